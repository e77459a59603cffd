// distvals._core.all_reduce_leaves: the all-reduce of a structure's leaves in one call.
//
// A training step all-reduces many arrays at once (the gradients of every layer). Leaf
// by leaf from Python, each leaf pays a pass through the interpreter and numpy (output
// arrays, checks, slices: several microseconds each on a virtual machine) and an engine
// call whose worker threads may have gone to sleep since the previous one. Here the
// leaves are checked and planned first, small leaves of one dtype are packed into one
// pooled buffer per replica (one engine call per pack, as tensor fusion does), large
// ones are reduced straight into pooled outputs, the GIL is released once for all of
// them, and the engine's workers linger between the calls instead of sleeping.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

using distvals::buffer_view;
using distvals::call_desc;
using distvals::collective;
using distvals::group;

// One leaf index across the replicas: its dtype, size and shape, and where its result
// goes. Its replicas' arrays and views are in the plan's flat vectors, at i * n + r: a
// structure's leaves are planned every step, and a vector per leaf and replica would cost
// an allocation each.
struct leaf {
  distvals::dtype type = distvals::dtype::float32;
  std::size_t count = 0;
  std::size_t dims = 0;    // where its shape starts in plan::dims
  int ndim = 0;
  int pack = -1;           // index of its pack, or -1: reduced on its own
  std::size_t offset = 0;  // elements before it in its pack
};

// Every leaf of every replica, checked.
struct plan {
  int n = 0;
  std::vector<leaf> leaves;
  std::vector<py::array> in;  // leaf i of replica r at i * n + r, C-contiguous; held while the engine reads
  std::vector<buffer_view> view;
  std::vector<py::ssize_t> dims;  // the leaves' shapes, one after another
  std::vector<py::ssize_t> shape(const leaf& l) const {
    const auto* d = dims.data() + l.dims;
    return {d, d + l.ndim};
  }
};

// Small leaves of one dtype reduced as one flat buffer per replica.
struct pack {
  distvals::dtype type = distvals::dtype::float32;
  std::size_t count = 0;
  std::vector<int> leaves;
  std::vector<py::array> buf;  // one pooled flat array per replica
};

// A batch of the group's collectives, open until destroyed: the workers keep spinning
// for the next call (see group::batch).
struct open_batch {
  group& g;
  explicit open_batch(group& grp) : g(grp) { g.batch(true); }
  ~open_batch() { g.batch(false); }
  open_batch(const open_batch&) = delete;
  open_batch& operator=(const open_batch&) = delete;
};

// Checks leaf `i` of every replica into the plan; false (nothing planned) when its dtype
// is not one the engine reduces as it is, or an integer MEAN (which runs in float32 or
// float64).
bool take_leaf(const std::vector<py::sequence>& rows, std::size_t i, distvals::reduce_op op, plan& p) {
  const int n = p.n;
  leaf& out = p.leaves[i];
  for (int r = 0; r < n; ++r) {
    const py::sequence& row = rows[static_cast<std::size_t>(r)];
    py::object x;
    if (PyList_CheckExact(row.ptr())) {
      if (static_cast<Py_ssize_t>(i) >= PyList_GET_SIZE(row.ptr())) return false;
      x = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(row.ptr(), static_cast<Py_ssize_t>(i)));
    } else {
      x = row[i];
    }
    // A plain ndarray only: a subclass (a masked array, whose mask the kernels would
    // drop) takes the general path, which knows what each one means.
    if (Py_TYPE(x.ptr()) != reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_)) return false;
    py::array a = py::reinterpret_borrow<py::array>(x);
    if (!engine_readable(a.ptr())) {
      a = py::array::ensure(a, engine_array_flags);  // a contiguous, aligned copy, as the engine needs
      if (!a) {
        // ensure() clears the error it met; for an array that can only be memory.
        PyErr_NoMemory();
        throw py::error_already_set();
      }
    }
    distvals::dtype t;
    try {
      t = to_dtype(a.dtype(), r);
    } catch (const py::type_error&) {
      return false;
    }
    if (r == 0) {
      if (op == distvals::reduce_op::mean && integral(t)) return false;
      out.type = t;
      out.dims = p.dims.size();
      out.ndim = static_cast<int>(a.ndim());
      p.dims.insert(p.dims.end(), a.shape(), a.shape() + a.ndim());
      out.count = static_cast<std::size_t>(a.size());
    } else {
      if (t != out.type) {
        throw py::type_error("all_reduce: leaf " + std::to_string(i) + " of replica " + std::to_string(r) +
                             " has dtype " + distvals::dtype_name(t) + ", replica 0's has " +
                             distvals::dtype_name(out.type));
      }
      if (a.ndim() != out.ndim || !std::equal(a.shape(), a.shape() + a.ndim(), p.dims.data() + out.dims)) {
        throw py::value_error("all_reduce: leaf " + std::to_string(i) + " of replica " + std::to_string(r) +
                              " has shape " + shape_str(a) + ", replica 0's has shape " +
                              shape_str(p.in[i * static_cast<std::size_t>(n)]));
      }
    }
    p.view.push_back(view_of(a, t));
    p.in.push_back(std::move(a));
  }
  return true;
}

// Assigns the small leaves to packs by dtype, in order of first appearance, each pack
// at most `bytes_per_pack` bytes (0: no limit), as the Python collectives do.
std::vector<pack> plan_packs(std::vector<leaf>& leaves, std::size_t fuse_bytes, std::size_t bytes_per_pack) {
  std::vector<pack> packs;
  std::vector<int> open;  // per dtype (by engine dtype number): the pack being filled, or -1
  open.assign(distvals::dtype_count, -1);
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    leaf& l = leaves[i];
    const std::size_t bytes = l.count * distvals::dtype_size(l.type);
    if (bytes > fuse_bytes) continue;
    int& p = open[static_cast<int>(l.type)];
    if (p >= 0 && bytes_per_pack > 0 &&
        (packs[static_cast<std::size_t>(p)].count * distvals::dtype_size(l.type) + bytes) > bytes_per_pack) {
      p = -1;
    }
    if (p < 0) {
      p = static_cast<int>(packs.size());
      packs.emplace_back();
      packs.back().type = l.type;
    }
    pack& k = packs[static_cast<std::size_t>(p)];
    l.pack = p;
    l.offset = k.count;
    k.count += l.count;
    k.leaves.push_back(static_cast<int>(i));
  }
  // A pack of one leaf would only add two copies: that leaf goes on its own.
  for (pack& k : packs) {
    if (k.leaves.size() == 1) {
      leaves[static_cast<std::size_t>(k.leaves[0])].pack = -1;
      k.leaves.clear();
      k.count = 0;
    }
  }
  return packs;
}

}  // namespace

py::object all_reduce_rows(group& g, const std::vector<py::sequence>& rows, distvals::reduce_op op,
                           distvals::algorithm algo, std::size_t fuse_bytes, std::size_t bytes_per_pack,
                           const py::object& trace) {
  const int n = g.size();
  const auto un = static_cast<std::size_t>(n);
  const std::size_t count = py::len(rows[0]);
  // 1. Check every leaf before any data moves.
  plan p;
  p.n = n;
  p.leaves.resize(count);
  p.in.reserve(count * un);
  p.view.reserve(count * un);
  for (std::size_t i = 0; i < count; ++i) {
    if (!take_leaf(rows, i, op, p)) return py::none();
  }
  std::vector<leaf>& leaves = p.leaves;
  // 2. Plan the packs and make every output (with the GIL: numpy arrays).
  std::vector<pack> packs = plan_packs(leaves, count > 1 ? fuse_bytes : 0, bytes_per_pack);
  for (pack& k : packs) {
    if (k.leaves.empty()) continue;
    const py::dtype dt = to_numpy(k.type);
    for (int r = 0; r < n; ++r) k.buf.push_back(result_array(dt, {static_cast<py::ssize_t>(k.count)}, k.count));
  }
  // The results of the leaves reduced on their own, leaf by leaf: outs[d * n + r] for
  // the d-th such leaf.
  std::vector<py::array> outs;
  for (std::size_t i = 0; i < count; ++i) {
    const leaf& l = leaves[i];
    if (l.pack >= 0) continue;
    // Each result in its replica's own spelling of the dtype (np.longlong stays longlong).
    for (std::size_t r = 0; r < un; ++r) outs.push_back(pooled_array(p.in[i * un + r].dtype(), p.shape(l), l.count));
  }
  // 3. Without the GIL: fill the packs, then one engine call per pack and per large
  // leaf, the workers lingering between them.
  run_single(g, [&]() {
    open_batch keep(g);
    std::vector<buffer_view> in(un);
    std::vector<buffer_view> out(un);
    for (pack& k : packs) {
      if (k.leaves.empty()) continue;
      const std::size_t size = distvals::dtype_size(k.type);
      for (std::size_t r = 0; r < un; ++r) {
        auto* dst = static_cast<char*>(k.buf[r].mutable_data());
        for (int i : k.leaves) {
          const leaf& l = leaves[static_cast<std::size_t>(i)];
          std::memcpy(dst + l.offset * size, p.view[static_cast<std::size_t>(i) * un + r].data, l.count * size);
        }
        out[r] = buffer_view{dst, k.count, k.type};
      }
      if (k.count == 0) continue;
      g.run(call_desc{collective::all_reduce, k.type, op, strategy_algorithm(algo, k.type, op), k.count, 0}, out, out);
    }
    std::size_t direct = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const leaf& l = leaves[i];
      if (l.pack >= 0) continue;
      for (std::size_t r = 0; r < un; ++r) {
        in[r] = p.view[i * un + r];
        out[r] = buffer_view{outs[direct * un + r].mutable_data(), l.count, l.type};
      }
      ++direct;
      if (l.count == 0) continue;  // nothing to reduce: the empty output is the result
      g.run(call_desc{collective::all_reduce, l.type, op, strategy_algorithm(algo, l.type, op), l.count, 0}, in, out);
    }
  });
  if (!trace.is_none()) {
    // (dtype name, elements) of each engine call, in the order made: for tests.
    for (const pack& k : packs) {
      if (k.count > 0) trace.attr("append")(py::make_tuple(distvals::dtype_name(k.type), k.count));
    }
    for (const leaf& l : leaves) {
      if (l.pack < 0 && l.count > 0) trace.attr("append")(py::make_tuple(distvals::dtype_name(l.type), l.count));
    }
  }
  // 4. The results, leaf by leaf: a packed leaf's is a view of its pack.
  py::list result(n);
  for (std::size_t r = 0; r < un; ++r) {
    py::list row(static_cast<py::ssize_t>(count));
    std::size_t direct = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const leaf& l = leaves[i];
      py::object x;
      if (l.pack < 0) {
        x = outs[direct++ * un + r];
      } else {
        const py::array& buf = packs[static_cast<std::size_t>(l.pack)].buf[r];
        auto* base = static_cast<char*>(const_cast<void*>(buf.data())) + l.offset * distvals::dtype_size(l.type);
        // Each result in its replica's own spelling of the dtype (np.longlong stays longlong).
        PyObject* descr = reinterpret_cast<PyObject*>(py::detail::array_proxy(p.in[i * un + r].ptr())->descr);
        x = view_array(descr, l.ndim, p.dims.data() + l.dims, base, buf);
      }
      PyList_SET_ITEM(row.ptr(), static_cast<Py_ssize_t>(i), x.release().ptr());
    }
    PyList_SET_ITEM(result.ptr(), static_cast<Py_ssize_t>(r), row.release().ptr());
  }
  return std::move(result);
}

namespace {

// Every replica's result of every leaf (new pooled arrays; a packed leaf's result is a
// view of its pack), as a list per replica; None when some leaf is not for this path.
py::object all_reduce_leaves(group& g, const py::sequence& leaves_in, const std::string& op_name,
                             const std::string& algo_name, std::size_t fuse_bytes, std::size_t bytes_per_pack,
                             const py::object& trace) {
  const int n = g.size();
  if (static_cast<int>(py::len(leaves_in)) != n) {
    throw py::value_error("all_reduce_leaves needs one list of leaves per replica: " + std::to_string(n) +
                          " expected, got " + std::to_string(py::len(leaves_in)));
  }
  const distvals::reduce_op op = distvals::parse_reduce_op(op_name);
  const distvals::algorithm algo = distvals::parse_algorithm(algo_name);
  std::vector<py::sequence> rows;
  rows.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    rows.push_back(py::reinterpret_borrow<py::sequence>(leaves_in[static_cast<std::size_t>(r)]));
    if (py::len(rows.back()) != py::len(rows[0])) {
      throw py::value_error("all_reduce_leaves: replica " + std::to_string(r) + " passes " +
                            std::to_string(py::len(rows.back())) + " leaves, replica 0 passes " +
                            std::to_string(py::len(rows[0])));
    }
  }
  return all_reduce_rows(g, rows, op, algo, fuse_bytes, bytes_per_pack, trace);
}

}  // namespace

void register_leaves(py::module_& m) {
  m.def("all_reduce_leaves", &all_reduce_leaves, py::arg("group"), py::arg("leaves"), py::arg("op"),
        py::arg("algorithm") = "auto", py::arg("fuse_bytes") = 32768, py::arg("bytes_per_pack") = 0,
        py::arg("trace") = py::none(),
        "All-reduce of many leaves in one call: leaves[r][i] is leaf i of replica r. Returns new arrays "
        "(results[r][i]); small leaves travel packed. None when a leaf's dtype is not reduced as it is "
        "(unsupported, or integer MEAN): the caller then takes another path. "
        "trace: a list that gets (dtype name, elements) for each engine call made.");
}

}  // namespace distvals_py
