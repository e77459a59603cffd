// distvals._core: the engine's Python face. This file only wires the areas together.
#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "distvals collective engine (C++), see the distvals package for the Python API";
  m.attr("__version__") = distvals::version_string;
  m.attr("has_cuda") = static_cast<bool>(DISTVALS_HAS_CUDA);
  distvals_py::register_errors(m);
  distvals_py::register_types(m);
  distvals_py::register_group(m);
  distvals_py::register_timing(m);
  distvals_py::register_pool(m);
  distvals_py::register_leaves(m);
  distvals_py::register_meeting(m);
  distvals_py::register_nest(m);
  distvals_py::register_scope(m);
  distvals_py::register_scheduler(m);
  distvals_py::register_worker_small(m);
  distvals_py::register_shuffle(m);
#if DISTVALS_HAS_CUDA
  distvals_py::register_cuda(m);
#endif
}
