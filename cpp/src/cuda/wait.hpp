// Host waits on CUDA work that always end: spin briefly on cudaEventQuery, then sleep
// in short slices until the deadline. Not installed.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <functional>
#include <string>

namespace distvals::cuda::detail {

using clock_type = std::chrono::steady_clock;

/// The default deadline of host waits: 300 s, or DISTVALS_TIMEOUT_SECONDS.
std::chrono::milliseconds default_timeout();

/// Polls `query` (a cudaEventQuery or cudaStreamQuery) until it returns cudaSuccess.
/// Throws cuda_error for results other than cudaErrorNotReady (naming `what`),
/// timeout_error(describe()) at `deadline`. `check` runs about every 50 ms and may
/// throw to end the wait (aborts, interrupts).
void poll_until(const std::function<cudaError_t()>& query, clock_type::time_point deadline, const char* what,
                const std::function<std::string()>& describe, const std::function<void()>& check = {});

/// Makes `gpu` the current device for the lifetime of the guard and restores the
/// previous one afterwards.
class device_guard {
 public:
  explicit device_guard(int gpu);
  ~device_guard();
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  /// Switches to `gpu` (cheap when it is already current).
  void set(int gpu);

 private:
  int previous_ = -1;
  int current_ = -1;
};

}  // namespace distvals::cuda::detail
