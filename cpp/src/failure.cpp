// Failure handling of a group: recording the first failure, turning it into the right
// exception, abort/cancel/reset/close, and the waits every blocked caller shares.
#include <string>
#include <thread>

#include "group_impl.hpp"

namespace distvals {

void group::impl::wake_all() noexcept {
  std::lock_guard<std::mutex> lk(mu);
  cv.notify_all();
}

void group::impl::publish(int replica, std::uint64_t seq, std::uint64_t steps) noexcept {
  reps[replica].progress.store((seq << 32) | steps);
  if (sleepers.load() > 0) wake_all();
}

void group::impl::fail(int kind, int replica, const std::string& msg) noexcept {
  {
    std::lock_guard<std::mutex> lk(state_mu);
    if (state.load() == ok) {
      state_msg = msg;
      state_replica = replica;
      state.store(kind);
    } else if (kind == closed) {
      state.store(closed);  // closing overrides an earlier abort: nothing can run again
      state_msg = msg;
    }
  }
  wake_all();
}

void group::impl::drain() const noexcept {
  for (int j = 0; j < n; ++j) {
    for (unsigned i = 1; reps[j].busy.load(); ++i) {
      if ((i & 63u) == 0) std::this_thread::yield();
      cpu::relax();
    }
  }
}

void group::impl::throw_if_failed(int me) const {
  const int s = state.load(std::memory_order_acquire);
  if (s == ok) return;
  std::string msg;
  int origin = -1;
  {
    std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(state_mu));
    msg = state_msg;
    origin = state_replica;
  }
  switch (s) {
    case timed_out: throw timeout_error(msg);
    case closed: throw closed_error("distvals: the group is closed");
    default: {
      std::string what = "distvals: collective aborted";
      if (origin >= 0) what += " by replica " + std::to_string(origin);
      if (!msg.empty()) what += ": " + msg;
      if (me >= 0 && me != origin) what += " (seen by replica " + std::to_string(me) + ")";
      throw aborted_error(what, origin);
    }
  }
}

void group::impl::throw_if_failed_at_start(int me) const {
  const int s = state.load(std::memory_order_acquire);
  if (s == ok) return;
  if (s == closed) throw closed_error("distvals: the group is closed");
  std::string msg;
  int origin = -1;
  {
    std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(state_mu));
    msg = state_msg;
    origin = state_replica;
  }
  std::string what = "distvals: the group is aborted since an earlier collective failed";
  if (origin >= 0) what += " in replica " + std::to_string(origin);
  what += " (" + (s == timed_out ? std::string("timeout: ") : std::string()) + msg +
          "); no collective runs until reset() is called, once no call is in flight";
  if (me >= 0) what += " (seen by replica " + std::to_string(me) + ")";
  throw group_aborted_error(what, origin, msg);
}

// ---- the public failure calls ------------------------------------------------------------

void group::abort(int replica, const std::string& why) noexcept {
  impl_->check_fork();
  impl_->fail(impl::aborted, replica, why);
}
void group::cancel() noexcept {
  impl_->check_fork();
  impl_->fail(impl::aborted, -1, "cancelled");
}
bool group::aborted() const noexcept {
  const int s = impl_->state.load();
  return s == impl::aborted || s == impl::timed_out;
}
bool group::closed() const noexcept { return impl_->state.load() == impl::closed; }

void group::reset() {
  impl& m = *impl_;
  m.check_fork();
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
  m.check_fork();
  if (m.close_started.exchange(true)) return;
  m.fail(impl::closed, -1, "closed");
  // Waiters see the closed state within one wait slice; wait for them to leave before
  // the state they read goes away.
  while (m.inside.load() != 0) {
    m.wake_all();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Only now stop the executor (worker threads, streams). Stopping it first could let a
  // worker exit while a caller that had not yet seen the closed state hands it a job.
  // With nobody inside and the state closed, no caller can start work any more.
  if (m.exec) m.exec->close();
}

}  // namespace distvals
