// distvals::cuda::group: construction (devices, peer access, streams), argument checks
// and the public calls. Enqueueing lives in executor.cpp.
#include "distvals/cuda/group.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

#include "cuda/group_impl.hpp"
#include "distvals/cuda/error.hpp"
#include "distvals/cuda/runtime.hpp"

namespace distvals::cuda {
namespace {

constexpr std::size_t kDefaultChunkBytes = 16u << 20;

std::string who(int r) { return "replica " + std::to_string(r); }

void init(group::impl& m, std::vector<device> names, std::vector<int> gpus, group_options options) {
  if (gpus.empty()) throw invalid_argument_error("a GPU group needs at least 1 device");
  if (static_cast<int>(gpus.size()) > max_replicas) {
    throw invalid_argument_error("a GPU group holds at most " + std::to_string(max_replicas) + " replicas, got " +
                                 std::to_string(gpus.size()));
  }
  const int count = device_count();
  if (count == 0) {
    throw cuda_error("distvals: no CUDA device is available (" + unavailable_reason() + "); cannot place replica " +
                     names[0].str() + " on a GPU");
  }
  for (std::size_t r = 0; r < gpus.size(); ++r) {
    if (gpus[r] < 0 || gpus[r] >= count) {
      throw invalid_argument_error(who(static_cast<int>(r)) + " (" + names[r].str() + ") needs CUDA device " +
                                   std::to_string(gpus[r]) + ", but this machine has " + std::to_string(count) +
                                   " CUDA device" + (count == 1 ? "" : "s") +
                                   " (several replicas can share one GPU as logical GPUs)");
    }
  }
  m.n = static_cast<int>(gpus.size());
  m.devices = std::move(names);
  m.gpus = std::move(gpus);
  m.opts = std::move(options);
  if (m.opts.timeout.count() <= 0) m.opts.timeout = detail::default_timeout();
  if (m.opts.chunk_bytes == 0) m.opts.chunk_bytes = kDefaultChunkBytes;
  for (int g : m.gpus) {
    if (std::find(m.distinct_gpus.begin(), m.distinct_gpus.end(), g) == m.distinct_gpus.end()) {
      m.distinct_gpus.push_back(g);
    }
  }

  detail::device_guard guard(m.gpus[0]);
  // Peer access between every pair of distinct devices where the hardware allows it;
  // "already enabled" (by an earlier group or another library) counts as enabled.
  m.peer.assign(static_cast<std::size_t>(count), std::vector<char>(static_cast<std::size_t>(count), 0));
  for (int a = 0; a < count; ++a) m.peer[a][a] = 1;
  for (int a : m.distinct_gpus) {
    for (int b : m.distinct_gpus) {
      if (a == b || !m.opts.peer_access || !can_access_peer(a, b)) continue;
      guard.set(a);
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) {
        m.peer[a][b] = 1;
      }
      (void)cudaGetLastError();  // a failure only means staged copies for this pair
    }
  }

  m.reps.resize(static_cast<std::size_t>(m.n));
  for (int r = 0; r < m.n; ++r) {
    auto& rep = m.reps[r];
    guard.set(m.gpus[r]);
    rep.s = std::make_unique<stream>(m.gpus[r]);
    rep.end = std::make_unique<event>(m.gpus[r]);
    int sms = 0;
    DISTVALS_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, m.gpus[r]));
    rep.max_blocks = std::max(1, sms) * 4;
  }
  m.fork_events.resize(static_cast<std::size_t>(count));
}

struct inside_guard {
  std::atomic<int>& c;
  explicit inside_guard(std::atomic<int>& x) : c(x) { c.fetch_add(1); }
  ~inside_guard() { c.fetch_sub(1); }
};

}  // namespace

group::group(const std::vector<int>& gpus, group_options options) : impl_(new impl) {
  std::vector<device> names(gpus.size());
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    names[i].kind = device::kind_t::gpu;
    names[i].index = static_cast<int>(i);
  }
  init(*impl_, std::move(names), gpus, std::move(options));
}

group::group(const std::vector<device>& devices, int logical_per_gpu, group_options options) : impl_(new impl) {
  if (logical_per_gpu < 1) {
    throw invalid_argument_error("logical GPUs per device must be at least 1, got " + std::to_string(logical_per_gpu));
  }
  std::vector<int> gpus;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].is_cpu()) {
      throw invalid_argument_error("device " + devices[i].str() + " (replica " + std::to_string(i) +
                                   ") is a CPU; a GPU group runs GPU replicas only");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        throw invalid_argument_error("device " + devices[i].str() + " is listed twice (replicas " + std::to_string(j) +
                                     " and " + std::to_string(i) + ")");
      }
    }
    gpus.push_back(devices[i].index / logical_per_gpu);
  }
  init(*impl_, devices, std::move(gpus), std::move(options));
}

group::~group() { close(); }

int group::size() const noexcept { return impl_->n; }
const std::vector<device>& group::devices() const noexcept { return impl_->devices; }
const std::vector<int>& group::gpus() const noexcept { return impl_->gpus; }
const group_options& group::options() const noexcept { return impl_->opts; }

bool group::direct_access(int a, int b) const noexcept {
  if (a < 0 || b < 0 || a >= impl_->n || b >= impl_->n) return false;
  return impl_->reach(a, b);
}

stream_view group::replica_stream(int r) const {
  if (r < 0 || r >= impl_->n) {
    throw invalid_argument_error("replica " + std::to_string(r) + " is out of range for a group of " +
                                 std::to_string(impl_->n));
  }
  if (impl_->reps.empty()) throw closed_error("distvals: the group is closed");
  return impl_->reps[r].s->view();
}

algorithm choose_gpu_algorithm(const group& g, std::size_t bytes) noexcept {
  // One GPU (logical replicas) or peer access everywhere: `direct` reads every input
  // once and writes every output once, the least device-memory traffic there is, in
  // one kernel per replica. Without peer access every remote read would be staged, so
  // the ring, which reads one neighbour per step, stages the least.
  (void)bytes;
  for (int a = 0; a < g.size(); ++a) {
    for (int b = 0; b < g.size(); ++b) {
      if (!g.direct_access(a, b)) return algorithm::ring;
    }
  }
  return algorithm::direct;
}

// ---- failure state ------------------------------------------------------------------

void group::impl::fail(int kind, int replica, const std::string& msg) noexcept {
  std::lock_guard<std::mutex> lk(state_mu);
  if (state.load() == ok) {
    state_msg = msg;
    state_replica = replica;
    state.store(kind);
  } else if (kind == closed) {
    state.store(closed);
    state_msg = msg;
  }
}

void group::impl::throw_if_failed() const {
  const int s = state.load();
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
      throw aborted_error(what, origin);
    }
  }
}

void group::abort(int replica, const std::string& why) noexcept { impl_->fail(impl::aborted, replica, why); }
void group::cancel() noexcept { impl_->fail(impl::aborted, -1, "cancelled"); }
bool group::aborted() const noexcept {
  const int s = impl_->state.load();
  return s == impl::aborted || s == impl::timed_out;
}
bool group::closed() const noexcept { return impl_->state.load() == impl::closed; }

void group::reset() {
  impl& m = *impl_;
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  if (m.inside.load() != 0) {
    throw std::logic_error("distvals: cuda::group::reset() called while a collective is in flight");
  }
  std::lock_guard<std::mutex> lk(m.state_mu);
  m.state.store(impl::ok);
  m.state_msg.clear();
  m.state_replica = -1;
}

void group::close() noexcept {
  impl& m = *impl_;
  if (m.state.load() == impl::closed && m.reps.empty()) return;
  m.fail(impl::closed, -1, "closed");
  // Host waits notice the closed state within one 50 ms slice.
  while (m.inside.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  std::lock_guard<std::mutex> lk(m.call_mu);
  // Let queued work finish (bounded) before scratch memory and events go away.
  for (auto& rep : m.reps) {
    try {
      if (rep.s) rep.s->synchronize(m.opts.timeout);
    } catch (...) {
    }
  }
  m.reps.clear();
  m.fork_events.clear();
}

// ---- argument checks ------------------------------------------------------------------

void group::impl::validate(call_desc& desc, const std::vector<buffer_view>& in,
                           const std::vector<buffer_view>& out) const {
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n) {
    throw invalid_argument_error("expected " + std::to_string(n) + " input and output buffers (one per replica), got " +
                                 std::to_string(in.size()) + " and " + std::to_string(out.size()));
  }
  struct range {
    std::uintptr_t b, e;
    int gpu, replica;
    bool write;
  };
  std::vector<range> ranges;
  for (int r = 0; r < n; ++r) {
    // Counts, dtypes, root and op go through the checks the CPU group uses; the memory
    // checks below are the GPU's own.
    buffer_view hi = in[r], ho = out[r];
    hi.dev = device{};
    ho.dev = device{};
    validate_replica_buffers(desc, n, r, hi, ho);
    const bool reads = desc.kind != collective::broadcast || r == desc.root;
    const bool writes = desc.kind != collective::reduce || r == desc.root;
    auto check = [&](const buffer_view& b, const char* what) {
      if (b.count == 0) return;
      if (b.dev.is_cpu()) {
        throw invalid_argument_error(who(r) + ": " + what + " is host memory (" + b.dev.str() +
                                     "); replica " + std::to_string(r) + " (" + devices[r].str() +
                                     ") needs device memory of CUDA device " + std::to_string(gpus[r]));
      }
      if (b.dev.index != gpus[r]) {
        throw invalid_argument_error(who(r) + ": " + what + " lives on CUDA device " + std::to_string(b.dev.index) +
                                     ", but replica " + std::to_string(r) + " (" + devices[r].str() +
                                     ") runs on CUDA device " + std::to_string(gpus[r]));
      }
      if (reinterpret_cast<std::uintptr_t>(b.data) % dtype_size(b.type) != 0) {
        throw invalid_argument_error(who(r) + ": " + what + " is not aligned to its " +
                                     std::to_string(dtype_size(b.type)) + "-byte elements");
      }
    };
    if (reads) check(in[r], "input");
    if (writes) check(out[r], "output");
    const auto ib = reinterpret_cast<std::uintptr_t>(in[r].data);
    const auto ob = reinterpret_cast<std::uintptr_t>(out[r].data);
    const bool inplace = ib == ob && in[r].bytes() == out[r].bytes();
    if (writes && out[r].bytes() > 0) ranges.push_back({ob, ob + out[r].bytes(), gpus[r], r, true});
    if (reads && in[r].bytes() > 0 && !(inplace && writes)) {
      ranges.push_back({ib, ib + in[r].bytes(), gpus[r], r, false});
    }
  }
  // A written range may overlap nothing else (in place is one range, added once).
  auto name = [](const range& x) {
    return "replica " + std::to_string(x.replica) + "'s " + (x.write ? "output" : "input");
  };
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    for (std::size_t j = i + 1; j < ranges.size(); ++j) {
      const range& a = ranges[i];
      const range& b = ranges[j];
      if (!(a.write || b.write) || a.gpu != b.gpu) continue;
      if (a.b < b.e && b.b < a.e) {
        throw invalid_argument_error(name(b) + " overlaps " + name(a) +
                                     "; every replica needs its own buffer (an output may only be exactly its "
                                     "own input, for in-place)");
      }
    }
  }
  if (desc.algo == algorithm::automatic) {
    if (desc.kind == collective::all_reduce) {
      bool all = true;
      for (int a = 0; a < n && all; ++a) {
        for (int b = 0; b < n && all; ++b) all = reach(a, b);
      }
      desc.algo = all ? algorithm::direct : algorithm::ring;
    } else {
      desc.algo = algorithm::direct;
    }
  }
}

// ---- calls ------------------------------------------------------------------------------

void group::run(const call_desc& desc_in, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  impl& m = *impl_;
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  call_desc desc = desc_in;
  m.validate(desc, in, out);
  std::lock_guard<std::mutex> lk(m.call_mu);
  m.throw_if_failed();
  m.execute(desc, in, out, nullptr);
}

void group::enqueue(const call_desc& desc_in, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                    stream_view caller) {
  impl& m = *impl_;
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  call_desc desc = desc_in;
  m.validate(desc, in, out);
  if (caller.device() >= device_count()) {
    throw invalid_argument_error("the caller's stream is on CUDA device " + std::to_string(caller.device()) +
                                 ", which does not exist");
  }
  std::lock_guard<std::mutex> lk(m.call_mu);
  m.throw_if_failed();
  m.execute(desc, in, out, &caller);
}

void group::all_reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op,
                       algorithm algo) {
  DISTVALS_EXPECTS(!in.empty(), "all_reduce needs one input buffer per replica");
  run(call_desc{collective::all_reduce, in[0].type, op, algo, in[0].count, 0}, in, out);
}

void group::reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root, reduce_op op) {
  DISTVALS_EXPECTS(!in.empty(), "reduce needs one input buffer per replica");
  run(call_desc{collective::reduce, in[0].type, op, algorithm::direct, in[0].count, root}, in, out);
}

void group::broadcast(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root) {
  DISTVALS_EXPECTS(root >= 0 && root < static_cast<int>(in.size()), "broadcast root out of range");
  run(call_desc{collective::broadcast, in[root].type, reduce_op::sum, algorithm::direct, in[root].count, root}, in,
      out);
}

void group::all_gather(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  DISTVALS_EXPECTS(!in.empty(), "all_gather needs one input buffer per replica");
  run(call_desc{collective::all_gather, in[0].type, reduce_op::sum, algorithm::direct, in[0].count, 0}, in, out);
}

void group::reduce_scatter(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, reduce_op op) {
  DISTVALS_EXPECTS(!in.empty(), "reduce_scatter needs one input buffer per replica");
  run(call_desc{collective::reduce_scatter, in[0].type, op, algorithm::direct, in[0].count, 0}, in, out);
}

}  // namespace distvals::cuda
