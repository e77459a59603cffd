// The schedule builders, one per algorithm file; make_schedule() dispatches to them.
// Private to the library (not exported): call make_schedule(). Not installed.
#pragma once

#include <algorithm>
#include <cstddef>

#include "distvals/schedule.hpp"

namespace distvals::algorithms {
/// The most pipelining chunks a schedule cuts a range into. Step numbers are ints, and a
/// schedule of millions of chunks (a chunk_bytes of a few bytes on a buffer of GiBs)
/// would take more memory than the buffers; past this, chunks grow instead. (With the
/// default 256 KiB chunk, only a range over 4 GiB has that many.)
inline constexpr std::size_t max_chunks = std::size_t{1} << 14;
/// The chunk, in elements, of a range of `len` elements pipelined in chunks of `chunk`
/// (0: one chunk), made larger where it would cut the range into more than max_chunks.
inline std::size_t bounded_chunk(std::size_t len, std::size_t chunk) noexcept {
  len = std::max<std::size_t>(len, 1);
  if (chunk == 0 || chunk >= len) return len;
  return std::max(chunk, (len + max_chunks - 1) / max_chunks);
}
/// Ring all-reduce: chunked reduce-scatter then all-gather around the ring. Any thread.
schedule ring_all_reduce(const schedule_key& key);
/// Double binary tree all-reduce: pipelined reduce up, broadcast down. Any thread.
schedule tree_all_reduce(const schedule_key& key);
/// Direct all-reduce: replica r reduces slice r from all inputs into all outputs. Any thread.
schedule direct_all_reduce(const schedule_key& key);
/// Direct reduce: the replicas reduce slices of the inputs into the root's output. Any thread.
schedule direct_reduce(const schedule_key& key);
/// Direct broadcast: each replica copies the root's input into its own output. Any thread.
schedule direct_broadcast(const schedule_key& key);
/// Direct all-gather: each replica copies every input, in order, into its own output. Any thread.
schedule direct_all_gather(const schedule_key& key);
/// Direct reduce-scatter: replica r reduces block r of all inputs into its output. Any thread.
schedule direct_reduce_scatter(const schedule_key& key);
}  // namespace distvals::algorithms
