/// @file
/// Owning buffers of device memory (cudaMalloc; never managed memory).
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/device_buffer.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <cstddef>

#include "distvals/buffer.hpp"
#include "distvals/export.hpp"

namespace distvals::cuda {

/// `bytes` bytes of memory on CUDA device `gpu`, uninitialized. Move-only; freed with
/// cudaFree (which waits for work still using it).
class DISTVALS_EXPORT device_buffer {
 public:
  device_buffer() = default;
  /// Allocates with cudaMalloc on device `gpu`. Throws invalid_argument_error for a
  /// device that does not exist, cuda_error when the allocation fails.
  device_buffer(std::size_t bytes, int gpu);
  ~device_buffer();
  device_buffer(device_buffer&& o) noexcept;
  device_buffer& operator=(device_buffer&& o) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  int device() const noexcept { return device_; }
  /// A view of the first bytes()/dtype_size(t) elements as dtype `t`, on "GPU:<device>".
  buffer_view view(dtype t) const noexcept;

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
};

/// A view of `count` elements at device pointer `ptr` on CUDA device `gpu`.
inline buffer_view device_view(void* ptr, std::size_t count, dtype t, int gpu) noexcept {
  buffer_view v;
  v.data = ptr;
  v.count = count;
  v.type = t;
  v.dev.kind = device::kind_t::gpu;
  v.dev.index = gpu;
  return v;
}

}  // namespace distvals::cuda
