"""Zero-copy conversion of array-likes to host numpy arrays, for the engine."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_host_array(obj: Any, replica: int) -> np.ndarray:
    """Return ``obj`` as a numpy array sharing its memory.

    Accepts numpy arrays, objects with ``__dlpack__`` living in host memory (torch CPU
    tensors, TensorFlow eager tensors, jax arrays) and buffer-protocol objects
    (``memoryview``, ``bytearray``, ``array.array``). Raises TypeError naming the replica
    for anything else, such as Python lists, which would need a copy: the engine works
    in place and a copy would silently drop the result.
    """
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise TypeError(
                f"replica {replica}: cannot view {type(obj).__name__} through DLPack "
                f"without a copy ({e}); device arrays need a GPU group"
            ) from None
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"replica {replica}: expected an array (numpy, DLPack or buffer protocol), "
            f"got {type(obj).__name__}; convert it with numpy.asarray first"
        ) from None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as e:
        raise TypeError(f"replica {replica}: unsupported buffer ({e})") from None
