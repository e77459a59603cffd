/// @file
/// The whole public C++ API of distvals in one include, the CUDA backend's too when the
/// library was built with it (DISTVALS_HAS_CUDA; none of it needs the CUDA headers).
///
/// In CMake: `find_package(distvals CONFIG REQUIRED)` and
/// `target_link_libraries(app PRIVATE distvals::distvals)`.
#pragma once

#include "distvals/buffer.hpp"
#include "distvals/config.hpp"
#include "distvals/device.hpp"
#include "distvals/dtype.hpp"
#include "distvals/error.hpp"
#include "distvals/group.hpp"
#include "distvals/host_reduce.hpp"
#include "distvals/schedule.hpp"
#include "distvals/timing.hpp"
#include "distvals/version.hpp"
#if DISTVALS_HAS_CUDA
#include "distvals/cuda/all.hpp"
#endif
