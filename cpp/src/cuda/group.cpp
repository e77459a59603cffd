// distvals::cuda::group: the GPU-only calls of a group of GPU replicas, over the shared
// group state and its CUDA executor.
#include "distvals/cuda/group.hpp"

#include <string>

#include "factory.hpp"
#include "group_impl.hpp"

namespace distvals::cuda {
namespace {

std::unique_ptr<distvals::group::impl> state_for_gpus(const std::vector<int>& gpus, group_options options) {
  if (gpus.empty()) throw invalid_argument_error("a GPU group needs at least 1 device");
  std::vector<device> names(gpus.size());
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    names[i].kind = device::kind_t::gpu;
    names[i].index = static_cast<int>(i);
  }
  return detail::make_state(names, std::move(options), nullptr, &gpus);
}

std::unique_ptr<distvals::group::impl> state_for_devices(const std::vector<device>& devices, int logical_per_gpu,
                                                         group_options options) {
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].is_cpu()) {
      throw invalid_argument_error("device " + devices[i].str() + " (replica " + std::to_string(i) +
                                   ") is a CPU; a GPU group runs GPU replicas only");
    }
  }
  options.logical_per_gpu = logical_per_gpu;
  return detail::make_state(devices, std::move(options));
}

std::vector<detail::stream_ref> refs(const std::vector<stream_view>& streams) {
  std::vector<detail::stream_ref> out;
  out.reserve(streams.size());
  for (const stream_view& s : streams) out.push_back({s.value(), s.device()});
  return out;
}

}  // namespace

group::group(const std::vector<int>& gpus, group_options options)
    : distvals::group(state_for_gpus(gpus, std::move(options))) {}

group::group(const std::vector<device>& devices, int logical_per_gpu, group_options options)
    : distvals::group(state_for_devices(devices, logical_per_gpu, std::move(options))) {}

const std::vector<int>& group::gpus() const noexcept { return detail::cuda_gpus(state()); }

bool group::direct_access(int a, int b) const noexcept {
  try {
    return detail::cuda_reach(state(), a, b);
  } catch (...) {
    return false;
  }
}

stream_view group::replica_stream(int r) const {
  return stream_view(static_cast<CUstream_st*>(detail::cuda_replica_stream(state(), r)), gpus().at(r));
}

void group::run(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                const std::vector<stream_view>& wait_for) {
  state().run_single(desc, in, out, nullptr, refs(wait_for));
}

void group::enqueue(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                    stream_view caller, const std::vector<stream_view>& wait_for) {
  const detail::stream_ref c{caller.value(), caller.device()};
  state().run_single(desc, in, out, &c, refs(wait_for));
}

void group::run(int replica, const call_desc& desc, buffer_view in, buffer_view out, const replica_options& options,
                stream_view wait_for) {
  const detail::stream_ref w{wait_for.value(), wait_for.device()};
  state().run_replica(replica, desc, in, out, options, &w);
}

algorithm choose_gpu_algorithm(const group&, std::size_t) noexcept { return algorithm::direct; }

}  // namespace distvals::cuda
