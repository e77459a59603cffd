// Kernel bodies, compiled once per instruction set: the including file defines
// DISTVALS_KERNEL_NS (a namespace name) first, so each copy has its own symbols and the
// linker never mixes an AVX2 instantiation into the portable path. Only plain loops and
// builtins are used here, no standard-library templates, for the same reason.
#ifndef DISTVALS_KERNEL_NS
#error "define DISTVALS_KERNEL_NS before including kernels_impl.hpp"
#endif

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "elementwise.hpp"

#include "kernels.hpp"

namespace distvals::cpu {
/// Smallest total output of one kernel call (bytes, every destination together) that is
/// written with non-temporal stores when a destination aliases no source; defined in
/// kernels.cpp.
std::size_t streaming_store_min_bytes() noexcept;
}  // namespace distvals::cpu

namespace distvals::cpu::DISTVALS_KERNEL_NS {
namespace {

// Elements per block: the float32 accumulator of a block takes 8 KiB, well inside L1.
constexpr std::size_t kBlock = 2048;

// Conversions, element types and operators are shared with the CUDA kernels.
using elementwise::elem;
using elementwise::is_int_v;
using elementwise::op_max;
using elementwise::op_min;
using elementwise::op_prod;
using elementwise::op_sum;

// ---- streaming (non-temporal) stores ---------------------------------------------
// An ordinary store to a line that is not in the cache first reads the line (a read for
// ownership), so writing S bytes to memory moves 2·S. A non-temporal store writes whole
// lines straight to memory: S bytes. Worth it only for outputs much larger than the
// cache, which would be evicted before anyone reads them anyway, and never for an output
// that is also an input (its lines are in the cache already: in place).

// Whether this build has non-temporal stores (x86-64 always has SSE2's).
constexpr bool kHasStreamingStores =
#if defined(__SSE2__)
    true;
#else
    false;
#endif

// Copies `bytes` from `src` (a block in L1) to `dst` with non-temporal stores for every
// whole 64-byte line of `dst`, plain stores for the partial lines at either end (any
// alignment, any element size). The caller fences (sfence) before the data is published.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  std::size_t head = (64u - reinterpret_cast<std::uintptr_t>(d) % 64u) % 64u;
  if (head > bytes) head = bytes;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const std::size_t body = bytes / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
#if defined(__AVX2__)
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
#else
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
#endif
  }
  std::memcpy(d + body, s + body, bytes - body);
#else
  std::memcpy(d, s, bytes);  // no non-temporal stores here: plain ones
#endif
}

// Orders the non-temporal stores before every later store (the executor's release of
// the step): another thread that sees the step done sees the data.
inline void streaming_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

template <class X, class Y> struct same_type { static constexpr bool value = false; };
template <class X> struct same_type<X, X> { static constexpr bool value = true; };

// Whether [p, p + bytes) overlaps [q, q + qbytes).
inline bool overlaps(const void* p, std::size_t bytes, const void* q, std::size_t qbytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(q);
  return a < b + qbytes && b < a + bytes;
}

// ---- the blocked reduction --------------------------------------------------------

template <dtype D, class Op>
void reduce_impl(const reduce_args& a) {
  using E = elem<D>;
  using S = typename E::store_t;
  using A = typename E::acc_t;
  A acc[kBlock];
  // Destinations written with streaming stores: large outputs that alias no source.
  // (At most 64 destinations are classified; any beyond use plain stores.)
  constexpr int kMaxStreamed = 64;
  bool streamed[kMaxStreamed];
  bool any_streamed = false;
  if (kHasStreamingStores && a.count * sizeof(S) * static_cast<std::size_t>(a.ndst) >= streaming_store_min_bytes()) {
    const std::size_t bytes = a.count * sizeof(S);
    for (int d = 0; d < a.ndst && d < kMaxStreamed; ++d) {
      bool alone = true;
      for (int j = 0; j < a.nsrc && alone; ++j) alone = !overlaps(a.dsts[d], bytes, a.srcs[j], bytes);
      streamed[d] = alone;
      any_streamed = any_streamed || alone;
    }
  }
  for (std::size_t base = 0; base < a.count; base += kBlock) {
    const std::size_t n = a.count - base < kBlock ? a.count - base : kBlock;
    // step 1: the first source (combined with the second in the same pass, if any)
    const S* s0 = static_cast<const S*>(a.srcs[0]) + base;
    int j = 1;
    if (a.nsrc >= 2) {
      const S* s1 = static_cast<const S*>(a.srcs[1]) + base;
      for (std::size_t i = 0; i < n; ++i) acc[i] = Op::apply(E::load(s0[i]), E::load(s1[i]));
      j = 2;
    } else {
      for (std::size_t i = 0; i < n; ++i) acc[i] = E::load(s0[i]);
    }
    // step 2: fold in every other source
    for (; j < a.nsrc; ++j) {
      const S* sj = static_cast<const S*>(a.srcs[j]) + base;
      for (std::size_t i = 0; i < n; ++i) acc[i] = Op::apply(acc[i], E::load(sj[i]));
    }
    // step 3: the epilogue (mean divides by the replica count)
    if constexpr (!is_int_v<A>) {
      if (a.divisor != 0.0) {
        const A d = static_cast<A>(a.divisor);
        for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] / d;
      }
    }
    // step 4: store the block into every destination
    if (any_streamed) {
      // The block in its stored form once (the accumulator itself when the types agree),
      // then streamed to every destination that takes streaming stores.
      const S* staged;
      S conv[same_type<S, A>::value ? 1 : kBlock];
      if constexpr (same_type<S, A>::value) {
        staged = acc;
      } else {
        for (std::size_t i = 0; i < n; ++i) conv[i] = E::store(acc[i]);
        staged = conv;
      }
      for (int d = 0; d < a.ndst; ++d) {
        S* out = static_cast<S*>(a.dsts[d]) + base;
        if (d < kMaxStreamed && streamed[d]) {
          stream_copy(out, staged, n * sizeof(S));
        } else {
          for (std::size_t i = 0; i < n; ++i) out[i] = staged[i];
        }
      }
      continue;
    }
    for (int d = 0; d < a.ndst; ++d) {
      S* out = static_cast<S*>(a.dsts[d]) + base;
      for (std::size_t i = 0; i < n; ++i) out[i] = E::store(acc[i]);
    }
  }
  if (any_streamed) streaming_fence();
}

template <dtype D>
void fill_dtype(kernel_table& t) {
  const int i = static_cast<int>(D);
  t.reduce[i][0] = &reduce_impl<D, op_sum>;
  t.reduce[i][1] = &reduce_impl<D, op_prod>;
  t.reduce[i][2] = &reduce_impl<D, op_min>;
  t.reduce[i][3] = &reduce_impl<D, op_max>;
}

}  // namespace

void fill_table(kernel_table& t) noexcept {
  fill_dtype<dtype::float16>(t);
  fill_dtype<dtype::bfloat16>(t);
  fill_dtype<dtype::float32>(t);
  fill_dtype<dtype::float64>(t);
  fill_dtype<dtype::int8>(t);
  fill_dtype<dtype::uint8>(t);
  fill_dtype<dtype::int32>(t);
  fill_dtype<dtype::int64>(t);
}

}  // namespace distvals::cpu::DISTVALS_KERNEL_NS
