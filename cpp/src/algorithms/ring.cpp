// The `ring` algorithm: a chunked, pipelined reduce-scatter followed by an all-gather,
// the schedule NCCL and Gloo use between devices.
//
// The data is cut into N segments; segment c is further cut into chunks so that the
// ring works on several chunks at once. With replicas in a ring 0 -> 1 -> ... -> N-1 -> 0
// (replica r reads from its left neighbour l = r-1):
//
//   reduce-scatter, step s = 0 .. N-2, replica r, segment c = (r - s - 1) mod N:
//     out[r][c] = in[r][c] op (s == 0 ? in[l][c] : out[l][c])
//     after step N-2, replica r holds the complete reduction of segment (r + 1) mod N.
//   all-gather, step t = 0 .. N-2, replica r, segment c = (r - t) mod N:
//     out[r][c] = out[l][c]          (l finished c in its previous step)
//
// Each step of replica r waits only for its left neighbour's previous step on the same
// chunk; a step never overwrites memory that a replica could still read (the tests
// check every schedule for such hazards).
#include <algorithm>

#include "algorithms/algorithms.hpp"

namespace distvals::algorithms {

schedule ring_all_reduce(const schedule_key& key) {
  schedule s;
  s.kind = collective::all_reduce;
  s.algo = algorithm::ring;
  s.replicas = key.replicas;
  s.count = key.count;
  const int n = key.replicas;
  s.programs.resize(static_cast<std::size_t>(n));
  if (n == 1) return direct_all_reduce(key);

  // Segment boundaries and the number of chunks the longest segment needs: every
  // replica walks the same chunk indices so that step numbers line up across replicas.
  std::vector<std::size_t> seg_begin(n), seg_end(n);
  std::size_t longest = 0;
  for (int c = 0; c < n; ++c) {
    split_range(key.count, n, c, key.align, &seg_begin[c], &seg_end[c]);
    longest = std::max(longest, seg_end[c] - seg_begin[c]);
  }
  const std::size_t chunk = bounded_chunk(longest, key.chunk);
  const std::size_t chunks = std::max<std::size_t>(1, (longest + chunk - 1) / chunk);
  const int per_chunk = 2 * (n - 1);  // steps per chunk: N-1 reduce-scatter + N-1 all-gather

  // The [b, e) range of chunk q of segment c (empty past the segment's end).
  auto chunk_range = [&](int c, std::size_t q, std::size_t* b, std::size_t* e) {
    const std::size_t len = seg_end[c] - seg_begin[c];
    const std::size_t lo = std::min(len, q * chunk), hi = std::min(len, (q + 1) * chunk);
    *b = seg_begin[c] + lo;
    *e = seg_begin[c] + hi;
  };
  auto mod = [n](int x) { return ((x % n) + n) % n; };

  for (int r = 0; r < n; ++r) {
    const int left = mod(r - 1);
    auto& prog = s.programs[r];
    prog.reserve(chunks * per_chunk);
    for (std::size_t q = 0; q < chunks; ++q) {
      const int base = static_cast<int>(q) * per_chunk;
      // Step s of the reduce-scatter: fold the left neighbour's partial sum of segment c
      // into our own input.
      for (int st = 0; st < n - 1; ++st) {
        const int c = mod(r - st - 1);
        std::size_t b = 0, e = 0;
        chunk_range(c, q, &b, &e);
        step x;
        x.kind = step::kind_t::reduce;
        x.count = e - b;
        x.finalize = (st == n - 2);  // this step completes segment c
        x.srcs = {{r, false, b}, {left, st != 0, b}};
        x.dsts = {{r, true, b}};
        if (st != 0) x.deps = {{left, base + st - 1}};
        prog.push_back(std::move(x));
      }
      // Step t of the all-gather: copy the segment the left neighbour just completed.
      for (int t = 0; t < n - 1; ++t) {
        const int c = mod(r - t);
        std::size_t b = 0, e = 0;
        chunk_range(c, q, &b, &e);
        step x;
        x.kind = step::kind_t::copy;
        x.count = e - b;
        x.srcs = {{left, true, b}};
        x.dsts = {{r, true, b}};
        x.deps = {{left, base + (n - 1) + t - 1}};
        prog.push_back(std::move(x));
      }
    }
  }
  return s;
}

}  // namespace distvals::algorithms
