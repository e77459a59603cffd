// distvals._core.Group: the engine's group with numpy arrays in and out.
//
// Single-call methods take one array per replica; per-replica methods (replica_*) are
// called from N threads at once. Every blocking call releases the GIL. Everything is
// checked before the engine touches data, and errors name the replica.
#include <chrono>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

using distvals::buffer_view;
using distvals::call_desc;
using distvals::collective;
using distvals::group;

// The interpreter's main thread, the only one that runs Python signal handlers. Taken
// from threading.main_thread(), so importing the module from another thread is fine.
unsigned long main_thread_id = 0;

// What a signal handler raised during a blocked wait (KeyboardInterrupt for Ctrl-C, or
// whatever a custom handler raises), kept until the interrupted call unwinds and the
// exception translator raises it again. Only the main thread touches it, with the GIL.
py::error_already_set* pending_interrupt = nullptr;

}  // namespace

// Blocked waits call this every ~50 ms: on the main thread it lets Python run pending
// signal handlers, so Ctrl-C cancels a long collective instead of waiting it out.
bool interrupted() {
  if (PyThread_get_thread_ident() != main_thread_id || !Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  // A handler raised: keep its exception (this clears the error indicator, which must
  // be clear while the engine unwinds) and cancel the group.
  delete pending_interrupt;
  pending_interrupt = new py::error_already_set();
  return true;
}

namespace {

bool same_shape(const py::array& a, const py::array& b) {
  if (a.ndim() != b.ndim()) return false;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (a.shape(i) != b.shape(i)) return false;
  }
  return true;
}

// One array per replica, checked: count, contiguity, writability, dtype, shape.
struct arrays {
  std::vector<py::array> a;
  std::vector<buffer_view> v;
  distvals::dtype type = distvals::dtype::float32;
};

arrays collect(const group& g, const py::sequence& bufs, bool writable, const char* what) {
  const int n = g.size();
  if (static_cast<int>(py::len(bufs)) != n) {
    throw py::value_error(std::string(what) + " needs one array per replica: " + std::to_string(n) +
                          " expected, got " + std::to_string(py::len(bufs)));
  }
  arrays out;
  out.a.reserve(n);
  out.v.reserve(n);
  for (int r = 0; r < n; ++r) out.a.push_back(as_array(bufs[r], r, writable, "array"));
  out.type = to_dtype(out.a[0].dtype(), 0);
  for (int r = 0; r < n; ++r) {
    const distvals::dtype t = r == 0 ? out.type : to_dtype(out.a[r].dtype(), r);
    if (t != out.type) {
      throw py::type_error("replica " + std::to_string(r) + " has dtype " + distvals::dtype_name(t) +
                           ", replica 0 has " + distvals::dtype_name(out.type) + "; all replicas need the same dtype");
    }
    if (!same_shape(out.a[r], out.a[0])) {
      throw py::value_error("replica " + std::to_string(r) + " has shape " + shape_str(out.a[r]) +
                            ", replica 0 has shape " + shape_str(out.a[0]) + "; all replicas need the same shape");
    }
    out.v.push_back(view_of(out.a[r], t));
  }
  return out;
}

}  // namespace

// A collective on the main thread may complete although a signal handler raised while
// it waited (the data arrived in the same instant): the handler's exception is raised
// anyway, so Ctrl-C is never lost.
void raise_pending_interrupt() {
  if (reraise_interrupt()) throw py::error_already_set();
}

void run_single(distvals::group& g, const std::function<void()>& call) {
  // A failed single call leaves nobody of its own inside the group, so the group is
  // reset at once and stays usable (unless per-replica callers wait at the gate, which
  // then see the failure themselves).
  auto reset = [&]() {
    try {
      if (!g.closed()) g.reset();
    } catch (const std::logic_error&) {
    }
  };
  {
    nogil unlocked;
    try {
      call();
    } catch (const distvals::group_aborted_error&) {
      // Refused at the start: the group was failed by another call (an abort, a
      // timeout of per-replica callers), and stays so until the caller's reset().
      throw;
    } catch (const distvals::timeout_error&) {
      // Only this call's own failure is cleared: a call that timed out at the gate,
      // behind per-replica callers, failed nothing, and per-replica callers may be
      // inside (a reset would restart the call sequence under them).
      if (g.aborted()) reset();
      throw;
    } catch (const distvals::aborted_error&) {
      reset();
      throw;
    }
  }
  if (pending_interrupt != nullptr && PyThread_get_thread_ident() == main_thread_id) {
    // Completed, but the signal handler cancelled the group meanwhile: clear that as
    // after any failure.
    if (g.aborted()) reset();
    raise_pending_interrupt();
  }
}

namespace {

// Runs the single-call style without the GIL. A failed collective leaves nobody inside
// the group, so it is reset at once and stays usable.
void run_all(group& g, const call_desc& d, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  run_single(g, [&]() { g.run(d, in, out); });
}

py::array new_like(const py::array& a, distvals::dtype t, std::vector<py::ssize_t> shape) {
  return py::array(to_numpy(t), shape);
}

std::vector<py::ssize_t> shape_of(const py::array& a) {
  return std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim());
}

// Shape of an all-gathered array: concatenation along axis 0 (0-d parts become a vector).
std::vector<py::ssize_t> gathered_shape(const py::array& a, int n) {
  auto s = shape_of(a);
  if (s.empty()) return {static_cast<py::ssize_t>(n)};
  s[0] *= n;
  return s;
}

std::vector<py::ssize_t> scattered_shape(const py::array& a, int n, int replica) {
  auto s = shape_of(a);
  if (s.empty() || s[0] % n != 0) {
    throw py::value_error("replica " + std::to_string(replica) + ": reduce_scatter needs a first dimension divisible by " +
                          std::to_string(n) + " replicas, got shape " + shape_str(a));
  }
  s[0] /= n;
  return s;
}

// One replica's checked arguments of a per-replica call, and everything that keeps the
// memory of its buffers alive (arrays, buffer exports, DLPack owners) until the engine
// no longer touches it: a bytearray whose export is held cannot be resized meanwhile.
struct call_args {
  call_desc desc;
  buffer_view in, out;
  std::chrono::nanoseconds timeout{0};
  std::vector<std::int64_t> shape;
  std::vector<py::object> keep;
  py::object result = py::none();  // the new output array, for collectives that return one
};

std::vector<std::int64_t> shape_vector(const py::array& a) {
  return std::vector<std::int64_t>(a.shape(), a.shape() + a.ndim());
}

// The checked arguments of a collective that works in place on `x`.
call_args in_place_call(const py::array& x, distvals::dtype t, call_desc d, std::chrono::nanoseconds timeout) {
  call_args c;
  c.in = c.out = view_of(x, t);
  d.type = t;
  d.count = c.in.count;
  c.desc = d;
  c.timeout = timeout;
  c.shape = shape_vector(x);
  c.keep.push_back(x);
  return c;
}

// The checked arguments of a collective that reads `x` and returns a new array.
call_args new_output_call(const py::array& x, distvals::dtype t, call_desc d, std::vector<py::ssize_t> out_shape,
                          std::chrono::nanoseconds timeout) {
  call_args c = in_place_call(x, t, d, timeout);
  py::array out = new_like(x, t, std::move(out_shape));
  c.out = view_of(out, t);
  c.keep.push_back(out);
  c.result = out;
  return c;
}

// Per-replica call without the GIL.
void run_one(group& g, int replica, const call_args& c) {
  distvals::replica_options o;
  o.timeout = c.timeout;
  o.shape = c.shape.data();
  o.ndim = static_cast<int>(c.shape.size());
  {
    nogil unlocked;
    g.run(replica, c.desc, c.in, c.out, o);
  }
  raise_pending_interrupt();
}

// Tells the other replicas that this replica's arguments are invalid, so that each of
// them raises the error instead of waiting for a replica that never comes. Returns once
// they have all arrived (or on timeout, abort or close): the caller then raises its own
// error, which is more useful than anything this call could say.
void report_invalid(group& g, int replica, std::string why, bool type_error, std::chrono::nanoseconds t) {
  const std::string who = "replica " + std::to_string(replica);
  if (why.compare(0, who.size(), who) != 0) why = who + ": " + why;
  {
    nogil unlocked;
    try {
      g.report_invalid(replica, why, type_error, t);
    } catch (const std::exception&) {
    }
  }
  // A Ctrl-C while it waited is raised now, in place of the argument's error: otherwise
  // it would stay pending and surface from a later, successful call.
  raise_pending_interrupt();
}

// The protocol of every replica_* method:
//  step 1: find the calling replica; a call that names no valid replica cannot take part
//          in the meeting, so it aborts the collective (the others are released at once
//          with AbortedError) and raises its own TypeError or ValueError;
//  step 2: bind and check every other argument; whatever goes wrong (a wrong type, a
//          misspelt keyword, an exception raised by the array's own __dlpack__) is
//          reported to the other replicas, which raise it too, before it is raised here;
//  step 3: meet the others and run, without the GIL.
template <class Prepare>
py::object per_replica(group& g, const parameters& p, std::size_t timeout_index, const py::args& args,
                       const py::kwargs& kwargs, Prepare prepare) {
  int replica = -1;
  try {
    replica = to_replica(find_argument(p, 0, args, kwargs), g.size());
  } catch (py::error_already_set& e) {
    g.abort(-1, std::string("a ") + p.function + " call named no valid replica (" + exception_text(e) + ")");
    throw;
  } catch (const std::exception& e) {
    g.abort(-1, std::string("a ") + p.function + " call named no valid replica (" + e.what() + ")");
    throw;
  }
  auto timeout_for_report = [&]() {
    try {
      return to_timeout(find_argument(p, timeout_index, args, kwargs));
    } catch (py::error_already_set&) {
      return std::chrono::nanoseconds{0};  // the group's own, when the given one is bad too
    } catch (const std::exception&) {
      return std::chrono::nanoseconds{0};
    }
  };
  call_args c;
  try {
    c = prepare(replica, bind_arguments(p, args, kwargs));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_Exception)) {
      // Not a bad argument: Ctrl-C (or another BaseException) while the arguments were
      // read. The others are released as from an interrupted wait, with AbortedError
      // that names no replica, not with this replica's "invalid argument".
      g.abort(-1, std::string("a ") + p.function + " call of replica " + std::to_string(replica) +
                      " was interrupted (" + exception_text(e) + ")");
      throw;
    }
    report_invalid(g, replica, exception_text(e), e.matches(PyExc_TypeError), timeout_for_report());
    throw;
  } catch (const py::type_error& e) {
    report_invalid(g, replica, e.what(), true, timeout_for_report());
    throw;
  } catch (const distvals::dtype_error& e) {
    report_invalid(g, replica, e.what(), true, timeout_for_report());
    throw;
  } catch (const std::exception& e) {
    report_invalid(g, replica, e.what(), false, timeout_for_report());
    throw;
  }
  run_one(g, replica, c);
  return c.result;
}

// A str argument such as op="sum"; TypeError naming the parameter otherwise.
std::string text_argument(const py::object& v, const char* name) {
  if (!py::isinstance<py::str>(v)) {
    throw py::type_error(std::string(name) + " must be a string, got " +
                         std::string(py::str(py::type::handle_of(v).attr("__name__"))));
  }
  return v.cast<std::string>();
}

// The group's size from Python: an int in [1, max_group_size]; the CPU device names
// otherwise. Huge ints are a ValueError, not an overflow deep inside the cast.
int replica_count(const py::handle& devices) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(devices.ptr(), &overflow);
  if (overflow == 0 && v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow > 0 || v > distvals::max_group_size) {
    throw py::value_error("a group of " + std::string(py::str(devices)) + " replicas is too large (at most " +
                          std::to_string(distvals::max_group_size) + ")");
  }
  if (overflow < 0 || v < 1) {
    throw py::value_error("a group needs at least 1 replica, got " + std::string(py::str(devices)));
  }
  return static_cast<int>(v);
}

}  // namespace

bool reraise_interrupt() {
  if (pending_interrupt == nullptr || PyThread_get_thread_ident() != main_thread_id) return false;
  pending_interrupt->restore();
  delete pending_interrupt;
  pending_interrupt = nullptr;
  return true;
}

void register_group(py::module_& m) {
  main_thread_id = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  // Leaked on purpose: the defaults are Python objects, which must not be released after
  // the interpreter has finalized.
  // The per-replica methods take *args and **kwargs and bind them themselves (see
  // per_replica), so that every mistake in a call reaches the other replicas.
  static const parameters& all_reduce_params = *new parameters{
      "replica_all_reduce", {"replica", "array", "op", "algorithm", "timeout_seconds", "out"},
      {py::object(), py::object(), py::str("sum"), py::str("auto"), py::none(), py::none()}};
  static const parameters& all_gather_params = *new parameters{
      "replica_all_gather", {"replica", "array", "timeout_seconds"}, {py::object(), py::object(), py::none()}};
  static const parameters& broadcast_params = *new parameters{
      "replica_broadcast", {"replica", "array", "root", "timeout_seconds"},
      {py::object(), py::object(), py::int_(0), py::none()}};
  static const parameters& reduce_params = *new parameters{
      "replica_reduce", {"replica", "array", "root", "op", "timeout_seconds"},
      {py::object(), py::object(), py::int_(0), py::str("sum"), py::none()}};
  static const parameters& reduce_scatter_params = *new parameters{
      "replica_reduce_scatter", {"replica", "array", "op", "timeout_seconds"},
      {py::object(), py::object(), py::str("sum"), py::none()}};

  py::class_<group> group_class(m, "Group", "N local replicas that run collectives together (the C++ engine).");
  refuse_pickling(group_class);
  group_class
      .def(py::init([](const py::object& devices, const py::object& timeout_seconds, int threads,
                       std::size_t chunk_bytes, int spin_us) {
             distvals::group_options o;
             o.timeout = to_timeout(timeout_seconds);
             o.threads = threads;
             o.chunk_bytes = chunk_bytes;
             o.spin_us = spin_us;
             o.interrupted = &interrupted;
             if (PyLong_Check(devices.ptr()) && !PyBool_Check(devices.ptr())) {
               const int n = replica_count(devices);
               nogil unlocked;
               return new group(n, o);
             }
             std::vector<distvals::device> ds;
             for (auto d : devices) ds.push_back(distvals::device::parse(py::str(d)));
             return new group(ds, o);
           }),
           py::arg("devices"), py::arg("timeout_seconds") = py::none(), py::arg("threads") = 0,
           py::arg("chunk_bytes") = 0, py::arg("spin_us") = -1)
      .def_property_readonly("size", &group::size)
      .def_property_readonly("devices", [](const group& g) {
        py::list out;
        for (const auto& d : g.devices()) out.append(d.str());
        return out;
      })
      .def_property_readonly("timeout_seconds", [](const group& g) { return timeout_seconds(g.options().timeout); })
      .def_property_readonly("threads", [](const group& g) { return g.options().threads; })
      .def("set_linger_us", &group::set_linger_us, py::arg("us"),
           "Idle workers keep spinning this many more microseconds after a collective; returns the previous value.")
      .def("batch", &group::batch, py::arg("open"),
           "Opens (True) or closes a batch of back-to-back collectives, during which idle workers keep spinning; "
           "returns the number of batches open afterwards.")
      // ---- single-call style ------------------------------------------------------
      .def("all_reduce",
           [](group& g, const py::sequence& bufs, const std::string& op, const std::string& algo,
              const py::object& out) {
             const auto in = collect(g, bufs, out.is_none(), "all_reduce");
             const call_desc d{collective::all_reduce, in.type, distvals::parse_reduce_op(op),
                               distvals::parse_algorithm(algo), in.v[0].count, 0};
             if (out.is_none()) {
               run_all(g, d, in.v, in.v);
               return;
             }
             const auto o = collect(g, out, true, "all_reduce output");
             if (o.type != in.type || !same_shape(o.a[0], in.a[0])) {
               throw py::value_error("all_reduce: outputs must have the inputs' dtype and shape");
             }
             run_all(g, d, in.v, o.v);
           },
           py::arg("buffers"), py::arg("op") = "sum", py::arg("algorithm") = "auto", py::arg("out") = py::none())
      .def("reduce",
           [](group& g, const py::sequence& bufs, const py::object& root_obj, const std::string& op,
              const py::object& out) {
             const auto in = collect(g, bufs, false, "reduce");
             const int root = to_replica(root_obj, g.size(), "root");
             const call_desc d{collective::reduce, in.type, distvals::parse_reduce_op(op),
                               distvals::algorithm::direct, in.v[0].count, root};
             if (out.is_none()) {
               as_array(in.a[root], root, true, "root array");
               run_all(g, d, in.v, in.v);
               return;
             }
             // Out of place: only the root's result is written, into `out`; the other
             // replicas' outputs are never touched, so their inputs stand in for them.
             const py::array o = as_array(out, root, true, "reduce output");
             const distvals::dtype t = to_dtype(o.dtype(), root);
             if (t != in.type || !same_shape(o, in.a[0])) {
               throw py::value_error(std::string("reduce: out must have the inputs' dtype and shape (") +
                                     distvals::dtype_name(in.type) + " " + shape_str(in.a[0]) + "), got " +
                                     distvals::dtype_name(t) + " " + shape_str(o));
             }
             std::vector<buffer_view> ov = in.v;
             ov[static_cast<std::size_t>(root)] = view_of(o, t);
             run_all(g, d, in.v, ov);
           },
           py::arg("buffers"), py::arg("root") = 0, py::arg("op") = "sum", py::arg("out") = py::none())
      .def("broadcast",
           [](group& g, const py::sequence& bufs, const py::object& root_obj) {
             const auto in = collect(g, bufs, true, "broadcast");
             const int root = to_replica(root_obj, g.size(), "root");
             const call_desc d{collective::broadcast, in.type, distvals::reduce_op::sum, distvals::algorithm::direct,
                               in.v[0].count, root};
             run_all(g, d, in.v, in.v);
           },
           py::arg("buffers"), py::arg("root") = 0)
      .def("all_gather",
           [](group& g, const py::sequence& bufs) {
             const auto in = collect(g, bufs, false, "all_gather");
             std::vector<py::array> outs;
             std::vector<buffer_view> ov;
             for (int r = 0; r < g.size(); ++r) {
               outs.push_back(new_like(in.a[r], in.type, gathered_shape(in.a[r], g.size())));
               ov.push_back(view_of(outs.back(), in.type));
             }
             const call_desc d{collective::all_gather, in.type, distvals::reduce_op::sum, distvals::algorithm::direct,
                               in.v[0].count, 0};
             run_all(g, d, in.v, ov);
             py::list res;
             for (auto& o : outs) res.append(o);
             return res;
           },
           py::arg("buffers"))
      .def("reduce_scatter",
           [](group& g, const py::sequence& bufs, const std::string& op) {
             const auto in = collect(g, bufs, false, "reduce_scatter");
             std::vector<py::array> outs;
             std::vector<buffer_view> ov;
             for (int r = 0; r < g.size(); ++r) {
               outs.push_back(new_like(in.a[r], in.type, scattered_shape(in.a[r], g.size(), r)));
               ov.push_back(view_of(outs.back(), in.type));
             }
             const call_desc d{collective::reduce_scatter, in.type, distvals::parse_reduce_op(op),
                               distvals::algorithm::direct, in.v[0].count, 0};
             run_all(g, d, in.v, ov);
             py::list res;
             for (auto& o : outs) res.append(o);
             return res;
           },
           py::arg("buffers"), py::arg("op") = "sum")
      // ---- per-replica style: one thread per replica -----------------------------------
      .def("replica_all_reduce",
           [](group& g, const py::args& args, const py::kwargs& kwargs) {
             return per_replica(g, all_reduce_params, 4, args, kwargs, [&](int replica, std::vector<py::object> a) {
               call_desc d{collective::all_reduce};
               d.op = distvals::parse_reduce_op(text_argument(a[2], "op"));
               d.algo = distvals::parse_algorithm(text_argument(a[3], "algorithm"));
               const auto timeout = to_timeout(a[4]);
               py::array x = as_array(a[1], replica, a[5].is_none(), "array");
               const auto t = to_dtype(x.dtype(), replica);
               call_args c = in_place_call(x, t, d, timeout);
               if (!a[5].is_none()) {
                 // Out of place: the engine reads `array` and writes `out`, no copy first.
                 py::array b = as_array(a[5], replica, true, "out");
                 if (to_dtype(b.dtype(), replica) != t || !same_shape(x, b)) {
                   throw py::value_error("replica " + std::to_string(replica) + ": out has dtype " +
                                         std::string(py::str(b.dtype())) + " and shape " + shape_str(b) +
                                         ", the array has " + std::string(py::str(x.dtype())) + " and " +
                                         shape_str(x));
                 }
                 c.out = view_of(b, t);
                 c.keep.push_back(b);
               }
               return c;
             });
           },
           "replica_all_reduce(replica, array, op='sum', algorithm='auto', timeout_seconds=None, out=None)\n\n"
           "Replica `replica`'s part of an all-reduce, in place or into `out`; all replicas call it "
           "from their own threads.")
      .def("replica_all_gather",
           [](group& g, const py::args& args, const py::kwargs& kwargs) {
             return per_replica(g, all_gather_params, 2, args, kwargs, [&](int replica, std::vector<py::object> a) {
               const auto timeout = to_timeout(a[2]);
               py::array x = as_array(a[1], replica, false, "array");
               return new_output_call(x, to_dtype(x.dtype(), replica), call_desc{collective::all_gather},
                                      gathered_shape(x, g.size()), timeout);
             });
           },
           "replica_all_gather(replica, array, timeout_seconds=None)\n\n"
           "Replica `replica`'s part of an all-gather: a new array, every replica's array concatenated along axis 0.")
      .def("replica_broadcast",
           [](group& g, const py::args& args, const py::kwargs& kwargs) {
             return per_replica(g, broadcast_params, 3, args, kwargs, [&](int replica, std::vector<py::object> a) {
               const int root = to_replica(a[2], g.size(), "root");
               const auto timeout = to_timeout(a[3]);
               py::array x = as_array(a[1], replica, true, "array");
               call_desc d{collective::broadcast};
               d.root = root;
               return in_place_call(x, to_dtype(x.dtype(), replica), d, timeout);
             });
           },
           "replica_broadcast(replica, array, root=0, timeout_seconds=None)\n\n"
           "Replica `replica`'s part of a broadcast: `array` receives the root's array, in place.")
      .def("replica_reduce",
           [](group& g, const py::args& args, const py::kwargs& kwargs) {
             return per_replica(g, reduce_params, 4, args, kwargs, [&](int replica, std::vector<py::object> a) {
               const int root = to_replica(a[2], g.size(), "root");
               call_desc d{collective::reduce};
               d.op = distvals::parse_reduce_op(text_argument(a[3], "op"));
               d.root = root;
               const auto timeout = to_timeout(a[4]);
               py::array x = as_array(a[1], replica, replica == root, "array");
               return in_place_call(x, to_dtype(x.dtype(), replica), d, timeout);
             });
           },
           "replica_reduce(replica, array, root=0, op='sum', timeout_seconds=None)\n\n"
           "Replica `replica`'s part of a reduce: the root's array receives the reduction, in place.")
      .def("replica_reduce_scatter",
           [](group& g, const py::args& args, const py::kwargs& kwargs) {
             return per_replica(g, reduce_scatter_params, 3, args, kwargs, [&](int replica, std::vector<py::object> a) {
               call_desc d{collective::reduce_scatter};
               d.op = distvals::parse_reduce_op(text_argument(a[2], "op"));
               const auto timeout = to_timeout(a[3]);
               py::array x = as_array(a[1], replica, false, "array");
               return new_output_call(x, to_dtype(x.dtype(), replica), d, scattered_shape(x, g.size(), replica),
                                      timeout);
             });
           },
           "replica_reduce_scatter(replica, array, op='sum', timeout_seconds=None)\n\n"
           "Replica `replica`'s part of a reduce-scatter: a new array, block `replica` of the reduction.")
      // ---- failure handling ------------------------------------------------------------
      .def("abort", &group::abort, py::arg("replica"), py::arg("why"),
           "Release every waiting replica with AbortedError naming `replica`; the group stays aborted until reset().")
      .def("cancel", &group::cancel)
      .def("reset", &group::reset, "Clear an abort; only when no collective is in flight.")
      .def("close", [](group& g) {
        nogil unlocked;
        g.close();
      })
      .def_property_readonly("aborted", &group::aborted)
      .def_property_readonly("closed", &group::closed);
}

}  // namespace distvals_py
