// SPDX-License-Identifier: MIT
// A consumer of apex::mpi: ring attention of a short causal sequence on every rank of
// MPI_COMM_WORLD, checked against sdpa over the whole sequence. Exits non-zero on a mismatch.
#include <apex/apex.hpp>
#include <apex/distributed/ring_attention.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  namespace dist = apex::distributed;
  const dist::RankInfo me = dist::rank_info(MPI_COMM_WORLD);
  apex::HeadsTensor<float> q({1, 2, 40, 8}), k({1, 1, 40, 8}), v({1, 1, 40, 8});
  for (apex::Index i = 0; i < 2 * 40 * 8; ++i) q.data()[i] = float(i % 7) * 0.1f;
  for (apex::Index i = 0; i < 40 * 8; ++i) k.data()[i] = float(i % 5) * 0.2f;
  for (apex::Index i = 0; i < 40 * 8; ++i) v.data()[i] = float(i % 11) * 0.3f;
  apex::PositionMask causal;
  causal.causal = true;
  const dist::SequenceSharding sharding(40, me.size, dist::ShardLayout::kZigzag);
  const auto q_r = dist::shard_rows(q.view(), sharding, me.rank);
  const auto k_r = dist::shard_rows(k.view(), sharding, me.rank);
  const auto v_r = dist::shard_rows(v.view(), sharding, me.rank);
  apex::HeadsTensor<float> out({1, 2, q_r.seq(), 8}), whole({1, 2, 40, 8});
  dist::ring_attention(MPI_COMM_WORLD, sharding, q_r.view(), k_r.view(), v_r.view(), causal, {},
                       out.view());
  apex::sdpa(q.view(), k.view(), v.view(), apex::AttentionMask<float>{causal, {}, {}}, {},
             whole.view());
  const auto want = dist::shard_rows(whole.view(), sharding, me.rank);
  float worst = 0.0f;
  for (apex::Index h = 0; h < 2; ++h) {
    worst = std::max(worst, (out.head(0, h) - want.head(0, h)).cwiseAbs().maxCoeff());
  }
  const bool ok = worst < 1e-5f;
  if (me.rank == 0)
    std::printf("apex::mpi consumer on %d ranks: %s\n", me.size, ok ? "ok" : "MISMATCH");
  MPI_Finalize();
  return ok ? 0 : 1;
}
