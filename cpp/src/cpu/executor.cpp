// The CPU executor: runs schedule programs on host threads.
//
// A thread may own several replicas' programs (the single-call style runs N replicas
// on at most as many threads as there are cores). It executes, in order, every step of
// its programs whose dependencies are met, switching between programs instead of
// blocking on one, so no wait can deadlock as long as the schedule is acyclic.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu/claim.hpp"
#include "cpu/kernels.hpp"
#include "factory.hpp"
#include "group_impl.hpp"

namespace distvals::detail {
namespace {

// Below this many bytes in all replicas' inputs together, the calling thread does the
// whole collective alone: handing work to a worker costs more than the work. Measured
// with the engine's timing loop (direct, float32, 2 cores), one thread against two:
// N=2 at 32 KiB per replica 1.44 us vs 1.46 us, at 128 KiB 5.2 us vs 3.9 us.
constexpr std::size_t kSingleThreadBytes = 96 * 1024;

class cpu_executor final : public executor {
 public:
  explicit cpu_executor(group::impl& core);
  ~cpu_executor() override { close(); }

  void check_buffer(int replica, const buffer_view& b, const char* what) const override {
    if (!b.dev.is_cpu()) {
      throw invalid_argument_error("replica " + std::to_string(replica) + ": " + what + " lives on " + b.dev.str() +
                                   ", but this group runs on host memory");
    }
  }
  algorithm choose_algorithm(const call_desc& d) const noexcept override {
    return distvals::choose_algorithm(m_.n, d.count * dtype_size(d.type));
  }
  bool runs_parts() const noexcept override { return true; }
  void run(const call& c) override;
  void run_part(int replica, const call& c) override;
  void close() noexcept override;
  void after_fork() noexcept override;

 private:
  struct alignas(64) worker_slot {
    std::atomic<std::uint64_t> go{0};  // the job number (jobs_) this worker should run
    // The job number whose share has been taken, by the worker itself or by the caller.
    // Whoever moves it to the job number first runs the share; the other leaves it alone.
    std::atomic<std::uint64_t> taken{0};
    std::thread thread;
  };

  /// Runs the programs of replicas `owned` of schedule `s` for call `seq`.
  void run_programs(const schedule& s, std::uint64_t seq, const int* owned, int nowned,
                    clock_type::time_point deadline, int me);
  /// Runs thread `thread`'s share of a single-call job split over `threads` threads:
  /// the programs of replicas thread, thread + threads, thread + 2*threads, ...
  void run_share(const schedule& s, std::uint64_t seq, int thread, int threads, clock_type::time_point deadline);
  /// Claims worker `index`'s share of job `seq` (see worker_slot::taken); true when the
  /// caller won and must run the share itself.
  static bool take(worker_slot& w, std::uint64_t seq) noexcept;
  /// Executes one step of call `seq` (reads posted buffers of slot seq & 1).
  void exec_step(const step& st, std::uint64_t seq) noexcept;
  /// Main loop of worker `index` (thread index + 1).
  void worker_main(int index) noexcept;
  schedule_key key_for(const call_desc& d, int parts) const;

  group::impl& m_;
  int threads_ = 1;  // threads of the single-call style, caller included
  std::unique_ptr<worker_slot[]> workers_;  // threads_ - 1 of them
  const schedule* job_sched_ = nullptr;
  std::uint64_t job_seq_ = 0;
  // Job numbers handed to the workers: 1, 2, 3, ... for the executor's whole life. Not
  // the group's call numbers, which start again from 1 after a reset.
  std::uint64_t jobs_ = 0;
  int job_threads_ = 1;
  clock_type::time_point job_deadline_;
  std::atomic<int> job_done_{0};
  std::mutex job_error_mu_;
  std::exception_ptr job_error_;
  std::atomic<bool> stopping_{false};  // workers exit when they see it
  bool closed_ = false;
  // Idle workers (no job) wait here, apart from the group's condition variable: that one
  // is notified at every step a replica publishes, which must not wake a worker that
  // has nothing to do (a small collective runs on the calling thread alone, and waking
  // an idle worker at each of its steps would cost a context switch each).
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::atomic<int> idle_{0};
  /// Wakes the idle workers (a job was posted, or the executor closes).
  void wake_idle() noexcept;
};

void cpu_executor::wake_idle() noexcept {
  if (idle_.load() == 0) return;
  std::lock_guard<std::mutex> lk(idle_mu_);
  idle_cv_.notify_all();
}

cpu_executor::cpu_executor(group::impl& core) : m_(core) {
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  threads_ = m_.opts.threads > 0 ? std::min(m_.opts.threads, m_.n) : std::min(m_.n, hw);
  m_.opts.threads = threads_;
  if (threads_ <= 1) return;
  workers_.reset(new worker_slot[static_cast<std::size_t>(threads_ - 1)]);
  try {
    for (int t = 1; t < threads_; ++t) workers_[t - 1].thread = std::thread([this, t]() { worker_main(t); });
  } catch (...) {
    // Out of threads (many groups alive): stop the workers already started before the
    // exception leaves, or their joinable std::thread objects would end the process.
    close();
    throw;
  }
}

void cpu_executor::after_fork() noexcept {
  // The workers were the parent's threads: their handles are dropped (they can be
  // neither joined nor detached here), the locks they may have held are replaced, and
  // new workers start. Should that fail, the calling thread runs every share itself
  // (run() takes over shares no worker started).
  new (&idle_mu_) std::mutex();
  new (&idle_cv_) std::condition_variable();
  new (&job_error_mu_) std::mutex();
  idle_.store(0);
  job_done_.store(0);
  job_error_ = nullptr;
  if (closed_ || threads_ <= 1) return;
  for (int t = 1; t < threads_; ++t) {
    worker_slot& w = workers_[t - 1];
    new (&w.thread) std::thread();
    // No share of a job numbered so far may be taken by a new worker.
    w.go.store(jobs_);
    w.taken.store(jobs_);
  }
  for (int t = 1; t < threads_; ++t) {
    try {
      workers_[t - 1].thread = std::thread([this, t]() { worker_main(t); });
    } catch (...) {
      return;  // out of threads: the remaining shares run on the caller
    }
  }
}

void cpu_executor::close() noexcept {
  if (closed_) return;
  closed_ = true;
  stopping_.store(true);
  m_.wake_all();
  {
    std::lock_guard<std::mutex> lk(idle_mu_);
    idle_cv_.notify_all();
  }
  for (int t = 1; t < threads_; ++t) {
    if (workers_[t - 1].thread.joinable()) workers_[t - 1].thread.join();
  }
}

schedule_key cpu_executor::key_for(const call_desc& d, int parts) const {
  schedule_key key{d.kind, d.algo, m_.n, d.count, d.root,
                   std::max<std::size_t>(1, m_.opts.chunk_bytes / dtype_size(d.type)), 16};
  key.parts = parts;
  return key;
}

// ---- steps ------------------------------------------------------------------------------

void cpu_executor::exec_step(const step& st, std::uint64_t seq) noexcept {
  if (st.count == 0) return;
  const int slot = static_cast<int>(seq & 1u);
  const call_desc& d = m_.reps[0].desc[slot];
  const std::size_t esize = dtype_size(d.type);
  auto ptr = [&](const slot_ref& ref) -> char* {
    const buffer_view& v = ref.output ? m_.reps[ref.replica].out[slot] : m_.reps[ref.replica].in[slot];
    return static_cast<char*>(v.data) + ref.offset * esize;
  };
  // Small fixed arrays cover every schedule up to 64 replicas without allocating.
  constexpr int kInline = 64;
  void* dst_inline[kInline];
  const void* src_inline[kInline];
  std::vector<void*> dst_heap;
  std::vector<const void*> src_heap;
  void** dsts = dst_inline;
  const void** srcs = src_inline;
  const int ndst = static_cast<int>(st.dsts.size()), nsrc = static_cast<int>(st.srcs.size());
  if (ndst > kInline) {
    dst_heap.resize(ndst);
    dsts = dst_heap.data();
  }
  if (nsrc > kInline) {
    src_heap.resize(nsrc);
    srcs = src_heap.data();
  }
  for (int i = 0; i < ndst; ++i) dsts[i] = ptr(st.dsts[i]);
  for (int i = 0; i < nsrc; ++i) srcs[i] = ptr(st.srcs[i]);

  const bool mean = st.finalize && d.op == reduce_op::mean;
  if (st.kind == step::kind_t::copy || (nsrc == 1 && !mean)) {
    cpu::copy_to_all(dsts, ndst, srcs[0], st.count * esize);
    return;
  }
  cpu::reduce_args a{dsts, ndst, srcs, nsrc, st.count, mean ? static_cast<double>(m_.n) : 0.0};
  cpu::kernels().reduce[static_cast<int>(d.type)][cpu::op_index(d.op)](a);
}

void cpu_executor::run_programs(const schedule& s, std::uint64_t seq, const int* owned, int nowned,
                                clock_type::time_point deadline, int me) {
  const std::uint64_t base = seq << 32;
  auto done_at = [&](const step_dep& dep) {
    return reached(m_.reps[dep.replica].progress.load(std::memory_order_acquire),
                   base + static_cast<std::uint64_t>(dep.step) + 1);
  };
  auto ready = [&](const step& st) {
    for (const auto& dep : st.deps) {
      if (!done_at(dep)) return false;
    }
    return true;
  };
  // next[i]: the next step of owned program i. Few programs per thread: keep on stack.
  constexpr int kInline = 64;
  std::size_t next_inline[kInline] = {};
  std::vector<std::size_t> next_heap;
  std::size_t* next = next_inline;
  if (nowned > kInline) {
    next_heap.assign(nowned, 0);
    next = next_heap.data();
  }
  int remaining = 0;
  for (int i = 0; i < nowned; ++i) {
    if (!s.programs[owned[i]].empty()) ++remaining;
  }
  while (remaining > 0) {
    bool progressed = false;
    for (int i = 0; i < nowned; ++i) {
      const auto& prog = s.programs[owned[i]];
      if (next[i] == prog.size()) continue;
      while (next[i] < prog.size() && ready(prog[next[i]])) {
        // Mark the step as running before checking the failure state; fail() sets the
        // state before drain() reads the marks. Both sides use sequentially consistent
        // atomics, so either this thread sees the failure and starts nothing, or the
        // draining replica sees the mark and waits for the step to end: no step touches
        // a buffer whose owner has already left with an error.
        std::atomic<bool>& busy = m_.reps[owned[i]].busy;
        busy.store(true);
        if (m_.state.load() != group::impl::ok) {
          busy.store(false);
          m_.throw_if_failed(me);
        }
        exec_step(prog[next[i]], seq);
        busy.store(false);
        ++next[i];
        m_.publish(owned[i], seq, next[i]);
        progressed = true;
      }
      if (next[i] == prog.size()) --remaining;
    }
    if (progressed || remaining == 0) continue;
    // Nothing runnable: wait until a head step of one of our programs becomes ready.
    auto any_ready = [&]() {
      for (int i = 0; i < nowned; ++i) {
        const auto& prog = s.programs[owned[i]];
        if (next[i] < prog.size() && ready(prog[next[i]])) return true;
      }
      return false;
    };
    auto describe = [&]() {
      std::string who;
      for (int i = 0; i < nowned; ++i) {
        const auto& prog = s.programs[owned[i]];
        if (next[i] == prog.size()) continue;
        for (const auto& dep : prog[next[i]].deps) {
          if (done_at(dep)) continue;
          if (!who.empty()) who += ", ";
          who += "replica " + std::to_string(dep.replica) + " (step " + std::to_string(dep.step) + ")";
        }
      }
      return "distvals: " + std::string(collective_name(s.kind)) + " timed out in replica " +
             std::to_string(me < 0 ? owned[0] : me) + " waiting for " + who;
    };
    m_.wait(any_ready, deadline, me, describe);
  }
}

// ---- the single-call style: the caller and the workers ------------------------------------

bool cpu_executor::take(worker_slot& w, std::uint64_t seq) noexcept {
  // Job numbers are the executor's own, never reset with the group's call numbers.
  return cpu::claim_share(w.taken, seq);
}

void cpu_executor::run_share(const schedule& s, std::uint64_t seq, int thread, int threads,
                             clock_type::time_point deadline) {
  constexpr int kInline = 64;
  int owned_inline[kInline];
  std::vector<int> owned_heap;
  int* own = owned_inline;
  const int most = (m_.n + threads - 1) / threads;
  if (most > kInline) {
    owned_heap.resize(most);
    own = owned_heap.data();
  }
  int nown = 0;
  for (int r = thread; r < m_.n; r += threads) own[nown++] = r;
  run_programs(s, seq, own, nown, deadline, -1);
}

void cpu_executor::run(const call& c) {
  const call_desc& desc = c.desc;
  const std::size_t total = desc.count * dtype_size(desc.type) * static_cast<std::size_t>(m_.n);
  const int t = total < kSingleThreadBytes ? 1 : threads_;
  // `direct` cuts the data into one slice per executing thread (thread p runs replica
  // p's program), not one per replica: fewer, longer steps for the same traffic.
  const auto sched = m_.get_schedule(key_for(desc, t));
  if (t == 1) {
    run_share(*sched, c.seq, 0, 1, c.deadline);
    return;
  }

  // Hand the job to workers 1 .. t-1 and run our own share (replicas 0, t, 2t, ...).
  // Then take over the share of every worker that has not started yet: a worker that is
  // asleep or descheduled (a busy machine) would otherwise make us wait for it, and one
  // thread doing all the work is never slower than waiting. Finally wait for the workers
  // that did start to leave the job (they read *sched and the posted views).
  job_sched_ = sched.get();
  job_seq_ = c.seq;
  job_threads_ = t;
  job_deadline_ = c.deadline;
  job_done_.store(0);
  job_error_ = nullptr;
  const std::uint64_t job = ++jobs_;
  for (int w = 1; w < t; ++w) workers_[w - 1].go.store(job);
  wake_idle();

  std::exception_ptr mine;
  int started = t - 1;
  try {
    run_share(*sched, c.seq, 0, t, c.deadline);
    for (int w = 1; w < t; ++w) {
      if (take(workers_[w - 1], job)) {
        --started;
        run_share(*sched, c.seq, w, t, c.deadline);
      }
    }
  } catch (...) {
    mine = std::current_exception();
    m_.fail(group::impl::aborted, -1, "the calling thread failed");
    // Shares not taken yet: take them so no worker starts on a failed job.
    for (int w = 1; w < t; ++w) {
      if (take(workers_[w - 1], job)) --started;
    }
  }
  // Workers always finish: they complete their programs or see the failure state.
  auto all_done = [&]() { return job_done_.load() == started; };
  while (!all_done()) {
    for (int i = 0; i < 64 && !all_done(); ++i) cpu::relax();
    if (all_done()) break;
    std::unique_lock<std::mutex> lk(m_.mu);
    m_.sleepers.fetch_add(1);
    m_.cv.wait_for(lk, std::chrono::milliseconds(1), all_done);
    m_.sleepers.fetch_sub(1);
  }
  if (mine) std::rethrow_exception(mine);
  if (job_error_) std::rethrow_exception(job_error_);
}

void cpu_executor::worker_main(int index) noexcept {
  worker_slot& me = workers_[index - 1];
  std::uint64_t seen = 0;
  for (;;) {
    // Wait for a job: spin a little (back-to-back collectives), then block.
    auto has_job = [&]() { return me.go.load(std::memory_order_acquire) != seen || stopping_.load(); };
    if (!has_job()) {
      // The linger is read again while spinning: a caller that lowers it, or closes the
      // last open batch of collectives, lets the worker go to sleep at once.
      const auto start = clock_type::now();
      const auto spin_end = start + std::chrono::microseconds(m_.spin_us * 4);
      for (unsigned i = 1; !has_job(); ++i) {
        if ((i & 63u) == 0) {
          const auto now = clock_type::now();
          int linger = m_.linger_us.load(std::memory_order_relaxed);
          if (m_.open_batches.load(std::memory_order_relaxed) > 0) linger = std::max(linger, group::batch_linger_us);
          if (now > spin_end && now > start + std::chrono::microseconds(linger)) break;
        }
        cpu::relax();
      }
      if (!has_job()) {
        // Announce, then check under the lock the poster notifies under: either the
        // poster sees us idle and notifies, or we see its job (both are seq_cst).
        idle_.fetch_add(1);
        {
          std::unique_lock<std::mutex> lk(idle_mu_);
          idle_cv_.wait(lk, has_job);
        }
        idle_.fetch_sub(1);
      }
    }
    if (stopping_.load()) return;
    seen = me.go.load(std::memory_order_acquire);
    // The caller may already have taken our share (we woke late); then the job's fields
    // may already belong to a later job, and we must not read them.
    if (!take(me, seen)) continue;
    try {
      run_share(*job_sched_, job_seq_, index, job_threads_, job_deadline_);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(job_error_mu_);
        if (!job_error_) job_error_ = std::current_exception();
      }
      m_.fail(group::impl::aborted, -1, "a worker thread failed");
    }
    job_done_.fetch_add(1);
    if (m_.sleepers.load() > 0) m_.wake_all();
  }
}

// ---- the per-replica style ------------------------------------------------------------------

void cpu_executor::run_part(int replica, const call& c) {
  // Step 4 of the meeting: run our own program, one slice per replica for `direct`.
  const auto sched = m_.get_schedule(key_for(c.desc, 0));
  run_programs(*sched, c.seq, &replica, 1, c.deadline, replica);
  // Step 5: leave only when nobody can still read or write our buffers.
  const std::uint64_t base = c.seq << 32;
  auto finished = [&](int j) {
    return reached(m_.reps[j].progress.load(std::memory_order_acquire), base + sched->programs[j].size());
  };
  m_.wait(
      [&]() {
        for (int j = 0; j < m_.n; ++j) {
          if (!finished(j)) return false;
        }
        return true;
      },
      c.deadline, replica, [&]() {
        std::string who;
        for (int j = 0; j < m_.n; ++j) {
          if (finished(j)) continue;
          if (!who.empty()) who += ", ";
          who += std::to_string(j);
        }
        return "distvals: " + std::string(collective_name(c.desc.kind)) + " timed out in replica " +
               std::to_string(replica) + " waiting for replica(s) " + who + " to finish";
      });
}

}  // namespace

std::unique_ptr<executor> make_cpu_executor(group::impl& core) { return std::make_unique<cpu_executor>(core); }

}  // namespace distvals::detail
