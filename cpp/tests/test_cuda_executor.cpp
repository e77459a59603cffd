// The CUDA executor: how a collective is launched and ordered, on the host model of the
// CUDA runtime (`test_cuda_executor model`, on every machine and under ThreadSanitizer)
// and, where there is one, on a real GPU (`test_cuda_executor cuda`). The host model
// runs kernels on the CPU, counts every call and reports operations of different streams
// that touch the same memory at the same time, so an ordering bug fails here.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "reference.hpp"

using namespace distvals;
using namespace distvals_test;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<backend> B;
bool is_model() { return B->model() != nullptr; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A group's insides, for the GPU-only calls (host model groups only).
group::impl& inner(group& g) { return static_cast<state_group&>(g).inner(); }

// Enqueues `d` on `stream` (of device `gpu`, -1: ask) and returns at once.
void enqueue(group& g, const call_desc& d, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
             void* stream, int gpu = -1, const std::vector<detail::stream_ref>& wait_for = {}) {
#if DISTVALS_HAS_CUDA
  if (!is_model()) {
    std::vector<cuda::stream_view> w;
    for (const auto& r : wait_for) w.emplace_back(static_cast<CUstream_st*>(r.handle), r.device);
    static_cast<cuda::group&>(g).enqueue(d, in, out, cuda::stream_view(static_cast<CUstream_st*>(stream), gpu), w);
    return;
  }
#endif
  const detail::stream_ref caller{stream, gpu};
  inner(g).run_single(d, in, out, &caller, wait_for);
}

// The runtime under the backend: the host model, or the real one.
cuda::runtime& rt() { return is_model() ? *B->model() : *cuda::real_runtime(); }

// A stream of device `gpu` made for a test, and a host wait for it.
void* new_stream(int gpu) {
  cuda::device_scope scope(rt());
  scope.set(gpu);
  return rt().stream_create();
}
void drain(void* s, int gpu) {
  cuda::device_scope scope(rt());
  scope.set(gpu);
  while (!rt().stream_query(s)) std::this_thread::sleep_for(50us);
}

// N replicas' buffers of `count` floats, replica r filled with `fill(r, i)`.
template <class Fill>
std::vector<buffer_view> floats(group& g, std::size_t count, const Fill& fill) {
  std::vector<buffer_view> v;
  std::vector<float> h(count);
  for (int r = 0; r < g.size(); ++r) {
    for (std::size_t i = 0; i < count; ++i) h[i] = fill(r, i);
    v.push_back(B->alloc(g, r, count, dtype::float32));
    B->to_device(v.back(), h.data());
  }
  return v;
}

std::vector<float> host(const buffer_view& v) {
  std::vector<float> h(v.count);
  B->to_host(h.data(), v);
  return h;
}

// What a consumer on `stream` (of device `gpu`) reads of every replica's buffer: on the
// host model, work queued on that stream alone and the host waiting for that stream alone,
// as a user's kernel after the call would (so a call whose end is not ordered before the
// stream's next work shows as wrong values and a hazard); on a GPU, after a host wait for
// the stream.
std::vector<std::vector<float>> consume(const std::vector<buffer_view>& v, void* stream, int gpu) {
  std::vector<std::vector<float>> seen(v.size());
  if (is_model()) {
    for (std::size_t r = 0; r < v.size(); ++r) {
      const auto* p = static_cast<const float*>(v[r].data);
      std::vector<float>* out = &seen[r];
      const std::size_t n = v[r].count;
      B->model()->enqueue_host_work(stream, [p, out, n]() { out->assign(p, p + n); }, v[r].data, v[r].bytes());
    }
    drain(stream, gpu);
  } else {
    drain(stream, gpu);
    for (std::size_t r = 0; r < v.size(); ++r) seen[r] = host(v[r]);
  }
  return seen;
}

call_desc all_reduce_desc(std::size_t count) {
  return call_desc{collective::all_reduce, dtype::float32, reduce_op::sum, algorithm::automatic, count, 0};
}

void no_hazards(const std::string& where) {
  if (!is_model()) return;
  CHECK_MSG(B->model()->hazards() == 0, where + ": " + B->model()->first_hazard());
  CHECK_MSG(B->model()->illegal_accesses() == 0, where);
}

}  // namespace

// ---- how many CUDA calls a collective costs -------------------------------------------------

TEST_CASE("replicas on one device: one launch and at most three enqueue calls per collective") {
  if (!is_model()) return;  // counted on the host model, where every call is seen
  auto& m = *B->model();
  for (int n : {2, 8}) {
    auto g = B->make_group(n);
    auto v = floats(*g, 4096, [](int r, std::size_t) { return static_cast<float>(r + 1); });
    void* s = new_stream(0);
    enqueue(*g, all_reduce_desc(4096), v, v, s, 0);  // warm-up: the first call may set things up
    drain(s, 0);
    m.reset_counts();
    const int calls = 10;
    for (int i = 0; i < calls; ++i) enqueue(*g, all_reduce_desc(4096), v, v, s, 0);
    const auto c = m.counts();  // before the test's own waits
    drain(s, 0);
    auto at = [&](const char* k) { return c.count(k) ? c.at(k) : 0L; };
    const long enqueue_calls = m.count_of({"launch", "event_record", "stream_wait_event", "memcpy_async",
                                           "memcpy_peer_async", "memset_async"});
    std::printf("    n=%d: per collective %.1f enqueue calls (launch %.1f, event_record %.1f, stream_wait_event %.1f), "
                "%.1f device queries, %ld allocations, %ld events created\n",
                n, double(enqueue_calls) / calls, double(at("launch")) / calls, double(at("event_record")) / calls,
                double(at("stream_wait_event")) / calls, double(at("current_device") + at("set_device")) / calls,
                at("malloc") + at("free"), at("event_create"));
    CHECK(at("launch") == calls);
    CHECK(enqueue_calls <= 3 * calls);
    CHECK(at("malloc") == 0 && at("free") == 0 && at("event_create") == 0 && at("stream_create") == 0);
    CHECK(at("event_query") == 0 && at("stream_query") == 0);  // no host wait in the hot path
    const auto want = static_cast<float>(n * (n + 1) / 2) * std::pow(static_cast<float>(n), static_cast<float>(calls));
    for (int r = 0; r < n; ++r) CHECK(host(v[r])[4095] == want);
    rt().stream_destroy(s);
  }
  no_hazards("counts");
}

TEST_CASE("replicas on several devices: one launch per device and one start and end event per device") {
  if (!is_model() || B->devices() < 2) return;
  auto& m = *B->model();
  auto g = B->make_group(4, {}, {0, 1, 0, 1});
  auto v = floats(*g, 10000, [](int r, std::size_t i) { return static_cast<float>(r + i % 7); });
  void* s = new_stream(0);
  enqueue(*g, all_reduce_desc(10000), v, v, s, 0);
  drain(s, 0);
  m.reset_counts();
  enqueue(*g, all_reduce_desc(10000), v, v, s, 0);
  const auto c = m.counts();
  drain(s, 0);
  CHECK(c.at("launch") == 2);
  // start on both, end on the other device, join: 4 records.
  CHECK(c.at("event_record") == 4);
  CHECK(m.count_of({"malloc", "free", "event_create"}) == 0);
  for (int r = 0; r < 4; ++r) {
    const auto h = host(v[r]);
    for (std::size_t i = 0; i < 10000; i += 997) {
      const float once = static_cast<float>(0 + 1 + 2 + 3 + 4 * (i % 7));
      CHECK(h[i] == once * 4);
    }
  }
  rt().stream_destroy(s);
  no_hazards("several devices");
}

// ---- ordering ----------------------------------------------------------------------------------------

TEST_CASE("back-to-back calls alternating two caller streams stay in order") {
  // In place, so every call reads what the previous one wrote: a call that overtook the
  // previous one (on the other stream) would read a half-written buffer. Over every way
  // the executor orders a call: replicas on one device (the caller's), replicas on two
  // devices (start and end events between them), and replicas on a device other than the
  // caller streams' (the group's own stream, joined to the caller's by an end event).
  struct layout {
    std::vector<int> gpus;
    int caller_gpu;
  };
  std::vector<layout> layouts{{{0, 0}, 0}, {std::vector<int>(8, 0), 0}};
  if (B->devices() >= 2) {
    layouts.push_back({{0, 1}, 0});
    layouts.push_back({{0, 1, 0, 1}, 1});
    layouts.push_back({{1, 1}, 0});
  }
  for (const auto& l : layouts) {
    const int n = static_cast<int>(l.gpus.size());
    auto g = B->make_group(n, {}, l.gpus);
    const std::size_t count = is_model() ? 50000 : (4u << 20) + 3;
    auto v = floats(*g, count, [](int r, std::size_t) { return r == 0 ? 1.0f : 0.0f; });
    void* a = new_stream(l.caller_gpu);
    void* b = new_stream(l.caller_gpu);
    const int calls = is_model() ? 6 : 40;
    for (int i = 0; i < calls; ++i) enqueue(*g, all_reduce_desc(count), v, v, i % 2 ? b : a, l.caller_gpu);
    // Replica 0 starts at 1, the others at 0: after k calls every element is n^(k-1).
    const float want = std::pow(static_cast<float>(n), static_cast<float>(calls - 1));
    const auto seen = consume(v, (calls - 1) % 2 ? b : a, l.caller_gpu);
    drain(a, l.caller_gpu);
    for (int r = 0; r < n; ++r) {
      const auto& h = seen[r];
      std::size_t wrong = 0;
      for (float x : h) wrong += x != want;
      CHECK_MSG(wrong == 0, "replica " + std::to_string(r) + " of " + std::to_string(n) + " on GPU " +
                                std::to_string(l.gpus[r]) + ", callers on GPU " + std::to_string(l.caller_gpu) +
                                ": " + std::to_string(wrong) + " wrong, e.g. " + std::to_string(h[0]) + " want " +
                                std::to_string(want));
    }
    rt().stream_destroy(a);
    rt().stream_destroy(b);
    no_hazards("alternating streams, callers on GPU " + std::to_string(l.caller_gpu));
  }
}

TEST_CASE("a collective follows the work queued on the caller's stream before it, on every device") {
  // A producer on the caller's stream writes every replica's input slowly, then the call
  // is enqueued on that stream: every device's kernel must wait for it (the caller's device
  // through the stream's order, the others through its start event, or through a fork
  // event when the caller's device holds no replica).
  if (!is_model()) return;  // needs a slow producer, which the host model provides
  std::vector<std::pair<std::vector<int>, int>> layouts{{{0, 0}, 0}};
  if (B->devices() >= 2) {
    layouts.push_back({{0, 1}, 0});
    layouts.push_back({{0, 1, 1}, 1});
    layouts.push_back({{1, 1}, 0});
  }
  for (const auto& [gpus, caller_gpu] : layouts) {
    const int n = static_cast<int>(gpus.size());
    auto g = B->make_group(n, {}, gpus);
    const std::size_t count = 20000;
    auto v = floats(*g, count, [](int, std::size_t) { return 1.0f; });
    void* s = new_stream(caller_gpu);
    for (int r = 0; r < n; ++r) {
      float* p = static_cast<float*>(v[r].data);
      B->model()->enqueue_host_work(
          s,
          [p, r, count]() {
            std::this_thread::sleep_for(5ms);
            for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>(r + 2);
          },
          p, count * sizeof(float));
    }
    enqueue(*g, all_reduce_desc(count), v, v, s, caller_gpu);
    const auto seen = consume(v, s, caller_gpu);
    const float want = static_cast<float>(n * (n + 3) / 2);  // 2 + 3 + ... + (n + 1)
    for (int r = 0; r < n; ++r) {
      std::size_t wrong = 0;
      for (float x : seen[r]) wrong += x != want;
      CHECK_MSG(wrong == 0, "replica " + std::to_string(r) + " on GPU " + std::to_string(gpus[r]) +
                                ", caller on GPU " + std::to_string(caller_gpu) + ": " + std::to_string(wrong) +
                                " wrong");
    }
    rt().stream_destroy(s);
    no_hazards("caller's producer, caller on GPU " + std::to_string(caller_gpu));
  }
}

TEST_CASE("a synchronous call follows the work queued on each device's legacy default stream") {
  // What a user queued on the default stream (cudaMemcpy, a kernel on stream 0) of any
  // replica's device comes before a synchronous call, as it would before a blocking stream.
  if (!is_model() || B->devices() < 2) return;
  auto g = B->make_group(2, {}, {0, 1});
  auto v = floats(*g, 1000, [](int, std::size_t) { return 1.0f; });
  for (int r = 0; r < 2; ++r) {
    cuda::device_scope scope(rt());
    scope.set(r);
    float* p = static_cast<float*>(v[r].data);
    B->model()->enqueue_host_work(
        cuda::legacy_stream(),
        [p, r]() {
          std::this_thread::sleep_for(10ms);
          for (int i = 0; i < 1000; ++i) p[i] = static_cast<float>(r + 4);
        },
        p, 1000 * sizeof(float));
  }
  g->run(all_reduce_desc(1000), v, v);
  for (int r = 0; r < 2; ++r) CHECK(host(v[r])[999] == 9.0f);
  no_hazards("legacy default streams");
}

TEST_CASE("a caller stream destroyed and made again at the same address still follows the previous call") {
  // Ordering goes through the previous call's join event, never through a comparison
  // of stream handles, which a new stream may reuse.
  auto g = B->make_group(2);
  const std::size_t count = is_model() ? 50000 : (4u << 20);
  auto v = floats(*g, count, [](int r, std::size_t) { return r == 0 ? 1.0f : 0.0f; });
  const int calls = 6;
  for (int i = 0; i < calls; ++i) {
    void* s = new_stream(0);
    enqueue(*g, all_reduce_desc(count), v, v, s, 0);
    rt().stream_destroy(s);  // at once: the call may still run, as CUDA allows
  }
  B->synchronize_all();
  const float want = std::pow(2.0f, static_cast<float>(calls - 1));
  for (int r = 0; r < 2; ++r) CHECK(host(v[r])[count - 1] == want);
  no_hazards("re-created streams");
}

TEST_CASE("a synchronous call follows the work queued on a replica's stream") {
  if (!is_model()) return;  // needs a slow producer, which the host model provides
  auto g = B->make_group(2);
  auto v = floats(*g, 1000, [](int, std::size_t) { return 1.0f; });
  // The user writes 5 into replica 1's buffer on the group's stream of its device, slowly.
  void* s = detail::cuda_replica_stream(inner(*g), 1);
  float* p = static_cast<float*>(v[1].data);
  B->model()->enqueue_host_work(
      s,
      [p]() {
        std::this_thread::sleep_for(20ms);
        for (int i = 0; i < 1000; ++i) p[i] = 5.0f;
      },
      p, 1000 * sizeof(float));
  g->run(all_reduce_desc(1000), v, v);
  CHECK(host(v[0])[999] == 6.0f);
  no_hazards("replica stream");
}

TEST_CASE("a collective follows the producer streams it is told about, without a host wait") {
  if (!is_model()) return;
  auto g = B->make_group(2);
  auto v = floats(*g, 1000, [](int, std::size_t) { return 1.0f; });
  void* producer = new_stream(0);  // a user's stream, as torch.cuda.Stream or cupy's
  float* p = static_cast<float*>(v[0].data);
  B->model()->enqueue_host_work(
      producer,
      [p]() {
        std::this_thread::sleep_for(20ms);
        for (int i = 0; i < 1000; ++i) p[i] = 7.0f;
      },
      p, 1000 * sizeof(float));
  B->model()->reset_counts();
  inner(*g).run_single(all_reduce_desc(1000), v, v, nullptr, {detail::stream_ref{producer, 0}});
  CHECK(host(v[1])[0] == 8.0f);
  rt().stream_destroy(producer);
  no_hazards("producer stream");
}

TEST_CASE("a caller's stream of another device, named without its device, is asked for it") {
  if (!is_model() || B->devices() < 2) return;
  auto g = B->make_group(2, {}, {1, 1});
  auto v = floats(*g, 100, [](int r, std::size_t) { return static_cast<float>(r); });
  void* s = new_stream(1);
  cuda::device_scope scope(rt());
  scope.set(0);  // the current device is another one than the stream's
  enqueue(*g, all_reduce_desc(100), v, v, s, -1);
  drain(s, 1);
  CHECK(host(v[0])[7] == 1.0f);
  rt().stream_destroy(s);
  no_hazards("stream device");
}

// A caller stream named by a special handle (0: the legacy default stream) means the
// default stream of the device it names; every wait the call puts on it must be made with
// that device current, whatever device the calling thread (or the call's previous step)
// left current, or the wait lands on another device's default stream.
TEST_CASE("a legacy caller stream of one device, with a producer on another and the other device current") {
  if (!is_model() || B->devices() < 2) return;
  auto g = B->make_group(2, {}, {0, 1});
  auto v = floats(*g, 1000, [](int, std::size_t) { return 1.0f; });
  void* producer = new_stream(1);
  float* p = static_cast<float*>(v[1].data);
  B->model()->enqueue_host_work(
      producer,
      [p]() {
        std::this_thread::sleep_for(30ms);
        for (int i = 0; i < 1000; ++i) p[i] = 7.0f;
      },
      p, 1000 * sizeof(float));
  {
    cuda::device_scope scope(rt());
    scope.set(0);
    enqueue(*g, all_reduce_desc(1000), v, v, nullptr, 0, {detail::stream_ref{producer, 1}});
  }
  B->model()->synchronize_all();
  for (int r = 0; r < 2; ++r) CHECK_MSG(host(v[r])[0] == 8.0f && host(v[r])[999] == 8.0f, "replica " + std::to_string(r));
  rt().stream_destroy(producer);
  no_hazards("legacy caller, producer on another device");
}

TEST_CASE("a legacy caller stream follows the previous call whatever device the thread has current") {
  if (!is_model() || B->devices() < 2) return;
  const std::size_t count = 50000;
  for (const std::vector<int>& gpus : {std::vector<int>{1, 1}, std::vector<int>{0, 1}}) {
    const int home = gpus[0];
    auto g = B->make_group(2, {}, gpus);
    auto v = floats(*g, count, [](int r, std::size_t) { return r == 0 ? 1.0f : 0.0f; });
    void* user = new_stream(home);
    {
      cuda::device_scope scope(rt());
      scope.set(1 - home);  // not the caller stream's device
      B->model()->enqueue_host_work(user, []() { std::this_thread::sleep_for(30ms); });
      // A broadcast of replica 1's zeros on a busy user stream, then a sum on device
      // `home`'s legacy stream: the sum must wait for the broadcast (all zeros).
      const call_desc bcast{collective::broadcast, dtype::float32, reduce_op::sum, algorithm::automatic, count, 1};
      enqueue(*g, bcast, v, v, user, home);
      enqueue(*g, all_reduce_desc(count), v, v, nullptr, home);
    }
    B->model()->synchronize_all();
    std::size_t wrong = 0;
    for (int r = 0; r < 2; ++r) {
      for (float x : host(v[r])) wrong += x != 0.0f;
    }
    CHECK_MSG(wrong == 0, std::to_string(wrong) + " wrong elements on devices " + std::to_string(gpus[0]) + "," +
                              std::to_string(gpus[1]));
    rt().stream_destroy(user);
    no_hazards("legacy caller after a call on a user stream");
  }
}

TEST_CASE("a thread that never used CUDA gets no context on device 0") {
  if (!is_model() || B->devices() < 2) return;
  auto g = B->make_group(2, {}, {1, 1});  // made on this thread: device 1 only
  auto v = floats(*g, 100, [](int r, std::size_t) { return static_cast<float>(r + 1); });
  std::set<int> seen;
  std::thread fresh([&]() {
    g->run(all_reduce_desc(100), v, v);
    seen = B->model()->devices_made_current(std::this_thread::get_id());
  });
  fresh.join();
  CHECK(host(v[1])[3] == 3.0f);
  CHECK_MSG(seen.count(0) == 0, "device 0 was made current by a group that lives on device 1");
}

TEST_CASE("a failure in the middle of enqueueing: the next call still waits for the work already queued") {
  if (!is_model() || B->devices() < 2) return;
  auto& m = *B->model();
  auto g = B->make_group(2, {}, {0, 1});
  auto v = floats(*g, 20000, [](int r, std::size_t) { return static_cast<float>(r + 1); });
  void* s = new_stream(0);
  enqueue(*g, all_reduce_desc(20000), v, v, s, 0);
  drain(s, 0);
  // The second launch (device 1) fails after the first (device 0, slow) is queued.
  m.fail_next("launch", 1);
  bool threw = false;
  try {
    enqueue(*g, all_reduce_desc(20000), v, v, s, 0);
  } catch (const cuda_error&) {
    threw = true;
  }
  CHECK(threw);
  // The next call, on another stream, must not overtake device 0's kernel of the failed
  // call: the host model reports it as a hazard if it does.
  void* s2 = new_stream(0);
  enqueue(*g, all_reduce_desc(20000), v, v, s2, 0);
  drain(s2, 0);
  m.synchronize_all();
  no_hazards("after a failed enqueue");
  rt().stream_destroy(s);
  rt().stream_destroy(s2);
}

TEST_CASE("without peer access the unreachable replicas are staged, with copies naming their devices") {
  if (!is_model()) return;
  // Three devices: 0 and 1 reach each other, 2 reaches nobody.
  cuda::host_model::options o;
  o.devices = 3;
  o.peer = {{true, true, false}, {true, true, false}, {false, false, true}};
  model_backend mb(o);
  auto g = mb.make_group(3, {}, {0, 1, 2});
  for (collective k : {collective::all_reduce, collective::reduce, collective::broadcast, collective::all_gather,
                       collective::reduce_scatter}) {
    for (int root : {0, 2}) {
      const std::size_t count = 3 * 1001;
      const std::size_t oc = k == collective::all_gather ? count * 3 : k == collective::reduce_scatter ? count / 3 : count;
      std::vector<buffer_view> in, out;
      for (int r = 0; r < 3; ++r) {
        in.push_back(mb.alloc(*g, r, count, dtype::float64));
        std::vector<double> h(count);
        for (std::size_t i = 0; i < count; ++i) h[i] = static_cast<double>(r * 1000 + i);
        mb.to_device(in.back(), h.data());
        out.push_back(mb.alloc(*g, r, oc, dtype::float64));
      }
      g->run(call_desc{k, dtype::float64, reduce_op::sum, algorithm::automatic, count, root}, in, out);
      for (int r = 0; r < 3; ++r) {
        if (k == collective::reduce && r != root) continue;
        std::vector<double> h(oc);
        mb.to_host(h.data(), out[r]);
        for (std::size_t i = 0; i < oc; i += 97) {
          double want = 0;
          switch (k) {
            case collective::all_reduce:
            case collective::reduce: want = 3000 + 3.0 * i; break;
            case collective::broadcast: want = root * 1000 + static_cast<double>(i); break;
            case collective::all_gather: want = static_cast<double>((i / count) * 1000 + i % count); break;
            case collective::reduce_scatter: want = 3000 + 3.0 * (r * oc + i); break;
          }
          CHECK_MSG(h[i] == want, std::string(collective_name(k)) + " root " + std::to_string(root) + " replica " +
                                      std::to_string(r) + " element " + std::to_string(i));
        }
      }
    }
  }
  CHECK(mb.model()->hazards() == 0);
  CHECK(mb.model()->illegal_accesses() == 0);
  CHECK(mb.model()->counts().at("memcpy_peer_async") > 0);
}

// ---- failures and timeouts -------------------------------------------------------------------------

TEST_CASE("a host wait that times out fails the group; later calls say so and reset() clears it") {
  if (!is_model()) return;
  cuda::host_model::options o;
  o.devices = 1;
  o.delay = 300ms;  // every kernel takes this long
  model_backend mb(o);
  group_options go;
  go.timeout = 50ms;
  auto g = mb.make_group(2, go);
  auto in = std::vector<buffer_view>{mb.alloc(*g, 0, 16, dtype::float32), mb.alloc(*g, 1, 16, dtype::float32)};
  std::string err;
  try {
    g->run(all_reduce_desc(16), in, in);
  } catch (const timeout_error& e) {
    err = e.what();
  }
  CHECK_MSG(contains(err, "on GPU timed out after 0.05 s"), err);
  CHECK(g->aborted());
  std::string later;
  try {
    g->run(all_reduce_desc(16), in, in);
  } catch (const group_aborted_error& e) {
    later = e.what();
    CHECK(contains(e.original(), "timed out"));
  }
  CHECK_MSG(contains(later, "reset()") && contains(later, "timed out"), later);
  mb.model()->synchronize_all();
  g->reset();
  group_options patient;
  patient.timeout = 10s;
  auto h = mb.make_group(2, patient);
  h->run(all_reduce_desc(16), in, in);
}

TEST_CASE("per replica on GPUs: replica 0 launches for all, the others get its result or its error") {
  auto g = B->make_group(3);
  auto v = floats(*g, 333, [](int r, std::size_t i) { return static_cast<float>(r * 10 + i % 3); });
  std::vector<std::thread> ts;
  std::vector<std::string> errs(3);
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r]() {
      try {
        g->all_reduce(r, v[r], v[r], reduce_op::max);
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 3; ++r) {
    CHECK_MSG(errs[r].empty(), errs[r]);
    CHECK(host(v[r])[5] == 22.0f);
  }
  if (is_model()) {
    B->model()->fail_next("launch");
    ts.clear();
    for (int r = 0; r < 3; ++r) {
      ts.emplace_back([&, r]() {
        try {
          g->all_reduce(r, v[r], v[r], reduce_op::sum);
        } catch (const std::exception& e) {
          errs[r] = e.what();
        }
      });
    }
    for (auto& t : ts) t.join();
    for (int r = 0; r < 3; ++r) CHECK_MSG(contains(errs[r], "injected"), errs[r]);
  }
  no_hazards("per replica");
}

TEST_CASE("per replica on GPUs: another replica's per-thread default stream is refused, not ignored") {
  if (!is_model()) return;
  auto g = B->make_group(2);
  auto v = floats(*g, 100, [](int r, std::size_t) { return static_cast<float>(r + 1); });
  const call_desc d = all_reduce_desc(100);
  std::vector<std::string> errs(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r]() {
      // Handle 2 names the calling thread's own stream; replica 0's thread enqueues the
      // collective, so replica 1's would never be waited for.
      const detail::stream_ref per_thread{reinterpret_cast<void*>(std::uintptr_t{2}), 0};
      try {
        inner(*g).run_replica(r, d, v[r], v[r], replica_options{}, &per_thread);
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK_MSG(contains(errs[1], "replica 1: a per-thread default stream (handle 2)"), errs[1]);
  CHECK_MSG(!errs[0].empty(), "replica 0 is released with the error");
  CHECK(host(v[0])[0] == 1.0f && host(v[1])[0] == 2.0f);  // nothing ran
  no_hazards("per-thread stream refused");
}

// ---- sizes and alignment (the kernel's own paths on a GPU) ---------------------------------------

TEST_CASE("misaligned buffers: heads and tails peeled, the body still right") {
  // Views that start 1 to 3 elements into their allocation, with odd counts, so that no
  // pointer is 16-byte aligned and they are misaligned differently from each other.
  auto g = B->make_group(3);
  for (dtype t : {dtype::float32, dtype::float16, dtype::int8, dtype::float64}) {
    for (collective k : {collective::all_reduce, collective::all_gather, collective::reduce_scatter,
                         collective::broadcast}) {
      const std::size_t count = k == collective::reduce_scatter ? 3 * 1237 : 4099;
      const std::size_t oc = k == collective::all_gather ? 3 * count : k == collective::reduce_scatter ? count / 3 : count;
      const std::size_t es = dtype_size(t);
      std::vector<buffer_view> in, out;
      std::vector<buffer> hin;
      for (int r = 0; r < 3; ++r) {
        buffer_view a = B->alloc(*g, r, count + 4, t), b = B->alloc(*g, r, oc + 4, t);
        a.data = static_cast<char*>(a.data) + es * static_cast<std::size_t>(r + 1);
        a.count = count;
        b.data = static_cast<char*>(b.data) + es * static_cast<std::size_t>(3 - r);
        b.count = oc;
        hin.emplace_back(count, t);
        for (std::size_t i = 0; i < count; ++i) store(hin.back().data(), t, i, value(reduce_op::sum, t, r, i));
        B->to_device(a, hin.back().data());
        in.push_back(a);
        out.push_back(b);
      }
      g->run(call_desc{k, t, reduce_op::sum, algorithm::automatic, count, 1}, in, out);
      std::size_t wrong = 0;
      for (int r = 0; r < 3; ++r) {
        buffer got(oc, t);
        B->to_host(got.data(), out[r]);
        for (std::size_t i = 0; i < oc; ++i) {
          double want = 0;
          switch (k) {
            case collective::all_reduce:
              for (int j = 0; j < 3; ++j) want += value(reduce_op::sum, t, j, i);
              break;
            case collective::all_gather: want = value(reduce_op::sum, t, static_cast<int>(i / count), i % count); break;
            case collective::reduce_scatter:
              for (int j = 0; j < 3; ++j) want += value(reduce_op::sum, t, j, r * oc + i);
              break;
            default: want = value(reduce_op::sum, t, 1, i); break;
          }
          wrong += !close(load(got.data(), t, i), want, t);
        }
      }
      CHECK_MSG(wrong == 0, std::string(collective_name(k)) + " " + dtype_name(t) + ": " + std::to_string(wrong) +
                                " wrong elements");
      B->release();
    }
  }
  no_hazards("misaligned");
}

TEST_CASE("more than 2^31 elements") {
  if (quick()) return;  // 4 GiB of buffers: not under the sanitizers
  const std::size_t n = (std::size_t{1} << 31) + 17;
  auto g = B->make_group(2);
  std::vector<buffer_view> v{B->alloc(*g, 0, n, dtype::int8), B->alloc(*g, 1, n, dtype::int8)};
  {
    std::vector<std::int8_t> h(n, 1);
    // Distinct values around the 2^31 boundary, where 32-bit indexing would wrap.
    const std::size_t at[] = {0, (std::size_t{1} << 31) - 1, std::size_t{1} << 31, n - 1};
    for (std::size_t i : at) h[i] = 5;
    B->to_device(v[0], h.data());
    for (std::size_t i : at) h[i] = 2;
    B->to_device(v[1], h.data());
  }
  g->run(call_desc{collective::all_reduce, dtype::int8, reduce_op::sum, algorithm::automatic, n, 0}, v, v);
  for (int r = 0; r < 2; ++r) {
    std::vector<std::int8_t> h(n);
    B->to_host(h.data(), v[r]);
    std::size_t sevens = 0, twos = 0, other = 0;
    for (std::int8_t x : h) {
      if (x == 7) {
        ++sevens;
      } else if (x == 2) {
        ++twos;
      } else {
        ++other;
      }
    }
    CHECK_MSG(sevens == 4 && twos == n - 4 && other == 0,
              "replica " + std::to_string(r) + ": " + std::to_string(sevens) + " sevens, " + std::to_string(other) +
                  " wrong");
  }
  B->release();
}

int main(int argc, char** argv) {
  cuda::host_model::options o;
  o.devices = 2;
  o.delay = std::chrono::microseconds(quick() ? 200 : 1000);  // widens the window of ordering bugs
  B = backend_from_args(argc, argv, o);
  if (!B->gpu()) {
    std::fprintf(stderr, "test_cuda_executor runs on GPU replicas: model or cuda\n");
    return 2;
  }
  std::printf("backend: %s\n", B->name().c_str());
  const int rc = run_all();
  B.reset();
  return rc;
}
