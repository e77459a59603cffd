// distvals::group: argument checks, the two call styles, workers, failure handling.
#include "distvals/group.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "distvals/error.hpp"
#include "group_impl.hpp"
#include "validate.hpp"

namespace distvals {
namespace {

// Below this many bytes in all replicas' inputs together, the calling thread does the
// whole collective alone: handing work to a worker costs more than the work. Measured
// with the engine's timing loop (direct, float32, 2 cores), one thread against two:
// N=2 at 32 KiB per replica 1.44 us vs 1.46 us, at 128 KiB 5.2 us vs 3.9 us.
constexpr std::size_t kSingleThreadBytes = 96 * 1024;

std::vector<device> cpu_devices(int n) {
  if (n < 1) throw invalid_argument_error("a group needs at least 1 replica, got " + std::to_string(n));
  if (n > max_group_size) {
    throw invalid_argument_error("a group of " + std::to_string(n) + " replicas is too large (at most " +
                                 std::to_string(max_group_size) + ")");
  }
  std::vector<device> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[i].index = i;
  return d;
}

// "(2, 3)", "(5,)", "()": a shape as numpy prints it.
std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string t = "(";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) t += ", ";
    t += std::to_string(s[i]);
  }
  return t + (s.size() == 1 ? ",)" : ")");
}

std::string call_text(const call_desc& d) {
  return std::string(collective_name(d.kind)) + "(dtype=" + dtype_name(d.type) + ", op=" + reduce_op_name(d.op) +
         ", count=" + std::to_string(d.count) + ", root=" + std::to_string(d.root) +
         ", algorithm=" + algorithm_name(d.algo) + ")";
}

// The first way in which replica j's posted call differs from replica 0's, or "".
std::string first_difference(const call_desc& a, const std::vector<std::int64_t>& sa, const call_desc& b,
                             const std::vector<std::int64_t>& sb, int j) {
  const std::string r0 = "replica 0", rj = "replica " + std::to_string(j);
  if (a.kind != b.kind) return r0 + " called " + collective_name(a.kind) + ", " + rj + " called " + collective_name(b.kind);
  if (a.type != b.type) return r0 + " passed dtype " + dtype_name(a.type) + ", " + rj + " passed dtype " + dtype_name(b.type);
  if (sa != sb) return r0 + " passed shape " + shape_text(sa) + ", " + rj + " passed shape " + shape_text(sb);
  if (a.count != b.count) {
    return r0 + " passed " + std::to_string(a.count) + " elements, " + rj + " passed " + std::to_string(b.count);
  }
  if (a.op != b.op) return r0 + " asked for op " + reduce_op_name(a.op) + ", " + rj + " for op " + reduce_op_name(b.op);
  if (a.root != b.root) return r0 + " named root " + std::to_string(a.root) + ", " + rj + " root " + std::to_string(b.root);
  if (a.algo != b.algo) {
    return r0 + " asked for algorithm " + algorithm_name(a.algo) + ", " + rj + " for " + algorithm_name(b.algo);
  }
  return "";
}

algorithm resolve_algorithm(const call_desc& d, int n) {
  if (d.algo != algorithm::automatic) return d.algo;
  return d.kind == collective::all_reduce ? choose_algorithm(n, d.count * dtype_size(d.type)) : algorithm::direct;
}

}  // namespace

group::group(int replicas, group_options options) : group(cpu_devices(replicas), std::move(options)) {}

group::group(const std::vector<device>& devices, group_options options) : impl_(new impl) {
  if (devices.empty()) throw invalid_argument_error("a group needs at least 1 device");
  if (devices.size() > static_cast<std::size_t>(max_group_size)) {
    throw invalid_argument_error("a group of " + std::to_string(devices.size()) + " replicas is too large (at most " +
                                 std::to_string(max_group_size) + ")");
  }
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (!devices[i].is_cpu()) {
      throw invalid_argument_error("device " + devices[i].str() +
                                   " is a GPU; this group runs CPU replicas only");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        throw invalid_argument_error("device " + devices[i].str() + " is listed twice (replicas " +
                                     std::to_string(j) + " and " + std::to_string(i) + ")");
      }
    }
  }
  impl& m = *impl_;
  m.n = static_cast<int>(devices.size());
  m.devices = devices;
  m.opts = std::move(options);
  m.opts.timeout = detail::resolve_timeout(m.opts.timeout);
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  m.threads = m.opts.threads > 0 ? std::min(m.opts.threads, m.n) : std::min(m.n, hw);
  m.opts.threads = m.threads;
  if (m.opts.spin_us >= 0) {
    m.spin_us = m.opts.spin_us;
  } else {
    m.spin_us = m.n > hw ? 0 : 20;  // oversubscribed: spinning only steals the core we wait for
  }
  m.opts.spin_us = m.spin_us;
  if (m.opts.chunk_bytes == 0) m.opts.chunk_bytes = 256 * 1024;
  m.reps.reset(new impl::replica_state[static_cast<std::size_t>(m.n)]);
  if (m.threads > 1) {
    m.workers.reset(new impl::worker_slot[static_cast<std::size_t>(m.threads - 1)]);
    try {
      for (int t = 1; t < m.threads; ++t) {
        m.workers[t - 1].thread = std::thread([&m, t]() { m.worker_main(t); });
      }
    } catch (...) {
      // Out of threads (many groups alive): stop the workers already started before
      // the exception leaves, or their joinable std::thread objects would terminate
      // the process when impl_ is destroyed.
      m.stopping.store(true);
      m.wake_all();
      for (int t = 1; t < m.threads; ++t) {
        if (m.workers[t - 1].thread.joinable()) m.workers[t - 1].thread.join();
      }
      throw;
    }
  }
}

group::~group() { close(); }

int group::size() const noexcept { return impl_->n; }
const std::vector<device>& group::devices() const noexcept { return impl_->devices; }
const group_options& group::options() const noexcept { return impl_->opts; }

void group::abort(int replica, const std::string& why) noexcept { impl_->fail(impl::aborted, replica, why); }
void group::cancel() noexcept { impl_->fail(impl::aborted, -1, "cancelled"); }
bool group::aborted() const noexcept {
  const int s = impl_->state.load();
  return s == impl::aborted || s == impl::timed_out;
}
bool group::closed() const noexcept { return impl_->state.load() == impl::closed; }

void group::reset() {
  impl& m = *impl_;
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  if (m.inside.load() != 0) {
    throw std::logic_error("distvals: group::reset() called while a collective is in flight");
  }
  // Nobody is inside: start the call numbering afresh so stale progress cannot satisfy
  // a future dependency.
  for (int r = 0; r < m.n; ++r) {
    m.reps[r].progress.store(0);
    m.reps[r].seq.store(0);
  }
  std::lock_guard<std::mutex> lk(m.state_mu);
  m.state.store(impl::ok);
  m.state_msg.clear();
  m.state_replica = -1;
}

void group::close() noexcept {
  impl& m = *impl_;
  if (m.close_started.exchange(true)) return;
  m.fail(impl::closed, -1, "closed");
  // Waiters see the closed state within one wait slice; wait for them to leave before
  // the state they read goes away.
  while (m.inside.load() != 0) {
    m.wake_all();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Only now stop the workers. Stopping them first could let a worker exit while a
  // single-call caller that had not yet seen the closed state hands it a job, and that
  // caller would then wait forever for the job to finish. With nobody inside and the
  // state closed, no caller can post a job any more.
  m.stopping.store(true);
  m.wake_all();
  for (int t = 1; t < m.threads; ++t) {
    if (m.workers[t - 1].thread.joinable()) m.workers[t - 1].thread.join();
  }
}

namespace {
struct inside_guard {
  std::atomic<int>& c;
  explicit inside_guard(std::atomic<int>& x) : c(x) { c.fetch_add(1); }
  ~inside_guard() { c.fetch_sub(1); }
};
}  // namespace

// ---- the gate between the call styles ---------------------------------------------

void group::impl::enter_single(clock_type::time_point deadline, std::chrono::nanoseconds timeout,
                               const call_desc& desc) {
  // Step 1: say that a single call waits, so that no new per-replica collective starts.
  gate.fetch_or(gate_waiting);
  // Step 2: enter once no per-replica caller is inside.
  bool in = false;
  auto try_enter = [&]() {
    if (in) return true;
    std::uint64_t w = gate.load();
    while ((w & gate_count) == 0 && (w & gate_active) == 0) {
      if (gate.compare_exchange_weak(w, (w & ~gate_waiting) | gate_active)) return in = true;
    }
    return false;
  };
  if (try_enter()) return;
  try {
    wait(try_enter, deadline, -1,
         [&]() {
           return "distvals: a single-call " + std::string(collective_name(desc.kind)) + " waited " +
                  detail::timeout_text(timeout) +
                  " for the per-replica calls in flight on this group to end (a group runs one "
                  "collective at a time)";
         },
         /*fail_group=*/false);
  } catch (...) {
    gate.fetch_and(~gate_waiting);
    if (sleepers.load() > 0) wake_all();
    throw;
  }
}

void group::impl::leave_single() noexcept {
  gate.fetch_and(~(gate_active | gate_waiting));
  if (sleepers.load() > 0) wake_all();
}

void group::impl::enter_replica(int me, clock_type::time_point deadline, std::chrono::nanoseconds timeout) {
  bool in = false;
  auto try_enter = [&]() {
    if (in) return true;
    std::uint64_t w = gate.load();
    for (;;) {
      // The collective this call would take part in. Only a hint here: once inside, the
      // caller reads its call number again (a single call may have run meanwhile).
      const std::uint64_t mine = (reps[me].seq.load() + 1) & 0xffffffffu;
      const std::uint64_t count = w & gate_count;
      // Not while a single call runs; while one waits, only to join the collective
      // that other replicas have already started.
      if ((w & gate_active) != 0) return false;
      if ((w & gate_waiting) != 0 && !(count > 0 && (w >> 32) == mine)) return false;
      const std::uint64_t next = (mine << 32) | (w & (gate_active | gate_waiting)) | (count + 1);
      if (gate.compare_exchange_weak(w, next)) return in = true;
    }
  };
  if (!try_enter()) {
    wait(try_enter, deadline, me,
         [&]() {
           return "distvals: replica " + std::to_string(me) + " waited " + detail::timeout_text(timeout) +
                  " for a single-call collective on this group to end (a group runs one collective at a time)";
         },
         /*fail_group=*/false);
  }
  // Inside, nothing else changes our call number: record it as the collective in
  // progress (the hint may have been stale if a single call ran just before we got in),
  // so that the other replicas of this collective may join while a single call waits.
  const std::uint64_t actual = (reps[me].seq.load() + 1) & 0xffffffffu;
  std::uint64_t w = gate.load();
  bool changed = false;
  while ((w >> 32) != actual) {
    if (gate.compare_exchange_weak(w, (actual << 32) | (w & 0xffffffffu))) changed = true;
  }
  if (changed && sleepers.load() > 0) wake_all();
}

void group::impl::leave_replica() noexcept {
  const std::uint64_t w = gate.fetch_sub(1) - 1;
  if ((w & gate_count) == 0 && (w & gate_waiting) != 0 && sleepers.load() > 0) wake_all();
}

// ---- single-call style ----------------------------------------------------------------

void group::run(const call_desc& desc_in, const std::vector<buffer_view>& in,
                const std::vector<buffer_view>& out) {
  impl& m = *impl_;
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  if (static_cast<int>(in.size()) != m.n || static_cast<int>(out.size()) != m.n) {
    throw invalid_argument_error("expected " + std::to_string(m.n) + " input and output buffers (one per replica), got " +
                                 std::to_string(in.size()) + " and " + std::to_string(out.size()));
  }
  call_desc desc = desc_in;
  for (int r = 0; r < m.n; ++r) validate_replica_buffers(desc, m.n, r, in[r], out[r]);
  detail::check_overlaps(desc, in, out);
  desc.algo = resolve_algorithm(desc, m.n);

  std::lock_guard<std::mutex> call_lock(m.call_mu);
  m.throw_if_failed(-1);
  const auto deadline = detail::deadline_after(m.opts.timeout);
  m.enter_single(deadline, m.opts.timeout, desc);
  struct leave {
    impl& m;
    ~leave() { m.leave_single(); }
  } leave_gate{m};
  // Post the call for every replica, then mark them all arrived.
  const std::uint64_t seq = m.reps[0].seq.load() + 1;
  const int slot = static_cast<int>(seq & 1u);
  for (int r = 0; r < m.n; ++r) {
    auto& rs = m.reps[r];
    rs.seq.store(seq);
    rs.desc[slot] = desc;
    rs.in[slot] = in[r];
    rs.out[slot] = out[r];
    rs.error[slot].clear();
  }
  for (int r = 0; r < m.n; ++r) m.reps[r].progress.store(seq << 32);

  const std::size_t total = desc.count * dtype_size(desc.type) * static_cast<std::size_t>(m.n);
  const int t = total < kSingleThreadBytes ? 1 : m.threads;
  // `direct` cuts the data into one slice per executing thread (thread p runs replica
  // p's program), not one per replica: fewer, longer steps for the same traffic.
  schedule_key key{desc.kind, desc.algo, m.n, desc.count, desc.root,
                   std::max<std::size_t>(1, m.opts.chunk_bytes / dtype_size(desc.type)), 16};
  key.parts = t;
  const auto sched = m.get_schedule(key);

  if (t == 1) {
    m.run_share(*sched, seq, 0, 1, deadline);
    return;
  }

  // Hand the job to workers 1 .. t-1 and run our own share (replicas 0, t, 2t, ...).
  // Then take over the share of every worker that has not started yet: a worker that is
  // asleep or descheduled (a busy machine) would otherwise make us wait for it, and one
  // thread doing all the work is never slower than waiting. Finally wait for the workers
  // that did start to leave the job (they read *sched and the posted views).
  m.job_sched = sched.get();
  m.job_seq = seq;
  m.job_threads = t;
  m.job_deadline = deadline;
  m.job_done.store(0);
  m.job_error = nullptr;
  for (int w = 1; w < t; ++w) m.workers[w - 1].go.store(seq);
  if (m.sleepers.load() > 0) m.wake_all();

  std::exception_ptr mine;
  int started = t - 1;
  try {
    m.run_share(*sched, seq, 0, t, deadline);
    for (int w = 1; w < t; ++w) {
      if (impl::take(m.workers[w - 1], seq)) {
        --started;
        m.run_share(*sched, seq, w, t, deadline);
      }
    }
  } catch (...) {
    mine = std::current_exception();
    m.fail(impl::aborted, -1, "the calling thread failed");
    // Shares not taken yet: take them so no worker starts on a failed job.
    for (int w = 1; w < t; ++w) {
      if (impl::take(m.workers[w - 1], seq)) --started;
    }
  }
  // Workers always finish: they complete their programs or see the failure state.
  auto all_done = [&]() { return m.job_done.load() == started; };
  while (!all_done()) {
    for (int i = 0; i < 64 && !all_done(); ++i) cpu::relax();
    if (all_done()) break;
    std::unique_lock<std::mutex> lk(m.mu);
    m.sleepers.fetch_add(1);
    m.cv.wait_for(lk, std::chrono::milliseconds(1), all_done);
    m.sleepers.fetch_sub(1);
  }
  if (mine) std::rethrow_exception(mine);
  if (m.job_error) std::rethrow_exception(m.job_error);
}

void group::all_reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                       reduce_op op, algorithm algo) {
  DISTVALS_EXPECTS(!in.empty(), "all_reduce needs one input buffer per replica");
  run(call_desc{collective::all_reduce, in[0].type, op, algo, in[0].count, 0}, in, out);
}

void group::reduce(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root,
                   reduce_op op) {
  DISTVALS_EXPECTS(!in.empty(), "reduce needs one input buffer per replica");
  run(call_desc{collective::reduce, in[0].type, op, algorithm::direct, in[0].count, root}, in, out);
}

void group::broadcast(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out, int root) {
  DISTVALS_EXPECTS(root >= 0 && root < static_cast<int>(in.size()), "broadcast root out of range");
  run(call_desc{collective::broadcast, in[root].type, reduce_op::sum, algorithm::direct, in[root].count, root},
      in, out);
}

void group::all_gather(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  DISTVALS_EXPECTS(!in.empty(), "all_gather needs one input buffer per replica");
  run(call_desc{collective::all_gather, in[0].type, reduce_op::sum, algorithm::direct, in[0].count, 0}, in,
      out);
}

void group::reduce_scatter(const std::vector<buffer_view>& in, const std::vector<buffer_view>& out,
                           reduce_op op) {
  DISTVALS_EXPECTS(!in.empty(), "reduce_scatter needs one input buffer per replica");
  run(call_desc{collective::reduce_scatter, in[0].type, op, algorithm::direct, in[0].count, 0}, in, out);
}

// ---- per-replica style ------------------------------------------------------------------

void group::run(int replica, const call_desc& desc, buffer_view in, buffer_view out,
                std::chrono::nanoseconds timeout) {
  replica_options o;
  o.timeout = timeout;
  run(replica, desc, in, out, o);
}

namespace {
// Leaves the gate when the per-replica call ends, however it ends.
struct replica_gate {
  group::impl& m;
  ~replica_gate() { m.leave_replica(); }
};

void check_replica_index(int replica, int n) {
  if (replica < 0 || replica >= n) {
    throw invalid_argument_error("replica " + std::to_string(replica) + " is out of range for a group of " +
                                 std::to_string(n));
  }
}
}  // namespace

void group::run(int replica, const call_desc& desc_in, buffer_view in, buffer_view out,
                const replica_options& options) {
  impl& m = *impl_;
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  check_replica_index(replica, m.n);
  m.throw_if_failed(replica);
  call_desc desc = desc_in;
  desc.algo = resolve_algorithm(desc, m.n);
  const auto timeout = options.timeout.count() > 0 ? options.timeout : m.opts.timeout;
  const auto deadline = detail::deadline_after(timeout);
  auto& me = m.reps[replica];
  m.enter_replica(replica, deadline, timeout);
  replica_gate leave_gate{m};

  // Step 1: post our arguments (and whether they are valid) and arrive.
  const std::uint64_t seq = me.seq.load() + 1;
  const int slot = static_cast<int>(seq & 1u);
  me.seq.store(seq);
  me.desc[slot] = desc;
  me.in[slot] = in;
  me.out[slot] = out;
  if (options.shape != nullptr && options.ndim >= 0) {
    me.shape[slot].assign(options.shape, options.shape + options.ndim);
  } else {
    me.shape[slot].assign(1, static_cast<std::int64_t>(desc.count));
  }
  me.error[slot].clear();
  me.type_error[slot] = false;
  try {
    validate_replica_buffers(desc, m.n, replica, in, out);
  } catch (const dtype_error& e) {
    me.error[slot] = e.what();
    me.type_error[slot] = true;
  } catch (const std::exception& e) {
    me.error[slot] = e.what();
  }
  m.publish(replica, seq, 0);
  try {
    m.run_arrived(replica, seq, desc, timeout, deadline);
  } catch (...) {
    // Other replicas may be inside a step that reads or writes our buffers (we may have
    // timed out, or been aborted, while they still work). They start no new step once
    // the group has failed; wait for the running ones so that the caller, who now owns
    // its buffers again, never sees them change.
    m.drain();
    throw;
  }
}

void group::report_invalid(int replica, const std::string& why, bool type_error,
                           std::chrono::nanoseconds timeout_in) {
  impl& m = *impl_;
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  check_replica_index(replica, m.n);
  m.throw_if_failed(replica);
  const auto timeout = timeout_in.count() > 0 ? timeout_in : m.opts.timeout;
  const auto deadline = detail::deadline_after(timeout);
  auto& me = m.reps[replica];
  m.enter_replica(replica, deadline, timeout);
  replica_gate leave_gate{m};
  // Arrive like run() with an error posted and no buffers: step 3 of run_arrived makes
  // every replica throw it before anything is compared or touched.
  const std::uint64_t seq = me.seq.load() + 1;
  const int slot = static_cast<int>(seq & 1u);
  call_desc desc;
  me.seq.store(seq);
  me.desc[slot] = desc;
  me.in[slot] = buffer_view{};
  me.out[slot] = buffer_view{};
  me.shape[slot].clear();
  me.error[slot] = why.empty() ? "replica " + std::to_string(replica) + ": invalid arguments" : why;
  me.type_error[slot] = type_error;
  m.publish(replica, seq, 0);
  try {
    m.run_arrived(replica, seq, desc, timeout, deadline);
  } catch (...) {
    m.drain();
    throw;
  }
}

void group::impl::run_arrived(int replica, std::uint64_t seq, const call_desc& desc,
                              std::chrono::nanoseconds timeout, clock_type::time_point deadline) {
  impl& m = *this;
  const int slot = static_cast<int>(seq & 1u);

  // Waits until done(j) holds for every replica j; on timeout, message(list of the
  // replicas it still waits for) says what went wrong.
  auto wait_every = [&](const auto& done, const auto& message) {
    m.wait(
        [&]() {
          for (int j = 0; j < m.n; ++j) {
            if (!done(j)) return false;
          }
          return true;
        },
        deadline, replica,
        [&]() {
          std::string who;
          for (int j = 0; j < m.n; ++j) {
            if (done(j)) continue;
            if (!who.empty()) who += ", ";
            who += std::to_string(j);
          }
          return message(who);
        });
  };

  // Step 2: wait for everybody to arrive.
  const std::uint64_t base = seq << 32;
  auto arrived = [&](int j) { return m.reps[j].progress.load(std::memory_order_acquire) >= base; };
  wait_every(arrived, [&](const std::string& who) {
    return "distvals: " + std::string(collective_name(desc.kind)) + " timed out after " +
           detail::timeout_text(timeout) + " in replica " + std::to_string(replica) + ": replica(s) " + who +
           " never arrived";
  });

  // Step 3: every replica checks every posted call the same way, so they all reach the
  // same verdict and raise the same error; nothing has been touched yet. First the
  // replicas' own argument checks, then agreement (collective, dtype, shape, count, op,
  // root, algorithm), then the buffers of all replicas together (overlaps).
  for (int j = 0; j < m.n; ++j) {
    if (!m.reps[j].error[slot].empty()) {
      std::string what = m.reps[j].error[slot] +
                         (j == replica ? "" : " (reported by replica " + std::to_string(j) + ")");
      if (m.reps[j].type_error[slot]) throw dtype_error(what);
      throw invalid_argument_error(what);
    }
  }
  const call_desc& d0 = m.reps[0].desc[slot];
  for (int j = 1; j < m.n; ++j) {
    const call_desc& dj = m.reps[j].desc[slot];
    const std::string diff = first_difference(d0, m.reps[0].shape[slot], dj, m.reps[j].shape[slot], j);
    if (diff.empty()) continue;
    throw mismatch_error("distvals: replicas called different collectives: " + diff + " (replica 0 called " +
                         call_text(d0) + ", replica " + std::to_string(j) + " called " + call_text(dj) + ")");
  }
  struct posted_call {
    const impl* m;
    int slot;
  } posted{this, slot};
  detail::check_overlaps(
      desc, m.n,
      [](const void* c, int r, bool output) -> const buffer_view& {
        const auto& p = *static_cast<const posted_call*>(c);
        return output ? p.m->reps[r].out[p.slot] : p.m->reps[r].in[p.slot];
      },
      &posted);

  // Step 4: run our program.
  schedule_key key{desc.kind, desc.algo, m.n, desc.count, desc.root,
                   std::max<std::size_t>(1, m.opts.chunk_bytes / dtype_size(desc.type)), 16};
  const auto sched = m.get_schedule(key);
  const int own = replica;
  m.run_programs(*sched, seq, &own, 1, deadline, replica);

  // Step 5: leave only when nobody can still read or write our buffers.
  auto finished = [&](int j) {
    return m.reps[j].progress.load(std::memory_order_acquire) >= base + sched->programs[j].size();
  };
  wait_every(finished, [&](const std::string& who) {
    return "distvals: " + std::string(collective_name(desc.kind)) + " timed out in replica " +
           std::to_string(replica) + " waiting for replica(s) " + who + " to finish";
  });
}

}  // namespace distvals
