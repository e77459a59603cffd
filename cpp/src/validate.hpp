// Checks across the buffers of all replicas of one call, shared by both call styles.
// Not installed.
#pragma once

#include <vector>

#include "distvals/group.hpp"

namespace distvals::detail {

/// Replica r's input (output == false) or output buffer of the call being checked.
using view_getter = const buffer_view& (*)(const void* context, int replica, bool output);

/// Throws invalid_argument_error when a buffer that the collective writes overlaps any
/// other buffer of the call (another replica's input or output, or its own input),
/// except that a replica's output may be exactly its own input (in place). Only the
/// buffers the collective touches count (broadcast reads only the root's input, reduce
/// writes only the root's output). Every replica of a per-replica call runs it over the
/// same posted buffers and gets the same verdict. Touches no data; any thread.
void check_overlaps(const call_desc& desc, int replicas, view_getter get, const void* context);

/// Throws dtype_error when `type`, or invalid_argument_error when `op`, lies past the
/// last value of its enum (cast from an integer): they index kernel tables.
void check_dtype_and_op(dtype type, reduce_op op);

/// check_overlaps over the buffers of a single call.
void check_overlaps(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out);

}  // namespace distvals::detail
