// Shared declarations of the pybind11 module distvals._core: one register_<area>
// function per file, called from module.cpp.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "distvals/distvals.hpp"

namespace distvals_py {

namespace py = pybind11;

void register_errors(py::module_& m);
void register_types(py::module_& m);
void register_group(py::module_& m);
void register_timing(py::module_& m);
void register_pool(py::module_& m);
void register_leaves(py::module_& m);
void register_meeting(py::module_& m);
void register_nest(py::module_& m);
void register_scope(py::module_& m);
void register_scheduler(py::module_& m);
void register_worker_small(py::module_& m);
void register_shuffle(py::module_& m);
void register_cuda(py::module_& m);  // the `cuda` submodule; only with DISTVALS_HAS_CUDA

/// Releases the GIL around blocking engine work, as py::gil_scoped_release does, but
/// safe at interpreter exit. A daemon thread that takes the GIL back once finalization
/// has begun is ended by CPython (before 3.14) with pthread_exit, whose forced unwind
/// through a destructor ends in std::terminate: the whole process aborts at exit. So
/// when the interpreter is finalizing, the thread parks instead, for good, as 3.14 does.
class nogil {
 public:
  nogil();
  ~nogil();
  nogil(const nogil&) = delete;
  nogil& operator=(const nogil&) = delete;

 private:
  PyThreadState* state_;
};

/// Whether the interpreter is shutting down (no thread but the finalizing one may take
/// the GIL any more).
bool finalizing();

/// The group options' interrupt hook: on the main thread, runs Python's pending signal
/// handlers; true (cancel the group) when one raised, which is kept for reraise_interrupt().
bool interrupted();

/// Raises what a signal handler raised during the last blocked call, if anything.
void raise_pending_interrupt();

/// Runs `call`, a single-call collective of `g`, without the GIL. After a timeout or an
/// abort the group is reset at once (nobody else is inside) and the error raised.
void run_single(distvals::group& g, const std::function<void()>& call);

/// On the main thread, raises again (sets as the Python error) what a signal handler
/// raised while a collective was blocked, or KeyboardInterrupt, and returns true; on
/// any other thread returns false and does nothing. Needs the GIL.
bool reraise_interrupt();

/// A replica's array as the engine sees it, after every check: C-contiguous, a
/// supported dtype, writable when `writable`. Throws ValueError/TypeError naming the
/// replica. Objects that are not numpy arrays go through distvals._convert first
/// (buffer protocol, DLPack), without copying.
py::array as_array(const py::handle& obj, int replica, bool writable, const char* role);

// numpy flags of an array the engine reads as it is: C-contiguous and aligned to its
// elements (anything else is copied first, or refused).
inline constexpr int engine_array_flags =
    py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
inline bool engine_readable(PyObject* array) {
  return (py::detail::array_proxy(array)->flags & engine_array_flags) == engine_array_flags;
}

/// The engine dtype of a numpy dtype; throws TypeError naming the replica.
distvals::dtype to_dtype(const py::dtype& dt, int replica);
/// Whether the engine dtype is an integer one (whose MEAN runs in float, elsewhere).
bool integral(distvals::dtype t);
/// The numpy dtype of an engine dtype (bfloat16 needs ml_dtypes).
py::dtype to_numpy(distvals::dtype t);

/// An array's shape as Python prints it: "(2, 3)", "(5,)", "()".
std::string shape_str(const py::array& a);

/// A view of the array's memory for the engine (no copy).
distvals::buffer_view view_of(const py::array& a, distvals::dtype t);

/// An uninitialized C-contiguous array of `count` elements of `dt` in `shape`, from the
/// host pool (see pool.cpp). Needs the GIL.
py::array pooled_array(const py::dtype& dt, const std::vector<py::ssize_t>& shape, std::size_t count);

/// Results below this many bytes are plain numpy arrays (numpy's own small-block cache
/// is cheaper than the pool's lock); larger ones come from the host pool, so that
/// repeated steps reuse pages that are already mapped. The Python paths use the same.
inline constexpr std::size_t pool_min_bytes = 4096;

/// A new uninitialized result array: pooled_array from pool_min_bytes up, else numpy's.
py::array result_array(const py::dtype& dt, const std::vector<py::ssize_t>& shape, std::size_t count);

/// A C-contiguous, writable array of `descr` in `shape` (`ndim` sizes) over `data`,
/// which `base` (an array) owns; made by numpy's constructor directly (a result leaf that
/// is a view of its pack is made once per leaf and replica every step). Needs the GIL.
py::object view_array(PyObject* descr, int ndim, const py::ssize_t* shape, void* data, const py::handle& base);

// The algorithm of a strategy's all-reduce of `type` with `op`: the one asked for, except
// that sums, means and products of float16 and bfloat16 always go direct, which combines
// every replica's element in float32 and rounds once. Ring and tree round each partial
// result to the dtype (see distvals/dtype.hpp), and a strategy's collectives promise
// float32 accumulation whatever implementation its options name.
inline distvals::algorithm strategy_algorithm(distvals::algorithm a, distvals::dtype type,
                                              distvals::reduce_op op) noexcept {
  const bool half = type == distvals::dtype::float16 || type == distvals::dtype::bfloat16;
  const bool rounds =
      op == distvals::reduce_op::sum || op == distvals::reduce_op::mean || op == distvals::reduce_op::prod;
  const bool partials = a == distvals::algorithm::ring || a == distvals::algorithm::tree;
  return half && rounds && partials ? distvals::algorithm::direct : a;
}

/// Makes instances of `cls`, which own native resources (threads, device memory), refuse
/// pickling and copying with a TypeError at every protocol: protocols 0 and 1 would
/// otherwise reach pybind11's constructor through copyreg, which aborts the process.
template <class Class>
void refuse_pickling(Class& cls) {
  cls.def("__reduce_ex__", [](const py::object& self, const py::object&) -> py::object {
    throw py::type_error("cannot pickle '" + std::string(py::str(py::type::of(self).attr("__name__"))) +
                         "' object: it owns native resources");
  });
}

/// The all-reduce of many leaves in one call (see leaves.cpp): rows[r][i] is leaf i of
/// replica r, every row as long. Returns a list per replica of its result leaves, or None
/// (nothing touched) when a leaf is not one the engine reduces as it is.
py::object all_reduce_rows(distvals::group& g, const std::vector<py::sequence>& rows, distvals::reduce_op op,
                           distvals::algorithm algo, std::size_t fuse_bytes, std::size_t bytes_per_pack,
                           const py::object& trace);

/// The engine op of a distvals.ReduceOp member (see meeting.cpp); false for anything else.
bool engine_op(const py::handle& op, distvals::reduce_op& out);

/// True when the two structures have the same nesting (see nest.cpp).
bool nest_same(PyObject* a, PyObject* b);
/// `structure` with its leaves replaced, in nest's order, by those of `flat` (see nest.cpp).
py::object nest_pack(const py::handle& structure, const py::handle& flat);

/// The named parameters of a function taking *args and **kwargs, in order, with their
/// defaults (an empty object: required).
struct parameters {
  const char* function;
  std::vector<const char*> names;
  std::vector<py::object> defaults;
};

/// Binds positional and keyword arguments to `p` as Python would: raises TypeError for
/// too many positional arguments, an unknown or repeated keyword, or a missing required
/// argument. Returns one object per parameter.
std::vector<py::object> bind_arguments(const parameters& p, const py::args& args, const py::kwargs& kwargs);

/// Parameter `index` of `p` as given (positionally or by keyword), or an empty handle.
py::handle find_argument(const parameters& p, std::size_t index, const py::args& args, const py::kwargs& kwargs);

/// A timeout in seconds from Python: None gives 0 (the group's own), a positive number
/// its value to the nanosecond (inf, or anything too large: no timeout). TypeError for
/// anything but a number (strings, bools), ValueError for NaN, zero and negatives.
std::chrono::nanoseconds to_timeout(const py::handle& seconds, const char* what = "timeout_seconds");

/// A timeout in seconds for Python (inf for no timeout).
double timeout_seconds(std::chrono::nanoseconds t);

/// A replica index (an int, not a bool) in [0, n); TypeError or ValueError otherwise.
int to_replica(const py::handle& obj, int n, const char* what = "replica");

/// What a Python exception says, for another replica's message: the message of a
/// TypeError or ValueError, "Type: message" for anything else.
std::string exception_text(const py::error_already_set& e);

}  // namespace distvals_py
