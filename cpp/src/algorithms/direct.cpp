// The `direct` algorithm: in shared memory every replica can read every buffer, so
// replica r takes slice r of the data, reduces it straight from all N inputs and
// writes the result to all N outputs. Each input element is read once and each output
// element written once: the least memory traffic any all-reduce can have.
//
//   in[0]  | s0 | s1 | s2 |        replica 1 reads s1 of every input,
//   in[1]  | s0 | s1 | s2 |  --->  reduces it in a small cache-resident block,
//   in[2]  | s0 | s1 | s2 |        and stores the block into s1 of every output.
//
// The other collectives of this file follow the same idea: reduce and reduce_scatter
// split by slice, broadcast and all_gather let each replica fill its own output.
#include "algorithms/algorithms.hpp"

namespace distvals::algorithms {
namespace {

schedule empty_schedule(const schedule_key& key) {
  schedule s;
  s.kind = key.kind;
  s.algo = algorithm::direct;
  s.replicas = key.replicas;
  s.count = key.count;
  s.root = key.root;
  s.programs.resize(static_cast<std::size_t>(key.replicas));
  return s;
}

// A reduce step over slice [b, e) of every input into the given destinations.
step slice_reduce(int n, std::size_t b, std::size_t e, std::vector<slot_ref> dsts) {
  step st;
  st.kind = step::kind_t::reduce;
  st.count = e - b;
  st.finalize = true;
  for (int j = 0; j < n; ++j) st.srcs.push_back({j, false, b});
  st.dsts = std::move(dsts);
  return st;
}

// Number of slices: one per replica unless the key asks for fewer.
int slices(const schedule_key& key) {
  return key.parts > 0 && key.parts < key.replicas ? key.parts : key.replicas;
}

}  // namespace

schedule direct_all_reduce(const schedule_key& key) {
  schedule s = empty_schedule(key);
  const int n = key.replicas, parts = slices(key);
  for (int r = 0; r < parts; ++r) {
    std::size_t b = 0, e = 0;
    split_range(key.count, parts, r, key.align, &b, &e);
    if (b == e) continue;
    std::vector<slot_ref> dsts;
    for (int j = 0; j < n; ++j) dsts.push_back({j, true, b});
    s.programs[r].push_back(slice_reduce(n, b, e, std::move(dsts)));
  }
  return s;
}

schedule direct_reduce(const schedule_key& key) {
  schedule s = empty_schedule(key);
  const int n = key.replicas, parts = slices(key);
  for (int r = 0; r < parts; ++r) {
    std::size_t b = 0, e = 0;
    split_range(key.count, parts, r, key.align, &b, &e);
    if (b == e) continue;
    s.programs[r].push_back(slice_reduce(n, b, e, {{key.root, true, b}}));
  }
  return s;
}

schedule direct_broadcast(const schedule_key& key) {
  // Each replica copies the root's input into its own output; the root's copy is
  // skipped by the executor when it is in place.
  schedule s = empty_schedule(key);
  for (int r = 0; r < key.replicas; ++r) {
    if (key.count == 0) continue;
    step st;
    st.kind = step::kind_t::copy;
    st.count = key.count;
    st.srcs.push_back({key.root, false, 0});
    st.dsts.push_back({r, true, 0});
    s.programs[r].push_back(std::move(st));
  }
  return s;
}

schedule direct_all_gather(const schedule_key& key) {
  // Replica r fills its own output: block j is a copy of replica j's input.
  schedule s = empty_schedule(key);
  for (int r = 0; r < key.replicas; ++r) {
    if (key.count == 0) continue;
    for (int j = 0; j < key.replicas; ++j) {
      step st;
      st.kind = step::kind_t::copy;
      st.count = key.count;
      st.srcs.push_back({j, false, 0});
      st.dsts.push_back({r, true, key.count * static_cast<std::size_t>(j)});
      s.programs[r].push_back(std::move(st));
    }
  }
  return s;
}

schedule direct_reduce_scatter(const schedule_key& key) {
  // key.count is each input's length, N blocks of m elements; replica r reduces block r
  // of every input into its output.
  schedule s = empty_schedule(key);
  const int n = key.replicas;
  const std::size_t m = key.count / static_cast<std::size_t>(n);
  if (m == 0) return s;
  for (int r = 0; r < n; ++r) {
    step st;
    st.kind = step::kind_t::reduce;
    st.count = m;
    st.finalize = true;
    for (int j = 0; j < n; ++j) st.srcs.push_back({j, false, m * static_cast<std::size_t>(r)});
    st.dsts.push_back({r, true, 0});
    s.programs[r].push_back(std::move(st));
  }
  return s;
}

}  // namespace distvals::algorithms
