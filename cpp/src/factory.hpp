// How a group gets its executor, and the GPU-only calls on a group's state. Used by
// group.cpp, the public CUDA group and the tests. Not installed.
#pragma once

#include <memory>
#include <vector>

#include "group_impl.hpp"

namespace distvals::cuda {
class runtime;
}

namespace distvals::detail {

/// The executor of CPU replicas (cpu/executor.cpp).
std::unique_ptr<executor> make_cpu_executor(group::impl& core);

/// The executor of GPU replicas (cuda/executor.cpp) over `rt`: replica r runs on CUDA
/// device gpus[r]. Throws invalid_argument_error for a device that does not exist or too
/// many replicas, cuda_error without a usable GPU.
std::unique_ptr<executor> make_cuda_executor(group::impl& core, cuda::runtime& rt, std::vector<int> gpus);

/// A checked group state over `devices` with its executor installed: CPU replicas get
/// the CPU executor, GPU replicas the CUDA executor over `rt` (the real CUDA runtime
/// when null), replica r on CUDA device (*gpus)[r], or devices[r].index /
/// options.logical_per_gpu when `gpus` is null. Throws like group's constructor.
std::unique_ptr<group::impl> make_state(const std::vector<device>& devices, group_options options,
                                        cuda::runtime* rt = nullptr, const std::vector<int>* gpus = nullptr);

// ---- GPU groups only: the CUDA executor of `core` (invalid_argument_error otherwise) ------
/// The CUDA device of each replica.
const std::vector<int>& cuda_gpus(group::impl& core);
/// Replica a's kernels reach replica b's memory directly.
bool cuda_reach(group::impl& core, int a, int b);
/// The group's stream on replica r's device (work queued there comes before the next
/// synchronous call that touches r's buffers).
void* cuda_replica_stream(group::impl& core, int r);

}  // namespace distvals::detail
