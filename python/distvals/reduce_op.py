"""``ReduceOp``: how values from several replicas combine into one."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """How to combine the replicas' values.

    ``SUM`` and ``MEAN`` as in ``tf.distribute.ReduceOp``; ``MIN``, ``MAX`` and
    ``PRODUCT`` go beyond it. Wherever a reduce op is taken, a string naming one in
    any case (``"sum"``, ``"Mean"``, ``"prod"``) is accepted too.
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"
    PRODUCT = "PRODUCT"

    @staticmethod
    def from_variable_aggregation(aggregation: Any) -> ReduceOp:
        """The reduce op of a ``VariableAggregation`` (SUM or MEAN); ValueError otherwise."""
        name = getattr(aggregation, "name", aggregation)
        if name == "SUM":
            return ReduceOp.SUM
        if name == "MEAN":
            return ReduceOp.MEAN
        raise ValueError(
            f"could not convert VariableAggregation {aggregation!r} to a ReduceOp; only SUM and MEAN have one"
        )

    @property
    def engine_name(self) -> str:
        """The op's name in the C++ engine."""
        return _ENGINE[self]

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    # Members are singletons compared by identity, so the identity hash is a valid one;
    # Enum's own is Python code, and a collective looks ops up in dicts several times.
    __hash__ = object.__hash__


_ENGINE = {
    ReduceOp.SUM: "sum",
    ReduceOp.MEAN: "mean",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.PRODUCT: "prod",
}

_ALIASES = {"PROD": ReduceOp.PRODUCT, "AVG": ReduceOp.MEAN, "AVERAGE": ReduceOp.MEAN}


def as_reduce_op(op: object) -> ReduceOp:
    """``op`` as a ReduceOp; strings in any case are accepted.

    Raises ValueError for an unknown name and TypeError for anything else.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.strip().upper()
        if key in ReduceOp.__members__:
            return ReduceOp[key]
        if key in _ALIASES:
            return _ALIASES[key]
        raise ValueError(f"unknown reduce op {op!r}; expected one of SUM, MEAN, MIN, MAX, PRODUCT (any case)")
    # A ReduceOp from another copy of this module, or tf.distribute.ReduceOp.
    name = getattr(op, "name", None)
    if isinstance(name, str) and name.upper() in ReduceOp.__members__:
        return ReduceOp[name.upper()]
    raise TypeError(f"expected a distvals.ReduceOp or a string such as 'SUM', got {type(op).__name__}")
