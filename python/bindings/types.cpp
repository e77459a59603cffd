// dtypes, ops, algorithms and devices: parsing helpers and numpy conversions.
#include <string>

#include "bindings.hpp"

namespace distvals_py {

namespace {

// dtype descriptors seen before, with the engine dtype each maps to. Every collective
// converts one dtype per array, and asking a descriptor for its kind, size and byte
// order goes through Python attributes with numpy 2: a handful of descriptors (the
// builtin ones, shared by every array of their type) answer from here instead. Each
// cached descriptor is kept alive by the reference held here, so its address cannot be
// reused by another. Used with the GIL held only.
struct dtype_cache {
  static constexpr int size = 8;
  PyObject* descr[size] = {};
  distvals::dtype type[size] = {};
  int next = 0;

  bool find(PyObject* d, distvals::dtype& out) const {
    for (int i = 0; i < size; ++i) {
      if (descr[i] == d) {
        out = type[i];
        return true;
      }
    }
    return false;
  }
  void add(PyObject* d, distvals::dtype t) {
    Py_INCREF(d);
    PyObject* old = descr[next];
    descr[next] = d;
    type[next] = t;
    next = (next + 1) % size;
    Py_XDECREF(old);
  }
};

// Leaked on purpose: released after the interpreter has finalized, it would decref
// without the GIL.
dtype_cache& known_dtypes() {
  static auto* cache = new dtype_cache();
  return *cache;
}

distvals::dtype to_dtype_slow(const py::dtype& dt, int replica);

}  // namespace

distvals::dtype to_dtype(const py::dtype& dt, int replica) {
  distvals::dtype t;
  if (known_dtypes().find(dt.ptr(), t)) return t;
  t = to_dtype_slow(dt, replica);  // throws for what the engine does not take
  known_dtypes().add(dt.ptr(), t);
  return t;
}

namespace {

distvals::dtype to_dtype_slow(const py::dtype& dt, int replica) {
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  const char order = dt.byteorder();
  auto where = [&]() { return std::string("replica ") + std::to_string(replica) + ": "; };
  if (order == '>') {
    throw py::type_error(where() + "big-endian dtype " + std::string(py::str(dt)) +
                         " is not supported; use the native byte order");
  }
  using distvals::dtype;
  if (kind == 'f') {
    if (size == 2) return dtype::float16;
    if (size == 4) return dtype::float32;
    if (size == 8) return dtype::float64;
  } else if (kind == 'i') {
    if (size == 1) return dtype::int8;
    if (size == 4) return dtype::int32;
    if (size == 8) return dtype::int64;
  } else if (kind == 'u') {
    if (size == 1) return dtype::uint8;
  } else if (size == 2 && std::string(py::str(dt.attr("name"))) == "bfloat16") {
    return dtype::bfloat16;
  }
  throw py::type_error(where() + "dtype " + std::string(py::str(dt)) +
                       " is not supported; supported: float16, bfloat16, float32, float64, int8, uint8, "
                       "int32, int64");
}

}  // namespace

py::dtype to_numpy(distvals::dtype t) {
  if (t == distvals::dtype::bfloat16) {
    return py::dtype::from_args(py::module_::import("ml_dtypes").attr("bfloat16"));
  }
  return py::dtype(distvals::dtype_name(t));
}

namespace {
// distvals._convert.as_host_array, once looked up (read and written under the GIL).
py::object* host_array_converter = nullptr;
}  // namespace

py::array as_array(const py::handle& obj, int replica, bool writable, const char* role) {
  auto where = [&]() { return std::string("replica ") + std::to_string(replica) + ": "; };
  // Not `py::array a;` then an assignment: pybind11's default array constructor makes a
  // new (empty) numpy array, a cost paid for every array of every collective.
  auto take = [&]() -> py::array {
    const auto* array_type = reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_);
    if (Py_TYPE(obj.ptr()) == array_type) return py::reinterpret_borrow<py::array>(obj);
    // Subclasses of ndarray (a masked array is refused there), buffer protocol and DLPack,
    // zero-copy; the Python helper knows the protocols.
    if (host_array_converter == nullptr) {
      // Set under the GIL, without a function-local static: the import may let another
      // thread take the GIL, and a thread blocked on a static's guard while holding the
      // GIL would deadlock the process. Two threads may both import; one keeps its own.
      py::object f = py::module_::import("distvals._convert").attr("as_host_array");
      // Leaked on purpose: a static py::object would be released after the interpreter
      // has finalized, without the GIL.
      if (host_array_converter == nullptr) host_array_converter = new py::object(std::move(f));
    }
    return (*host_array_converter)(obj, replica);
  };
  py::array a = take();
  const int flags = py::detail::array_proxy(a.ptr())->flags;
  if (!(flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_)) {
    throw py::value_error(where() + role + " is not C-contiguous (strides " +
                          std::string(py::str(a.attr("strides"))) +
                          "); pass numpy.ascontiguousarray(x), which copies, or a contiguous array");
  }
  if (!(flags & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) {
    throw py::value_error(where() + role + " is not aligned to its " + std::to_string(a.itemsize()) +
                          "-byte elements; pass numpy.require(x, requirements=['C', 'A']), which copies");
  }
  if (writable && !(flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) {
    throw py::value_error(where() + role + " is read-only, but the collective writes into it");
  }
  return a;
}

bool integral(distvals::dtype t) {
  using distvals::dtype;
  return t == dtype::int8 || t == dtype::uint8 || t == dtype::int32 || t == dtype::int64;
}

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    s += std::to_string(a.shape(i));
    if (a.ndim() == 1 || i + 1 < a.ndim()) s += i + 1 < a.ndim() ? ", " : ",";
  }
  return s + ")";
}

distvals::buffer_view view_of(const py::array& a, distvals::dtype t) {
  distvals::buffer_view v;
  v.data = const_cast<void*>(a.data());
  v.count = static_cast<std::size_t>(a.size());
  v.type = t;
  return v;
}

void register_types(py::module_& m) {
  m.def("dtype_names", []() {
    py::list out;
    for (int i = 0; i < distvals::dtype_count; ++i) out.append(distvals::dtype_name(static_cast<distvals::dtype>(i)));
    return out;
  }, "Names of the dtypes the engine reduces.");
  m.def("parse_device", [](const std::string& s) { return distvals::device::parse(s).str(); },
        "Canonical name ('CPU:1', 'GPU:0') of a device string; ValueError when it is not one.");
  m.def("parse_reduce_op", [](const std::string& s) { return std::string(distvals::reduce_op_name(distvals::parse_reduce_op(s))); });
  m.def("parse_algorithm", [](const std::string& s) { return std::string(distvals::algorithm_name(distvals::parse_algorithm(s))); });
  m.def("strategy_algorithm",
        [](const std::string& algo, const py::dtype& dt, const std::string& op) {
          return std::string(distvals::algorithm_name(
              strategy_algorithm(distvals::parse_algorithm(algo), to_dtype(dt, 0), distvals::parse_reduce_op(op))));
        },
        "The algorithm a strategy's all-reduce of this engine dtype with this op runs: the one named, "
        "except direct for float16/bfloat16 sums, means and products (float32 accumulation).");
  m.def("choose_algorithm", [](int n, std::size_t bytes) { return std::string(distvals::algorithm_name(distvals::choose_algorithm(n, bytes))); },
        "The all-reduce algorithm 'auto' uses for n replicas and this many bytes each.");
}

}  // namespace distvals_py
