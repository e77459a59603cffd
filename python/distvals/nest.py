"""Nested structures of values: lists, tuples, dicts and namedtuples.

Everything else (arrays, numbers, None, DistributedValues, variables) is a leaf.
Dicts flatten in sorted key order, as in ``tf.nest``; packing rebuilds each container
with its own type (and the dict's own key order).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

__all__ = [
    "assert_same_structure",
    "describe",
    "flatten",
    "is_nested",
    "map_structure",
    "pack_sequence_as",
    "paths",
    "structure_mismatch",
]


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_nested(x: Any) -> bool:
    """True for the containers nest walks into: list, tuple (namedtuple too), dict."""
    return isinstance(x, (list, tuple, dict))


def _sorted_keys(d: Dict[Any, Any]) -> List[Any]:
    try:
        return sorted(d)
    except TypeError:
        # Keys of mixed types cannot be sorted; keep insertion order, still deterministic.
        return list(d)


def _plain(structure: Any) -> bool:
    """A plain list or tuple of leaves (run's arguments, most often): no walk needed."""
    kind = type(structure)
    if kind is not list and kind is not tuple:
        return False
    for x in structure:  # noqa: SIM110 - a loop, not all(): it runs for every argument of every step
        if isinstance(x, (list, tuple, dict)):
            return False
    return True


def flatten(structure: Any) -> List[Any]:
    """The leaves of ``structure`` in a deterministic order."""
    if _plain(structure):
        return list(structure)
    if type(structure) is dict:
        # A flat dict (a model's gradients by name, most often): its values in key order.
        out = [structure[k] for k in _sorted_keys(structure)]
        for x in out:  # a loop, not any(): it runs for every step's structure
            if isinstance(x, (list, tuple, dict)):
                break
        else:
            return out
    out = []
    _flatten_into(structure, out)
    return out


def _flatten_into(x: Any, out: List[Any]) -> None:
    if isinstance(x, (list, tuple)):
        for item in x:
            if isinstance(item, (list, tuple, dict)):
                _flatten_into(item, out)
            else:
                out.append(item)
    elif isinstance(x, dict):
        for k in _sorted_keys(x):
            item = x[k]
            if isinstance(item, (list, tuple, dict)):
                _flatten_into(item, out)
            else:
                out.append(item)
    else:
        out.append(x)


def _rebuild(template: Any, items: List[Any]) -> Any:
    if _is_namedtuple(template):
        return type(template)(*items)
    if isinstance(template, tuple):
        return tuple(items) if type(template) is tuple else type(template)(items)
    if isinstance(template, list):
        return items if type(template) is list else type(template)(items)
    raise TypeError(f"cannot rebuild a {type(template).__name__}")


def pack_sequence_as(structure: Any, flat: Sequence[Any]) -> Any:
    """``structure`` with its leaves replaced, in order, by ``flat``."""
    if _plain(structure) and len(flat) == len(structure):
        return list(flat) if type(structure) is list else tuple(flat)
    if type(structure) is dict and len(flat) == len(structure):
        flat_dict = _pack_flat_dict(structure, flat)
        if flat_dict is not None:
            return flat_dict
    it = iter(flat)
    result = _pack(structure, it)
    rest = sum(1 for _ in it)
    if rest:
        raise ValueError(f"pack_sequence_as: {rest} more leaves than the structure holds")
    return result


def _pack_flat_dict(structure: Dict[Any, Any], flat: Sequence[Any]) -> Optional[Dict[Any, Any]]:
    """``pack_sequence_as`` of a dict whose values are all leaves (None when some is not):
    the leaves come in sorted key order, the dict keeps its own order."""
    for x in structure.values():
        if isinstance(x, (list, tuple, dict)):
            return None
    by_key = dict(zip(_sorted_keys(structure), flat))
    return {k: by_key[k] for k in structure}


def _pack(x: Any, it: Iterator[Any]) -> Any:
    if isinstance(x, (list, tuple)):
        return _rebuild(x, [_pack(item, it) for item in x])
    if isinstance(x, dict):
        values = {k: _pack(x[k], it) for k in _sorted_keys(x)}
        # Keep the dict's own type and key order.
        out = type(x)() if type(x) is not dict else {}
        for k in x:
            out[k] = values[k]
        return out
    try:
        return next(it)
    except StopIteration:
        raise ValueError("pack_sequence_as: fewer leaves than the structure holds") from None


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


def describe(x: Any) -> str:
    """A short name of the container kind of ``x`` (for error messages)."""
    if _is_namedtuple(x):
        return f"{type(x).__name__} namedtuple of {len(x)}"
    if isinstance(x, (list, tuple, dict)):
        return f"{type(x).__name__} of {len(x)}"
    return "a single value"


def structure_mismatch(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None when ``a`` and ``b`` have the same nesting, else a description of the first
    difference (with its path)."""
    # The common case (the same nesting) builds no path text: it is made only for the
    # difference found, from the keys on the way down.
    keys: List[str] = []
    why = _mismatch(a, b, keys)
    if why is None:
        return None
    where = path + "".join(keys)
    return f"at {where or 'the top level'}: {why}"


def _mismatch(a: Any, b: Any, keys: List[str]) -> Optional[str]:
    """The first difference below ``a`` and ``b``, without its place; ``keys`` gets the
    path to it, outermost first."""
    a_nested = isinstance(a, (list, tuple, dict))
    b_nested = isinstance(b, (list, tuple, dict))
    if not a_nested and not b_nested:
        return None
    if a_nested != b_nested or (type(a) is not type(b) and not (isinstance(a, list) and isinstance(b, list))):
        return f"{describe(a)} vs {describe(b)}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"dict keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        for k, x in a.items():
            if isinstance(x, (list, tuple, dict)) or isinstance(b[k], (list, tuple, dict)):
                break
        else:
            return None  # the same keys, leaves only (no need to sort them)
        for k in _sorted_keys(a):
            x, y = a[k], b[k]
            if isinstance(x, (list, tuple, dict)) or isinstance(y, (list, tuple, dict)):
                why = _mismatch(x, y, keys)
                if why is not None:
                    keys.insert(0, f"[{k!r}]")
                    return why
        return None
    if len(a) != len(b):
        return f"{describe(a)} vs {describe(b)}"
    for i, x in enumerate(a):
        y = b[i]
        if isinstance(x, (list, tuple, dict)) or isinstance(y, (list, tuple, dict)):
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
    elif isinstance(x, dict):
        for k in _sorted_keys(x):
            _paths_into(x[k], f"{path}[{k!r}]", out)
    else:
        out.append(path)
