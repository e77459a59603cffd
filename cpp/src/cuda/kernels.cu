// Reduce and copy kernels.
//
// Every thread moves 16-byte vectors, kUnroll of them per source in flight at once,
// in a grid-stride loop: vector i of iteration k is touched by thread i % T, so each
// of the kUnroll loads of a warp is one coalesced 512-byte transaction. A launch is
// vectorized only when every pointer is 16-byte aligned; the elements past the last
// whole vector (or all of them, when unaligned) take the scalar loop.
//
// Instantiations: one reduce kernel per dtype x op (8 x 4; mean is sum with a divisor)
// and one copy kernel per access width (16, 8, 4, 2, 1 bytes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/kernels.cuh"

namespace distvals::cuda::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// ---- element types: storage type, accumulator type, load and store ----------------

template <dtype D> struct elem;
#define DISTVALS_PLAIN_ELEM(D, T)                                      \
  template <> struct elem<D> {                                        \
    using store_t = T;                                                \
    using acc_t = T;                                                  \
    __device__ static acc_t load(store_t v) { return v; }             \
    __device__ static store_t store(acc_t v) { return v; }            \
  };
DISTVALS_PLAIN_ELEM(dtype::float32, float)
DISTVALS_PLAIN_ELEM(dtype::float64, double)
DISTVALS_PLAIN_ELEM(dtype::int8, std::int8_t)
DISTVALS_PLAIN_ELEM(dtype::uint8, std::uint8_t)
DISTVALS_PLAIN_ELEM(dtype::int32, std::int32_t)
DISTVALS_PLAIN_ELEM(dtype::int64, std::int64_t)
#undef DISTVALS_PLAIN_ELEM
// Half types are stored as their raw bits so that every storage type is trivial; the
// conversions round to nearest even, like the CPU kernels.
template <> struct elem<dtype::float16> {
  using store_t = std::uint16_t;
  using acc_t = float;
  __device__ static float load(std::uint16_t v) { return __half2float(__ushort_as_half(v)); }
  __device__ static std::uint16_t store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <> struct elem<dtype::bfloat16> {
  using store_t = std::uint16_t;
  using acc_t = float;
  __device__ static float load(std::uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  __device__ static std::uint16_t store(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

// ---- operators (the same definitions as the CPU kernels) ---------------------------
// Integer sum and product wrap around like numpy's: computed in an unsigned type,
// where overflow is defined. min and max propagate NaN like np.minimum / np.maximum.

template <class T> struct wide_unsigned { using type = T; };
template <> struct wide_unsigned<std::int8_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::uint8_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::int32_t> { using type = std::uint32_t; };
template <> struct wide_unsigned<std::int64_t> { using type = std::uint64_t; };

template <class T> __device__ inline bool is_nan(T v) {
  if constexpr (std::is_floating_point_v<T>) return v != v;
  return false;
}

struct op_sum {
  template <class T> __device__ static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = typename wide_unsigned<T>::type;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct op_prod {
  template <class T> __device__ static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = typename wide_unsigned<T>::type;
      return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  }
};
struct op_min {
  template <class T> __device__ static T apply(T a, T b) { return (a < b || is_nan(a)) ? a : b; }
};
struct op_max {
  template <class T> __device__ static T apply(T a, T b) { return (a > b || is_nan(a)) ? a : b; }
};

// 16 bytes seen as raw bits or as elements.
template <class S> union pack {
  uint4 raw;
  S e[16 / sizeof(S)];
};

__device__ inline uint4 zero16() { return make_uint4(0u, 0u, 0u, 0u); }

// ---- reduce --------------------------------------------------------------------------

template <dtype D, class Op>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const step_args a, std::size_t nvec) {
  using E = elem<D>;
  using S = typename E::store_t;
  using A = typename E::acc_t;
  constexpr int V = 16 / sizeof(S);
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;

  // Part 1: whole vectors. Step 1 loads source 0, step 2 folds in every other source,
  // step 3 applies the epilogue, step 4 stores into every destination.
  for (std::size_t base = tid; base < nvec; base += stride * kUnroll) {
    pack<S> p[kUnroll];
    A acc[kUnroll][V];
    const uint4* s0 = static_cast<const uint4*>(a.srcs[0]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      p[u].raw = i < nvec ? s0[i] : zero16();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) acc[u][k] = E::load(p[u].e[k]);
    }
    for (int j = 1; j < a.nsrc; ++j) {
      const uint4* sj = static_cast<const uint4*>(a.srcs[j]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::size_t i = base + u * stride;
        p[u].raw = i < nvec ? sj[i] : zero16();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) acc[u][k] = Op::apply(acc[u][k], E::load(p[u].e[k]));
      }
    }
    if constexpr (!std::is_integral_v<A>) {
      if (a.divisor != 0.0) {
        const A d = static_cast<A>(a.divisor);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[u][k] = acc[u][k] / d;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) p[u].e[k] = E::store(acc[u][k]);
    }
    for (int d = 0; d < a.ndst; ++d) {
      uint4* out = static_cast<uint4*>(a.dsts[d]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::size_t i = base + u * stride;
        if (i < nvec) out[i] = p[u].raw;
      }
    }
  }

  // Part 2: the remaining elements one at a time (all of them when unaligned).
  for (std::size_t i = nvec * V + tid; i < a.count; i += stride) {
    A acc = E::load(static_cast<const S*>(a.srcs[0])[i]);
    for (int j = 1; j < a.nsrc; ++j) acc = Op::apply(acc, E::load(static_cast<const S*>(a.srcs[j])[i]));
    if constexpr (!std::is_integral_v<A>) {
      if (a.divisor != 0.0) acc = acc / static_cast<A>(a.divisor);
    }
    const S v = E::store(acc);
    for (int d = 0; d < a.ndst; ++d) static_cast<S*>(a.dsts[d])[i] = v;
  }
}

bool aligned16(const step_args& a) {
  std::uintptr_t bits = 0;
  for (int j = 0; j < a.nsrc; ++j) bits |= reinterpret_cast<std::uintptr_t>(a.srcs[j]);
  for (int d = 0; d < a.ndst; ++d) bits |= reinterpret_cast<std::uintptr_t>(a.dsts[d]);
  return (bits & 15u) == 0;
}

unsigned grid_for(std::size_t threads_wanted, int max_blocks) {
  std::size_t blocks = (threads_wanted + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (max_blocks > 0 && blocks > static_cast<std::size_t>(max_blocks)) blocks = static_cast<std::size_t>(max_blocks);
  return static_cast<unsigned>(blocks);
}

template <dtype D, class Op>
cudaError_t reduce_typed(const step_args& a, int max_blocks, cudaStream_t stream) {
  using S = typename elem<D>::store_t;
  constexpr std::size_t V = 16 / sizeof(S);
  const std::size_t nvec = aligned16(a) ? a.count / V : 0;
  const std::size_t scalar = a.count - nvec * V;
  const std::size_t vec_threads = (nvec + kUnroll - 1) / kUnroll;
  const unsigned blocks = grid_for(vec_threads > scalar ? vec_threads : scalar, max_blocks);
  reduce_kernel<D, Op><<<blocks, kThreads, 0, stream>>>(a, nvec);
  return cudaGetLastError();
}

template <dtype D>
cudaError_t reduce_dtype(const step_args& a, reduce_op op, int max_blocks, cudaStream_t stream) {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::mean: return reduce_typed<D, op_sum>(a, max_blocks, stream);
    case reduce_op::prod: return reduce_typed<D, op_prod>(a, max_blocks, stream);
    case reduce_op::min: return reduce_typed<D, op_min>(a, max_blocks, stream);
    case reduce_op::max: return reduce_typed<D, op_max>(a, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

// ---- copy ------------------------------------------------------------------------------

template <class U>
__global__ void __launch_bounds__(kThreads) copy_kernel(const step_args a, std::size_t units) {
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const U* src = static_cast<const U*>(a.srcs[0]);
  for (std::size_t base = tid; base < units; base += stride * kUnroll) {
    U v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      if (i < units) v[u] = src[i];
    }
    for (int d = 0; d < a.ndst; ++d) {
      U* out = static_cast<U*>(a.dsts[d]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::size_t i = base + u * stride;
        if (i < units) out[i] = v[u];
      }
    }
  }
  // Bytes past the last whole unit.
  const unsigned char* sb = static_cast<const unsigned char*>(a.srcs[0]);
  for (std::size_t i = units * sizeof(U) + tid; i < a.count; i += stride) {
    const unsigned char b = sb[i];
    for (int d = 0; d < a.ndst; ++d) static_cast<unsigned char*>(a.dsts[d])[i] = b;
  }
}

template <class U>
cudaError_t copy_typed(const step_args& a, int max_blocks, cudaStream_t stream) {
  const std::size_t units = a.count / sizeof(U);
  const std::size_t tail = a.count - units * sizeof(U);
  const std::size_t unit_threads = (units + kUnroll - 1) / kUnroll;
  const unsigned blocks = grid_for(unit_threads > tail ? unit_threads : tail, max_blocks);
  copy_kernel<U><<<blocks, kThreads, 0, stream>>>(a, units);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reduce(const step_args& a, dtype type, reduce_op op, int max_blocks,
                          cudaStream_t stream) noexcept {
  if (a.count == 0 || a.ndst == 0) return cudaSuccess;
  if (a.nsrc < 1 || a.nsrc > kMaxPointers || a.ndst > kMaxPointers) return cudaErrorInvalidValue;
  switch (type) {
    case dtype::float16: return reduce_dtype<dtype::float16>(a, op, max_blocks, stream);
    case dtype::bfloat16: return reduce_dtype<dtype::bfloat16>(a, op, max_blocks, stream);
    case dtype::float32: return reduce_dtype<dtype::float32>(a, op, max_blocks, stream);
    case dtype::float64: return reduce_dtype<dtype::float64>(a, op, max_blocks, stream);
    case dtype::int8: return reduce_dtype<dtype::int8>(a, op, max_blocks, stream);
    case dtype::uint8: return reduce_dtype<dtype::uint8>(a, op, max_blocks, stream);
    case dtype::int32: return reduce_dtype<dtype::int32>(a, op, max_blocks, stream);
    case dtype::int64: return reduce_dtype<dtype::int64>(a, op, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy(const step_args& a, int max_blocks, cudaStream_t stream) noexcept {
  if (a.count == 0 || a.ndst == 0) return cudaSuccess;
  if (a.nsrc < 1 || a.ndst > kMaxPointers) return cudaErrorInvalidValue;
  // The widest access every pointer is aligned to.
  std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(a.srcs[0]);
  for (int d = 0; d < a.ndst; ++d) bits |= reinterpret_cast<std::uintptr_t>(a.dsts[d]);
  if ((bits & 15u) == 0) return copy_typed<uint4>(a, max_blocks, stream);
  if ((bits & 7u) == 0) return copy_typed<uint2>(a, max_blocks, stream);
  if ((bits & 3u) == 0) return copy_typed<unsigned>(a, max_blocks, stream);
  if ((bits & 1u) == 0) return copy_typed<unsigned short>(a, max_blocks, stream);
  return copy_typed<unsigned char>(a, max_blocks, stream);
}

}  // namespace distvals::cuda::kernels
