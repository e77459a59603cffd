// Argument checks shared by both call styles. Everything here runs before any data is
// touched, and every message names the replica and what was wrong.
#include <string>

#include "distvals/error.hpp"
#include "distvals/group.hpp"

namespace distvals {
namespace {

std::string who(int replica) { return "replica " + std::to_string(replica); }

void check_type(const call_desc& d, int replica, const buffer_view& b, const char* which) {
  if (b.type != d.type) {
    throw dtype_error(who(replica) + ": " + which + " dtype " + dtype_name(b.type) +
                      " does not match the collective's dtype " + dtype_name(d.type));
  }
}

void check_count(int replica, const buffer_view& b, std::size_t want, const char* which) {
  if (b.count != want) {
    throw invalid_argument_error(who(replica) + ": " + which + " has " + std::to_string(b.count) +
                                 " elements, expected " + std::to_string(want));
  }
  if (want != 0 && b.data == nullptr) {
    throw invalid_argument_error(who(replica) + ": " + which + " is a null pointer");
  }
  if (!b.dev.is_cpu()) {
    throw invalid_argument_error(who(replica) + ": " + which + " lives on " + b.dev.str() +
                                 ", but this group runs on host memory");
  }
}

}  // namespace

void validate_replica_buffers(const call_desc& d, int n, int r, const buffer_view& in,
                              const buffer_view& out) {
  if (d.op == reduce_op::mean && !is_floating(d.type) &&
      (d.kind == collective::all_reduce || d.kind == collective::reduce ||
       d.kind == collective::reduce_scatter)) {
    throw dtype_error(std::string("reduce op 'mean' needs a floating dtype, got ") +
                      dtype_name(d.type) + " (use 'sum' and divide, or convert to float)");
  }
  if ((d.kind == collective::reduce || d.kind == collective::broadcast) && (d.root < 0 || d.root >= n)) {
    throw invalid_argument_error("root " + std::to_string(d.root) + " is out of range for " +
                                 std::to_string(n) + " replicas");
  }
  const std::size_t nn = static_cast<std::size_t>(n);
  switch (d.kind) {
    case collective::all_reduce:
      check_type(d, r, in, "input");
      check_type(d, r, out, "output");
      check_count(r, in, d.count, "input");
      check_count(r, out, d.count, "output");
      break;
    case collective::reduce:
      check_type(d, r, in, "input");
      check_count(r, in, d.count, "input");
      if (r == d.root) {
        check_type(d, r, out, "output");
        check_count(r, out, d.count, "output");
      }
      break;
    case collective::broadcast:
      if (r == d.root) {
        check_type(d, r, in, "input");
        check_count(r, in, d.count, "input");
      }
      check_type(d, r, out, "output");
      check_count(r, out, d.count, "output");
      break;
    case collective::all_gather:
      check_type(d, r, in, "input");
      check_type(d, r, out, "output");
      check_count(r, in, d.count, "input");
      check_count(r, out, d.count * nn, "output");
      break;
    case collective::reduce_scatter:
      check_type(d, r, in, "input");
      check_type(d, r, out, "output");
      if (d.count % nn != 0) {
        throw invalid_argument_error(who(r) + ": reduce_scatter input has " + std::to_string(d.count) +
                                     " elements, not a multiple of the " + std::to_string(n) +
                                     " replicas");
      }
      check_count(r, in, d.count, "input");
      check_count(r, out, d.count / nn, "output");
      break;
  }
}

}  // namespace distvals
