// SPDX-License-Identifier: MIT
// What apex's distributed attention asks of MPI, in one place: the rank and size of a
// communicator, the bytes a call hands to MPI (Traffic), and the agreement that turns bad input
// on any rank into the same std::invalid_argument on every rank, before any data moves, so that
// no rank is left waiting in a collective that another rank has left.
//
// Optional: this header and the others of apex/distributed/ need MPI (the CMake target
// apex::mpi links MPI::MPI_CXX). The rest of apex never includes them.
//
// COLLECTIVE CALLS. Every function of apex/distributed/ documented as collective must be called
// by every rank of the communicator, in the same order, with arguments that agree where its
// documentation says so. Each first runs its local checks, then exchanges one small descriptor
// (MPI_Allgather of a few integers) that carries whether the checks passed and the values that
// must agree; only then does it touch its outputs or send data. MPI errors keep the
// communicator's error handler (by default MPI aborts the job).
#pragma once

#include <apex/config.hpp>
#include <apex/tensor.hpp>

// apex uses MPI's C API only; the deprecated C++ bindings of Open MPI and MPICH stay out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace apex::distributed {

/// The bytes one rank handed to MPI in a call: point-to-point messages (the ring's K/V) and its
/// contributions to collectives (sharded decoding's partial results). Counted from the buffers
/// passed to MPI, which is what the scaling model of docs/guide.md predicts; the agreement's
/// descriptors are not counted.
struct Traffic {
  std::int64_t bytes_sent = 0;        ///< bytes of the point-to-point messages this rank sent
  std::int64_t messages = 0;          ///< point-to-point messages this rank sent
  std::int64_t collective_bytes = 0;  ///< bytes of this rank's send buffers in collectives

  /// Adds another call's traffic.
  Traffic& operator+=(const Traffic& other) {
    bytes_sent += other.bytes_sent;
    messages += other.messages;
    collective_bytes += other.collective_bytes;
    return *this;
  }
};

/// A rank's place in a communicator.
struct RankInfo {
  int rank = 0;  ///< this process's rank, in [0, size)
  int size = 1;  ///< processes in the communicator
};

namespace detail {

/// Throws std::runtime_error naming `op` and MPI's message unless rc is MPI_SUCCESS (reached
/// only under an error handler that returns, MPI_ERRORS_RETURN).
inline void mpi_call(int rc, const char* op) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw std::runtime_error(std::string("[") + op +
                           "] MPI error: " + std::string(text, static_cast<std::size_t>(length)));
}

/// The rank and size of `comm`. Throws std::invalid_argument (on this rank alone: without MPI
/// there is no one to tell) when MPI is not initialised, already finalised, or comm is
/// MPI_COMM_NULL.
inline RankInfo rank_info(MPI_Comm comm, const char* op) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  APEX_CHECK(initialized != 0 && finalized == 0,
             "[" << op << "] MPI must be initialised (MPI_Init) and not yet finalised");
  APEX_CHECK(comm != MPI_COMM_NULL, "[" << op << "] comm is MPI_COMM_NULL");
  RankInfo info;
  mpi_call(MPI_Comm_rank(comm, &info.rank), op);
  mpi_call(MPI_Comm_size(comm, &info.size), op);
  return info;
}

/// One value that every rank must hold alike, with the name an error gives it.
struct Agreed {
  const char* name;
  std::int64_t value;
};

/// THE AGREEMENT (collective). Runs `check` on this rank, then exchanges with every rank
/// whether its check threw and the `agreed` values (a fixed list per call site). Then, on every
/// rank alike:
///   - if some rank's check threw std::invalid_argument, throws std::invalid_argument with the
///     message of the lowest such rank, followed by " (on rank r)";
///   - else if some value differs between ranks, throws std::invalid_argument naming the value,
///     rank 0's and the first differing rank's;
///   - else returns.
/// Another exception of `check` is rethrown on its rank alone after the exchange (as a failed
/// check everywhere else). Allocates the gathered descriptors: size · (agreed + 1) integers, and
/// the message.
template <class Check>
void agree(MPI_Comm comm, const RankInfo& me, const char* op, const std::vector<Agreed>& agreed,
           const Check& check) {
  std::string message;
  std::exception_ptr other;
  try {
    check();
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (...) {
    other = std::current_exception();
    message = std::string("[") + op + "] this rank failed with an error of its own";
  }
  const std::size_t width = agreed.size() + 1;
  std::vector<std::int64_t> mine(width);
  mine[0] = message.empty() ? 0 : 1;
  for (std::size_t i = 0; i < agreed.size(); ++i) mine[i + 1] = agreed[i].value;
  std::vector<std::int64_t> all(width * static_cast<std::size_t>(me.size));
  mpi_call(MPI_Allgather(mine.data(), static_cast<int>(width), MPI_INT64_T, all.data(),
                         static_cast<int>(width), MPI_INT64_T, comm),
           op);
  const auto at = [&](int rank, std::size_t i) {
    return all[static_cast<std::size_t>(rank) * width + i];
  };
  int failed = -1;
  for (int r = 0; r < me.size && failed < 0; ++r) {
    if (at(r, 0) != 0) failed = r;
  }
  if (failed >= 0) {
    int length = me.rank == failed ? static_cast<int>(message.size()) : 0;
    mpi_call(MPI_Bcast(&length, 1, MPI_INT, failed, comm), op);
    std::string text(static_cast<std::size_t>(length), ' ');
    if (me.rank == failed) text = message;
    mpi_call(MPI_Bcast(text.data(), length, MPI_CHAR, failed, comm), op);
    if (other) std::rethrow_exception(other);
    throw std::invalid_argument(text + " (on rank " + std::to_string(failed) + ")");
  }
  for (std::size_t i = 0; i < agreed.size(); ++i) {
    for (int r = 1; r < me.size; ++r) {
      APEX_CHECK(at(r, i + 1) == at(0, i + 1), "[" << op << "] " << agreed[i].name
                                                   << " must be the same on every rank: rank 0 has "
                                                   << at(0, i + 1) << ", rank " << r << " has "
                                                   << at(r, i + 1));
    }
  }
}

}  // namespace detail

/// The rank and size of `comm` (checks as every collective of apex does).
inline RankInfo rank_info(MPI_Comm comm) { return detail::rank_info(comm, "rank_info"); }

/// Copies a [B, H, S, D] view of rank `root` into the views of every other rank (collective;
/// MPI_Bcast of each head's rows): how a decoding step gives every rank the queries one rank
/// computed. Every rank passes a view of the same shape and element type (agreed); views of
/// any layout that apex writes (detail::check_output_view) are allowed. Allocates one contiguous
/// staging copy of the view's elements. Returns the bytes this rank handed to MPI
/// (collective_bytes).
template <class T>
Traffic broadcast(MPI_Comm comm, const HeadsView<T>& view, int root) {
  constexpr const char* op = "broadcast";
  const RankInfo me = detail::rank_info(comm, op);
  const HeadsShape s = view.shape();
  std::int64_t bytes = 0;  // of the view's elements: one MPI message, so at most INT_MAX
  detail::agree(comm, me, op,
                {{"root", root},
                 {"batch", s.batch},
                 {"heads", s.heads},
                 {"seq", s.seq},
                 {"dim", s.dim},
                 {"element size", static_cast<std::int64_t>(sizeof(T))}},
                [&] {
                  APEX_CHECK(root >= 0 && root < me.size, "[" << op << "] root (" << root
                                                              << ") must lie in [0, " << me.size
                                                              << ")");
                  apex::detail::check_extents(view, op, "view shape");
                  apex::detail::check_output_view(view, op, "view");
                  bytes = apex::detail::checked_product(
                      {s.batch, s.heads, s.seq, s.dim, static_cast<std::int64_t>(sizeof(T))}, op,
                      "view bytes B*H*S*D*sizeof(T)");
                  APEX_CHECK(bytes <= std::numeric_limits<int>::max(),
                             "[" << op << "] the view's " << bytes
                                 << " bytes exceed one MPI message (2^31 - 1 bytes)");
                });
  Traffic traffic;
  if (s.has_no_elements()) return traffic;
  HeadsTensor<T> staging(s);
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) staging.view().head(b, h) = view.head(b, h);
  }
  detail::mpi_call(MPI_Bcast(staging.data(), static_cast<int>(bytes), MPI_BYTE, root, comm), op);
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) view.head(b, h) = staging.view().head(b, h);
  }
  traffic.collective_bytes = bytes;
  return traffic;
}

}  // namespace apex::distributed
