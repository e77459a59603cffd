#include "distvals/dtype.hpp"

#include <algorithm>
#include <cctype>
#include <string>

#include "distvals/error.hpp"

namespace distvals {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

}  // namespace

std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::float16:
    case dtype::bfloat16: return 2;
    case dtype::float32:
    case dtype::int32: return 4;
    case dtype::float64:
    case dtype::int64: return 8;
    case dtype::int8:
    case dtype::uint8: return 1;
  }
  return 1;
}

const char* dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::float32: return "float32";
    case dtype::float64: return "float64";
    case dtype::int8: return "int8";
    case dtype::uint8: return "uint8";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
  }
  return "?";
}

dtype parse_dtype(const std::string& name) {
  const std::string n = lower(name);
  for (int i = 0; i < dtype_count; ++i) {
    if (n == dtype_name(static_cast<dtype>(i))) return static_cast<dtype>(i);
  }
  if (n == "half") return dtype::float16;
  if (n == "float") return dtype::float32;
  if (n == "double") return dtype::float64;
  throw dtype_error("unsupported dtype '" + name +
                    "'; supported: float16, bfloat16, float32, float64, int8, uint8, int32, int64");
}

bool is_floating(dtype t) noexcept {
  return t == dtype::float16 || t == dtype::bfloat16 || t == dtype::float32 || t == dtype::float64;
}

const char* reduce_op_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::prod: return "prod";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::mean: return "mean";
  }
  return "?";
}

reduce_op parse_reduce_op(const std::string& name) {
  const std::string n = lower(name);
  if (n == "sum") return reduce_op::sum;
  if (n == "prod" || n == "product") return reduce_op::prod;
  if (n == "min") return reduce_op::min;
  if (n == "max") return reduce_op::max;
  if (n == "mean" || n == "avg") return reduce_op::mean;
  throw invalid_argument_error("unknown reduce op '" + name +
                               "'; expected one of sum, mean, min, max, prod");
}

const char* algorithm_name(algorithm a) noexcept {
  switch (a) {
    case algorithm::automatic: return "auto";
    case algorithm::ring: return "ring";
    case algorithm::tree: return "tree";
    case algorithm::direct: return "direct";
  }
  return "?";
}

algorithm parse_algorithm(const std::string& name) {
  const std::string n = lower(name);
  if (n == "auto" || n == "automatic") return algorithm::automatic;
  if (n == "ring") return algorithm::ring;
  if (n == "tree") return algorithm::tree;
  if (n == "direct") return algorithm::direct;
  throw invalid_argument_error("unknown algorithm '" + name +
                               "'; expected one of auto, ring, tree, direct");
}

}  // namespace distvals
