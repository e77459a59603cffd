// The public CUDA API (distvals/cuda/*.hpp) over the runtime interface: owning streams,
// events and device buffers, plain copies, and host waits that always end.
#include <mutex>
#include <string>

#include "cuda/host_wait.hpp"
#include "cuda/runtime_api.hpp"
#include "distvals/cuda/device_buffer.hpp"
#include "distvals/cuda/runtime.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/error.hpp"
#include "timeout.hpp"

namespace distvals::cuda {
namespace {

runtime& rt() { return *real_runtime(); }

void check_device(int gpu) {
  const int n = device_count();
  if (n == 0) throw cuda_error("distvals: no CUDA device is available (" + unavailable_reason() + ")");
  if (gpu < 0 || gpu >= n) {
    throw invalid_argument_error("CUDA device " + std::to_string(gpu) + " does not exist: this machine has " +
                                 std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s"));
  }
}

// One event per device for host waits on the legacy default stream, created once: a
// plain copy costs no event creation. Several threads may record it at once; each then
// waits for the latest record, which comes after its own work on that in-order stream.
event_t done_event(int gpu) {
  static std::mutex mu;
  static event_t events[64] = {};
  if (gpu >= 64) throw invalid_argument_error("CUDA device " + std::to_string(gpu) + " is beyond the 64 supported");
  std::lock_guard<std::mutex> lk(mu);
  if (!events[gpu]) {
    device_scope scope(rt());
    scope.set(gpu);
    events[gpu] = rt().event_create(false);
  }
  return events[gpu];
}

// Records `e` on `s` (a stream of the current device) and waits for it on the host.
void wait_here(event_t e, stream_t s, std::chrono::nanoseconds timeout, const std::string& what) {
  rt().event_record(e, s);
  const auto t = detail::resolve_timeout(timeout);
  wait_for_event(rt(), e, detail::deadline_after(t), {},
                 [&]() { return "distvals: " + what + " did not finish within " + detail::timeout_text(t); });
}

}  // namespace

void copy_async(void* dst, const void* src, std::size_t bytes, stream_view s) {
  if (bytes == 0) return;
  rt().memcpy_async(dst, src, bytes, s.value());
}

void copy(void* dst, const void* src, std::size_t bytes, int gpu, std::chrono::nanoseconds timeout) {
  if (bytes == 0) return;
  check_device(gpu);
  device_scope scope(rt());
  scope.set(gpu);
  rt().memcpy_async(dst, src, bytes, legacy_stream());
  wait_here(done_event(gpu), legacy_stream(), timeout,
            "a copy of " + std::to_string(bytes) + " bytes on GPU " + std::to_string(gpu));
}

void fill_bytes(void* ptr, int value, std::size_t bytes, int gpu, std::chrono::nanoseconds timeout) {
  if (bytes == 0) return;
  check_device(gpu);
  device_scope scope(rt());
  scope.set(gpu);
  rt().memset_async(ptr, value, bytes, legacy_stream());
  wait_here(done_event(gpu), legacy_stream(), timeout,
            "a fill of " + std::to_string(bytes) + " bytes on GPU " + std::to_string(gpu));
}

void synchronize(stream_view s, std::chrono::nanoseconds timeout) {
  device_scope scope(rt());
  // The stream's own device (not the current one): events are recorded on their device.
  int gpu = s.device();
  if (gpu < 0) gpu = rt().stream_device(s.value());
  check_device(gpu);
  scope.set(gpu);
  wait_here(done_event(gpu), s.value(), timeout, "a stream on GPU " + std::to_string(gpu));
}

// ---- stream ---------------------------------------------------------------------------

stream::stream(int gpu) : device_(gpu) {
  check_device(gpu);
  device_scope scope(rt());
  scope.set(gpu);
  handle_ = static_cast<CUstream_st*>(rt().stream_create());
}

stream::~stream() {
  if (handle_) rt().stream_destroy(handle_);  // work still queued completes first
}

stream::stream(stream&& o) noexcept : handle_(o.handle_), device_(o.device_) { o.handle_ = nullptr; }

stream& stream::operator=(stream&& o) noexcept {
  if (this != &o) {
    if (handle_) rt().stream_destroy(handle_);
    handle_ = o.handle_;
    device_ = o.device_;
    o.handle_ = nullptr;
  }
  return *this;
}

void stream::synchronize(std::chrono::nanoseconds timeout) const { cuda::synchronize(view(), timeout); }

// ---- event ----------------------------------------------------------------------------

event::event(int gpu, bool timing) : device_(gpu) {
  check_device(gpu);
  device_scope scope(rt());
  scope.set(gpu);
  handle_ = static_cast<CUevent_st*>(rt().event_create(timing));
}

event::~event() {
  if (handle_) rt().event_destroy(handle_);
}

event::event(event&& o) noexcept : handle_(o.handle_), device_(o.device_) { o.handle_ = nullptr; }

event& event::operator=(event&& o) noexcept {
  if (this != &o) {
    if (handle_) rt().event_destroy(handle_);
    handle_ = o.handle_;
    device_ = o.device_;
    o.handle_ = nullptr;
  }
  return *this;
}

void event::record(stream_view s) { rt().event_record(handle_, s.value()); }

bool event::ready() const { return rt().event_query(handle_); }

void event::synchronize(std::chrono::nanoseconds timeout) const {
  const auto t = detail::resolve_timeout(timeout);
  wait_for_event(rt(), handle_, detail::deadline_after(t), {}, [&]() {
    return "distvals: an event on GPU " + std::to_string(device_) + " did not complete within " + detail::timeout_text(t);
  });
}

float event::elapsed_ms(const event& start, const event& stop) { return rt().event_elapsed_ms(start.handle_, stop.handle_); }

// ---- device_buffer ----------------------------------------------------------------------

device_buffer::device_buffer(std::size_t bytes, int gpu) : bytes_(bytes), device_(gpu) {
  check_device(gpu);
  if (bytes == 0) return;
  device_scope scope(rt());
  scope.set(gpu);
  data_ = rt().malloc(bytes);
}

device_buffer::~device_buffer() {
  if (data_) rt().free(data_);
}

device_buffer::device_buffer(device_buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), device_(o.device_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

device_buffer& device_buffer::operator=(device_buffer&& o) noexcept {
  if (this != &o) {
    if (data_) rt().free(data_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

buffer_view device_buffer::view(dtype t) const noexcept { return device_view(data_, bytes_ / dtype_size(t), t, device_); }

}  // namespace distvals::cuda
