"""Distributed values: one value per replica.

``PerReplica`` values differ across replicas (a batch split over replicas, the results of
``strategy.run``); ``Mirrored`` values are the same on every replica (model weights).
Inside ``strategy.run`` either behaves as the current replica's part. Outside it, a
``Mirrored`` behaves as its first part, while a ``PerReplica`` refuses to be used as one
array, since it is not one.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Type, TypeVar

import numpy as np

from . import _core, context, nest

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "contains_distributed",
    "per_replica_arguments",
    "regroup",
    "select_replica",
]

_DV = TypeVar("_DV", bound="DistributedValues")


class DistributedValues:
    """Base class of the values that hold one part per replica (never built directly).

    ``.values`` is the tuple of parts in replica order. ``repr`` and ``str`` print
    ``ClassName:{`` then one ``  i: part`` line per replica, then ``}``.
    """

    # Variables are handed to replicas whole, not as their parts.
    _select_whole = False
    # Every step makes one per leaf of its results: without an instance dict, making one
    # is an allocation and a slot store. (Subclasses without __slots__, the variables,
    # have their dict as usual.)
    __slots__ = ("__weakref__", "_values")

    def __init__(self, values: Sequence[Any]) -> None:
        if type(self) is DistributedValues:
            raise TypeError("DistributedValues is a base class; build a PerReplica or a Mirrored")
        if not isinstance(values, (list, tuple)):
            raise TypeError(
                f"{type(self).__name__} takes a list or tuple of per-replica values, got {type(values).__name__}"
            )
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one value")
        self._values = tuple(values)

    @classmethod
    def _of(cls: Type[_DV], values: Tuple[Any, ...]) -> _DV:
        """An instance over a non-empty tuple made by distvals itself (skips the checks of
        the public constructor, for hot paths such as splitting every batch)."""
        self = cls.__new__(cls)
        self._values = values
        return self

    @property
    def values(self) -> Tuple[Any, ...]:
        """The per-replica parts, in replica order."""
        return self._values

    def _cross_replica_part(self) -> Any:
        raise NotImplementedError

    def _current(self) -> Any:
        """The part of the replica running this code, or the cross-replica stand-in."""
        ctx = context.current_run_context()
        if ctx is not None and ctx._num_replicas == len(self._values):
            return self._values[ctx._replica_id]
        return self._cross_replica_part()

    def __str__(self) -> str:
        body = ",\n".join(f"  {i}: {v!s}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    # ---- numpy interoperability: the current part stands in for the value ----------
    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        part = self._current()
        if copy:
            return np.array(part, dtype=dtype, copy=True)
        return np.asarray(part, dtype=dtype)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(x._current() if isinstance(x, DistributedValues) else x for x in inputs)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(x._current() if isinstance(x, DistributedValues) else x for x in out)
        return getattr(ufunc, method)(*inputs, **kwargs)

    # ---- operators ------------------------------------------------------------------
    def __add__(self, o: Any) -> Any:
        return self._current() + _unwrap(o)

    def __radd__(self, o: Any) -> Any:
        return _unwrap(o) + self._current()

    def __sub__(self, o: Any) -> Any:
        return self._current() - _unwrap(o)

    def __rsub__(self, o: Any) -> Any:
        return _unwrap(o) - self._current()

    def __mul__(self, o: Any) -> Any:
        return self._current() * _unwrap(o)

    def __rmul__(self, o: Any) -> Any:
        return _unwrap(o) * self._current()

    def __truediv__(self, o: Any) -> Any:
        return self._current() / _unwrap(o)

    def __rtruediv__(self, o: Any) -> Any:
        return _unwrap(o) / self._current()

    def __floordiv__(self, o: Any) -> Any:
        return self._current() // _unwrap(o)

    def __rfloordiv__(self, o: Any) -> Any:
        return _unwrap(o) // self._current()

    def __mod__(self, o: Any) -> Any:
        return self._current() % _unwrap(o)

    def __rmod__(self, o: Any) -> Any:
        return _unwrap(o) % self._current()

    def __pow__(self, o: Any) -> Any:
        return self._current() ** _unwrap(o)

    def __rpow__(self, o: Any) -> Any:
        return _unwrap(o) ** self._current()

    def __matmul__(self, o: Any) -> Any:
        return self._current() @ _unwrap(o)

    def __rmatmul__(self, o: Any) -> Any:
        return _unwrap(o) @ self._current()

    def __and__(self, o: Any) -> Any:
        return self._current() & _unwrap(o)

    def __rand__(self, o: Any) -> Any:
        return _unwrap(o) & self._current()

    def __or__(self, o: Any) -> Any:
        return self._current() | _unwrap(o)

    def __ror__(self, o: Any) -> Any:
        return _unwrap(o) | self._current()

    def __xor__(self, o: Any) -> Any:
        return self._current() ^ _unwrap(o)

    def __rxor__(self, o: Any) -> Any:
        return _unwrap(o) ^ self._current()

    def __lt__(self, o: Any) -> Any:
        return self._current() < _unwrap(o)

    def __le__(self, o: Any) -> Any:
        return self._current() <= _unwrap(o)

    def __gt__(self, o: Any) -> Any:
        return self._current() > _unwrap(o)

    def __ge__(self, o: Any) -> Any:
        return self._current() >= _unwrap(o)

    def __neg__(self) -> Any:
        return -self._current()

    def __pos__(self) -> Any:
        return +self._current()

    def __abs__(self) -> Any:
        return abs(self._current())

    def __invert__(self) -> Any:
        return ~self._current()

    def __getitem__(self, key: Any) -> Any:
        return self._current()[key]

    def __iter__(self) -> Any:
        # Over this replica's value, as for the value itself: a scalar one raises TypeError
        # (Python's old protocol, __getitem__ until an IndexError, would see it empty).
        return iter(self._current())

    def __float__(self) -> float:
        return float(self._current())

    def __int__(self) -> int:
        return int(self._current())

    def __complex__(self) -> complex:
        return complex(self._current())

    def __index__(self) -> int:
        return operator.index(self._current())

    # Equality and hashing stay by identity, as for TensorFlow's distributed values, so
    # these objects can be dict keys and set members.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


def _unwrap(o: Any) -> Any:
    return o._current() if isinstance(o, DistributedValues) else o


class PerReplica(DistributedValues):
    """One value per replica, not kept in sync (a split batch, the results of ``run``).

    Inside ``strategy.run`` it behaves as the current replica's part; outside, using it
    as one array (arithmetic, ``numpy.asarray``, indexing) raises TypeError: combine the
    parts with ``strategy.reduce``/``strategy.gather``, or work on them in
    ``strategy.run``.
    """

    __slots__ = ()

    def _cross_replica_part(self) -> NoReturn:
        raise TypeError(
            f"a PerReplica holds {len(self._values)} different per-replica values and cannot be "
            "used as one array outside a replica context; use strategy.run(fn, args=(value,)) "
            "to work on each replica's part, strategy.reduce or strategy.gather to combine "
            "the parts, or strategy.experimental_local_results(value) to get them"
        )


class Mirrored(DistributedValues):
    """One value per replica, kept equal on every replica (e.g. model weights).

    It behaves as its value: operators and attributes go to the current replica's part
    inside ``strategy.run`` and to the first part outside.
    """

    __slots__ = ()

    def _cross_replica_part(self) -> Any:
        return self._values[0]

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the class does not have. Dunders are not delegated
        # so that copy, pickle and the like see the Mirrored itself.
        if name.startswith("__") or name == "_values":
            raise AttributeError(name)
        return getattr(self._current(), name)


# ---- between per-replica and distributed structures -----------------------------------


def select_replica(replica: int, structure: Any) -> Any:
    """``structure`` as replica ``replica`` sees it: every DistributedValues replaced by
    that replica's part (variables stay whole)."""
    if isinstance(structure, DistributedValues):
        return structure if structure._select_whole else structure._values[replica]
    if not _nested(structure):
        return structure
    if not structure:
        # An empty list or dict can still be changed: each replica gets one of its own,
        # as a non-empty one is rebuilt for each (an empty tuple is immutable).
        return structure if isinstance(structure, tuple) else nest.pack_sequence_as(structure, [])
    # flatten gives leaves only, so each needs one look, not a walk of its own.
    return nest.pack_sequence_as(structure, [_part(replica, x) for x in nest.flatten(structure)])


def _part(replica: int, x: Any) -> Any:
    """Replica ``replica``'s part of a leaf: of a DistributedValues that is split, else
    the leaf itself."""
    if isinstance(x, DistributedValues) and not x._select_whole:
        return x._values[replica]
    return x


def per_replica_arguments(
    args: Sequence[Any], kwargs: Dict[str, Any], num_replicas: int, what: str
) -> List[Tuple[Any, Dict[str, Any]]]:
    """Each replica's ``(args, kwargs)`` for a call of the replica function: every split
    DistributedValues replaced by that replica's part. ValueError when one has a
    different number of parts than ``num_replicas``."""
    n = num_replicas
    if not kwargs and type(args) is tuple:
        # The common case, positional arguments that are values or DistributedValues
        # (no containers to walk): one look at each.
        split = False
        for x in args:
            if isinstance(x, DistributedValues):
                if len(x._values) != n:
                    break  # the general path below says what is wrong
                split = split or not x._select_whole
            elif _nested(x):
                break
        else:
            if not split:
                return [(args, kwargs)] * n
            if len(args) == 1:
                # One argument, split: each replica's part, as a 1-tuple.
                return [((v,), kwargs) for v in args[0]._values]
            return [(tuple([_part(r, x) for x in args]), kwargs) for r in range(n)]
    if (args and contains_distributed(args, n, what)) or (kwargs and contains_distributed(kwargs, n, what)):
        return [(select_replica(r, args), select_replica(r, kwargs)) for r in range(n)]
    return [(args, kwargs)] * n


def contains_distributed(structure: Any, num_replicas: int, what: str) -> bool:
    """True when ``structure`` holds a DistributedValues that is split per replica;
    ValueError when one has a different number of parts than ``num_replicas``."""
    leaves: List[Any]
    if isinstance(structure, DistributedValues):
        leaves = [structure]
    elif _nested(structure):
        if not structure:
            return False
        leaves = nest.flatten(structure)
    else:
        return False
    found = False
    for x in leaves:
        if isinstance(x, DistributedValues):
            if len(x._values) != num_replicas:
                raise ValueError(
                    f"{what}: a {type(x).__name__} with {len(x._values)} values was given to a "
                    f"strategy with {num_replicas} replicas"
                )
            found = found or not x._select_whole
    return found


def regroup(
    per_replica: Sequence[Any],
    wrap: Optional[Callable[[Tuple[Any, ...]], Any]] = None,
    what: str = "strategy.run",
    scalars_by_identity: bool = True,
    always_wrap: bool = False,
) -> Any:
    """N per-replica structures as one structure of PerReplica leaves (or ``wrap``).

    As in TensorFlow, a leaf that is the very same object on every replica stays as it
    is, Python numbers, strings and bools included (``run(lambda: 2.5)`` is ``2.5``;
    equal but distinct objects make a PerReplica), except numpy bools, of which numpy
    keeps one True and one False (each replica's ``np.any(x)`` is its own value). With
    ``always_wrap`` every leaf is wrapped, even one replica's. Different structures are
    a ValueError naming the replicas."""
    wrap = PerReplica if wrap is None else wrap
    v0 = per_replica[0]
    n = len(per_replica)
    if not _nested(v0):
        if n == 1 and not always_wrap:
            return v0
        # (numpy keeps one True and one False: identity says nothing of numpy bools.)
        same = not always_wrap and type(v0) is not np.bool_
        for r in range(1, n):
            x = per_replica[r]
            if x is not v0:
                same = False
                if _nested(x):
                    _mismatch(per_replica, r, what)
        if same:
            return v0
        if wrap is PerReplica:
            # The step's result: made without the checks of the constructor (a tuple of
            # the right length, by construction).
            out = _new_per_replica(PerReplica)
            out._values = tuple(per_replica)
            return out
        return wrap(tuple(per_replica))
    if wrap is PerReplica:
        # A step's results: one walk in C++ makes the PerReplica leaves without the
        # constructor's checks (None: nestings that differ, named below).
        out = _regroup(per_replica, PerReplica, always_wrap)
        if out is not None:
            return out
    same_nesting = nest._same
    for r in range(1, n):
        if not same_nesting(v0, per_replica[r]):
            _mismatch(per_replica, r, what)
    flats = [nest.flatten(v) for v in per_replica]
    leaves: List[Any] = []
    for column in zip(*flats):
        c0 = column[0]
        if not always_wrap and all(c is c0 for c in column):
            leaves.append(c0)
        else:
            leaves.append(wrap(column))
    return nest.pack_sequence_as(v0, leaves)


_nested = nest.is_nested
_new_per_replica = object.__new__
_regroup = _core.nest_regroup


def _mismatch(per_replica: Sequence[Any], r: int, what: str) -> None:
    why = nest.structure_mismatch(per_replica[0], per_replica[r])
    if what.startswith("merge_call "):  # merge_call's args or kwargs: what the replicas passed
        raise ValueError(
            f"merge_call: replicas 0 and {r} passed different structures as {what.split(' ', 1)[1]} ({why}); "
            "every replica must pass the same nesting of lists, tuples and mappings"
        )
    raise ValueError(
        f"{what}: replicas 0 and {r} returned different structures ({why}); every replica "
        "must return the same nesting of lists, tuples and mappings"
    )
