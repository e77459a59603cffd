/// @file
/// Element types and reduction operators understood by the engine.
///
/// Every function here is pure: any thread may call it at any time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "distvals/export.hpp"

namespace distvals {

/// Element type of a buffer. float16 and bfloat16 are reduced in float32: `direct` (the
/// automatic choice on the CPU) combines every replica's element in float32 and rounds
/// once; `ring` and `tree` round each partial result to the dtype as it passes between
/// replicas (as NCCL does), so with more than two replicas their sums and products can
/// differ from direct's in the last bits, or overflow where direct's do not.
enum class dtype : std::uint8_t {
  float16,   ///< IEEE 754 half precision
  bfloat16,  ///< bfloat16: float32's exponent, 7-bit mantissa
  float32,   ///< IEEE 754 single precision
  float64,   ///< IEEE 754 double precision
  int8,      ///< signed 8-bit integer
  uint8,     ///< unsigned 8-bit integer
  int32,     ///< signed 32-bit integer
  int64      ///< signed 64-bit integer
};

/// Number of dtypes; dtype values run from 0 to dtype_count - 1.
inline constexpr int dtype_count = 8;

/// Size of one element in bytes. Never throws; any thread.
DISTVALS_EXPORT std::size_t dtype_size(dtype t) noexcept;
/// Lower-case name as numpy spells it ("float32", "bfloat16"). Never throws; any thread.
DISTVALS_EXPORT const char* dtype_name(dtype t) noexcept;
/// Parses a dtype name; throws dtype_error for an unknown one. Any thread.
DISTVALS_EXPORT dtype parse_dtype(const std::string& name);
/// True for float16, bfloat16, float32 and float64. Never throws; any thread.
DISTVALS_EXPORT bool is_floating(dtype t) noexcept;

/// Reduction operator. mean is sum followed by a division by the replica count
/// and is only defined for floating dtypes.
enum class reduce_op : std::uint8_t {
  sum,   ///< element-wise sum
  prod,  ///< element-wise product
  min,   ///< element-wise minimum
  max,   ///< element-wise maximum
  mean   ///< element-wise sum divided by the replica count (floating dtypes only)
};

/// Lower-case name ("sum", "prod", "min", "max", "mean"). Never throws; any thread.
DISTVALS_EXPORT const char* reduce_op_name(reduce_op op) noexcept;
/// Parses an operator name in any case ("SUM", "product" and "prod" alike);
/// throws invalid_argument_error for an unknown one. Any thread.
DISTVALS_EXPORT reduce_op parse_reduce_op(const std::string& name);

/// All-reduce algorithm. `automatic` chooses by size and replica count.
enum class algorithm : std::uint8_t {
  automatic,  ///< chosen per call by choose_algorithm()
  ring,       ///< chunked, pipelined reduce-scatter then all-gather around a ring
  tree,       ///< pipelined double binary tree: reduce up both trees, then broadcast down
  direct      ///< each replica reduces its 1/N slice from all inputs, writes it to all outputs
};

/// Lower-case name ("auto", "ring", "tree", "direct"). Never throws; any thread.
DISTVALS_EXPORT const char* algorithm_name(algorithm a) noexcept;
/// Parses an algorithm name in any case; throws invalid_argument_error for an unknown
/// one. Any thread.
DISTVALS_EXPORT algorithm parse_algorithm(const std::string& name);

}  // namespace distvals
