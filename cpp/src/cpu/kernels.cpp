// Run-time choice of the kernel table and the blocked multi-destination copy.
#include "kernels.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "distvals/config.hpp"

namespace distvals::cpu {

// Declared where they are used (kernels_impl.hpp, timing.cpp).
std::size_t streaming_store_min_bytes() noexcept;
std::size_t set_streaming_store_min_bytes(std::size_t bytes) noexcept;

namespace {

// When the last-level cache's size is unknown: an eighth of 32 MiB.
constexpr std::size_t kDefaultStreamingMinBytes = 4u << 20;
constexpr std::size_t kMaxDefaultStreamingMinBytes = 8u << 20;

kernel_table make_table() noexcept {
  kernel_table t{};
  generic::fill_table(t);
  t.isa = "generic";
#if DISTVALS_HAS_AVX2_KERNELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    avx2::fill_table(t);
    t.isa = "avx2";
  }
#endif
  return t;
}

// The size of cpu0's largest-level data or unified cache from Linux's sysfs, 0 when
// unknown. (glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) reports a whole AMD package's L3, not
// the slice that one core shares, so it is not used.)
std::size_t last_level_cache_bytes() noexcept {
  std::size_t best = 0;
  int best_level = 0;
  for (int i = 0; i < 16; ++i) {
    char path[96];
    auto read = [&](const char* leaf, char* buf, int len) {
      std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, leaf);
      std::FILE* f = std::fopen(path, "r");
      if (!f) return false;
      const bool ok = std::fgets(buf, len, f) != nullptr;
      std::fclose(f);
      return ok;
    };
    char level[16], type[32], size[32];
    if (!read("level", level, sizeof level) || !read("type", type, sizeof type) || !read("size", size, sizeof size)) {
      continue;
    }
    if (type[0] == 'I') continue;  // instruction cache
    char* end = nullptr;
    unsigned long long v = std::strtoull(size, &end, 10);
    if (end == size) continue;
    if (*end == 'K') v <<= 10;
    else if (*end == 'M') v <<= 20;
    const int lv = std::atoi(level);
    if (lv > best_level) {
      best_level = lv;
      best = static_cast<std::size_t>(v);
    }
  }
  return best;
}

// Streaming stores pay off once one kernel call writes more than about an eighth of the
// last-level cache. Measured out of place against in place (direct, float32 sum, 2-core
// x86-64 VM, 32 MiB L3, 2 threads, so two kernel calls per collective): streaming lost
// below 3 MiB per call (N=2 at 2 MiB per replica: 447 us against 379 us with plain
// stores; N=4 at 1 MiB: 282 against 133) and won from 4 MiB per call (N=2 at 6 MiB: 784
// against 1377; N=4 at 4 MiB: 1718 against 2545; N=2 at 64 MiB: 14.6 ms against 22.3 ms,
// in place 12.1 ms). Below that, the outputs stay in the cache for their next reader.
//
// The eighth is capped at 8 MiB: a virtual machine reads the whole host socket's L3 from
// sysfs (480 MiB "shared by 2 CPUs" on one 2-vCPU VM), most of which other tenants use.
// There the uncapped 60 MiB kept every leaf of a 64 MiB structure all-reduce (32, 16, 8
// ... MiB) on plain stores: 10.2 ms against 5.7-6.2 ms with streaming from 2, 4 or 8 MiB,
// where one 64 MiB array took 5.8 ms either way.
std::size_t default_streaming_min_bytes() noexcept {
  if (const char* env = std::getenv("DISTVALS_STREAMING_MIN_BYTES")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end != env) return static_cast<std::size_t>(v);
  }
  const std::size_t llc = last_level_cache_bytes();
  return llc > 0 ? std::min(llc / 8, kMaxDefaultStreamingMinBytes) : kDefaultStreamingMinBytes;
}

std::atomic<std::size_t>& streaming_min() noexcept {
  static std::atomic<std::size_t> v{default_streaming_min_bytes()};
  return v;
}

}  // namespace

std::size_t streaming_store_min_bytes() noexcept { return streaming_min().load(std::memory_order_relaxed); }

std::size_t set_streaming_store_min_bytes(std::size_t bytes) noexcept {
  return streaming_min().exchange(bytes);
}

const kernel_table& kernels() noexcept {
  static const kernel_table table = make_table();
  return table;
}

void copy_to_all(void* const* dsts, int ndst, const void* src, std::size_t bytes) noexcept {
  if (ndst == 1) {
    if (dsts[0] != src) std::memcpy(dsts[0], src, bytes);
    return;
  }
  // Several destinations: copy block by block so the source block is read from memory
  // once and from L1 for every further destination.
  constexpr std::size_t kBlockBytes = 16 * 1024;
  const char* s = static_cast<const char*>(src);
  for (std::size_t off = 0; off < bytes; off += kBlockBytes) {
    const std::size_t n = bytes - off < kBlockBytes ? bytes - off : kBlockBytes;
    for (int d = 0; d < ndst; ++d) {
      char* p = static_cast<char*>(dsts[d]) + off;
      if (p != s + off) std::memcpy(p, s + off, n);
    }
  }
}

}  // namespace distvals::cpu
