// A group used in a child process after fork(). Only the thread that called fork() lives
// on in the child: the engine's worker threads are gone, and so is any thread of the
// parent that was inside a call of the group at that moment. Its locks stay taken, its
// place at the gate stays held and its call never ends, so the child's first call would
// wait forever. Instead, the child's first use of a group renews its state.
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <thread>

#include "group_impl.hpp"

namespace distvals {
namespace detail {
namespace {

std::atomic<std::uint64_t> generation{0};

void in_child() noexcept { generation.fetch_add(1); }

// Registered once, when the library is loaded.
const int registered = pthread_atfork(nullptr, nullptr, &in_child);

}  // namespace

std::uint64_t fork_generation() noexcept {
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

}  // namespace detail

void group::impl::renew_after_fork() noexcept {
  // One thread renews, marking the state with a generation that never occurs; others
  // wait until it has finished.
  constexpr std::uint64_t renewing = ~std::uint64_t{0};
  const std::uint64_t now = detail::fork_generation();
  std::uint64_t seen = fork_gen.load();
  while (seen != now) {
    if (seen != renewing && fork_gen.compare_exchange_weak(seen, renewing)) break;
    std::this_thread::yield();
    seen = fork_gen.load();
  }
  if (seen == now) return;

  // Step 1: new locks and condition variable. The old ones may be held by threads that
  // do not exist here; they are not destroyed (that needs them unlocked), only replaced.
  new (&call_mu) std::mutex();
  new (&state_mu) std::mutex();
  new (&mu) std::mutex();
  new (&cv) std::condition_variable();
  new (&cache_mu) std::mutex();
  // Step 2: nobody is inside the group or at its gate, and no call is in flight: the
  // call numbering starts afresh, as after reset(). The failure state stays (a closed
  // group stays closed).
  gate.store(0);
  inside.store(0);
  sleepers.store(0);
  for (int r = 0; r < n; ++r) {
    reps[r].progress.store(0);
    reps[r].seq.store(0);
    reps[r].busy.store(false);
    reps[r].caller.store(false);
  }
  // Step 3: the executor's own threads and locks.
  if (exec && state.load() != closed) exec->after_fork();
  fork_gen.store(now);
}

}  // namespace distvals
