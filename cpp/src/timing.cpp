// Timing loops for the benchmarks (see timing.hpp).
#include "distvals/timing.hpp"

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "cpu/relax.hpp"

namespace distvals {

std::vector<double> time_collective(group& g, const call_desc& desc, const std::vector<buffer_view>& in,
                                    const std::vector<buffer_view>& out, int iterations, int warmup) {
  using clk = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i) g.run(desc, in, out);
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const auto a = clk::now();
    g.run(desc, in, out);
    t.push_back(std::chrono::duration<double>(clk::now() - a).count());
  }
  return t;
}

std::vector<double> time_copy(int threads, std::size_t bytes, int iterations, int warmup) {
  using clk = std::chrono::steady_clock;
  std::vector<buffer> src, dst;
  for (int i = 0; i < threads; ++i) {
    src.emplace_back(bytes, dtype::uint8);
    dst.emplace_back(bytes, dtype::uint8);
    std::memset(src.back().data(), i + 1, bytes);
  }
  // A sense-reversing spin barrier: rounds start together and end when the slowest
  // thread is done, which is what a collective waits for too.
  std::atomic<int> arrived{0};
  std::atomic<int> phase{0};
  auto barrier = [&]() {
    const int p = phase.load();
    if (arrived.fetch_add(1) + 1 == threads) {
      arrived.store(0);
      phase.store(p + 1);
    } else {
      while (phase.load() == p) {
        cpu::relax();
        if (threads > static_cast<int>(std::thread::hardware_concurrency())) std::this_thread::yield();
      }
    }
  };
  const int rounds = warmup + iterations;
  std::vector<double> times(static_cast<std::size_t>(rounds));
  auto body = [&](int id) {
    for (int it = 0; it < rounds; ++it) {
      barrier();
      const auto a = clk::now();
      std::memcpy(dst[id].data(), src[id].data(), bytes);
      barrier();
      if (id == 0) times[it] = std::chrono::duration<double>(clk::now() - a).count();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(body, i);
  body(0);
  for (auto& th : pool) th.join();
  return std::vector<double>(times.begin() + warmup, times.end());
}

}  // namespace distvals
