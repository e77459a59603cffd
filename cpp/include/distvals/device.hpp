/// @file
/// Devices a replica can live on.
#pragma once

#include <string>

#include "distvals/export.hpp"

namespace distvals {

/// A logical device: host memory ("CPU:n", any n) or a GPU ("GPU:n").
struct DISTVALS_EXPORT device {
  enum class kind_t { cpu, gpu };
  kind_t kind = kind_t::cpu;
  int index = 0;

  /// Parses "CPU:0", "cpu:1", "/cpu:1", "/device:GPU:0" and
  /// "/job:localhost/replica:0/task:0/device:GPU:1". Throws invalid_argument_error
  /// naming the string when it is not a device.
  static device parse(const std::string& name);
  /// Canonical name, "CPU:3" or "GPU:0".
  std::string str() const;
  bool is_cpu() const noexcept { return kind == kind_t::cpu; }
  bool operator==(const device& o) const noexcept { return kind == o.kind && index == o.index; }
  bool operator!=(const device& o) const noexcept { return !(*this == o); }
};

}  // namespace distvals
