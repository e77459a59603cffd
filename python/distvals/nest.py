"""Nested structures of values: lists, tuples, namedtuples and mappings.

A mapping is a dict or any ``collections.abc.Mapping`` (an OrderedDict, a
``types.MappingProxyType``, a class of your own that subclasses or registers with
Mapping), as ``tf.nest`` walks them. Everything else (arrays, numbers, None,
DistributedValues, variables) is a leaf. Mappings flatten in sorted key order, as in
``tf.nest`` (in their own order when the keys cannot be sorted); packing rebuilds each
container with its own type (and the mapping's own key order): a dict subclass from a
shallow copy of it, another Mapping by calling its class with a dict of its items. Any two
mappings are of one kind (a dict matches an OrderedDict), as are any two lists. Two
mappings have the same nesting when their keys, in that order, are equal one by one:
equal key sets in orders that would pair one mapping's leaves with another key's are a
mismatch, never a silent pairing by position.
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence

from . import _core

__all__ = [
    "assert_same_structure",
    "describe",
    "flatten",
    "is_mapping",
    "is_nested",
    "layout",
    "map_structure",
    "pack_sequence_as",
    "paths",
    "structure_mismatch",
]


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


#: CPython's type flag of mapping classes (``Py_TPFLAGS_MAPPING``): set on dict, on
#: subclasses of collections.abc.Mapping and by ``Mapping.register``, so a look at it tells
#: a mapping without an isinstance call against the ABC.
_MAPPING_FLAG = 1 << 6


def is_mapping(x: Any) -> bool:
    """True for the mappings nest walks into: a dict or any collections.abc.Mapping."""
    return bool(type(x).__flags__ & _MAPPING_FLAG)


def is_nested(x: Any) -> bool:
    """True for the containers nest walks into: list, tuple (namedtuple too), a dict or
    any other collections.abc.Mapping."""
    return isinstance(x, (list, tuple)) or bool(type(x).__flags__ & _MAPPING_FLAG)


def _sorted_keys(d: Mapping[Any, Any]) -> List[Any]:
    try:
        return sorted(d)
    except TypeError:
        # Keys of mixed types cannot be sorted; keep insertion order, still deterministic.
        return list(d)


# The walks run in C++ (_core's nest.cpp), to the rules above: every step flattens,
# compares and packs its structures several times, and in Python each walk cost
# microseconds, more than a small collective.

#: ``flatten(structure)``: the leaves of ``structure``, depth first, a mapping's values in
#: sorted key order (its own order when its keys cannot be sorted).
flatten: Callable[[Any], List[Any]] = _core.nest_flatten

#: ``pack_sequence_as(structure, flat)``: ``structure`` with its leaves replaced, in
#: ``flatten``'s order, by ``flat``; each container rebuilt with its own type, each mapping
#: with its own key order. ValueError when ``flat`` holds more or fewer leaves.
pack_sequence_as: Callable[[Any, Sequence[Any]], Any] = _core.nest_pack

_same = _core.nest_same


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Applies ``fn`` to corresponding leaves; the structures must match."""
    if not structures:
        raise ValueError("map_structure needs at least one structure")
    first = structures[0]
    for i, s in enumerate(structures[1:], 1):
        why = structure_mismatch(first, s)
        if why is not None:
            raise ValueError(f"map_structure: structure {i} differs from structure 0: {why}")
    flats = [flatten(s) for s in structures]
    return pack_sequence_as(first, [fn(*leaves) for leaves in zip(*flats)])


def _same_kind(a: Any, b: Any) -> bool:
    """Containers of one kind: the same type, any two lists, any two mappings,
    namedtuples of the same name and fields (as the C++ walk and tf.nest count them)."""
    if type(a) is type(b) or (isinstance(a, list) and isinstance(b, list)) or (is_mapping(a) and is_mapping(b)):
        return True
    return (
        _is_namedtuple(a)
        and _is_namedtuple(b)
        and (type(a).__name__, type(a)._fields) == (type(b).__name__, type(b)._fields)
    )


def describe(x: Any) -> str:
    """A short name of the container kind of ``x`` (for error messages)."""
    if _is_namedtuple(x):
        return f"{type(x).__name__}({', '.join(type(x)._fields)}) namedtuple"
    if is_nested(x):
        return f"{type(x).__name__} of {len(x)}"
    return "a single value"


def layout(x: Any) -> str:
    """The nesting of ``x`` written out, every container's kind and keys included and
    each leaf as ``*``: ``{'b': [*, (*,)], 'w': *}``. Two values have the same nesting
    exactly when their layouts are equal (descriptions compared across processes)."""
    if _is_namedtuple(x):
        fields = ", ".join(f"{f}={layout(v)}" for f, v in zip(type(x)._fields, x))
        return f"{type(x).__name__}({fields})"
    if isinstance(x, list):
        return "[" + ", ".join(layout(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(layout(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if is_mapping(x):
        return "{" + ", ".join(f"{k!r}: {layout(x[k])}" for k in _sorted_keys(x)) + "}"
    return "*"


def structure_mismatch(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None when ``a`` and ``b`` have the same nesting, else a description of the first
    difference (with its path)."""
    # The common case (the same nesting) is one walk in C++; the description, with the
    # path built from the keys on the way down, only for a difference.
    if _same(a, b):
        return None
    keys: List[str] = []
    why = _mismatch(a, b, keys)
    if why is None:
        return None
    where = path + "".join(keys)
    return f"at {where or 'the top level'}: {why}"


def _mismatch(a: Any, b: Any, keys: List[str]) -> Optional[str]:
    """The first difference below ``a`` and ``b``, without its place; ``keys`` gets the
    path to it, outermost first."""
    a_nested = is_nested(a)
    b_nested = is_nested(b)
    if not a_nested and not b_nested:
        return None
    if a_nested != b_nested or not _same_kind(a, b):
        return f"{describe(a)} vs {describe(b)}"
    if is_mapping(a):
        kind = "dict" if isinstance(a, dict) and isinstance(b, dict) else "mapping"
        if a.keys() != b.keys():
            ka, kb = sorted(map(repr, a)), sorted(map(repr, b))
            text = f"{kind} keys {ka} vs {kb}"
            if ka == kb:
                text += " (keys that print alike but are not equal, such as NaN, or objects equal only to themselves)"
            return text
        if list(a) != list(b):
            # The same keys in another insertion order: their leaves pair up only if nest
            # orders both the same way (keys that cannot be sorted keep each mapping's own
            # order; keys without a total order, such as sets, may sort either way).
            ka, kb = _sorted_keys(a), _sorted_keys(b)
            if ka != kb:
                return (
                    f"{kind} keys in another order, {ka!r} vs {kb!r} (keys that cannot be "
                    f"sorted must be in the same order in every {kind})"
                )
        for k, x in a.items():
            if is_nested(x) or is_nested(b[k]):
                break
        else:
            return None  # the same keys, leaves only (no need to sort them)
        for k in _sorted_keys(a):
            x, y = a[k], b[k]
            if is_nested(x) or is_nested(y):
                why = _mismatch(x, y, keys)
                if why is not None:
                    keys.insert(0, f"[{k!r}]")
                    return why
        return None
    if len(a) != len(b):
        return f"{describe(a)} vs {describe(b)}"
    for i, x in enumerate(a):
        y = b[i]
        if is_nested(x) or is_nested(y):
            why = _mismatch(x, y, keys)
            if why is not None:
                keys.insert(0, f"[{i}]")
                return why
    return None


def assert_same_structure(a: Any, b: Any) -> None:
    """Raises ValueError describing the first difference between the nestings."""
    why = structure_mismatch(a, b)
    if why is not None:
        raise ValueError(f"the two structures differ {why}")


def paths(structure: Any) -> List[str]:
    """Where each leaf of ``structure`` sits, in ``flatten`` order: ``""`` for a single
    value, else ``"[0]"``, ``"['weights']"``, ``"['layer'][1]"`` (for error messages)."""
    out: List[str] = []
    _paths_into(structure, "", out)
    return out


def _paths_into(x: Any, path: str, out: List[str]) -> None:
    if isinstance(x, (list, tuple)):
        for i, item in enumerate(x):
            _paths_into(item, f"{path}[{i}]", out)
    elif is_mapping(x):
        for k in _sorted_keys(x):
            _paths_into(x[k], f"{path}[{k!r}]", out)
    else:
        out.append(path)
