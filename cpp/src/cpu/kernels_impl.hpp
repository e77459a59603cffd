// Kernel bodies, compiled once per instruction set: the including file defines
// DISTVALS_KERNEL_NS (a namespace name) first, so each copy has its own symbols and the
// linker never mixes an AVX2 instantiation into the portable path. Only plain loops and
// builtins are used here, no standard-library templates, for the same reason.
#ifndef DISTVALS_KERNEL_NS
#error "define DISTVALS_KERNEL_NS before including kernels_impl.hpp"
#endif

#include <cstdint>
#include <cstring>

#include "elementwise.hpp"
#include "kernels.hpp"

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

// ---- the blocked reduction --------------------------------------------------------

template <dtype D, class Op>
void reduce_impl(const reduce_args& a) {
  using E = elem<D>;
  using S = typename E::store_t;
  using A = typename E::acc_t;
  A acc[kBlock];
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
    for (int d = 0; d < a.ndst; ++d) {
      S* out = static_cast<S*>(a.dsts[d]) + base;
      for (std::size_t i = 0; i < n; ++i) out[i] = E::store(acc[i]);
    }
  }
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
