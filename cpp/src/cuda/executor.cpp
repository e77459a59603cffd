// The CUDA executor: runs a collective of GPU replicas the way NCCL launches, written
// against the small runtime interface (runtime_api.hpp) so that the same code runs on
// the real CUDA runtime and on the host model of the tests.
//
// Replicas that share one device (logical GPUs) are served by ONE kernel launch per
// collective, on one stream (the caller's when given), that reads all N inputs and writes
// all N outputs (launch.hpp). With the previous call's join event, a call costs three
// enqueue calls: wait for the previous call, launch, record the new join:
//
//   caller stream:  ..user work.. | wait(join k-1) | kernel k | record(join k) | ..user work..
//
// Replicas on several devices that all reach each other's memory (peer access): one
// launch per device, each over its part of every segment, ordered by one start and one
// end event per device:
//
//   device d stream:  wait(join k-1) | record(start d) | wait(start e), e != d | kernel(part d) | record(end d)
//   home stream:      ... | wait(end d), d != home | record(join k)
//
// Devices that cannot all reach each other: the home device stages the unreachable
// replicas' buffers through scratch memory with peer copies (the driver stages those
// through the host), runs the one kernel, and copies the results back.
//
// A synchronous call (no caller stream) runs on the group's own streams, after the work
// queued on each device's legacy default stream (where plain copies to and from the
// device run), and waits on the host for the join event. Nothing here allocates device
// memory or waits on the host in the steady state of asynchronous calls.
#include <algorithm>
#include <array>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/host_wait.hpp"
#include "cuda/runtime_api.hpp"
#include "factory.hpp"
#include "group_impl.hpp"

namespace distvals::detail {
namespace {

constexpr std::size_t kScratchAlign = 256;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

class cuda_executor final : public executor {
 public:
  cuda_executor(group::impl& core, cuda::runtime& rt, std::vector<int> gpus);
  ~cuda_executor() override { close(); }

  void check_buffer(int replica, const buffer_view& b, const char* what) const override;
  // One pass over the data is the least device-memory traffic there is, in one launch
  // per device: every algorithm name runs it on GPU replicas.
  algorithm choose_algorithm(const call_desc&) const noexcept override { return algorithm::direct; }
  bool runs_parts() const noexcept override { return false; }
  void run(const call& c) override;
  void run_part(int, const call&) override {
    throw std::logic_error("distvals: GPU replicas run a per-replica collective from replica 0");
  }
  void close() noexcept override;

  const std::vector<int>& gpus() const noexcept { return gpus_; }
  bool reach(int a, int b) const noexcept { return peer_[dev_of_[a]][dev_of_[b]] != 0; }
  cuda::stream_t replica_stream(int r) const noexcept { return devs_[dev_of_[r]].stream; }

 private:
  // What the group keeps per distinct CUDA device of its replicas.
  struct device_state {
    int gpu = -1;
    cuda::stream_t stream = nullptr;  // the group's stream on this device
    cuda::event_t start = nullptr;    // recorded where this device's part may start
    cuda::event_t end = nullptr;      // recorded after this device's part
    cuda::event_t fork = nullptr;     // recorded on a stream this call must follow
    cuda::event_t join = nullptr;     // recorded where a whole call ends, when this device is home
    int sms = 1;
  };
  // Events on devices outside the group (a caller's stream elsewhere, a producer).
  struct other_device {
    cuda::event_t fork = nullptr;
    cuda::event_t join = nullptr;
  };

  int index_of(int gpu) const noexcept {
    for (std::size_t d = 0; d < devs_.size(); ++d) {
      if (devs_[d].gpu == gpu) return static_cast<int>(d);
    }
    return -1;
  }
  cuda::event_t fork_event(int gpu, cuda::device_scope& scope);
  cuda::event_t join_event(int gpu, cuda::device_scope& scope);
  cuda::event_t other_event(int gpu, cuda::event_t other_device::*which, cuda::device_scope& scope);
  void fill_args(cuda::launch_args& a, const call& c, int part, int parts, int sms) const;
  void staged_launch(const call& c, cuda::stream_t s, cuda::device_scope& scope);
  void wait_on_host(cuda::event_t e, const call& c);
  void fence_after_failure(const cuda::stream_t* x, int nx, cuda::device_scope& scope) noexcept;

  group::impl& m_;
  cuda::runtime& rt_;
  std::vector<int> gpus_;                 // CUDA device of each replica
  std::vector<int> dev_of_;               // replica -> index into devs_
  std::vector<device_state> devs_;        // distinct devices, in the order replicas name them
  std::vector<std::vector<char>> peer_;   // peer_[a][b]: device a reaches device b's memory
  bool all_peer_ = true;
  std::unordered_map<int, other_device> others_;
  std::mutex mu_;                         // one enqueue at a time
  cuda::event_t join_ = nullptr;          // where the previous call ended (an event of ours)
  bool join_pending_ = false;             // recorded and not known to be complete
  bool fence_pending_ = false;            // a failed call left end events to wait for
  void* scratch_ = nullptr;               // staging on the home device (no peer access)
  std::size_t scratch_bytes_ = 0;
  bool closed_ = false;
};

cuda_executor::cuda_executor(group::impl& core, cuda::runtime& rt, std::vector<int> gpus)
    : m_(core), rt_(rt), gpus_(std::move(gpus)) {
  const int count = rt_.device_count();
  if (count == 0) {
    throw cuda_error("distvals: no CUDA device is available (" + rt_.unavailable_reason() +
                     "); cannot place replica " + m_.devices[0].str() + " on a GPU");
  }
  if (m_.n > cuda::max_launch_replicas) {
    throw invalid_argument_error("a GPU group holds at most " + std::to_string(cuda::max_launch_replicas) +
                                 " replicas, got " + std::to_string(m_.n));
  }
  for (int r = 0; r < m_.n; ++r) {
    const int gpu = gpus_[r];
    if (gpu < 0 || gpu >= count) {
      throw invalid_argument_error("replica " + std::to_string(r) + " (" + m_.devices[r].str() +
                                   ") needs CUDA device " + std::to_string(gpu) + ", but this machine has " +
                                   std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") +
                                   " (several replicas can share one GPU as logical GPUs)");
    }
  }
  for (int r = 0; r < m_.n; ++r) {
    int d = index_of(gpus_[r]);
    if (d < 0) {
      d = static_cast<int>(devs_.size());
      devs_.push_back(device_state{});
      devs_.back().gpu = gpus_[r];
    }
    dev_of_.push_back(d);
  }
  try {
    cuda::device_scope scope(rt_);
    // Peer access between every pair of distinct devices where the hardware allows it;
    // "already enabled" (by an earlier group or another library) counts as enabled.
    const std::size_t nd = devs_.size();
    peer_.assign(nd, std::vector<char>(nd, 0));
    for (std::size_t a = 0; a < nd; ++a) {
      for (std::size_t b = 0; b < nd; ++b) {
        if (a == b) {
          peer_[a][b] = 1;
          continue;
        }
        if (!m_.opts.peer_access || !rt_.can_access_peer(devs_[a].gpu, devs_[b].gpu)) continue;
        scope.set(devs_[a].gpu);
        peer_[a][b] = rt_.enable_peer_access(devs_[b].gpu) ? 1 : 0;
      }
    }
    for (std::size_t a = 0; a < nd; ++a) {
      for (std::size_t b = 0; b < nd; ++b) all_peer_ = all_peer_ && peer_[a][b];
    }
    // Streams and events, created once: none of them in the hot path.
    for (auto& d : devs_) {
      scope.set(d.gpu);
      d.stream = rt_.stream_create();
      d.start = rt_.event_create(false);
      d.end = rt_.event_create(false);
      d.fork = rt_.event_create(false);
      d.join = rt_.event_create(false);
      d.sms = std::max(1, rt_.multiprocessor_count(d.gpu));
    }
  } catch (...) {
    close();
    throw;
  }
}

void cuda_executor::close() noexcept {
  if (closed_) return;
  closed_ = true;
  // Let queued work finish (bounded) before scratch memory and events go away.
  const auto deadline = deadline_after(m_.opts.timeout);
  for (auto& d : devs_) {
    if (!d.stream) continue;
    try {
      while (!rt_.stream_query(d.stream) && clock_type::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    } catch (...) {
    }
  }
  try {
    cuda::device_scope scope(rt_);
    for (auto& d : devs_) {
      scope.set(d.gpu);
      for (cuda::event_t e : {d.start, d.end, d.fork, d.join}) {
        if (e) rt_.event_destroy(e);
      }
      if (d.stream) rt_.stream_destroy(d.stream);
      d = device_state{d.gpu};
    }
    for (auto& [gpu, o] : others_) {
      scope.set(gpu);
      if (o.fork) rt_.event_destroy(o.fork);
      if (o.join) rt_.event_destroy(o.join);
    }
    others_.clear();
    if (scratch_) rt_.free(scratch_);
    scratch_ = nullptr;
  } catch (...) {
  }
}

// ---- checks --------------------------------------------------------------------------------

void cuda_executor::check_buffer(int r, const buffer_view& b, const char* what) const {
  const std::string who = "replica " + std::to_string(r);
  if (b.dev.is_cpu()) {
    throw invalid_argument_error(who + ": " + what + " is host memory (" + b.dev.str() + "); " + who + " (" +
                                 m_.devices[r].str() + ") needs device memory of CUDA device " +
                                 std::to_string(gpus_[r]));
  }
  if (b.dev.index != gpus_[r]) {
    throw invalid_argument_error(who + ": " + what + " lives on CUDA device " + std::to_string(b.dev.index) + ", but " +
                                 who + " (" + m_.devices[r].str() + ") runs on CUDA device " + std::to_string(gpus_[r]));
  }
  // (Alignment to whole elements is checked for every backend: validate.cpp.)
}

// ---- events on any device ----------------------------------------------------------------------

cuda::event_t cuda_executor::fork_event(int gpu, cuda::device_scope& scope) {
  const int d = index_of(gpu);
  return d >= 0 ? devs_[d].fork : other_event(gpu, &other_device::fork, scope);
}

cuda::event_t cuda_executor::join_event(int gpu, cuda::device_scope& scope) {
  const int d = index_of(gpu);
  return d >= 0 ? devs_[d].join : other_event(gpu, &other_device::join, scope);
}

cuda::event_t cuda_executor::other_event(int gpu, cuda::event_t other_device::*which, cuda::device_scope& scope) {
  cuda::event_t& e = others_[gpu].*which;
  if (!e) {
    scope.set(gpu);
    e = rt_.event_create(false);  // once per foreign device, then cached
  }
  return e;
}

// ---- one call ----------------------------------------------------------------------------------

void cuda_executor::fill_args(cuda::launch_args& a, const call& c, int part, int parts, int sms) const {
  const int slot = static_cast<int>(c.seq & 1u);
  a.n = m_.n;
  a.kind = c.desc.kind;
  a.type = c.desc.type;
  a.op = c.desc.op;
  a.root = c.desc.root;
  a.count = c.desc.count;
  a.part = part;
  a.parts = parts;
  a.multiprocessors = sms;
  for (int r = 0; r < m_.n; ++r) {
    a.in[r] = m_.reps[r].in[slot].data;
    a.out[r] = m_.reps[r].out[slot].data;
  }
}

void cuda_executor::run(const call& c) {
  if (c.desc.count == 0) return;  // nothing to move: nothing is enqueued
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw closed_error("distvals: the group is closed");
  cuda::device_scope scope(rt_);
  const int nd = static_cast<int>(devs_.size());
  const bool async = c.caller != nullptr;

  // Where each device's part runs: the caller's stream on the caller's device, the
  // group's own stream elsewhere (and everywhere for a synchronous call). `home` is the
  // stream the call ends on.
  std::array<cuda::stream_t, cuda::max_launch_replicas> x{};
  int caller_gpu = -1;
  if (async) {
    caller_gpu = c.caller->device >= 0 ? c.caller->device : -1;
    if (caller_gpu < 0) {
      scope.set(devs_[0].gpu);  // a special handle means the current device's stream
      caller_gpu = rt_.stream_device(c.caller->handle);
    }
  }
  const int home = async ? index_of(caller_gpu) : 0;
  for (int d = 0; d < nd; ++d) x[d] = async && d == home ? c.caller->handle : devs_[d].stream;
  const cuda::stream_t home_stream = async ? c.caller->handle : devs_[0].stream;
  const int home_gpu = async ? caller_gpu : devs_[0].gpu;
  // Device d's stream waits for `e`, with device d current: x[home] may be the caller's
  // special handle (0, 1, 2: the *current* device's default stream), so a wait made with
  // another device current would order that device's default stream instead.
  auto wait = [&](int d, cuda::event_t e) {
    scope.set(devs_[d].gpu);
    rt_.stream_wait_event(x[d], e);
  };

  try {
    // Step 1: order after what must come first. (a) A synchronous call follows the work
    // queued on each device's legacy default stream; an asynchronous one makes the group
    // streams it uses follow the caller's stream.
    if (!async) {
      for (int d = 0; d < nd; ++d) {
        scope.set(devs_[d].gpu);
        rt_.event_record(devs_[d].fork, cuda::legacy_stream());
        rt_.stream_wait_event(x[d], devs_[d].fork);
      }
    } else if (home < 0) {
      // (With the caller's device in the group, its start event below does this.)
      scope.set(caller_gpu);
      cuda::event_t f = fork_event(caller_gpu, scope);
      rt_.event_record(f, c.caller->handle);
      for (int d = 0; d < nd; ++d) {
        if (d != home) wait(d, f);
      }
    }
    // (b) The previous call of this group, through its one join event (and, after a
    // failed call, the end events it left), unless the host has seen it complete.
    if (join_pending_) {
      for (int d = 0; d < nd; ++d) wait(d, join_);
    }
    if (fence_pending_) {
      for (int d = 0; d < nd; ++d) {
        for (int e = 0; e < nd; ++e) wait(d, devs_[e].end);
      }
      fence_pending_ = false;
    }
    // (c) Streams named by the caller (where the inputs were produced).
    for (int w = 0; w < c.nwait; ++w) {
      const stream_ref& p = c.wait_for[w];
      int gpu = p.device;
      if (gpu < 0) {
        scope.set(devs_[0].gpu);
        gpu = rt_.stream_device(p.handle);
      }
      scope.set(gpu);
      cuda::event_t f = fork_event(gpu, scope);
      rt_.event_record(f, p.handle);
      for (int d = 0; d < nd; ++d) wait(d, f);
    }
    // Step 2 (several devices): every device starts only when every device has reached
    // this call, since each one reads and writes the others' buffers.
    if (nd > 1) {
      for (int d = 0; d < nd; ++d) {
        scope.set(devs_[d].gpu);
        rt_.event_record(devs_[d].start, x[d]);
      }
      for (int d = 0; d < nd; ++d) {
        for (int e = 0; e < nd; ++e) {
          if (e != d) wait(d, devs_[e].start);
        }
      }
    }
    // Step 3: the kernels. One launch per device over its part of every segment, or, when
    // some device cannot reach another's memory, one launch on the first device with
    // the unreachable buffers staged.
    if (all_peer_) {
      for (int d = 0; d < nd; ++d) {
        scope.set(devs_[d].gpu);
        cuda::launch_args a{};
        fill_args(a, c, d, nd, devs_[d].sms);
        rt_.launch(a, x[d]);
      }
    } else {
      staged_launch(c, x[0], scope);
    }
    // Step 4: join. Every other device's end, then one join event on the home stream.
    if (nd > 1) {
      for (int d = 0; d < nd; ++d) {
        if (d == home) continue;
        scope.set(devs_[d].gpu);
        rt_.event_record(devs_[d].end, x[d]);
      }
      scope.set(home_gpu);
      for (int d = 0; d < nd; ++d) {
        if (d != home) rt_.stream_wait_event(home_stream, devs_[d].end);
      }
    } else if (home < 0) {
      scope.set(devs_[0].gpu);
      rt_.event_record(devs_[0].end, x[0]);
      scope.set(home_gpu);
      rt_.stream_wait_event(home_stream, devs_[0].end);
    }
    scope.set(home_gpu);
    cuda::event_t j = join_event(home_gpu, scope);
    rt_.event_record(j, home_stream);
    join_ = j;
    join_pending_ = true;
  } catch (...) {
    fence_after_failure(x.data(), nd, scope);
    throw;
  }
  if (!async) {
    wait_on_host(join_, c);
    join_pending_ = false;  // seen complete: the next call need not wait for it
  }
}

void cuda_executor::fence_after_failure(const cuda::stream_t* x, int nx, cuda::device_scope& scope) noexcept {
  // Part of the call may be enqueued (a kernel on one device, not on another): record an
  // end event on every stream it used, and make the next call wait for all of them, so
  // it never overtakes work of this one that may still run.
  for (int d = 0; d < nx; ++d) {
    try {
      scope.set(devs_[d].gpu);
      rt_.event_record(devs_[d].end, x[d]);
    } catch (...) {
    }
  }
  fence_pending_ = true;
}

void cuda_executor::wait_on_host(cuda::event_t e, const call& c) {
  cuda::wait_for_event(
      rt_, e, c.deadline,
      [&]() {
        if (m_.opts.interrupted && m_.opts.interrupted()) m_.fail(group::impl::aborted, -1, "interrupted");
        m_.throw_if_failed(c.me);
      },
      [&]() {
        const std::string msg = "distvals: " + std::string(collective_name(c.desc.kind)) + " on GPU timed out after " +
                                timeout_text(c.timeout) + ": the kernels of this call are still running";
        m_.fail(group::impl::timed_out, c.me, msg);
        return msg;
      });
}

void cuda_executor::staged_launch(const call& c, cuda::stream_t s, cuda::device_scope& scope) {
  // The first device (`hub`) runs the whole collective. A replica whose memory it cannot
  // reach gets scratch regions on the hub: its input is copied in before the kernel, its
  // output copied back after (one region when it runs in place).
  const int slot = static_cast<int>(c.seq & 1u);
  const call_desc& d = c.desc;
  const std::size_t es = dtype_size(d.type);
  const std::size_t out_count = d.kind == collective::all_gather       ? d.count * static_cast<std::size_t>(m_.n)
                                : d.kind == collective::reduce_scatter ? d.count / static_cast<std::size_t>(m_.n)
                                                                       : d.count;
  auto writes = [&](int r) { return d.kind != collective::reduce || r == d.root; };
  // Step 1: where each unreachable buffer goes in scratch: its input region (when it is
  // read, or written in place) and its output region (written out of place).
  struct staging {
    bool copy_in = false, in_region = false, out_region = false;
    std::size_t in_at = 0, out_at = 0;
  };
  std::array<staging, cuda::max_launch_replicas> plan{};
  std::size_t need = 0;
  for (int r = 0; r < m_.n; ++r) {
    if (peer_[0][dev_of_[r]]) continue;
    staging& p = plan[r];
    const bool in_place = m_.reps[r].in[slot].data == m_.reps[r].out[slot].data;
    p.copy_in = d.kind != collective::broadcast || r == d.root;
    p.in_region = p.copy_in || (in_place && writes(r));
    p.out_region = writes(r) && !in_place;
    if (p.in_region) {
      p.in_at = need;
      need += round_up(std::max(d.count, out_count) * es, kScratchAlign);
    }
    if (p.out_region) {
      p.out_at = need;
      need += round_up(out_count * es, kScratchAlign);
    }
  }
  scope.set(devs_[0].gpu);
  if (need > scratch_bytes_) {
    // Growing: the old scratch may still be read by the previous call's copies.
    if (join_pending_) wait_on_host(join_, c);
    join_pending_ = false;
    if (scratch_) rt_.free(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    scratch_ = rt_.malloc(need);
    scratch_bytes_ = need;
  }
  char* base = static_cast<char*>(scratch_);
  // Step 2: copy in, each copy naming the device that holds its source, and point the
  // kernel at the scratch regions.
  cuda::launch_args a{};
  fill_args(a, c, 0, 1, devs_[0].sms);
  for (int r = 0; r < m_.n; ++r) {
    const staging& p = plan[r];
    if (p.copy_in) {
      rt_.memcpy_peer_async(base + p.in_at, devs_[0].gpu, m_.reps[r].in[slot].data, gpus_[r], d.count * es, s);
    }
    if (p.in_region) a.in[r] = a.out[r] = base + p.in_at;
    if (p.out_region) a.out[r] = base + p.out_at;
  }
  // Step 3: the kernel, then copy the results out to their devices.
  rt_.launch(a, s);
  for (int r = 0; r < m_.n; ++r) {
    if (peer_[0][dev_of_[r]] || !writes(r)) continue;
    rt_.memcpy_peer_async(m_.reps[r].out[slot].data, gpus_[r], a.out[r], devs_[0].gpu, out_count * es, s);
  }
}

}  // namespace

std::unique_ptr<executor> make_cuda_executor(group::impl& core, cuda::runtime& rt, std::vector<int> gpus) {
  if (gpus.size() != static_cast<std::size_t>(core.n)) {
    throw invalid_argument_error("a GPU group needs one CUDA device per replica: " + std::to_string(core.n) +
                                 " replicas, " + std::to_string(gpus.size()) + " devices");
  }
  return std::make_unique<cuda_executor>(core, rt, std::move(gpus));
}

namespace {
cuda_executor& cuda_of(group::impl& core) {
  auto* e = dynamic_cast<cuda_executor*>(core.exec.get());
  if (e == nullptr) throw invalid_argument_error("distvals: this is not a group of GPU replicas");
  return *e;
}
void check_index(group::impl& core, int r) {
  if (r < 0 || r >= core.n) {
    throw invalid_argument_error("replica " + std::to_string(r) + " is out of range for a group of " +
                                 std::to_string(core.n));
  }
}
}  // namespace

const std::vector<int>& cuda_gpus(group::impl& core) { return cuda_of(core).gpus(); }

bool cuda_reach(group::impl& core, int a, int b) {
  check_index(core, a);
  check_index(core, b);
  return cuda_of(core).reach(a, b);
}

void* cuda_replica_stream(group::impl& core, int r) {
  check_index(core, r);
  if (core.state.load() == group::impl::closed) throw closed_error("distvals: the group is closed");
  return cuda_of(core).replica_stream(r);
}

}  // namespace distvals::detail
