// The `tree` algorithm: a pipelined double binary tree. Chunks alternate between two
// binary trees so that no replica is an interior node of both for long stretches and
// the work is shared, as in NCCL's double binary tree.
//
//   tree A (root 0)          tree B (mirror, root N-1)
//          0                        N-1
//        /   \                     /   \ .
//       1     2                 N-2     N-3
//      / \   / \                / \     / \ .
//     3   4 5   6            N-4 N-5 N-6  N-7
//
// For each chunk k of its tree:
//   reduce (up):   a leaf does nothing (its parent reads its input directly); an
//                  interior node v computes out[v][k] = in[v][k] op partial(children),
//                  where a child's partial is its input (leaf) or its output (interior).
//                  The root's result is final.
//   broadcast (down): every non-root copies out[parent][k] once the parent's copy is final.
// Every replica's program is its K reduce steps, then its K broadcast steps, so step
// numbers are the same on every replica (empty steps keep the numbering).
#include <algorithm>

#include "algorithms/algorithms.hpp"

namespace distvals::algorithms {

schedule tree_all_reduce(const schedule_key& key) {
  const int n = key.replicas;
  if (n == 1) return direct_all_reduce(key);
  schedule s;
  s.kind = collective::all_reduce;
  s.algo = algorithm::tree;
  s.replicas = n;
  s.count = key.count;
  s.programs.resize(static_cast<std::size_t>(n));

  const std::size_t chunk = bounded_chunk(key.count, key.chunk);
  const std::size_t chunks = std::max<std::size_t>(1, (key.count + chunk - 1) / chunk);
  const int kk = static_cast<int>(chunks);

  // Position of rank r in tree `t` (heap order) and back.
  auto pos_of = [n](int t, int rank) { return t == 0 ? rank : n - 1 - rank; };
  auto rank_of = [n](int t, int pos) { return t == 0 ? pos : n - 1 - pos; };

  for (int k = 0; k < kk; ++k) {
    const int t = (k % 2);  // which tree carries chunk k
    const std::size_t b = std::min(key.count, static_cast<std::size_t>(k) * chunk);
    const std::size_t e = std::min(key.count, b + chunk);
    for (int r = 0; r < n; ++r) {
      const int p = pos_of(t, r);
      const int c1 = 2 * p + 1, c2 = 2 * p + 2;
      const bool leaf = c1 >= n;
      step up;
      up.kind = step::kind_t::reduce;
      if (!leaf && e > b) {
        up.count = e - b;
        up.finalize = (p == 0);
        up.srcs.push_back({r, false, b});
        for (int c : {c1, c2}) {
          if (c >= n) continue;
          const int cr = rank_of(t, c);
          const bool child_leaf = 2 * c + 1 >= n;
          up.srcs.push_back({cr, !child_leaf, b});
          if (!child_leaf) up.deps.push_back({cr, k});
        }
        up.dsts.push_back({r, true, b});
      }
      s.programs[r].push_back(std::move(up));
    }
  }
  for (int k = 0; k < kk; ++k) {
    const int t = (k % 2);
    const std::size_t b = std::min(key.count, static_cast<std::size_t>(k) * chunk);
    const std::size_t e = std::min(key.count, b + chunk);
    for (int r = 0; r < n; ++r) {
      const int p = pos_of(t, r);
      step down;
      down.kind = step::kind_t::copy;
      if (p != 0 && e > b) {
        const int parent = (p - 1) / 2;
        const int pr = rank_of(t, parent);
        down.count = e - b;
        down.srcs.push_back({pr, true, b});
        down.dsts.push_back({r, true, b});
        // The parent's chunk is final after its reduce step (root) or its broadcast step.
        down.deps.push_back({pr, parent == 0 ? k : kk + k});
      }
      s.programs[r].push_back(std::move(down));
    }
  }
  return s;
}

}  // namespace distvals::algorithms
