// Every collective in both call styles, parameterized over algorithm x replicas x dtype
// x size x op, against a float64 reference, on one backend per run (backends.hpp):
// `test_collectives cpu`, `... model` (GPU replicas on the host model of CUDA, on one
// device and spread over several, with and without peer access) and `... cuda`.
// Outputs are poisoned first, so an element the engine forgot to write shows up as wrong.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "group_impl.hpp"  // only to set a group's call counters (the 2^32 test)
#include "reference.hpp"

using namespace distvals;
using namespace distvals_test;

namespace {

std::unique_ptr<backend> B;

enum class style { single_call, per_replica };

struct case_t {
  collective kind;
  algorithm algo;
  dtype type;
  std::size_t count;  // elements of each input
  reduce_op op;
  style how;
  bool inplace;
  int root;
};

std::string describe(const case_t& c, const group& g) {
  return B->name() + ": " + collective_name(c.kind) + " algo=" + algorithm_name(c.algo) + " n=" +
         std::to_string(g.size()) + " dtype=" + dtype_name(c.type) + " count=" + std::to_string(c.count) +
         " op=" + reduce_op_name(c.op) + (c.how == style::single_call ? " single-call" : " per-replica") +
         (c.inplace ? " in-place" : "");
}

std::size_t out_count(const case_t& c, int n) {
  switch (c.kind) {
    case collective::all_gather: return c.count * n;
    case collective::reduce_scatter: return c.count / n;
    default: return c.count;
  }
}

void run_case(group& g, const case_t& c) {
  const int n = g.size();
  const std::size_t oc = out_count(c, n);
  // Host copies of every input and output: distinct values per replica, poisoned outputs.
  std::vector<buffer> hin, hout;
  std::vector<buffer_view> iv, ov;
  for (int r = 0; r < n; ++r) {
    hin.emplace_back(c.count, c.type);
    hout.emplace_back(oc, c.type);
    for (std::size_t i = 0; i < c.count; ++i) store(hin[r].data(), c.type, i, value(c.op, c.type, r, i));
    for (std::size_t i = 0; i < oc; ++i) store(hout[r].data(), c.type, i, 99.0);
    iv.push_back(B->alloc(g, r, c.count, c.type));
    B->to_device(iv.back(), hin[r].data());
    if (c.inplace) {
      ov.push_back(iv.back());
    } else {
      ov.push_back(B->alloc(g, r, oc, c.type));
      B->to_device(ov.back(), hout[r].data());
    }
  }
  const call_desc d{c.kind, c.type, c.op, c.algo, c.count, c.root};
  if (c.how == style::single_call) {
    g.run(d, iv, ov);
  } else {
    std::vector<std::thread> ts;
    std::vector<std::string> errors(n);
    for (int r = 0; r < n; ++r) {
      ts.emplace_back([&, r]() {
        try {
          g.run(r, d, iv[r], ov[r]);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : ts) t.join();
    for (int r = 0; r < n; ++r) CHECK_MSG(errors[r].empty(), describe(c, g) + ": " + errors[r]);
  }

  // Read back every output (and input, which must be untouched out of place).
  std::vector<buffer> got, gin;
  for (int r = 0; r < n; ++r) {
    got.emplace_back(ov[r].count, c.type);
    gin.emplace_back(c.count, c.type);
    B->to_host(got[r].data(), ov[r]);
    B->to_host(gin[r].data(), iv[r]);
  }
  // Reference in float64, from the values the inputs were filled with.
  auto ref_reduce = [&](std::size_t i) {
    double acc = value(c.op, c.type, 0, i);
    for (int j = 1; j < n; ++j) acc = combine(c.op, acc, value(c.op, c.type, j, i));
    if (c.op == reduce_op::mean) acc /= n;
    return acc;
  };
  std::size_t wrong = 0;
  std::string first;
  auto expect = [&](int r, std::size_t i, double want) {
    const double v = load(got[r].data(), c.type, i);
    if (!close(v, want, c.type) && wrong++ == 0) {
      first = "replica " + std::to_string(r) + " element " + std::to_string(i) + ": got " + std::to_string(v) +
              ", want " + std::to_string(want);
    }
  };
  for (int r = 0; r < n; ++r) {
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
        for (int j = 0; j < n; ++j) {
          for (std::size_t i = 0; i < c.count; ++i) expect(r, j * c.count + i, value(c.op, c.type, j, i));
        }
        break;
      case collective::reduce_scatter:
        for (std::size_t i = 0; i < oc; ++i) expect(r, i, ref_reduce(r * oc + i));
        break;
    }
    if (!c.inplace) {
      for (std::size_t i = 0; i < c.count; ++i) {
        if (load(gin[r].data(), c.type, i) != value(c.op, c.type, r, i) && wrong++ == 0) {
          first = "input of replica " + std::to_string(r) + " modified";
        }
      }
    }
  }
  CHECK_MSG(wrong == 0, describe(c, g) + ": " + std::to_string(wrong) + " wrong, first " + first);
  B->release();
  if (B->model()) {
    CHECK_MSG(B->model()->hazards() == 0, describe(c, g) + ": " + B->model()->first_hazard());
    CHECK(B->model()->illegal_accesses() == 0);
  }
}

const dtype kAllTypes[] = {dtype::float16, dtype::bfloat16, dtype::float32, dtype::float64,
                           dtype::int8,    dtype::uint8,    dtype::int32,   dtype::int64};

// Replica counts of the parameterized cases; DISTVALS_TEST_QUICK keeps a smaller set that
// still covers one replica, powers of two and not, and oversubscription (5 on 2 cores).
std::vector<int> replica_counts() {
  if (quick()) return {1, 2, 3, 5};
  return {1, 2, 3, 4, 5, 8, 13};
}

// Whether a case of this element type and op runs. Under DISTVALS_TEST_QUICK (the
// sanitizer and valgrind runs, where each collective costs the most) the host model of
// CUDA takes one element type of each size and kind, and the ops that differ in how they
// combine (sum, max, mean): its kernels are the CPU backend's, whose quick sweep keeps
// every type and op, and what the model adds is the orchestration of streams, events and
// copies, which is the same for every type and op. Full runs take everything.
bool sweeps(dtype t, reduce_op op) {
  if (!quick() || B->model() == nullptr) return true;
  const bool type_kept = t == dtype::float16 || t == dtype::float32 || t == dtype::int8 || t == dtype::int64;
  return type_kept && (op == reduce_op::sum || op == reduce_op::max || op == reduce_op::mean);
}

// Where the GPU replicas of an n-replica group live: all on device 0 (logical GPUs),
// and, where there are several devices, round robin over them.
std::vector<std::vector<int>> placements(int n) {
  std::vector<std::vector<int>> out{{}};  // {} means all on device 0
  if (B->gpu() && B->devices() > 1 && n > 1) {
    std::vector<int> spread;
    for (int r = 0; r < n; ++r) spread.push_back(r % B->devices());
    out.push_back(spread);
  }
  return out;
}

}  // namespace

TEST_CASE("all_reduce: algorithm x replicas x dtype x size x op, both call styles") {
  for (int n : replica_counts()) {
    for (const auto& gpus : placements(n)) {
      group_options o;
      o.chunk_bytes = 4096;  // small chunks so that rings and trees pipeline in the tests
      auto g = B->make_group(n, o, gpus);
      const bool spread = !gpus.empty();
      for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct, algorithm::automatic}) {
        for (dtype t : kAllTypes) {
          for (std::size_t count : {0ul, 1ul, 1009ul, 70001ul}) {
            for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::mean}) {
              if (op == reduce_op::mean && !is_floating(t)) continue;
              if (!sweeps(t, op)) continue;
              if (count == 70001 && op != reduce_op::sum && op != reduce_op::mean) continue;
              // The long case once per element size (4, 2 and 1 bytes) when quick or spread.
              if (count == 70001 && (quick() || spread) && t != dtype::float32 && t != dtype::bfloat16 &&
                  t != dtype::int8) {
                continue;
              }
              if (spread && op != reduce_op::sum && op != reduce_op::mean && op != reduce_op::max) continue;
              for (style how : {style::single_call, style::per_replica}) {
                for (bool inplace : {false, true}) {
                  run_case(*g, {collective::all_reduce, a, t, count, op, how, inplace, 0});
                }
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
    auto g = B->make_group(n);
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
      for (style how : {style::single_call, style::per_replica}) {
        run_case(*g, {collective::all_reduce, a, dtype::float32, (3u << 20) / 4 + 5, reduce_op::sum, how, true, 0});
      }
    }
  }
}

TEST_CASE("reduce, broadcast, all_gather, reduce_scatter: replicas x dtype x size x root") {
  for (int n : replica_counts()) {
    for (const auto& gpus : placements(n)) {
      auto g = B->make_group(n, {}, gpus);
      for (dtype t : kAllTypes) {
        if (!sweeps(t, reduce_op::sum)) continue;
        for (std::size_t count : {0ul, 1ul, 1009ul}) {
          for (style how : {style::single_call, style::per_replica}) {
            const int root = n - 1;
            run_case(*g, {collective::reduce, algorithm::direct, t, count, reduce_op::sum, how, false, root});
            run_case(*g, {collective::reduce, algorithm::direct, t, count, reduce_op::max, how, true, 0});
            run_case(*g, {collective::broadcast, algorithm::direct, t, count, reduce_op::sum, how, false, root});
            run_case(*g, {collective::broadcast, algorithm::direct, t, count, reduce_op::sum, how, true, 0});
            run_case(*g, {collective::all_gather, algorithm::direct, t, count, reduce_op::sum, how, false, 0});
            run_case(*g, {collective::reduce_scatter, algorithm::direct, t, count * n, reduce_op::sum, how, false, 0});
            if (is_floating(t)) {
              run_case(*g, {collective::reduce_scatter, algorithm::direct, t, count * n, reduce_op::mean, how, false, 0});
            }
          }
        }
      }
    }
  }
}

TEST_CASE("many replicas on few cores, both styles") {
  const int n = B->gpu() ? 64 : 64;  // 64 is also the most a GPU group holds
  auto g = B->make_group(n);
  for (style how : {style::single_call, style::per_replica}) {
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
      run_case(*g, {collective::all_reduce, a, dtype::float32, 4099, reduce_op::sum, how, true, 0});
    }
  }
}

TEST_CASE("integer sums wrap around like numpy") {
  auto g = B->make_group(2);
  const std::int8_t v = 100;
  std::vector<buffer_view> bufs{B->alloc(*g, 0, 1, dtype::int8), B->alloc(*g, 1, 1, dtype::int8)};
  for (auto& b : bufs) B->to_device(b, &v);
  g->all_reduce(bufs, bufs, reduce_op::sum);
  for (auto& b : bufs) {
    std::int8_t got = 0;
    B->to_host(&got, b);
    CHECK(got == static_cast<std::int8_t>(-56));
  }
}

TEST_CASE("NaN and infinity propagate") {
  auto g = B->make_group(3);
  std::vector<buffer_view> bufs;
  for (int r = 0; r < 3; ++r) {
    float h[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    if (r == 1) h[0] = NAN;
    if (r == 2) h[1] = INFINITY;
    if (r == 0) h[2] = NAN;  // min must propagate NaN too
    bufs.push_back(B->alloc(*g, r, 4, dtype::float32));
    B->to_device(bufs.back(), h);
  }
  g->all_reduce(bufs, bufs, reduce_op::min);
  for (int r = 0; r < 3; ++r) {
    float h[4];
    B->to_host(h, bufs[r]);
    CHECK(std::isnan(h[0]));
    CHECK(h[1] == 2.0f);  // min(2, 2, inf)
    CHECK(std::isnan(h[2]));
  }
}

TEST_CASE("lingering workers: back-to-back calls stay right; the setting is clamped and returned") {
  group_options o;
  o.spin_us = 0;  // workers would sleep between calls but for the linger
  auto g = B->make_group(3, o);
  CHECK(g->set_linger_us(500) == 0);
  for (int i = 0; i < 20; ++i) {
    for (algorithm a : {algorithm::ring, algorithm::direct}) {
      run_case(*g, {collective::all_reduce, a, dtype::float32, 70001, reduce_op::sum, style::single_call, i % 2 == 0, 0});
    }
  }
  CHECK(g->set_linger_us(-5) == 500);
  CHECK(g->set_linger_us(1 << 30) == 0);
  CHECK(g->set_linger_us(0) == 100000);
  run_case(*g, {collective::all_reduce, algorithm::direct, dtype::float32, 1009, reduce_op::max, style::single_call, true, 0});
}

TEST_CASE("batches: overlapping ones are counted, the workers linger until the last closes") {
  group_options o;
  o.spin_us = 0;
  auto g = B->make_group(2, o);
  CHECK(g->batch(true) == 1);
  CHECK(g->batch(true) == 2);  // a second caller's batch, overlapping the first
  for (int i = 0; i < 10; ++i) {
    run_case(*g, {collective::all_reduce, algorithm::direct, dtype::float32, 4099, reduce_op::sum, style::single_call, i % 2 == 0, 0});
  }
  CHECK(g->batch(false) == 1);  // the first closes; the second is still open
  CHECK(g->batch(false) == 0);
  CHECK(g->batch(false) == 0);  // an unmatched close leaves the count at zero
  CHECK(g->batch(true) == 1);
  CHECK(g->batch(false) == 0);
  CHECK(g->set_linger_us(0) == 0);  // batches never touch the linger setting
  run_case(*g, {collective::all_reduce, algorithm::ring, dtype::float64, 1001, reduce_op::max, style::single_call, true, 0});
}

// A group's implementation, reached through the accessor subclasses are given.
struct state_of : group {
  static group::impl& get(const group& g) { return (g.*(&state_of::state))(); }
};

TEST_CASE("per-replica calls across call number 2^32 wait for a late replica and reduce its data") {
  // The call counters are set as 2^32 - 3 calls would leave them. Each replica's
  // progress is (call << 32) + steps, which wraps around at call 2^32: compared as plain
  // integers, the previous call's progress passed for "arrived" there (no wait, stale
  // data).
  auto g = B->make_group(2);
  group::impl& m = state_of::get(*g);
  const std::uint64_t start = (std::uint64_t{1} << 32) - 3;
  for (int r = 0; r < 2; ++r) {
    m.reps[r].seq.store(start);
    m.reps[r].progress.store(start << 32);
  }
  const std::size_t n = 4099;
  const call_desc d{collective::all_reduce, dtype::float64, reduce_op::sum, algorithm::automatic, n, 0};
  std::vector<buffer_view> v = {B->alloc(*g, 0, n, dtype::float64), B->alloc(*g, 1, n, dtype::float64)};
  for (int call = 0; call < 6; ++call) {
    buffer h0(n, dtype::float64), h1(n, dtype::float64);
    std::fill_n(static_cast<double*>(h0.data()), n, 1.0 + call);
    std::fill_n(static_cast<double*>(h1.data()), n, 10.0 + call);
    B->to_device(v[0], h0.data());
    std::string e0, e1;
    std::thread late([&] {
      // Replica 1's input is written only now, just before it arrives.
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      B->to_device(v[1], h1.data());
      try {
        g->run(1, d, v[1], v[1]);
      } catch (const std::exception& e) {
        e1 = e.what();
      }
    });
    try {
      g->run(0, d, v[0], v[0]);
    } catch (const std::exception& e) {
      e0 = e.what();
    }
    late.join();
    CHECK_MSG(e0.empty() && e1.empty(), e0 + " | " + e1);
    B->synchronize_all();
    const double want = 11.0 + 2 * call;
    for (int r = 0; r < 2; ++r) {
      buffer got(n, dtype::float64);
      B->to_host(got.data(), v[static_cast<std::size_t>(r)]);
      const auto* p = static_cast<const double*>(got.data());
      const std::size_t wrong = static_cast<std::size_t>(std::count_if(p, p + n, [&](double x) { return x != want; }));
      CHECK_MSG(wrong == 0, "call " + std::to_string(start + static_cast<std::uint64_t>(call) + 1) + ", replica " +
                                std::to_string(r) + ": " + std::to_string(wrong) + " elements differ from " +
                                std::to_string(want));
    }
  }
  B->release();
}

int main(int argc, char** argv) {
  B = backend_from_args(argc, argv, cuda::host_model::options{2, {}, 4, {}});
  std::printf("backend: %s\n", B->name().c_str());
  const int rc = run_all();
  B.reset();
  return rc;
}
