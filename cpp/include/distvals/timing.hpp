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
/// own and joins them before returning. Throws std::invalid_argument (threads < 1,
/// iterations < 1, warmup < 0), std::bad_alloc and std::system_error (threads that
/// cannot start). Any thread.
DISTVALS_EXPORT std::vector<double> time_copy(int threads, std::size_t bytes, int iterations,
                                              int warmup);

/// The memory bound of an in-place all-reduce over `bufs` (one buffer per replica, all
/// of the same count and dtype): rounds in which `threads` threads read every byte of
/// every buffer and store it back in place, N·S bytes read and N·S written, on the very
/// buffers (so the same working set, caches and pages) the collective uses. Thread p
/// takes slice p of every buffer, cut like the direct algorithm's slices. The fastest
/// loop this processor has (AVX2, else SSE2, else 8-byte words); `streaming` stores
/// with non-temporal stores where the processor has them (see
/// memory_bound_has_streaming()), plain stores otherwise.
///
/// With `outs` (one output per buffer, of the same count and dtype, overlapping no
/// buffer and no other output): the bound of an out-of-place collective, whose results go
/// to memory of their own. Every byte of buffer i is read and stored to output i, so the
/// same N·S read and N·S written, over twice the working set.
///
/// Timed as time_collective times a single-call collective: the calling thread starts
/// the clock, hands parts 1.. to `threads - 1` persistent threads (which spin between
/// rounds, as the group's workers do between back-to-back calls), runs part 0, takes
/// over every part no thread has started yet, waits for the others and stops the
/// clock. Returns the seconds of each of the last `iterations` rounds. The contents of
/// the buffers are unchanged (outputs end as copies of them). Starts and joins
/// `threads - 1` threads of its own; throws std::invalid_argument (mismatched buffers or
/// outputs, an output that overlaps another array, threads < 1, iterations < 1) and
/// std::system_error (threads that cannot start). Any thread; nothing else may use the
/// buffers meanwhile.
DISTVALS_EXPORT std::vector<double> time_memory_bound(const std::vector<buffer_view>& bufs, int threads,
                                                      bool streaming, int iterations, int warmup,
                                                      const std::vector<buffer_view>& outs = {});

/// The CPU kernels write a reduction's result with non-temporal (streaming) stores when
/// one kernel call's outputs total at least this many bytes and the output aliases no
/// input (out-of-place): such stores skip the read for ownership of every output line.
/// The default comes from measurement; the environment variable
/// DISTVALS_STREAMING_MIN_BYTES, read once at first use, overrides it. Never throws;
/// any thread.
DISTVALS_EXPORT std::size_t streaming_store_min_bytes() noexcept;

/// Sets that threshold for every group of the process (for benchmarks: 0 streams every
/// out-of-place output, SIZE_MAX none) and returns the previous value. Calls already
/// running may use either value. Never throws; any thread.
DISTVALS_EXPORT std::size_t set_streaming_store_min_bytes(std::size_t bytes) noexcept;

/// Whether time_memory_bound can use non-temporal stores on this build and processor.
DISTVALS_EXPORT bool memory_bound_has_streaming() noexcept;

}  // namespace distvals
