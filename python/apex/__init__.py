# SPDX-License-Identifier: MIT
"""apex, the APEX-1 attention math library, on numpy arrays.

Every function and class is apex's C++ call of the same name (include/apex/), computing on the
arrays given. See docs/guide.md, "apex from Python", for each call's C++ counterpart.
"""
from ._core import *  # noqa: F401,F403
from ._core import __version__  # noqa: F401
