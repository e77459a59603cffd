// distvals._core.inline_drive: the inline replicas' scheduler loop (replicas_inline.py).
//
// A step of inline replicas switches into each replica greenlet, collects what each
// switched back with (a meeting's request, its result, its failure), resolves the
// meeting once every replica waits at it and switches each replica back in with its
// outcome. Written in Python, that bookkeeping cost about as much as the switches
// themselves; here it is a loop over C calls. It does only the common path, exactly as
// InlineRunner._resume and the loop of InlineRunner.step do it: when a replica failed
// or some replicas returned while others wait, it hands the step back to Python (which
// releases them, then drives on), and everything it knows is in the runner's fields.
//
// Needs the GIL (it is called from Python and calls Python); never releases it.
#include <Python.h>

#include <utility>

#include "bindings.hpp"

namespace distvals_py {
namespace {

// Set once by inline_setup: the replica body's markers (_DONE, _FAILED), the Raise
// outcome type, the empty kwargs dict, and interned attribute names.
struct scheduler_names {
  PyObject* done = nullptr;
  PyObject* failed = nullptr;
  PyObject* raise_type = nullptr;
  PyObject* empty = nullptr;
  PyObject* stack = nullptr;
  PyObject* switch_ = nullptr;
  PyObject* throw_ = nullptr;
  PyObject* copy = nullptr;
  PyObject* gr_context = nullptr;
  PyObject* error = nullptr;
  PyObject* waiting = nullptr;
  PyObject* lost = nullptr;
  PyObject* msgs = nullptr;
  PyObject* results = nullptr;
  PyObject* stacks = nullptr;
  PyObject* failures = nullptr;
  PyObject* note_failure = nullptr;
};
scheduler_names names;

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

// The state of one call: the runner's fields, borrowed (the runner holds them).
struct drive_state {
  PyObject* runner;
  PyObject* gls;      // list of greenlets
  PyObject* local;    // distvals.context._local
  PyObject* msgs;     // list: each replica's pending request, None while it runs
  PyObject* results;  // list: each replica's result
  PyObject* stacks;   // list: each replica's context stack
  PyObject* failures; // list of Failure
  Py_ssize_t n;
  Py_ssize_t waiting;
  bool opened = false;  // the fields above were all read
};

// Writes `waiting` back to the runner; false with an error set when that fails.
bool store_waiting(drive_state& s) {
  PyObject* w = PyLong_FromSsize_t(s.waiting);
  if (w == nullptr) return false;
  const int rc = PyObject_SetAttr(s.runner, names.waiting, w);
  Py_DECREF(w);
  return rc == 0;
}

// Replica r failed with `error`: InlineRunner._note_failure records it.
bool note_failure(drive_state& s, Py_ssize_t r, PyObject* error) {
  PyObject* idx = PyLong_FromSsize_t(r);
  if (idx == nullptr) return false;
  PyObject* ok = PyObject_CallMethodObjArgs(s.runner, names.note_failure, idx, error, nullptr);
  Py_DECREF(idx);
  if (ok == nullptr) return false;
  Py_DECREF(ok);
  return true;
}

// False with a RuntimeError set unless replica r has a slot in every list of the step
// (Python code runs between any two switches and could have shortened one).
bool in_range(drive_state& s, Py_ssize_t r) {
  for (PyObject* list : {s.gls, s.msgs, s.results, s.stacks}) {
    if (r >= PyList_GET_SIZE(list)) {
      PyErr_Format(PyExc_RuntimeError, "inline scheduler: the step's lists lost replica %zd's slot", r);
      return false;
    }
  }
  return true;
}

// Stores `item` (a new reference, always consumed) at list[r].
bool put(PyObject* list, Py_ssize_t r, PyObject* item) { return PyList_SetItem(list, r, item) == 0; }

// The exception being raised, taken out of the error state as a new reference, with its
// traceback on it (so that it can be raised again elsewhere). NULL with a SystemError set
// when `what` failed without one.
PyObject* take_error(const char* what) {
  PyObject *type, *val, *tb;
  PyErr_Fetch(&type, &val, &tb);
  PyErr_NormalizeException(&type, &val, &tb);
  if (tb != nullptr && val != nullptr) PyException_SetTraceback(val, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  if (val == nullptr) PyErr_Format(PyExc_SystemError, "inline scheduler: %s failed without an exception", what);
  return val;
}

// Switches into replica r with `value` (or throws `error` there) and notes what it
// switched back with: a request (in msgs[r]), its result or its failure. False with an
// error set only when the bookkeeping itself failed (the replica's own errors are its
// outcome).
bool resume(drive_state& s, Py_ssize_t r, PyObject* value, PyObject* error) {
  if (!in_range(s, r)) return false;
  if (PyObject_SetAttr(s.local, names.stack, PyList_GET_ITEM(s.stacks, r)) < 0) return false;
  if (PyList_GET_ITEM(s.msgs, r) != Py_None) {
    Py_INCREF(Py_None);
    if (!put(s.msgs, r, Py_None)) return false;
    --s.waiting;
  }
  PyObject* g = PyList_GET_ITEM(s.gls, r);
  Py_INCREF(g);  // the replica may change the list while it runs
  PyObject* m;
  if (error == nullptr) {
    PyObject* args[] = {g, value};
    m = PyObject_VectorcallMethod(names.switch_, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  } else if (!PyExceptionInstance_Check(error)) {
    PyErr_Format(PyExc_TypeError, "inline scheduler: replica %zd's outcome is to raise a %s, not an exception", r,
                 Py_TYPE(error)->tp_name);
    m = nullptr;
  } else {
    // throw with the traceback, so that the frames where the error arose stay on it.
    PyObject* tb = PyException_GetTraceback(error);
    PyObject* args[] = {g, reinterpret_cast<PyObject*>(Py_TYPE(error)), error, tb != nullptr ? tb : Py_None};
    m = PyObject_VectorcallMethod(names.throw_, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    Py_XDECREF(tb);
  }
  Py_DECREF(g);
  if (m == nullptr) {
    // The greenlet died, or an interrupt landed right after it switched back and what
    // it switched back with is lost: this step's greenlets are never resumed again, and
    // the exception is the replica's failure.
    PyObject* val = take_error("a switch");
    if (val == nullptr) return false;
    const bool ok = PyObject_SetAttr(s.runner, names.lost, Py_True) == 0 && note_failure(s, r, val);
    Py_DECREF(val);
    return ok;
  }
  // The replica's outcome: [_DONE, result] or [_FAILED, error]. The replica's frame keeps
  // the list while it waits for its next task, so it is emptied here: no result or error
  // stays alive in it after the step.
  if (PyList_CheckExact(m) && PyList_GET_SIZE(m) == 2) {
    PyObject* tag = PyList_GET_ITEM(m, 0);
    if (tag == names.done || tag == names.failed) {
      PyObject* item = PyList_GET_ITEM(m, 1);
      Py_INCREF(item);
      const bool emptied = PyList_SetSlice(m, 0, 2, nullptr) == 0;
      Py_DECREF(m);
      if (!emptied) {
        Py_DECREF(item);
        return false;
      }
      if (tag == names.failed) {
        const bool ok = note_failure(s, r, item);
        Py_DECREF(item);
        return ok;
      }
      if (!in_range(s, r)) {
        Py_DECREF(item);
        return false;
      }
      return put(s.results, r, item);
    }
  }
  if (m == Py_None) {
    // No outcome and no request: the replica's greenlet ended (returned) instead of
    // switching back. Never taken for a request: that replica failed, and this step's
    // greenlets are not resumed again.
    Py_DECREF(m);
    PyObject* err = PyObject_CallFunction(PyExc_RuntimeError, "s",
                                          "inline scheduler: the replica's greenlet ended without an outcome");
    if (err == nullptr) return false;
    const bool ok = PyObject_SetAttr(s.runner, names.lost, Py_True) == 0 && note_failure(s, r, err);
    Py_DECREF(err);
    return ok;
  }
  // Anything else is a request: a Request, or its quick tuple form.
  if (!in_range(s, r)) {
    Py_DECREF(m);
    return false;
  }
  if (!put(s.msgs, r, m)) return false;
  ++s.waiting;
  return true;
}

// The runner's field `name` (a new reference), which must be a list of n items.
PyObject* list_field(PyObject* runner, PyObject* name, Py_ssize_t n) {
  PyObject* v = PyObject_GetAttr(runner, name);
  if (v == nullptr) return nullptr;
  if (!PyList_CheckExact(v) || PyList_GET_SIZE(v) != n) {
    PyErr_Format(PyExc_RuntimeError, "inline scheduler: the runner's %U is not a list of %zd items", name, n);
    Py_DECREF(v);
    return nullptr;
  }
  return v;
}

// The first round of a step: each replica starts with its task (fn, args, kwargs)
// until its first meeting or its end. Replicas after one that failed are not started
// (they would only be released at their first meeting).
bool start_all(drive_state& s, PyObject* fn, PyObject* per_replica, PyObject* base) {
  for (Py_ssize_t r = 0; r < s.n; ++r) {
    if (PyList_GET_SIZE(s.failures) > 0) break;
    PyObject* g = PyList_GET_ITEM(s.gls, r);
    // Each replica starts the step from a copy of the caller's context variables, or
    // from none when the caller has none: never from what it set in an earlier step
    // (its greenlet is reused from step to step, and keeps its context).
    PyObject* ctx = base == Py_None ? nullptr : PyObject_CallMethodNoArgs(base, names.copy);
    if (ctx == nullptr && base != Py_None) return false;
    const int rc = PyObject_SetAttr(g, names.gr_context, ctx == nullptr ? Py_None : ctx);
    Py_XDECREF(ctx);
    if (rc < 0) return false;
    PyObject* item = PySequence_GetItem(per_replica, r);
    if (item == nullptr) return false;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      Py_DECREF(item);
      PyErr_SetString(PyExc_RuntimeError, "inline scheduler: a replica's arguments are not (args, kwargs)");
      return false;
    }
    PyObject* kwargs = PyTuple_GET_ITEM(item, 1);
    if (kwargs == Py_None || (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0)) kwargs = names.empty;
    PyObject* task = PyTuple_Pack(3, fn, PyTuple_GET_ITEM(item, 0), kwargs);
    Py_DECREF(item);
    if (task == nullptr) return false;
    const bool ok = resume(s, r, task, nullptr);
    Py_DECREF(task);
    if (!ok) return false;
  }
  return true;
}

// While every replica waits at a meeting and none failed: resolve it, resume each
// replica with its outcome (a value, or a Raise whose error it raises).
bool meet_all(drive_state& s, PyObject* saved, PyObject* resolve) {
  while (s.waiting > 0) {
    if (PyList_GET_SIZE(s.failures) > 0 || s.waiting < s.n) return true;  // Python's part
    if (PyObject_SetAttr(s.local, names.stack, saved) < 0) return false;
    PyObject* outcomes = PyObject_CallOneArg(resolve, s.msgs);
    if (outcomes == nullptr) {
      // The meeting itself failed (the group was closed by another thread, say): every
      // replica raises the error where it waits, as replica threads do, so that each
      // can handle it and the step reports it with a replica's name. An interrupt
      // (KeyboardInterrupt, SystemExit) leaves the step at once instead.
      if (!PyErr_ExceptionMatches(PyExc_Exception)) return false;
      PyObject* error = take_error("a meeting");
      if (error == nullptr) return false;
      bool ok = true;
      for (Py_ssize_t r = 0; r < s.n && ok; ++r) ok = resume(s, r, nullptr, error);
      Py_DECREF(error);
      if (!ok) return false;
      continue;
    }
    // A tuple of its own: code that runs while replicas resume cannot change it.
    PyObject* seq = PySequence_Tuple(outcomes);
    Py_DECREF(outcomes);
    if (seq == nullptr) return false;
    if (PyTuple_GET_SIZE(seq) != s.n) {
      PyErr_Format(PyExc_RuntimeError, "inline scheduler: a meeting gave %zd outcomes for %zd replicas",
                   PyTuple_GET_SIZE(seq), s.n);
      Py_DECREF(seq);
      return false;
    }
    for (Py_ssize_t r = 0; r < s.n; ++r) {
      PyObject* o = PyTuple_GET_ITEM(seq, r);
      bool ok;
      if (reinterpret_cast<PyObject*>(Py_TYPE(o)) == names.raise_type) {
        PyObject* error = PyObject_GetAttr(o, names.error);
        ok = error != nullptr && resume(s, r, nullptr, error);
        Py_XDECREF(error);
      } else {
        ok = resume(s, r, o, nullptr);
      }
      if (!ok) {
        Py_DECREF(seq);
        return false;
      }
    }
    Py_DECREF(seq);
  }
  return true;
}

// Reads the step's fields of the runner into `s` (new references, released by
// close_state). False with an error set when they are not what the loop needs.
bool open_state(drive_state& s, PyObject* runner, PyObject* gls, PyObject* local) {
  if (names.note_failure == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "inline scheduler: inline_setup was not called");
    return false;
  }
  if (!PyList_CheckExact(gls)) {
    PyErr_SetString(PyExc_TypeError, "inline scheduler: the greenlets must be a list");
    return false;
  }
  s.runner = runner;
  s.gls = gls;
  s.local = local;
  s.n = PyList_GET_SIZE(gls);
  PyObject* waiting = PyObject_GetAttr(runner, names.waiting);
  if (waiting == nullptr) return false;
  s.waiting = PyLong_AsSsize_t(waiting);
  Py_DECREF(waiting);
  if (s.waiting == -1 && PyErr_Occurred()) return false;
  if ((s.msgs = list_field(runner, names.msgs, s.n)) == nullptr) return false;
  if ((s.results = list_field(runner, names.results, s.n)) == nullptr) return false;
  if ((s.stacks = list_field(runner, names.stacks, s.n)) == nullptr) return false;
  if ((s.failures = PyObject_GetAttr(runner, names.failures)) == nullptr) return false;
  if (!PyList_Check(s.failures)) {
    PyErr_SetString(PyExc_TypeError, "inline scheduler: the runner's failures must be a list");
    return false;
  }
  s.opened = true;
  return true;
}

// Gives the count of waiting replicas back to the runner (on every way out, an
// exception's included, which is kept aside meanwhile), releases what open_state took,
// and returns None, or NULL with the error set when `ok` is false.
PyObject* close_state(drive_state& s, bool ok) {
  if (s.opened) {
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    const bool stored = store_waiting(s);
    if (type != nullptr) {
      PyErr_Restore(type, val, tb);
    } else if (!stored) {
      ok = false;
    }
  }
  Py_XDECREF(s.msgs);
  Py_XDECREF(s.results);
  Py_XDECREF(s.stacks);
  Py_XDECREF(s.failures);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// inline_drive(runner, gls, fn, per_replica, base, local, saved, resolve): starts every
// replica with fn (unless fn is None), then resolves meetings while every replica waits
// at one. The runner's fields say where the step stands afterwards.
PyObject* inline_drive(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "inline_drive takes 8 arguments");
    return nullptr;
  }
  drive_state s{};
  bool ok = open_state(s, args[0], args[1], args[5]);
  if (ok && args[2] != Py_None) ok = start_all(s, args[2], args[3], args[4]);
  if (ok) ok = meet_all(s, args[6], args[7]);
  return close_state(s, ok);
}

// inline_resume(runner, gls, local, r, value, error): one switch into replica r, with
// `value`, or raising `error` there when it is not None (the releases of waiting
// replicas, which replicas_inline.py does itself).
PyObject* inline_resume(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "inline_resume takes 6 arguments");
    return nullptr;
  }
  drive_state s{};
  bool ok = open_state(s, args[0], args[1], args[2]);
  if (ok) {
    const Py_ssize_t r = PyLong_AsSsize_t(args[3]);
    if (r == -1 && PyErr_Occurred()) {
      ok = false;
    } else if (r < 0) {
      PyErr_Format(PyExc_ValueError, "inline scheduler: no replica %zd", r);
      ok = false;
    } else {
      ok = args[5] == Py_None ? resume(s, r, args[4], nullptr) : resume(s, r, nullptr, args[5]);
    }
  }
  return close_state(s, ok);
}

// inline_setup(done, failed, raise_type, empty): the markers and types the loop tells
// outcomes apart by (replicas_inline.py calls it once, at import).
PyObject* inline_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "inline_setup takes 4 arguments");
    return nullptr;
  }
  PyObject** slots[] = {&names.done, &names.failed, &names.raise_type, &names.empty};
  for (int i = 0; i < 4; ++i) {
    Py_INCREF(args[i]);
    Py_XSETREF(*slots[i], args[i]);
  }
  if (names.note_failure == nullptr) {  // the last one set: a partial failure is retried
    const std::pair<PyObject**, const char*> attrs[] = {
        {&names.stack, "stack"},       {&names.switch_, "switch"},     {&names.throw_, "throw"},
        {&names.copy, "copy"},         {&names.gr_context, "gr_context"}, {&names.error, "error"},
        {&names.waiting, "_waiting"},  {&names.lost, "_lost"},         {&names.msgs, "_msgs"},
        {&names.results, "_results"},  {&names.stacks, "_stacks"},     {&names.failures, "failures"},
        {&names.note_failure, "_note_failure"}};
    for (const auto& [slot, text] : attrs) {
      if ((*slot = intern(text)) == nullptr) return nullptr;
    }
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"inline_drive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&inline_drive)), METH_FASTCALL,
     "inline_drive($module, runner, greenlets, fn, per_replica, base, local, saved, resolve, /)\n--\n\n"
     "The inline replicas' scheduler loop (see distvals.replicas_inline)."},
    {"inline_resume", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&inline_resume)), METH_FASTCALL,
     "inline_resume($module, runner, greenlets, local, replica, value, error, /)\n--\n\n"
     "One switch into a replica, with value or raising error there (see distvals.replicas_inline)."},
    {"inline_setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&inline_setup)), METH_FASTCALL,
     "inline_setup($module, done, failed, raise_type, empty, /)\n--\n\n"
     "The markers and types inline_drive tells outcomes apart by."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void register_scheduler(py::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) throw py::error_already_set();
}

}  // namespace distvals_py
