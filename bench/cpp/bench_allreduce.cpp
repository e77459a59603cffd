// Microbenchmark of the engine alone: all-reduce bytes per second per algorithm and
// size, timed inside the engine, next to the copy bandwidth measured in the same run.
// Every row is checked: each replica starts from distinct values and the result of a
// separate call is compared with a float64 reference (the "wrong" column).
//
// Usage: distvals_bench_cpp [replicas=2] [max_bytes=64MiB] [min_bytes=1KiB]
//        [algo=all|ring|tree|direct|auto]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "distvals/distvals.hpp"

using namespace distvals;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Distinct small integers per replica and element, exact in float32 once summed.
float value_of(int replica, std::size_t i) {
  return static_cast<float>(replica + 1) + static_cast<float>(i % 61) - 30.0f;
}

/// Fills every replica's buffer, runs one all-reduce in place and counts the elements,
/// over all replicas, that differ from the float64 reference.
std::size_t check(group& g, const call_desc& d, std::vector<buffer>& bufs,
                  const std::vector<buffer_view>& views) {
  const int n = static_cast<int>(bufs.size());
  for (int r = 0; r < n; ++r) {
    float* p = bufs[r].as<float>();
    for (std::size_t i = 0; i < d.count; ++i) p[i] = value_of(r, i);
  }
  g.run(d, views, views);
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r) {
    const float* p = bufs[r].as<float>();
    for (std::size_t i = 0; i < d.count; ++i) {
      double want = 0.0;
      for (int j = 0; j < n; ++j) want += value_of(j, i);
      if (static_cast<double>(p[i]) != want) ++wrong;
    }
  }
  return wrong;
}

/// Enough iterations for about 0.2 s per row, at least 5 and at most 2000.
int iterations_for(std::size_t bytes) {
  const double est_s = 1e-6 + static_cast<double>(bytes) / 2e9;
  return static_cast<int>(std::clamp(0.2 / est_s, 5.0, 2000.0));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int n = argc > 1 ? std::atoi(argv[1]) : 2;
    const std::size_t max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (64u << 20);
    const std::size_t min_bytes = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1024;
    const std::string which = argc > 4 ? argv[4] : "all";
    std::vector<algorithm> algos;
    if (which == "all") {
      algos = {algorithm::ring, algorithm::tree, algorithm::direct, algorithm::automatic};
    } else {
      algos = {parse_algorithm(which)};
    }
    if (n < 1 || min_bytes < 4 || max_bytes < min_bytes) {
      std::fprintf(stderr, "usage: %s [replicas>=1] [max_bytes] [min_bytes>=4] [algo]\n", argv[0]);
      return 2;
    }

    group g(n);
    std::printf("# distvals %s, %d replicas, float32 sum, in place; %%bound: the memory-bound time\n"
                "# (every byte of every buffer read and stored back once, on the same buffers, the\n"
                "# fastest of 1 and %d threads, plain and streaming stores) over the all-reduce's time\n",
                version_string, n, g.options().threads);
    std::printf("%12s %8s %12s %12s %12s %8s %8s\n", "bytes", "algo", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "%bound", "wrong");
    std::size_t total_wrong = 0;
    for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      const std::size_t moved = count * sizeof(float);  // the bytes really reduced
      std::vector<buffer> bufs;
      std::vector<buffer_view> views;
      for (int r = 0; r < n; ++r) {
        bufs.emplace_back(count, dtype::float32);
        views.push_back(bufs.back().view());
      }
      const int iters = iterations_for(bytes);
      // An in-place all-reduce reads and writes every byte of every buffer at least once:
      // the fastest such pass over the very same buffers is its lower bound.
      double bound_t = 0;
      for (int threads : {1, g.options().threads}) {
        for (bool streaming : {false, true}) {
          if (streaming && !memory_bound_has_streaming()) continue;
          const double t = median(time_memory_bound(views, threads, streaming, iters, 3));
          if (bound_t == 0 || t < bound_t) bound_t = t;
        }
      }
      for (algorithm a : algos) {
        const call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, a, count, 0};
        const std::size_t wrong = check(g, d, bufs, views);
        total_wrong += wrong;
        const double t = median(time_collective(g, d, views, views, iters, 5));
        const double algbw = static_cast<double>(moved) / t / 1e9;
        std::printf("%12zu %8s %12.2f %12.3f %12.3f %7.1f%% %8zu\n", moved, algorithm_name(a), t * 1e6,
                    algbw, algbw * 2.0 * (n - 1) / n, 100.0 * bound_t / t, wrong);
      }
    }
    return total_wrong == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distvals_bench_cpp: %s\n", e.what());
    return 2;
  }
}
