/// @file
/// Timing helpers used by the benchmarks: loops that run inside the engine so the
/// figures carry no interpreter overhead.
#pragma once

#include <cstddef>
#include <vector>

#include "distvals/export.hpp"
#include "distvals/group.hpp"

namespace distvals {

/// Runs `desc` `warmup + iterations` times with the single-call style and returns the
/// seconds each of the last `iterations` calls took. Same throws and threads as the
/// single-call group::run(); in place when `in` and `out` are the same buffers.
DISTVALS_EXPORT std::vector<double> time_collective(group& g, const call_desc& desc,
                                                    const std::vector<buffer_view>& in,
                                                    const std::vector<buffer_view>& out,
                                                    int iterations, int warmup);

/// Measures the machine's copy bandwidth: `threads` threads each copy `bytes` bytes
/// from a private source to a private destination, all at once, `iterations` times.
/// Returns the seconds of each round (all threads between two barriers). Bytes moved
/// per round: 2 · threads · bytes (read plus write). Starts `threads - 1` threads of its
/// own and joins them before returning. Throws std::bad_alloc and std::system_error
/// (threads that cannot start). Any thread.
DISTVALS_EXPORT std::vector<double> time_copy(int threads, std::size_t bytes, int iterations,
                                              int warmup);

}  // namespace distvals
