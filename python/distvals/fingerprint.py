"""``fingerprint``: 62 bits that tell values apart the same way in every process.

Workers compare values they were meant to share (a global batch after an input error,
a non-distributed value a collective reduces on each worker alone) by exchanging a
fingerprint instead of the values.
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any, List

import numpy as np

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


def object_bytes(x: Any, out: List[Any]) -> None:
    """Appends to ``out`` bytes that determine ``x`` and read the same in every process:
    an array's dtype, shape and data (an object array's elements one by one), a
    Python value's type and value, a container's kind, size and items (a set's in an
    order of their own bytes: a set of strings iterates in another order in each
    process). Other objects go by their pickle; one that cannot be pickled is a
    TypeError, since it could not be compared."""
    if isinstance(x, np.ndarray):
        out.append(f"a{x.dtype.str}{x.shape};".encode())
        if x.dtype.hasobject:
            for item in x.reshape(-1):
                object_bytes(item, out)
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
    elif isinstance(x, (list, tuple, dict)):
        items = list(x.items()) if isinstance(x, dict) else x
        out.append(f"{type(x).__name__}{len(items)};".encode())
        for item in items:
            object_bytes(item, out)
    elif isinstance(x, (set, frozenset)):
        members = []
        for item in x:
            part: List[Any] = []
            object_bytes(item, part)
            members.append(b"".join(bytes(p) for p in part))
        out.append(f"{type(x).__name__}{len(members)};".encode())
        out.extend(sorted(members))
    else:
        try:
            data = pickle.dumps(x, protocol=4)
        except Exception as e:  # noqa: BLE001 - any failure to pickle is the same here
            raise TypeError(
                f"a {type(x).__name__} object cannot be fingerprinted (it cannot be pickled: {e})"
            ) from None
        out.append(f"p{len(data)};".encode())
        out.append(data)
