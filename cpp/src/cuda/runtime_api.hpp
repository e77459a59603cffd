// The CUDA runtime as the CUDA executor sees it: a small interface with two
// implementations, the real CUDA runtime (real_runtime.cpp, built only with the CUDA
// backend) and a host model with CUDA's semantics (host_model.cpp), on which the
// executor's orchestration is tested on every machine, also under ThreadSanitizer.
// Not installed.
//
// Handles are opaque pointers: a stream_t is a cudaStream_t, an event_t a cudaEvent_t.
// As in CUDA, the special stream handles 0 and 1 (the legacy default stream) and 2 (the
// per-thread default stream) mean the default stream of the *current* device. Every
// failure throws distvals::cuda_error naming the call.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "cuda/launch.hpp"

namespace distvals::cuda {

using stream_t = void*;
using event_t = void*;

/// cudaStreamLegacy's value: the legacy default stream of the current device.
inline stream_t legacy_stream() noexcept { return reinterpret_cast<stream_t>(std::uintptr_t{1}); }

class runtime {
 public:
  virtual ~runtime() = default;

  // ---- devices -----------------------------------------------------------------------
  /// Number of usable devices; 0 without a GPU or a driver. Never throws.
  virtual int device_count() noexcept = 0;
  /// Why device_count() is 0, or "". Never throws but std::bad_alloc.
  virtual std::string unavailable_reason() = 0;
  /// The device current on this thread, or -1 when the thread never made one current
  /// (no context): a guard then has nothing to restore.
  virtual int current_device() = 0;
  virtual void set_device(int gpu) = 0;
  virtual int multiprocessor_count(int gpu) = 0;
  /// Device `from` can reach device `to`'s memory (peer access supported, or the same).
  virtual bool can_access_peer(int from, int to) noexcept = 0;
  /// Enables access from the current device to `peer`'s memory; true when enabled (or
  /// already enabled), false when refused.
  virtual bool enable_peer_access(int peer) noexcept = 0;
  /// The device that holds `ptr`, or -1 for host or unknown memory. Never throws.
  virtual int pointer_device(const void* ptr) noexcept = 0;

  // ---- streams and events --------------------------------------------------------------
  /// A new non-blocking stream on the current device.
  virtual stream_t stream_create() = 0;
  virtual void stream_destroy(stream_t s) noexcept = 0;
  /// The device of stream `s` (a special handle: the current device).
  virtual int stream_device(stream_t s) = 0;
  /// True when every operation queued on `s` so far has completed.
  virtual bool stream_query(stream_t s) = 0;
  /// A new event on the current device (with timing when `timing`).
  virtual event_t event_create(bool timing) = 0;
  virtual void event_destroy(event_t e) noexcept = 0;
  /// Marks the point in `s` that the event completes at (replacing an earlier record).
  virtual void event_record(event_t e, stream_t s) = 0;
  /// Later work on `s` waits until the event's latest record (at the time of this call)
  /// has completed; nothing when the event was never recorded.
  virtual void stream_wait_event(stream_t s, event_t e) = 0;
  /// True when the latest record has completed (or there was none).
  virtual bool event_query(event_t e) = 0;
  virtual float event_elapsed_ms(event_t start, event_t stop) = 0;

  // ---- memory and work -------------------------------------------------------------------
  /// `bytes` of memory on the current device.
  virtual void* malloc(std::size_t bytes) = 0;
  virtual void free(void* p) noexcept = 0;
  /// A copy of `bytes` bytes in any direction (unified addressing), on `s`.
  virtual void memcpy_async(void* dst, const void* src, std::size_t bytes, stream_t s) = 0;
  /// A copy between the memory of two devices, staged by the driver without peer access.
  virtual void memcpy_peer_async(void* dst, int dst_gpu, const void* src, int src_gpu, std::size_t bytes,
                                 stream_t s) = 0;
  virtual void memset_async(void* dst, int value, std::size_t bytes, stream_t s) = 0;
  /// The collective kernel (launch.hpp) over `a` on `s`, which must be a stream of the
  /// current device.
  virtual void launch(const launch_args& a, stream_t s) = 0;
};

/// The CUDA runtime of this process, or null when distvals was built without the CUDA
/// backend. Thread-safe; lives as long as the process.
runtime* real_runtime() noexcept;

/// Sets the current device for a while and puts the previous one back, but only when the
/// thread had one: a thread that never used CUDA is not given a context on device 0.
class device_scope {
 public:
  explicit device_scope(runtime& rt) : rt_(rt), previous_(rt.current_device()), current_(previous_) {}
  ~device_scope() {
    if (previous_ >= 0 && current_ != previous_) {
      try {
        rt_.set_device(previous_);
      } catch (...) {
      }
    }
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  /// Makes `gpu` current (no call when it already is).
  void set(int gpu) {
    if (gpu == current_) return;
    rt_.set_device(gpu);
    current_ = gpu;
  }

 private:
  runtime& rt_;
  int previous_;
  int current_;
};

}  // namespace distvals::cuda
