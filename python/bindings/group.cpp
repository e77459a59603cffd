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

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    s += std::to_string(a.shape(i));
    if (a.ndim() == 1 || i + 1 < a.ndim()) s += i + 1 < a.ndim() ? ", " : ",";
  }
  return s + ")";
}

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

// A collective on the main thread may complete although a signal handler raised while
// it waited (the data arrived in the same instant): the handler's exception is raised
// anyway, so Ctrl-C is never lost.
void raise_pending_interrupt() {
  if (reraise_interrupt()) throw py::error_already_set();
}

// Runs the single-call style without the GIL. A failed collective leaves nobody inside
// the group, so it is reset at once and stays usable.
void run_all(group& g, const call_desc& d, const std::vector<buffer_view>& in, const std::vector<buffer_view>& out) {
  {
    py::gil_scoped_release nogil;
    try {
      g.run(d, in, out);
    } catch (const distvals::timeout_error&) {
      if (!g.closed()) g.reset();
      throw;
    } catch (const distvals::aborted_error&) {
      if (!g.closed()) g.reset();
      throw;
    }
  }
  if (pending_interrupt != nullptr && PyThread_get_thread_ident() == main_thread_id) {
    // Completed, but the signal handler cancelled the group meanwhile: nobody is inside
    // (this style runs one call at a time), so clear that as after any failure.
    try {
      if (g.aborted() && !g.closed()) g.reset();
    } catch (const std::logic_error&) {
    }
    raise_pending_interrupt();
  }
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

std::chrono::milliseconds to_ms(const py::object& seconds) {
  if (seconds.is_none()) return std::chrono::milliseconds{0};
  const double s = seconds.cast<double>();
  if (!(s > 0)) throw py::value_error("timeout_seconds must be positive, got " + std::to_string(s));
  return std::chrono::milliseconds(static_cast<long long>(s * 1000.0 + 0.5));
}

// Per-replica call without the GIL.
void run_one(group& g, int replica, const call_desc& d, buffer_view in, buffer_view out, std::chrono::milliseconds t) {
  {
    py::gil_scoped_release nogil;
    g.run(replica, d, in, out, t);
  }
  raise_pending_interrupt();
}

// One replica's checked arguments of a per-replica call.
struct call_args {
  call_desc desc;
  buffer_view in, out;
  std::chrono::milliseconds timeout{0};
  py::object result;  // the new output array, for collectives that return one
};

// Tells the other replicas that this replica's arguments are invalid, so that each of
// them raises the error instead of waiting for a replica that never comes. Returns once
// they have all arrived (or on timeout, abort or close): the caller then raises its own
// error, which is more useful than anything this call could say.
void report_invalid(group& g, int replica, const std::string& why, bool type_error, const py::object& timeout) {
  std::chrono::milliseconds t{0};  // the group's timeout when the given one is bad too
  try {
    t = to_ms(timeout);
  } catch (const std::exception&) {
    PyErr_Clear();
  }
  py::gil_scoped_release nogil;
  try {
    g.report_invalid(replica, why, type_error, t);
  } catch (const std::exception&) {
  }
}

// Runs `prepare` (checks and conversions of one replica's arguments) and returns its
// result; when it raises ValueError or TypeError, reports that to the other replicas
// first (see report_invalid), then raises it.
template <class Prepare>
call_args checked_call(group& g, int replica, const py::object& timeout, Prepare&& prepare) {
  try {
    return prepare();
  } catch (const py::type_error& e) {
    report_invalid(g, replica, e.what(), true, timeout);
    throw;
  } catch (const py::value_error& e) {
    report_invalid(g, replica, e.what(), false, timeout);
    throw;
  } catch (const distvals::dtype_error& e) {
    report_invalid(g, replica, e.what(), true, timeout);
    throw;
  } catch (const distvals::invalid_argument_error& e) {
    report_invalid(g, replica, e.what(), false, timeout);
    throw;
  } catch (py::error_already_set& e) {
    // Raised in Python code (the zero-copy converter); its message is the value's str.
    const bool type_error = e.matches(PyExc_TypeError);
    if (type_error || e.matches(PyExc_ValueError)) {
      report_invalid(g, replica, py::str(e.value()).cast<std::string>(), type_error, timeout);
    }
    throw;
  }
}

int check_replica(const group& g, int replica) {
  if (replica < 0 || replica >= g.size()) {
    throw py::value_error("replica " + std::to_string(replica) + " is out of range for a group of " +
                          std::to_string(g.size()));
  }
  return replica;
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
  py::class_<group>(m, "Group", "N local replicas that run collectives together (the C++ engine).")
      .def(py::init([](const py::object& devices, const py::object& timeout_seconds, int threads,
                       std::size_t chunk_bytes, int spin_us) {
             distvals::group_options o;
             o.timeout = to_ms(timeout_seconds);
             o.threads = threads;
             o.chunk_bytes = chunk_bytes;
             o.spin_us = spin_us;
             o.interrupted = &interrupted;
             if (py::isinstance<py::int_>(devices)) return new group(devices.cast<int>(), o);
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
      .def_property_readonly("timeout_seconds", [](const group& g) { return g.options().timeout.count() / 1000.0; })
      .def_property_readonly("threads", [](const group& g) { return g.options().threads; })
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
           [](group& g, const py::sequence& bufs, int root, const std::string& op) {
             const auto in = collect(g, bufs, false, "reduce");
             check_replica(g, root);
             as_array(in.a[root], root, true, "root array");
             const call_desc d{collective::reduce, in.type, distvals::parse_reduce_op(op),
                               distvals::algorithm::direct, in.v[0].count, root};
             run_all(g, d, in.v, in.v);
           },
           py::arg("buffers"), py::arg("root") = 0, py::arg("op") = "sum")
      .def("broadcast",
           [](group& g, const py::sequence& bufs, int root) {
             const auto in = collect(g, bufs, true, "broadcast");
             check_replica(g, root);
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
      // Arguments are checked inside checked_call: when one replica's are bad, it still
      // meets the others to report it, and every replica raises the same error at once.
      .def("replica_all_reduce",
           [](group& g, int replica, const py::object& arr, const std::string& op, const std::string& algo,
              const py::object& timeout, const py::object& out) {
             check_replica(g, replica);
             call_args c = checked_call(g, replica, timeout, [&]() {
               py::array a = as_array(arr, replica, out.is_none(), "array");
               const auto t = to_dtype(a.dtype(), replica);
               const auto v = view_of(a, t);
               buffer_view o = v;
               if (!out.is_none()) {
                 // Out of place: the engine reads `array` and writes `out`, no copy first.
                 py::array b = as_array(out, replica, true, "out");
                 if (to_dtype(b.dtype(), replica) != t || !same_shape(a, b)) {
                   throw py::value_error("replica " + std::to_string(replica) + ": out has dtype " +
                                         std::string(py::str(b.dtype())) + " and shape " + shape_str(b) +
                                         ", the array has " + std::string(py::str(a.dtype())) + " and " +
                                         shape_str(a));
                 }
                 o = view_of(b, t);
               }
               return call_args{call_desc{collective::all_reduce, t, distvals::parse_reduce_op(op),
                                          distvals::parse_algorithm(algo), v.count, 0},
                                v, o, to_ms(timeout), py::none()};
             });
             run_one(g, replica, c.desc, c.in, c.out, c.timeout);
           },
           py::arg("replica"), py::arg("array"), py::arg("op") = "sum", py::arg("algorithm") = "auto",
           py::arg("timeout_seconds") = py::none(), py::arg("out") = py::none(),
           "Replica `replica`'s part of an all-reduce, in place or into `out`; all replicas call it "
           "from their own threads.")
      .def("replica_all_gather",
           [](group& g, int replica, const py::object& arr, const py::object& timeout) {
             check_replica(g, replica);
             call_args c = checked_call(g, replica, timeout, [&]() {
               py::array a = as_array(arr, replica, false, "array");
               const auto t = to_dtype(a.dtype(), replica);
               py::array out = new_like(a, t, gathered_shape(a, g.size()));
               return call_args{call_desc{collective::all_gather, t, distvals::reduce_op::sum,
                                          distvals::algorithm::direct, static_cast<std::size_t>(a.size()), 0},
                                view_of(a, t), view_of(out, t), to_ms(timeout), out};
             });
             run_one(g, replica, c.desc, c.in, c.out, c.timeout);
             return c.result;
           },
           py::arg("replica"), py::arg("array"), py::arg("timeout_seconds") = py::none())
      .def("replica_broadcast",
           [](group& g, int replica, const py::object& arr, int root, const py::object& timeout) {
             check_replica(g, replica);
             call_args c = checked_call(g, replica, timeout, [&]() {
               check_replica(g, root);
               py::array a = as_array(arr, replica, true, "array");
               const auto t = to_dtype(a.dtype(), replica);
               const auto v = view_of(a, t);
               return call_args{call_desc{collective::broadcast, t, distvals::reduce_op::sum,
                                          distvals::algorithm::direct, v.count, root},
                                v, v, to_ms(timeout), py::none()};
             });
             run_one(g, replica, c.desc, c.in, c.out, c.timeout);
           },
           py::arg("replica"), py::arg("array"), py::arg("root") = 0, py::arg("timeout_seconds") = py::none())
      .def("replica_reduce",
           [](group& g, int replica, const py::object& arr, int root, const std::string& op, const py::object& timeout) {
             check_replica(g, replica);
             call_args c = checked_call(g, replica, timeout, [&]() {
               check_replica(g, root);
               py::array a = as_array(arr, replica, replica == root, "array");
               const auto t = to_dtype(a.dtype(), replica);
               const auto v = view_of(a, t);
               return call_args{call_desc{collective::reduce, t, distvals::parse_reduce_op(op),
                                          distvals::algorithm::direct, v.count, root},
                                v, v, to_ms(timeout), py::none()};
             });
             run_one(g, replica, c.desc, c.in, c.out, c.timeout);
           },
           py::arg("replica"), py::arg("array"), py::arg("root") = 0, py::arg("op") = "sum",
           py::arg("timeout_seconds") = py::none())
      .def("replica_reduce_scatter",
           [](group& g, int replica, const py::object& arr, const std::string& op, const py::object& timeout) {
             check_replica(g, replica);
             call_args c = checked_call(g, replica, timeout, [&]() {
               py::array a = as_array(arr, replica, false, "array");
               const auto t = to_dtype(a.dtype(), replica);
               py::array out = new_like(a, t, scattered_shape(a, g.size(), replica));
               return call_args{call_desc{collective::reduce_scatter, t, distvals::parse_reduce_op(op),
                                          distvals::algorithm::direct, static_cast<std::size_t>(a.size()), 0},
                                view_of(a, t), view_of(out, t), to_ms(timeout), out};
             });
             run_one(g, replica, c.desc, c.in, c.out, c.timeout);
             return c.result;
           },
           py::arg("replica"), py::arg("array"), py::arg("op") = "sum", py::arg("timeout_seconds") = py::none())
      // ---- failure handling ------------------------------------------------------------
      .def("abort", &group::abort, py::arg("replica"), py::arg("why"),
           "Release every waiting replica with AbortedError naming `replica`; the group stays aborted until reset().")
      .def("cancel", &group::cancel)
      .def("reset", &group::reset, "Clear an abort; only when no collective is in flight.")
      .def("close", [](group& g) {
        py::gil_scoped_release nogil;
        g.close();
      })
      .def_property_readonly("aborted", &group::aborted)
      .def_property_readonly("closed", &group::closed);
}

}  // namespace distvals_py
