/// @file
/// A group of N local replicas and the collectives they run together.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distvals/buffer.hpp"
#include "distvals/device.hpp"
#include "distvals/dtype.hpp"
#include "distvals/export.hpp"
#include "distvals/schedule.hpp"

namespace distvals {

/// Settings of a group. Every field has a usable default.
struct group_options {
  /// Longest time any wait inside a collective may take before timeout_error.
  /// Default 300 s; the environment variable DISTVALS_TIMEOUT_SECONDS overrides it.
  std::chrono::milliseconds timeout{0};
  /// Worker threads that run the single-call style (caller included).
  /// 0: min(replicas, hardware threads).
  int threads = 0;
  /// Pipelining chunk of ring and tree, in bytes; 0: the default (256 KiB).
  std::size_t chunk_bytes = 0;
  /// How long a wait spins before it yields and then blocks, in microseconds.
  /// Negative: the default (20 µs, none when replicas outnumber hardware threads).
  int spin_us = -1;
  /// Optional hook that blocked waits call about every 50 ms (from whichever thread is
  /// waiting); returning true cancels the group, as cancel() does. Bindings use it to
  /// honour keyboard interrupts. Must not throw.
  std::function<bool()> interrupted;
};

/// One collective call: what every replica must agree on.
struct call_desc {
  collective kind = collective::all_reduce;
  dtype type = dtype::float32;
  reduce_op op = reduce_op::sum;
  algorithm algo = algorithm::automatic;
  std::size_t count = 0;  ///< elements of each replica's input
  int root = 0;           ///< reduce and broadcast only
  bool operator==(const call_desc& o) const noexcept {
    return kind == o.kind && type == o.type && op == o.op && algo == o.algo && count == o.count &&
           root == o.root;
  }
  bool operator!=(const call_desc& o) const noexcept { return !(*this == o); }
};

/// N replicas in one process that run collectives together.
///
/// Two call styles:
///  - single call: one thread passes all N buffers; the group runs the work on its
///    persistent worker threads (and the calling thread). Calls from several threads
///    are serialized.
///  - per replica: N threads, one per replica, each pass their own buffers; they meet,
///    check that they agree, and each executes its own part.
/// A group runs one collective at a time; do not mix the styles concurrently.
///
/// Every wait honours the timeout. A failure in one replica (timeout, abort) releases
/// the others, which throw too; the group then stays aborted until reset().
class DISTVALS_EXPORT group {
 public:
  /// A group of `replicas` CPU replicas ("CPU:0" .. "CPU:n-1").
  /// Throws invalid_argument_error when replicas < 1.
  explicit group(int replicas, group_options options = {});
  /// A group over the given devices (CPU only in this backend).
  /// Throws invalid_argument_error for duplicates, an empty list or a GPU device.
  explicit group(const std::vector<device>& devices, group_options options = {});
  /// Closes the group (see close()).
  ~group();
  group(const group&) = delete;
  group& operator=(const group&) = delete;

  /// Number of replicas. Any thread.
  int size() const noexcept;
  /// The replicas' devices. Any thread.
  const std::vector<device>& devices() const noexcept;
  /// The options in force (defaults resolved). Any thread.
  const group_options& options() const noexcept;

  // ----- single-call style: any one thread, all N buffers -------------------------

  /// Runs `desc` over all replicas: `in[r]` and `out[r]` are replica r's buffers.
  /// in-place when in[r] and out[r] are the same memory. Validates everything before
  /// touching data (throws invalid_argument_error, dtype_error); throws timeout_error,
  /// aborted_error or closed_error while running.
  void run(const call_desc& desc, const std::vector<buffer_view>& in,
           const std::vector<buffer_view>& out);

  /// All-reduce: every out[r] = op over all in[j]. Same throws as run().
  void all_reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                  reduce_op op, algorithm algo = algorithm::automatic);
  /// Reduce to `root`: out[root] = op over all in[j]; other outputs are not touched.
  void reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root,
              reduce_op op);
  /// Broadcast: every out[r] = in[root]; other inputs are not read.
  void broadcast(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root);
  /// All-gather: out[r] (N·count elements) = in[0] ++ in[1] ++ ... ++ in[N-1].
  void all_gather(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);
  /// Reduce-scatter: out[r] (count/N elements) = op over all in[j] of block r.
  void reduce_scatter(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                      reduce_op op);

  // ----- per-replica style: the thread of replica `replica` -----------------------

  /// Replica `replica`'s part of `desc`; blocks until the collective is complete for
  /// this replica. All replicas must call with equal `desc` or every one of them throws
  /// mismatch_error. `timeout` of zero means the group's timeout.
  void run(int replica, const call_desc& desc, buffer_view in, buffer_view out,
           std::chrono::milliseconds timeout = std::chrono::milliseconds{0});

  // ----- failure handling: any thread --------------------------------------------

  /// Aborts the collective in flight and every later one until reset(): every waiting
  /// replica throws aborted_error naming `replica` and `why`. Never throws.
  void abort(int replica, const std::string& why) noexcept;
  /// abort() from outside the replicas (replica -1), e.g. on a keyboard interrupt.
  void cancel() noexcept;
  /// True once aborted (or timed out) and not yet reset.
  bool aborted() const noexcept;
  /// Clears an abort so the group can run again. Call only when no collective is in
  /// flight; throws std::logic_error otherwise.
  void reset();
  /// Stops the workers and frees resources; later calls throw closed_error and
  /// waiters are released with closed_error. Idempotent; never throws.
  void close() noexcept;
  /// True once closed.
  bool closed() const noexcept;

  /// Opaque implementation (backends, synchronization state).
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

/// Checks `desc` against the buffers of one replica; throws invalid_argument_error or
/// dtype_error naming the replica and what is wrong. Used by both call styles.
DISTVALS_EXPORT void validate_replica_buffers(const call_desc& desc, int replicas, int replica,
                                              const buffer_view& in, const buffer_view& out);

}  // namespace distvals
