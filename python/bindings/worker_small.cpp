// distvals._core.worker_small_all_reduce: the steady state of a small all-reduce between
// MPI workers (distvals.mpi_collectives), in one native call.
//
// A training loop makes the same small all-reduce every step. Once the workers have
// agreed on it, each repeat is five steps: the local replicas' arrays reduced into the
// call's flat buffer, the agreement flag written into its last element, the persistent
// MPI all-reduce request bound to that buffer started and tested until it completes, the
// flag read back, and the result copied out to every local replica (divided for MEAN).
// From Python each step is a call of its own, and together they cost more than the MPI
// exchange itself; here they are one call.
//
// MPI is not linked into distvals: the caller passes the addresses of MPI_Start and
// MPI_Test from the MPI library that mpi4py loaded, and the address of the request's
// handle inside mpi4py's Prequest. Both functions take only pointers (to the handle, to
// an int, to a status), so neither mpi.h nor the library's handle types are needed.
//
// Anything that is not this exact case returns 0 before any data moves or any MPI call
// is made; the Python path then does the same work.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

using mpi_start_fn = int (*)(void* request);
using mpi_test_fn = int (*)(void* request, int* flag, void* status);

// Outcomes other than a finished call (which returns the result arrays).
constexpr int kNotHere = 0;     // not this case: nothing done
constexpr int kPending = 1;     // started, not complete within the spin: the caller waits for it
constexpr int kDisagreed = 2;   // complete, but some worker's flag said its call was another

// The flag `value` in element `index` of `flat`, of an engine dtype that is not 16-bit.
void write_flag(distvals::dtype t, void* flat, std::size_t index, double value) {
  switch (t) {
    case distvals::dtype::float32: static_cast<float*>(flat)[index] = static_cast<float>(value); break;
    case distvals::dtype::float64: static_cast<double*>(flat)[index] = value; break;
    case distvals::dtype::int8: static_cast<std::int8_t*>(flat)[index] = static_cast<std::int8_t>(value); break;
    case distvals::dtype::uint8: static_cast<std::uint8_t*>(flat)[index] = static_cast<std::uint8_t>(value); break;
    case distvals::dtype::int32: static_cast<std::int32_t*>(flat)[index] = static_cast<std::int32_t>(value); break;
    case distvals::dtype::int64: static_cast<std::int64_t*>(flat)[index] = static_cast<std::int64_t>(value); break;
    default: break;  // 16-bit floats never reach here
  }
}

// Whether element `index` of `flat` still holds the flag `value` (every worker's agreed).
bool flag_is(distvals::dtype t, const void* flat, std::size_t index, double value) {
  switch (t) {
    case distvals::dtype::float32: return static_cast<const float*>(flat)[index] == static_cast<float>(value);
    case distvals::dtype::float64: return static_cast<const double*>(flat)[index] == value;
    case distvals::dtype::int8: return static_cast<const std::int8_t*>(flat)[index] == static_cast<std::int8_t>(value);
    case distvals::dtype::uint8: return static_cast<const std::uint8_t*>(flat)[index] == static_cast<std::uint8_t>(value);
    case distvals::dtype::int32: return static_cast<const std::int32_t*>(flat)[index] == static_cast<std::int32_t>(value);
    case distvals::dtype::int64: return static_cast<const std::int64_t*>(flat)[index] == static_cast<std::int64_t>(value);
    default: return false;
  }
}

// Whether `x` is a numpy array of exactly `like`'s dtype and shape that the kernels read
// as it is (C-contiguous, aligned), and writable when `writable`.
bool same_kind(PyObject* x, const py::array& like, bool writable) {
  const auto& api = py::detail::npy_api::get();
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(api.PyArray_Type_) || !engine_readable(x)) return false;
  const auto* a = py::detail::array_proxy(x);
  const auto* b = py::detail::array_proxy(like.ptr());
  if (writable && !(a->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) return false;
  if (a->nd != b->nd) return false;
  for (int d = 0; d < a->nd; ++d) {
    if (a->dimensions[d] != b->dimensions[d]) return false;
  }
  return a->descr == b->descr || api.PyArray_EquivTypes_(a->descr, b->descr);
}

py::object worker_small_all_reduce(const py::list& ins, const py::array& data, const py::array& flat,
                                   const py::object& outs, const py::handle& op, int mean_divisor, double agree,
                                   std::uintptr_t request, std::uintptr_t start, std::uintptr_t test,
                                   double spin_seconds) {
  const auto not_here = py::int_(kNotHere);
  // 1. The case, checked before anything moves: n arrays of data's dtype and shape, data
  // the front of flat (one more element, the flag's), an engine dtype and op, and outs
  // (when given) n writable arrays of the same kind.
  const auto n = static_cast<int>(ins.size());
  if (n < 1 || request == 0 || start == 0 || test == 0) return not_here;
  if (!engine_readable(flat.ptr()) || !engine_readable(data.ptr()) || data.data() != flat.data() ||
      flat.size() != data.size() + 1 || !(py::detail::array_proxy(flat.ptr())->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) {
    return not_here;
  }
  distvals::dtype t;
  try {
    t = to_dtype(flat.dtype(), 0);
  } catch (const py::type_error&) {
    return not_here;
  }
  distvals::reduce_op local_op;
  if (t == distvals::dtype::float16 || t == distvals::dtype::bfloat16 || !engine_op(op, local_op) ||
      local_op == distvals::reduce_op::mean || (mean_divisor > 0 && integral(t)) || mean_divisor < 0) {
    return not_here;
  }
  if (!py::detail::npy_api::get().PyArray_EquivTypes_(py::detail::array_proxy(data.ptr())->descr,
                                                       py::detail::array_proxy(flat.ptr())->descr)) {
    return not_here;
  }
  std::vector<const void*> srcs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    PyObject* x = PyList_GET_ITEM(ins.ptr(), r);
    if (!same_kind(x, data, false)) return not_here;
    srcs[static_cast<std::size_t>(r)] = py::detail::array_proxy(x)->data;
  }
  // The results: the caller's arrays, or new ones made now (before MPI starts, so that a
  // failed allocation leaves no started request behind).
  py::list results;
  if (outs.is_none()) {
    const std::vector<py::ssize_t> shape(data.shape(), data.shape() + data.ndim());
    results = py::list(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      results[static_cast<std::size_t>(r)] = result_array(data.dtype(), shape, static_cast<std::size_t>(data.size()));
    }
  } else {
    if (!PyList_CheckExact(outs.ptr()) || PyList_GET_SIZE(outs.ptr()) != n) return not_here;
    for (int r = 0; r < n; ++r) {
      if (!same_kind(PyList_GET_ITEM(outs.ptr(), r), data, true)) return not_here;
    }
    results = py::reinterpret_borrow<py::list>(outs);
  }
  std::vector<void*> dsts(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) dsts[static_cast<std::size_t>(r)] = py::detail::array_proxy(PyList_GET_ITEM(results.ptr(), r))->data;
  const auto count = static_cast<std::size_t>(data.size());
  void* buf = py::detail::array_proxy(flat.ptr())->data;
  void* req = reinterpret_cast<void*>(request);
  // 2. The local replicas' arrays reduced into the flat buffer (one array: copied).
  distvals::reduce_on_caller(t, local_op, srcs.data(), n, &buf, 1, count);
  // 3. The flag behind the data: "my call is the expected one".
  write_flag(t, buf, count, agree);
  // 4. The request started and tested, without the GIL (a Python MPI op, float MIN or
  // MAX, takes it back inside MPI_Test), for at most spin_seconds: a small all-reduce
  // between workers that each have a core completes within microseconds; a longer wait
  // goes back to the caller's polling, which yields the core and honours the timeout.
  int rc = 0;
  int done = 0;
  bool started = false;
  {
    alignas(16) unsigned char status[256];  // any MPI's MPI_Status fits (Open MPI: 24 bytes)
    nogil released;
    rc = reinterpret_cast<mpi_start_fn>(start)(req);
    if (rc == 0) {
      started = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin_seconds);
      do {
        rc = reinterpret_cast<mpi_test_fn>(test)(req, &done, status);
      } while (rc == 0 && !done && std::chrono::steady_clock::now() < until);
    }
  }
  if (rc != 0) {
    throw std::runtime_error(std::string(started ? "MPI_Test" : "MPI_Start") +
                             " of the small all-reduce's persistent request failed with MPI error code " +
                             std::to_string(rc));
  }
  if (!done) return py::int_(kPending);
  // 5. Every worker's flag agreed: the result out to every replica (divided for MEAN).
  if (!flag_is(t, buf, count, agree)) return py::int_(kDisagreed);
  const void* reduced = buf;
  distvals::reduce_on_caller(t, mean_divisor > 0 ? distvals::reduce_op::mean : distvals::reduce_op::sum, &reduced, 1,
                             dsts.data(), n, count, mean_divisor);
  return std::move(results);
}

// reduce_into(srcs, dsts, op): every dsts[d] = srcs[0] op srcs[1] op ... in one pass on
// the calling thread, without the GIL. The exchanges of large all-reduces between
// workers (distvals.mpi_exchanges) end each piece with the local replicas' values and
// the piece received from the other workers reduced straight into every local replica's
// result; numpy would take a pass per operand and another per copy. False, with nothing
// written, when an array is not an ndarray the kernels read as it is (C-contiguous,
// aligned, a writable destination) or the arrays differ in dtype or shape, or op is not
// one the kernels apply element by element (MEAN). `cached`: the results stay in the
// cache (plain stores, block by block), for results that are sent on at once; otherwise
// the kernels write large results that alias no source past the cache.
bool reduce_into(const py::list& srcs, const py::list& dsts, const py::handle& op, bool cached) {
  const auto ns = static_cast<int>(srcs.size());
  const auto nd = static_cast<int>(dsts.size());
  distvals::reduce_op o;
  if (ns < 1 || nd < 1 || !engine_op(op, o) || o == distvals::reduce_op::mean) return false;
  // Every array of the first one's kind (same_kind), and that kind one the kernels take.
  PyObject* first = PyList_GET_ITEM(srcs.ptr(), 0);
  if (!py::isinstance<py::array>(first)) return false;
  const auto like = py::reinterpret_borrow<py::array>(first);
  distvals::dtype t;
  try {
    t = to_dtype(like.dtype(), 0);
  } catch (const py::type_error&) {
    return false;
  }
  const auto count = static_cast<std::size_t>(like.size());
  std::vector<const void*> in(static_cast<std::size_t>(ns));
  std::vector<void*> out(static_cast<std::size_t>(nd));
  for (int i = 0; i < ns; ++i) {
    PyObject* x = PyList_GET_ITEM(srcs.ptr(), i);
    if (!same_kind(x, like, false)) return false;
    in[static_cast<std::size_t>(i)] = py::detail::array_proxy(x)->data;
  }
  for (int i = 0; i < nd; ++i) {
    PyObject* x = PyList_GET_ITEM(dsts.ptr(), i);
    if (!same_kind(x, like, true)) return false;
    out[static_cast<std::size_t>(i)] = py::detail::array_proxy(x)->data;
  }
  nogil released;
  if (!cached) {
    distvals::reduce_on_caller(t, o, in.data(), ns, out.data(), nd, count);
    return true;
  }
  // Blocks whose results together stay far below the size from which the kernels stream
  // (an eighth of the last-level cache, at least 1 MiB): 256 KiB of results per call.
  const std::size_t size = distvals::dtype_size(t);
  const std::size_t block = std::max<std::size_t>(2048, (256u << 10) / (size * static_cast<std::size_t>(nd)));
  std::vector<const void*> bin(in.size());
  std::vector<void*> bout(out.size());
  for (std::size_t lo = 0; lo < count; lo += block) {
    const std::size_t offset = lo * size;
    for (std::size_t i = 0; i < in.size(); ++i) bin[i] = static_cast<const char*>(in[i]) + offset;
    for (std::size_t i = 0; i < out.size(); ++i) bout[i] = static_cast<char*>(out[i]) + offset;
    distvals::reduce_on_caller(t, o, bin.data(), ns, bout.data(), nd, std::min(block, count - lo));
  }
  return true;
}

}  // namespace

void register_worker_small(py::module_& m) {
  m.def("reduce_into", &reduce_into, py::arg("srcs"), py::arg("dsts"), py::arg("op"), py::arg("cached") = false,
        "Every array of `dsts` set to the arrays of `srcs` reduced with `op` (a ReduceOp other "
        "than MEAN), in one pass on the calling thread without the GIL. False, with nothing "
        "written, when an array is not a C-contiguous aligned ndarray (a writable one in "
        "`dsts`) or the arrays differ in dtype or shape. A destination may be a source. `cached`: "
        "plain stores, leaving the results in the cache (large results that alias no source are "
        "otherwise written past it).");
  m.def("worker_small_all_reduce", &worker_small_all_reduce, py::arg("ins"), py::arg("data"), py::arg("flat"),
        py::arg("outs"), py::arg("op"), py::arg("mean_divisor"), py::arg("agree"), py::arg("request"),
        py::arg("start"), py::arg("test"), py::arg("spin_seconds"),
        "The steady state of a small all-reduce between MPI workers in one call: the arrays `ins` "
        "reduced with `op` into `flat` (whose front is `data`), the flag `agree` in its last element, "
        "the persistent MPI request at address `request` started with MPI_Start and tested with "
        "MPI_Test (function addresses `start`, `test`) for at most `spin_seconds`, then `data` out "
        "to `outs` (or new arrays), divided by `mean_divisor` when it is positive. Returns the "
        "result arrays; 0 when the arguments are not this case (nothing done), 1 when the request "
        "is still running (the caller waits for it), 2 when a worker's flag disagreed.");
}

}  // namespace distvals_py
