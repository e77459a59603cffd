// Shared declarations of the pybind11 module distvals._core: one register_<area>
// function per file, called from module.cpp.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "distvals/distvals.hpp"

namespace distvals_py {

namespace py = pybind11;

void register_errors(py::module_& m);
void register_types(py::module_& m);
void register_group(py::module_& m);
void register_timing(py::module_& m);
void register_pool(py::module_& m);
void register_cuda(py::module_& m);  // the `cuda` submodule; only with DISTVALS_HAS_CUDA

/// On the main thread, raises again (sets as the Python error) what a signal handler
/// raised while a collective was blocked, or KeyboardInterrupt, and returns true; on
/// any other thread returns false and does nothing. Needs the GIL.
bool reraise_interrupt();

/// A replica's array as the engine sees it, after every check: C-contiguous, a
/// supported dtype, writable when `writable`. Throws ValueError/TypeError naming the
/// replica. Objects that are not numpy arrays go through distvals._convert first
/// (buffer protocol, DLPack), without copying.
py::array as_array(const py::handle& obj, int replica, bool writable, const char* role);

/// The engine dtype of a numpy dtype; throws TypeError naming the replica.
distvals::dtype to_dtype(const py::dtype& dt, int replica);
/// The numpy dtype of an engine dtype (bfloat16 needs ml_dtypes).
py::dtype to_numpy(distvals::dtype t);

/// A view of the array's memory for the engine (no copy).
distvals::buffer_view view_of(const py::array& a, distvals::dtype t);

}  // namespace distvals_py
