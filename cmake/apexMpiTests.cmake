# SPDX-License-Identifier: MIT
# apex_add_mpi_test(<name> <ranks> <program> [args...]): a ctest test that runs the program on
# <ranks> processes through MPI's launcher, with a timeout so that a rank left waiting fails the
# test instead of hanging CI. The launcher's flags: MPIEXEC_NUMPROC_FLAG from FindMPI, then
# APEX_MPIEXEC_FLAGS (for Open MPI, --oversubscribe: the tests run more ranks than a small
# machine has cores). The environment lets Open MPI run as root (CI containers), yields idle
# ranks' cores to busy ones, and gives each rank one OpenMP thread, since oversubscribed ranks
# that spin in their thread teams slow each other down a hundredfold. LeakSanitizer is off for
# these programs alone (the debug preset): the MPI library keeps allocations until exit by
# design; AddressSanitizer and UndefinedBehaviorSanitizer stay on.
if(NOT DEFINED APEX_MPIEXEC_FLAGS)
  execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version OUTPUT_VARIABLE _apex_mpiexec_version
                  ERROR_QUIET TIMEOUT 30)
  if(_apex_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(_apex_mpiexec_flags --oversubscribe)
  else()
    set(_apex_mpiexec_flags "")
  endif()
  set(APEX_MPIEXEC_FLAGS "${_apex_mpiexec_flags}" CACHE STRING
      "Flags of MPI's launcher for apex's MPI tests (after the rank count)")
endif()
set(APEX_MPI_TEST_TIMEOUT 300 CACHE STRING "Seconds before an MPI test of apex is stopped")

function(apex_add_mpi_test name ranks program)
  add_test(NAME ${name}
           COMMAND "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${APEX_MPIEXEC_FLAGS}
                   ${MPIEXEC_PREFLAGS} "${program}" ${MPIEXEC_POSTFLAGS} ${ARGN})
  set_tests_properties(${name} PROPERTIES
    TIMEOUT ${APEX_MPI_TEST_TIMEOUT}
    PROCESSORS ${ranks}
    ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0;OMP_NUM_THREADS=1;OMPI_MCA_mpi_yield_when_idle=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endfunction()
