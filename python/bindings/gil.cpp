// The GIL guard of every blocking call (see nogil in bindings.hpp).
#include <chrono>
#include <thread>
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#include "bindings.hpp"

namespace distvals_py {
namespace {

// Keeps this thread out of Python for good: the process exits around it, as it does
// around any daemon thread.
[[noreturn]] void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

nogil::nogil() : state_(PyEval_SaveThread()) {}

nogil::~nogil() {
  // The interpreter began to exit while this thread was in the engine: returning to
  // Python is impossible.
  if (finalizing()) park();
#if defined(__GLIBCXX__)
  // It may also begin while this thread waits for the GIL, which CPython then ends
  // with pthread_exit. Its forced unwind would run the destructors of the Python
  // objects in the frames above without the GIL (a crash), so it stops here instead.
  try {
    PyEval_RestoreThread(state_);
  } catch (abi::__forced_unwind&) {
    park();
  }
#else
  PyEval_RestoreThread(state_);
#endif
}

}  // namespace distvals_py
