// distvals._core.quick_all_reduce: the commonest meeting of a step, resolved in one call.
//
// Inside strategy.run, each inline replica that calls ctx.all_reduce(op, x) on one numpy
// array hands the scheduler a tuple (marker, op, x). When every replica has done so, the
// meeting is one all-reduce of the N arrays into N new ones. Checking the N tuples,
// making the outputs and calling the engine from Python costs a few microseconds, more
// than the engine's own call for small arrays; here it costs a pass over N tuples.
//
// Anything that is not this exact case (another request, another op on some replica, a
// dtype or shape that differs, a non-contiguous array, a dtype the engine does not
// reduce as it is) returns None before any data moves: the caller's general path then
// reduces it, or names the mismatch.
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

using distvals::buffer_view;
using distvals::call_desc;
using distvals::collective;
using distvals::group;

}  // namespace

// The engine op of a ReduceOp member, looked up once per member (members live as long as
// the interpreter, so their address identifies them; ReduceOp has five).
bool engine_op(const py::handle& op, distvals::reduce_op& out) {
  static PyObject* known[8] = {};
  static distvals::reduce_op known_op[8] = {};
  static int count = 0;
  for (int i = 0; i < count; ++i) {
    if (known[i] == op.ptr()) {
      out = known_op[i];
      return true;
    }
  }
  if (!py::hasattr(op, "engine_name")) return false;
  try {
    out = distvals::parse_reduce_op(py::str(op.attr("engine_name")).cast<std::string>());
  } catch (const std::exception&) {
    return false;
  }
  if (count < 8) {
    // Kept alive while it is remembered, so that its address cannot be reused.
    known[count] = op.inc_ref().ptr();
    known_op[count++] = out;
  }
  return true;
}

namespace {

// What steps 1 and 2 of a quick all-reduce make: the replicas' arrays, their new outputs,
// and the call that reduces the one into the other.
struct quick_call {
  std::vector<py::array> ins;
  std::vector<buffer_view> in_views;
  py::list outs;
  std::vector<buffer_view> out_views;
  py::object op;  // replica 0's ReduceOp member
  distvals::dtype type = distvals::dtype::float32;
  distvals::reduce_op engine_op = distvals::reduce_op::sum;
  std::size_t count = 0;
};

// Steps 1 and 2 of the meeting where each of n replicas all-reduces one array (see the
// file comment); false, with nothing made, when the requests are not all of that form.
bool prepare_quick(int n, const py::list& requests, const py::handle& marker, quick_call& q) {
  if (static_cast<int>(requests.size()) != n) return false;
  const PyTypeObject* array_type = reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_);
  q.ins.reserve(static_cast<std::size_t>(n));
  q.in_views.reserve(static_cast<std::size_t>(n));
  PyObject* op0 = nullptr;
  // 1. Every request is (marker, op, array) with replica 0's op, a C-contiguous numpy
  // array of replica 0's dtype and shape, of a dtype the engine reduces with that op.
  // (The arrays are held by q.ins, and each op by its request's tuple, while anything runs.)
  for (int r = 0; r < n; ++r) {
    PyObject* q_r = PyList_GET_ITEM(requests.ptr(), r);
    if (!PyTuple_CheckExact(q_r) || PyTuple_GET_SIZE(q_r) != 3 || PyTuple_GET_ITEM(q_r, 0) != marker.ptr()) {
      return false;
    }
    PyObject* op = PyTuple_GET_ITEM(q_r, 1);
    PyObject* x = PyTuple_GET_ITEM(q_r, 2);
    if (Py_TYPE(x) != array_type) return false;
    py::array a = py::reinterpret_borrow<py::array>(x);
    // Contiguous and aligned to its elements, as the engine reads it (else the general path copies it).
    if (!engine_readable(x)) return false;
    distvals::dtype t;
    try {
      t = to_dtype(a.dtype(), r);
    } catch (const py::type_error&) {
      return false;
    }
    if (r == 0) {
      op0 = op;
      q.type = t;
    } else {
      const py::array& a0 = q.ins[0];
      if (op != op0 || t != q.type || a.ndim() != a0.ndim()) return false;
      for (py::ssize_t d = 0; d < a.ndim(); ++d) {
        if (a.shape(d) != a0.shape(d)) return false;
      }
    }
    q.in_views.push_back(view_of(a, t));
    q.ins.push_back(std::move(a));
  }
  if (!engine_op(op0, q.engine_op)) return false;
  if (q.engine_op == distvals::reduce_op::mean && integral(q.type)) return false;  // float64 MEAN: the general path
  q.op = py::reinterpret_borrow<py::object>(op0);
  // 2. New outputs, one per replica, shaped as the inputs.
  const py::array& a0 = q.ins[0];
  const std::vector<py::ssize_t> shape(a0.shape(), a0.shape() + a0.ndim());
  q.count = static_cast<std::size_t>(a0.size());
  q.outs = py::list(static_cast<std::size_t>(n));
  q.out_views.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    // Each result in its replica's own spelling of the dtype (np.longlong stays longlong).
    const py::dtype dt = q.ins[static_cast<std::size_t>(r)].dtype();
    py::array o = result_array(dt, shape, q.count);
    q.out_views.push_back(view_of(o, q.type));
    q.outs[static_cast<std::size_t>(r)] = std::move(o);
  }
  return true;
}

py::object quick_all_reduce(group& g, const py::list& requests, const py::handle& marker,
                            const std::string& algo_name) {
  quick_call q;
  if (!prepare_quick(g.size(), requests, marker, q)) return py::none();
  // 3. One engine call, without the GIL.
  if (q.count > 0) {
    const call_desc d{collective::all_reduce, q.type, q.engine_op,
                      strategy_algorithm(distvals::parse_algorithm(algo_name), q.type, q.engine_op), q.count, 0};
    run_single(g, [&]() { g.run(d, q.in_views, q.out_views); });
  }
  return std::move(q.outs);
}

// The same meeting where something other than one engine group reduces the arrays (the
// hierarchical all-reduce of a worker among MPI workers): steps 1 and 2 here, then
// run(ins, op, outs) with the replicas' arrays, replica 0's ReduceOp and the new outputs.
py::object quick_all_reduce_with(const py::object& run, int n, const py::list& requests, const py::handle& marker) {
  quick_call q;
  if (n < 1 || !prepare_quick(n, requests, marker, q)) return py::none();
  py::list ins(q.ins.size());
  for (std::size_t r = 0; r < q.ins.size(); ++r) ins[r] = q.ins[r];
  run(ins, q.op, q.outs);
  return std::move(q.outs);
}

// The meeting where every replica all-reduces a structure of numpy arrays: requests[r]
// is (marker, op, structure, leaves) with `leaves` the structure's leaves. One call into
// the engine for all leaves of all replicas (all_reduce_rows); each replica's outcome is
// its result, packed as its own structure. None, before any data moves, when the
// requests are not all of that form with the same op and nesting, or some leaf is not one
// the engine reduces as it is, or the replicas' leaves differ in dtype or shape: the
// general path then reduces it or names what differs.
py::object quick_all_reduce_tree(group& g, const py::list& requests, const py::handle& marker,
                                 const std::string& algo_name, std::size_t fuse_bytes, std::size_t bytes_per_pack,
                                 const py::object& trace) {
  const int n = g.size();
  if (static_cast<int>(requests.size()) != n) return py::none();
  std::vector<py::sequence> rows;
  rows.reserve(static_cast<std::size_t>(n));
  std::vector<py::object> held;  // the requests, held while Python code (a key's comparison) runs
  held.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) held.push_back(requests[static_cast<std::size_t>(r)]);
  PyObject* q0 = held[0].ptr();
  for (int r = 0; r < n; ++r) {
    PyObject* q = held[static_cast<std::size_t>(r)].ptr();
    if (!PyTuple_CheckExact(q) || PyTuple_GET_SIZE(q) != 4 || PyTuple_GET_ITEM(q, 0) != marker.ptr()) {
      return py::none();
    }
    PyObject* leaves = PyTuple_GET_ITEM(q, 3);
    if (!PyList_CheckExact(leaves)) return py::none();
    if (r > 0) {
      // The same op object, the same nesting, as many leaves as replica 0.
      if (PyTuple_GET_ITEM(q, 1) != PyTuple_GET_ITEM(q0, 1) ||
          PyList_GET_SIZE(leaves) != PyList_GET_SIZE(PyTuple_GET_ITEM(q0, 3)) ||
          !nest_same(PyTuple_GET_ITEM(q0, 2), PyTuple_GET_ITEM(q, 2))) {
        return py::none();
      }
    }
    rows.push_back(py::reinterpret_borrow<py::sequence>(leaves));
  }
  distvals::reduce_op op;
  if (!engine_op(py::handle(PyTuple_GET_ITEM(q0, 1)), op)) return py::none();
  py::object out;
  try {
    out = all_reduce_rows(g, rows, op, distvals::parse_algorithm(algo_name), fuse_bytes, bytes_per_pack, trace);
  } catch (const py::type_error&) {
    return py::none();  // leaves of different dtypes: named by the general path
  } catch (const py::value_error&) {
    return py::none();  // or of different shapes
  }
  if (out.is_none()) return out;
  // Each replica's results packed as its own structure (a dict keeps its key order).
  for (int r = 0; r < n; ++r) {
    PyObject* row = PyList_GET_ITEM(out.ptr(), r);
    py::object packed = nest_pack(py::handle(PyTuple_GET_ITEM(held[static_cast<std::size_t>(r)].ptr(), 2)), py::handle(row));
    PyList_SetItem(out.ptr(), r, packed.release().ptr());  // in range: cannot fail
  }
  return out;
}

}  // namespace

void register_meeting(py::module_& m) {
  m.def("quick_all_reduce", &quick_all_reduce, py::arg("group"), py::arg("requests"), py::arg("marker"),
        py::arg("algorithm") = "auto",
        "The meeting where every replica all-reduces one array: requests[r] is the tuple (marker, op, array) "
        "of replica r (op a ReduceOp). Returns one new array per replica, or None, before any data moves, "
        "when the requests are not all of that form with the same op, dtype and shape (C-contiguous arrays "
        "of a dtype the engine reduces with that op).");
  m.def("quick_all_reduce_with", &quick_all_reduce_with, py::arg("run"), py::arg("n"), py::arg("requests"),
        py::arg("marker"),
        "quick_all_reduce's checks and new outputs for n replicas, reduced by run(ins, op, outs) (called with "
        "the GIL held; op is replica 0's ReduceOp) instead of one engine group. Returns the outputs, or None, "
        "before anything runs, when the requests are not all of quick_all_reduce's form.");
  m.def("quick_all_reduce_tree", &quick_all_reduce_tree, py::arg("group"), py::arg("requests"), py::arg("marker"),
        py::arg("algorithm"), py::arg("fuse_bytes"), py::arg("bytes_per_pack"), py::arg("trace") = py::none(),
        "The meeting where every replica all-reduces a structure of numpy arrays: requests[r] is "
        "(marker, op, structure, leaves). Returns each replica's result, packed as its structure, or "
        "None, before any data moves, when the requests differ in form, op, nesting, leaf dtypes or shapes. "
        "trace: as all_reduce_leaves'.");
}

}  // namespace distvals_py
