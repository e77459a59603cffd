"""``fingerprint``: 62 bits that tell values apart the same way in every process.

Workers compare values they were meant to share (a global batch after an input error,
a non-distributed value a collective reduces on each worker alone) by exchanging a
fingerprint instead of the values.
"""

from __future__ import annotations

import pickle
import types
import zlib
from typing import Any, Iterator, List, Optional, Set

import numpy as np

from . import nest

__all__ = ["fingerprint", "object_bytes"]


def fingerprint(leaves: Any) -> int:
    """A 62-bit fingerprint of arrays' dtypes, shapes and bytes: CRC-32 and Adler-32,
    which zlib computes at memory speed, side by side (so it fits the int64 exchange)."""
    crc, adler = 0, 1
    for a in leaves:
        parts: List[Any] = []
        object_bytes(a, parts)
        for data in parts:
            crc, adler = zlib.crc32(data, crc), zlib.adler32(data, adler)
    return ((crc << 30) ^ adler) & ((1 << 62) - 1)


def object_bytes(x: Any, out: List[Any], _open: Optional[Set[int]] = None) -> None:
    """Appends to ``out`` bytes that determine ``x`` and read the same in every process:
    an array's dtype, shape and data (an object array's elements one by one), a
    Python value's type and value, a container's kind, size and items (a set's in an
    order of their own bytes: a set of strings iterates in another order in each
    process). Any other object goes by what pickling it is made of (``__reduce_ex__``:
    the callable that rebuilds it, by name, and its arguments and state, each in these
    terms), so that a set inside it, or equal strings that are one object in one
    process and two in another (pickle's memo would tell them apart), read the same.
    A container that holds itself reads as a reference back. An object that cannot be
    pickled is a TypeError, since it could not be compared."""
    if _open is None:
        _open = set()
    if isinstance(x, np.ndarray):
        out.append(f"a{x.dtype.str}{x.shape};".encode())
        if x.dtype.hasobject:
            _items(x.reshape(-1), x, out, _open)
        else:
            out.append(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    elif isinstance(x, np.generic):
        out.append(f"g{x.dtype.str};".encode())
        out.append(x.tobytes())
    elif x is None or isinstance(x, (bool, int, float, complex)):
        # repr is exact for these (a float's round-trips; -0.0 is not 0.0).
        out.append(f"{type(x).__name__}:{x!r};".encode())
    elif isinstance(x, (str, bytes, bytearray)):
        data = x.encode("utf-8", "surrogatepass") if isinstance(x, str) else bytes(x)
        out.append(f"{type(x).__name__}{len(data)};".encode())
        out.append(data)
    elif nest.is_nested(x):
        # (Any Mapping by its items, as distvals.nest walks it.)
        items = list(x.items()) if nest.is_mapping(x) else x
        out.append(f"{type(x).__name__}{len(items)};".encode())
        _items(items, x, out, _open)
    elif isinstance(x, (set, frozenset)):
        members = []
        for item in x:
            part: List[Any] = []
            object_bytes(item, part, _open)
            members.append(b"".join(bytes(p) for p in part))
        out.append(f"{type(x).__name__}{len(members)};".encode())
        out.extend(sorted(members))
    elif isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)) or x is Ellipsis:
        # Pickled by name: the same in every process.
        _pickled(x, out)
    else:
        _reduced(x, out, _open)


def _items(items: Any, owner: Any, out: List[Any], _open: Set[int]) -> None:
    """The items of container ``owner``, in order; ``owner`` itself among them (or
    deeper) reads as a reference back instead of recursing forever."""
    key = id(owner)
    if key in _open:
        out.append(b"cycle;")
        return
    _open.add(key)
    try:
        for item in items:
            if id(item) in _open:
                out.append(b"cycle;")
            else:
                object_bytes(item, out, _open)
    finally:
        _open.discard(key)


def _reduced(x: Any, out: List[Any], _open: Set[int]) -> None:
    """An object by the parts pickle rebuilds it from: ``__reduce_ex__``'s callable (by
    name) and arguments, state, list items and dict items."""
    try:
        parts = x.__reduce_ex__(4)
    except Exception as e:  # noqa: BLE001 - any failure to pickle is the same here
        raise _unpicklable(x, e) from None
    if isinstance(parts, str):  # a global, by name
        out.append(f"r{parts};".encode())
        return
    parts = tuple(list(p) if isinstance(p, Iterator) else p for p in parts)
    out.append(f"o{len(parts)};".encode())
    _pickled(parts[0], out)
    _items(parts[1:], x, out, _open)


def _pickled(x: Any, out: List[Any]) -> None:
    try:
        data = pickle.dumps(x, protocol=4)
    except Exception as e:  # noqa: BLE001 - any failure to pickle is the same here
        raise _unpicklable(x, e) from None
    out.append(f"p{len(data)};".encode())
    out.append(data)


def _unpicklable(x: Any, e: Exception) -> TypeError:
    return TypeError(f"a {type(x).__name__} object cannot be fingerprinted (it cannot be pickled: {e})")
