/// @file
/// Element types and reduction operators understood by the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "distvals/export.hpp"

namespace distvals {

/// Element type of a buffer. float16 and bfloat16 are reduced in float32.
enum class dtype : std::uint8_t { float16, bfloat16, float32, float64, int8, uint8, int32, int64 };

/// Number of dtypes; dtype values run from 0 to dtype_count - 1.
inline constexpr int dtype_count = 8;

/// Size of one element in bytes. Never throws.
DISTVALS_EXPORT std::size_t dtype_size(dtype t) noexcept;
/// Lower-case name as numpy spells it ("float32", "bfloat16"). Never throws.
DISTVALS_EXPORT const char* dtype_name(dtype t) noexcept;
/// Parses a dtype name; throws dtype_error for an unknown one.
DISTVALS_EXPORT dtype parse_dtype(const std::string& name);
/// True for float16, bfloat16, float32 and float64.
DISTVALS_EXPORT bool is_floating(dtype t) noexcept;

/// Reduction operator. mean is sum followed by a division by the replica count
/// and is only defined for floating dtypes.
enum class reduce_op : std::uint8_t { sum, prod, min, max, mean };

/// Lower-case name ("sum", "prod", "min", "max", "mean"). Never throws.
DISTVALS_EXPORT const char* reduce_op_name(reduce_op op) noexcept;
/// Parses an operator name in any case ("SUM", "product" and "prod" alike);
/// throws invalid_argument_error for an unknown one.
DISTVALS_EXPORT reduce_op parse_reduce_op(const std::string& name);

/// All-reduce algorithm. `automatic` chooses by size and replica count.
enum class algorithm : std::uint8_t { automatic, ring, tree, direct };

/// Lower-case name ("auto", "ring", "tree", "direct"). Never throws.
DISTVALS_EXPORT const char* algorithm_name(algorithm a) noexcept;
/// Parses an algorithm name in any case; throws invalid_argument_error for an unknown one.
DISTVALS_EXPORT algorithm parse_algorithm(const std::string& name);

}  // namespace distvals
