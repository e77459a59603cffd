// distvals._core.WorkerSmallPlan: the steady state of a small all-reduce between MPI
// workers (distvals.mpi_collectives), in one native call.
//
// A training loop makes the same small all-reduce every step. Once the workers have
// agreed on it, each repeat is five steps: the local replicas' arrays reduced into the
// call's flat buffer, the agreement flag written into its last element, the persistent
// MPI all-reduce request bound to that buffer started and tested until it completes, the
// flag read back, and the result copied out to every local replica (divided for MEAN).
// From Python each step is a call of its own, and together they cost more than the MPI
// exchange itself; here they are one call, on a plan made once per kind of call, so that
// a repeat converts two arguments and checks only the replicas' arrays.
//
// MPI is not linked into distvals: the caller passes the addresses of MPI_Start and
// MPI_Test from the MPI library that mpi4py loaded, and the address of the request's
// handle inside mpi4py's Prequest. Both functions take only pointers (to the handle, to
// an int, to a status), so neither mpi.h nor the library's handle types are needed.
//
// Arrays that are not this exact case return 0 before any data moves or any MPI call is
// made; the Python path then does the same work.
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

// The steady state of one kind of small all-reduce (one dtype, shape and op, the same
// number of local replicas), bound once to its buffers and its persistent request, so
// that a repeat checks only the arrays it is given: everything that holds for every
// repeat (the dtype and op the kernels take, the data view at the front of the flat
// buffer, the request and MPI's functions) is checked when the plan is made.
class small_plan {
 public:
  small_plan(py::array data, py::array flat, const py::object& op, const py::handle& local_op, int replicas,
             int mean_divisor, double agree, std::uintptr_t request, std::uintptr_t start, std::uintptr_t test,
             double spin_seconds)
      : data_(std::move(data)),
        flat_(std::move(flat)),
        op_(op),
        replicas_(replicas),
        mean_divisor_(mean_divisor),
        agree_(agree),
        request_(request),
        start_(reinterpret_cast<mpi_start_fn>(start)),
        test_(reinterpret_cast<mpi_test_fn>(test)),
        spin_(spin_seconds) {
    // Each refusal names what is not this case; the caller then keeps the Python path.
    if (replicas < 1) throw py::value_error("a small plan needs at least one replica, not " + std::to_string(replicas));
    if (request == 0 || start == 0 || test == 0) throw py::value_error("a small plan needs a request, MPI_Start and MPI_Test");
    if (!engine_readable(flat_.ptr()) || !engine_readable(data_.ptr()) ||
        !(py::detail::array_proxy(flat_.ptr())->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) {
      throw py::value_error("a small plan's buffers must be C-contiguous, aligned and writable");
    }
    if (data_.data() != flat_.data() || flat_.size() != data_.size() + 1 ||
        !py::detail::npy_api::get().PyArray_EquivTypes_(py::detail::array_proxy(data_.ptr())->descr,
                                                          py::detail::array_proxy(flat_.ptr())->descr)) {
      throw py::value_error("a small plan's data must be its flat buffer but the last element, of one dtype");
    }
    type_ = to_dtype(flat_.dtype(), 0);  // TypeError for a dtype the engine lacks
    if (type_ == distvals::dtype::float16 || type_ == distvals::dtype::bfloat16) {
      throw py::value_error("a small plan does not take 16-bit floats (their flag cannot be written exactly)");
    }
    if (!engine_op(local_op, local_op_) || local_op_ == distvals::reduce_op::mean) {
      throw py::value_error("a small plan's local op must be an op the kernels apply element by element");
    }
    if (mean_divisor < 0 || (mean_divisor > 0 && integral(type_))) {
      throw py::value_error("a small plan divides float results only, by a positive count");
    }
    count_ = static_cast<std::size_t>(data_.size());
    shape_.assign(data_.shape(), data_.shape() + data_.ndim());
    srcs_.resize(static_cast<std::size_t>(replicas));
    dsts_.resize(static_cast<std::size_t>(replicas));
  }

  // The call `op` over `ins` (one array per local replica), into `outs` (as many
  // writable arrays) or new arrays: the result arrays, or a code (see kNotHere).
  py::object arrays(const py::handle& op, const py::handle& ins, const py::handle& outs) {
    if (!ready(op) || !PyList_CheckExact(ins.ptr()) || PyList_GET_SIZE(ins.ptr()) != replicas_) return not_here();
    for (int r = 0; r < replicas_; ++r) {
      if (!take_source(r, PyList_GET_ITEM(ins.ptr(), r))) return not_here();
    }
    py::list results;
    if (outs.is_none()) {
      results = new_results();
    } else {
      if (!PyList_CheckExact(outs.ptr()) || PyList_GET_SIZE(outs.ptr()) != replicas_) return not_here();
      for (int r = 0; r < replicas_; ++r) {
        PyObject* o = PyList_GET_ITEM(outs.ptr(), r);
        if (!same_kind(o, data_, true)) return not_here();
        dsts_[static_cast<std::size_t>(r)] = py::detail::array_proxy(o)->data;
      }
      results = py::reinterpret_borrow<py::list>(outs);
    }
    const int code = run();
    if (code != kDone) return py::int_(code);
    return std::move(results);
  }

  // The same over `rows` (a list per local replica holding its one array, as the
  // collectives' all_reduce takes them), into new arrays, each in a list of its own.
  py::object rows(const py::handle& op, const py::handle& rows) {
    if (!ready(op) || !PyList_CheckExact(rows.ptr()) || PyList_GET_SIZE(rows.ptr()) != replicas_) return not_here();
    for (int r = 0; r < replicas_; ++r) {
      PyObject* row = PyList_GET_ITEM(rows.ptr(), r);
      PyObject* x = nullptr;
      if (PyList_CheckExact(row) && PyList_GET_SIZE(row) == 1) {
        x = PyList_GET_ITEM(row, 0);
      } else if (PyTuple_CheckExact(row) && PyTuple_GET_SIZE(row) == 1) {
        x = PyTuple_GET_ITEM(row, 0);
      }
      if (x == nullptr || !take_source(r, x)) return not_here();
    }
    const py::list results = new_results();
    const int code = run();
    if (code != kDone) return py::int_(code);
    py::list out(static_cast<std::size_t>(replicas_));
    for (int r = 0; r < replicas_; ++r) {
      py::list row(1);
      PyObject* x = PyList_GET_ITEM(results.ptr(), r);
      Py_INCREF(x);
      PyList_SET_ITEM(row.ptr(), 0, x);
      PyList_SET_ITEM(out.ptr(), r, row.release().ptr());
    }
    return std::move(out);
  }

  // The request is about to be freed: every later call is not this case.
  void close() noexcept { request_ = 0; }
  bool closed() const noexcept { return request_ == 0; }
  const py::array& data() const noexcept { return data_; }

 private:
  static constexpr int kDone = -1;

  static py::object not_here() { return py::int_(kNotHere); }
  bool ready(const py::handle& op) const noexcept { return request_ != 0 && op.ptr() == op_.ptr(); }

  // Replica r's array, if it is of the plan's kind.
  bool take_source(int r, PyObject* x) {
    if (!same_kind(x, data_, false)) return false;
    srcs_[static_cast<std::size_t>(r)] = py::detail::array_proxy(x)->data;
    return true;
  }

  // New result arrays, made before MPI starts (a failed allocation leaves no started
  // request behind), and their memory as the destinations.
  py::list new_results() {
    py::list results(static_cast<std::size_t>(replicas_));
    const auto& api = py::detail::npy_api::get();
    PyObject* descr = py::detail::array_proxy(data_.ptr())->descr;
    const bool pooled = count_ * static_cast<std::size_t>(data_.itemsize()) >= pool_min_bytes;
    for (int r = 0; r < replicas_; ++r) {
      py::object a;
      if (pooled) {
        a = result_array(data_.dtype(), shape_, count_);
      } else {
        // numpy's own constructor, straight from the kind's descr and shape: a small
        // result is made every repeat, and the general constructor costs more than the
        // reduction of its kilobyte.
        Py_INCREF(descr);  // the constructor takes a reference, even when it fails
        PyObject* made = api.PyArray_NewFromDescr_(api.PyArray_Type_, descr, static_cast<int>(shape_.size()),
                                                   shape_.data(), nullptr, nullptr, 0, nullptr);
        if (made == nullptr) throw py::error_already_set();
        a = py::reinterpret_steal<py::object>(made);
      }
      dsts_[static_cast<std::size_t>(r)] = py::detail::array_proxy(a.ptr())->data;
      PyList_SET_ITEM(results.ptr(), r, a.release().ptr());
    }
    return results;
  }

  // Steps 2 to 5 of the call, with the sources and destinations taken: kDone when the
  // results are written, else the code for the caller.
  int run() {
    void* buf = py::detail::array_proxy(flat_.ptr())->data;
    void* req = reinterpret_cast<void*>(request_);
    // 2. The local replicas' arrays reduced into the flat buffer (one array: copied).
    distvals::reduce_on_caller(type_, local_op_, srcs_.data(), replicas_, &buf, 1, count_);
    // 3. The flag behind the data: "my call is the expected one".
    write_flag(type_, buf, count_, agree_);
    // 4. The request started and tested, without the GIL (a Python MPI op, float MIN or
    // MAX, takes it back inside MPI_Test), for at most spin_ seconds: a small all-reduce
    // between workers that each have a core completes within microseconds; a longer wait
    // goes back to the caller's polling, which yields the core and honours the timeout.
    int rc = 0;
    int done = 0;
    bool started = false;
    {
      alignas(16) unsigned char status[256];  // any MPI's MPI_Status fits (Open MPI: 24 bytes)
      nogil released;
      rc = start_(req);
      if (rc == 0) {
        started = true;
        const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin_);
        do {
          rc = test_(req, &done, status);
        } while (rc == 0 && !done && std::chrono::steady_clock::now() < until);
      }
    }
    if (rc != 0) {
      throw std::runtime_error(std::string(started ? "MPI_Test" : "MPI_Start") +
                               " of the small all-reduce's persistent request failed with MPI error code " +
                               std::to_string(rc));
    }
    if (!done) return kPending;
    // 5. Every worker's flag agreed: the result out to every replica (divided for MEAN).
    if (!flag_is(type_, buf, count_, agree_)) return kDisagreed;
    const void* reduced = buf;
    distvals::reduce_on_caller(type_, mean_divisor_ > 0 ? distvals::reduce_op::mean : distvals::reduce_op::sum,
                               &reduced, 1, dsts_.data(), replicas_, count_, mean_divisor_);
    return kDone;
  }

  py::array data_;
  py::array flat_;
  py::object op_;
  int replicas_;
  int mean_divisor_;
  double agree_;
  std::uintptr_t request_;
  mpi_start_fn start_;
  mpi_test_fn test_;
  double spin_;
  distvals::dtype type_ = distvals::dtype::float32;
  distvals::reduce_op local_op_ = distvals::reduce_op::sum;
  std::size_t count_ = 0;
  std::vector<py::ssize_t> shape_;
  std::vector<const void*> srcs_;
  std::vector<void*> dsts_;
};

// Whether two buffers of `bytes` bytes share memory without starting at one address.
bool partly_overlaps(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x != y && x < y + bytes && y < x + bytes;
}

// reduce_into(srcs, dsts, op): every dsts[d] = srcs[0] op srcs[1] op ... in one pass on
// the calling thread, without the GIL. The exchanges of large all-reduces between
// workers (distvals.mpi_exchanges) end each piece with the local replicas' values and
// the piece received from the other workers reduced straight into every local replica's
// result; numpy would take a pass per operand and another per copy. False, with nothing
// written, when an array is not an ndarray the kernels read as it is (C-contiguous,
// aligned, a writable destination) or the arrays differ in dtype or shape, or op is not
// one the kernels apply element by element (MEAN), or a destination overlaps a source
// or another destination without being it. `cached`: the results stay in the
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
  // A destination that overlaps a source or another destination without being it
  // would have elements overwritten before the kernels read them (they work block by
  // block): numpy's ufuncs, which buffer overlapping operands, take that case.
  const std::size_t bytes = count * distvals::dtype_size(t);
  for (std::size_t d = 0; d < out.size(); ++d) {
    for (const void* x : in) {
      if (partly_overlaps(out[d], x, bytes)) return false;
    }
    for (std::size_t e = 0; e < d; ++e) {
      if (partly_overlaps(out[d], out[e], bytes)) return false;
    }
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
        "`dsts`) or the arrays differ in dtype or shape, or a destination overlaps another array "
        "without being it. A destination may be a source. `cached`: "
        "plain stores, leaving the results in the cache (large results that alias no source are "
        "otherwise written past it).");
  py::class_<small_plan> plan(m, "WorkerSmallPlan",
                              "The steady state of one kind of small all-reduce between MPI workers, in one "
                              "native call per repeat (see distvals.mpi_collectives).");
  plan.def(py::init<py::array, py::array, const py::object&, const py::handle&, int, int, double, std::uintptr_t,
                    std::uintptr_t, std::uintptr_t, double>(),
           py::arg("data"), py::arg("flat"), py::arg("op"), py::arg("local_op"), py::arg("replicas"),
           py::arg("mean_divisor"), py::arg("agree"), py::arg("request"), py::arg("start"), py::arg("test"),
           py::arg("spin_seconds"),
           "Binds the call `op` of `replicas` local arrays of `data`'s dtype and shape: reduced with "
           "`local_op` into `flat` (whose front is `data`), the flag `agree` in its last element, the "
           "persistent MPI request at address `request` started with MPI_Start and tested with MPI_Test "
           "(function addresses `start`, `test`) for at most `spin_seconds`, then `data` out to every "
           "replica, divided by `mean_divisor` when it is positive. ValueError (TypeError for a dtype "
           "the engine lacks), naming what, when the call is not one the plan makes.");
  plan.def("arrays", &small_plan::arrays, py::arg("op"), py::arg("ins"), py::arg("outs"),
           "The call over `ins` (a list of one array per replica) into `outs` (a list of as many "
           "writable arrays) or new arrays (None). Returns the result arrays; 0 when the arguments "
           "are not the plan's call (nothing done), 1 when the request is still running (the caller "
           "waits for it), 2 when a worker's flag disagreed.");
  plan.def("rows", &small_plan::rows, py::arg("op"), py::arg("rows"),
           "The call over `rows` (a list per replica holding its one array) into new arrays, "
           "returned as a list per replica; the codes of `arrays` otherwise.");
  plan.def("close", &small_plan::close, "Every later call returns 0 (its request is being freed).");
  plan.def_property_readonly("closed", &small_plan::closed);
  plan.def_property_readonly("data", &small_plan::data,
                             "The front of the flat buffer, in the arrays' shape: after a call, the reduced data.");
  refuse_pickling(plan);
}

}  // namespace distvals_py
