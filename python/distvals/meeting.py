"""Checking that the replicas at a meeting asked for the same thing.

Before a collective runs, every replica's request is compared: the same call (kind and
parameters such as the op or the axis), the same nesting of lists, tuples and mappings
(with the same keys), and leaf by leaf the same dtype and shape (except along the
gathered axis). The first difference becomes one ``MismatchError`` that every replica
raises, naming the replicas and what each passed, and nothing is reduced.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import nest
from ._convert import refuse_masked
from ._core import MismatchError
from .collectives import REDUCIBLE_KINDS, engine_supports, type_name
from .replicas import Request

__all__ = ["check_calls", "check_leaves", "check_structures", "mismatch", "split_leaves"]


def mismatch(message: str) -> MismatchError:
    return MismatchError(message)


def check_calls(requests: Sequence[Request]) -> None:
    """Raises MismatchError when the replicas' calls differ in kind or parameters."""
    q0 = requests[0]
    for r in range(1, len(requests)):
        q = requests[r]
        if q.kind != q0.kind:
            raise mismatch(
                f"replicas called different collectives: replica 0 called {q0.describe()}, replica {r} "
                f"called {q.describe()}; every replica must make the same collective, merge_call and "
                "variable-update calls in the same order"
            )
        if q.params != q0.params:
            raise mismatch(
                f"{q0.kind}: replica 0 called {q0.describe()}, replica {r} called {q.describe()}; every "
                "replica must pass the same arguments"
            )


def check_structures(requests: Sequence[Request], what: str) -> None:
    """Raises MismatchError when the replicas' values are nested differently (lists,
    tuples, dicts and their keys)."""
    v0 = requests[0].value
    for r in range(1, len(requests)):
        why = nest.structure_mismatch(v0, requests[r].value)
        if why is not None:
            raise mismatch(
                f"{what}: replica 0 and replica {r} passed different structures ({why}); every "
                "replica must pass the same nesting of lists, tuples and mappings, with the same keys"
            )


def split_leaves(
    requests: Sequence[Request], convert: Callable[[Any], Any], what: str, reducible: bool
) -> Tuple[List[List[Any]], bool]:
    """Every replica's value as a list of leaf arrays (``convert`` makes an array of a
    leaf), after checking that the nestings agree; returns (leaves per replica, whether
    the value is a single leaf). With ``reducible``, leaves that are not numbers are a
    TypeError naming the replica."""
    values = [q.value for q in requests]
    v0 = values[0]
    single = not nest.is_nested(v0)
    for r in range(1, len(values)):
        why = nest.structure_mismatch(v0, values[r])
        if why is not None:
            raise mismatch(
                f"{what}: replica 0 and replica {r} passed different structures ({why}); every "
                "replica must pass the same nesting of lists, tuples and mappings, with the same keys"
            )
    out = []
    for r, v in enumerate(values):
        leaves = [v] if single else nest.flatten(v)
        arrays = []
        for leaf in leaves:
            refuse_masked(leaf, r, what)
            a = convert(leaf)
            dt = a.dtype
            if dt.hasobject or (reducible and dt.kind not in REDUCIBLE_KINDS and not engine_supports(dt)):
                raise TypeError(
                    f"replica {r}: {what} cannot {'reduce' if reducible else 'send'} a value of type "
                    f"{type_name(leaf, a)}; pass numbers or arrays of numbers"
                )
            arrays.append(a)
        out.append(arrays)
    return out, single


def _where(paths: Optional[List[str]], i: int) -> str:
    if not paths or not paths[i]:
        return ""
    return f" at {paths[i]}"


def check_leaves(value0: Any, leaves: Sequence[Sequence[Any]], what: str, axes: Optional[Sequence[int]] = None) -> None:
    """Raises MismatchError naming the first leaf whose dtype or shape differs across
    replicas (shapes may differ along ``axes[i]`` only, when given)."""
    first = leaves[0]
    for r in range(1, len(leaves)):
        mine = leaves[r]
        for i, (a0, a) in enumerate(zip(first, mine)):
            d0, d = a0.dtype, a.dtype
            if d is not d0 and d != d0:
                paths = nest.paths(value0) if nest.is_nested(value0) else None
                raise mismatch(
                    f"{what}: replica 0 passed dtype {_dtype_name(d0)}, replica {r} passed dtype "
                    f"{_dtype_name(d)}{_where(paths, i)}; every replica's value needs the same dtype"
                )
            s0, s = tuple(a0.shape), tuple(a.shape)
            if s == s0:
                continue
            if axes is not None:
                ax = axes[i]
                if len(s) == len(s0) and all(x == y for k, (x, y) in enumerate(zip(s, s0)) if k != ax):
                    continue
                paths = nest.paths(value0) if nest.is_nested(value0) else None
                raise mismatch(
                    f"{what}: replica 0 passed shape {s0}, replica {r} passed shape {s}"
                    f"{_where(paths, i)}; shapes may differ only along axis {ax}"
                )
            paths = nest.paths(value0) if nest.is_nested(value0) else None
            raise mismatch(
                f"{what}: replica 0 passed shape {s0}, replica {r} passed shape {s}{_where(paths, i)}; "
                "every replica's value needs the same shape"
            )


def _dtype_name(dt: np.dtype) -> str:
    if not dt.isnative and dt.byteorder in "<>":
        return f"{dt.name} ({'big' if dt.byteorder == '>' else 'little'}-endian)"
    name: str = dt.name
    return name
