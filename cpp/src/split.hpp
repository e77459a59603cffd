// How a range of elements is cut into parts: the one split that schedules (the slices
// of `direct`) and GPU launches (one part per device) share. Host and device code.
// Not installed.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#define DISTVALS_SPLIT_HD __host__ __device__ __forceinline__
#else
#define DISTVALS_SPLIT_HD inline
#endif

namespace distvals::detail {

/// [begin, end) of part `part` of `parts` nearly equal parts of `count` elements,
/// boundaries at multiples of `align` (the one split used by schedules and launches).
DISTVALS_SPLIT_HD void part_range(std::size_t count, int parts, int part, std::size_t align, std::size_t* begin,
                                   std::size_t* end) {
  if (align == 0) align = 1;
  auto boundary = [&](int p) -> std::size_t {
    if (p >= parts) return count;
    // count * p / parts without overflow for any count below 2^64 / parts.
    const std::size_t q = count / static_cast<std::size_t>(parts), rem = count % static_cast<std::size_t>(parts);
    const std::size_t raw = q * static_cast<std::size_t>(p) + rem * static_cast<std::size_t>(p) / static_cast<std::size_t>(parts);
    return raw / align * align;
  };
  *begin = boundary(part);
  *end = boundary(part + 1);
}

}  // namespace distvals::detail
