// The host model of the CUDA runtime (see host_model.hpp).
#include "cuda/host_model.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cpu/kernels.hpp"
#include "distvals/error.hpp"

namespace distvals::cuda {
namespace {

std::atomic<std::uint64_t> next_model_id{1};

// The device each thread made current, per model (keyed by a model id, never reused).
std::map<std::uint64_t, int>& current_devices() {
  thread_local std::map<std::uint64_t, int> current;
  return current;
}

[[noreturn]] void fail(const std::string& call, const std::string& why) {
  throw cuda_error("distvals: CUDA call `" + call + "` failed (host model): " + why);
}

bool special(stream_t s) { return reinterpret_cast<std::uintptr_t>(s) <= 2; }

}  // namespace

struct host_model::stream {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<op> q;
  std::uint64_t enqueued = 0, done = 0;
  bool stop = false;
  std::thread thread;
};

struct host_model::event {
  int device = 0;
  bool timing = false;
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t latest = 0;        // the latest record's generation; 0: never recorded
  std::vector<char> completed{0};  // completed[g]: record g has completed
  std::chrono::steady_clock::time_point when{};  // when the latest record completed (timing)
};

host_model::host_model(options o) : opts_(std::move(o)), id_(next_model_id.fetch_add(1)) {
  const auto n = static_cast<std::size_t>(opts_.devices);
  if (opts_.peer.empty()) opts_.peer.assign(n, std::vector<bool>(n, true));
  enabled_.assign(n, std::vector<bool>(n, false));
  for (std::size_t d = 0; d < n; ++d) {
    enabled_[d][d] = true;
    auto s = std::make_unique<stream>();
    s->device = static_cast<int>(d);
    stream* raw = s.get();
    s->thread = std::thread([this, raw]() { worker(raw); });
    legacy_.push_back(std::move(s));
  }
}

host_model::~host_model() {
  synchronize_all();
  std::vector<stream*> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (stream* s : live_streams_) all.push_back(s);
    live_streams_.clear();
  }
  for (auto& s : legacy_) all.push_back(s.get());
  for (stream* s : all) {
    {
      std::lock_guard<std::mutex> lk(s->mu);
      s->stop = true;
    }
    s->cv.notify_all();
    s->thread.join();
  }
  for (stream* s : all) {
    if (std::find_if(legacy_.begin(), legacy_.end(), [&](const auto& l) { return l.get() == s; }) == legacy_.end()) {
      delete s;
    }
  }
  for (event* e : live_events_) delete e;
  for (event* e : dead_events_) delete e;
  for (auto& [base, info] : allocs_) std::free(reinterpret_cast<void*>(base));
  current_devices().erase(id_);
}

// ---- bookkeeping ---------------------------------------------------------------------------

void host_model::count(const char* name) {
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_[name];
  auto f = faults_.find(name);
  if (f == faults_.end()) return;
  if (f->second > 0) {
    --f->second;
    return;
  }
  faults_.erase(f);
  fail(name, "failure injected by the test");
}

std::map<std::string, long> host_model::counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  return counts_;
}

long host_model::count_of(std::initializer_list<const char*> names) const {
  std::lock_guard<std::mutex> lk(mu_);
  long total = 0;
  for (const char* n : names) {
    auto it = counts_.find(n);
    if (it != counts_.end()) total += it->second;
  }
  return total;
}

void host_model::reset_counts() {
  std::lock_guard<std::mutex> lk(mu_);
  counts_.clear();
}

void host_model::fail_next(const std::string& name, int skip) {
  std::lock_guard<std::mutex> lk(mu_);
  faults_[name] = skip;
}

long host_model::hazards() const {
  std::lock_guard<std::mutex> lk(mu_);
  return hazards_;
}

std::string host_model::first_hazard() const {
  std::lock_guard<std::mutex> lk(mu_);
  return first_hazard_;
}

long host_model::illegal_accesses() const {
  std::lock_guard<std::mutex> lk(mu_);
  return illegal_;
}

std::size_t host_model::live_allocations() const {
  std::lock_guard<std::mutex> lk(mu_);
  return allocs_.size();
}

std::set<int> host_model::devices_made_current(std::thread::id t) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = made_current_.find(t);
  return it == made_current_.end() ? std::set<int>{} : it->second;
}

int host_model::owner(std::uintptr_t p, std::size_t bytes) const {
  auto it = allocs_.upper_bound(p);
  if (it == allocs_.begin()) return -1;
  --it;
  if (p + bytes > it->first + it->second.first) return -1;
  return it->second.second;
}

void host_model::check_reach(int from, const void* p, std::size_t bytes, const char* what) {
  std::lock_guard<std::mutex> lk(mu_);
  const int o = owner(reinterpret_cast<std::uintptr_t>(p), bytes);
  if (o >= 0 && (o == from || enabled_[from][o])) return;
  ++illegal_;
  fail("launch", std::string("a kernel on device ") + std::to_string(from) + " would touch " + what + " at " +
                     std::to_string(reinterpret_cast<std::uintptr_t>(p)) +
                     (o < 0 ? ", which is no device memory" : ", memory of device " + std::to_string(o) +
                                                               " it has no peer access to"));
}

// ---- devices --------------------------------------------------------------------------------

int host_model::current_device() {
  count("current_device");
  auto& cur = current_devices();
  auto it = cur.find(id_);
  return it == cur.end() ? -1 : it->second;
}

void host_model::set_device(int gpu) {
  count("set_device");
  if (gpu < 0 || gpu >= opts_.devices) fail("set_device", "invalid device ordinal " + std::to_string(gpu));
  current_devices()[id_] = gpu;
  std::lock_guard<std::mutex> lk(mu_);
  made_current_[std::this_thread::get_id()].insert(gpu);
}

int host_model::device_now() {
  auto& cur = current_devices();
  auto it = cur.find(id_);
  if (it != cur.end()) return it->second;
  // As in CUDA, work without a current device goes to device 0 (and makes it current).
  cur[id_] = 0;
  std::lock_guard<std::mutex> lk(mu_);
  made_current_[std::this_thread::get_id()].insert(0);
  return 0;
}

int host_model::multiprocessor_count(int gpu) {
  count("multiprocessor_count");
  if (gpu < 0 || gpu >= opts_.devices) fail("multiprocessor_count", "invalid device ordinal");
  return opts_.multiprocessors;
}

bool host_model::can_access_peer(int from, int to) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_["can_access_peer"];
  if (from < 0 || to < 0 || from >= opts_.devices || to >= opts_.devices) return false;
  return from == to || opts_.peer[from][to];
}

bool host_model::enable_peer_access(int peer) noexcept {
  int from = 0;
  try {
    from = device_now();
  } catch (...) {
    return false;
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_["enable_peer_access"];
  if (peer < 0 || peer >= opts_.devices || !opts_.peer[from][peer]) return false;
  enabled_[from][peer] = true;
  return true;
}

int host_model::pointer_device(const void* ptr) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_["pointer_device"];
  return owner(reinterpret_cast<std::uintptr_t>(ptr), 0);
}

// ---- streams ----------------------------------------------------------------------------------

host_model::stream& host_model::resolve_stream(stream_t s) {
  if (special(s)) return *legacy_[device_now()];
  auto* p = static_cast<stream*>(s);
  std::lock_guard<std::mutex> lk(mu_);
  if (live_streams_.count(p) == 0) fail("stream", "invalid resource handle (a stream that does not exist)");
  return *p;
}

host_model::event& host_model::resolve_event(event_t e) {
  auto* p = static_cast<event*>(e);
  std::lock_guard<std::mutex> lk(mu_);
  if (live_events_.count(p) == 0) fail("event", "invalid resource handle (an event that does not exist)");
  return *p;
}

stream_t host_model::stream_create() {
  count("stream_create");
  auto* s = new stream;
  s->device = device_now();
  s->thread = std::thread([this, s]() { worker(s); });
  std::lock_guard<std::mutex> lk(mu_);
  live_streams_.insert(s);
  return s;
}

void host_model::stream_destroy(stream_t h) noexcept {
  auto* s = static_cast<stream*>(h);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++counts_["stream_destroy"];
    if (special(h) || live_streams_.erase(s) == 0) return;
  }
  // Work already queued still completes, as in CUDA.
  {
    std::lock_guard<std::mutex> lk(s->mu);
    s->stop = true;
  }
  s->cv.notify_all();
  s->thread.join();
  delete s;
}

int host_model::stream_device(stream_t s) {
  count("stream_device");
  return resolve_stream(s).device;
}

bool host_model::stream_query(stream_t h) {
  count("stream_query");
  stream& s = resolve_stream(h);
  std::lock_guard<std::mutex> lk(s.mu);
  return s.done == s.enqueued;
}

void host_model::enqueue(stream& s, op o) {
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.q.push_back(std::move(o));
    ++s.enqueued;
  }
  s.cv.notify_all();
}

void host_model::worker(stream* s) {
  for (;;) {
    op o;
    {
      std::unique_lock<std::mutex> lk(s->mu);
      s->cv.wait(lk, [&]() { return !s->q.empty() || s->stop; });
      if (s->q.empty()) return;  // stopped and drained
      o = std::move(s->q.front());
      s->q.pop_front();
    }
    run_op(*s, o);
    {
      std::lock_guard<std::mutex> lk(s->mu);
      ++s->done;
    }
    s->cv.notify_all();
  }
}

void host_model::run_op(stream& s, op& o) {
  if (o.touches.empty()) {
    o.run();
    return;
  }
  // Register what the operation touches, and report any overlap with a write of an
  // operation of another stream that runs at the same time.
  {
    std::lock_guard<std::mutex> lk(in_flight_mu_);
    for (const auto& [other_stream, other] : in_flight_) {
      if (other_stream == &s) continue;
      for (const range& a : o.touches) {
        for (const range& b : other->touches) {
          if ((a.write || b.write) && a.begin < b.end && b.begin < a.end) {
            std::lock_guard<std::mutex> lk2(mu_);
            if (hazards_++ == 0) first_hazard_ = o.what + " overlapped " + other->what + " on another stream";
          }
        }
      }
    }
    in_flight_.emplace_back(&s, &o);
  }
  if (opts_.delay.count() > 0) std::this_thread::sleep_for(opts_.delay);
  o.run();
  std::lock_guard<std::mutex> lk(in_flight_mu_);
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), std::make_pair(static_cast<const stream*>(&s),
                                                                                    static_cast<const op*>(&o))));
}

void host_model::synchronize_all() {
  std::vector<stream*> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (stream* s : live_streams_) all.push_back(s);
  }
  for (auto& s : legacy_) all.push_back(s.get());
  for (stream* s : all) {
    std::unique_lock<std::mutex> lk(s->mu);
    s->cv.wait(lk, [&]() { return s->done == s->enqueued; });
  }
}

void host_model::enqueue_host_work(stream_t h, std::function<void()> fn, void* ptr, std::size_t bytes) {
  stream& s = resolve_stream(h);
  op o;
  o.run = std::move(fn);
  o.what = "host work";
  if (ptr) o.touches.push_back({reinterpret_cast<std::uintptr_t>(ptr), reinterpret_cast<std::uintptr_t>(ptr) + bytes, true});
  enqueue(s, std::move(o));
}

// ---- events -----------------------------------------------------------------------------------------

event_t host_model::event_create(bool timing) {
  count("event_create");
  auto* e = new event;
  e->device = device_now();
  e->timing = timing;
  std::lock_guard<std::mutex> lk(mu_);
  live_events_.insert(e);
  return e;
}

void host_model::event_destroy(event_t h) noexcept {
  auto* e = static_cast<event*>(h);
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_["event_destroy"];
  // Kept alive (not deleted) until the model goes: an operation still queued may
  // complete it, as CUDA defers the release of an event in use.
  if (live_events_.erase(e)) dead_events_.push_back(e);
}

void host_model::event_record(event_t he, stream_t hs) {
  count("event_record");
  event& e = resolve_event(he);
  stream& s = resolve_stream(hs);
  if (e.device != s.device) fail("event_record", "the event and the stream belong to different devices");
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e.mu);
    gen = e.completed.size();
    e.completed.push_back(0);
    e.latest = gen;
  }
  event* ep = &e;
  op o;
  o.what = "event record";
  o.run = [ep, gen]() {
    {
      std::lock_guard<std::mutex> lk(ep->mu);
      ep->completed[gen] = 1;
      if (gen == ep->latest) ep->when = std::chrono::steady_clock::now();
    }
    ep->cv.notify_all();
  };
  enqueue(s, std::move(o));
}

void host_model::stream_wait_event(stream_t hs, event_t he) {
  count("stream_wait_event");
  stream& s = resolve_stream(hs);
  event& e = resolve_event(he);
  std::uint64_t target;
  {
    std::lock_guard<std::mutex> lk(e.mu);
    target = e.latest;
  }
  if (target == 0) return;  // never recorded: nothing to wait for
  event* ep = &e;
  op o;
  o.what = "event wait";
  o.run = [ep, target]() {
    std::unique_lock<std::mutex> lk(ep->mu);
    ep->cv.wait(lk, [&]() { return ep->completed[target] != 0; });
  };
  enqueue(s, std::move(o));
}

bool host_model::event_query(event_t he) {
  count("event_query");
  event& e = resolve_event(he);
  std::lock_guard<std::mutex> lk(e.mu);
  return e.latest == 0 || e.completed[e.latest] != 0;
}

float host_model::event_elapsed_ms(event_t a, event_t b) {
  count("event_elapsed_ms");
  event& s = resolve_event(a);
  event& e = resolve_event(b);
  if (!s.timing || !e.timing) fail("event_elapsed_ms", "an event without timing");
  if (&s == &e) return 0.0f;
  std::scoped_lock lk(s.mu, e.mu);
  return std::chrono::duration<float, std::milli>(e.when - s.when).count();
}

// ---- memory and work -------------------------------------------------------------------------------

void* host_model::malloc(std::size_t bytes) {
  count("malloc");
  const int dev = device_now();
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, rounded);
  if (!p) fail("malloc", "out of memory");
  std::memset(p, 0xA5, rounded);  // fresh device memory is garbage, not zeros
  std::lock_guard<std::mutex> lk(mu_);
  allocs_[reinterpret_cast<std::uintptr_t>(p)] = {bytes, dev};
  return p;
}

void host_model::free(void* p) noexcept {
  // CUDA's free waits for the device; so does the model, so nothing queued touches
  // memory that is gone.
  synchronize_all();
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_["free"];
  if (allocs_.erase(reinterpret_cast<std::uintptr_t>(p))) std::free(p);
}

void host_model::memcpy_async(void* dst, const void* src, std::size_t bytes, stream_t h) {
  count("memcpy_async");
  stream& s = resolve_stream(h);
  if (bytes == 0) return;
  op o;
  o.what = "copy";
  o.touches = {{reinterpret_cast<std::uintptr_t>(src), reinterpret_cast<std::uintptr_t>(src) + bytes, false},
               {reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(dst) + bytes, true}};
  o.run = [dst, src, bytes]() { std::memmove(dst, src, bytes); };
  enqueue(s, std::move(o));
}

void host_model::memcpy_peer_async(void* dst, int dst_gpu, const void* src, int src_gpu, std::size_t bytes,
                                   stream_t h) {
  count("memcpy_peer_async");
  stream& s = resolve_stream(h);
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int d = owner(reinterpret_cast<std::uintptr_t>(dst), bytes);
    const int from = owner(reinterpret_cast<std::uintptr_t>(src), bytes);
    if (d != dst_gpu || from != src_gpu) {
      fail("memcpy_peer_async", "the copy names devices " + std::to_string(src_gpu) + " -> " + std::to_string(dst_gpu) +
                                    " but its memory lives on " + std::to_string(from) + " -> " + std::to_string(d));
    }
  }
  if (bytes == 0) return;
  op o;
  o.what = "peer copy";
  o.touches = {{reinterpret_cast<std::uintptr_t>(src), reinterpret_cast<std::uintptr_t>(src) + bytes, false},
               {reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(dst) + bytes, true}};
  o.run = [dst, src, bytes]() { std::memmove(dst, src, bytes); };
  enqueue(s, std::move(o));
}

void host_model::memset_async(void* dst, int value, std::size_t bytes, stream_t h) {
  count("memset_async");
  stream& s = resolve_stream(h);
  if (bytes == 0) return;
  op o;
  o.what = "memset";
  o.touches = {{reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(dst) + bytes, true}};
  o.run = [dst, value, bytes]() { std::memset(dst, value, bytes); };
  enqueue(s, std::move(o));
}

void host_model::launch(const launch_args& a, stream_t h) {
  count("launch");
  stream& s = resolve_stream(h);
  const int cur = device_now();
  if (cur != s.device) {
    fail("launch", "the stream belongs to device " + std::to_string(s.device) + " but device " + std::to_string(cur) +
                       " is current");
  }
  // Step 1: what the kernel will touch, checked against what its device may reach.
  const std::size_t es = dtype_size(a.type);
  const std::size_t len = segment_length(a);
  std::size_t b = 0, e = 0;
  part_range(len, a.parts, a.part, part_align, &b, &e);
  op o;
  o.what = std::string("kernel (") + collective_name(a.kind) + ", part " + std::to_string(a.part) + ")";
  if (e > b) {
    for (int sg = 0; sg < segments(a); ++sg) {
      for (int j = 0; j < segment_sources(a, sg); ++j) {
        const char* p = segment_source(a, sg, j, es) + b * es;
        check_reach(s.device, p, (e - b) * es, "a source");
        o.touches.push_back({reinterpret_cast<std::uintptr_t>(p), reinterpret_cast<std::uintptr_t>(p) + (e - b) * es, false});
      }
      for (int d = 0; d < segment_destinations(a, sg); ++d) {
        char* p = segment_destination(a, sg, d, es) + b * es;
        check_reach(s.device, p, (e - b) * es, "a destination");
        o.touches.push_back({reinterpret_cast<std::uintptr_t>(p), reinterpret_cast<std::uintptr_t>(p) + (e - b) * es, true});
      }
    }
  }
  // Step 2: the work, with the CPU kernels, segment by segment.
  o.run = [a, b, e, es]() {
    if (e <= b) return;
    for (int sg = 0; sg < segments(a); ++sg) {
      const void* srcs[max_launch_replicas];
      void* dsts[max_launch_replicas];
      const int nsrc = segment_sources(a, sg), ndst = segment_destinations(a, sg);
      for (int j = 0; j < nsrc; ++j) srcs[j] = segment_source(a, sg, j, es) + b * es;
      for (int d = 0; d < ndst; ++d) dsts[d] = segment_destination(a, sg, d, es) + b * es;
      if (is_copy(a)) {
        cpu::copy_to_all(dsts, ndst, srcs[0], (e - b) * es);
        continue;
      }
      cpu::reduce_args r{dsts, ndst, srcs, nsrc, e - b, takes_mean(a) ? static_cast<double>(a.n) : 0.0};
      cpu::kernels().reduce[static_cast<int>(a.type)][cpu::op_index(a.op)](r);
    }
  };
  enqueue(s, std::move(o));
}

}  // namespace distvals::cuda
