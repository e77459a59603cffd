// The collective kernel: one launch reads every source and writes every destination of
// every segment of a collective (launch.hpp), as the CPU kernels do on the host.
//
// Each thread moves 16-byte vectors in a grid-stride loop, `unroll` vectors per source
// in flight at once and two sources loaded together before they are folded, so a warp
// keeps many coalesced 512-byte transactions outstanding. Step by step, per segment:
//
//   1. take this launch's part [b, e) of the segment;
//   2. peel a head of up to 15 bytes so that source 0 is 16-byte aligned, then whole
//      vectors, then a tail: only head and tail go element by element, whatever the
//      alignment of the buffers;
//   3. a source or destination with another alignment than source 0 (a block of a
//      reduce_scatter or all_gather that is not a multiple of 16 bytes) is still read
//      and written 16 bytes per thread and step, in the widest accesses its alignment
//      allows;
//   4. fold the sources in the accumulator type (float32 for the half types), divide
//      for the mean, store to every destination.
//
// The grid is one full wave of resident blocks (or fewer for small segments), so no
// block waits for another to finish before it starts.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "cuda/launch.hpp"
#include "elementwise.hpp"

namespace distvals::cuda {
namespace {

constexpr int kThreads = 256;

// ---- 16 bytes at any alignment -------------------------------------------------------

// The alignment of `p` in bytes, up to 16 (the lowest set bit of its address).
__device__ __forceinline__ unsigned alignment(const void* p) {
  const unsigned low = static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(p)) & 15u;
  return low == 0 ? 16u : (low & (0u - low));
}

template <class W>
__device__ __forceinline__ uint4 load_as(const char* p) {
  union {
    uint4 v;
    W w[16 / sizeof(W)];
  } u;
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(W)); ++i) u.w[i] = reinterpret_cast<const W*>(p)[i];
  return u.v;
}

template <class W>
__device__ __forceinline__ void store_as(char* p, uint4 v) {
  union {
    uint4 v;
    W w[16 / sizeof(W)];
  } u;
  u.v = v;
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(W)); ++i) reinterpret_cast<W*>(p)[i] = u.w[i];
}

// `align` is the same for every vector of a pointer in the body (they are 16 bytes
// apart), so the branch never diverges within a warp.
__device__ __forceinline__ uint4 load16(const char* p, unsigned align) {
  switch (align) {
    case 16: return *reinterpret_cast<const uint4*>(p);
    case 8: return load_as<uint2>(p);
    case 4: return load_as<unsigned>(p);
    case 2: return load_as<unsigned short>(p);
    default: return load_as<unsigned char>(p);
  }
}

__device__ __forceinline__ void store16(char* p, unsigned align, uint4 v) {
  switch (align) {
    case 16: *reinterpret_cast<uint4*>(p) = v; return;
    case 8: store_as<uint2>(p, v); return;
    case 4: store_as<unsigned>(p, v); return;
    case 2: store_as<unsigned short>(p, v); return;
    default: store_as<unsigned char>(p, v); return;
  }
}

template <class S>
union pack {
  uint4 raw;
  S e[16 / sizeof(S)];
};

// ---- the kernel ----------------------------------------------------------------------

// `Copy` moves bytes (one source, no arithmetic); otherwise elements of D are folded
// with Op.
struct op_copy {};

template <dtype D, class Op, bool Copy>
__global__ void __launch_bounds__(kThreads) collective_kernel(const launch_args a) {
  using E = elementwise::elem<D>;
  using S = typename E::store_t;  // the unit moved: bytes for a copy
  using A = typename E::acc_t;
  constexpr int V = 16 / sizeof(S);                // units per vector
  constexpr int U = V >= 16 ? 2 : 4;               // vectors per source in flight
  const int seg = static_cast<int>(blockIdx.y);
  const std::size_t es = element_size(a.type);     // the collective's element size

  // Step 1: this launch's part of the segment, in units of S.
  std::size_t b = 0, e = 0;
  part_range(segment_length(a), a.parts, a.part, part_align, &b, &e);
  if (e <= b) return;
  const std::size_t len = (e - b) * es / sizeof(S);
  const int nsrc = segment_sources(a, seg), ndst = segment_destinations(a, seg);
  auto src = [&](int j) { return segment_source(a, seg, j, es) + b * es; };
  auto dst = [&](int d) { return segment_destination(a, seg, d, es) + b * es; };
  const char* const src0 = src(0);

  // Step 2: head (until source 0 is aligned), whole vectors, tail.
  std::size_t head = ((16u - (static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(src0)) & 15u)) & 15u) / sizeof(S);
  if (head > len) head = len;
  const std::size_t nvec = (len - head) / V;
  const std::size_t body_end = head + nvec * V;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const bool mean = !Copy && takes_mean(a);
  const A divisor = static_cast<A>(a.n);

  // Step 3: the body, `U` vectors of every source per thread and step.
  for (std::size_t base = tid; base < nvec; base += stride * U) {
    if constexpr (Copy) {
      pack<S> v[U];
      const unsigned al = alignment(src0 + head);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const std::size_t i = base + u * stride;
        if (i < nvec) v[u].raw = load16(src0 + (head + i * V), al);
      }
      for (int d = 0; d < ndst; ++d) {
        char* q = dst(d);
        if (q == src0) continue;  // in place: already right
        const unsigned qa = alignment(q + head);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const std::size_t i = base + u * stride;
          if (i < nvec) store16(q + (head + i * V), qa, v[u].raw);
        }
      }
    } else {
      A acc[U][V];
      pack<S> p[U], q[U];
      // Two sources at a time, 2U loads in flight, folded in source order.
      for (int j = 0; j < nsrc; j += 2) {
        const bool two = j + 1 < nsrc;
        const char* sj = src(j) + head * sizeof(S);
        const char* sk = two ? src(j + 1) + head * sizeof(S) : sj;
        const unsigned aj = alignment(sj), ak = alignment(sk);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const std::size_t i = base + u * stride;
          if (i < nvec) {
            p[u].raw = load16(sj + i * 16, aj);
            if (two) q[u].raw = load16(sk + i * 16, ak);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            acc[u][k] = j == 0 ? E::load(p[u].e[k]) : Op::apply(acc[u][k], E::load(p[u].e[k]));
            if (two) acc[u][k] = Op::apply(acc[u][k], E::load(q[u].e[k]));
          }
        }
      }
      // Step 4: the mean's division, then every destination.
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if constexpr (!elementwise::is_int_v<A>) {
            if (mean) acc[u][k] = acc[u][k] / divisor;
          }
          p[u].e[k] = E::store(acc[u][k]);
        }
      }
      for (int d = 0; d < ndst; ++d) {
        char* o = dst(d) + head * sizeof(S);
        const unsigned oa = alignment(o);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const std::size_t i = base + u * stride;
          if (i < nvec) store16(o + i * 16, oa, p[u].raw);
        }
      }
    }
  }

  // The head and tail units, one per thread.
  const std::size_t rest = head + (len - body_end);
  for (std::size_t t = tid; t < rest; t += stride) {
    const std::size_t i = t < head ? t : body_end + (t - head);
    if constexpr (Copy) {
      const S v = reinterpret_cast<const S*>(src0)[i];
      for (int d = 0; d < ndst; ++d) {
        S* q = reinterpret_cast<S*>(dst(d));
        if (reinterpret_cast<const char*>(q) != src0) q[i] = v;
      }
    } else {
      A acc = E::load(reinterpret_cast<const S*>(src0)[i]);
      for (int j = 1; j < nsrc; ++j) acc = Op::apply(acc, E::load(reinterpret_cast<const S*>(src(j))[i]));
      if constexpr (!elementwise::is_int_v<A>) {
        if (mean) acc = acc / divisor;
      }
      const S v = E::store(acc);
      for (int d = 0; d < ndst; ++d) reinterpret_cast<S*>(dst(d))[i] = v;
    }
  }
}

// ---- launching -----------------------------------------------------------------------

template <dtype D, class Op, bool Copy>
cudaError_t launch_typed(const launch_args& a, cudaStream_t stream) {
  using S = typename elementwise::elem<D>::store_t;
  constexpr int V = 16 / sizeof(S);
  constexpr int U = V >= 16 ? 2 : 4;
  // Resident blocks per multiprocessor of this instantiation, asked once per process.
  static std::atomic<int> resident{0};
  int per_sm = resident.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, collective_kernel<D, Op, Copy>, kThreads, 0) !=
            cudaSuccess ||
        per_sm < 1) {
      (void)cudaGetLastError();
      per_sm = 1;
    }
    resident.store(per_sm, std::memory_order_relaxed);
  }
  const int nseg = segments(a);
  std::size_t b = 0, e = 0;
  part_range(segment_length(a), a.parts, a.part, part_align, &b, &e);
  const std::size_t units = e > b ? (e - b) * element_size(a.type) / sizeof(S) : 0;
  // Enough threads for every vector (U per thread), at least one block, at most one wave
  // shared by the segments.
  const std::size_t want = (units / V + static_cast<std::size_t>(kThreads) * U - 1) / (static_cast<std::size_t>(kThreads) * U);
  const std::size_t wave = static_cast<std::size_t>(a.multiprocessors) * static_cast<std::size_t>(per_sm);
  std::size_t blocks = want < 1 ? 1 : want;
  const std::size_t cap = wave / static_cast<std::size_t>(nseg) < 1 ? 1 : wave / static_cast<std::size_t>(nseg);
  if (blocks > cap) blocks = cap;
  collective_kernel<D, Op, Copy><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nseg)), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <dtype D>
cudaError_t launch_dtype(const launch_args& a, cudaStream_t stream) {
  switch (a.op) {
    case reduce_op::sum:
    case reduce_op::mean: return launch_typed<D, elementwise::op_sum, false>(a, stream);
    case reduce_op::prod: return launch_typed<D, elementwise::op_prod, false>(a, stream);
    case reduce_op::min: return launch_typed<D, elementwise::op_min, false>(a, stream);
    case reduce_op::max: return launch_typed<D, elementwise::op_max, false>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_collective(const launch_args& a, cudaStream_t stream) noexcept {
  if (a.count == 0) return cudaSuccess;
  if (a.n < 1 || a.n > max_launch_replicas || a.parts < 1) return cudaErrorInvalidValue;
  if (is_copy(a)) return launch_typed<dtype::uint8, elementwise::op_sum, true>(a, stream);
  switch (a.type) {
    case dtype::float16: return launch_dtype<dtype::float16>(a, stream);
    case dtype::bfloat16: return launch_dtype<dtype::bfloat16>(a, stream);
    case dtype::float32: return launch_dtype<dtype::float32>(a, stream);
    case dtype::float64: return launch_dtype<dtype::float64>(a, stream);
    case dtype::int8: return launch_dtype<dtype::int8>(a, stream);
    case dtype::uint8: return launch_dtype<dtype::uint8>(a, stream);
    case dtype::int32: return launch_dtype<dtype::int32>(a, stream);
    case dtype::int64: return launch_dtype<dtype::int64>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace distvals::cuda
