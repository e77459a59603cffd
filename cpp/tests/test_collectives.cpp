// Every collective through the real CPU engine, in both call styles, parameterized over
// algorithm x replicas x dtype x size x op, against a float64 reference. Outputs are
// poisoned first, so an element the engine forgot to write shows up as wrong.
#include <cmath>
#include <vector>
#include <string>
#include <thread>

#include "check.hpp"
#include "reference.hpp"

using namespace distvals;
using namespace distvals_test;

namespace {

enum class style { single_call, per_replica };

struct case_t {
  collective kind;
  algorithm algo;
  int n;
  dtype type;
  std::size_t count;  // elements of each input
  reduce_op op;
  style how;
  bool inplace;
  int root;
};

std::string describe(const case_t& c) {
  return std::string(collective_name(c.kind)) + " algo=" + algorithm_name(c.algo) + " n=" + std::to_string(c.n) +
         " dtype=" + dtype_name(c.type) + " count=" + std::to_string(c.count) + " op=" + reduce_op_name(c.op) +
         (c.how == style::single_call ? " single-call" : " per-replica") + (c.inplace ? " in-place" : "");
}

std::size_t out_count(const case_t& c) {
  switch (c.kind) {
    case collective::all_gather: return c.count * c.n;
    case collective::reduce_scatter: return c.count / c.n;
    default: return c.count;
  }
}

void run_case(group& g, const case_t& c) {
  const std::size_t oc = out_count(c);
  std::vector<buffer> in, out;
  for (int r = 0; r < c.n; ++r) {
    in.emplace_back(c.count, c.type);
    out.emplace_back(oc, c.type);
    for (std::size_t i = 0; i < c.count; ++i) store(in[r].data(), c.type, i, value(c.op, c.type, r, i));
    for (std::size_t i = 0; i < oc; ++i) store(out[r].data(), c.type, i, 99.0);  // poison
  }
  std::vector<buffer_view> iv, ov;
  for (int r = 0; r < c.n; ++r) {
    iv.push_back(in[r].view());
    ov.push_back(c.inplace ? in[r].view() : out[r].view());
  }
  const call_desc d{c.kind, c.type, c.op, c.algo, c.count, c.root};
  if (c.how == style::single_call) {
    g.run(d, iv, ov);
  } else {
    std::vector<std::thread> ts;
    std::vector<std::string> errors(c.n);
    for (int r = 0; r < c.n; ++r) {
      ts.emplace_back([&, r]() {
        try {
          g.run(r, d, iv[r], ov[r]);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : ts) t.join();
    for (int r = 0; r < c.n; ++r) CHECK_MSG(errors[r].empty(), describe(c) + ": " + errors[r]);
  }

  // Reference in float64, from the values the inputs were filled with.
  auto ref_reduce = [&](std::size_t i) {
    double acc = value(c.op, c.type, 0, i);
    for (int j = 1; j < c.n; ++j) acc = combine(c.op, acc, value(c.op, c.type, j, i));
    if (c.op == reduce_op::mean) acc /= c.n;
    return acc;
  };
  std::size_t wrong = 0;
  std::string first;
  auto expect = [&](int r, std::size_t i, double want) {
    const double got = load(ov[r].data, c.type, i);
    if (!close(got, want, c.type)) {
      if (wrong++ == 0) {
        first = "replica " + std::to_string(r) + " element " + std::to_string(i) + ": got " + std::to_string(got) +
                ", want " + std::to_string(want);
      }
    }
  };
  for (int r = 0; r < c.n; ++r) {
    switch (c.kind) {
      case collective::all_reduce:
        for (std::size_t i = 0; i < c.count; ++i) expect(r, i, ref_reduce(i));
        break;
      case collective::reduce:
        if (r == c.root) {
          for (std::size_t i = 0; i < c.count; ++i) expect(r, i, ref_reduce(i));
        } else if (!c.inplace) {
          for (std::size_t i = 0; i < oc; ++i) expect(r, i, 99.0);  // untouched
        }
        break;
      case collective::broadcast:
        for (std::size_t i = 0; i < c.count; ++i) expect(r, i, value(c.op, c.type, c.root, i));
        break;
      case collective::all_gather:
        for (int j = 0; j < c.n; ++j) {
          for (std::size_t i = 0; i < c.count; ++i) expect(r, j * c.count + i, value(c.op, c.type, j, i));
        }
        break;
      case collective::reduce_scatter:
        for (std::size_t i = 0; i < oc; ++i) expect(r, i, ref_reduce(r * oc + i));
        break;
    }
  }
  // Out of place, the inputs must be untouched.
  if (!c.inplace) {
    for (int r = 0; r < c.n; ++r) {
      for (std::size_t i = 0; i < c.count; ++i) {
        if (load(iv[r].data, c.type, i) != value(c.op, c.type, r, i)) {
          if (wrong++ == 0) first = "input of replica " + std::to_string(r) + " modified";
        }
      }
    }
  }
  CHECK_MSG(wrong == 0, describe(c) + ": " + std::to_string(wrong) + " wrong, first " + first);
}

const dtype kAllTypes[] = {dtype::float16, dtype::bfloat16, dtype::float32, dtype::float64,
                           dtype::int8,    dtype::uint8,    dtype::int32,   dtype::int64};

// Replica counts of the parameterized cases; DISTVALS_TEST_QUICK keeps a smaller set that
// still covers one replica, powers of two and not, and oversubscription (5 on 2 cores).
std::vector<int> replica_counts() {
  if (quick()) return {1, 2, 3, 5};
  return {1, 2, 3, 4, 5, 8, 13};
}

}  // namespace

TEST_CASE("all_reduce: algorithm x replicas x dtype x size x op, both call styles") {
  for (int n : replica_counts()) {
    group_options o;
    o.chunk_bytes = 4096;  // small chunks so that rings and trees pipeline in the tests
    group g(n, o);
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct, algorithm::automatic}) {
      for (dtype t : kAllTypes) {
        for (std::size_t count : {0ul, 1ul, 1009ul, 70001ul}) {
          for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::mean}) {
            if (op == reduce_op::mean && !is_floating(t)) continue;
            if (count == 70001 && op != reduce_op::sum && op != reduce_op::mean) continue;
            // The long pipelined case once per element size (4, 2 and 1 bytes) when quick.
            if (count == 70001 && quick() && t != dtype::float32 && t != dtype::bfloat16 && t != dtype::int8) {
              continue;
            }
            for (style how : {style::single_call, style::per_replica}) {
              for (bool inplace : {false, true}) {
                run_case(g, {collective::all_reduce, a, n, t, count, op, how, inplace, 0});
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("all_reduce of several MiB, every algorithm") {
  for (int n : quick() ? std::vector<int>{2, 3} : std::vector<int>{2, 3, 8}) {
    group g(n);
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
      for (style how : {style::single_call, style::per_replica}) {
        run_case(g, {collective::all_reduce, a, n, dtype::float32, (3u << 20) / 4 + 5, reduce_op::sum, how, true, 0});
      }
    }
  }
}

TEST_CASE("reduce, broadcast, all_gather, reduce_scatter: replicas x dtype x size x root") {
  for (int n : replica_counts()) {
    group g(n);
    for (dtype t : kAllTypes) {
      for (std::size_t count : {0ul, 1ul, 1009ul}) {
        for (style how : {style::single_call, style::per_replica}) {
          const int root = n - 1;
          run_case(g, {collective::reduce, algorithm::direct, n, t, count, reduce_op::sum, how, false, root});
          run_case(g, {collective::reduce, algorithm::direct, n, t, count, reduce_op::max, how, true, 0});
          run_case(g, {collective::broadcast, algorithm::direct, n, t, count, reduce_op::sum, how, false, root});
          run_case(g, {collective::broadcast, algorithm::direct, n, t, count, reduce_op::sum, how, true, 0});
          run_case(g, {collective::all_gather, algorithm::direct, n, t, count, reduce_op::sum, how, false, 0});
          run_case(g, {collective::reduce_scatter, algorithm::direct, n, t, count * n, reduce_op::sum, how, false, 0});
          if (is_floating(t)) {
            run_case(g, {collective::reduce_scatter, algorithm::direct, n, t, count * n, reduce_op::mean, how, false, 0});
          }
        }
      }
    }
  }
}

TEST_CASE("64 replicas on few cores, both styles") {
  group g(64);
  for (style how : {style::single_call, style::per_replica}) {
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
      run_case(g, {collective::all_reduce, a, 64, dtype::float32, 4099, reduce_op::sum, how, true, 0});
    }
  }
}

TEST_CASE("integer sums wrap around like numpy") {
  group g(2);
  buffer a(1, dtype::int8), b(1, dtype::int8);
  a.as<std::int8_t>()[0] = 100;
  b.as<std::int8_t>()[0] = 100;
  g.all_reduce({a.view(), b.view()}, {a.view(), b.view()}, reduce_op::sum);
  CHECK(a.as<std::int8_t>()[0] == static_cast<std::int8_t>(-56));
  CHECK(b.as<std::int8_t>()[0] == static_cast<std::int8_t>(-56));
}

TEST_CASE("NaN and infinity propagate") {
  group g(3);
  std::vector<buffer> bufs;
  for (int r = 0; r < 3; ++r) bufs.emplace_back(4, dtype::float32);
  bufs[1].as<float>()[0] = NAN;
  bufs[2].as<float>()[1] = INFINITY;
  bufs[0].as<float>()[2] = NAN;  // min must propagate NaN too
  std::vector<buffer_view> v{bufs[0].view(), bufs[1].view(), bufs[2].view()};
  g.all_reduce(v, v, reduce_op::min);
  for (int r = 0; r < 3; ++r) {
    CHECK(std::isnan(bufs[r].as<float>()[0]));
    CHECK(bufs[r].as<float>()[1] == 0.0f);
    CHECK(std::isnan(bufs[r].as<float>()[2]));
  }
}

TEST_MAIN()
