// CPU kernels that reduce and copy bytes. The algorithms decide what goes where; these
// functions only do the element-wise work, blocked so that the accumulator stays in L1.
#pragma once

#include <cstddef>

#include "distvals/dtype.hpp"

namespace distvals::cpu {

/// dsts[d][i] = srcs[0][i] op srcs[1][i] op ... for i < count, for every d.
/// When divisor != 0 the result is divided by it (mean). Destinations may alias sources:
/// each block is fully read before any of it is written.
struct reduce_args {
  void* const* dsts;
  int ndst;
  const void* const* srcs;
  int nsrc;
  std::size_t count;
  double divisor;
};

using reduce_kernel = void (*)(const reduce_args&);

/// The kernels for every dtype and op (sum, prod, min, max; mean uses sum + divisor).
struct kernel_table {
  reduce_kernel reduce[dtype_count][4];
  const char* isa;
};

/// The best table this processor supports, chosen once at first use. Thread-safe.
const kernel_table& kernels() noexcept;

/// Copies `bytes` from src to every destination, in cache-sized blocks.
void copy_to_all(void* const* dsts, int ndst, const void* src, std::size_t bytes) noexcept;

/// Index of a reduce_op in kernel_table::reduce (mean maps to sum).
inline int op_index(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::mean: return 0;
    case reduce_op::prod: return 1;
    case reduce_op::min: return 2;
    case reduce_op::max: return 3;
  }
  return 0;
}

namespace generic { void fill_table(kernel_table& t) noexcept; }
namespace avx2 { void fill_table(kernel_table& t) noexcept; }

}  // namespace distvals::cpu
