#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the Debian package (cpack -G DEB), unpacks it with dpkg-deb -x into a scratch root
# (no installation on this machine), and consumes it the ways a user of the package would,
# running examples/00_quickstart.cpp each time:
#   1. pkg-config, with PKG_CONFIG_SYSROOT_DIR and PKG_CONFIG_LIBDIR pointing into the root,
#   2. CMake's find_package(apex) with CMAKE_PREFIX_PATH pointing into the root.
# The root stands for a system with the package's dependency installed: Eigen is linked into
# it from this machine (its headers and eigen3.pc), as libeigen3-dev would put it there.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for tool in cpack dpkg-deb pkg-config; do
  command -v "$tool" >/dev/null || { echo "check_deb: $tool not found" >&2; exit 1; }
done
version=$(sed -n 's/^#define APEX_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' \
  "$src/include/apex/config.hpp" | paste -sd.)

echo "== cpack -G DEB"
# The Python module is off: CPack would build it only to leave it out (its install component is
# EXCLUDE_FROM_ALL, python/CMakeLists.txt), which costs minutes of compiling.
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DAPEX_BUILD_TESTS=OFF \
  -DAPEX_BUILD_EXAMPLES=OFF -DAPEX_BUILD_BENCHMARKS=OFF -DAPEX_BUILD_PYTHON=OFF \
  -DAPEX_INSTALL=ON >/dev/null
(cd "$work/build" && cpack -G DEB >/dev/null)
deb="$work/build/libapex-dev_${version}_all.deb"
test -f "$deb" || { echo "check_deb: $deb was not built" >&2; ls "$work/build" >&2; exit 1; }
field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = libapex-dev ] || { echo "check_deb: Package is $(field Package)" >&2; exit 1; }
[ "$(field Version)" = "$version" ] || { echo "check_deb: Version is $(field Version)" >&2; exit 1; }
[ "$(field Architecture)" = all ] || { echo "check_deb: Architecture is $(field Architecture)" >&2; exit 1; }
field Depends | grep -q '^libeigen3-dev' || { echo "check_deb: Depends is $(field Depends)" >&2; exit 1; }
echo "$(basename "$deb"): Architecture $(field Architecture), Depends $(field Depends)"

root="$work/root"
dpkg-deb -x "$deb" "$root"
for file in usr/include/apex/apex.hpp usr/include/apex/detail/flash_attention.hpp \
  usr/share/cmake/apex/apexConfig.cmake usr/share/cmake/apex/apexConfigVersion.cmake \
  usr/share/cmake/apex/apexTargets.cmake usr/share/pkgconfig/apex.pc; do
  test -f "$root/$file" || { echo "check_deb: the package lacks /$file" >&2; exit 1; }
done
# Nothing architecture-specific may be in an "all" package.
if find "$root" -type f \( -name '*.so*' -o -name '*.a' -o -perm -u+x \) | grep -q .; then
  echo "check_deb: the package holds binaries or executables" >&2
  exit 1
fi
# The dependency, as libeigen3-dev would have installed it in this root.
eigen_pc=$(pkg-config --variable=pcfiledir eigen3)/eigen3.pc
eigen_include=$(pkg-config --variable=prefix eigen3)/include/eigen3
mkdir -p "$root/usr/include"
cp "$eigen_pc" "$root/usr/share/pkgconfig/"
ln -s "$eigen_include" "$root/usr/include/eigen3"

echo "== pkg-config"
export PKG_CONFIG_SYSROOT_DIR="$root"
export PKG_CONFIG_LIBDIR="$root/usr/share/pkgconfig"
export PKG_CONFIG_PATH=""
[ "$(pkg-config --modversion apex)" = "$version" ]
cflags=$(pkg-config --cflags apex)
echo "pkg-config --cflags apex: $cflags"
case "$cflags" in
  *"-I$root/usr/include"*) ;;
  *) echo "check_deb: apex's include directory is not in the root" >&2; exit 1 ;;
esac
# shellcheck disable=SC2086  # cflags is a list of flags
g++ -std=c++17 -O1 $cflags "$src/examples/00_quickstart.cpp" -o "$work/quickstart_pc"
"$work/quickstart_pc" >/dev/null
unset PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_LIBDIR PKG_CONFIG_PATH

echo "== find_package"
cmake -S "$src/tests/package/find_package" -B "$work/found" -DAPEX_SOURCE_DIR="$src" \
  -DCMAKE_PREFIX_PATH="$root/usr" >/dev/null
grep -q "apex_DIR:PATH=$root/usr/share/cmake/apex" "$work/found/CMakeCache.txt" ||
  { echo "check_deb: find_package did not find the unpacked package" >&2; exit 1; }
cmake --build "$work/found" -j2 >/dev/null
"$work/found/consumer" >/dev/null
echo "deb package checks passed"
