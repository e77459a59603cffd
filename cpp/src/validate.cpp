// Argument checks shared by both call styles and every backend. Everything here runs before any data is
// touched, and every message names the replica and what was wrong.
#include "validate.hpp"

#include <algorithm>
#include <cstdint>
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
  // Kernels load and store whole elements (vectors of them), on every backend.
  if (want != 0 && reinterpret_cast<std::uintptr_t>(b.data) % dtype_size(b.type) != 0) {
    throw invalid_argument_error(who(replica) + ": " + which + " is not aligned to its " +
                                 std::to_string(dtype_size(b.type)) + "-byte " + dtype_name(b.type) +
                                 " elements (address " + std::to_string(reinterpret_cast<std::uintptr_t>(b.data)) +
                                 "); pass an aligned copy");
  }
  // Where the memory lives is the backend's check (executor::check_buffer).
}

// An enum value outside its enumerators (cast from an integer): refused, rather than a
// kernel or an operator picked by accident.
template <class E>
void check_enum(E value, E last, const char* what) {
  if (static_cast<unsigned>(value) > static_cast<unsigned>(last)) {
    throw invalid_argument_error(std::string(what) + " " + std::to_string(static_cast<unsigned>(value)) +
                                 " is not one of the " + std::to_string(static_cast<unsigned>(last) + 1) + " " +
                                 what + "s (0 to " + std::to_string(static_cast<unsigned>(last)) + ")");
  }
}

}  // namespace

void detail::check_dtype_and_op(dtype type, reduce_op op) {
  if (static_cast<unsigned>(type) >= static_cast<unsigned>(dtype_count)) {
    throw dtype_error("dtype " + std::to_string(static_cast<unsigned>(type)) + " is not one of the " +
                      std::to_string(dtype_count) + " dtypes (0 to " + std::to_string(dtype_count - 1) + ")");
  }
  check_enum(op, reduce_op::mean, "reduce op");
}

namespace {

// The call itself, the same for every replica: its enums, and sizes that fit in size_t.
void check_call(const call_desc& d, int n) {
  check_enum(d.kind, collective::reduce_scatter, "collective");
  detail::check_dtype_and_op(d.type, d.op);
  check_enum(d.algo, algorithm::direct, "algorithm");
  // The largest buffer of the call (all_gather's output holds n inputs) in bytes.
  const std::size_t factor = d.kind == collective::all_gather ? static_cast<std::size_t>(n) : 1;
  if (d.count > SIZE_MAX / dtype_size(d.type) / factor) {
    throw invalid_argument_error(std::string(collective_name(d.kind)) + " of " + std::to_string(d.count) + " " +
                                 dtype_name(d.type) + " elements" +
                                 (factor > 1 ? " from each of " + std::to_string(n) + " replicas" : "") +
                                 ": its size in bytes does not fit in size_t");
  }
}

}  // namespace

void validate_replica_buffers(const call_desc& d, int n, int r, const buffer_view& in,
                              const buffer_view& out) {
  check_call(d, n);
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

namespace detail {

void check_overlaps(const call_desc& d, int n, view_getter get, const void* context) {
  // Writes may not overlap any other buffer of the call, except that a replica's output
  // may be exactly its own input (in place). One sweep over the ranges sorted by start:
  // a range clashes with the written range reaching furthest so far, or, when it is
  // written itself, with any range reaching past its start.
  struct range {
    std::uintptr_t b, e;
    int replica;
    bool write;
  };
  thread_local std::vector<range> rs;  // kept between calls: no allocation on the hot path
  rs.clear();
  auto reads = [&](int r) { return d.kind != collective::broadcast || r == d.root; };
  auto writes = [&](int r) { return d.kind != collective::reduce || r == d.root; };
  for (int r = 0; r < n; ++r) {
    const buffer_view& in = get(context, r, false);
    const buffer_view& out = get(context, r, true);
    const auto ib = reinterpret_cast<std::uintptr_t>(in.data);
    const auto ob = reinterpret_cast<std::uintptr_t>(out.data);
    const bool same = ib == ob && in.bytes() == out.bytes();
    if (writes(r) && out.bytes() > 0) rs.push_back({ob, ob + out.bytes(), r, true});
    if (reads(r) && in.bytes() > 0 && !(same && writes(r))) rs.push_back({ib, ib + in.bytes(), r, false});
  }
  std::sort(rs.begin(), rs.end(), [](const range& a, const range& b) { return a.b < b.b; });
  const range* far_any = nullptr;    // the range reaching furthest so far
  const range* far_write = nullptr;  // the written range reaching furthest so far
  auto name = [](const range& r) {
    return std::string("replica ") + std::to_string(r.replica) + "'s " + (r.write ? "output" : "input");
  };
  for (const auto& c : rs) {
    const range* clash = nullptr;
    if (far_write && c.b < far_write->e) {
      clash = far_write;
    } else if (c.write && far_any && c.b < far_any->e) {
      clash = far_any;
    }
    if (clash) {
      throw invalid_argument_error(name(c) + " overlaps " + name(*clash) +
                                   "; every replica needs its own buffer (an output may only be "
                                   "exactly its own input, for in-place)");
    }
    if (!far_any || c.e > far_any->e) far_any = &c;
    if (c.write && (!far_write || c.e > far_write->e)) far_write = &c;
  }
}

void check_overlaps(const call_desc& desc, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  struct both {
    const std::vector<buffer_view>& in;
    const std::vector<buffer_view>& out;
  } views{in, out};
  check_overlaps(desc, static_cast<int>(in.size()),
                 [](const void* c, int r, bool output) -> const buffer_view& {
                   const auto& v = *static_cast<const both*>(c);
                   return output ? v.out[r] : v.in[r];
                 },
                 &views);
}

}  // namespace detail

}  // namespace distvals
