// Microbenchmark of the engine alone: all-reduce throughput per algorithm and size,
// timed inside the engine, next to the copy bandwidth measured in the same run.
// Usage: distvals_bench_cpp [replicas] [max_bytes]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "distvals/distvals.hpp"

using namespace distvals;

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (64u << 20);
  group g(n);
  std::printf("# distvals %s, %d replicas, float32 sum, in place\n", version_string, n);
  std::printf("%12s %8s %12s %12s %12s %8s\n", "bytes", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "%bound");
  for (std::size_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / 4;
    std::vector<buffer> bufs;
    std::vector<buffer_view> views;
    for (int r = 0; r < n; ++r) {
      bufs.emplace_back(count, dtype::float32);
      views.push_back(bufs.back().view());
    }
    const int iters = bytes < (1u << 20) ? 2000 : bytes < (16u << 20) ? 100 : 10;
    const double copy_t = median(time_copy(n, bytes, iters, 3));
    const double bound_t = copy_t;  // 2·N·S bytes at the measured copy rate = N copies of S
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct, algorithm::automatic}) {
      const call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, a, count, 0};
      const double t = median(time_collective(g, d, views, views, iters, 5));
      const double algbw = bytes / t / 1e9;
      std::printf("%12zu %8s %12.2f %12.3f %12.3f %7.1f%%\n", bytes, algorithm_name(a), t * 1e6, algbw,
                  algbw * 2.0 * (n - 1) / n, 100.0 * bound_t / t);
    }
  }
  return 0;
}
