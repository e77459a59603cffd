// The CUDA backend's executor: enqueues the programs of a schedule on one stream per
// replica, ordered with events, from one host thread and without host round trips.
//
//   caller stream ──fork event──┬──> replica 0 stream: step, step, ... ──end event──┐
//   (or the legacy default      ├──> replica 1 stream: step, ... ──────end event────┼──> caller waits
//    streams, then a host wait) └──> replica N-1 stream: ... ──────────end event────┘    (or the host)
//
// A step of replica r that depends on step k of replica j waits on the event recorded
// after that step (cudaStreamWaitEvent). Steps are enqueued in an order where every
// dependency was enqueued (and its event recorded) first, so each wait refers to this
// call's record of the event.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/group_impl.hpp"
#include "cuda/kernels.cuh"
#include "distvals/cuda/error.hpp"
#include "distvals/cuda/runtime.hpp"

namespace distvals::cuda {
namespace {

constexpr std::size_t kScratchAlign = 256;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

bool is_copy(const step& st, reduce_op op) {
  const bool mean = st.finalize && op == reduce_op::mean;
  return st.kind == step::kind_t::copy || (st.srcs.size() == 1 && !mean);
}

// The device of a caller's stream when the caller did not say.
int stream_device(stream_view s, int fallback) {
  if (s.device() >= 0) return s.device();
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  const auto raw = reinterpret_cast<std::uintptr_t>(s.value());
  if (raw > 2) {  // not one of the special handles (0, legacy, per-thread)
    int d = -1;
    if (cudaStreamGetDevice(s.value(), &d) == cudaSuccess && d >= 0) return d;
    (void)cudaGetLastError();
  }
#endif
  return fallback;
}

}  // namespace

event& group::impl::fork_event(int gpu) {
  if (!fork_events[gpu]) fork_events[gpu] = std::make_unique<event>(gpu);
  return *fork_events[gpu];
}

std::shared_ptr<const prepared_schedule> group::impl::get_schedule(const schedule_key& key) {
  std::lock_guard<std::mutex> lk(cache_mu);
  for (std::size_t i = 0; i < cache.size(); ++i) {
    if (cache[i].first == key) {
      if (i != 0) std::swap(cache[i], cache[0]);
      return cache[0].second;
    }
  }
  auto p = std::make_shared<prepared_schedule>();
  p->sched = make_schedule(key);
  p->needed.resize(p->sched.programs.size());
  for (std::size_t r = 0; r < p->sched.programs.size(); ++r) p->needed[r].assign(p->sched.programs[r].size(), 0);
  for (std::size_t r = 0; r < p->sched.programs.size(); ++r) {
    for (const step& st : p->sched.programs[r]) {
      for (const step_dep& d : st.deps) {
        // A dependency on the replica's own earlier step is ordered by its stream.
        if (d.replica != static_cast<int>(r)) p->needed[d.replica][d.step] = 1;
      }
    }
  }
  constexpr std::size_t kMaxCached = 32;
  if (cache.size() >= kMaxCached) cache.pop_back();
  cache.insert(cache.begin(), {key, p});
  return p;
}

std::size_t group::impl::scratch_bytes(int r, const step& st, reduce_op op, std::size_t esize) const noexcept {
  // Copies between unreachable devices go through cudaMemcpyPeerAsync and need no
  // scratch; a reduce stages each unreachable source, and its result too when no
  // destination is reachable (the same decisions as exec_step).
  if (st.count == 0 || is_copy(st, op)) return 0;
  const std::size_t bytes = round_up(st.count * esize, kScratchAlign);
  std::size_t regions = 0;
  for (const slot_ref& s : st.srcs) regions += reach(r, s.replica) ? 0 : 1;
  bool any_dst = false, all_dst = true;
  for (const slot_ref& d : st.dsts) {
    any_dst = any_dst || reach(r, d.replica);
    all_dst = all_dst && reach(r, d.replica);
  }
  if (!all_dst && !any_dst) regions += 1;
  return regions * bytes;
}

void group::impl::exec_step(int r, const step& st, const call_desc& desc, const std::vector<buffer_view>& in,
                            const std::vector<buffer_view>& out) {
  if (st.count == 0) return;
  const std::size_t esize = dtype_size(desc.type);
  const std::size_t bytes = st.count * esize;
  replica_res& me = reps[r];
  cudaStream_t s = me.s->value();
  auto ptr = [&](const slot_ref& ref) -> char* {
    const buffer_view& v = ref.output ? out[ref.replica] : in[ref.replica];
    return static_cast<char*>(v.data) + ref.offset * esize;
  };
  kernels::step_args a;
  a.nsrc = 0;
  a.ndst = 0;
  a.divisor = 0.0;

  if (is_copy(st, desc.op)) {
    // Every destination gets the source's bytes; a destination that is the source
    // itself (in place) is already right.
    const slot_ref& src = st.srcs[0];
    char* sp = ptr(src);
    bool reachable = reach(r, src.replica);
    a.srcs[0] = sp;
    a.nsrc = 1;
    a.count = bytes;
    for (const slot_ref& d : st.dsts) {
      char* dp = ptr(d);
      if (dp == sp) continue;
      reachable = reachable && reach(r, d.replica);
      a.dsts[a.ndst++] = dp;
    }
    if (a.ndst == 0) return;
    if (reachable) {
      DISTVALS_CUDA_TRY(kernels::launch_copy(a, me.max_blocks, s));
      return;
    }
    for (const slot_ref& d : st.dsts) {
      char* dp = ptr(d);
      if (dp == sp) continue;
      DISTVALS_CUDA_TRY(cudaMemcpyPeerAsync(dp, gpus[d.replica], sp, gpus[src.replica], bytes, s));
    }
    return;
  }

  // Reduce: stage unreachable sources into scratch first.
  char* scratch = static_cast<char*>(me.scratch.data());
  std::size_t used = 0;
  const std::size_t region = round_up(bytes, kScratchAlign);
  for (const slot_ref& src : st.srcs) {
    char* sp = ptr(src);
    if (!reach(r, src.replica)) {
      DISTVALS_CUDA_TRY(cudaMemcpyPeerAsync(scratch + used, gpus[r], sp, gpus[src.replica], bytes, s));
      sp = scratch + used;
      used += region;
    }
    a.srcs[a.nsrc++] = sp;
  }
  // The kernel writes every reachable destination (or a scratch region when there is
  // none); unreachable ones receive a peer copy of the result afterwards.
  for (const slot_ref& d : st.dsts) {
    if (reach(r, d.replica)) a.dsts[a.ndst++] = ptr(d);
  }
  if (a.ndst == 0) {
    a.dsts[a.ndst++] = scratch + used;
    used += region;
  }
  a.count = st.count;
  a.divisor = st.finalize && desc.op == reduce_op::mean ? static_cast<double>(n) : 0.0;
  DISTVALS_CUDA_TRY(kernels::launch_reduce(a, desc.type, desc.op, me.max_blocks, s));
  for (const slot_ref& d : st.dsts) {
    if (reach(r, d.replica)) continue;
    DISTVALS_CUDA_TRY(cudaMemcpyPeerAsync(ptr(d), gpus[d.replica], a.dsts[0], gpus[r], bytes, s));
  }
}

void group::impl::execute(const call_desc& desc, const std::vector<buffer_view>& in,
                          const std::vector<buffer_view>& out, const stream_view* caller) {
  const std::size_t esize = dtype_size(desc.type);
  // Ring and tree chunks: whole multiples of 16 elements, so chunk boundaries keep the
  // 16-byte alignment the vectorized kernels need.
  const std::size_t chunk = std::max<std::size_t>(16, opts.chunk_bytes / esize / 16 * 16);
  const schedule_key key{desc.kind, desc.algo, n, desc.count, desc.root, chunk, 16};
  const auto prepared = get_schedule(key);
  const schedule& sched = prepared->sched;
  const auto deadline = detail::clock_type::now() + opts.timeout;
  detail::device_guard guard(gpus[0]);

  // Step 0: what this call needs, allocated before anything is enqueued: an event per
  // step others wait for, and scratch where peer access is missing. Growing scratch
  // waits for the replica's stream, since the old scratch may still be in use.
  for (int r = 0; r < n; ++r) {
    replica_res& rep = reps[r];
    const auto& prog = sched.programs[r];
    if (rep.step_events.size() < prog.size()) rep.step_events.resize(prog.size());
    std::size_t need = 0;
    for (std::size_t i = 0; i < prog.size(); ++i) {
      if (prepared->needed[r][i] && !rep.step_events[i]) rep.step_events[i] = std::make_unique<event>(gpus[r]);
      need = std::max(need, scratch_bytes(r, prog[i], desc.op, esize));
    }
    if (need > rep.scratch.size()) {
      rep.s->synchronize(opts.timeout);
      rep.scratch = device_buffer();
      rep.scratch = device_buffer(need, gpus[r]);
    }
  }

  // From here on a failure leaves work of unknown extent on the streams.
  const bool was_drained = drained;
  const bool had_caller = last_has_caller;
  drained = false;
  last_has_caller = false;  // set again only once this call has joined into its caller
  const bool has_caller = caller != nullptr;
  const int caller_dev = has_caller ? stream_device(*caller, gpus[0]) : -1;

  // Step 1: fork. Every replica stream starts after the caller's stream (or the legacy
  // default stream of every device of the group) reaches this call.
  std::vector<cudaEvent_t> forks;
  if (has_caller) {
    guard.set(caller_dev);
    event& f = fork_event(caller_dev);
    DISTVALS_CUDA_TRY(cudaEventRecord(f.value(), caller->value()));
    forks.push_back(f.value());
  } else {
    for (int d : distinct_gpus) {
      guard.set(d);
      event& f = fork_event(d);
      DISTVALS_CUDA_TRY(cudaEventRecord(f.value(), cudaStreamLegacy));
      forks.push_back(f.value());
    }
  }
  // A replica writes into other replicas' buffers, so it must also start after every
  // replica finished the previous call, unless that is already known: the host saw it
  // finish, or it joined into the very stream this call forks from.
  const bool same_caller = has_caller && had_caller && last_caller == caller->value() &&
                           last_caller_device == caller_dev;
  const bool order_after_previous = !was_drained && !same_caller;
  for (int r = 0; r < n; ++r) {
    cudaStream_t s = reps[r].s->value();
    for (cudaEvent_t f : forks) DISTVALS_CUDA_TRY(cudaStreamWaitEvent(s, f, 0));
    if (order_after_previous) {
      for (int j = 0; j < n; ++j) {
        if (j != r) DISTVALS_CUDA_TRY(cudaStreamWaitEvent(s, reps[j].end->value(), 0));
      }
    }
  }

  // Step 2: the programs, each step after the steps it depends on.
  std::vector<std::size_t> next(static_cast<std::size_t>(n), 0);
  std::size_t remaining = 0;
  for (const auto& prog : sched.programs) remaining += prog.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < n; ++r) {
      const auto& prog = sched.programs[r];
      cudaStream_t s = reps[r].s->value();
      while (next[r] < prog.size()) {
        const step& st = prog[next[r]];
        bool ready = true;
        for (const step_dep& d : st.deps) ready = ready && next[d.replica] > static_cast<std::size_t>(d.step);
        if (!ready) break;
        guard.set(gpus[r]);
        for (const step_dep& d : st.deps) {
          if (d.replica == r) continue;
          DISTVALS_CUDA_TRY(cudaStreamWaitEvent(s, reps[d.replica].step_events[d.step]->value(), 0));
        }
        exec_step(r, st, desc, in, out);
        if (prepared->needed[r][next[r]]) {
          DISTVALS_CUDA_TRY(cudaEventRecord(reps[r].step_events[next[r]]->value(), s));
        }
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) throw std::logic_error("distvals: the schedule's dependencies form a cycle");
  }

  // Step 3: join. Each replica marks its end; the caller's stream waits for all of
  // them, or the host does.
  for (int r = 0; r < n; ++r) {
    guard.set(gpus[r]);
    DISTVALS_CUDA_TRY(cudaEventRecord(reps[r].end->value(), reps[r].s->value()));
  }
  if (has_caller) {
    guard.set(caller_dev);
    for (int r = 0; r < n; ++r) DISTVALS_CUDA_TRY(cudaStreamWaitEvent(caller->value(), reps[r].end->value(), 0));
    last_has_caller = true;
    last_caller = caller->value();
    last_caller_device = caller_dev;
    return;
  }
  for (int r = 0; r < n; ++r) {
    cudaEvent_t e = reps[r].end->value();
    detail::poll_until(
        [e]() { return cudaEventQuery(e); }, deadline, "cudaEventQuery(end of replica)",
        [&]() {
          std::string busy;
          for (int j = 0; j < n; ++j) {
            if (cudaEventQuery(reps[j].end->value()) == cudaSuccess) continue;
            (void)cudaGetLastError();
            if (!busy.empty()) busy += ", ";
            busy += std::to_string(j);
          }
          const std::string msg = "distvals: " + std::string(collective_name(desc.kind)) + " on GPU timed out after " +
                                  std::to_string(opts.timeout.count() / 1000.0) + " s: replica(s) " + busy +
                                  " still running on their streams";
          fail(timed_out, -1, msg);
          return msg;
        },
        [&]() {
          if (opts.interrupted && opts.interrupted()) fail(aborted, -1, "interrupted");
          throw_if_failed();
        });
  }
  drained = true;
}

}  // namespace distvals::cuda
