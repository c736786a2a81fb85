// SPDX-License-Identifier: MIT
// The main of the MPI tests: each rank runs every test (the tests are collective), rank 0
// prints GoogleTest's report, every other rank prints only its failures (prefixed with its
// rank), and the program fails when any rank's tests failed. Run it as `mpiexec -n P mpi_test`
// (tests/mpi/CMakeLists.txt registers P = 1, 2, 3, 4).
#include <apex/distributed/communicator.hpp>

#include <gtest/gtest.h>

#include <cstdio>

namespace {

/// Prints each failed assertion of this rank, with its rank.
class RankFailures : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailures(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailures(rank));
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any != 0 && failed == 0) std::fprintf(stderr, "a test failed on another rank\n");
  MPI_Finalize();
  return any;
}
