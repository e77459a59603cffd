// Host waits on CUDA work (see host_wait.hpp).
#include "cuda/host_wait.hpp"

#include <thread>

#include "cpu/relax.hpp"
#include "distvals/error.hpp"

namespace distvals::cuda {

void wait_for_event(runtime& rt, event_t e, std::chrono::steady_clock::time_point deadline,
                    const std::function<void()>& check, const std::function<std::string()>& describe) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start + std::chrono::milliseconds(50);
  for (;;) {
    if (rt.event_query(e)) return;
    const auto now = clock::now();
    if (now >= next_check) {
      if (check) check();
      next_check = now + std::chrono::milliseconds(50);
    }
    if (now >= deadline) throw timeout_error(describe());
    if (now - start < std::chrono::microseconds(200)) {
      cpu::relax();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

}  // namespace distvals::cuda
