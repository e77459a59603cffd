// How the steps of a collective run: the one thing that differs between CPU and GPU
// replicas. The group (group_impl.hpp) owns everything else: argument checks, the
// meeting of per-replica callers, timeouts, failure state and the schedule cache.
// Not installed.
#pragma once

#include <chrono>
#include <cstdint>

#include "distvals/group.hpp"
#include "timeout.hpp"

namespace distvals::detail {

/// A stream named by a caller (a cudaStream_t and its device, -1: ask the runtime).
struct stream_ref {
  void* handle = nullptr;
  int device = -1;
};

/// One collective as the group hands it to an executor: checked, agreed on, with every
/// replica's buffers posted in the group's slot `seq & 1` (group::impl::replica_state).
struct call {
  call_desc desc;                         ///< algorithm resolved
  std::uint64_t seq = 0;                  ///< the call number
  clock_type::time_point deadline;        ///< of every host wait of this call
  std::chrono::nanoseconds timeout{0};    ///< for messages
  int me = -1;                            ///< the replica whose thread runs it; -1: a single call
  const stream_ref* caller = nullptr;     ///< GPU: enqueue on this stream and return at once
  const stream_ref* wait_for = nullptr;   ///< GPU: streams whose queued work comes first
  int nwait = 0;
};

class executor {
 public:
  virtual ~executor() = default;
  /// Throws invalid_argument_error unless `b` (replica r's input or output, `what`) is
  /// memory this backend can use for replica r: host memory for CPU replicas, device
  /// memory of the replica's GPU, aligned to its elements, for GPU replicas. Called only
  /// for buffers the collective touches, with at least one element.
  virtual void check_buffer(int replica, const buffer_view& b, const char* what) const = 0;
  /// The all-reduce algorithm `automatic` stands for. Never throws.
  virtual algorithm choose_algorithm(const call_desc& d) const noexcept = 0;
  /// True when, in the per-replica style, every replica runs its own part (run_part);
  /// false when replica 0 runs the whole call for all (run) and the others wait.
  virtual bool runs_parts() const noexcept = 0;
  /// Runs a whole call: the single-call style, or replica 0 of a per-replica call when
  /// !runs_parts(). Returns when every output is complete (or, with c.caller, when it is
  /// enqueued). Throws timeout_error, aborted_error, closed_error, cuda_error.
  virtual void run(const call& c) = 0;
  /// Replica `replica`'s part of a per-replica call (runs_parts() only); returns once
  /// no step of any replica can still touch this replica's buffers.
  virtual void run_part(int replica, const call& c) = 0;
  /// Stops threads and frees resources; called once, when nobody is inside the group.
  virtual void close() noexcept = 0;
  /// In a child process after fork(), before the group's first use there: the parent's
  /// threads are gone, and locks they held stay taken. Makes the executor usable again
  /// (new locks, new threads). Only the renewing thread is inside the group.
  virtual void after_fork() noexcept {}
};

}  // namespace distvals::detail
