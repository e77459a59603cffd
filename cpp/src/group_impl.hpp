// The state behind distvals::group, whatever the replicas run on: configuration, the
// per-replica meeting, the gate between the call styles, failure state, blocking waits
// and the schedule cache. An executor (executor.hpp) runs the steps. Not installed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu/relax.hpp"
#include "distvals/error.hpp"
#include "distvals/group.hpp"
#include "executor.hpp"
#include "timeout.hpp"

namespace distvals::detail {
/// How many fork()s lie between this process and the one that loaded the engine: 0
/// there, +1 in each child (counted by a pthread_atfork handler).
std::uint64_t fork_generation() noexcept;
}  // namespace distvals::detail

namespace distvals {

using detail::clock_type;

/// True when a replica's `progress` (see group::impl::replica_state) has reached
/// `target`. Compared as serial numbers, not as plain integers: seq << 32 wraps around
/// 2^64 at call 2^32, where a plain >= would take the previous call's progress for this
/// one's (no wait, stale data). Every two values compared lie within a few calls of each
/// other (a replica is at most one call ahead; reset() and fork restart both at 0), far
/// below 2^63, so the sign of their difference orders them.
inline bool reached(std::uint64_t progress, std::uint64_t target) noexcept {
  return static_cast<std::int64_t>(progress - target) >= 0;
}

// Hidden: the implementation is not part of the library's ABI, even though `group` is exported.
struct __attribute__((visibility("hidden"))) group::impl {
  // ---- configuration -----------------------------------------------------------
  int n = 0;
  std::vector<device> devices;
  group_options opts;
  int spin_us = 20;  // spin before yield/block
  static constexpr int max_spin_us = 10000;
  // Extra time idle CPU workers keep spinning for the next collective (µs), set by a
  // caller about to issue several collectives back to back (see group::set_linger_us).
  std::atomic<int> linger_us{0};
  // Batches of collectives open now (see group::batch): while any is, workers linger at
  // least group::batch_linger_us.
  std::atomic<int> open_batches{0};

  // ---- per-replica state -------------------------------------------------------
  // progress = (seq << 32) | steps completed in call `seq`. A replica sets it to
  // seq << 32 when it arrives at call seq, then bumps it after every step. Values only
  // grow, so "replica j completed step k of call seq" is reached(progress, (seq<<32) + k + 1).
  // (seq << 32 wraps around at call 2^32; see reached().)
  struct alignas(64) replica_state {
    std::atomic<std::uint64_t> progress{0};
    // True while a thread executes a step of this replica's program. A replica that
    // leaves a failed collective first waits for every flag to drop (drain()), so no
    // step still reads or writes its buffers once its caller has the error.
    std::atomic<bool> busy{false};
    // True while a thread is in a per-replica call as this replica: a second thread
    // passing the same index is refused at once (it would post over the first one's
    // arguments, and both would wait for a replica that never comes).
    std::atomic<bool> caller{false};
    // Last call number; written by the replica's own caller, or by a single call (which
    // runs only while no per-replica caller is inside the gate). Atomic because a caller
    // waiting at the gate reads it to tell whether it joins a started collective.
    std::atomic<std::uint64_t> seq{0};
    // Posted arguments of call seq live in slot seq & 1: a replica can be at most one
    // call ahead of another, so the slot others may still read is never overwritten.
    call_desc desc[2];
    buffer_view in[2], out[2];
    std::string error[2];                 // non-empty: this replica's own arguments were invalid
    bool type_error[2] = {false, false};  // ... and the error is about a dtype
    std::vector<std::int64_t> shape[2];   // the logical shape of the input ({count} if none given)
    detail::stream_ref wait_for[2];       // GPU: a stream whose queued work must come first
    bool has_wait_for[2] = {false, false};
  };
  std::unique_ptr<replica_state[]> reps;
  // What replica 0 got when it ran a whole per-replica call for all (executors that do
  // not run parts): the others rethrow it. Slot seq & 1, like the posted arguments.
  std::exception_ptr leader_error[2];

  // ---- the gate between the two call styles ------------------------------------
  // A group runs one collective at a time. gate = (round & 0xffffffff) << 32 |
  // single_active | single_waiting | number of per-replica callers inside. A single call
  // enters when no per-replica caller is inside; while it waits, per-replica callers may
  // still join the collective already started (the same round) but not start a new one,
  // so the single call gets in between two per-replica collectives.
  static constexpr std::uint64_t gate_count = (std::uint64_t{1} << 30) - 1;
  static constexpr std::uint64_t gate_waiting = std::uint64_t{1} << 30;
  static constexpr std::uint64_t gate_active = std::uint64_t{1} << 31;
  std::atomic<std::uint64_t> gate{0};
  std::mutex call_mu;  // serializes single-call callers

  // ---- failure state -----------------------------------------------------------
  enum : int { ok = 0, aborted = 1, timed_out = 2, closed = 3 };
  std::atomic<int> state{ok};
  std::mutex state_mu;
  std::string state_msg;
  int state_replica = -1;
  std::atomic<int> inside{0};  // calls in flight
  std::atomic<bool> close_started{false};

  // ---- blocking waits: one condition variable for the whole group ---------------
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> sleepers{0};

  // ---- schedules, cached by shape ----------------------------------------------
  std::mutex cache_mu;
  std::vector<std::pair<schedule_key, std::shared_ptr<const schedule>>> cache;

  // ---- how the steps run --------------------------------------------------------
  std::unique_ptr<detail::executor> exec;

  // ---- fork (fork.cpp) ------------------------------------------------------------
  // The process generation (detail::fork_generation) this state was made or renewed in.
  std::atomic<std::uint64_t> fork_gen{0};
  /// Every entry point calls this first: in a child process after fork(), the first
  /// caller renews the state (renew_after_fork) while any other waits for it.
  void check_fork() noexcept {
    if (fork_gen.load(std::memory_order_relaxed) != detail::fork_generation()) renew_after_fork();
  }
  void renew_after_fork() noexcept;

  /// Resolves the options (timeout, spin) and sizes the replica state; the caller then
  /// installs an executor.
  impl(std::vector<device> devices, group_options options);

  // ---- methods (failure.cpp) ------------------------------------------------------
  /// Wakes every blocked waiter.
  void wake_all() noexcept;
  /// Publishes that `replica` completed `steps` steps of call `seq` and wakes sleepers.
  void publish(int replica, std::uint64_t seq, std::uint64_t steps) noexcept;
  /// Throws the exception that matches a failure state; no-op when ok. For waits inside
  /// a collective: timeout_error, aborted_error or closed_error.
  void throw_if_failed(int me) const;
  /// For a call that is about to start: group_aborted_error naming the earlier failure
  /// and reset() when aborted or timed out, closed_error when closed.
  void throw_if_failed_at_start(int me) const;
  /// Records a failure (first one wins) and wakes everybody. Never throws.
  void fail(int kind, int replica, const std::string& msg) noexcept;
  /// Waits until no thread executes a step (every replica's `busy` is false). Once the
  /// group has failed no new step starts, so this returns after at most one step.
  void drain() const noexcept;
  /// Waits until ready() holds, spinning then yielding then blocking. Throws on
  /// failure, or at the deadline timeout_error with describe()'s message, after failing
  /// the group with it when `fail_group`.
  template <class Ready, class Describe>
  void wait(const Ready& ready, clock_type::time_point deadline, int me, const Describe& describe,
            bool fail_group = true);

  // ---- the gate (gate.cpp) ----------------------------------------------------------
  /// Enters the gate as a single call (the caller holds call_mu); throws timeout_error
  /// at the deadline (without failing the group), or on failure.
  void enter_single(clock_type::time_point deadline, std::chrono::nanoseconds timeout, const call_desc& desc);
  /// Leaves the gate as a single call and wakes the waiters. Never throws.
  void leave_single() noexcept;
  /// Enters the gate as replica `me`, whose next call number tells whether it joins a
  /// collective that others have started.
  void enter_replica(int me, clock_type::time_point deadline, std::chrono::nanoseconds timeout);
  /// Leaves the gate as a per-replica caller. Never throws.
  void leave_replica() noexcept;

  // ---- the calls (group.cpp, meeting.cpp) -----------------------------------------------
  /// Checks one replica's buffers: the backend-neutral checks, then where the memory
  /// lives (the executor). Throws invalid_argument_error or dtype_error.
  void check_replica(const call_desc& desc, int replica, const buffer_view& in, const buffer_view& out) const;
  /// `automatic` resolved: the executor's choice for all_reduce, `direct` otherwise.
  algorithm resolve_algorithm(const call_desc& d) const noexcept;
  /// The per-replica style after `replica` has posted call `seq` and arrived: waits for
  /// the others, checks that every replica posted the same call, runs it and waits until
  /// nobody uses its buffers.
  void run_arrived(int replica, std::uint64_t seq, const call_desc& desc, std::chrono::nanoseconds timeout,
                   clock_type::time_point deadline);
  /// The single-call style with every argument checked: posts, runs, and leaves.
  void run_single(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                  const detail::stream_ref* caller, const std::vector<detail::stream_ref>& wait_for);
  /// The per-replica style (group::run and its GPU variant).
  void run_replica(int replica, const call_desc& desc, const buffer_view& in, const buffer_view& out,
                   const replica_options& options, const detail::stream_ref* wait_for);
  /// The cached schedule for `key`.
  std::shared_ptr<const schedule> get_schedule(const schedule_key& key);
};

template <class Ready, class Describe>
void group::impl::wait(const Ready& ready, clock_type::time_point deadline, int me, const Describe& describe,
                       bool fail_group) {
  // Phase 1: spin. Cheapest when the awaited replica runs on another core right now.
  if (spin_us > 0) {
    const auto spin_end = clock_type::now() + std::chrono::microseconds(spin_us);
    for (unsigned i = 1;; ++i) {
      if (ready()) return;
      if ((i & 63u) == 0) {
        throw_if_failed(me);
        if (clock_type::now() > spin_end) break;
      }
      cpu::relax();
    }
  }
  // Phase 2: yield a few times, so an awaited thread sharing our core can run.
  for (int i = 0; i < 16; ++i) {
    if (ready()) return;
    throw_if_failed(me);
    std::this_thread::yield();
  }
  // Phase 3: block on the group's condition variable. publish() notifies when it sees
  // sleepers; both sides use sequentially consistent atomics, so either the publisher
  // sees our sleeper count or we see its progress. Bounded waits re-check the deadline
  // and the failure state and call the interrupt hook.
  sleepers.fetch_add(1);
  struct leave {
    std::atomic<int>& s;
    ~leave() { s.fetch_sub(1); }
  } on_exit{sleepers};
  std::unique_lock<std::mutex> lk(mu);
  while (!ready()) {
    throw_if_failed(me);
    const auto now = clock_type::now();
    if (now >= deadline) {
      lk.unlock();
      const std::string msg = describe();
      if (fail_group) fail(timed_out, me, msg);
      throw timeout_error(msg);
    }
    const auto slice = std::chrono::milliseconds(50);
    if (cv.wait_until(lk, (deadline - now) < slice ? deadline : now + slice) == std::cv_status::timeout &&
        opts.interrupted && !ready()) {
      lk.unlock();
      if (opts.interrupted()) fail(aborted, -1, "interrupted");
      lk.lock();
    }
  }
}

}  // namespace distvals
