"""Distributed variables: one ``Variable`` copy per replica (see ``distvals.variables``).

``MirroredVariable`` keeps its copies equal on every update; ``SyncOnReadVariable``
lets each replica update its own copy and combines the copies when read in
cross-replica context. Every update kind (assign, assign_add, assign_sub, the scatter
family, count_up_to) follows the same rules in replica and cross-replica context.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import numpy as np

from . import context, devices, nest, sparse, variable_slices
from .errors import OutOfRangeError
from .fork_locks import shared_after_fork
from .reduce_op import ReduceOp
from .replicas_threads import committing
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    Variable,
    VariableAggregation,
    VariableSynchronization,
    _equal,
    _unwrap,
    coerce_sparse,
    coerce_value,
    commit_copies,
)

if TYPE_CHECKING:
    from .cuda import DeviceArray

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable"]


class DistributedVariable(DistributedValues, Variable):
    """A variable with one copy (a ``Variable``) per replica; ``.values`` are the copies."""

    _select_whole = True
    _values: Tuple[Variable, ...]
    # Its number among its strategy's variables, in the order of creation (_call_label).
    _serial = 0

    def __init__(
        self,
        strategy: Any,
        copies: Tuple[Variable, ...],
        name: str,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        trainable: bool,
    ) -> None:
        DistributedValues.__init__(self, copies)
        self._strategy = strategy
        self._name = name
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._trainable = trainable
        self._n = len(copies)
        self._constraint = None
        self._initial = copies[0]._initial
        self._shape_rule = copies[0]._shape_rule
        # One lock for all copies: see commit_copies.
        shared_after_fork(copies)

    # The copies live in DistributedValues' slot, not in the __dict__ that Variable's
    # state methods carry: copies and pickles take them along too.
    def __getstate__(self) -> Dict[str, Any]:
        state = Variable.__getstate__(self)
        state["_values"] = self._values
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        values = state.pop("_values")
        Variable.__setstate__(self, state)
        self._values = values
        if any(c._lock is not values[0]._lock for c in values):
            # New copies (a deep copy, an unpickled variable), each with a lock of its own.
            shared_after_fork(values)

    def __copy__(self) -> DistributedVariable:
        """A new distributed variable over the same copies (as TensorFlow's copy.copy):
        an update through either shows in both."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        return new

    def __deepcopy__(self, memo: Dict[int, Any]) -> DistributedVariable:
        """An independent variable of the same strategy, aggregation and synchronization
        whose copies start with this one's values, as TensorFlow's deepcopy: the strategy
        is not copied, and deep-copying inside another strategy's scope is an error."""
        current = context.get_strategy()
        if context.has_strategy() and current is not self._strategy:
            raise RuntimeError(
                f"copy.deepcopy of variable '{self.name}': it belongs to {self._strategy!r}, and "
                f"{current!r} is in force; deep-copy it inside its own strategy's scope or outside any"
            )
        memo.setdefault(id(self._strategy), self._strategy)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        ref = weakref.ref(new)
        for c in new._values:
            # (copy.deepcopy keeps weak references as they are: they would name this variable.)
            c._distributed_container = ref
        return new

    @property
    def distribute_strategy(self) -> Any:
        return self._strategy

    @property
    def device(self) -> str:
        return self._local_copy().device

    def _read_meta(self) -> Union[np.ndarray, DeviceArray]:
        return self._values[0]._value

    def _replica_context(self) -> Optional[context.ReplicaContext]:
        """This strategy's replica context when called inside its ``run``."""
        ctx = context.current_run_context()
        if ctx is not None and ctx._strategy is self._strategy:
            return ctx
        if ctx is not None:
            raise RuntimeError(
                f"variable '{self.name}' belongs to {self._strategy!r}, not to the strategy running now "
                f"({ctx._strategy!r})"
            )
        return None

    def _local_copy(self) -> Variable:
        ctx = self._replica_context()
        if ctx is not None:
            return self._values[ctx._replica_id]
        i = context.updating_copy(self._strategy)
        return self._values[i if i is not None else 0]

    def _current(self) -> Any:
        ctx = self._replica_context()
        if ctx is not None:
            return self._values[ctx._replica_id]
        i = context.updating_copy(self._strategy)
        if i is not None:
            return self._values[i]
        return self._cross_replica_part()

    def _read(self) -> Any:
        part = self._current()
        return part._read() if isinstance(part, Variable) else part

    def value(self) -> Any:
        return self._read()

    def read_value(self) -> Any:
        return self._read()

    def __getitem__(self, key: Any) -> Any:
        # The part of the value this context reads, written back through this variable
        # (its aggregation, every copy), not through the copy it was read from.
        return variable_slices.slice_of(self, self._read(), key)

    def _replica_write(self, r: int, kind: str, value: Any) -> None:
        """Replica ``r``'s update of its own copy, from inside ``strategy.run``. A replica
        thread still running a step that has ended with an error (its timeout, another
        replica's failure) must not change its copy after the caller got that error."""
        with committing(lambda: self._dropped(r, kind)):
            self._values[r]._apply(kind, value)

    def _call_label(self, kind: str) -> str:
        """What a collective that ``kind`` (a read, assign_add, scatter_add ...) of this
        variable makes is for, as the workers agree on it: with the variable's number
        among its strategy's variables (created in one order on every worker), so that
        variables of one name (unnamed ones: 'Variable') are told apart too."""
        return f"{kind} of variable #{self._serial} '{self.name}'"

    def _dropped(self, r: int, kind: str) -> str:
        return (
            f"replica {r}: {kind} of variable '{self.name}' was dropped: this replica's step had already "
            "ended with an error (a timeout, Ctrl-C or another replica's failure)"
        )

    def count_up_to(self, limit: int) -> np.ndarray:
        """As ``Variable.count_up_to``, by the rules of ``assign_add`` for this variable."""
        self._check_counter()
        old = np.asarray(devices.to_host(self.read_value()))
        if old >= limit:
            raise OutOfRangeError(f"count_up_to of variable '{self.name}': reached limit of {limit}")
        self._update("assign_add", np.ones((), self.dtype), False)
        return old

    def _chief_value(self, value: Any, kind: str) -> Any:
        """A cross-replica update's plain value (not a per-replica one), checked and cast
        for the variable: on a multi-worker strategy the chief's, on every worker, as a
        new variable's initial value is. Each worker's own value would make the variable
        differ between workers without a word: an unseeded random value, or a worker's
        own result of ``run`` with one replica per worker, which is a plain array there.
        Workers whose values differ in shape or dtype get MismatchError."""
        coerced = self._coerce_parts(value, kind)
        ext = self._strategy.extended
        what = f"{kind} of variable '{self.name}'"
        label = self._call_label(kind)
        if isinstance(coerced, sparse.SparseDelta):
            indices = ext._first_replica_value(coerced.indices, f"{what} (indices)", f"{label} (indices)")
            chief = sparse.SparseDelta(
                indices, ext._first_replica_value(coerced.values, f"{what} (values)", f"{label} (values)"), coerced.nd
            )
        else:
            chief = ext._first_replica_value(coerced, what, label)
        # The chief's value as it arrived (a host array for GPU copies), cast and placed
        # again; one process's strategies hand back the value itself.
        return coerced if chief is coerced else self._coerce_parts(chief, kind)

    def _update_copy(self, i: int, kind: str, value: Any) -> None:
        """An update made by ``extended.update``'s function while it updates copy ``i``:
        that copy only, with the value's part ``i`` (TensorFlow's update context)."""
        if isinstance(value, DistributedValues) and not isinstance(value, DistributedVariable):
            if len(value.values) != self._n:
                raise ValueError(
                    f"{kind} of variable '{self.name}': a {type(value).__name__} with {len(value.values)} values "
                    f"for {self._n} copies"
                )
            value = value.values[i]
        # A distributed variable as the value reads as its own copy i here.
        self._values[i]._apply(kind, self._coerce_parts(value, kind))

    def _coerce_parts(self, value: Any, what: str) -> Any:
        if what in sparse.SCATTER_KINDS:
            return coerce_sparse(self, what, value)
        return coerce_value(self, _unwrap(value), what)

    # Values compare element-wise like any variable (not by identity like other
    # distributed values).
    def __eq__(self, o: object) -> Any:
        return _equal(self.read_value(), o, np.equal)

    def __ne__(self, o: object) -> Any:
        return _equal(self.read_value(), o, np.not_equal)

    __hash__ = Variable.__hash__

    def __repr__(self) -> str:
        return DistributedValues.__repr__(self)

    def __str__(self) -> str:
        return DistributedValues.__str__(self)


def _merge_sparse_update(strategy: Any, var: MirroredVariable, kind: str, delta: Any, raw: Any) -> MirroredVariable:
    """merge_fn of a sparse update made inside ``run``: the replicas' updates, combined by
    the variable's aggregation, go to every copy. ``raw`` (the caller's argument) is the
    same object on every replica only when each replica passed that very object."""
    leaves = nest.flatten(raw) if nest.is_nested(raw) else [raw]
    # With one local replica (a worker of a multi-worker strategy) a plain value is that
    # replica's own: nothing is counted twice.
    if (
        var._aggregation is VariableAggregation.SUM
        and var._n > 1
        and not any(isinstance(x, PerReplica) for x in leaves)
    ):
        raise ValueError(
            f"a SUM update ({kind}) of variable '{var.name}' got the same plain value on every replica, which "
            f"would count it {var._n} times; pass each replica's own value, or use aggregation MEAN or "
            "ONLY_FIRST_REPLICA"
        )
    if not isinstance(delta, PerReplica):
        delta = PerReplica((delta,) * var._n)
    var._update_cross_replica(kind, delta)
    return var


# Sparse updates whose result is one replica's row (or the least or greatest of them):
# nothing to sum or average across replicas.
_ONE_WRITER_KINDS = frozenset(
    ["scatter_update", "scatter_min", "scatter_max", "scatter_nd_update", "scatter_nd_min", "scatter_nd_max"]
)


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable whose copies are kept equal by every update (see distvals.variables)."""

    def count_up_to(self, limit: int) -> np.ndarray:
        """As ``Variable.count_up_to``. Inside ``strategy.run`` the replicas count once
        together; a SUM variable there is refused, since each replica's +1 would add up
        (and several replicas could pass the limit at once)."""
        if (
            self._aggregation is VariableAggregation.SUM
            and self._strategy.num_replicas_in_sync > 1
            and self._replica_context() is not None
        ):
            raise ValueError(
                f"count_up_to of variable '{self.name}' inside strategy.run: with aggregation SUM every replica's "
                f"+1 would be added up ({self._strategy.num_replicas_in_sync} per call); use aggregation "
                "ONLY_FIRST_REPLICA or MEAN, or call it in cross-replica context"
            )
        return DistributedVariable.count_up_to(self, limit)

    def _cross_replica_part(self) -> Any:
        return self._values[0]

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        ctx = self._replica_context()
        agg = self._aggregation
        if kind in _ONE_WRITER_KINDS and (agg is VariableAggregation.SUM or agg is VariableAggregation.MEAN):
            # Replicas' rows that overwrite (or keep the least or greatest of) a row have no
            # sum or mean: refused before anything changes, as TensorFlow refuses them.
            raise NotImplementedError(
                f"{kind} of variable '{self.name}': a mirrored variable with {agg.name} aggregation cannot "
                f"combine the replicas' {kind} updates; create it with aggregation NONE or ONLY_FIRST_REPLICA "
                "(as in TensorFlow), or use scatter_add / scatter_sub"
            )
        if ctx is None:
            i = context.updating_copy(self._strategy)
            if i is not None:
                self._update_copy(i, kind, value)
            else:
                self._update_cross_replica(kind, value)
            return self if read_value else None
        r = ctx._replica_id
        if agg is VariableAggregation.NONE or self._strategy.num_replicas_in_sync == 1:
            self._replica_write(r, kind, self._coerce_parts(value, kind))
            return self if read_value else None
        local = self._coerce_parts(value, kind)
        if isinstance(local, sparse.SparseDelta):
            # Sparse updates meet in merge_call: the replicas' (indices, values) pairs are
            # concatenated, as TensorFlow sums IndexedSlices across replicas.
            ctx.merge_call(_merge_sparse_update, args=(self, kind, local, value))
            return self if read_value else None
        # The meeting's resolver combines the replicas' values and updates every local copy
        # at once (see _commit_update): a failure or Ctrl-C never leaves copies unequal.
        op: Optional[ReduceOp] = None  # ONLY_FIRST_REPLICA: the first replica's value
        if agg is not VariableAggregation.ONLY_FIRST_REPLICA:
            op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        # The resolver refuses a SUM update that got the very same plain object on every
        # replica: it would count it once per replica. A sync-on-read variable is not one,
        # nor a PerReplica (one captured by the replica function, say): each replica
        # passes its own copy's value, its own part.
        original = local if isinstance(value, (SyncOnReadVariable, PerReplica)) else value
        self._strategy.extended._replica_update_all_reduce(ctx, self, kind, op, local, original)
        return self if read_value else None

    def _commit_update(self, kind: str, results: List[Any], first_replica: int) -> None:
        """Every local copy updated with its replica's combined value, as one change (the
        resolver of an aggregated update calls it once for all local replicas)."""
        values = [devices.cast(devices.as_value(x), self.dtype) for x in results]
        with committing(lambda: self._dropped(first_replica, kind)):
            commit_copies(self._values, kind, values)

    def _update_cross_replica(self, kind: str, value: Any) -> None:
        if isinstance(value, PerReplica):
            value = self._aggregate(value, kind)
        elif isinstance(value, SyncOnReadVariable):
            value = value.read_value()
        elif isinstance(value, DistributedValues):
            value = value.values[0]
        else:
            commit_copies(self._values, kind, [self._chief_value(value, kind)] * self._n)
            return
        coerced = self._coerce_parts(value, kind)
        commit_copies(self._values, kind, [coerced] * self._n)

    def _aggregate(self, value: PerReplica, kind: str) -> Any:
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"{kind} of variable '{self.name}' got a PerReplica value in cross-replica context, but the "
                "variable's aggregation is NONE; create it with aggregation SUM, MEAN or ONLY_FIRST_REPLICA, "
                "or reduce the value first"
            )
        ext = self._strategy.extended
        what = f"{kind} of variable '{self.name}'"
        # The variable and the kind of update are part of each call between workers (see
        # _call_label).
        label = self._call_label(kind)
        if kind in sparse.SCATTER_KINDS:
            # Every replica's update, of every worker: their rows differ in number, so
            # indices and values are gathered rather than reduced.
            local = [sparse.rows(self._coerce_parts(v, kind)) for v in value.values]
            idx = ext._every_replica_part([d.indices for d in local], what, f"{label} (indices)")
            vals = ext._every_replica_part(
                [np.asarray(devices.to_host(d.values)) for d in local], what, f"{label} (values)"
            )
            deltas = [sparse.SparseDelta(i, v, local[0].nd) for i, v in zip(idx, vals)]
            if agg is VariableAggregation.ONLY_FIRST_REPLICA:
                return deltas[0]
            scale = None if agg is VariableAggregation.SUM else self.dtype.type(1) / self.dtype.type(len(deltas))
            return sparse.concat_deltas(deltas, scale)
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            # Global replica 0's value: on a multi-worker strategy, the chief's.
            return ext._first_replica_value(self._coerce_parts(value.values[0], kind), what, label)
        op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        # Each part in the variable's dtype first, as inside run: int32 parts of an int64
        # variable must not wrap around in int32 while they are summed.
        parts = PerReplica(tuple(self._coerce_parts(v, kind) for v in value.values))
        return ext._reduce_one(op, parts, None, what, label)


class SyncOnReadVariable(DistributedVariable):
    """A variable whose copies are combined only when read in cross-replica context
    (see distvals.variables)."""

    def _cross_replica_part(self) -> Any:
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            # Global replica 0's copy: on a multi-worker strategy, the chief's.
            return self._strategy.extended._first_replica_value(
                self._values[0]._value, f"read of '{self.name}'", self._call_label("read")
            )
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"cannot read SyncOnReadVariable '{self.name}' in cross-replica context: its aggregation is "
                "NONE; read its copies with .values, or create it with SUM, MEAN or ONLY_FIRST_REPLICA"
            )
        op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        parts = [c._value for c in self._values]
        # The variable is part of the call between workers: two sync-on-read variables of
        # one shape read in different orders on two workers must not pair.
        out = self._strategy.extended._reduce_one(op, PerReplica(tuple(parts)), None, "read", self._call_label("read"))
        # A DeviceArray on the first replica's GPU for GPU copies (see distvals.cuda_collectives).
        out = devices.cast(devices.as_value(out), self.dtype)
        return devices.freeze(np.asarray(out) if isinstance(out, np.ndarray) else out)

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        ctx = self._replica_context()
        if ctx is not None:
            self._replica_write(ctx._replica_id, kind, self._coerce_parts(value, kind))
            return self if read_value else None
        i = context.updating_copy(self._strategy)
        if i is not None:
            self._update_copy(i, kind, value)
            return self if read_value else None
        if kind in sparse.SCATTER_KINDS:
            raise NotImplementedError(
                f"SyncOnReadVariable '{self.name}' does not support {kind} in cross-replica context (as in "
                "TensorFlow): update its copies inside strategy.run, or assign a dense value"
            )
        agg = self._aggregation
        if isinstance(value, PerReplica):
            if len(value.values) != self._n:
                raise ValueError(
                    f"{kind} of variable '{self.name}': a PerReplica with {len(value.values)} values "
                    f"for {self._n} copies"
                )
            parts = [self._coerce_parts(v, kind) for v in value.values]
            commit_copies(self._values, kind, parts)
            return self if read_value else None
        if kind != "assign" and agg is VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable '{self.name}' with aggregation SUM does not support {kind} in "
                "cross-replica context (the change could not be split across the copies); use assign"
            )
        coerced = self._chief_value(value, kind)
        if kind == "assign" and agg is VariableAggregation.SUM:
            # Split over every replica in sync (with several workers, this worker's copies
            # are replicas offset .. offset + n - 1 of them).
            total = self._strategy.num_replicas_in_sync
            offset = getattr(self._strategy.extended, "_offset", 0)
            parts = _split_sum(devices.to_host(coerced), total)[offset : offset + self._n]
            commit_copies(self._values, kind, parts)
            return self if read_value else None
        commit_copies(self._values, kind, [coerced] * self._n)
        return self if read_value else None

    def count_up_to(self, limit: int) -> np.ndarray:
        """As ``Variable.count_up_to``: inside ``strategy.run`` on the replica's own copy;
        in cross-replica context on every copy, checked against the aggregated value
        (ValueError for aggregation SUM, whose +1 could not be split across the copies)."""
        if self._replica_context() is None and self._aggregation is VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable '{self.name}' with aggregation SUM does not support count_up_to in "
                "cross-replica context (the change could not be split across the copies); call it inside "
                "strategy.run"
            )
        return DistributedVariable.count_up_to(self, limit)


def _split_sum(value: np.ndarray, n: int) -> List[np.ndarray]:
    """``n`` parts that sum to ``value`` exactly, each close to value/n, whatever order the
    engine adds them in. Integers: the quotient each, and the remainder spread one by
    one over the first copies, so that a saved counter of 7 over 2 copies loads as 4 + 3,
    never 3 + 3. Floats: see ``_split_float``; complex numbers: their real and imaginary
    parts split alike."""
    if value.dtype.kind == "b":
        return [value.copy()] * n
    if value.dtype.kind == "c":
        parts = []
        for re, im in zip(_split_float(value.real, n), _split_float(value.imag, n)):
            part = np.empty_like(value)
            part.real, part.imag = re, im  # (re + 1j * im would lose a -0.0)
            parts.append(part)
        return parts
    if value.dtype.kind not in "iu":
        return _split_float(value, n)
    q, rem = np.divmod(value, value.dtype.type(n))
    return [np.asarray(q + (rem > k), dtype=value.dtype) for k in range(n)]


def _split_float(value: np.ndarray, n: int) -> List[np.ndarray]:
    """``n`` parts of a float ``value`` whose sum, in any order, is ``value`` exactly.

    value/n on every copy (TensorFlow's split) does not sum back: value/n rounded, added
    n times, rounds again (float64 0.3 over 4 copies reads 0.30000000000000004; float16
    65504 over 3 copies is 21840 each, 65520 in all: inf). Here every copy but the first
    takes value/n rounded toward zero to a multiple of u, a unit of the last place of
    ``value`` (``|value| - nextafter(|value|, 0)``, a power of two), and the first takes the
    rest. Every part and every partial sum of them is then a multiple of u no larger than
    ``|value|``, which the dtype holds exactly: no addition rounds. The arithmetic runs in
    float64 on integers below 2^53 (the count of u in ``value``), exact for dtypes of up
    to 53 significant bits. Zeros (of either sign), infinities and NaN go to every copy as
    they are (-0.0 summed stays -0.0); a dtype of more significant bits (long double) puts
    the value on the first copy and -0.0, which leaves any sum as it is, on the others."""
    dtype = value.dtype
    if dtype.itemsize > 8:
        rest = np.full_like(value, -0.0)
        return [value.copy()] + [rest] * (n - 1)
    magnitude = np.abs(value)
    with np.errstate(invalid="ignore", over="ignore"):
        unit = (magnitude - np.nextafter(magnitude, np.zeros_like(magnitude))).astype(np.float64)
        wide = value.astype(np.float64)
        split = np.isfinite(wide) & (wide != 0)
        units = np.where(split, wide / np.where(split, unit, 1.0), 0.0)  # an integer, exactly
        # k = units / n rounded toward zero: fmod is exact, and so is the division of the
        # multiple of n that remains.
        k = (units - np.fmod(units, n)) / n
        part = np.where(split, k * unit, wide)
        first = np.where(split, (units - k * (n - 1)) * unit, wide)
    return [first.astype(dtype)] + [part.astype(dtype)] * (n - 1)
