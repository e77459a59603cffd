// The launcher of the collective kernel (kernels.cu), for the real runtime. Needs the
// CUDA headers. Not installed.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/launch.hpp"

namespace distvals::cuda {

/// Enqueues the collective kernel over `a` on `stream` (a stream of the current device):
/// one grid of one full wave of resident blocks at most, segments along y. Returns the
/// launch status; never throws.
cudaError_t launch_collective(const launch_args& a, cudaStream_t stream) noexcept;

}  // namespace distvals::cuda
