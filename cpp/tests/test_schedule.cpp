// Schedules checked on their own, with no backend: every schedule is executed by a
// simulator in many random orders that respect its dependencies, and checked for
// hazards (two steps of different replicas touching the same memory, one of them
// writing, with no dependency path ordering them).
#include <algorithm>
#include <random>
#include <string>

#include "check.hpp"
#include "distvals/distvals.hpp"

using namespace distvals;

namespace {

struct region {
  int replica;
  bool output;
  std::size_t b, e;
};

bool overlaps(const region& a, const region& b, bool inplace) {
  // In place, a replica's input and output are the same memory.
  const bool same_buf = a.replica == b.replica && (inplace || a.output == b.output);
  return same_buf && a.b < b.e && b.b < a.e;
}

// happens-before over all steps: program order plus explicit dependencies, closed
// transitively. Returns reach[i][j] = step i completes before step j starts.
std::vector<std::vector<bool>> happens_before(const schedule& s, std::vector<std::pair<int, int>>& ids) {
  ids.clear();
  std::vector<std::vector<int>> index(s.programs.size());
  for (std::size_t r = 0; r < s.programs.size(); ++r) {
    for (std::size_t k = 0; k < s.programs[r].size(); ++k) {
      index[r].push_back(static_cast<int>(ids.size()));
      ids.push_back({static_cast<int>(r), static_cast<int>(k)});
    }
  }
  const std::size_t m = ids.size();
  std::vector<std::vector<int>> preds(m);
  for (std::size_t i = 0; i < m; ++i) {
    auto [r, k] = ids[i];
    if (k > 0) preds[i].push_back(index[r][k - 1]);
    for (const auto& d : s.programs[r][k].deps) preds[i].push_back(index[d.replica][d.step]);
  }
  // Topological order by repeated relaxation (schedules are small in tests).
  std::vector<std::vector<bool>> before(m, std::vector<bool>(m, false));
  std::vector<int> order;
  std::vector<int> indeg(m, 0);
  std::vector<std::vector<int>> succ(m);
  for (std::size_t i = 0; i < m; ++i) {
    for (int p : preds[i]) {
      succ[p].push_back(static_cast<int>(i));
      ++indeg[i];
    }
  }
  std::vector<int> q;
  for (std::size_t i = 0; i < m; ++i) {
    if (indeg[i] == 0) q.push_back(static_cast<int>(i));
  }
  while (!q.empty()) {
    int i = q.back();
    q.pop_back();
    order.push_back(i);
    for (int j : succ[i]) {
      if (--indeg[j] == 0) q.push_back(j);
    }
  }
  CHECK_MSG(order.size() == m, "schedule has a dependency cycle");
  for (int i : order) {
    for (int p : preds[i]) {
      before[p][i] = true;
      for (std::size_t x = 0; x < m; ++x) {
        if (before[x][p]) before[x][i] = true;
      }
    }
  }
  return before;
}

void check_hazards(const schedule& s, bool inplace, const std::string& what) {
  std::vector<std::pair<int, int>> ids;
  auto before = happens_before(s, ids);
  const std::size_t m = ids.size();
  auto regions = [&](const step& st, bool writes) {
    std::vector<region> out;
    for (const auto& r : (writes ? st.dsts : st.srcs)) out.push_back({r.replica, r.output, r.offset, r.offset + st.count});
    return out;
  };
  for (std::size_t i = 0; i < m; ++i) {
    const step& a = s.programs[ids[i].first][ids[i].second];
    if (a.count == 0) continue;
    for (std::size_t j = i + 1; j < m; ++j) {
      if (ids[i].first == ids[j].first) continue;  // program order covers one replica
      const step& b = s.programs[ids[j].first][ids[j].second];
      if (b.count == 0 || before[i][j] || before[j][i]) continue;
      bool clash = false;
      for (const auto& wa : regions(a, true)) {
        for (const auto& rb : regions(b, false)) clash |= overlaps(wa, rb, inplace);
        for (const auto& wb : regions(b, true)) clash |= overlaps(wa, wb, inplace);
      }
      for (const auto& wb : regions(b, true)) {
        for (const auto& ra : regions(a, false)) clash |= overlaps(wb, ra, inplace);
      }
      CHECK_MSG(!clash, what + ": unordered conflicting steps (" + std::to_string(ids[i].first) + "," +
                            std::to_string(ids[i].second) + ") and (" + std::to_string(ids[j].first) + "," +
                            std::to_string(ids[j].second) + ")");
      if (clash) return;
    }
  }
}

// Runs the schedule on doubles in a random order that respects dependencies.
void simulate(const schedule& s, bool inplace, unsigned seed, const std::string& what) {
  const int n = s.replicas;
  const std::size_t count = s.count;
  std::vector<std::vector<double>> in(n, std::vector<double>(count)), out(n, std::vector<double>(count, -1e300));
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < count; ++i) in[r][i] = static_cast<double>((r + 1) * 1000 + i % 97);
  }
  auto& outs = inplace ? in : out;
  std::vector<std::size_t> next(n, 0);
  std::mt19937 rng(seed);
  auto done = [&](const step_dep& d) { return next[d.replica] > static_cast<std::size_t>(d.step); };
  for (;;) {
    std::vector<int> runnable;
    for (int r = 0; r < n; ++r) {
      if (next[r] == s.programs[r].size()) continue;
      const step& st = s.programs[r][next[r]];
      if (std::all_of(st.deps.begin(), st.deps.end(), done)) runnable.push_back(r);
    }
    if (runnable.empty()) break;
    const int r = runnable[rng() % runnable.size()];
    const step& st = s.programs[r][next[r]++];
    std::vector<double> acc(st.count, 0.0);
    for (std::size_t i = 0; i < st.count; ++i) {
      double v = 0;
      for (std::size_t j = 0; j < st.srcs.size(); ++j) {
        const auto& ref = st.srcs[j];
        const double x = (ref.output ? outs : in)[ref.replica][ref.offset + i];
        v = j == 0 ? x : v + x;
      }
      acc[i] = v;
    }
    for (const auto& d : st.dsts) {
      for (std::size_t i = 0; i < st.count; ++i) (d.output ? outs : in)[d.replica][d.offset + i] = acc[i];
    }
  }
  for (int r = 0; r < n; ++r) CHECK_MSG(next[r] == s.programs[r].size(), what + ": deadlock in simulation");
  int wrong = 0;
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < count; ++i) {
      double want = 0;
      for (int j = 0; j < n; ++j) want += static_cast<double>((j + 1) * 1000 + i % 97);
      if (outs[r][i] != want) ++wrong;
    }
  }
  CHECK_MSG(wrong == 0, what + ": " + std::to_string(wrong) + " wrong elements");
}

}  // namespace

TEST_CASE("all-reduce schedules compute the sum in any valid order and have no hazards") {
  for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
    for (int n : {1, 2, 3, 4, 5, 8, 13}) {
      for (std::size_t count : {0ul, 1ul, 7ul, 61ul, 200ul}) {
        for (std::size_t chunk : {0ul, 5ul, 16ul}) {
          schedule_key key{collective::all_reduce, a, n, count, 0, chunk, 4};
          const schedule s = make_schedule(key);
          const std::string what = std::string(algorithm_name(a)) + " n=" + std::to_string(n) +
                                   " count=" + std::to_string(count) + " chunk=" + std::to_string(chunk);
          for (bool inplace : {false, true}) {
            for (unsigned seed = 0; seed < 4; ++seed) simulate(s, inplace, seed, what);
            if (count <= 61 && n <= 8) check_hazards(s, inplace, what + (inplace ? " in-place" : ""));
          }
        }
      }
    }
  }
}

TEST_CASE("a chunk too small for the count grows: every output element is still written, in few steps") {
  // 2^31 + 1 and 2^32 + 3 elements in chunks of one: the step numbers of as many chunks
  // would not fit in an int (the tree then covered none or a few elements).
  for (algorithm a : {algorithm::ring, algorithm::tree}) {
    for (int n : {2, 3}) {
      for (std::size_t count : {(std::size_t{1} << 31) + 1, (std::size_t{1} << 32) + 3}) {
        const schedule s = make_schedule({collective::all_reduce, a, n, count, 0, 1, 16});
        const std::string what = std::string(algorithm_name(a)) + " n=" + std::to_string(n) +
                                 " count=" + std::to_string(count);
        for (int r = 0; r < n; ++r) {
          const auto& prog = s.programs[static_cast<std::size_t>(r)];
          CHECK_MSG(prog.size() <= std::size_t{4} * static_cast<std::size_t>(n) * 16384, what);
          // The ranges of replica r's output that the steps write, merged, are [0, count).
          std::vector<std::pair<std::size_t, std::size_t>> written;
          for (const auto& prog_j : s.programs) {
            for (const step& st : prog_j) {
              for (const slot_ref& d : st.dsts) {
                if (d.replica == r && d.output && st.count > 0) written.emplace_back(d.offset, d.offset + st.count);
              }
            }
          }
          std::sort(written.begin(), written.end());
          std::size_t covered = 0;
          for (const auto& [b, e] : written) {
            if (b > covered) break;
            covered = std::max(covered, e);
          }
          CHECK_MSG(covered == count, what + ": replica " + std::to_string(r) + "'s output is written up to " +
                                          std::to_string(covered));
        }
      }
    }
  }
}

TEST_CASE("direct schedules cut into fewer slices than replicas (one per thread)") {
  for (collective c : {collective::all_reduce, collective::reduce}) {
    for (int n : {2, 3, 8, 13}) {
      for (int parts : {1, 2, 3}) {
        for (std::size_t count : {0ul, 1ul, 61ul, 200ul}) {
          schedule_key key{c, algorithm::direct, n, count, 0, 0, 4};
          key.parts = parts;
          const schedule s = make_schedule(key);
          int busy = 0;
          for (const auto& p : s.programs) busy += p.empty() ? 0 : 1;
          CHECK(busy <= parts);
          const std::string what = std::string(collective_name(c)) + " direct n=" + std::to_string(n) +
                                   " parts=" + std::to_string(parts) + " count=" + std::to_string(count);
          if (c == collective::all_reduce) {
            for (bool inplace : {false, true}) simulate(s, inplace, 1, what);
          }
          check_hazards(s, false, what);
        }
      }
    }
  }
}

TEST_CASE("split_range covers the range with aligned boundaries") {
  for (std::size_t count : {0ul, 1ul, 15ul, 16ul, 1000ul, 12345ul}) {
    for (int parts : {1, 2, 3, 7, 64}) {
      std::size_t prev = 0;
      for (int p = 0; p < parts; ++p) {
        std::size_t b, e;
        split_range(count, parts, p, 16, &b, &e);
        CHECK(b == prev);
        CHECK(e >= b);
        if (p + 1 < parts) CHECK(e % 16 == 0);
        prev = e;
      }
      CHECK(prev == count);
    }
  }
}

TEST_CASE("automatic algorithm resolves to a concrete one") {
  for (int n : {1, 2, 8, 64}) {
    for (std::size_t bytes : {0ul, 1024ul, 1ul << 20, 1ul << 28}) {
      CHECK(choose_algorithm(n, bytes) != algorithm::automatic);
    }
  }
  CHECK_THROWS_AS(make_schedule(schedule_key{collective::all_reduce, algorithm::automatic, 2, 4, 0, 0, 1}),
                  invalid_argument_error);
}

TEST_MAIN()
