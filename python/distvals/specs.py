"""Type specifications of dataset elements: ``TensorSpec``, ``PerReplicaSpec`` and
``DatasetSpec``.

``element_spec`` of a ``distvals.data.Dataset``, of a distributed dataset and of its
iterator describes each element without producing it, as TensorFlow's does: one
``TensorSpec(shape, dtype)`` per leaf (an unknown dimension is None, as the batch
dimension of a dataset whose last batch may be smaller), nested like the elements; a
distributed dataset of several replicas gives each leaf a ``PerReplicaSpec`` holding one
spec per replica.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import nest

__all__ = ["DatasetSpec", "PerReplicaSpec", "TensorSpec", "from_tensorflow", "spec_of", "unbatched", "with_batch"]

Shape = Optional[Tuple[Optional[int], ...]]


class TensorSpec:
    """The shape (None for unknown dimensions, or for an unknown rank) and numpy dtype of
    an array, as ``tf.TensorSpec``."""

    __slots__ = ("_dtype", "_name", "_shape")

    def __init__(self, shape: Any, dtype: Any = np.float32, name: Optional[str] = None) -> None:
        self._shape: Shape = None if shape is None else tuple(None if d is None else int(d) for d in shape)
        self._dtype: np.dtype[Any] = np.dtype(dtype)
        self._name = name

    @property
    def shape(self) -> Shape:
        """The shape as a tuple, None for each unknown dimension (such as the batch
        dimension when the last batch may be smaller); None for an unknown rank."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the arrays the spec describes."""
        return self._dtype

    @property
    def name(self) -> Optional[str]:
        """The name given to the constructor, or None (it takes part in ``==``, not in
        ``is_compatible_with``)."""
        return self._name

    def is_compatible_with(self, value: Any) -> bool:
        """True when ``value`` (an array, or another spec) fits this spec."""
        shape = value.shape
        dtype = value.dtype
        if np.dtype(dtype) != self._dtype:
            return False
        if self._shape is None or shape is None:
            return True
        return len(shape) == len(self._shape) and all(
            a is None or b is None or a == b for a, b in zip(self._shape, shape)
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorSpec)
            and other._shape == self._shape
            and other._dtype == self._dtype
            and other._name == self._name
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((self._shape, self._dtype.str, self._name))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self._shape}, dtype={self._dtype.name}, name={self._name!r})"


class PerReplicaSpec:
    """The specs of a PerReplica value's parts, one per replica."""

    __slots__ = ("_value_specs",)

    def __init__(self, *value_specs: Any) -> None:
        self._value_specs = tuple(value_specs)

    @property
    def value_specs(self) -> Tuple[Any, ...]:
        return self._value_specs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerReplicaSpec) and other._value_specs == self._value_specs

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self._value_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self._value_specs))})"


class DatasetSpec:
    """The spec of an element that is itself a dataset (``window``'s): the spec of that
    dataset's elements, as ``tf.data.DatasetSpec``."""

    __slots__ = ("_element_spec",)

    def __init__(self, element_spec: Any) -> None:
        self._element_spec = element_spec

    @property
    def element_spec(self) -> Any:
        return self._element_spec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DatasetSpec) and other._element_spec == self._element_spec

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(repr(self._element_spec))

    def __repr__(self) -> str:
        return f"DatasetSpec({self._element_spec!r})"


def _leaf_spec(x: Any) -> Any:
    from .values import DistributedValues

    if isinstance(x, DistributedValues):
        return PerReplicaSpec(*(_leaf_spec(p) for p in x.values))
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        a = np.asarray(x)
        shape, dtype = a.shape, a.dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        from . import kinds

        a = kinds.to_numpy(x)
        shape, dtype = a.shape, a.dtype
    return TensorSpec(tuple(shape), dtype)


def spec_of(element: Any) -> Any:
    """The spec of one element, exactly as it is (every dimension known); a PerReplica
    leaf gives a PerReplicaSpec of its parts."""
    if nest.is_nested(element):
        return nest.map_structure(_leaf_spec, element)
    return _leaf_spec(element)


def _map(spec: Any, fn: Any) -> Any:
    if isinstance(spec, TensorSpec):
        return fn(spec)
    return nest.map_structure(fn, spec)


def unbatched(spec: Any) -> Any:
    """``spec`` with its leading dimension set to None (a batch of any size)."""
    return _map(spec, lambda s: s if not s.shape else TensorSpec((None,) + s.shape[1:], s.dtype, s.name))


def with_batch(spec: Any, size: Optional[int]) -> Any:
    """``spec`` of one element, with a new leading batch dimension of ``size``."""
    return _map(spec, lambda s: TensorSpec(None if s.shape is None else (size,) + s.shape, s.dtype, s.name))


def from_tensorflow(spec: Any) -> Any:
    """A ``tf.data`` element_spec as distvals specs (TensorSpec leaves)."""

    def one(s: Any) -> Any:
        shape = getattr(s, "shape", None)
        dims = None if shape is None or getattr(shape, "rank", 0) is None else tuple(shape.as_list())
        dtype = getattr(getattr(s, "dtype", None), "as_numpy_dtype", np.float32)
        return TensorSpec(dims, dtype, getattr(s, "name", None))

    if nest.is_nested(spec):
        return nest.map_structure(one, spec)
    return one(spec)
