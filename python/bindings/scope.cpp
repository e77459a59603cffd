// The exit of `with strategy.scope():` in C. A Python __exit__ starts with a check for
// pending signals, so a Ctrl-C that lands there raises before the scope is left, and
// the scope stays entered for good. Called from C, the exit is one step that no signal
// handler can interrupt.
#include "bindings.hpp"

namespace distvals_py {
namespace {

// distvals.context._local: the thread-local whose `stack` holds the entered scopes.
py::object* scope_local = nullptr;

void scope_exit(py::handle self, const py::args&) {
  // Step 1: a scope entered again (nested, or the same strategy's) only counts down.
  const py::object again = self.attr("_again");
  const long count = again.cast<long>();
  if (count > 0) {
    self.attr("_again") = py::int_(count - 1);
    return;
  }
  // Step 2: the outermost exit drops this scope's entry (found by identity, innermost
  // first) from the thread's stack.
  const py::object entry = self.attr("_entry");
  const py::list stack = scope_local->attr("stack");
  for (Py_ssize_t i = PyList_GET_SIZE(stack.ptr()) - 1; i >= 0; --i) {
    if (PyList_GET_ITEM(stack.ptr(), i) == entry.ptr()) {
      if (PySequence_DelItem(stack.ptr(), i) < 0) throw py::error_already_set();
      return;
    }
  }
}

}  // namespace

void register_scope(py::module_& m) {
  m.def(
      "install_scope_exit",
      [](py::object cls, py::object local) {
        delete scope_local;
        scope_local = new py::object(std::move(local));
        // A method (bound to the instance), as a Python __exit__ would be.
        cls.attr("__exit__") = py::cpp_function(&scope_exit, py::name("__exit__"), py::is_method(cls));
      },
      py::arg("cls"), py::arg("local"),
      "Gives the scope class `cls` an __exit__ written in C, which reads the scope stack of "
      "the thread-local `local` (see distvals.context).");
}

}  // namespace distvals_py
