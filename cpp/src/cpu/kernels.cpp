// Run-time choice of the kernel table and the blocked multi-destination copy.
#include "kernels.hpp"

#include <cstring>

#include "distvals/config.hpp"

namespace distvals::cpu {
namespace {

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

}  // namespace

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
