// A host model of the CUDA runtime, with CUDA's semantics, for testing the CUDA
// executor on any machine (and under ThreadSanitizer). Not installed.
//
//  - "Devices" are ids; their memory is host memory, registered per device, so every
//    pointer can be traced to the device that holds it.
//  - Each stream is a FIFO of operations executed in order, asynchronously, on a thread
//    of its own. The handles 0 and 1 name the legacy default stream of the current
//    device, 2 its per-thread default stream (modelled as the legacy one).
//  - An event record completes when the stream reaches it; a stream that waits on an
//    event waits for the record that was the latest when the wait was enqueued, and a
//    wait on an event never recorded does nothing, as in CUDA.
//  - A launch runs the collective with the CPU kernels, segment by segment (launch.hpp).
//    It must be issued with the stream's device current, and may only touch memory of
//    devices that device reaches (the same device, or peer access enabled).
//  - Every call is counted by name; a call can be made to fail once (fault injection).
//  - Kernels and copies may be slowed down, and while an operation runs the model checks
//    that no operation of another stream touches overlapping memory with a write: an
//    ordering bug in the executor shows up as a hazard, not as luck.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda/runtime_api.hpp"

namespace distvals::cuda {

class host_model final : public runtime {
 public:
  struct options {
    int devices = 2;
    /// peer[a][b]: device a can reach device b's memory once enabled; empty: every pair.
    std::vector<std::vector<bool>> peer;
    int multiprocessors = 4;
    /// Extra time each kernel and copy takes, to widen the window of ordering bugs.
    std::chrono::microseconds delay{0};
  };
  explicit host_model(options o);
  ~host_model() override;

  // ---- what the tests look at ------------------------------------------------------------
  /// Calls by name ("launch", "event_record", ...), since construction or reset_counts().
  std::map<std::string, long> counts() const;
  /// Sum of counts() over `names`.
  long count_of(std::initializer_list<const char*> names) const;
  void reset_counts();
  /// Makes the next call named `name` (after `skip` more of them) throw cuda_error.
  void fail_next(const std::string& name, int skip = 0);
  /// Operations that touched memory another stream's operation was writing at the same
  /// time (or wrote memory it was reading), and the first such report.
  long hazards() const;
  std::string first_hazard() const;
  /// Kernels that touched memory of a device their own device cannot reach.
  long illegal_accesses() const;
  /// Enqueues `fn` on stream `s` as if it were a kernel writing [ptr, ptr + bytes).
  void enqueue_host_work(stream_t s, std::function<void()> fn, void* ptr = nullptr, std::size_t bytes = 0);
  /// Waits until every stream is idle.
  void synchronize_all();
  /// Live allocations (model device memory).
  std::size_t live_allocations() const;
  /// Devices that thread `t` made current (or used as current without choosing one, which
  /// makes device 0 current, as in CUDA).
  std::set<int> devices_made_current(std::thread::id t) const;

  // ---- the runtime interface -----------------------------------------------------------------
  int device_count() noexcept override { return opts_.devices; }
  std::string unavailable_reason() override { return opts_.devices > 0 ? "" : "the host model has no device"; }
  int current_device() override;
  void set_device(int gpu) override;
  int multiprocessor_count(int gpu) override;
  bool can_access_peer(int from, int to) noexcept override;
  bool enable_peer_access(int peer) noexcept override;
  int pointer_device(const void* ptr) noexcept override;
  stream_t stream_create() override;
  void stream_destroy(stream_t s) noexcept override;
  int stream_device(stream_t s) override;
  bool stream_query(stream_t s) override;
  event_t event_create(bool timing) override;
  void event_destroy(event_t e) noexcept override;
  void event_record(event_t e, stream_t s) override;
  void stream_wait_event(stream_t s, event_t e) override;
  bool event_query(event_t e) override;
  float event_elapsed_ms(event_t start, event_t stop) override;
  void* malloc(std::size_t bytes) override;
  void free(void* p) noexcept override;
  void memcpy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override;
  void memcpy_peer_async(void* dst, int dst_gpu, const void* src, int src_gpu, std::size_t bytes,
                         stream_t s) override;
  void memset_async(void* dst, int value, std::size_t bytes, stream_t s) override;
  void launch(const launch_args& a, stream_t s) override;

 private:
  struct range {
    std::uintptr_t begin, end;
    bool write;
  };
  struct op {
    std::function<void()> run;
    std::vector<range> touches;  // for the hazard check
    std::string what;
  };
  struct stream;
  struct event;

  void count(const char* name);
  int device_now();  // the current device; device 0 when none, which it then becomes (as in CUDA)
  stream& resolve_stream(stream_t s);
  event& resolve_event(event_t e);
  void enqueue(stream& s, op o);
  void worker(stream* s);
  void run_op(stream& s, op& o);
  int owner(std::uintptr_t p, std::size_t bytes) const;  // device holding [p, p + bytes), -1 if none
  void check_reach(int from, const void* p, std::size_t bytes, const char* what);

  options opts_;
  std::uint64_t id_;       // never reused, unlike an address: keys the threads' current devices
  mutable std::mutex mu_;  // counts, faults, allocations, hazards, peer state, live handles
  std::map<std::string, long> counts_;
  std::map<std::string, int> faults_;  // name -> calls to let pass before failing
  std::map<std::uintptr_t, std::pair<std::size_t, int>> allocs_;  // base -> (bytes, device)
  std::vector<std::vector<bool>> enabled_;                         // peer access enabled
  long hazards_ = 0, illegal_ = 0;
  std::string first_hazard_;
  std::map<std::thread::id, std::set<int>> made_current_;
  std::vector<std::unique_ptr<stream>> legacy_;  // per device
  std::set<stream*> live_streams_;
  std::set<event*> live_events_;
  std::vector<event*> dead_events_;  // destroyed, released with the model
  std::mutex in_flight_mu_;
  std::vector<std::pair<const stream*, const op*>> in_flight_;
};

}  // namespace distvals::cuda
