/// @file
/// Devices a replica can live on.
#pragma once

#include <string>

#include "distvals/export.hpp"

namespace distvals {

/// A logical device: host memory ("CPU:n", any n) or a GPU ("GPU:n").
/// A plain value; any thread may use it.
struct DISTVALS_EXPORT device {
  /// The two kinds of device.
  enum class kind_t {
    cpu,  ///< host memory; the index only names the replica's logical CPU
    gpu   ///< an NVIDIA GPU; the index is the CUDA device ordinal
  };
  /// Host or GPU.
  kind_t kind = kind_t::cpu;
  /// The n of "CPU:n" or "GPU:n"; never negative.
  int index = 0;

  /// Parses "CPU:0", "cpu:1", "/cpu:1", "/device:GPU:0" and
  /// "/job:localhost/replica:0/task:0/device:GPU:1". Throws invalid_argument_error
  /// naming the string when it is not a device. Any thread.
  static device parse(const std::string& name);
  /// Canonical name, "CPU:3" or "GPU:0". Throws only std::bad_alloc. Any thread.
  std::string str() const;
  /// True for host memory. Never throws; any thread.
  bool is_cpu() const noexcept { return kind == kind_t::cpu; }
  /// Same kind and index. Never throws; any thread.
  bool operator==(const device& o) const noexcept { return kind == o.kind && index == o.index; }
  /// Different kind or index. Never throws; any thread.
  bool operator!=(const device& o) const noexcept { return !(*this == o); }
};

}  // namespace distvals
