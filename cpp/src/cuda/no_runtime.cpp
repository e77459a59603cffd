// A build without the CUDA backend has no CUDA runtime: GPU replicas are refused with a
// clear error (group.cpp), while the CUDA executor and its host model still build and run
// their tests.
#include "cuda/runtime_api.hpp"

namespace distvals::cuda {

runtime* real_runtime() noexcept { return nullptr; }

}  // namespace distvals::cuda
