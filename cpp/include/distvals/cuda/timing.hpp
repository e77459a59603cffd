/// @file
/// Timing helpers for the GPU benchmark, measured with CUDA events.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/timing.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <cstddef>
#include <vector>

#include "distvals/cuda/group.hpp"
#include "distvals/export.hpp"

namespace distvals::cuda {

/// Enqueues `desc` `warmup + iterations` times back to back on a stream of the group's
/// first GPU (group::enqueue) and returns the seconds of each of the last `iterations`
/// calls, between events recorded before and after each call. Host enqueue time the
/// GPU has to wait for is included. Throws like group::enqueue, timeout_error.
DISTVALS_EXPORT std::vector<double> time_collective(group& g, const call_desc& desc,
                                                    const std::vector<buffer_view>& in,
                                                    const std::vector<buffer_view>& out, int iterations,
                                                    int warmup);

/// Device-to-device copy bandwidth of CUDA device `gpu`: seconds of each of
/// `iterations` copies of `bytes` bytes between two buffers of that device
/// (2 · bytes move through device memory per copy). Throws cuda_error, timeout_error.
DISTVALS_EXPORT std::vector<double> time_copy(int gpu, std::size_t bytes, int iterations, int warmup);

}  // namespace distvals::cuda
