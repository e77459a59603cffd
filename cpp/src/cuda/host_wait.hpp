// Host waits on CUDA work that always end. Not installed.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "cuda/runtime_api.hpp"

namespace distvals::cuda {

/// Waits on the host until `e` has completed: spins for 200 µs (short collectives end
/// there with the least latency), then sleeps in 20 µs slices (a long wait costs no core,
/// and a collective that ends meanwhile is seen within 20 µs). About every 50 ms calls
/// `check`, which may throw to end the wait (an abort, an interrupt); at `deadline`
/// throws timeout_error with describe()'s message. cuda_error when the event fails.
void wait_for_event(runtime& rt, event_t e, std::chrono::steady_clock::time_point deadline,
                    const std::function<void()>& check, const std::function<std::string()>& describe);

}  // namespace distvals::cuda
