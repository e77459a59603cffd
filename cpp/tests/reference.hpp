// Test helpers: typed access to buffers through double, distinct values per replica,
// and the float64 reference every result is compared with.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "distvals/distvals.hpp"

namespace distvals_test {

using distvals::dtype;

// An independent bfloat16 conversion (round to nearest even), written apart from the
// library's so the tests do not check the library against itself.
inline std::uint16_t to_bf16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t lsb = (x >> 16) & 1u;
  return static_cast<std::uint16_t>((x + 0x7fffu + lsb) >> 16);
}
inline float from_bf16(std::uint16_t h) {
  std::uint32_t x = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline void store(void* p, dtype t, std::size_t i, double v) {
  switch (t) {
    case dtype::float16: static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v); break;
    case dtype::bfloat16: static_cast<std::uint16_t*>(p)[i] = to_bf16(static_cast<float>(v)); break;
    case dtype::float32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case dtype::float64: static_cast<double*>(p)[i] = v; break;
    case dtype::int8: static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(v); break;
    case dtype::uint8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
    case dtype::int32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case dtype::int64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
  }
}

inline double load(const void* p, dtype t, std::size_t i) {
  switch (t) {
    case dtype::float16: return static_cast<double>(static_cast<const _Float16*>(p)[i]);
    case dtype::bfloat16: return from_bf16(static_cast<const std::uint16_t*>(p)[i]);
    case dtype::float32: return static_cast<const float*>(p)[i];
    case dtype::float64: return static_cast<const double*>(p)[i];
    case dtype::int8: return static_cast<const std::int8_t*>(p)[i];
    case dtype::uint8: return static_cast<const std::uint8_t*>(p)[i];
    case dtype::int32: return static_cast<const std::int32_t*>(p)[i];
    case dtype::int64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
  }
  return 0;
}

// Distinct per replica and per element, small enough that every reduction over up to
// 13 replicas is exact in every dtype (sums within +-80, products within +-2^5).
inline double value(distvals::reduce_op op, dtype t, int replica, std::size_t i) {
  const long long k = static_cast<long long>(i % 1031);
  if (op == distvals::reduce_op::prod) {
    if ((k + replica) % 4 == 0) return 2.0;
    return ((k * 7 + replica) % 3 == 0) && t != dtype::uint8 ? -1.0 : 1.0;
  }
  const double v = static_cast<double>((k * 7 + replica * 13) % 11);  // 0 .. 10
  return t == dtype::uint8 ? v : v - 5.0;
}

inline double combine(distvals::reduce_op op, double a, double b) {
  switch (op) {
    case distvals::reduce_op::sum:
    case distvals::reduce_op::mean: return a + b;
    case distvals::reduce_op::prod: return a * b;
    case distvals::reduce_op::min: return std::fmin(a, b);
    case distvals::reduce_op::max: return std::fmax(a, b);
  }
  return 0;
}

inline double tolerance(dtype t) {
  switch (t) {
    case dtype::float16: return 1e-3;
    case dtype::bfloat16: return 8e-3;
    case dtype::float32: return 1e-6;
    case dtype::float64: return 1e-12;
    default: return 0;
  }
}

inline bool close(double got, double want, dtype t) {
  return std::fabs(got - want) <= tolerance(t) * std::fmax(1.0, std::fabs(want));
}

}  // namespace distvals_test
