// The same kernels built with AVX2, FMA and F16C (x86-64 only; this file gets those
// flags from CMake). Chosen at run time when the processor has them.
#define DISTVALS_KERNEL_NS avx2
#include "kernels_impl.hpp"
