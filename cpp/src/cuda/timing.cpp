// GPU timing loops for the benchmark: CUDA events around each call, on one stream.
#include "distvals/cuda/timing.hpp"

#include <vector>

#include "cuda/runtime_api.hpp"
#include "distvals/cuda/device_buffer.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/error.hpp"

namespace distvals::cuda {
namespace {

// Records an event before and after each of `warmup + iterations` calls of `body` on
// `s`, then returns the seconds of the last `iterations`. Back-to-back calls: the time
// of one includes whatever host work the device had to wait for.
template <class Body>
std::vector<double> time_on(int gpu, stream& s, int iterations, int warmup, const Body& body) {
  if (iterations < 1) throw invalid_argument_error("iterations must be at least 1");
  if (warmup < 0) throw invalid_argument_error("warmup must not be negative");
  std::vector<event> starts, stops;
  starts.reserve(iterations);
  stops.reserve(iterations);
  for (int i = 0; i < iterations; ++i) {
    starts.emplace_back(gpu, true);
    stops.emplace_back(gpu, true);
  }
  device_scope scope(*real_runtime());
  scope.set(gpu);
  for (int i = 0; i < warmup; ++i) body();
  for (int i = 0; i < iterations; ++i) {
    starts[i].record(s.view());
    body();
    stops[i].record(s.view());
  }
  stops.back().synchronize();
  std::vector<double> t(static_cast<std::size_t>(iterations));
  for (int i = 0; i < iterations; ++i) t[i] = event::elapsed_ms(starts[i], stops[i]) * 1e-3;
  return t;
}

}  // namespace

std::vector<double> time_collective(group& g, const call_desc& desc, const std::vector<buffer_view>& in,
                                    const std::vector<buffer_view>& out, int iterations, int warmup) {
  const int gpu = g.gpus()[0];
  stream s(gpu);
  return time_on(gpu, s, iterations, warmup, [&]() { g.enqueue(desc, in, out, s.view()); });
}

std::vector<double> time_copy(int gpu, std::size_t bytes, int iterations, int warmup) {
  stream s(gpu);
  device_buffer a(bytes, gpu), b(bytes, gpu);
  runtime& rt = *real_runtime();
  device_scope scope(rt);
  scope.set(gpu);
  rt.memset_async(a.data(), 1, bytes, s.value());
  return time_on(gpu, s, iterations, warmup, [&]() { rt.memcpy_async(b.data(), a.data(), bytes, s.value()); });
}

}  // namespace distvals::cuda
