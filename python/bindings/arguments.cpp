// Argument handling shared by the bindings: Python's own rules for binding *args and
// **kwargs to named parameters (so that a per-replica call can report any bad argument
// to the other replicas instead of failing before it meets them), timeouts in seconds,
// and replica indices.
#include <cmath>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {

std::vector<py::object> bind_arguments(const parameters& p, const py::args& args, const py::kwargs& kwargs) {
  const std::size_t n = p.names.size();
  std::vector<py::object> out(n);
  // Step 1: positional arguments fill the parameters in order.
  if (args.size() > n) {
    throw py::type_error(std::string(p.function) + "() takes " + std::to_string(n) + " positional arguments but " +
                         std::to_string(args.size()) + " were given");
  }
  for (std::size_t i = 0; i < args.size(); ++i) out[i] = py::reinterpret_borrow<py::object>(args[i]);
  // Step 2: keywords fill the rest, each name once.
  for (auto item : kwargs) {
    const std::string key = py::str(item.first);
    std::size_t i = 0;
    while (i < n && key != p.names[i]) ++i;
    if (i == n) {
      throw py::type_error(std::string(p.function) + "() got an unexpected keyword argument '" + key + "'");
    }
    if (out[i]) {
      throw py::type_error(std::string(p.function) + "() got multiple values for argument '" + key + "'");
    }
    out[i] = py::reinterpret_borrow<py::object>(item.second);
  }
  // Step 3: defaults for what is still missing; a parameter without one is required.
  for (std::size_t i = 0; i < n; ++i) {
    if (out[i]) continue;
    if (!p.defaults[i]) {
      throw py::type_error(std::string(p.function) + "() missing required argument '" + p.names[i] + "'");
    }
    out[i] = p.defaults[i];
  }
  return out;
}

py::handle find_argument(const parameters& p, std::size_t index, const py::args& args, const py::kwargs& kwargs) {
  if (index < args.size()) return args[index];
  const py::str key(p.names[index]);
  if (kwargs.contains(key)) return kwargs[key];
  return py::handle();
}

std::chrono::nanoseconds to_timeout(const py::handle& seconds, const char* what) {
  if (!seconds || seconds.is_none()) return std::chrono::nanoseconds{0};
  // Numbers only: a string such as "5" or a bool is a mistake, not a timeout.
  if (PyBool_Check(seconds.ptr()) || PyUnicode_Check(seconds.ptr()) || PyBytes_Check(seconds.ptr()) ||
      !(PyFloat_Check(seconds.ptr()) || PyLong_Check(seconds.ptr()) || PyIndex_Check(seconds.ptr()) ||
        PyObject_HasAttrString(seconds.ptr(), "__float__"))) {
    throw py::type_error(std::string(what) + " must be a number of seconds or None, got " +
                         std::string(py::str(py::type::handle_of(seconds).attr("__name__"))));
  }
  const double s = PyFloat_AsDouble(seconds.ptr());
  if (s == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  if (std::isnan(s) || !(s > 0)) {
    throw py::value_error(std::string(what) + " must be positive (inf: no timeout), got " +
                          std::string(py::str(seconds)));
  }
  return distvals::timeout_from_seconds(s);
}

double timeout_seconds(std::chrono::nanoseconds t) {
  if (t == distvals::no_timeout) return INFINITY;
  return static_cast<double>(t.count()) * 1e-9;
}

int to_replica(const py::handle& obj, int n, const char* what) {
  if (!obj) throw py::type_error(std::string("missing required argument '") + what + "'");
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) {
    throw py::type_error(std::string(what) + " must be an int, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  int overflow = 0;
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow == 0 && v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < 0 || v >= n) {
    throw py::value_error(std::string(what) + " " + std::string(py::str(obj)) + " is out of range for a group of " +
                          std::to_string(n));
  }
  return static_cast<int>(v);
}

std::string exception_text(const py::error_already_set& e) {
  // TypeError and ValueError carry their message alone (it names the replica already);
  // anything else gets its type name in front, as a traceback's last line has it.
  const std::string msg = py::str(e.value());
  if (e.matches(PyExc_TypeError) || e.matches(PyExc_ValueError)) return msg;
  const std::string type = py::str(py::type::handle_of(e.value()).attr("__name__"));
  return msg.empty() ? type : type + ": " + msg;
}

}  // namespace distvals_py
