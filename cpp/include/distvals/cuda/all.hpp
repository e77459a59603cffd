/// @file
/// The whole CUDA backend API of distvals in one include (without the CUDA headers;
/// include distvals/cuda/error.hpp too for DISTVALS_CUDA_TRY).
#pragma once

#include "distvals/cuda/device_buffer.hpp"
#include "distvals/cuda/group.hpp"
#include "distvals/cuda/runtime.hpp"
#include "distvals/cuda/stream.hpp"
#include "distvals/cuda/timing.hpp"
