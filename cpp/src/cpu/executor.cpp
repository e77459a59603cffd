// The CPU backend: runs schedule programs on host threads.
//
// A thread may own several replicas' programs (the single-call style runs N replicas
// on at most as many threads as there are cores). It executes, in order, every step of
// its programs whose dependencies are met, switching between programs instead of
// blocking on one, so no wait can deadlock as long as the schedule is acyclic.
#include <string>

#include "cpu/kernels.hpp"
#include "group_impl.hpp"

namespace distvals {

void group::impl::wake_all() noexcept {
  std::lock_guard<std::mutex> lk(mu);
  cv.notify_all();
}

void group::impl::publish(int replica, std::uint64_t seq, std::uint64_t steps) noexcept {
  reps[replica].progress.store((seq << 32) | steps);
  if (sleepers.load() > 0) wake_all();
}

void group::impl::fail(int kind, int replica, const std::string& msg) noexcept {
  {
    std::lock_guard<std::mutex> lk(state_mu);
    if (state.load() == ok) {
      state_msg = msg;
      state_replica = replica;
      state.store(kind);
    } else if (kind == closed) {
      state.store(closed);  // closing overrides an earlier abort: nothing can run again
      state_msg = msg;
    }
  }
  wake_all();
}

void group::impl::drain() const noexcept {
  for (int j = 0; j < n; ++j) {
    for (unsigned i = 1; reps[j].busy.load(); ++i) {
      if ((i & 63u) == 0) std::this_thread::yield();
      cpu::relax();
    }
  }
}

void group::impl::throw_if_failed(int me) const {
  const int s = state.load(std::memory_order_acquire);
  if (s == ok) return;
  std::string msg;
  int origin = -1;
  {
    std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(state_mu));
    msg = state_msg;
    origin = state_replica;
  }
  switch (s) {
    case timed_out: throw timeout_error(msg);
    case closed: throw closed_error("distvals: the group is closed");
    default: {
      std::string what = "distvals: collective aborted";
      if (origin >= 0) what += " by replica " + std::to_string(origin);
      if (!msg.empty()) what += ": " + msg;
      if (me >= 0 && me != origin) what += " (seen by replica " + std::to_string(me) + ")";
      throw aborted_error(what, origin);
    }
  }
}

void group::impl::exec_step(const step& st, std::uint64_t seq) noexcept {
  if (st.count == 0) return;
  const int slot = static_cast<int>(seq & 1u);
  const call_desc& d = reps[0].desc[slot];
  const std::size_t esize = dtype_size(d.type);
  auto ptr = [&](const slot_ref& ref) -> char* {
    const buffer_view& v = ref.output ? reps[ref.replica].out[slot] : reps[ref.replica].in[slot];
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
  cpu::reduce_args a{dsts, ndst, srcs, nsrc, st.count, mean ? static_cast<double>(n) : 0.0};
  cpu::kernels().reduce[static_cast<int>(d.type)][cpu::op_index(d.op)](a);
}

void group::impl::run_programs(const schedule& s, std::uint64_t seq, const int* owned, int nowned,
                               clock_type::time_point deadline, int me) {
  const std::uint64_t base = seq << 32;
  auto done_at = [&](const step_dep& dep) {
    return reps[dep.replica].progress.load(std::memory_order_acquire) >=
           base + static_cast<std::uint64_t>(dep.step) + 1;
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
        std::atomic<bool>& busy = reps[owned[i]].busy;
        busy.store(true);
        if (state.load() != ok) {
          busy.store(false);
          throw_if_failed(me);
        }
        exec_step(prog[next[i]], seq);
        busy.store(false);
        ++next[i];
        publish(owned[i], seq, next[i]);
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
    wait(any_ready, deadline, me, describe);
  }
}

std::shared_ptr<const schedule> group::impl::get_schedule(const schedule_key& key) {
  std::lock_guard<std::mutex> lk(cache_mu);
  for (std::size_t i = 0; i < cache.size(); ++i) {
    if (cache[i].first == key) {
      // Move hits to the front so the linear search stays short for hot shapes.
      if (i != 0) std::swap(cache[i], cache[0]);
      return cache[0].second;
    }
  }
  auto s = std::make_shared<const schedule>(make_schedule(key));
  constexpr std::size_t kMaxCached = 32;
  if (cache.size() >= kMaxCached) cache.pop_back();
  cache.insert(cache.begin(), {key, s});
  return s;
}

bool group::impl::take(worker_slot& w, std::uint64_t seq) noexcept {
  std::uint64_t cur = w.taken.load();
  return cur != seq && w.taken.compare_exchange_strong(cur, seq);
}

void group::impl::run_share(const schedule& s, std::uint64_t seq, int thread, int threads,
                            clock_type::time_point deadline) {
  constexpr int kInline = 64;
  int owned_inline[kInline];
  std::vector<int> owned_heap;
  int* own = owned_inline;
  const int most = (n + threads - 1) / threads;
  if (most > kInline) {
    owned_heap.resize(most);
    own = owned_heap.data();
  }
  int nown = 0;
  for (int r = thread; r < n; r += threads) own[nown++] = r;
  run_programs(s, seq, own, nown, deadline, -1);
}

void group::impl::worker_main(int index) noexcept {
  worker_slot& me = workers[index - 1];
  std::uint64_t seen = 0;
  for (;;) {
    // Wait for a job: spin a little (back-to-back collectives), then block.
    auto has_job = [&]() { return me.go.load(std::memory_order_acquire) != seen || stopping.load(); };
    if (!has_job()) {
      const auto spin_end = clock_type::now() + std::chrono::microseconds(spin_us * 4);
      for (unsigned i = 1; !has_job(); ++i) {
        if ((i & 63u) == 0 && clock_type::now() > spin_end) break;
        cpu::relax();
      }
      if (!has_job()) {
        sleepers.fetch_add(1);
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, has_job);
        lk.unlock();
        sleepers.fetch_sub(1);
      }
    }
    if (stopping.load()) return;
    seen = me.go.load(std::memory_order_acquire);
    // The caller may already have taken our share (we woke late); then the job's fields
    // may already belong to a later job, and we must not read them.
    if (!take(me, seen)) continue;
    try {
      run_share(*job_sched, job_seq, index, job_threads, job_deadline);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(job_error_mu);
        if (!job_error) job_error = std::current_exception();
      }
      fail(aborted, -1, "a worker thread failed");
    }
    job_done.fetch_add(1);
    if (sleepers.load() > 0) wake_all();
  }
}

}  // namespace distvals
