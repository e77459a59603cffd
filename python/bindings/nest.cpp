// distvals._core nest_flatten, nest_pack, nest_same: the walks of distvals.nest.
//
// Every step walks its structures several times: a replica flattens the structure it
// all-reduces, the meeting compares the replicas' nestings, each replica's results are
// packed back, and run's results are regrouped into PerReplica leaves. Written in Python
// these walks cost microseconds per call even for a flat dict of six arrays, more than
// the collective under them; here they cost a pass over the containers.
//
// The rules are distvals.nest's (its docstring): lists, tuples (namedtuples too) and
// mappings (dicts and any collections.abc.Mapping) are containers, subclasses included,
// everything else is a leaf; a mapping's values come in sorted key order, or in its own
// order when the keys cannot be sorted; packing rebuilds each container with its own
// type, a mapping with its own key order.
#include <cstdint>
#include <string>
#include <vector>

#include <structmember.h>

#include "bindings.hpp"

namespace distvals_py {
namespace {

// Whether `x` is a mapping: a dict, or an instance of a class that subclasses or is
// registered with collections.abc.Mapping. CPython marks such classes with a type flag
// (set by Mapping.register too), so the test costs no isinstance call against the ABC,
// which a walk would otherwise make for every leaf.
bool is_mapping(PyObject* x) { return PyDict_Check(x) || (PyType_GetFlags(Py_TYPE(x)) & Py_TPFLAGS_MAPPING) != 0; }

bool is_container(PyObject* x) { return PyList_Check(x) || PyTuple_Check(x) || is_mapping(x); }

// Raises the pending Python error as a C++ exception when `ok` is false.
void check(bool ok) {
  if (!ok) throw py::error_already_set();
}

// How deep the walks go at most, whatever Python's recursion limit: each level takes C
// stack, and a limit raised for deep Python recursion must not let a walk overflow it.
constexpr int max_depth = 10000;
thread_local int depth = 0;

// Guards a level of recursion: a structure nested too deeply (or one that contains
// itself) is a RecursionError, not a crash.
struct recursion_guard {
  explicit recursion_guard(const char* where) {
    if (depth >= max_depth) {
      PyErr_Format(PyExc_RecursionError, "maximum nesting depth (%d) exceeded%s", max_depth, where);
      throw py::error_already_set();
    }
    check(Py_EnterRecursiveCall(where) == 0);
    ++depth;
  }
  ~recursion_guard() {
    --depth;
    Py_LeaveRecursiveCall();
  }
  recursion_guard(const recursion_guard&) = delete;
  recursion_guard& operator=(const recursion_guard&) = delete;
};

// The keys of mapping `d` in its own order (list(d)): a snapshot, safe to hold while
// Python code (a key's comparison) runs.
py::list own_keys(PyObject* d) {
  PyObject* keys = PyDict_CheckExact(d) ? PyDict_Keys(d) : PySequence_List(d);
  check(keys != nullptr);
  return py::reinterpret_steal<py::list>(keys);
}

// A dict's own keys `keys` in nest's order: sorted when they can be, else as the dict
// iterates them (keys of mixed types: still deterministic). `keys` itself when they are
// in that order already, else a sorted copy.
py::list ordered(py::list keys) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  if (n < 2) return keys;
  // The commonest dict of a step has str keys written in order: checking that costs a
  // comparison per key, sorting a copy several times that (and a dict is walked several
  // times a step). str's < is PyUnicode_Compare's order, as list.sort uses it.
  bool in_order = true;
  for (Py_ssize_t i = 0; i < n && in_order; ++i) {
    PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
    in_order = PyUnicode_CheckExact(k) && (i == 0 || PyUnicode_Compare(PyList_GET_ITEM(keys.ptr(), i - 1), k) < 0);
  }
  if (in_order) return keys;
  py::list sorted = py::reinterpret_steal<py::list>(PyList_GetSlice(keys.ptr(), 0, PyList_GET_SIZE(keys.ptr())));
  check(sorted.ptr() != nullptr);
  if (PyList_Sort(sorted.ptr()) == 0) return sorted;
  // Only a TypeError means "cannot be sorted"; a failed sort may leave its list half
  // sorted, hence the copy.
  if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
  PyErr_Clear();
  return keys;
}

// The keys of dict `d` in nest's order.
py::list ordered_keys(PyObject* d) {
  // list(d) is the dict's own order (a subclass's too: an OrderedDict after move_to_end).
  return ordered(own_keys(d));
}

// d[k], a new reference.
py::object item_of(PyObject* d, PyObject* k) {
  if (PyDict_CheckExact(d)) {
    PyObject* v = PyDict_GetItemWithError(d, k);  // borrowed
    if (v == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, k);
      throw py::error_already_set();
    }
    return py::reinterpret_borrow<py::object>(v);
  }
  PyObject* v = PyObject_GetItem(d, k);
  check(v != nullptr);
  return py::reinterpret_steal<py::object>(v);
}

// ---- flat dicts ------------------------------------------------------------------------------

// The commonest structure of a step is a flat dict of arrays with str keys (a model's
// gradients by name). For such a dict, when its keys also come in sorted order, nest's
// order is the dict's own, and the walks below go straight through it (PyDict_Next)
// instead of listing, sorting and looking up its keys. Nothing here runs Python code, so
// the dict cannot change under the walk.

// Whether `d` is an exact dict whose keys are exact str in ascending order and whose
// values are all leaves; its size in `size`.
bool flat_in_order(PyObject* d, Py_ssize_t& size) {
  if (!PyDict_CheckExact(d)) return false;
  Py_ssize_t pos = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  PyObject* last = nullptr;
  while (PyDict_Next(d, &pos, &key, &value)) {
    if (!PyUnicode_CheckExact(key) || is_container(value)) return false;
    if (last != nullptr && PyUnicode_Compare(last, key) >= 0) return false;
    last = key;
  }
  size = PyDict_GET_SIZE(d);
  return true;
}

// Whether two flat, in-order dicts (flat_in_order) have the same keys.
bool same_flat_keys(PyObject* a, PyObject* b) {
  if (PyDict_GET_SIZE(a) != PyDict_GET_SIZE(b)) return false;
  Py_ssize_t pa = 0;
  Py_ssize_t pb = 0;
  PyObject* ka = nullptr;
  PyObject* kb = nullptr;
  PyObject* v = nullptr;
  while (PyDict_Next(a, &pa, &ka, &v)) {
    if (!PyDict_Next(b, &pb, &kb, &v)) return false;
    if (ka != kb && PyUnicode_Compare(ka, kb) != 0) return false;
  }
  return true;
}

// ---- flatten -------------------------------------------------------------------------------

void flatten_into(PyObject* x, PyObject* out) {
  Py_ssize_t size = 0;
  if (flat_in_order(x, size)) {
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(x, &pos, &key, &value)) check(PyList_Append(out, value) == 0);
    return;
  }
  if (PyList_Check(x) || PyTuple_Check(x)) {
    recursion_guard guard(" in nest.flatten");
    // Sizes are read again each time: a key's comparison (Python code) may change a list.
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(x); ++i) {
      py::object item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(x, i));
      if (is_container(item.ptr())) {
        flatten_into(item.ptr(), out);
      } else {
        check(PyList_Append(out, item.ptr()) == 0);
      }
    }
  } else if (is_mapping(x)) {
    recursion_guard guard(" in nest.flatten");
    py::list keys = ordered_keys(x);
    for (py::handle k : keys) {
      py::object item = item_of(x, k.ptr());
      if (is_container(item.ptr())) {
        flatten_into(item.ptr(), out);
      } else {
        check(PyList_Append(out, item.ptr()) == 0);
      }
    }
  } else {
    check(PyList_Append(out, x) == 0);
  }
}

py::list flatten(const py::handle& structure) {
  py::list out;
  flatten_into(structure.ptr(), out.ptr());
  return out;
}

// ---- pack ------------------------------------------------------------------------------------

// The leaves to pack, consumed in order.
struct leaf_source {
  PyObject* seq;  // a list or tuple
  Py_ssize_t next = 0;
};

// A mapping like `m`, not a dict, holding `values`'s items in the order of `own` (m's
// own keys). Its class is called with a dict of them, in that order: what mappings'
// constructors take most widely (MappingProxyType takes nothing else), where tf.nest
// passes (key, value) pairs.
py::object rebuild_mapping(PyObject* m, const py::list& own, const py::dict& values) {
  py::dict items;
  for (py::handle k : own) {
    py::object v = item_of(values.ptr(), k.ptr());  // KeyError: a key added meanwhile
    check(PyDict_SetItem(items.ptr(), k.ptr(), v.ptr()) == 0);
  }
  PyObject* made = PyObject_CallOneArg(reinterpret_cast<PyObject*>(Py_TYPE(m)), items.ptr());
  // A constructor that refuses a dict, or that does not keep its items as they come,
  // would fail later or lose leaves silently.
  const bool holds = made != nullptr && PyObject_Length(made) == PyDict_GET_SIZE(items.ptr());
  Py_XDECREF(holds ? nullptr : made);
  if (!holds) {
    PyErr_Clear();
    throw py::type_error(std::string("nest: a ") + Py_TYPE(m)->tp_name + " (a Mapping) called with a dict of its " +
                         std::to_string(PyDict_GET_SIZE(items.ptr())) + " items does not make one holding them; " +
                         "use a dict, or a Mapping whose constructor takes a dict");
  }
  return py::reinterpret_steal<py::object>(made);
}

bool is_namedtuple(PyObject* x) {
  return PyTuple_Check(x) && !PyTuple_CheckExact(x) && PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(x)), "_fields");
}

// A container like `tmpl` holding `items`.
py::object rebuild(PyObject* tmpl, py::list items) {
  if (PyList_CheckExact(tmpl)) return std::move(items);
  if (PyTuple_CheckExact(tmpl)) {
    PyObject* t = PyList_AsTuple(items.ptr());
    check(t != nullptr);
    return py::reinterpret_steal<py::object>(t);
  }
  py::handle type(reinterpret_cast<PyObject*>(Py_TYPE(tmpl)));
  py::object out;
  if (is_namedtuple(tmpl)) {
    py::tuple args = py::reinterpret_steal<py::tuple>(PyList_AsTuple(items.ptr()));
    check(args.ptr() != nullptr);
    out = py::reinterpret_steal<py::object>(PyObject_Call(type.ptr(), args.ptr(), nullptr));
  } else if (PyList_Check(tmpl)) {
    // A list subclass: a shallow copy keeps what its constructor set (its own __init__
    // may take other arguments than the items), then the items replace its contents.
    out = py::module_::import("copy").attr("copy")(py::handle(tmpl));
    check(PySequence_SetSlice(out.ptr(), 0, PY_SSIZE_T_MAX, items.ptr()) == 0);
  } else {
    out = py::reinterpret_steal<py::object>(PyObject_CallOneArg(type.ptr(), items.ptr()));
  }
  check(out.ptr() != nullptr);
  // A constructor that does not take its items as they come would lose leaves silently.
  if (PyObject_Length(out.ptr()) != PyList_GET_SIZE(items.ptr())) {
    PyErr_Clear();
    throw py::type_error(std::string("nest: a ") + Py_TYPE(tmpl)->tp_name + " rebuilt from its " +
                         std::to_string(PyList_GET_SIZE(items.ptr())) + " items does not hold them " +
                         "(its constructor takes other arguments); use a list, tuple or namedtuple");
  }
  return out;
}

// Whether two containers are of one kind for nest: the same type; any two lists; any two
// mappings (a dict and an OrderedDict or a MappingProxyType); namedtuples of the same name
// and fields (a class made anew in each replica's function), as tf.nest counts them.
bool same_kind(PyObject* a, PyObject* b) {
  if (Py_TYPE(a) == Py_TYPE(b)) return true;
  if ((PyList_Check(a) && PyList_Check(b)) || (is_mapping(a) && is_mapping(b))) return true;
  if (!is_namedtuple(a) || !is_namedtuple(b)) return false;
  py::handle ta(reinterpret_cast<PyObject*>(Py_TYPE(a)));
  py::handle tb(reinterpret_cast<PyObject*>(Py_TYPE(b)));
  return ta.attr("__name__").equal(tb.attr("__name__")) && ta.attr("_fields").equal(tb.attr("_fields"));
}

py::object pack(PyObject* x, leaf_source& src) {
  if (PyList_Check(x) || PyTuple_Check(x)) {
    recursion_guard guard(" in nest.pack_sequence_as");
    py::list items;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(x); ++i) {
      py::object item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(x, i));
      check(PyList_Append(items.ptr(), pack(item.ptr(), src).ptr()) == 0);
    }
    return rebuild(x, std::move(items));
  }
  Py_ssize_t size = 0;
  if (flat_in_order(x, size)) {
    // A flat dict in nest's order: its keys take the next `size` leaves as they come.
    if (PySequence_Fast_GET_SIZE(src.seq) - src.next < size) {
      throw py::value_error("pack_sequence_as: fewer leaves than the structure holds");
    }
    // A copy has its keys already in place (one copy of the table, no resizes as
    // inserting them one by one into a new dict costs); each value is then replaced.
    py::object out = py::reinterpret_steal<py::object>(PyDict_Copy(x));
    check(out.ptr() != nullptr);
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(x, &pos, &key, &value)) {
      check(PyDict_SetItem(out.ptr(), key, PySequence_Fast_GET_ITEM(src.seq, src.next++)) == 0);
    }
    return out;
  }
  if (is_mapping(x)) {
    recursion_guard guard(" in nest.pack_sequence_as");
    // Leaves come in sorted key order; the result keeps the mapping's own type and order
    // (taken before any Python code runs: a key's comparison may change the mapping).
    py::list own = own_keys(x);
    py::list keys = ordered(own);
    if (PyDict_CheckExact(x) && keys.ptr() == own.ptr()) {
      // Its own order is nest's: the result is filled as the leaves come.
      py::dict out;
      for (py::handle k : keys) {
        py::object item = item_of(x, k.ptr());
        check(PyDict_SetItem(out.ptr(), k.ptr(), pack(item.ptr(), src).ptr()) == 0);
      }
      return std::move(out);
    }
    py::dict values;
    for (py::handle k : keys) {
      py::object item = item_of(x, k.ptr());
      check(PyDict_SetItem(values.ptr(), k.ptr(), pack(item.ptr(), src).ptr()) == 0);
    }
    py::object out;
    if (!PyDict_Check(x)) return rebuild_mapping(x, own, values);
    if (PyDict_CheckExact(x)) {
      out = py::dict();
    } else {
      // A dict subclass: a shallow copy, emptied, keeps what its constructor set (a
      // defaultdict's default_factory; a constructor that takes other arguments).
      out = py::module_::import("copy").attr("copy")(py::handle(x));
      check(PyDict_Check(out.ptr()));
      PyDict_Clear(out.ptr());
    }
    for (py::handle k : own) {
      py::object v = item_of(values.ptr(), k.ptr());  // KeyError: a key added meanwhile
      check(PyObject_SetItem(out.ptr(), k.ptr(), v.ptr()) == 0);
    }
    return out;
  }
  if (src.next >= PySequence_Fast_GET_SIZE(src.seq)) {
    throw py::value_error("pack_sequence_as: fewer leaves than the structure holds");
  }
  return py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(src.seq, src.next++));
}

py::object pack_sequence_as(const py::handle& structure, const py::handle& flat) {
  // Any sequence of leaves; a list or tuple is used as it is.
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(flat.ptr(), "pack_sequence_as: the leaves must be a sequence"));
  check(seq.ptr() != nullptr);
  leaf_source src{seq.ptr()};
  py::object out = pack(structure.ptr(), src);
  const Py_ssize_t rest = PySequence_Fast_GET_SIZE(seq.ptr()) - src.next;
  if (rest > 0) {
    throw py::value_error("pack_sequence_as: " + std::to_string(rest) + " more leaves than the structure holds");
  }
  return out;
}

// ---- compare ---------------------------------------------------------------------------------

// Whether two sequences of keys are equal one by one (==, identity first).
bool equal_keys(const py::list& a, const py::list& b) {
  const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
  if (n != PyList_GET_SIZE(b.ptr())) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    // Held: comparing runs Python code, which must not free the keys under us.
    py::object x = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(a.ptr(), i));
    py::object y = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(b.ptr(), i));
    const int eq = PyObject_RichCompareBool(x.ptr(), y.ptr(), Py_EQ);
    check(eq >= 0);
    if (!eq) return false;
    if (PyList_GET_SIZE(a.ptr()) != n || PyList_GET_SIZE(b.ptr()) != n) return false;
  }
  return true;
}

// Whether two dicts' leaves pair up key by key when flattened: the same keys in nest's
// order. Equal key sets are not enough: keys that cannot be sorted keep each dict's own
// order, and keys without a total order (sets) may sort differently from different
// insertion orders; either way leaves would pair by position with another key's.
// `ka`: a's own keys (own_keys(a)).
bool same_key_order(PyObject* a, PyObject* b, const py::list& ka) {
  py::list kb = own_keys(b);
  if (PyList_GET_SIZE(ka.ptr()) != PyList_GET_SIZE(kb.ptr())) return false;
  // The common case: the same keys inserted in the same order give the same order
  // whichever way nest orders them.
  if (equal_keys(ka, kb)) return true;
  return equal_keys(ordered(ka), ordered(kb));
}

// True when `a` and `b` have the same nesting (distvals.nest.structure_mismatch is None):
// the same container types (any two lists count as the same), the same lengths, the same
// dict keys, and leaves in the same places.
bool same(PyObject* a, PyObject* b) {
  const bool an = is_container(a);
  const bool bn = is_container(b);
  if (!an && !bn) return true;
  if (an != bn) return false;
  if (!same_kind(a, b)) return false;
  Py_ssize_t na = 0;
  Py_ssize_t nb = 0;
  if (flat_in_order(a, na) && flat_in_order(b, nb)) return same_flat_keys(a, b);
  recursion_guard guard(" in nest.structure_mismatch");
  if (is_mapping(a)) {
    py::list keys = own_keys(a);
    if (!same_key_order(a, b, keys)) return false;
    for (py::handle k : keys) {
      py::object x = item_of(a, k.ptr());
      py::object y = item_of(b, k.ptr());
      if ((is_container(x.ptr()) || is_container(y.ptr())) && !same(x.ptr(), y.ptr())) return false;
    }
    return true;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
  if (n != PySequence_Fast_GET_SIZE(b)) return false;
  for (Py_ssize_t i = 0; i < n && i < PySequence_Fast_GET_SIZE(a) && i < PySequence_Fast_GET_SIZE(b); ++i) {
    py::object x = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(a, i));
    py::object y = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(b, i));
    if ((is_container(x.ptr()) || is_container(y.ptr())) && !same(x.ptr(), y.ptr())) return false;
  }
  return true;
}

// ---- regroup ---------------------------------------------------------------------------------

// N replicas' structures of the same nesting as one structure whose leaves are instances
// of `cls` (a DistributedValues class) over the N replicas' leaves, made without its
// constructor (each column is a tuple of N by construction); a leaf that is the very same
// object on every replica stays as it is unless `always_wrap`. None when the nestings
// differ: the caller names the difference.
// numpy's bool scalar type, set when the module is registered (numpy is imported then).
PyObject* g_numpy_bool = nullptr;

// Whether a leaf that is the same object on every replica says that the replicas share
// it: not for numpy bools, of which numpy keeps one True and one False, so that every
// replica's own np.any(x) would be taken for one shared value.
bool shared_by_identity(PyObject* leaf) { return reinterpret_cast<PyObject*>(Py_TYPE(leaf)) != g_numpy_bool; }

PyObject* values_name() {
  static PyObject* name = PyUnicode_InternFromString("_values");
  return name;
}

// Where instances of `type` keep their `_values` slot (DistributedValues' __slots__), or
// -1 when it is not a plain writable object slot: a regroup makes a value per leaf and
// setting the slot through the attribute protocol costs a lookup and a descriptor call
// each time. The last type asked about is held, so that its address cannot be reused by
// another class while it is cached.
Py_ssize_t values_slot(PyTypeObject* type) {
  static PyObject* last = nullptr;
  static Py_ssize_t last_offset = -1;
  if (reinterpret_cast<PyObject*>(type) == last) return last_offset;
  Py_ssize_t offset = -1;
  PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), values_name());
  if (d == nullptr) {
    PyErr_Clear();
  } else {
    if (Py_TYPE(d) == &PyMemberDescr_Type) {
      const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type == T_OBJECT_EX && (m->flags & READONLY) == 0) offset = m->offset;
    }
    Py_DECREF(d);
  }
  Py_INCREF(type);
  Py_XSETREF(last, reinterpret_cast<PyObject*>(type));
  last_offset = offset;
  return offset;
}

// The leaf of the regrouped structure for one column of leaves (x[r]: replica r's): the
// leaf itself when it is the very same object on every replica (unless `always_wrap`),
// else a new `type` instance over the column, made without its constructor.
PyObject* column_leaf(PyObject* const* x, Py_ssize_t n, PyTypeObject* type, bool always_wrap) {
  bool whole = !always_wrap && shared_by_identity(x[0]);
  for (Py_ssize_t r = 1; r < n && whole; ++r) whole = x[r] == x[0];
  if (whole) {
    Py_INCREF(x[0]);
    return x[0];
  }
  py::tuple column(n);
  for (Py_ssize_t r = 0; r < n; ++r) {
    Py_INCREF(x[r]);
    PyTuple_SET_ITEM(column.ptr(), r, x[r]);
  }
  static PyObject* no_args = PyTuple_New(0);  // kept for the process
  PyObject* made = type->tp_new(type, no_args, nullptr);
  check(made != nullptr);
  py::object obj = py::reinterpret_steal<py::object>(made);
  const Py_ssize_t offset = values_slot(type);
  if (offset > 0) {
    // The slot, freshly made and so empty, takes the column straight.
    auto** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj.ptr()) + offset);
    Py_XSETREF(*slot, column.release().ptr());
  } else {
    check(PyObject_SetAttr(obj.ptr(), values_name(), column.ptr()) == 0);
  }
  return obj.release().ptr();
}

// regroup of flat, in-order dicts (flat_in_order) with the same keys (the gradients a
// step returns by name): one walk through all of them side by side, building the result
// dict as it goes, instead of listing each replica's leaves and packing them again. The
// objects it makes may start the garbage collector, whose finalizers run Python code: each
// key and column is held before anything is made, and the keys are compared as they come.
py::object regroup_flat_dicts(const std::vector<py::object>& vs, PyTypeObject* type, bool always_wrap) {
  const auto n = static_cast<Py_ssize_t>(vs.size());
  std::vector<Py_ssize_t> pos(vs.size(), 0);
  std::vector<PyObject*> column(vs.size(), nullptr);
  std::vector<py::object> held(vs.size());
  // Replica 0's dict copied, then each value replaced (see pack).
  py::object out = py::reinterpret_steal<py::object>(PyDict_Copy(vs[0].ptr()));
  check(out.ptr() != nullptr);
  PyObject* key = nullptr;
  PyObject* other_key = nullptr;
  Py_ssize_t walked = 0;
  while (PyDict_Next(vs[0].ptr(), &pos[0], &key, &column[0])) {
    py::object k = py::reinterpret_borrow<py::object>(key);
    held[0] = py::reinterpret_borrow<py::object>(column[0]);
    for (Py_ssize_t r = 1; r < n; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      // Checked equal before the walk (same_flat_keys): only a finalizer can change them.
      if (!PyDict_Next(vs[ri].ptr(), &pos[ri], &other_key, &column[ri]) ||
          (other_key != key && PyUnicode_Compare(other_key, key) != 0)) {
        throw py::value_error("nest_regroup: a structure changed while it was being walked");
      }
      held[ri] = py::reinterpret_borrow<py::object>(column[ri]);
    }
    py::object leaf = py::reinterpret_steal<py::object>(column_leaf(column.data(), n, type, always_wrap));
    check(PyDict_SetItem(out.ptr(), k.ptr(), leaf.ptr()) == 0);
    ++walked;
  }
  // Every key of every dict walked, and the copy holding no key left unwalked (a key a
  // finalizer removed or added meanwhile would keep replica 0's own leaf there).
  bool whole = walked == PyDict_GET_SIZE(out.ptr());
  for (std::size_t r = 0; r < vs.size() && whole; ++r) {
    whole = PyDict_GET_SIZE(vs[r].ptr()) == walked && (r == 0 || !PyDict_Next(vs[r].ptr(), &pos[r], &other_key, &column[r]));
  }
  if (!whole) throw py::value_error("nest_regroup: a structure changed while it was being walked");
  return out;
}

py::object regroup(const py::sequence& per_replica, const py::handle& cls, bool always_wrap) {
  if (!PyType_Check(cls.ptr())) throw py::type_error("nest_regroup: cls must be a class");
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  if (type->tp_new == nullptr) throw py::type_error("nest_regroup: cls cannot make instances");
  const auto n = static_cast<Py_ssize_t>(py::len(per_replica));
  if (n < 1) throw py::value_error("nest_regroup: no replicas");
  std::vector<py::object> vs;
  vs.reserve(static_cast<std::size_t>(n));
  for (Py_ssize_t r = 0; r < n; ++r) vs.push_back(per_replica[static_cast<std::size_t>(r)]);
  PyObject* v0 = vs[0].ptr();
  // The commonest result of a step, a flat dict of arrays by name: one walk.
  Py_ssize_t size = 0;
  bool flat = flat_in_order(v0, size);
  for (Py_ssize_t r = 1; r < n && flat; ++r) {
    PyObject* v = vs[static_cast<std::size_t>(r)].ptr();
    flat = flat_in_order(v, size) && same_flat_keys(v0, v);
  }
  if (flat) return regroup_flat_dicts(vs, type, always_wrap);
  std::vector<py::list> flats;
  flats.reserve(static_cast<std::size_t>(n));
  for (Py_ssize_t r = 0; r < n; ++r) {
    PyObject* v = vs[static_cast<std::size_t>(r)].ptr();
    if (r > 0 && !same(v0, v)) return py::none();
    flats.push_back(flatten(v));
  }
  const Py_ssize_t count = PyList_GET_SIZE(flats[0].ptr());
  for (Py_ssize_t r = 1; r < n; ++r) {
    if (PyList_GET_SIZE(flats[static_cast<std::size_t>(r)].ptr()) != count) {
      // Only Python code run by the walk (a key's comparison) can do this.
      throw py::value_error("nest_regroup: a structure changed while it was being walked");
    }
  }
  py::list leaves(count);
  std::vector<PyObject*> column(static_cast<std::size_t>(n), nullptr);
  for (Py_ssize_t i = 0; i < count; ++i) {
    for (Py_ssize_t r = 0; r < n; ++r) column[static_cast<std::size_t>(r)] = PyList_GET_ITEM(flats[static_cast<std::size_t>(r)].ptr(), i);
    PyList_SET_ITEM(leaves.ptr(), i, column_leaf(column.data(), n, type, always_wrap));
  }
  return pack_sequence_as(vs[0], leaves);
}

// The leaves of `structure` when every one is a numpy array (exactly, no subclass) whose
// dtype's type number is a bit of `type_nums`; None otherwise. One walk for what an inline
// replica checks before it sends a structure to the one-call all-reduce.
py::object leaf_arrays(const py::handle& structure, std::uint64_t type_nums) {
  py::list leaves = flatten(structure);
  const auto* array_type = reinterpret_cast<PyTypeObject*>(py::detail::npy_api::get().PyArray_Type_);
  for (py::handle x : leaves) {
    if (Py_TYPE(x.ptr()) != array_type) return py::none();
    const int num = py::detail::array_descriptor_proxy(py::detail::array_proxy(x.ptr())->descr)->type_num;
    if (num < 0 || num >= 64 || ((type_nums >> num) & 1u) == 0) return py::none();
  }
  return std::move(leaves);
}

}  // namespace

bool nest_same(PyObject* a, PyObject* b) { return same(a, b); }

py::object nest_pack(const py::handle& structure, const py::handle& flat) { return pack_sequence_as(structure, flat); }

void register_nest(py::module_& m) {
  g_numpy_bool = py::object(py::module_::import("numpy").attr("bool_")).release().ptr();  // kept for the process
  m.def("nest_flatten", &flatten, py::arg("structure"), "The leaves of a structure in distvals.nest's order.");
  m.def("nest_pack", &pack_sequence_as, py::arg("structure"), py::arg("flat"),
        "The structure with its leaves replaced, in flatten's order, by those of `flat`.");
  m.def(
      "nest_same", [](const py::handle& a, const py::handle& b) { return same(a.ptr(), b.ptr()); }, py::arg("a"),
      py::arg("b"), "True when the two structures have the same nesting.");
  m.def("nest_leaf_arrays", &leaf_arrays, py::arg("structure"), py::arg("type_nums"),
        "The leaves of a structure when all are numpy arrays whose dtype number is a bit of type_nums; "
        "else None.");
  m.def("nest_regroup", &regroup, py::arg("per_replica"), py::arg("cls"), py::arg("always_wrap") = false,
        "The replicas' structures as one structure of `cls` leaves over the replicas' leaves (None when "
        "the nestings differ).");
}

}  // namespace distvals_py
