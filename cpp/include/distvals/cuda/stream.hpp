/// @file
/// Streams and events: an owning stream, a non-owning stream_view and an event.
///
/// The handles are the CUDA runtime's own (cudaStream_t is CUstream_st*), declared
/// here without the CUDA headers, so code that only passes streams around needs no
/// CUDA include path. Every blocking wait takes a timeout.
#pragma once

#include "distvals/config.hpp"
#if !DISTVALS_HAS_CUDA
#error "distvals/cuda/stream.hpp needs distvals built with the CUDA backend (DISTVALS_ENABLE_CUDA=ON or AUTO with nvcc found)"
#endif

#include <chrono>

#include "distvals/export.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct CUevent_st;   // cudaEvent_t is CUevent_st*

namespace distvals::cuda {

/// A stream someone else owns: a cudaStream_t (or a cupy/torch stream's pointer) and the
/// device it belongs to. The null handle is the legacy default stream of `device`.
/// device -1 means "ask CUDA" (CUDA 12.8 and newer) or, failing that, the group's first GPU.
class stream_view {
 public:
  constexpr stream_view() noexcept = default;
  constexpr stream_view(CUstream_st* handle, int device = -1) noexcept : handle_(handle), device_(device) {}
  constexpr CUstream_st* value() const noexcept { return handle_; }
  constexpr int device() const noexcept { return device_; }

 private:
  CUstream_st* handle_ = nullptr;
  int device_ = -1;
};

/// An owning, non-blocking stream on one device. Move-only.
class DISTVALS_EXPORT stream {
 public:
  /// Creates a stream on CUDA device `gpu` (cudaStreamNonBlocking). Throws cuda_error.
  explicit stream(int gpu);
  ~stream();
  stream(stream&& o) noexcept;
  stream& operator=(stream&& o) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  CUstream_st* value() const noexcept { return handle_; }
  int device() const noexcept { return device_; }
  stream_view view() const noexcept { return {handle_, device_}; }
  /// Waits until all work on the stream is done; timeout_error past `timeout` (0: 300 s).
  void synchronize(std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0}) const;

 private:
  CUstream_st* handle_ = nullptr;
  int device_ = -1;
};

/// An event on one device (timing disabled unless asked for). Move-only.
class DISTVALS_EXPORT event {
 public:
  /// Creates an event on CUDA device `gpu`. Throws cuda_error.
  explicit event(int gpu, bool timing = false);
  ~event();
  event(event&& o) noexcept;
  event& operator=(event&& o) noexcept;
  event(const event&) = delete;
  event& operator=(const event&) = delete;

  CUevent_st* value() const noexcept { return handle_; }
  int device() const noexcept { return device_; }
  /// Records the event on `s`, which must belong to the event's device.
  void record(stream_view s);
  /// True once the work recorded before it has completed. Throws cuda_error.
  bool ready() const;
  /// Waits on the host until ready(); timeout_error past `timeout` (0: 300 s).
  void synchronize(std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0}) const;
  /// Milliseconds between two recorded timing events.
  static float elapsed_ms(const event& start, const event& stop);

 private:
  CUevent_st* handle_ = nullptr;
  int device_ = -1;
};

}  // namespace distvals::cuda
