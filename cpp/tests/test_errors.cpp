// Failures: bad arguments before any data is touched, disagreeing replicas, timeouts,
// aborts and closing, none of which may hang.
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "check.hpp"
#include "reference.hpp"

using namespace distvals;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs fn(r) on n threads and returns each thread's exception message ("" if none).
template <class Fn>
std::vector<std::string> on_threads(int n, Fn fn) {
  std::vector<std::string> err(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r]() {
      try {
        fn(r);
      } catch (const std::exception& e) {
        err[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  return err;
}

}  // namespace

TEST_CASE("single call: bad buffers are rejected before data is touched, naming the replica") {
  group g(3);
  std::vector<buffer> b;
  for (int r = 0; r < 3; ++r) b.emplace_back(8, dtype::float32);
  buffer wrong_count(7, dtype::float32), wrong_type(8, dtype::float64);
  for (auto& x : b) x.as<float>()[0] = 5.0f;
  try {
    g.all_reduce({b[0].view(), wrong_count.view(), b[2].view()}, {b[0].view(), wrong_count.view(), b[2].view()},
                 reduce_op::sum);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "replica 1"));
    CHECK(contains(e.what(), "7 elements"));
  }
  try {
    g.all_reduce({b[0].view(), b[1].view(), wrong_type.view()}, {b[0].view(), b[1].view(), wrong_type.view()},
                 reduce_op::sum);
    CHECK(false);
  } catch (const dtype_error& e) {
    CHECK(contains(e.what(), "replica 2"));
    CHECK(contains(e.what(), "float64"));
  }
  // the same buffer twice: overlapping outputs
  try {
    g.all_reduce({b[0].view(), b[0].view(), b[2].view()}, {b[0].view(), b[0].view(), b[2].view()}, reduce_op::sum);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "overlaps"));
  }
  CHECK_THROWS_AS(g.all_reduce({b[0].view(), b[1].view()}, {b[0].view(), b[1].view()}, reduce_op::sum),
                  invalid_argument_error);
  buffer ints(8, dtype::int32);
  CHECK_THROWS_AS(g.reduce({b[0].view(), b[1].view(), b[2].view()}, {b[0].view(), b[1].view(), b[2].view()}, 3,
                           reduce_op::sum),
                  invalid_argument_error);
  // nothing was touched
  for (auto& x : b) CHECK(x.as<float>()[0] == 5.0f);
  // and the group still works
  g.all_reduce({b[0].view(), b[1].view(), b[2].view()}, {b[0].view(), b[1].view(), b[2].view()}, reduce_op::sum);
  CHECK(b[1].as<float>()[0] == 15.0f);
}

TEST_CASE("mean of integers is refused") {
  group g(2);
  buffer a(4, dtype::int32), b(4, dtype::int32);
  CHECK_THROWS_AS(g.all_reduce({a.view(), b.view()}, {a.view(), b.view()}, reduce_op::mean), dtype_error);
}

TEST_CASE("per replica: disagreeing replicas all get the same mismatch error") {
  group g(3);
  std::vector<buffer> b;
  for (int r = 0; r < 3; ++r) b.emplace_back(16, dtype::float32);
  auto err = on_threads(3, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, r == 2 ? reduce_op::max : reduce_op::sum,
                algorithm::direct, 16, 0};
    g.run(r, d, b[r].view(), b[r].view(), 5000ms);
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_MSG(contains(err[r], "replica 2 called all_reduce(dtype=float32, op=max"), err[r]);
  }
  // different counts: replica 1's buffer is fine for its own call, but counts disagree
  err = on_threads(3, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, r == 1 ? 8u : 16u, 0};
    buffer_view v = b[r].view();
    v.count = d.count;
    g.run(r, d, v, v, 5000ms);
  });
  for (int r = 0; r < 3; ++r) CHECK_MSG(contains(err[r], "count=8"), err[r]);
  // a replica with invalid buffers: every replica hears about it, naming it
  err = on_threads(3, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 16, 0};
    buffer_view v = b[r].view();
    if (r == 0) v.type = dtype::int32;
    g.run(r, d, v, v, 5000ms);
  });
  for (int r = 0; r < 3; ++r) CHECK_MSG(contains(err[r], "replica 0: input dtype int32"), err[r]);
  // the group is still usable afterwards
  err = on_threads(3, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::ring, 16, 0};
    g.run(r, d, b[r].view(), b[r].view(), 5000ms);
  });
  for (int r = 0; r < 3; ++r) CHECK_MSG(err[r].empty(), err[r]);
}

TEST_CASE("a replica that never arrives: the others time out naming it, then reset works") {
  group g(3);
  std::vector<buffer> b;
  for (int r = 0; r < 3; ++r) b.emplace_back(16, dtype::float32);
  const auto start = std::chrono::steady_clock::now();
  auto err = on_threads(2, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 16, 0};
    g.run(r, d, b[r].view(), b[r].view(), 200ms);
  });
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < 5s);
  CHECK_MSG(contains(err[0] + err[1], "replica(s) 2 never arrived"), err[0] + " | " + err[1]);
  CHECK(g.aborted());
  g.reset();
  CHECK(!g.aborted());
  err = on_threads(3, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 16, 0};
    g.run(r, d, b[r].view(), b[r].view(), 5000ms);
  });
  for (int r = 0; r < 3; ++r) CHECK_MSG(err[r].empty(), err[r]);
}

TEST_CASE("abort releases waiting replicas with the origin's id") {
  group g(3);
  std::vector<buffer> b;
  for (int r = 0; r < 3; ++r) b.emplace_back(16, dtype::float32);
  std::atomic<int> caught_origin{-2};
  std::thread killer([&]() {
    std::this_thread::sleep_for(50ms);
    g.abort(2, "replica 2 raised ValueError");
  });
  auto err = on_threads(2, [&](int r) {
    call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 16, 0};
    try {
      g.run(r, d, b[r].view(), b[r].view(), 60000ms);
    } catch (const aborted_error& e) {
      caught_origin = e.replica();
      throw;
    }
  });
  killer.join();
  CHECK(caught_origin.load() == 2);
  CHECK_MSG(contains(err[0], "aborted by replica 2: replica 2 raised ValueError"), err[0]);
  // further calls fail fast until reset
  CHECK_THROWS_AS(g.all_reduce({b[0].view(), b[1].view(), b[2].view()}, {b[0].view(), b[1].view(), b[2].view()},
                               reduce_op::sum),
                  aborted_error);
  g.reset();
  g.all_reduce({b[0].view(), b[1].view(), b[2].view()}, {b[0].view(), b[1].view(), b[2].view()}, reduce_op::sum);
}

TEST_CASE("closing a group releases a waiter with closed_error; later calls fail") {
  auto g = std::make_unique<group>(2);
  buffer a(4, dtype::float32);
  std::string err;
  std::thread waiter([&]() {
    try {
      g->run(0, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 4, 0}, a.view(),
             a.view(), 60000ms);
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  g->close();
  waiter.join();
  CHECK_MSG(contains(err, "closed"), err);
  CHECK(g->closed());
  CHECK_THROWS_AS(g->all_reduce({a.view(), a.view()}, {a.view(), a.view()}, reduce_op::sum), closed_error);
  g.reset();  // destroying a closed group is fine
}

TEST_CASE("devices: parsing and duplicates") {
  CHECK(device::parse("CPU:3").index == 3);
  CHECK(device::parse("/cpu:1").index == 1);
  CHECK(device::parse("/job:localhost/replica:0/task:0/device:GPU:1").kind == device::kind_t::gpu);
  CHECK(device::parse("gpu:0").str() == "GPU:0");
  CHECK_THROWS_AS(device::parse("TPU:0"), invalid_argument_error);
  CHECK_THROWS_AS(device::parse("CPU:"), invalid_argument_error);
  CHECK_THROWS_AS(group({device::parse("CPU:0"), device::parse("/cpu:0")}), invalid_argument_error);
  CHECK_THROWS_AS(group(0), invalid_argument_error);
  CHECK(parse_reduce_op("PRODUCT") == reduce_op::prod);
  CHECK(parse_algorithm("Ring") == algorithm::ring);
  CHECK_THROWS_AS(parse_dtype("complex64"), dtype_error);
}

TEST_MAIN()
