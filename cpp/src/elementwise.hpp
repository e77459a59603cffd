// One element of a reduction, shared by the CPU kernels (compiled once per instruction
// set) and the CUDA kernels: the half-precision conversions, the storage and accumulator
// type of every dtype, and the operators. Not installed.
//
// Everything here has internal linkage (an unnamed namespace), so each translation unit
// keeps its own copy: an AVX2 build of a function can never stand in for the portable
// one at link time. Only plain code and builtins are used, and on a GPU the conversions
// use the hardware's own instructions (same rounding: to nearest, ties to even).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "distvals/dtype.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DISTVALS_HD __host__ __device__ __forceinline__
#else
#define DISTVALS_HD inline
#endif

namespace distvals::elementwise {
namespace {

// ---- half-precision conversions (IEEE binary16 and bfloat16) ----------------------

DISTVALS_HD float f16_to_f32(std::uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // zero
  } else {
    // subnormal: value = mant * 2^-24, exact in float32
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

DISTVALS_HD std::uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or nan (keep nan quiet and non-zero)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  }
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (ax < 0x38800000u) {
    // result is subnormal or zero: round ax * 2^24 to the nearest integer, ties to even
    float a;
    std::memcpy(&a, &ax, 4);
    const float scaled = a * 16777216.0f;
    std::uint32_t m = static_cast<std::uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<std::uint16_t>(sign | m);
  }
  // normal: rebias 127 -> 15 and round the 13 dropped bits to nearest even
  std::uint32_t r = ax - (112u << 23);
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
#endif
}

DISTVALS_HD float bf16_to_f32(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

DISTVALS_HD std::uint16_t f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(x >> 16);
#endif
}

// ---- element types: storage type, accumulator type, load and store -----------------

template <dtype D> struct elem;
#define DISTVALS_PLAIN_ELEM(D, T)                                  \
  template <> struct elem<D> {                                    \
    using store_t = T;                                            \
    using acc_t = T;                                              \
    static DISTVALS_HD acc_t load(store_t v) { return v; }        \
    static DISTVALS_HD store_t store(acc_t v) { return v; }       \
  };
DISTVALS_PLAIN_ELEM(dtype::float32, float)
DISTVALS_PLAIN_ELEM(dtype::float64, double)
DISTVALS_PLAIN_ELEM(dtype::int8, std::int8_t)
DISTVALS_PLAIN_ELEM(dtype::uint8, std::uint8_t)
DISTVALS_PLAIN_ELEM(dtype::int32, std::int32_t)
DISTVALS_PLAIN_ELEM(dtype::int64, std::int64_t)
#undef DISTVALS_PLAIN_ELEM
// Half types are stored as their raw bits (every storage type is trivial) and reduced
// in float32.
template <> struct elem<dtype::float16> {
  using store_t = std::uint16_t;
  using acc_t = float;
  static DISTVALS_HD acc_t load(store_t v) { return f16_to_f32(v); }
  static DISTVALS_HD store_t store(acc_t v) { return f32_to_f16(v); }
};
template <> struct elem<dtype::bfloat16> {
  using store_t = std::uint16_t;
  using acc_t = float;
  static DISTVALS_HD acc_t load(store_t v) { return bf16_to_f32(v); }
  static DISTVALS_HD store_t store(acc_t v) { return f32_to_bf16(v); }
};

// ---- operators -------------------------------------------------------------------
// Integer sum and product wrap around like numpy's: computed in the unsigned type of
// the same width, where overflow is defined. min and max propagate NaN like np.minimum.

template <class T> struct wide_unsigned { using type = T; };
template <> struct wide_unsigned<std::int8_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::uint8_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::int32_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::int64_t> { using type = std::uint64_t; };

template <class T> constexpr bool is_int_v = std::is_integral_v<T>;

struct op_sum {
  template <class T> static DISTVALS_HD T apply(T a, T b) {
    if constexpr (is_int_v<T>) {
      using U = typename wide_unsigned<T>::type;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct op_prod {
  template <class T> static DISTVALS_HD T apply(T a, T b) {
    if constexpr (is_int_v<T>) {
      using U = typename wide_unsigned<T>::type;
      return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  }
};
struct op_min {
  template <class T> static DISTVALS_HD T apply(T a, T b) { return (a < b || a != a) ? a : b; }
};
struct op_max {
  template <class T> static DISTVALS_HD T apply(T a, T b) { return (a > b || a != a) ? a : b; }
};

}  // namespace
}  // namespace distvals::elementwise
