/// @file
/// DISTVALS_CUDA_TRY: the one check every CUDA runtime call of distvals goes through.
///
/// Needs the CUDA runtime headers (and, to call CUDA yourself, the CUDA runtime
/// library); the other headers of distvals/cuda/ do not.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/error.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <cuda_runtime_api.h>

#include "distvals/error.hpp"
#include "distvals/export.hpp"

namespace distvals::cuda::detail {
/// Throws distvals::cuda_error: "distvals: CUDA call `call` failed at file:line: name (text)".
[[noreturn]] DISTVALS_EXPORT void throw_cuda_error(const char* call, const char* file, int line, int error,
                                                   const char* name, const char* text);
}  // namespace distvals::cuda::detail

/// Runs a CUDA runtime call; on any result but cudaSuccess clears the runtime's last
/// error and throws distvals::cuda_error naming the call, the file, the line and the error.
#define DISTVALS_CUDA_TRY(call)                                                                   \
  do {                                                                                            \
    const cudaError_t dv_cuda_status_ = (call);                                                   \
    if (dv_cuda_status_ != cudaSuccess) {                                                         \
      (void)cudaGetLastError();                                                                   \
      ::distvals::cuda::detail::throw_cuda_error(#call, __FILE__, __LINE__,                       \
                                                 static_cast<int>(dv_cuda_status_),               \
                                                 cudaGetErrorName(dv_cuda_status_),               \
                                                 cudaGetErrorString(dv_cuda_status_));            \
    }                                                                                             \
  } while (0)
