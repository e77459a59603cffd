"""``v[key]`` of a variable: the value of that part, which can also write it back.

TensorFlow users write ``v[2:5].assign(x)`` (and ``v[0, :].assign(row)``): indexing a
variable gives a tensor of that part, and its ``assign`` writes the part of the variable.
Here the part is a read-only numpy array (the variable's value is an immutable snapshot)
of a small ndarray subclass, ``VariableSlice``, that remembers the variable and the key.

``assign`` goes through the variable's ``scatter_nd_update`` with the index of every
element the key selects, so it follows that update's rules everywhere: the lock of a
single-copy variable, every copy of a mirrored variable in cross-replica context, the
aggregation inside ``strategy.run`` (NONE or ONLY_FIRST_REPLICA; SUM and MEAN refuse, as
a replica's overwrite has no sum), the value checks (dtype kept strictly), and nothing
written when they fail. A read-modify-write of the whole value would be wrong under SUM
(every replica's copy of the untouched elements would be added up). A sync-on-read
variable in cross-replica context, whose copies change only as a whole there, is the
exception: its aggregate value with the part replaced is assigned.

Everything computed from the part is a plain ndarray (arithmetic, numpy functions,
further indexing drops the link), so ``assign`` is only on the part read from the
variable. Indexing that gives a scalar (``v[1]`` of a vector) gives numpy's scalar, as
before: a scalar cannot carry a method, and ``v[1:2].assign(...)`` writes one element.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from .values import DistributedValues

if TYPE_CHECKING:
    from .variables import Variable

__all__ = ["VariableSlice", "slice_of"]


def _plain(x: Any) -> Any:
    """``x`` as a plain ndarray when it is a VariableSlice (tuples and lists of them
    too)."""
    if isinstance(x, VariableSlice):
        return x.view(np.ndarray)
    if type(x) is tuple or type(x) is list:
        return type(x)(_plain(y) for y in x)
    return x


class VariableSlice(np.ndarray):
    """The value of ``variable[key]`` (read-only), whose ``assign`` writes that part of
    the variable (see the module doc)."""

    _variable: Optional[Variable] = None
    _key: Any = None

    def __array_finalize__(self, obj: Any) -> None:
        # Views and copies of a part are not the part: only ``slice_of`` links one.
        self._variable = None
        self._key = None

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        # Arithmetic on a part gives plain arrays (and numpy's scalars).
        if "out" in kwargs:
            kwargs["out"] = _plain(kwargs["out"])
        return getattr(ufunc, method)(*_plain(inputs), **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        # numpy's own implementation (as for any subclass), its result made plain.
        return _plain(super().__array_function__(func, types, args, kwargs))

    def __getitem__(self, key: Any) -> Any:
        return self.view(np.ndarray)[key]

    def __reduce__(self) -> Any:
        # Pickled (or deep-copied) as the plain array it holds.
        return self.view(np.ndarray).__reduce__()

    def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        """Sets this part of the variable to ``value`` (broadcast to the part's shape, as
        numpy's ``a[key] = value``); returns the variable (None with
        ``read_value=False``), as ``tf.Variable.__getitem__(...).assign`` does."""
        var = self._variable
        if var is None:
            raise TypeError(
                "assign on an array computed from a variable's part: only the part read by "
                "indexing the variable (v[key].assign(x)) writes back to it"
            )
        indices = _indices_of(tuple(var.shape), self._key)
        part_shape = indices.shape[:-1]
        if not isinstance(value, DistributedValues):
            value = np.asarray(value)
            if value.shape != part_shape:
                try:
                    value = np.broadcast_to(value, part_shape)
                except ValueError:
                    raise ValueError(
                        f"assign to {_describe(self._key)} of variable '{var.name}': a value of shape "
                        f"{value.shape} does not fit the part's shape {part_shape}"
                    ) from None
        from .distributed_variables import SyncOnReadVariable
        from .variables import _coerce_dtype

        if isinstance(var, SyncOnReadVariable) and var._replica_context() is None:
            # Its copies are updated only as a whole in cross-replica context: the
            # aggregate read, this part replaced (the value checked first, as any update
            # checks it), assigned back (a SUM variable stores it split over the copies).
            whole = np.array(var.read_value())
            whole[self._key] = _coerce_dtype(var, value, "assign")
            var.assign(whole)
        else:
            var.scatter_nd_update(indices, value)
        return var if read_value else None


def _indices_of(shape: Tuple[int, ...], key: Any) -> np.ndarray:
    """The index of every element ``key`` selects from an array of ``shape``, in the shape
    of the selection, with one more axis of length ``len(shape)`` (scatter_nd's indices).
    Each axis's coordinate is an arange broadcast to ``shape`` without copying, and the key
    applied to it: memory of the selection's size, not the variable's."""
    if not shape:
        return np.zeros(np.empty(())[key].shape + (0,), dtype=np.int64)
    coords = []
    for k, n in enumerate(shape):
        axis = np.arange(n, dtype=np.int64).reshape((n,) + (1,) * (len(shape) - 1 - k))
        coords.append(np.asarray(np.broadcast_to(axis, shape)[key]))
    return np.stack(coords, axis=-1)


def _describe(key: Any) -> str:
    return f"[{key!r}]" if not isinstance(key, tuple) else f"[{', '.join(repr(k) for k in key)}]"


def slice_of(variable: Variable, value: Any, key: Any) -> Any:
    """``value[key]`` (``value`` read from ``variable``), linked back to the variable when
    it is an array of the host (see the module doc)."""
    from . import devices

    if devices.is_device_array(value):
        raise TypeError(
            f"variable '{variable.name}'[{key!r}]: its value is a DeviceArray on a GPU, which has no "
            "indexing; read a part with v.numpy()[key] (a host copy) and write one with "
            "v.scatter_nd_update(indices, updates)"
        )
    part = value[key]
    if type(part) is not np.ndarray:
        return part
    out = part.view(VariableSlice)
    # Read-only like the value it comes from (a fancy index gives a copy): writing into
    # it would change nothing of the variable; ``assign`` does.
    out.flags.writeable = False
    out._variable = variable
    out._key = key
    return out
