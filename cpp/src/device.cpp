#include "distvals/device.hpp"

#include <cctype>
#include <string>

#include "distvals/error.hpp"

namespace distvals {

device device::parse(const std::string& name) {
  // Accept TensorFlow's spellings: the part after the last "device:" (or the last '/')
  // is "CPU:n" or "GPU:n" in any case.
  std::string s = name;
  const auto dev = s.rfind("device:");
  if (dev != std::string::npos) {
    s = s.substr(dev + 7);
  } else if (const auto slash = s.rfind('/'); slash != std::string::npos) {
    s = s.substr(slash + 1);
  }
  const auto colon = s.find(':');
  auto bad = [&]() {
    return invalid_argument_error("'" + name +
                                  "' is not a device; expected e.g. \"CPU:0\", \"/cpu:1\" or \"GPU:0\"");
  };
  if (colon == std::string::npos || colon + 1 >= s.size()) throw bad();
  std::string kind = s.substr(0, colon);
  for (auto& c : kind) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::string idx = s.substr(colon + 1);
  for (char c : idx) {
    if (!std::isdigit(static_cast<unsigned char>(c))) throw bad();
  }
  if (idx.size() > 6) throw bad();
  device d;
  if (kind == "CPU") {
    d.kind = kind_t::cpu;
  } else if (kind == "GPU") {
    d.kind = kind_t::gpu;
  } else {
    throw bad();
  }
  d.index = std::stoi(idx);
  return d;
}

std::string device::str() const { return (kind == kind_t::cpu ? "CPU:" : "GPU:") + std::to_string(index); }

}  // namespace distvals
