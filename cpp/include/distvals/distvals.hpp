/// @file
/// The whole public C++ API of distvals in one include.
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
#include "distvals/schedule.hpp"
#include "distvals/timing.hpp"
#include "distvals/version.hpp"
