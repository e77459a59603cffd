// The state behind distvals::cuda::group, shared by group.cpp (construction, checks,
// public calls) and executor.cpp (enqueueing schedules). Not installed.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/wait.hpp"
#include "distvals/cuda/device_buffer.hpp"
#include "distvals/cuda/group.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/error.hpp"
#include "distvals/schedule.hpp"

namespace distvals::cuda {

/// A schedule plus what the executor needs to know about it beforehand.
struct prepared_schedule {
  schedule sched;
  /// needed[r][i]: some step of another replica waits for step i of replica r, so an
  /// event must be recorded after it.
  std::vector<std::vector<char>> needed;
};

struct group::impl {
  // ---- configuration -----------------------------------------------------------
  int n = 0;
  std::vector<device> devices;      // logical names
  std::vector<int> gpus;            // CUDA device of each replica
  std::vector<int> distinct_gpus;   // each CUDA device of the group once
  group_options opts;
  std::vector<std::vector<char>> peer;  // peer[a][b]: device a reaches device b's memory (by ordinal)

  // ---- per-replica resources -----------------------------------------------------
  struct replica_res {
    std::unique_ptr<stream> s;
    std::unique_ptr<event> end;         // recorded after the replica's last step
    std::vector<std::unique_ptr<event>> step_events;  // [i]: recorded after step i, when needed
    device_buffer scratch;              // staging where peer access is missing
    int max_blocks = 0;
  };
  std::vector<replica_res> reps;
  std::vector<std::unique_ptr<event>> fork_events;  // by CUDA ordinal, created on first use

  // ---- state -----------------------------------------------------------------------
  enum : int { ok = 0, aborted = 1, timed_out = 2, closed = 3 };
  std::atomic<int> state{ok};
  std::mutex state_mu;
  std::string state_msg;
  int state_replica = -1;
  std::atomic<int> inside{0};
  std::mutex call_mu;  // one collective at a time
  // How the previous call ended, to order the next one after it (under call_mu):
  // drained: every replica's work of earlier calls is known complete on the host;
  // otherwise, when the previous call joined into the same caller stream as this one,
  // the fork from that stream already orders after it.
  bool drained = true;
  bool last_has_caller = false;
  CUstream_st* last_caller = nullptr;
  int last_caller_device = -1;

  std::mutex cache_mu;
  std::vector<std::pair<schedule_key, std::shared_ptr<const prepared_schedule>>> cache;

  // ---- methods -----------------------------------------------------------------------
  /// True when replica a's kernels reach replica b's memory directly.
  bool reach(int a, int b) const noexcept { return peer[gpus[a]][gpus[b]] != 0; }
  /// Records a failure (first wins). Never throws.
  void fail(int kind, int replica, const std::string& msg) noexcept;
  /// Throws the exception matching a failure state; no-op when ok.
  void throw_if_failed() const;
  /// The cached prepared schedule for `key`.
  std::shared_ptr<const prepared_schedule> get_schedule(const schedule_key& key);
  /// Checks every argument of a call; throws before anything is enqueued.
  void validate(call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) const;
  /// Enqueues the whole call. `caller` null: fork from the legacy default streams and
  /// wait on the host; otherwise fork from and join into *caller.
  void execute(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
               const stream_view* caller);
  /// The fork event of CUDA device `gpu`.
  event& fork_event(int gpu);
  /// Bytes of scratch replica r needs for step `st` (0 with peer access everywhere).
  std::size_t scratch_bytes(int r, const step& st, reduce_op op, std::size_t esize) const noexcept;
  /// Enqueues one step of replica r on its stream (the current device is r's).
  void exec_step(int r, const step& st, const call_desc& desc, const std::vector<buffer_view>& in,
                 const std::vector<buffer_view>& out);
};

}  // namespace distvals::cuda
