// A pause instruction for spin loops: lets the sibling hyper-thread run and saves power.
#pragma once

namespace distvals::cpu {

inline void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace distvals::cpu
