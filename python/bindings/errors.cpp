// C++ exceptions mapped to Python ones. Bad input becomes ValueError / TypeError;
// the engine's own failures get distvals exception classes that also derive from
// the matching builtins, so `except TimeoutError` keeps working.
#include "bindings.hpp"

namespace distvals_py {
namespace {
// Leaked on purpose: the classes must outlive the interpreter's finalization, and the
// translator below must be a plain function (no captures).
py::object* mismatch = nullptr;
py::object* timeout = nullptr;
py::object* aborted = nullptr;
py::object* closed = nullptr;
py::object* cuda = nullptr;
}  // namespace

void register_errors(py::module_& m) {
  mismatch = new py::object(py::exception<distvals::mismatch_error>(m, "MismatchError", PyExc_ValueError));
  timeout = new py::object(py::exception<distvals::timeout_error>(m, "CollectiveTimeoutError", PyExc_TimeoutError));
  aborted = new py::object(py::exception<distvals::aborted_error>(m, "AbortedError", PyExc_RuntimeError));
  closed = new py::object(py::exception<distvals::closed_error>(m, "ClosedError", PyExc_RuntimeError));
  cuda = new py::object(py::exception<distvals::cuda_error>(m, "CudaError", PyExc_RuntimeError));
  mismatch->attr("__doc__") =
      "Replicas (or workers) called a collective with arguments that do not agree: a different "
      "collective, op, root, dtype, shape, structure or keys. Every replica of the call raises it, "
      "and the message names the first difference and the replicas involved. Also a ValueError.";
  timeout->attr("__doc__") =
      "A collective (or strategy.run) waited longer than its timeout_seconds for the other "
      "replicas. The group is aborted, so the other replicas are released too; reset() it (or "
      "make a new strategy) to go on. Also a TimeoutError.";
  aborted->attr("__doc__") =
      "The group was aborted (by abort(), by a failure or timeout in another replica, by close() "
      "or Ctrl-C) while this call waited or before it began. `replica` names the replica that "
      "caused it (-1 when none did). The group refuses calls until reset().";
  closed->attr("__doc__") = "The group was closed: its worker threads are gone and every call is refused.";
  cuda->attr("__doc__") = "A CUDA runtime or driver call failed; the message names the call, the device and the error.";
  py::register_exception_translator([](std::exception_ptr p) {
    // A signal handler raised while the call was blocked (and cancelled the group): on
    // the main thread that exception, KeyboardInterrupt for Ctrl-C, is what the call
    // raises. Replicas on other threads get AbortedError naming no replica (-1).
    if (reraise_interrupt()) return;
    try {
      if (p) std::rethrow_exception(p);
    } catch (const distvals::mismatch_error& e) {
      py::set_error(*mismatch, e.what());
    } catch (const distvals::dtype_error& e) {
      py::set_error(PyExc_TypeError, e.what());
    } catch (const distvals::invalid_argument_error& e) {
      py::set_error(PyExc_ValueError, e.what());
    } catch (const distvals::timeout_error& e) {
      py::set_error(*timeout, e.what());
    } catch (const distvals::aborted_error& e) {
      py::object inst = (*aborted)(e.what());
      inst.attr("replica") = e.replica();
      py::set_error(*aborted, inst);
    } catch (const distvals::closed_error& e) {
      py::set_error(*closed, e.what());
    } catch (const distvals::cuda_error& e) {
      py::set_error(*cuda, e.what());
    }
  });
}

}  // namespace distvals_py
