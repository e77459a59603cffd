/// @file
/// The CUDA devices of this machine: how many, which can reach which, and plain copies.
///
/// Safe on a machine without a GPU or a driver: device_count() is then 0 and
/// unavailable_reason() says why. Nothing here needs the CUDA headers.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/runtime.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <chrono>
#include <cstddef>
#include <string>

#include "distvals/cuda/stream.hpp"
#include "distvals/export.hpp"

namespace distvals::cuda {

/// Number of CUDA devices; 0 when there is no GPU or no (recent enough) driver. Never throws.
DISTVALS_EXPORT int device_count() noexcept;
/// Why device_count() is 0 (the CUDA error text), or "" when devices exist. Never throws.
DISTVALS_EXPORT std::string unavailable_reason();
/// The CUDA runtime version compiled in (e.g. 13000). Never throws.
DISTVALS_EXPORT int runtime_version() noexcept;
/// The driver's CUDA version, or 0 without a driver. Never throws.
DISTVALS_EXPORT int driver_version() noexcept;
/// True when a kernel on device `from` can read and write memory of device `to`
/// directly (the same device, or peer access supported). Never throws.
DISTVALS_EXPORT bool can_access_peer(int from, int to) noexcept;
/// The name of device `gpu` ("NVIDIA H200"). Throws cuda_error.
DISTVALS_EXPORT std::string device_name(int gpu);

/// The CUDA device that holds `ptr`, or -1 for host or unknown memory. Never throws.
DISTVALS_EXPORT int pointer_device(const void* ptr) noexcept;

/// Enqueues a copy of `bytes` bytes on `stream` (any direction; between devices it is
/// staged by the driver where peer access is missing). Throws cuda_error.
DISTVALS_EXPORT void copy_async(void* dst, const void* src, std::size_t bytes, stream_view stream);

/// Copies `bytes` bytes and returns when they have arrived. Ordered after all earlier
/// work on the legacy default stream of device `gpu` (and the blocking streams there).
/// Throws timeout_error past `timeout` (0: 300 s), cuda_error on CUDA failures.
DISTVALS_EXPORT void copy(void* dst, const void* src, std::size_t bytes, int gpu,
                          std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0});

/// Waits on the host until all work queued on `s` so far is done (the null handle: the
/// legacy default stream of device s.device(), or of the current device when -1).
/// Throws timeout_error past `timeout` (0: 300 s), cuda_error on CUDA failures.
DISTVALS_EXPORT void synchronize(stream_view s, std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0});

/// Sets `bytes` bytes of device memory at `ptr` (on device `gpu`) to `value` and waits,
/// like copy(). Throws timeout_error or cuda_error.
DISTVALS_EXPORT void fill_bytes(void* ptr, int value, std::size_t bytes, int gpu,
                                std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0});

}  // namespace distvals::cuda
