// The gate between the two call styles: a group runs one collective at a time, whether
// it comes from one thread (single call) or from N (per replica). See group_impl.hpp.
#include <string>

#include "group_impl.hpp"

namespace distvals {

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

}  // namespace distvals
