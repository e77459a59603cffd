// C++ exceptions mapped to Python ones. Bad input becomes ValueError / TypeError;
// the engine's own failures get distvals exception classes that also derive from
// the matching builtins, so `except TimeoutError` keeps working.
#include "bindings.hpp"

namespace distvals_py {

void register_errors(py::module_& m) {
  static py::exception<distvals::mismatch_error> mismatch(m, "MismatchError", PyExc_ValueError);
  static py::exception<distvals::timeout_error> timeout(m, "CollectiveTimeoutError", PyExc_TimeoutError);
  static py::exception<distvals::aborted_error> aborted(m, "AbortedError", PyExc_RuntimeError);
  static py::exception<distvals::closed_error> closed(m, "ClosedError", PyExc_RuntimeError);
  static py::exception<distvals::cuda_error> cuda(m, "CudaError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const distvals::mismatch_error& e) {
      mismatch(e.what());
    } catch (const distvals::dtype_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const distvals::invalid_argument_error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const distvals::timeout_error& e) {
      timeout(e.what());
    } catch (const distvals::aborted_error& e) {
      if (e.replica() < 0 && std::string(e.what()).find(": interrupted") != std::string::npos) {
        PyErr_SetNone(PyExc_KeyboardInterrupt);
        return;
      }
      py::object exc = aborted;
      py::object inst = exc(e.what());
      inst.attr("replica") = e.replica();
      PyErr_SetObject(aborted.ptr(), inst.ptr());
    } catch (const distvals::closed_error& e) {
      closed(e.what());
    } catch (const distvals::cuda_error& e) {
      cuda(e.what());
    }
  });
}

}  // namespace distvals_py
