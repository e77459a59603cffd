// Portable kernels: whatever vectors the baseline target has (SSE2 on x86-64, NEON on
// arm64), through the compiler's auto-vectorizer.
#define DISTVALS_KERNEL_NS generic
#include "kernels_impl.hpp"
