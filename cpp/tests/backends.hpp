// The backends the C++ collective tests run on, one per run of a test binary:
//   cpu    CPU replicas (host memory, the CPU executor);
//   model  GPU replicas on the host model of the CUDA runtime (the CUDA executor's
//          orchestration with CPU kernels; streams are threads, every call counted);
//   cuda   GPU replicas on a real GPU (exit status 77, "skipped", without a usable one).
// A test allocates, fills and reads buffers through the backend, so one test serves all.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/host_model.hpp"
#include "cuda/runtime_api.hpp"
#include "distvals/distvals.hpp"
#include "factory.hpp"

namespace distvals_test {

using namespace distvals;

/// Exit status that ctest reports as "skipped" (SKIP_RETURN_CODE).
inline constexpr int skipped = 77;

// A group over a prepared state (the host model): group's constructor for it is protected.
struct state_group : group {
  explicit state_group(std::unique_ptr<impl> s) : group(std::move(s)) {}
  impl& inner() const { return state(); }
};

class backend {
 public:
  virtual ~backend() = default;
  virtual std::string name() const = 0;
  /// GPU replicas (the model or a real GPU).
  virtual bool gpu() const = 0;
  /// A group of `n` replicas: CPUs, or GPUs placed on CUDA devices `gpus` (default: all
  /// logical replicas of device 0).
  virtual std::unique_ptr<group> make_group(int n, group_options o = {}, std::vector<int> gpus = {}) = 0;
  /// `count` elements for replica r of `g`, alive until release() or the backend goes.
  virtual buffer_view alloc(const group& g, int replica, std::size_t count, dtype t) = 0;
  /// Frees everything alloc() gave since the last release(); no collective may still use it.
  virtual void release() = 0;
  virtual void to_device(const buffer_view& dst, const void* host) = 0;
  virtual void to_host(void* host, const buffer_view& src) = 0;
  /// Waits until every stream of the device(s) is idle (work enqueued on streams that
  /// are gone included).
  virtual void synchronize_all() {}
  /// The host model, for the tests that look at it (null elsewhere).
  virtual cuda::host_model* model() { return nullptr; }
  /// Devices available to GPU groups.
  virtual int devices() const { return 1; }
};

class cpu_backend final : public backend {
 public:
  std::string name() const override { return "cpu"; }
  bool gpu() const override { return false; }
  std::unique_ptr<group> make_group(int n, group_options o = {}, std::vector<int> = {}) override {
    return std::make_unique<group>(n, std::move(o));
  }
  buffer_view alloc(const group&, int, std::size_t count, dtype t) override {
    bufs_.emplace_back(count, t);
    return bufs_.back().view();
  }
  void release() override { bufs_.clear(); }
  void to_device(const buffer_view& dst, const void* host) override { std::memcpy(dst.data, host, dst.bytes()); }
  void to_host(void* host, const buffer_view& src) override { std::memcpy(host, src.data, src.bytes()); }

 private:
  std::vector<buffer> bufs_;
};

class model_backend final : public backend {
 public:
  explicit model_backend(cuda::host_model::options o = {}) : model_(std::make_unique<cuda::host_model>(o)) {
    devices_ = o.devices;
  }
  ~model_backend() override { release(); }
  void release() override {
    model_->synchronize_all();
    for (void* p : mem_) model_->free(p);
    mem_.clear();
  }
  std::string name() const override { return "model"; }
  bool gpu() const override { return true; }
  int devices() const override { return devices_; }
  cuda::host_model* model() override { return model_.get(); }
  void synchronize_all() override { model_->synchronize_all(); }
  std::unique_ptr<group> make_group(int n, group_options o = {}, std::vector<int> gpus = {}) override {
    if (gpus.empty()) gpus.assign(static_cast<std::size_t>(n), 0);
    std::vector<device> names(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) names[i] = device{device::kind_t::gpu, i};
    return std::make_unique<state_group>(detail::make_state(names, std::move(o), model_.get(), &gpus));
  }
  buffer_view alloc(const group& g, int replica, std::size_t count, dtype t) override {
    const int gpu = gpu_of(g, replica);
    cuda::device_scope scope(*model_);
    scope.set(gpu);
    void* p = model_->malloc(count * dtype_size(t));
    mem_.push_back(p);
    return buffer_view{p, count, t, device{device::kind_t::gpu, gpu}};
  }
  void to_device(const buffer_view& dst, const void* host) override {
    model_->synchronize_all();
    std::memcpy(dst.data, host, dst.bytes());
  }
  void to_host(void* host, const buffer_view& src) override {
    model_->synchronize_all();
    std::memcpy(host, src.data, src.bytes());
  }
  static int gpu_of(const group& g, int replica) {
    return detail::cuda_gpus(static_cast<const state_group&>(g).inner())[replica];
  }

 private:
  std::unique_ptr<cuda::host_model> model_;
  std::vector<void*> mem_;
  int devices_ = 1;
};

#if DISTVALS_HAS_CUDA
}  // namespace distvals_test
#include "distvals/cuda/error.hpp"
namespace distvals_test {

class cuda_backend final : public backend {
 public:
  std::string name() const override { return "cuda"; }
  bool gpu() const override { return true; }
  int devices() const override { return cuda::device_count(); }
  std::unique_ptr<group> make_group(int n, group_options o = {}, std::vector<int> gpus = {}) override {
    if (gpus.empty()) gpus.assign(static_cast<std::size_t>(n), 0);
    return std::make_unique<cuda::group>(gpus, std::move(o));
  }
  buffer_view alloc(const group& g, int replica, std::size_t count, dtype t) override {
    // From a 1 GiB arena per device, reset by release(): a test case costs no cudaMalloc.
    const int gpu = static_cast<const cuda::group&>(g).gpus()[replica];
    const std::size_t bytes = count * dtype_size(t);
    auto& a = arenas_[gpu];
    if (a.mem.size() == 0) a.mem = cuda::device_buffer(std::size_t{1} << 30, gpu);
    const std::size_t at = (a.used + 255) / 256 * 256;
    if (at + bytes <= a.mem.size()) {
      a.used = at + bytes;
      return cuda::device_view(static_cast<char*>(a.mem.data()) + at, count, t, gpu);
    }
    big_.emplace_back(std::max<std::size_t>(bytes, 1), gpu);
    return cuda::device_view(big_.back().data(), count, t, gpu);
  }
  void release() override {
    synchronize_all();
    for (auto& [gpu, a] : arenas_) a.used = 0;
    big_.clear();
  }
  void synchronize_all() override {
    for (int d = 0; d < cuda::device_count(); ++d) {
      DISTVALS_CUDA_TRY(cudaSetDevice(d));
      DISTVALS_CUDA_TRY(cudaDeviceSynchronize());
    }
  }
  void to_device(const buffer_view& dst, const void* host) override {
    cuda::copy(dst.data, host, dst.bytes(), dst.dev.index);
  }
  void to_host(void* host, const buffer_view& src) override { cuda::copy(host, src.data, src.bytes(), src.dev.index); }

 private:
  struct arena {
    cuda::device_buffer mem;
    std::size_t used = 0;
  };
  std::map<int, arena> arenas_;
  std::vector<cuda::device_buffer> big_;
};
#endif

/// The backend named on the command line (cpu, model or cuda); exits with `skipped`
/// when it cannot run here, saying why.
inline std::unique_ptr<backend> backend_from_args(int argc, char** argv, cuda::host_model::options model = {}) {
  const std::string which = argc > 1 ? argv[1] : "cpu";
  if (which == "cpu") return std::make_unique<cpu_backend>();
  if (which == "model") return std::make_unique<model_backend>(model);
  if (which == "cuda") {
#if DISTVALS_HAS_CUDA
    if (cuda::device_count() > 0) return std::make_unique<cuda_backend>();
    std::printf("SKIPPED: no usable GPU: %s\n", cuda::unavailable_reason().c_str());
#else
    std::printf("SKIPPED: distvals was built without the CUDA backend\n");
#endif
    std::fflush(stdout);
    std::exit(skipped);
  }
  std::fprintf(stderr, "unknown backend '%s' (cpu, model or cuda)\n", which.c_str());
  std::exit(2);
}

}  // namespace distvals_test
