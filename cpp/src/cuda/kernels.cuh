// CUDA kernels that reduce and copy bytes, and their launchers. The executor decides
// what goes where; these only do the element-wise work of one step. Not installed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "distvals/dtype.hpp"

namespace distvals::cuda::kernels {

/// Most sources or destinations of one step: a step of an N-replica schedule reads
/// at most N sources and writes at most N destinations, and groups stop at 64.
constexpr int kMaxPointers = 64;

/// The arguments of one launch, passed by value (about 1 KiB of kernel parameters).
struct step_args {
  const void* srcs[kMaxPointers];
  void* dsts[kMaxPointers];
  int nsrc;
  int ndst;
  std::size_t count;  ///< elements (reduce) or bytes (copy)
  double divisor;     ///< non-zero: divide each result by it (mean)
};

/// Enqueues dsts[d][i] = op(srcs[0][i], srcs[1][i], ...) for i < count, on `stream`
/// (which must belong to the current device). float16 and bfloat16 accumulate in
/// float32; integer sum and product wrap around. Destinations may be sources (same
/// offsets): each element is read from every source before it is written.
/// `max_blocks` caps the grid. Returns the launch status.
cudaError_t launch_reduce(const step_args& a, dtype type, reduce_op op, int max_blocks,
                          cudaStream_t stream) noexcept;

/// Enqueues a copy of `a.count` bytes from srcs[0] to every destination.
cudaError_t launch_copy(const step_args& a, int max_blocks, cudaStream_t stream) noexcept;

}  // namespace distvals::cuda::kernels
