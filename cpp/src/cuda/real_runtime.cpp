// The runtime interface (runtime_api.hpp) over the CUDA runtime, and the device queries
// of the public API that only the real runtime can answer. Built only with the CUDA
// backend; the runtime is linked statically, so without a driver device_count() is 0.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/kernels.hpp"
#include "cuda/runtime_api.hpp"
#include "distvals/cuda/error.hpp"
#include "distvals/cuda/runtime.hpp"

namespace distvals::cuda {
namespace {

// cuCtxGetCurrent from the driver, without linking the driver library (the library must
// load on machines without one): it tells a thread that never used CUDA (no context,
// where cudaGetDevice would still say 0) from one that chose device 0.
using ctx_get_current_fn = CUresult (*)(CUcontext*);

ctx_get_current_fn ctx_get_current() noexcept {
  static const ctx_get_current_fn fn = []() -> ctx_get_current_fn {
    void* p = nullptr;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12050
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
#endif
    return reinterpret_cast<ctx_get_current_fn>(p);
  }();
  return fn;
}

bool special(stream_t s) { return reinterpret_cast<std::uintptr_t>(s) <= 2; }

cudaStream_t as_stream(stream_t s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(event_t e) { return static_cast<cudaEvent_t>(e); }

class cuda_runtime final : public runtime {
 public:
  int device_count() noexcept override { return cuda::device_count(); }
  std::string unavailable_reason() override { return cuda::unavailable_reason(); }

  int current_device() override {
    if (auto fn = ctx_get_current()) {
      CUcontext ctx = nullptr;
      if (fn(&ctx) == CUDA_SUCCESS && ctx == nullptr) return -1;
    }
    int d = -1;
    DISTVALS_CUDA_TRY(cudaGetDevice(&d));
    return d;
  }
  void set_device(int gpu) override { DISTVALS_CUDA_TRY(cudaSetDevice(gpu)); }
  int multiprocessor_count(int gpu) override {
    int sms = 0;
    DISTVALS_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu));
    return sms;
  }
  bool can_access_peer(int from, int to) noexcept override { return cuda::can_access_peer(from, to); }
  bool enable_peer_access(int peer) noexcept override {
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    (void)cudaGetLastError();  // a failure only means staged copies for this pair
    return e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
  }
  int pointer_device(const void* ptr) noexcept override { return cuda::pointer_device(ptr); }

  stream_t stream_create() override {
    cudaStream_t s = nullptr;
    DISTVALS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }
  void stream_destroy(stream_t s) noexcept override {
    if (s && !special(s)) (void)cudaStreamDestroy(as_stream(s));
  }
  int stream_device(stream_t s) override {
    int d = -1;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    if (!special(s)) {
      DISTVALS_CUDA_TRY(cudaStreamGetDevice(as_stream(s), &d));
      return d;
    }
#endif
    // A special handle means the current device's default stream.
    DISTVALS_CUDA_TRY(cudaGetDevice(&d));
    return d;
  }
  bool stream_query(stream_t s) override {
    const cudaError_t e = cudaStreamQuery(as_stream(s));
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    DISTVALS_CUDA_TRY(e);
    return false;
  }
  event_t event_create(bool timing) override {
    cudaEvent_t e = nullptr;
    DISTVALS_CUDA_TRY(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  void event_destroy(event_t e) noexcept override {
    if (e) (void)cudaEventDestroy(as_event(e));
  }
  void event_record(event_t e, stream_t s) override { DISTVALS_CUDA_TRY(cudaEventRecord(as_event(e), as_stream(s))); }
  void stream_wait_event(stream_t s, event_t e) override {
    DISTVALS_CUDA_TRY(cudaStreamWaitEvent(as_stream(s), as_event(e), 0));
  }
  bool event_query(event_t e) override {
    const cudaError_t r = cudaEventQuery(as_event(e));
    if (r == cudaSuccess) return true;
    if (r == cudaErrorNotReady) return false;
    DISTVALS_CUDA_TRY(r);
    return false;
  }
  float event_elapsed_ms(event_t start, event_t stop) override {
    float ms = 0;
    DISTVALS_CUDA_TRY(cudaEventElapsedTime(&ms, as_event(start), as_event(stop)));
    return ms;
  }

  void* malloc(std::size_t bytes) override {
    void* p = nullptr;
    DISTVALS_CUDA_TRY(cudaMalloc(&p, bytes));
    return p;
  }
  void free(void* p) noexcept override {
    if (p) (void)cudaFree(p);
  }
  void memcpy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override {
    DISTVALS_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(s)));
  }
  void memcpy_peer_async(void* dst, int dst_gpu, const void* src, int src_gpu, std::size_t bytes,
                         stream_t s) override {
    DISTVALS_CUDA_TRY(cudaMemcpyPeerAsync(dst, dst_gpu, src, src_gpu, bytes, as_stream(s)));
  }
  void memset_async(void* dst, int value, std::size_t bytes, stream_t s) override {
    DISTVALS_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, as_stream(s)));
  }
  void launch(const launch_args& a, stream_t s) override { DISTVALS_CUDA_TRY(launch_collective(a, as_stream(s))); }
};

}  // namespace

runtime* real_runtime() noexcept {
  static cuda_runtime rt;
  return &rt;
}

// ---- device queries of the public API --------------------------------------------------

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
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
  const int n = device_count();
  if (n == 0) throw cuda_error("distvals: no CUDA device is available (" + unavailable_reason() + ")");
  if (gpu < 0 || gpu >= n) {
    throw invalid_argument_error("CUDA device " + std::to_string(gpu) + " does not exist: this machine has " +
                                 std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s"));
  }
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

namespace detail {

void throw_cuda_error(const char* call, const char* file, int line, int error, const char* name, const char* text) {
  throw cuda_error(std::string("distvals: CUDA call `") + call + "` failed at " + file + ":" + std::to_string(line) +
                   ": " + (name ? name : "cudaError") + " (" + std::to_string(error) +
                   "): " + (text ? text : "unknown error"));
}

}  // namespace detail
}  // namespace distvals::cuda
