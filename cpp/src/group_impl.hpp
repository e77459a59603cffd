// The state behind distvals::group, shared by group.cpp (calls, validation, workers)
// and executor.cpp (running programs, waiting). Not installed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu/relax.hpp"
#include "distvals/error.hpp"
#include "distvals/group.hpp"
#include "timeout.hpp"

namespace distvals {

using detail::clock_type;

// Hidden: the implementation is not part of the library's ABI, even though `group` is exported.
struct __attribute__((visibility("hidden"))) group::impl {
  // ---- configuration -----------------------------------------------------------
  int n = 0;
  std::vector<device> devices;
  group_options opts;
  int threads = 1;          // threads of the single-call style, caller included
  int spin_us = 20;         // spin before yield/block

  // ---- per-replica state -------------------------------------------------------
  // progress = (seq << 32) | steps completed in call `seq`. A replica sets it to
  // seq << 32 when it arrives at call seq, then bumps it after every step. Values only
  // grow, so "replica j completed step k of call seq" is progress >= (seq<<32) + k + 1.
  struct alignas(64) replica_state {
    std::atomic<std::uint64_t> progress{0};
    // True while a thread executes a step of this replica's program. A replica that
    // leaves a failed collective first waits for every flag to drop (drain()), so no
    // step still reads or writes its buffers once its caller has the error.
    std::atomic<bool> busy{false};
    // Last call number; written by the replica's own caller, or by a single call (which
    // runs only while no per-replica caller is inside the gate). Atomic because a caller
    // waiting at the gate reads it to tell whether it joins a started collective.
    std::atomic<std::uint64_t> seq{0};
    // Posted arguments of call seq live in slot seq & 1: a replica can be at most one
    // call ahead of another, so the slot others may still read is never overwritten.
    call_desc desc[2];
    buffer_view in[2], out[2];
    std::string error[2];  // non-empty: this replica's own arguments were invalid
    bool type_error[2] = {false, false};  // ... and the error is about a dtype
    std::vector<std::int64_t> shape[2];   // the logical shape of the input ({count} if none given)
  };
  std::unique_ptr<replica_state[]> reps;

  // ---- failure state -----------------------------------------------------------
  enum : int { ok = 0, aborted = 1, timed_out = 2, closed = 3 };
  std::atomic<int> state{ok};
  std::mutex state_mu;
  std::string state_msg;
  int state_replica = -1;
  std::atomic<int> inside{0};  // calls in flight

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

  // ---- blocking waits: one condition variable for the whole group ---------------
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> sleepers{0};

  // ---- schedules, cached by shape ----------------------------------------------
  std::mutex cache_mu;
  std::vector<std::pair<schedule_key, std::shared_ptr<const schedule>>> cache;

  // ---- workers of the single-call style -----------------------------------------
  struct alignas(64) worker_slot {
    std::atomic<std::uint64_t> go{0};  // the job number this worker should run
    // The job number whose share has been taken, by the worker itself or by the caller.
    // Whoever moves it to the job number first runs the share; the other leaves it alone.
    std::atomic<std::uint64_t> taken{0};
    std::thread thread;
  };
  std::unique_ptr<worker_slot[]> workers;  // threads - 1 of them
  std::mutex call_mu;                       // serializes single-call callers
  const schedule* job_sched = nullptr;
  std::uint64_t job_seq = 0;
  int job_threads = 1;
  clock_type::time_point job_deadline;
  std::atomic<int> job_done{0};
  std::mutex job_error_mu;
  std::exception_ptr job_error;
  std::atomic<bool> stopping{false};       // workers exit when they see it
  std::atomic<bool> close_started{false};  // makes close() idempotent

  // ---- methods (executor.cpp) ----------------------------------------------------
  /// Publishes that `replica` completed `steps` steps of call `seq` and wakes sleepers.
  void publish(int replica, std::uint64_t seq, std::uint64_t steps) noexcept;
  /// Wakes every blocked waiter.
  void wake_all() noexcept;
  /// Throws the exception that matches a failure state; no-op when ok.
  void throw_if_failed(int me) const;
  /// Records a failure (first one wins) and wakes everybody. Never throws.
  void fail(int kind, int replica, const std::string& msg) noexcept;
  /// Waits until ready() holds, spinning then yielding then blocking. Throws on
  /// failure, or at the deadline timeout_error with describe()'s message, after failing
  /// the group with it when `fail_group`.
  template <class Ready, class Describe>
  void wait(const Ready& ready, clock_type::time_point deadline, int me, const Describe& describe,
            bool fail_group = true);
  /// Enters the gate as a single call (the caller holds call_mu); throws timeout_error
  /// at the deadline (without failing the group), or on failure. (group.cpp)
  void enter_single(clock_type::time_point deadline, std::chrono::nanoseconds timeout, const call_desc& desc);
  /// Leaves the gate as a single call and wakes the waiters. Never throws.
  void leave_single() noexcept;
  /// Enters the gate as replica `me`, whose next call number tells whether it joins a
  /// collective that others have started. (group.cpp)
  void enter_replica(int me, clock_type::time_point deadline, std::chrono::nanoseconds timeout);
  /// Leaves the gate as a per-replica caller. Never throws.
  void leave_replica() noexcept;
  /// Runs the programs of replicas `owned` of schedule `s` for call `seq`.
  void run_programs(const schedule& s, std::uint64_t seq, const int* owned, int nowned,
                    clock_type::time_point deadline, int me);
  /// Runs thread `thread`'s share of a single-call job split over `threads` threads:
  /// the programs of replicas thread, thread + threads, thread + 2*threads, ...
  void run_share(const schedule& s, std::uint64_t seq, int thread, int threads,
                 clock_type::time_point deadline);
  /// Claims worker `index`'s share of job `seq` (see worker_slot::taken); true when the
  /// caller won and must run the share itself.
  static bool take(worker_slot& w, std::uint64_t seq) noexcept;
  /// Executes one step of call `seq` (reads posted buffers of slot seq & 1).
  void exec_step(const step& st, std::uint64_t seq) noexcept;
  /// Waits until no thread executes a step (every replica's `busy` is false). Once the
  /// group has failed no new step starts, so this returns after at most one step.
  void drain() const noexcept;
  /// The per-replica style after `replica` has posted call `seq` and arrived: waits for
  /// the others, checks that every replica posted the same call, runs its program and
  /// waits until nobody uses its buffers (group.cpp).
  void run_arrived(int replica, std::uint64_t seq, const call_desc& desc,
                   std::chrono::nanoseconds timeout, clock_type::time_point deadline);
  /// The cached schedule for `key`.
  std::shared_ptr<const schedule> get_schedule(const schedule_key& key);
  /// Main loop of worker `index` (thread index + 1).
  void worker_main(int index) noexcept;
};

template <class Ready, class Describe>
void group::impl::wait(const Ready& ready, clock_type::time_point deadline, int me,
                       const Describe& describe, bool fail_group) {
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
    if (cv.wait_until(lk, (deadline - now) < slice ? deadline : now + slice) ==
            std::cv_status::timeout &&
        opts.interrupted && !ready()) {
      lk.unlock();
      if (opts.interrupted()) fail(aborted, -1, "interrupted");
      lk.lock();
    }
  }
}

}  // namespace distvals
