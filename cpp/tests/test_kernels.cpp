// The portable kernels against the AVX2 ones, element by element, for every dtype, op,
// size tail, source count, destination count and aliasing the executor uses. On an AVX2
// machine the portable table never runs otherwise; where AVX2 is missing, the portable
// table is what every other test runs, and this test checks it against a plain loop.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "cpu/kernels.hpp"
#include "distvals/config.hpp"
#include "distvals/error.hpp"
#include "distvals/host_reduce.hpp"
#include "distvals/timing.hpp"

namespace {

using distvals::dtype;
using distvals::dtype_count;
using distvals::dtype_size;
using distvals::cpu::kernel_table;
using distvals::cpu::reduce_args;

kernel_table table_of(void (*fill)(kernel_table&) noexcept) {
  kernel_table t{};
  fill(t);
  return t;
}

bool avx2_usable() {
#if DISTVALS_HAS_AVX2_KERNELS
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Random bytes for integers; for floating dtypes, values of a few units (so that sums
// and products stay finite) with NaN and infinities sprinkled in.
std::vector<unsigned char> random_input(dtype t, std::size_t count, std::mt19937_64& rng) {
  std::vector<unsigned char> out(count * dtype_size(t));
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  for (std::size_t i = 0; i < count; ++i) {
    double v = u(rng);
    if (i % 97 == 13) v = std::nan("");
    if (i % 89 == 7) v = (i & 1) ? INFINITY : -INFINITY;
    unsigned char* p = out.data() + i * dtype_size(t);
    switch (t) {
      case dtype::float32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case dtype::float64: std::memcpy(p, &v, 8); break;
      case dtype::float16:
      case dtype::bfloat16: {
        // A float32 rounded by truncation to its upper half is a valid bfloat16; for
        // float16 use small integers times 1/8, exact in half precision.
        if (t == dtype::bfloat16) {
          const float f = static_cast<float>(v);
          std::uint32_t bits;
          std::memcpy(&bits, &f, 4);
          const std::uint16_t h = static_cast<std::uint16_t>(bits >> 16);
          std::memcpy(p, &h, 2);
        } else {
          const int k = static_cast<int>(std::lround(v * 8));  // |k| <= 32: k/8 is exact
          std::uint16_t h = 0;
          if (k != 0) {
            const int a = k < 0 ? -k : k;
            int e = 0;
            while ((a >> e) > 1) ++e;  // a = 1.m * 2^e
            const int mant = ((a << (10 - e)) & 0x3ff);
            const int exp = e - 3 + 15;  // value = a / 8
            h = static_cast<std::uint16_t>(((k < 0) << 15) | (exp << 10) | mant);
          }
          if (i % 97 == 13) h = 0x7e00;
          if (i % 89 == 7) h = (i & 1) ? 0x7c00 : 0xfc00;
          std::memcpy(p, &h, 2);
        }
        break;
      }
      default:
        for (std::size_t b = 0; b < dtype_size(t); ++b) p[b] = static_cast<unsigned char>(rng());
    }
  }
  return out;
}

double as_double(dtype t, const unsigned char* p) {
  switch (t) {
    case dtype::float32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case dtype::float64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case dtype::bfloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case dtype::float16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double sign = (h & 0x8000) ? -1.0 : 1.0;
      if (e == 0x1f) return m ? std::nan("") : sign * INFINITY;
      if (e == 0) return sign * std::ldexp(m, -24);
      return sign * std::ldexp(1024 + m, e - 25);
    }
    default: return 0;
  }
}

// Equal bytes, or (floating) both NaN, or within a relative 1e-6 (a mean divided in a
// different way) or one unit of the narrow types.
bool same(dtype t, const unsigned char* a, const unsigned char* b) {
  if (std::memcmp(a, b, dtype_size(t)) == 0) return true;
  if (!distvals::is_floating(t)) return false;
  const double x = as_double(t, a), y = as_double(t, b);
  if (std::isnan(x) && std::isnan(y)) return true;
  const double tol = (t == dtype::float16 || t == dtype::bfloat16) ? 1e-2 : 1e-6;
  return std::fabs(x - y) <= tol * std::fmax(1.0, std::fabs(y));
}

struct run_result {
  std::vector<std::vector<unsigned char>> outs;
};

// Runs one kernel over copies of `inputs`: with `alias`, destination 0 is source 0's
// buffer (in place, as the executor's in-place steps do).
run_result run(const kernel_table& k, dtype t, int op, const std::vector<std::vector<unsigned char>>& inputs,
               int ndst, bool alias, double divisor) {
  std::vector<std::vector<unsigned char>> srcs = inputs;
  run_result r;
  r.outs.assign(ndst, std::vector<unsigned char>(inputs[0].size(), 0xAB));
  std::vector<const void*> sp;
  for (auto& s : srcs) sp.push_back(s.data());
  std::vector<void*> dp;
  for (int d = 0; d < ndst; ++d) dp.push_back(alias && d == 0 ? srcs[0].data() : r.outs[d].data());
  const std::size_t count = inputs[0].size() / dtype_size(t);
  k.reduce[static_cast<int>(t)][op]({dp.data(), ndst, sp.data(), static_cast<int>(sp.size()), count, divisor});
  if (alias) r.outs[0] = srcs[0];
  return r;
}

TEST_CASE("portable kernels match the AVX2 kernels for every dtype, op and tail") {
  const kernel_table generic = table_of(&distvals::cpu::generic::fill_table);
  if (!avx2_usable()) {
    std::printf("  (no AVX2 on this machine: the portable kernels are checked by every other test)\n");
    return;
  }
  const kernel_table avx2 = table_of(&distvals::cpu::avx2::fill_table);
  std::mt19937_64 rng(12345);
  const std::size_t counts[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 2047, 2048, 2049, 4099};
  const char* op_names[] = {"sum", "prod", "min", "max"};
  int cases = 0;
  for (int ti = 0; ti < dtype_count; ++ti) {
    const dtype t = static_cast<dtype>(ti);
    for (int op = 0; op < 4; ++op) {
      for (std::size_t count : counts) {
        for (int nsrc : {1, 2, 3, 5}) {
          for (int ndst : {1, 2}) {
            for (bool alias : {false, true}) {
              const bool mean = distvals::is_floating(t) && op == 0 && nsrc > 1 && (count % 2 == 1);
              const double divisor = mean ? nsrc : 0.0;
              std::vector<std::vector<unsigned char>> in;
              for (int s = 0; s < nsrc; ++s) in.push_back(random_input(t, count, rng));
              const run_result a = run(generic, t, op, in, ndst, alias, divisor);
              const run_result b = run(avx2, t, op, in, ndst, alias, divisor);
              ++cases;
              for (int d = 0; d < ndst; ++d) {
                for (std::size_t i = 0; i < count; ++i) {
                  const std::size_t at = i * dtype_size(t);
                  if (!same(t, a.outs[d].data() + at, b.outs[d].data() + at)) {
                    CHECK_MSG(false, std::string(distvals::dtype_name(t)) + " " + op_names[op] +
                                         (mean ? " (mean)" : "") + " count " + std::to_string(count) + " nsrc " +
                                         std::to_string(nsrc) + " ndst " + std::to_string(ndst) +
                                         (alias ? " in place" : "") + ": element " + std::to_string(i) +
                                         " differs (portable " + std::to_string(as_double(t, a.outs[d].data() + at)) +
                                         ", avx2 " + std::to_string(as_double(t, b.outs[d].data() + at)) + ")");
                    break;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("  %d kernel calls compared\n", cases);
}

TEST_CASE("reduce_on_caller reduces host buffers on the calling thread as a group does") {
  using distvals::reduce_op;
  // Three sources of distinct values, to two destinations, against a float64 reference.
  const std::size_t n = 37;
  std::vector<float> a(n), b(n), c(n), out0(n, -1.0f), out1(n, -1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = 0.5f * static_cast<float>(i);
    b[i] = 100.0f + static_cast<float>(i);
    c[i] = -3.25f * static_cast<float>(i % 5);
  }
  const void* srcs[] = {a.data(), b.data(), c.data()};
  void* dsts[] = {out0.data(), out1.data()};
  distvals::reduce_on_caller(dtype::float32, reduce_op::sum, srcs, 3, dsts, 2, n);
  for (std::size_t i = 0; i < n; ++i) {
    const double want = double(a[i]) + double(b[i]) + double(c[i]);
    CHECK_MSG(out0[i] == static_cast<float>(want) && out1[i] == out0[i], "sum element " + std::to_string(i));
  }
  // A mean over more replicas than sources (others live in other processes).
  distvals::reduce_on_caller(dtype::float32, reduce_op::mean, srcs, 3, dsts, 1, n, 8);
  for (std::size_t i = 0; i < n; ++i) {
    const float sum = a[i] + b[i] + c[i];
    CHECK_MSG(out0[i] == sum / 8.0f, "mean element " + std::to_string(i));
  }
  // min propagates NaN, in place (the destination is a source).
  std::vector<double> x = {1.0, std::nan(""), -2.0}, y = {0.5, 3.0, std::nan("")};
  const void* xy[] = {x.data(), y.data()};
  void* into_x[] = {x.data()};
  distvals::reduce_on_caller(dtype::float64, reduce_op::min, xy, 2, into_x, 1, 3);
  CHECK(x[0] == 0.5 && std::isnan(x[1]) && std::isnan(x[2]));
  // Integers wrap around.
  std::vector<std::int32_t> big = {2147483647, -5}, one = {1, 7}, got(2, 0);
  const void* ints[] = {big.data(), one.data()};
  void* into_got[] = {got.data()};
  distvals::reduce_on_caller(dtype::int32, reduce_op::sum, ints, 2, into_got, 1, 2);
  CHECK(got[0] == -2147483647 - 1 && got[1] == 2);
  // Refused before any element is written.
  std::vector<std::int32_t> untouched = {42, 42};
  void* into_untouched[] = {untouched.data()};
  CHECK_THROWS_AS(distvals::reduce_on_caller(dtype::int32, reduce_op::mean, ints, 2, into_untouched, 1, 2, 2),
                  distvals::invalid_argument_error);
  CHECK_THROWS_AS(distvals::reduce_on_caller(dtype::float32, reduce_op::mean, srcs, 3, dsts, 1, n, 0),
                  distvals::invalid_argument_error);
  CHECK_THROWS_AS(distvals::reduce_on_caller(dtype::int32, reduce_op::sum, ints, 0, into_untouched, 1, 2),
                  distvals::invalid_argument_error);
  const void* with_null[] = {big.data(), nullptr};
  CHECK_THROWS_AS(distvals::reduce_on_caller(dtype::int32, reduce_op::sum, with_null, 2, into_untouched, 1, 2),
                  distvals::invalid_argument_error);
  // Enums past the last value (they index the kernel table): refused, not run.
  CHECK_THROWS_AS(distvals::reduce_on_caller(static_cast<dtype>(8), reduce_op::sum, ints, 2, into_untouched, 1, 2),
                  distvals::dtype_error);
  CHECK_THROWS_AS(distvals::reduce_on_caller(dtype::int32, static_cast<reduce_op>(7), ints, 2, into_untouched, 1, 2),
                  distvals::invalid_argument_error);
  CHECK(untouched[0] == 42 && untouched[1] == 42);
}

TEST_CASE("time_copy refuses no threads or no iterations instead of waiting for them") {
  CHECK_THROWS_AS(distvals::time_copy(0, 64, 1, 0), std::invalid_argument);
  CHECK_THROWS_AS(distvals::time_copy(-1, 64, 1, 0), std::invalid_argument);
  CHECK_THROWS_AS(distvals::time_copy(1, 64, 0, 0), std::invalid_argument);
  CHECK(distvals::time_copy(1, 64, 2, 1).size() == 2);
}

}  // namespace

TEST_MAIN()
