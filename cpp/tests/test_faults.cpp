// Faults while a collective is running: a replica that times out while others still
// work on its buffers, close() racing single-call collectives, a group destroyed while
// a replica waits in it, many groups alive at once. Built for the sanitizers too: every
// wait here is bounded and a watchdog ends the process if something hangs.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "reference.hpp"

using namespace distvals;
using namespace std::chrono_literals;
using distvals_test::quick;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Ends the process with a message when a test case takes longer than `limit`: a hang
// must show up as a failure, not as a stuck CI job.
class watchdog {
 public:
  watchdog(const char* what, std::chrono::seconds limit) : what_(what) {
    thread_ = std::thread([this, limit]() {
      const auto end = std::chrono::steady_clock::now() + limit;
      while (!done_.load()) {
        if (std::chrono::steady_clock::now() > end) {
          std::fprintf(stderr, "HANG: %s did not finish within %lld s\n", what_,
                       static_cast<long long>(limit.count()));
          std::fflush(stderr);
          std::_Exit(3);
        }
        std::this_thread::sleep_for(10ms);
      }
    });
  }
  ~watchdog() {
    done_.store(true);
    thread_.join();
  }

 private:
  const char* what_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

TEST_CASE("a replica that times out returns only after no step touches its buffer") {
  watchdog dog("timeout drain", 120s);
  // Large enough that one replica's slice of a direct all-reduce takes milliseconds.
  const std::size_t count = quick() ? (2u << 20) : (8u << 20);
  const int n = 3;
  for (int round = 0; round < (quick() ? 2 : 4); ++round) {
    group g(n);
    std::vector<buffer> b;
    for (int r = 0; r < n; ++r) {
      b.emplace_back(count, dtype::float32);
      for (std::size_t i = 0; i < count; ++i) b[r].as<float>()[i] = static_cast<float>(r + 1);
    }
    const call_desc d{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::direct, count, 0};
    std::vector<std::string> err(n);
    std::vector<std::thread> others;
    for (int r = 1; r < n; ++r) {
      others.emplace_back([&, r]() {
        try {
          g.run(r, d, b[r].view(), b[r].view(), 60000ms);
        } catch (const std::exception& e) {
          err[r] = e.what();
        }
      });
    }
    std::this_thread::sleep_for(30ms);  // replicas 1 and 2 are waiting for replica 0
    // Replica 0 arrives last with a 1 ms timeout: the others start their slices, replica
    // 0 finishes its own and times out waiting for theirs while they still write into
    // its buffer.
    bool timed_out = false;
    try {
      g.run(0, d, b[0].view(), b[0].view(), 1ms);
    } catch (const timeout_error& e) {
      timed_out = true;
      err[0] = e.what();
    }
    // From here on, replica 0 owns its buffer again: nobody may write into it.
    float* p = b[0].as<float>();
    for (std::size_t i = 0; i < count; ++i) p[i] = -7.0f;
    std::this_thread::sleep_for(30ms);
    std::size_t changed = 0;
    for (std::size_t i = 0; i < count; ++i) changed += p[i] != -7.0f;
    for (auto& t : others) t.join();
    if (timed_out) {
      CHECK_MSG(changed == 0, std::to_string(changed) + " elements written after replica 0 returned");
      CHECK_MSG(contains(err[0], "timed out"), err[0]);
      // The others either finished the step they were in and completed (every step had
      // run), or saw the failure before their next step.
      for (int r = 1; r < n; ++r) CHECK_MSG(err[r].empty() || contains(err[r], "timed out"), err[r]);
      CHECK(g.aborted());
      g.reset();
    } else {
      // The whole collective fitted in 1 ms (a fast machine): then all succeeded.
      for (int r = 1; r < n; ++r) CHECK_MSG(err[r].empty(), err[r]);
    }
    // The group works again, with correct results.
    for (int r = 0; r < n; ++r) {
      for (std::size_t i = 0; i < 1000; ++i) b[r].as<float>()[i] = static_cast<float>(r + 1);
    }
    const call_desc small{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::ring, 1000, 0};
    std::vector<std::thread> ts;
    std::vector<std::string> err2(n);
    for (int r = 0; r < n; ++r) {
      ts.emplace_back([&, r]() {
        try {
          buffer_view v = b[r].view();
          v.count = 1000;
          g.run(r, small, v, v, 60000ms);
        } catch (const std::exception& e) {
          err2[r] = e.what();
        }
      });
    }
    for (auto& t : ts) t.join();
    for (int r = 0; r < n; ++r) {
      CHECK_MSG(err2[r].empty(), err2[r]);
      CHECK(b[r].as<float>()[0] == 6.0f && b[r].as<float>()[999] == 6.0f);
    }
  }
}

TEST_CASE("close() racing single-call collectives on worker threads never hangs") {
  watchdog dog("close race", 120s);
  std::mt19937 rng(42);
  const int rounds = quick() ? 40 : 200;
  int closed_seen = 0;
  for (int round = 0; round < rounds; ++round) {
    group_options o;
    o.threads = 2;
    const int n = 4;
    group g(n, o);
    // 4 x 64 KiB: above the size where the calling thread works alone, so every call
    // hands a job to the worker.
    const std::size_t count = 16384;
    std::vector<buffer> b;
    for (int r = 0; r < n; ++r) b.emplace_back(count, dtype::float32);
    std::vector<buffer_view> v;
    for (int r = 0; r < n; ++r) v.push_back(b[r].view());
    std::string error;
    long calls = 0;
    std::thread caller([&]() {
      try {
        for (;;) {
          for (int r = 0; r < n; ++r) b[r].as<float>()[count - 1] = static_cast<float>(r);
          g.all_reduce(v, v, reduce_op::sum);
          ++calls;
          for (int r = 0; r < n; ++r) {
            if (b[r].as<float>()[count - 1] != 6.0f) throw std::runtime_error("wrong result");
          }
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    g.close();
    caller.join();
    CHECK_MSG(contains(error, "closed"), error + " after " + std::to_string(calls) + " calls");
    closed_seen += contains(error, "closed");
  }
  CHECK(closed_seen == rounds);
}

TEST_CASE("a group destroyed while replicas wait in it releases them") {
  watchdog dog("destroy while waiting", 60s);
  auto g = std::make_unique<group>(3);
  group* raw = g.get();
  std::vector<buffer> b;
  for (int r = 0; r < 2; ++r) b.emplace_back(64, dtype::float32);
  std::vector<std::string> err(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r]() {
      try {
        raw->run(r, call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::ring, 64, 0},
                 b[r].view(), b[r].view(), 60000ms);
      } catch (const std::exception& e) {
        err[r] = e.what();
      }
    });
  }
  // Replica 2 never comes; give the two threads ample time to be inside the call (a
  // thread that has not entered yet would call into a destroyed object).
  std::this_thread::sleep_for(200ms);
  g.reset();  // the destructor closes, waits for both waiters to leave, then frees
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) CHECK_MSG(contains(err[r], "closed"), err[r]);
}

TEST_CASE("many groups alive together, used from several threads at once") {
  watchdog dog("many groups", 120s);
  const int ngroups = quick() ? 8 : 32;
  std::vector<std::unique_ptr<group>> groups;
  for (int i = 0; i < ngroups; ++i) groups.push_back(std::make_unique<group>(2 + i % 3));
  std::vector<std::string> errors(ngroups);
  std::vector<std::thread> ts;
  for (int i = 0; i < ngroups; ++i) {
    ts.emplace_back([&, i]() {
      group& g = *groups[i];
      const int n = g.size();
      std::vector<buffer> b;
      for (int r = 0; r < n; ++r) b.emplace_back(1000, dtype::int64);
      std::vector<buffer_view> v;
      for (int r = 0; r < n; ++r) v.push_back(b[r].view());
      for (int it = 0; it < 20; ++it) {
        for (int r = 0; r < n; ++r) {
          for (int k = 0; k < 1000; ++k) b[r].as<std::int64_t>()[k] = i * 1000 + r * 7 + k + it;
        }
        g.all_reduce(v, v, reduce_op::sum);
        for (int r = 0; r < n; ++r) {
          for (int k = 0; k < 1000; ++k) {
            std::int64_t want = 0;
            for (int j = 0; j < n; ++j) want += i * 1000 + j * 7 + k + it;
            if (b[r].as<std::int64_t>()[k] != want) {
              errors[i] = "group " + std::to_string(i) + " replica " + std::to_string(r) + " element " +
                          std::to_string(k) + " wrong";
              return;
            }
          }
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int i = 0; i < ngroups; ++i) CHECK_MSG(errors[i].empty(), errors[i]);
}

TEST_MAIN()
