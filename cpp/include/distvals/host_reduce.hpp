/// @file
/// Element-wise reduction of host buffers on the calling thread, with no group.
#pragma once

#include <cstddef>

#include "distvals/dtype.hpp"
#include "distvals/export.hpp"

namespace distvals {

/// dsts[d][i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc - 1][i] for every i < count
/// and every destination d, computed on the calling thread with the engine's CPU kernels:
/// the same arithmetic as a group's direct all-reduce (float16 and bfloat16 accumulate in
/// float32, integers wrap around, min and max propagate NaN). With op mean the sum is
/// divided by `mean_divisor`, which may count replicas beyond these sources (those of
/// other processes); one source and op sum copies it to every destination.
///
/// For host buffers so small that handing them to a group's threads costs more than
/// the arithmetic. Destinations may alias sources (each block is read before any of it
/// is written). Throws invalid_argument_error, before any element is written, when
/// nsrc or ndst is below 1, a pointer is null while count is not 0, mean is asked of an
/// integer dtype, or mean_divisor is below 1 with op mean. Any thread.
DISTVALS_EXPORT void reduce_on_caller(dtype type, reduce_op op, const void* const* srcs, int nsrc, void* const* dsts,
                                      int ndst, std::size_t count, int mean_divisor = 0);

}  // namespace distvals
