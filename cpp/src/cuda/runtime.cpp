// Device queries, the CUDA error check, owning streams, events, device buffers, plain
// copies and the host waits they need.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "cuda/wait.hpp"
#include "distvals/cuda/device_buffer.hpp"
#include "distvals/cuda/error.hpp"
#include "distvals/cuda/runtime.hpp"
#include "distvals/cuda/stream.hpp"

namespace distvals::cuda {

namespace detail {

void throw_cuda_error(const char* call, const char* file, int line, int error, const char* name,
                      const char* text) {
  throw cuda_error(std::string("distvals: CUDA call `") + call + "` failed at " + file + ":" +
                   std::to_string(line) + ": " + (name ? name : "cudaError") + " (" + std::to_string(error) +
                   "): " + (text ? text : "unknown error"));
}

std::chrono::milliseconds default_timeout() {
  if (const char* env = std::getenv("DISTVALS_TIMEOUT_SECONDS")) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    if (end != env && s > 0) return std::chrono::milliseconds(static_cast<long long>(s * 1000.0));
  }
  return std::chrono::seconds(300);
}

void poll_until(const std::function<cudaError_t()>& query, clock_type::time_point deadline, const char* what,
                const std::function<std::string()>& describe, const std::function<void()>& check) {
  // Phase 1: spin for ~50 us; short collectives finish here with the least latency.
  const auto start = clock_type::now();
  const auto spin_end = start + std::chrono::microseconds(50);
  auto next_check = start + std::chrono::milliseconds(50);
  auto sleep = std::chrono::microseconds(10);
  for (;;) {
    const cudaError_t e = query();
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      throw_cuda_error(what, __FILE__, __LINE__, static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e));
    }
    const auto now = clock_type::now();
    if (now >= next_check) {
      if (check) check();
      next_check = now + std::chrono::milliseconds(50);
    }
    if (now >= deadline) throw timeout_error(describe());
    if (now < spin_end) continue;
    // Phase 2: sleep in growing slices (at most 1 ms), so a long wait costs no core.
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::microseconds(1000)) sleep *= 2;
  }
}

device_guard::device_guard(int gpu) {
  DISTVALS_CUDA_TRY(cudaGetDevice(&previous_));
  current_ = previous_;
  set(gpu);
}

device_guard::~device_guard() {
  if (current_ != previous_ && previous_ >= 0) (void)cudaSetDevice(previous_);
}

void device_guard::set(int gpu) {
  if (gpu == current_) return;
  DISTVALS_CUDA_TRY(cudaSetDevice(gpu));
  current_ = gpu;
}

}  // namespace detail

namespace {

std::chrono::milliseconds resolve(std::chrono::milliseconds t) {
  return t.count() > 0 ? t : detail::default_timeout();
}

void check_device(int gpu) {
  const int n = device_count();
  if (n == 0) {
    throw cuda_error("distvals: no CUDA device is available (" + unavailable_reason() + ")");
  }
  if (gpu < 0 || gpu >= n) {
    throw invalid_argument_error("CUDA device " + std::to_string(gpu) + " does not exist: this machine has " +
                                 std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s"));
  }
}

}  // namespace

int device_count() noexcept {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  }
  return n == 0 ? "no CUDA device found" : "";
}

int runtime_version() noexcept {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

int driver_version() noexcept {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

bool can_access_peer(int from, int to) noexcept {
  if (from == to) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return can != 0;
}

std::string device_name(int gpu) {
  check_device(gpu);
  cudaDeviceProp prop{};
  DISTVALS_CUDA_TRY(cudaGetDeviceProperties(&prop, gpu));
  return prop.name;
}

int pointer_device(const void* ptr) noexcept {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device : -1;
}

void copy_async(void* dst, const void* src, std::size_t bytes, stream_view s) {
  if (bytes == 0) return;
  DISTVALS_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.value()));
}

void copy(void* dst, const void* src, std::size_t bytes, int gpu, std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  check_device(gpu);
  const auto deadline = detail::clock_type::now() + resolve(timeout);
  detail::device_guard guard(gpu);
  event done(gpu);
  DISTVALS_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamLegacy));
  DISTVALS_CUDA_TRY(cudaEventRecord(done.value(), cudaStreamLegacy));
  detail::poll_until([&]() { return cudaEventQuery(done.value()); }, deadline, "cudaEventQuery(copy)",
                     [&]() { return "distvals: a copy of " + std::to_string(bytes) + " bytes on GPU " +
                                    std::to_string(gpu) + " did not finish in time"; });
}

void fill_bytes(void* ptr, int value, std::size_t bytes, int gpu, std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  check_device(gpu);
  const auto deadline = detail::clock_type::now() + resolve(timeout);
  detail::device_guard guard(gpu);
  event done(gpu);
  DISTVALS_CUDA_TRY(cudaMemsetAsync(ptr, value, bytes, cudaStreamLegacy));
  DISTVALS_CUDA_TRY(cudaEventRecord(done.value(), cudaStreamLegacy));
  detail::poll_until([&]() { return cudaEventQuery(done.value()); }, deadline, "cudaEventQuery(fill)",
                     [&]() { return "distvals: a fill of " + std::to_string(bytes) + " bytes on GPU " +
                                    std::to_string(gpu) + " did not finish in time"; });
}

void synchronize(stream_view s, std::chrono::milliseconds timeout) {
  const auto deadline = detail::clock_type::now() + resolve(timeout);
  int current = -1;
  DISTVALS_CUDA_TRY(cudaGetDevice(&current));
  detail::device_guard guard(s.device() >= 0 ? s.device() : current);
  // An event recorded now marks exactly the work queued so far.
  event done(s.device() >= 0 ? s.device() : current);
  DISTVALS_CUDA_TRY(cudaEventRecord(done.value(), s.value()));
  cudaEvent_t e = done.value();
  detail::poll_until([e]() { return cudaEventQuery(e); }, deadline, "cudaEventQuery(stream)",
                     [&]() { return std::string("distvals: a caller's stream did not drain in time"); });
}

// ---- stream ---------------------------------------------------------------------------

stream::stream(int gpu) : device_(gpu) {
  check_device(gpu);
  detail::device_guard guard(gpu);
  cudaStream_t s = nullptr;
  DISTVALS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  handle_ = s;
}

stream::~stream() {
  // Work still queued completes; the handle is released afterwards by CUDA.
  if (handle_) (void)cudaStreamDestroy(handle_);
}

stream::stream(stream&& o) noexcept : handle_(o.handle_), device_(o.device_) { o.handle_ = nullptr; }

stream& stream::operator=(stream&& o) noexcept {
  if (this != &o) {
    if (handle_) (void)cudaStreamDestroy(handle_);
    handle_ = o.handle_;
    device_ = o.device_;
    o.handle_ = nullptr;
  }
  return *this;
}

void stream::synchronize(std::chrono::milliseconds timeout) const {
  const auto deadline = detail::clock_type::now() + resolve(timeout);
  cudaStream_t s = handle_;
  detail::poll_until([s]() { return cudaStreamQuery(s); }, deadline, "cudaStreamQuery",
                     [&]() { return "distvals: a stream on GPU " + std::to_string(device_) + " did not drain in time"; });
}

// ---- event ----------------------------------------------------------------------------

event::event(int gpu, bool timing) : device_(gpu) {
  detail::device_guard guard(gpu);
  cudaEvent_t e = nullptr;
  DISTVALS_CUDA_TRY(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = e;
}

event::~event() {
  if (handle_) (void)cudaEventDestroy(handle_);
}

event::event(event&& o) noexcept : handle_(o.handle_), device_(o.device_) { o.handle_ = nullptr; }

event& event::operator=(event&& o) noexcept {
  if (this != &o) {
    if (handle_) (void)cudaEventDestroy(handle_);
    handle_ = o.handle_;
    device_ = o.device_;
    o.handle_ = nullptr;
  }
  return *this;
}

void event::record(stream_view s) { DISTVALS_CUDA_TRY(cudaEventRecord(handle_, s.value())); }

bool event::ready() const {
  const cudaError_t e = cudaEventQuery(handle_);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  DISTVALS_CUDA_TRY(e);
  return false;
}

void event::synchronize(std::chrono::milliseconds timeout) const {
  const auto deadline = detail::clock_type::now() + resolve(timeout);
  cudaEvent_t h = handle_;
  detail::poll_until([h]() { return cudaEventQuery(h); }, deadline, "cudaEventQuery",
                     [&]() { return "distvals: an event on GPU " + std::to_string(device_) + " did not complete in time"; });
}

float event::elapsed_ms(const event& start, const event& stop) {
  float ms = 0;
  DISTVALS_CUDA_TRY(cudaEventElapsedTime(&ms, start.handle_, stop.handle_));
  return ms;
}

// ---- device_buffer ----------------------------------------------------------------------

device_buffer::device_buffer(std::size_t bytes, int gpu) : bytes_(bytes), device_(gpu) {
  check_device(gpu);
  if (bytes == 0) return;
  detail::device_guard guard(gpu);
  DISTVALS_CUDA_TRY(cudaMalloc(&data_, bytes));
}

device_buffer::~device_buffer() {
  if (data_) (void)cudaFree(data_);
}

device_buffer::device_buffer(device_buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), device_(o.device_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

device_buffer& device_buffer::operator=(device_buffer&& o) noexcept {
  if (this != &o) {
    if (data_) (void)cudaFree(data_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

buffer_view device_buffer::view(dtype t) const noexcept {
  return device_view(data_, bytes_ / dtype_size(t), t, device_);
}

}  // namespace distvals::cuda
