// The per-replica style: N threads, one per replica, post their arguments, meet, agree,
// and run the collective. Whatever the backend, every replica checks every posted call
// the same way, so all of them raise the same error, before anything is touched.
#include <cstdint>
#include <string>

#include "group_impl.hpp"
#include "validate.hpp"

namespace distvals {
namespace {

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

void check_replica_index(int replica, int n) {
  if (replica < 0 || replica >= n) {
    throw invalid_argument_error("replica " + std::to_string(replica) + " is out of range for a group of " +
                                 std::to_string(n));
  }
}

struct inside_guard {
  std::atomic<int>& c;
  explicit inside_guard(std::atomic<int>& x) : c(x) { c.fetch_add(1); }
  ~inside_guard() { c.fetch_sub(1); }
};

// Leaves the gate when the per-replica call ends, however it ends.
struct replica_gate {
  group::impl& m;
  ~replica_gate() { m.leave_replica(); }
};

// The one thread in a call as a replica, from run() or report_invalid(): a second
// thread that claims the same replica meanwhile is refused at once. (It would post a
// call of its own over the first one's, and replicas in the middle of the first call
// would take it as finished and read or return half-written buffers.)
struct one_caller {
  std::atomic<bool>& flag;
  one_caller(std::atomic<bool>& f, int replica) : flag(f) {
    if (flag.exchange(true)) {
      throw invalid_argument_error("replica " + std::to_string(replica) +
                                   ": another thread is already in a call as this replica; each replica's calls "
                                   "must come from one thread at a time (two threads passed the same replica "
                                   "index?)");
    }
  }
  ~one_caller() { flag.store(false); }
  one_caller(const one_caller&) = delete;
  one_caller& operator=(const one_caller&) = delete;
};

}  // namespace

void group::run(int replica, const call_desc& desc, buffer_view in, buffer_view out, std::chrono::nanoseconds timeout) {
  replica_options o;
  o.timeout = timeout;
  impl_->run_replica(replica, desc, in, out, o, nullptr);
}

void group::run(int replica, const call_desc& desc, buffer_view in, buffer_view out, const replica_options& options) {
  impl_->run_replica(replica, desc, in, out, options, nullptr);
}

void group::impl::run_replica(int replica, const call_desc& desc_in, const buffer_view& in, const buffer_view& out,
                              const replica_options& options, const detail::stream_ref* wait_for) {
  check_fork();
  inside_guard guard(inside);
  if (state.load() == closed) throw closed_error("distvals: the group is closed");
  check_replica_index(replica, n);
  auto& me = reps[replica];
  const one_caller caller(me.caller, replica);
  throw_if_failed_at_start(replica);
  call_desc desc = desc_in;
  desc.algo = resolve_algorithm(desc);
  const auto timeout = options.timeout.count() > 0 ? options.timeout : opts.timeout;
  const auto deadline = detail::deadline_after(timeout);
  enter_replica(replica, deadline, timeout);
  replica_gate leave_gate{*this};

  // Step 1: post our arguments (and whether they are valid) and arrive.
  const std::uint64_t seq = me.seq.load() + 1;
  const int slot = static_cast<int>(seq & 1u);
  me.seq.store(seq);
  me.desc[slot] = desc;
  me.in[slot] = in;
  me.out[slot] = out;
  if (options.ndim == 0) {
    me.shape[slot].clear();  // a scalar: shape ()
  } else if (options.ndim > 0 && options.shape != nullptr) {
    me.shape[slot].assign(options.shape, options.shape + options.ndim);
  } else {
    me.shape[slot].assign(1, static_cast<std::int64_t>(desc.count));
  }
  me.has_wait_for[slot] = wait_for != nullptr;
  if (wait_for) me.wait_for[slot] = *wait_for;
  me.error[slot].clear();
  me.type_error[slot] = false;
  try {
    check_replica(desc, replica, in, out);
    if (wait_for != nullptr && replica != 0 && wait_for->handle == reinterpret_cast<void*>(std::uintptr_t{2})) {
      // Replica 0's thread enqueues the whole collective, and there handle 2 would be its
      // own per-thread default stream: this replica's work would never be waited for.
      throw invalid_argument_error("replica " + std::to_string(replica) +
                                   ": a per-thread default stream (handle 2) cannot be waited for from another "
                                   "thread; pass the stream object itself, or synchronize it first");
    }
    if (options.ndim > 0 && options.shape == nullptr) {
      throw invalid_argument_error("replica " + std::to_string(replica) + ": ndim is " +
                                   std::to_string(options.ndim) + " but shape is null");
    }
    if (options.ndim > 0) {
      // A shape describes the input: its elements must be the call's. A product past
      // 2^64 describes no buffer (wrapped around, it could equal the count).
      std::uint64_t elements = 1;
      bool negative = false, zero = false, overflow = false;
      for (int i = 0; i < options.ndim; ++i) {
        negative = negative || options.shape[i] < 0;
        zero = zero || options.shape[i] == 0;
      }
      for (int i = 0; i < options.ndim && !negative && !zero; ++i) {
        overflow = overflow || __builtin_mul_overflow(elements, static_cast<std::uint64_t>(options.shape[i]), &elements);
      }
      if (zero) elements = 0;
      if (negative || overflow || (desc.kind != collective::broadcast && elements != desc.count)) {
        std::string s = "(";
        for (int i = 0; i < options.ndim; ++i) s += (i ? ", " : "") + std::to_string(options.shape[i]);
        throw invalid_argument_error("replica " + std::to_string(replica) + ": shape " + s + ") does not describe " +
                                     std::to_string(desc.count) + " elements");
      }
    }
  } catch (const dtype_error& e) {
    me.error[slot] = e.what();
    me.type_error[slot] = true;
  } catch (const std::exception& e) {
    me.error[slot] = e.what();
  }
  publish(replica, seq, 0);
  try {
    run_arrived(replica, seq, desc, timeout, deadline);
  } catch (...) {
    // Other replicas may be inside a step that reads or writes our buffers (we may have
    // timed out, or been aborted, while they still work). They start no new step once
    // the group has failed; wait for the running ones so that the caller, who now owns
    // its buffers again, never sees them change.
    drain();
    throw;
  }
}

void group::report_invalid(int replica, const std::string& why, bool type_error, std::chrono::nanoseconds timeout_in) {
  impl& m = *impl_;
  m.check_fork();
  inside_guard guard(m.inside);
  if (m.state.load() == impl::closed) throw closed_error("distvals: the group is closed");
  check_replica_index(replica, m.n);
  auto& me = m.reps[replica];
  const one_caller caller(me.caller, replica);
  m.throw_if_failed_at_start(replica);
  const auto timeout = timeout_in.count() > 0 ? timeout_in : m.opts.timeout;
  const auto deadline = detail::deadline_after(timeout);
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
  me.has_wait_for[slot] = false;
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

void group::impl::run_arrived(int replica, std::uint64_t seq, const call_desc& desc, std::chrono::nanoseconds timeout,
                              clock_type::time_point deadline) {
  const int slot = static_cast<int>(seq & 1u);
  const std::uint64_t base = seq << 32;

  // Step 2: wait for everybody to arrive.
  auto arrived = [&](int j) { return reached(reps[j].progress.load(std::memory_order_acquire), base); };
  wait(
      [&]() {
        for (int j = 0; j < n; ++j) {
          if (!arrived(j)) return false;
        }
        return true;
      },
      deadline, replica, [&]() {
        std::string who;
        for (int j = 0; j < n; ++j) {
          if (arrived(j)) continue;
          if (!who.empty()) who += ", ";
          who += std::to_string(j);
        }
        return "distvals: " + std::string(collective_name(desc.kind)) + " timed out after " +
               detail::timeout_text(timeout) + " in replica " + std::to_string(replica) + ": replica(s) " + who +
               " never arrived";
      });

  // Step 3: every replica checks every posted call the same way, so they all reach the
  // same verdict and raise the same error; nothing has been touched yet. First the
  // replicas' own argument checks, then agreement (collective, dtype, shape, count, op,
  // root, algorithm), then the buffers of all replicas together (overlaps).
  for (int j = 0; j < n; ++j) {
    if (!reps[j].error[slot].empty()) {
      std::string what = reps[j].error[slot] + (j == replica ? "" : " (reported by replica " + std::to_string(j) + ")");
      if (reps[j].type_error[slot]) throw dtype_error(what);
      throw invalid_argument_error(what);
    }
  }
  const call_desc& d0 = reps[0].desc[slot];
  for (int j = 1; j < n; ++j) {
    const call_desc& dj = reps[j].desc[slot];
    const std::string diff = first_difference(d0, reps[0].shape[slot], dj, reps[j].shape[slot], j);
    if (diff.empty()) continue;
    throw mismatch_error("distvals: replicas called different collectives: " + diff + " (replica 0 called " +
                         call_text(d0) + ", replica " + std::to_string(j) + " called " + call_text(dj) + ")");
  }
  struct posted_call {
    const impl* m;
    int slot;
  } posted{this, slot};
  detail::check_overlaps(
      desc, n,
      [](const void* c, int r, bool output) -> const buffer_view& {
        const auto& p = *static_cast<const posted_call*>(c);
        return output ? p.m->reps[r].out[p.slot] : p.m->reps[r].in[p.slot];
      },
      &posted);

  // Step 4: run. Either every replica runs its own part (CPU), or replica 0 runs the
  // whole collective for all (one launch on a GPU) and the others wait for it.
  detail::call c;
  c.desc = desc;
  c.seq = seq;
  c.deadline = deadline;
  c.timeout = timeout;
  c.me = replica;
  if (exec->runs_parts()) {
    exec->run_part(replica, c);
    return;
  }
  if (replica == 0) {
    std::vector<detail::stream_ref> waits;
    for (int j = 0; j < n; ++j) {
      if (reps[j].has_wait_for[slot]) waits.push_back(reps[j].wait_for[slot]);
    }
    c.wait_for = waits.empty() ? nullptr : waits.data();
    c.nwait = static_cast<int>(waits.size());
    leader_error[slot] = nullptr;
    try {
      exec->run(c);
    } catch (...) {
      leader_error[slot] = std::current_exception();
      publish(0, seq, 1);
      throw;
    }
    publish(0, seq, 1);
    return;
  }
  auto ran = [&]() { return reached(reps[0].progress.load(std::memory_order_acquire), base + 1); };
  wait(ran, deadline, replica, [&]() {
    return "distvals: " + std::string(collective_name(desc.kind)) + " timed out after " +
           detail::timeout_text(timeout) + " in replica " + std::to_string(replica) +
           " waiting for replica 0 to run it";
  });
  if (leader_error[slot]) std::rethrow_exception(leader_error[slot]);
}

}  // namespace distvals
