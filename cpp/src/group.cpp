// distvals::group: construction, argument checks and the single-call style. The
// per-replica meeting is in meeting.cpp, failure handling in failure.cpp, the gate
// between the styles in gate.cpp; executors run the steps.
#include "distvals/group.hpp"

#include <algorithm>
#include <string>
#include <thread>

#include "cuda/runtime_api.hpp"
#include "distvals/error.hpp"
#include "factory.hpp"
#include "group_impl.hpp"
#include "validate.hpp"

namespace distvals {
namespace {

std::vector<device> cpu_devices(int n) {
  if (n < 1) throw invalid_argument_error("a group needs at least 1 replica, got " + std::to_string(n));
  if (n > max_group_size) {
    throw invalid_argument_error("a group of " + std::to_string(n) + " replicas is too large (at most " +
                                 std::to_string(max_group_size) + ")");
  }
  std::vector<device> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[i].index = i;
  return d;
}

}  // namespace

// ---- construction ------------------------------------------------------------------------

group::impl::impl(std::vector<device> devs, group_options options)
    : n(static_cast<int>(devs.size())), devices(std::move(devs)), opts(std::move(options)) {
  opts.timeout = detail::resolve_timeout(opts.timeout);
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // Oversubscribed: spinning only steals the core we wait for.
  // At most 10 ms: a spin checks neither the deadline nor the interrupt hook, and the
  // executor's spins are a multiple of it (a larger value would outlast short timeouts).
  spin_us = opts.spin_us >= 0 ? std::min(opts.spin_us, max_spin_us) : (n > hw ? 0 : 20);
  opts.spin_us = spin_us;
  if (opts.chunk_bytes == 0) opts.chunk_bytes = 256 * 1024;
  reps.reset(new replica_state[static_cast<std::size_t>(n)]);
  fork_gen.store(detail::fork_generation());
}

namespace detail {

std::unique_ptr<group::impl> make_state(const std::vector<device>& devices, group_options options,
                                        cuda::runtime* rt, const std::vector<int>* gpus) {
  if (devices.empty()) throw invalid_argument_error("a group needs at least 1 device");
  if (devices.size() > static_cast<std::size_t>(max_group_size)) {
    throw invalid_argument_error("a group of " + std::to_string(devices.size()) + " replicas is too large (at most " +
                                 std::to_string(max_group_size) + ")");
  }
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].index < 0) {
      throw invalid_argument_error("replica " + std::to_string(i) + "'s device has index " +
                                   std::to_string(devices[i].index) + "; device indices start at 0");
    }
    if (devices[i].is_cpu() != devices[0].is_cpu()) {
      throw invalid_argument_error("a group runs either CPU or GPU replicas, not both: replica 0 is " +
                                   devices[0].str() + ", replica " + std::to_string(i) + " is " + devices[i].str());
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        throw invalid_argument_error("device " + devices[i].str() + " is listed twice (replicas " +
                                     std::to_string(j) + " and " + std::to_string(i) + ")");
      }
    }
  }
  auto state = std::make_unique<group::impl>(devices, std::move(options));
  if (devices[0].is_cpu()) {
    state->exec = make_cpu_executor(*state);
    return state;
  }
  if (rt == nullptr) rt = cuda::real_runtime();
  if (rt == nullptr) {
    throw invalid_argument_error("replica 0 is " + devices[0].str() +
                                 ", but distvals was built without the CUDA backend (DISTVALS_ENABLE_CUDA=OFF, or "
                                 "no nvcc at build time)");
  }
  std::vector<int> placed;
  if (gpus != nullptr) {
    placed = *gpus;
  } else {
    const int per = state->opts.logical_per_gpu;
    if (per < 1) throw invalid_argument_error("logical GPUs per device must be at least 1, got " + std::to_string(per));
    for (const device& d : devices) placed.push_back(d.index / per);
  }
  state->exec = make_cuda_executor(*state, *rt, std::move(placed));
  return state;
}

}  // namespace detail

group::group(int replicas, group_options options) : group(cpu_devices(replicas), std::move(options)) {}

group::group(const std::vector<device>& devices, group_options options)
    : impl_(detail::make_state(devices, std::move(options))) {}

group::group(std::unique_ptr<impl> state) noexcept : impl_(std::move(state)) {}

group::~group() { close(); }

int group::size() const noexcept { return impl_->n; }
const std::vector<device>& group::devices() const noexcept { return impl_->devices; }
const group_options& group::options() const noexcept { return impl_->opts; }

int group::set_linger_us(int us) noexcept {
  return impl_->linger_us.exchange(std::clamp(us, 0, 100000), std::memory_order_relaxed);
}

int group::batch(bool open) noexcept {
  std::atomic<int>& count = impl_->open_batches;
  if (open) return count.fetch_add(1, std::memory_order_relaxed) + 1;
  // Never below zero: an unmatched close must not cancel a later batch's open.
  int now = count.load(std::memory_order_relaxed);
  while (now > 0 && !count.compare_exchange_weak(now, now - 1, std::memory_order_relaxed)) {
  }
  return now > 0 ? now - 1 : 0;
}

// ---- checks shared by both styles ------------------------------------------------------------

void group::impl::check_replica(const call_desc& d, int r, const buffer_view& in, const buffer_view& out) const {
  validate_replica_buffers(d, n, r, in, out);
  // Where the memory lives: only the buffers the collective touches.
  const bool reads = d.kind != collective::broadcast || r == d.root;
  const bool writes = d.kind != collective::reduce || r == d.root;
  if (reads && in.count > 0) exec->check_buffer(r, in, "input");
  if (writes && out.count > 0) exec->check_buffer(r, out, "output");
}

algorithm group::impl::resolve_algorithm(const call_desc& d) const noexcept {
  if (d.algo != algorithm::automatic) return d.algo;
  return d.kind == collective::all_reduce ? exec->choose_algorithm(d) : algorithm::direct;
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

// ---- single-call style ----------------------------------------------------------------

namespace {
struct inside_guard {
  std::atomic<int>& c;
  explicit inside_guard(std::atomic<int>& x) : c(x) { c.fetch_add(1); }
  ~inside_guard() { c.fetch_sub(1); }
};
}  // namespace

void group::impl::run_single(const call_desc& desc_in, const std::vector<buffer_view>& in,
                             const std::vector<buffer_view>& out, const detail::stream_ref* caller,
                             const std::vector<detail::stream_ref>& wait_for) {
  check_fork();
  inside_guard guard(inside);
  if (state.load() == closed) throw closed_error("distvals: the group is closed");
  // Step 1: every argument, before anything is touched or enqueued.
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n) {
    throw invalid_argument_error("expected " + std::to_string(n) + " input and output buffers (one per replica), got " +
                                 std::to_string(in.size()) + " and " + std::to_string(out.size()));
  }
  call_desc desc = desc_in;
  for (int r = 0; r < n; ++r) check_replica(desc, r, in[r], out[r]);
  detail::check_overlaps(desc, in, out);
  desc.algo = resolve_algorithm(desc);

  // Step 2: one collective at a time: other single callers, then per-replica callers.
  std::lock_guard<std::mutex> call_lock(call_mu);
  throw_if_failed_at_start(-1);
  const auto deadline = detail::deadline_after(opts.timeout);
  enter_single(deadline, opts.timeout, desc);
  struct leave {
    impl& m;
    ~leave() { m.leave_single(); }
  } leave_gate{*this};

  // Step 3: post the call for every replica, mark them all arrived, and run it.
  const std::uint64_t seq = reps[0].seq.load() + 1;
  const int slot = static_cast<int>(seq & 1u);
  for (int r = 0; r < n; ++r) {
    auto& rs = reps[r];
    rs.seq.store(seq);
    rs.desc[slot] = desc;
    rs.in[slot] = in[r];
    rs.out[slot] = out[r];
    rs.error[slot].clear();
    rs.has_wait_for[slot] = false;
  }
  for (int r = 0; r < n; ++r) reps[r].progress.store(seq << 32);
  detail::call c;
  c.desc = desc;
  c.seq = seq;
  c.deadline = deadline;
  c.timeout = opts.timeout;
  c.caller = caller;
  c.wait_for = wait_for.empty() ? nullptr : wait_for.data();
  c.nwait = static_cast<int>(wait_for.size());
  exec->run(c);
}

void group::run(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  impl_->run_single(desc, in, out, nullptr, {});
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

}  // namespace distvals
