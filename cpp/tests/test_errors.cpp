// Failures: bad arguments before any data is touched, disagreeing replicas, timeouts,
// aborts and closing, none of which may hang.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include <mutex>

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

TEST_CASE("per replica: the same or overlapping buffers across replicas are refused on every replica") {
  for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
    group g(3);
    buffer shared(64, dtype::float32), other(64, dtype::float32);
    for (std::size_t i = 0; i < 64; ++i) {
      shared.as<float>()[i] = 1.0f;
      other.as<float>()[i] = 2.0f;
    }
    // replicas 0 and 1 pass the very same array, replica 2 its own
    auto err = on_threads(3, [&](int r) {
      buffer_view v = r == 2 ? other.view() : shared.view();
      g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, a, 64, 0}, v, v, 5000ms);
    });
    for (int r = 0; r < 3; ++r) CHECK_MSG(contains(err[r], "overlaps"), std::string(algorithm_name(a)) + ": " + err[r]);
    for (std::size_t i = 0; i < 64; ++i) CHECK(shared.as<float>()[i] == 1.0f && other.as<float>()[i] == 2.0f);
    // overlapping slices of one base: [0, 40) and [20, 60) (replica 2 reads [0, 40) too)
    buffer base(64, dtype::float32);
    auto slice = [&](std::size_t b) {
      buffer_view v = base.view();
      v.data = base.as<float>() + b;
      v.count = 40;
      return v;
    };
    buffer out2(40, dtype::float32);
    err = on_threads(3, [&](int r) {
      buffer_view in = r == 1 ? slice(20) : slice(0);
      buffer_view out = r == 2 ? out2.view() : in;
      g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, a, 40, 0}, in, out, 5000ms);
    });
    for (int r = 0; r < 3; ++r) CHECK_MSG(contains(err[r], "overlaps"), err[r]);
    CHECK(!g.aborted());  // refused before anything ran: the group stays usable
  }
}

TEST_CASE("per replica: shapes must agree, and the message names the first difference") {
  group g(2);
  buffer a(6, dtype::float32), b(6, dtype::float32), oa(12, dtype::float32), ob(12, dtype::float32);
  const std::int64_t s23[] = {2, 3}, s32[] = {3, 2};
  auto err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    o.shape = r == 0 ? s23 : s32;
    o.ndim = 2;
    g.run(r, call_desc{collective::all_gather, dtype::float32, reduce_op::sum, algorithm::direct, 6, 0},
          r == 0 ? a.view() : b.view(), r == 0 ? oa.view() : ob.view(), o);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_MSG(contains(err[r], "replica 0 passed shape (2, 3), replica 1 passed shape (3, 2)"), err[r]);
  }
  // dtypes: named before anything else that differs
  err = on_threads(2, [&](int r) {
    call_desc d{collective::all_reduce, r == 0 ? dtype::float32 : dtype::int32, reduce_op::sum, algorithm::direct, 6, 0};
    buffer_view v = r == 0 ? a.view() : b.view();
    v.type = d.type;
    g.run(r, d, v, v, 5s);
  });
  for (int r = 0; r < 2; ++r) CHECK_MSG(contains(err[r], "replica 0 passed dtype float32, replica 1 passed dtype int32"), err[r]);
  CHECK(!g.aborted());
}

TEST_CASE("per replica: a shape whose product passes 2^64, or a missing one, is refused before any data") {
  group g(2);
  buffer a(2, dtype::float32), b(2, dtype::float32);
  auto* pa = static_cast<float*>(a.data());
  auto* pb = static_cast<float*>(b.data());
  pa[0] = pa[1] = 1.0f;
  pb[0] = pb[1] = 2.0f;
  // 3 * 6148914691236517206 = 2^64 + 2: wrapped around, it would "describe" 2 elements.
  const std::int64_t wraps[] = {3, 6148914691236517206};
  auto err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    o.shape = wraps;
    o.ndim = 2;
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 2, 0},
          r == 0 ? a.view() : b.view(), r == 0 ? a.view() : b.view(), o);
  });
  for (int r = 0; r < 2; ++r) CHECK_MSG(contains(err[r], "does not describe 2 elements"), err[r]);
  err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    o.ndim = r == 1 ? 1 : -1;  // replica 1: one dimension, but no shape
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 2, 0},
          r == 0 ? a.view() : b.view(), r == 0 ? a.view() : b.view(), o);
  });
  for (int r = 0; r < 2; ++r) CHECK_MSG(contains(err[r], "replica 1: ndim is 1 but shape is null"), err[r]);
  CHECK(pa[0] == 1.0f && pa[1] == 1.0f && pb[0] == 2.0f && pb[1] == 2.0f);
  // A dimension of 0 after huge ones describes no elements, not an overflow.
  const std::int64_t empty[] = {6148914691236517206, 3, 0};
  buffer e(0, dtype::float32), f(0, dtype::float32);
  err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    o.shape = empty;
    o.ndim = 3;
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 0, 0},
          r == 0 ? e.view() : f.view(), r == 0 ? e.view() : f.view(), o);
  });
  for (int r = 0; r < 2; ++r) CHECK_MSG(err[r].empty(), err[r]);
}

TEST_CASE("per replica: a scalar and a vector of one element are different shapes") {
  group g(2);
  buffer a(1, dtype::float32), b(1, dtype::float32);
  const std::int64_t s1[] = {1};
  float* pa = static_cast<float*>(a.data());
  float* pb = static_cast<float*>(b.data());
  pa[0] = 1.0f;
  pb[0] = 2.0f;
  auto err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    if (r == 0) {
      o.ndim = 0;  // a scalar: no extents, so no storage needed for them
    } else {
      o.shape = s1;
      o.ndim = 1;
    }
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 1, 0},
          r == 0 ? a.view() : b.view(), r == 0 ? a.view() : b.view(), o);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_MSG(contains(err[r], "replica 0 passed shape (), replica 1 passed shape (1,)"), err[r]);
  }
  CHECK(pa[0] == 1.0f);  // refused before any data was touched
  CHECK(pb[0] == 2.0f);
  // No shape at all (the default) still means a flat vector of `count` elements.
  err = on_threads(2, [&](int r) {
    replica_options o;
    o.timeout = 5s;
    if (r == 1) {
      o.shape = s1;
      o.ndim = 1;
    }
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 1, 0},
          r == 0 ? a.view() : b.view(), r == 0 ? a.view() : b.view(), o);
  });
  for (int r = 0; r < 2; ++r) CHECK_MSG(err[r].empty(), err[r]);
  CHECK(pa[0] == 3.0f);
  CHECK(pb[0] == 3.0f);
}

TEST_CASE("both call styles from several threads at once: serialized, never corrupted") {
  group g(2);
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0}, errors{0}, per_replica_rounds{0}, single_calls{0};
  std::string first_error;
  std::mutex first_mu;
  auto note = [&](const std::exception& e) {
    errors.fetch_add(1);
    std::lock_guard<std::mutex> lk(first_mu);
    if (first_error.empty()) first_error = e.what();
  };
  // Replicas 0 and 1 run the same number of per-replica collectives on their own
  // buffers...
  const int rounds = distvals_test::quick() ? 100 : 400;
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r]() {
      buffer x(4096, dtype::float32);
      // Start once the single calls have (one completed): on a loaded machine their
      // thread could otherwise first run after every round here.
      while (single_calls.load() == 0 && errors.load() == 0) std::this_thread::yield();
      for (int it = 0; it < rounds; ++it) {
        for (std::size_t i = 0; i < 4096; ++i) x.as<float>()[i] = static_cast<float>(r + 1 + it);
        try {
          g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 4096, 0},
                x.view(), x.view(), 20s);
        } catch (const std::exception& e) {
          note(e);
          return;
        }
        const float want = static_cast<float>(3 + 2 * it);
        for (std::size_t i = 0; i < 4096; ++i) {
          if (x.as<float>()[i] != want) {
            wrong.fetch_add(1);
            break;
          }
        }
        if (r == 0) per_replica_rounds.fetch_add(1);
      }
    });
  }
  // ...while a third thread runs single calls on other buffers.
  ts.emplace_back([&]() {
    buffer a(4096, dtype::float32), b(4096, dtype::float32);
    while (!stop.load()) {
      for (std::size_t i = 0; i < 4096; ++i) {
        a.as<float>()[i] = 10.0f;
        b.as<float>()[i] = 20.0f;
      }
      try {
        g.all_reduce({a.view(), b.view()}, {a.view(), b.view()}, reduce_op::sum);
      } catch (const std::exception& e) {
        note(e);
        return;
      }
      if (a.as<float>()[4095] != 30.0f || b.as<float>()[0] != 30.0f) wrong.fetch_add(1);
      single_calls.fetch_add(1);
    }
  });
  ts[0].join();
  ts[1].join();
  stop.store(true);
  ts[2].join();
  CHECK_MSG(errors.load() == 0, first_error);
  CHECK(wrong.load() == 0);
  CHECK(per_replica_rounds.load() == rounds);
  CHECK(single_calls.load() > 0);
}

TEST_CASE("timeouts keep sub-millisecond values, and huge ones mean no timeout") {
  group_options o;
  o.timeout = std::chrono::microseconds(400);
  group g(2, o);
  CHECK(g.options().timeout == std::chrono::microseconds(400));
  buffer a(4, dtype::float32);
  const auto start = std::chrono::steady_clock::now();
  std::string err;
  try {
    g.run(0, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 4, 0}, a.view(),
          a.view());
  } catch (const timeout_error& e) {
    err = e.what();
  }
  CHECK(std::chrono::steady_clock::now() - start < 2s);
  CHECK_MSG(contains(err, "timed out after 0.0004 s") && contains(err, "replica(s) 1 never arrived"), err);
  g.reset();
  // no_timeout is kept as given, and a call with it still ends on cancel()
  group_options forever;
  forever.timeout = no_timeout;
  group h(2, forever);
  CHECK(h.options().timeout == no_timeout);
  std::thread canceller([&]() {
    std::this_thread::sleep_for(50ms);
    h.cancel();
  });
  CHECK_THROWS_AS(h.run(0, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, 4, 0},
                        a.view(), a.view()),
                  aborted_error);
  canceller.join();
}

TEST_CASE("DISTVALS_TIMEOUT_SECONDS: inf and overflowing values mean no timeout, garbage the default") {
  const char* before = std::getenv("DISTVALS_TIMEOUT_SECONDS");
  const std::string keep = before ? before : "";
  auto with_env = [](const char* v) {
    setenv("DISTVALS_TIMEOUT_SECONDS", v, 1);
    return group(1).options().timeout;
  };
  CHECK(with_env("inf") == no_timeout);
  CHECK(with_env("1e308") == no_timeout);
  CHECK(with_env("0.0004") == std::chrono::microseconds(400));
  CHECK(with_env("2.5") == std::chrono::milliseconds(2500));
  CHECK(with_env("five") == std::chrono::seconds(300));
  CHECK(with_env("-3") == std::chrono::seconds(300));
  CHECK(with_env("nan") == std::chrono::seconds(300));
  CHECK(with_env("5s") == std::chrono::seconds(300));
  if (before) {
    setenv("DISTVALS_TIMEOUT_SECONDS", keep.c_str(), 1);
  } else {
    unsetenv("DISTVALS_TIMEOUT_SECONDS");
  }
}

TEST_CASE("a group larger than max_group_size is refused") {
  CHECK_THROWS_AS(group(max_group_size + 1), invalid_argument_error);
  CHECK_THROWS_AS(group(-1), invalid_argument_error);
}

TEST_CASE("the C++ API states each thing once: typed views and per-replica calls") {
  group g(3);
  std::vector<std::vector<float>> grads(3, std::vector<float>(1000));
  std::vector<std::vector<std::int32_t>> counts(3, std::vector<std::int32_t>(10));
  for (std::size_t r = 0; r < grads.size(); ++r) {
    for (std::size_t i = 0; i < grads[r].size(); ++i) grads[r][i] = static_cast<float>(r + 1) * 0.5f;
    for (auto& c : counts[r]) c = static_cast<std::int32_t>(r);
  }
  std::vector<std::thread> ts;
  std::vector<std::string> errs(3);
  // A std::size_t replica index (the vector's own) and views that carry their dtype.
  for (std::size_t r = 0; r < grads.size(); ++r) {
    ts.emplace_back([&, r]() {
      try {
        auto v = view(grads[r].data(), grads[r].size());
        g.all_reduce(r, v, v, reduce_op::sum);
        std::vector<std::int32_t> all(30);
        g.all_gather(r, view(static_cast<const std::int32_t*>(counts[r].data()), 10), view(all.data(), all.size()));
        if (all[0] != 0 || all[10] != 1 || all[29] != 2) errs[r] = "all_gather wrong";
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK_MSG(errs[r].empty(), errs[r]);
    CHECK(grads[r][999] == 3.0f);
  }
  CHECK(view(static_cast<double*>(nullptr), 0).type == dtype::float64);
  CHECK(view(static_cast<const std::uint8_t*>(nullptr), 0).type == dtype::uint8);
  CHECK(view(static_cast<bfloat16_bits*>(nullptr), 0).type == dtype::bfloat16);
  CHECK(dtype_of<std::int64_t>() == dtype::int64);
  // An index that fits no int is out of range, not wrapped around to a valid one.
  buffer a(4, dtype::float32);
  CHECK_THROWS_AS(g.all_reduce(std::size_t{1} << 32, a.view(), a.view(), reduce_op::sum), invalid_argument_error);
  CHECK_THROWS_AS(g.all_reduce(-1, a.view(), a.view(), reduce_op::sum), invalid_argument_error);
}

TEST_CASE("a call on an aborted group says so, names the original failure and the way out") {
  group_options o;
  o.timeout = 50ms;
  group g(2, o);
  buffer a(4, dtype::float32), b(4, dtype::float32);
  std::string first;
  try {
    g.all_reduce(0, a.view(), a.view(), reduce_op::sum);  // replica 1 never comes
  } catch (const timeout_error& e) {
    first = e.what();
  }
  CHECK_MSG(contains(first, "replica(s) 1 never arrived"), first);
  std::string later, original;
  int origin = -2;
  try {
    g.all_reduce(0, a.view(), a.view(), reduce_op::sum);
  } catch (const group_aborted_error& e) {
    later = e.what();
    original = e.original();
    origin = e.replica();
  }
  CHECK_MSG(contains(later, "aborted since an earlier collective failed") && contains(later, "reset()") &&
                contains(later, "never arrived"),
            later);
  CHECK(original == first);
  CHECK(origin == 0);
  CHECK_THROWS_AS(g.all_reduce({a.view(), b.view()}, {a.view(), b.view()}, reduce_op::sum), group_aborted_error);
  g.reset();
  g.all_reduce({a.view(), b.view()}, {a.view(), b.view()}, reduce_op::sum);
}

TEST_MAIN()

TEST_CASE("malformed calls are refused before any data is touched: enums, sizes, alignment") {
  group g(2);
  buffer a(16, dtype::float32), b(16, dtype::float32);
  for (int i = 0; i < 16; ++i) {
    a.as<float>()[i] = 1.0f + static_cast<float>(i);
    b.as<float>()[i] = 100.0f + static_cast<float>(i);
  }
  const std::vector<buffer_view> in{a.view(), b.view()};
  // Enum values outside their enumerators (cast from integers) name what was wrong;
  // an unknown reduce op is never taken for a sum, nor an unknown dtype for a kernel.
  auto refused = [&](call_desc d, const char* part) {
    try {
      g.run(d, in, in);
      CHECK(false);
    } catch (const std::exception& e) {
      CHECK(contains(e.what(), part));
    }
  };
  call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::automatic, 16, 0};
  call_desc bad = d;
  bad.op = static_cast<reduce_op>(7);
  refused(bad, "reduce op 7 is not one of the 5");
  bad = d;
  bad.algo = static_cast<algorithm>(9);
  refused(bad, "algorithm 9");
  bad = d;
  bad.kind = static_cast<collective>(9);
  refused(bad, "collective 9");
  bad = d;
  bad.type = static_cast<dtype>(42);
  try {
    const buffer_view odd{a.data(), 16, static_cast<dtype>(42), {}};
    g.run(bad, {odd, odd}, {odd, odd});
    CHECK(false);
  } catch (const dtype_error& e) {
    CHECK(contains(e.what(), "dtype 42 is not one of the 8"));
  }
  // Counts whose size in bytes does not fit in size_t: refused, not wrapped around.
  const std::size_t huge = SIZE_MAX / 4 + 2;
  const buffer_view big_a{a.data(), huge, dtype::float32, {}}, big_b{b.data(), huge, dtype::float32, {}};
  try {
    g.all_reduce({big_a, big_b}, {big_a, big_b}, reduce_op::sum);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "does not fit in size_t"));
  }
  const std::size_t half = std::size_t{1} << 63;
  const buffer_view gin_a{a.data(), half, dtype::uint8, {}}, gin_b{b.data(), half, dtype::uint8, {}};
  const buffer_view gout{nullptr, 0, dtype::uint8, {}};
  try {
    g.run(call_desc{collective::all_gather, dtype::uint8, reduce_op::sum, algorithm::direct, half, 0}, {gin_a, gin_b},
          {gout, gout});
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "from each of 2 replicas"));
  }
  // Pointers not aligned to whole elements.
  const buffer_view skew{static_cast<char*>(a.data()) + 1, 8, dtype::float32, {}};
  const buffer_view eight{b.data(), 8, dtype::float32, {}};
  try {
    g.all_reduce({skew, eight}, {skew, eight}, reduce_op::sum);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "replica 0"));
    CHECK(contains(e.what(), "not aligned to its 4-byte float32 elements"));
  }
  // Nothing was touched, and the group still works.
  for (int i = 0; i < 16; ++i) {
    CHECK(a.as<float>()[i] == 1.0f + static_cast<float>(i));
    CHECK(b.as<float>()[i] == 100.0f + static_cast<float>(i));
  }
  g.all_reduce(in, in, reduce_op::sum);
  for (int i = 0; i < 16; ++i) CHECK(a.as<float>()[i] == 101.0f + 2.0f * static_cast<float>(i));
  // A buffer whose size overflows cannot be had.
  CHECK_THROWS_AS(buffer(SIZE_MAX, dtype::uint8), std::bad_alloc);
  CHECK_THROWS_AS(buffer(SIZE_MAX / 4 + 2, dtype::float32), std::bad_alloc);
}

TEST_CASE("per replica: a second thread as a replica that is in a call is refused at once, in run and report_invalid") {
  group_options o;
  o.timeout = 10s;
  group g(2, o);
  buffer a(1 << 16, dtype::float32), b(1 << 16, dtype::float32);
  for (std::size_t i = 0; i < a.count(); ++i) {
    a.as<float>()[i] = static_cast<float>(i % 97);
    b.as<float>()[i] = 1000.0f + static_cast<float>(i % 89);
  }
  std::atomic<bool> done{false};
  std::string first_error;
  std::thread first([&]() {
    try {
      g.all_reduce(0, a.view(), a.view(), reduce_op::sum);  // waits for replica 1
    } catch (const std::exception& e) {
      first_error = e.what();
    }
    done = true;
  });
  std::this_thread::sleep_for(200ms);  // replica 0 is inside its call, waiting
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g.report_invalid(0, "replica 0: bad", false);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "another thread is already in a call as this replica"));
  }
  try {
    buffer c(a.count(), dtype::float32);
    g.all_reduce(0, c.view(), c.view(), reduce_op::sum);
    CHECK(false);
  } catch (const invalid_argument_error& e) {
    CHECK(contains(e.what(), "another thread is already in a call as this replica"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(!done.load());
  // Replica 1 arrives: the first call completes, right on both replicas.
  g.all_reduce(1, b.view(), b.view(), reduce_op::sum);
  first.join();
  CHECK(first_error.empty());
  for (std::size_t i = 0; i < a.count(); ++i) {
    const float want = static_cast<float>(i % 97) + 1000.0f + static_cast<float>(i % 89);
    if (a.as<float>()[i] != want || b.as<float>()[i] != want) {
      CHECK(false);
      break;
    }
  }
  CHECK(!g.aborted());
}

TEST_CASE("a spin longer than the clamp is clamped, so short timeouts still fire on time") {
  group_options o;
  o.spin_us = 20000000;  // 20 s asked
  o.timeout = 300ms;
  group g(2, o);
  CHECK(g.options().spin_us == 10000);
  buffer a(8, dtype::float32);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(g.all_reduce(0, a.view(), a.view(), reduce_op::sum), timeout_error);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
}

TEST_CASE("negative device indices and shapes that do not describe the count are refused") {
  CHECK_THROWS_AS(group({device{device::kind_t::cpu, -1}}), invalid_argument_error);
  group g(2);
  buffer a(8, dtype::float32), b(8, dtype::float32);
  a.as<float>()[0] = 1.0f;
  b.as<float>()[0] = 2.0f;
  const std::int64_t wrong[2] = {5, 7};  // 35 elements for a call of 8
  const std::int64_t right[2] = {2, 4};
  auto errors = on_threads(2, [&](int r) {
    replica_options o;
    o.shape = r == 0 ? wrong : right;
    o.ndim = 2;
    buffer& x = r == 0 ? a : b;
    g.run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::automatic, 8, 0}, x.view(),
          x.view(), o);
  });
  CHECK(contains(errors[0], "replica 0: shape (5, 7) does not describe 8 elements"));
  CHECK(contains(errors[1], "shape (5, 7)"));
  CHECK(a.as<float>()[0] == 1.0f && b.as<float>()[0] == 2.0f);
  CHECK(!g.aborted());
}
