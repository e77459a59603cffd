// Claiming a thread's share of a job that its owner or a helping thread may run.
#pragma once

#include <atomic>
#include <cstdint>

namespace distvals::cpu {

/// Claims the share of job `job` whose claim word is `taken`; true when the caller won
/// and must run the share. Job numbers only grow, and so may the claim: a thread that
/// woke late still holding an old job's number must not claim it back after another
/// thread took a later job's share (it would run a finished job's steps again and count
/// itself done twice, and the waiter of the later job would wait for a count it can no
/// longer reach).
inline bool claim_share(std::atomic<std::uint64_t>& taken, std::uint64_t job) noexcept {
  std::uint64_t cur = taken.load();
  while (cur < job) {
    if (taken.compare_exchange_weak(cur, job)) return true;
  }
  return false;
}

}  // namespace distvals::cpu
