"""``CrossDeviceOps.reduce``, ``batch_reduce`` and ``broadcast`` called directly, as
TensorFlow code calls them on a ``tf.distribute.CrossDeviceOps``.

A distvals ``CrossDeviceOps`` is a choice of how a strategy runs its collectives, not a
runner of its own: these calls run on the collectives of the strategy the values belong
to (``extended.reduce_to``, ``batch_reduce_to``, ``broadcast_to``), so a value reduces the
same way whichever door it comes through. Which strategy that is, in this order:

1. the strategy of a distributed variable among the values or destinations;
2. the strategy whose ``scope()`` is entered;
3. the one live strategy made with this object as its ``cross_device_ops``;
4. the default strategy (one replica).

As in TensorFlow, a value that is not distributed (an array, a number), or a distributed
value with one part, is one replica's value: each of SUM, MEAN, MIN, MAX and PRODUCT gives
it back (an integer MEAN as floats, as every distvals MEAN does), copied to every
destination. Within a ``MultiWorkerMirroredStrategy`` the strategy's own ``reduce_to``
semantics apply to every value, since a value there is also the other workers' part.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from . import context, nest
from .options import CommunicationOptions, CrossDeviceOps
from .reduce_op import ReduceOp, as_reduce_op
from .values import DistributedValues, PerReplica

__all__ = ["batch_reduce", "broadcast", "reduce"]


def reduce(ops: CrossDeviceOps, reduce_op: Any, per_replica_value: Any, destinations: Any, options: Any) -> Any:
    what = f"{type(ops).__name__}.reduce"
    _refuse_replica_context(what)
    op = as_reduce_op(reduce_op)
    opts = ops._call_options(_checked_options(options, what))
    _refuse_structure_of_values(per_replica_value, what)
    strategy = _strategy_for(ops, what, [per_replica_value, destinations])
    ext = strategy.extended
    _check_destinations(ext, destinations, what)
    alone = _check_parts(ext, per_replica_value, what)
    if alone:
        return ext.broadcast_to(_one_value(op, per_replica_value), destinations)
    return ext.reduce_to(op, per_replica_value, destinations, opts)


def batch_reduce(ops: CrossDeviceOps, reduce_op: Any, value_destination_pairs: Any, options: Any) -> List[Any]:
    what = f"{type(ops).__name__}.batch_reduce"
    _refuse_replica_context(what)
    op = as_reduce_op(reduce_op)
    opts = ops._call_options(_checked_options(options, what))
    if not isinstance(value_destination_pairs, (list, tuple)):
        raise TypeError(
            f"{what}: value_destination_pairs must be a list of (value, destinations) pairs, "
            f"got {type(value_destination_pairs).__name__}"
        )
    pairs: List[Tuple[Any, Any]] = []
    for i, pair in enumerate(value_destination_pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{what}: item {i} is not a (value, destinations) pair, got {type(pair).__name__}")
        _refuse_structure_of_values(pair[0], f"{what} (item {i})")
        pairs.append((pair[0], pair[1]))
    strategy = _strategy_for(ops, what, [x for pair in pairs for x in pair])
    ext = strategy.extended
    # Every item is checked before any of them moves.
    alone = []
    for i, (value, dests) in enumerate(pairs):
        _check_destinations(ext, dests, f"{what} (item {i})")
        alone.append(_check_parts(ext, value, f"{what} (item {i})"))
    together = [i for i, a in enumerate(alone) if not a]
    out: List[Any] = [None] * len(pairs)
    if together:
        # The distributed values in one batch_reduce_to, which packs them together.
        results = ext.batch_reduce_to(op, [pairs[i] for i in together], opts)
        for i, result in zip(together, results):
            out[i] = result
    for i, a in enumerate(alone):
        if a:
            value, dests = pairs[i]
            out[i] = ext.broadcast_to(_one_value(op, value), dests)
    return out


def broadcast(ops: CrossDeviceOps, tensor: Any, destinations: Any) -> Any:
    what = f"{type(ops).__name__}.broadcast"
    _refuse_replica_context(what)
    if isinstance(tensor, PerReplica):
        raise ValueError(
            f"{what}: the value is a PerReplica (one value per replica, not one value); reduce it first (reduce)"
        )
    _refuse_structure_of_values(tensor, what)
    strategy = _strategy_for(ops, what, [tensor, destinations])
    ext = strategy.extended
    _check_destinations(ext, destinations, what)
    return ext.broadcast_to(tensor, destinations)


# ---- checks, all made before any data moves ---------------------------------------------------
def _refuse_replica_context(what: str) -> None:
    ctx = context.current_run_context()
    if ctx is not None:
        ctx._strategy.extended._require_cross_replica(what)


def _checked_options(options: Any, what: str) -> Optional[CommunicationOptions]:
    if options is not None and not isinstance(options, CommunicationOptions):
        raise TypeError(f"{what}: options must be a CommunicationOptions or None, got {type(options).__name__}")
    return options


def _refuse_structure_of_values(value: Any, what: str) -> None:
    # TensorFlow takes one value here; a structure of distributed values would otherwise
    # be reduced leaf by leaf with the strategy's meaning of its plain leaves.
    if (
        not isinstance(value, DistributedValues)
        and nest.is_nested(value)
        and any(isinstance(x, DistributedValues) for x in nest.flatten(value))
    ):
        raise TypeError(
            f"{what}: expected one PerReplica, Mirrored or array, got a {type(value).__name__} holding "
            "distributed values; pass each on its own (batch_reduce takes several (value, destinations) pairs)"
        )


def _check_destinations(ext: Any, destinations: Any, what: str) -> None:
    if destinations is None:
        # A strategy's reduce_to reads None as its devices; TensorFlow's CrossDeviceOps
        # refuses it.
        raise ValueError(
            f"{what}: destinations must be a device string, a list of them, or a distributed value, got None"
        )
    if isinstance(destinations, DistributedValues) and len(destinations.values) > ext._n:
        raise ValueError(
            f"{what}: destinations is a {type(destinations).__name__} with {len(destinations.values)} values, "
            f"but {ext._container!r} has {_replicas(ext._n)}; it belongs to another strategy"
        )
    ext._destinations(destinations, what)


def _check_parts(ext: Any, value: Any, what: str) -> bool:
    """Whether ``value`` is one replica's value (not distributed, or of one part) on a
    strategy of several replicas in one process; ValueError for a distributed value
    whose part count is not the strategy's."""
    if ext.experimental_between_graph:
        return False
    if not isinstance(value, DistributedValues):
        return True
    count = len(value.values)
    if count == ext._n:
        return False
    if count == 1:
        return True
    raise ValueError(
        f"{what}: the value is a {type(value).__name__} with {count} values, but {ext._container!r} has "
        f"{_replicas(ext._n)}; call it inside the scope() of the strategy whose values these are"
    )


def _replicas(n: int) -> str:
    return "1 replica" if n == 1 else f"{n} replicas"


def _one_value(op: ReduceOp, value: Any) -> Any:
    """``op`` over one replica's value: the value itself (in a MEAN's dtype)."""
    from .cross_replica import reduced_alone, unwrap_part

    part = value.values[0] if isinstance(value, DistributedValues) else value
    return reduced_alone(op, unwrap_part(part))


# ---- which strategy runs the call ------------------------------------------------------------------
def _strategy_for(ops: CrossDeviceOps, what: str, items: Sequence[Any]) -> Any:
    from .distributed_variables import DistributedVariable

    owners: List[Any] = []
    for x in items:
        if isinstance(x, DistributedVariable) and all(x._strategy is not o for o in owners):
            owners.append(x._strategy)
    if len(owners) > 1:
        raise ValueError(f"{what}: the values are variables of different strategies: {owners[0]!r} and {owners[1]!r}")
    in_scope = context.get_strategy() if context.has_strategy() else None
    if owners:
        if in_scope is not None and in_scope is not owners[0]:
            raise ValueError(
                f"{what}: the value is a variable of {owners[0]!r}, but the scope of {in_scope!r} is entered; "
                "call it in the variable's strategy's scope, or outside any scope"
            )
        return owners[0]
    if in_scope is not None:
        return in_scope
    made_with = ops._strategies()
    if len(made_with) > 1:
        raise ValueError(
            f"{what}: this {type(ops).__name__} is the cross_device_ops of several open strategies "
            f"({', '.join(repr(s) for s in made_with)}); call it inside the scope() of the one to run it"
        )
    if made_with:
        return made_with[0]
    return context.get_strategy()
