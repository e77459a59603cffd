"""``CrossReplicaExtended``: the cross-replica collectives of the replicas of one process
(``strategy.reduce`` and ``gather``, ``extended.reduce_to``, ``batch_reduce_to`` and
``broadcast_to``), on values that hold every replica's part, outside ``strategy.run`` or
from ``merge_call``. They run on the strategy's ``Collectives`` like the meetings of
``strategy.run``; ``LocalExtended`` adds the replicas, their steps and their meetings.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, List, Optional, Sequence, Tuple

import numpy as np

from . import kinds, nest
from ._convert import refuse_masked
from .collectives import (
    REDUCIBLE_KINDS,
    Collectives,
    accumulator_dtype,
    engine_supports,
    normalize_axis,
    numpy_reduce,
    type_name,
    work_dtype,
)
from .extended import StrategyExtended
from .options import CommunicationOptions
from .reduce_op import ReduceOp, as_reduce_op
from .sparse import IndexedSlices
from .sparse_collectives import holds_sparse, is_sparse, reduce_sparse, refuse_op
from .values import DistributedValues, Mirrored, PerReplica
from .variables import Variable

__all__ = ["CrossReplicaExtended", "reduced_alone", "unwrap_part"]


class CrossReplicaExtended(StrategyExtended):
    """The cross-replica half of ``LocalExtended`` (which sets the state below)."""

    _n: int
    _coll: Collectives
    _lock: Any
    _on_gpu: bool
    _via_root: Optional[int]
    _algorithm: str
    _options: CommunicationOptions

    if TYPE_CHECKING:  # pragma: no cover - LocalExtended's

        @property
        def _places(self) -> Tuple[Optional[int], ...]: ...

        def _all_reduce_leaves(
            self,
            op: ReduceOp,
            leaves: List[List[Any]],
            algorithm: str,
            bytes_per_pack: int,
            value: Any = None,
            label: str = "",
        ) -> List[List[Any]]: ...

        def _total_replicas(self) -> int: ...

    def _together(self, what: str, value: Any, how: str = "") -> ContextManager[None]:
        """Around one collective's checks and calls. Nothing to do in one process; a
        multi-worker strategy keeps its workers' sequences of collectives aligned there
        when the collective fails, or needs no MPI call, on some worker only."""
        return contextlib.nullcontext()

    def _reduce_objects(self, op: ReduceOp, parts: List[Any], first: Any, what: str) -> np.ndarray:
        """The reduction of parts of object dtype (Python numbers such as Fractions), by
        numpy's object arithmetic."""
        return _numpy_objects(op, parts, first, what)

    def _parts(self, value: DistributedValues, what: str) -> List[Any]:
        parts = value.values
        if len(parts) != self._n:
            raise ValueError(
                f"{what}: a {type(value).__name__} with {len(parts)} values cannot be combined by a "
                f"strategy with {self._n} replicas"
            )
        return list(parts)

    def _part_values(self, value: DistributedValues, what: str) -> List[Any]:
        out = []
        for r, p in enumerate(self._parts(value, what)):
            if isinstance(p, Variable):
                p = p._read()
            else:
                refuse_masked(p, r, what)
            try:
                out.append(kinds.to_engine_value(p) if self._on_gpu else kinds.to_numpy(p))
            except ValueError as e:  # numpy's, for a ragged list: which value it was
                raise ValueError(f"{what}: replica {r}'s value of type {type(p).__name__} is not an array: {e}") from e
        return out

    def _reduce_one(self, op: ReduceOp, value: Any, axis: Optional[int], what: str, label: str = "") -> Any:
        """``strategy.reduce`` of one value (``label``: what the call is for, see
        ``Collectives.all_reduce``)."""
        if not isinstance(value, DistributedValues):
            return self._reduce_plain(op, value, axis, what)
        if holds_sparse(value):
            return self._reduce_sparse(op, value, axis, what)
        parts = self._part_values(value, what)
        original = unwrap_part(value.values[0])
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN and axis is None:
            # Every copy is the value: its mean is a copy of it, in a MEAN's dtype.
            mean = reduced_alone(op, parts[0])
            return _new_copy(mean, original) if mean is parts[0] else kinds.restore(mean, original)
        with self._lock:
            if axis is None:
                _first_difference([tuple(p.shape) for p in parts], [p.dtype for p in parts], what)
                if not _numeric(parts[0].dtype):
                    out = self._reduce_objects(op, parts, value.values[0], what)
                else:
                    out = self._coll.reduce(op, parts, label=label)
            else:
                out = self._reduce_along(op, parts, axis, what)
        return kinds.restore(out, original)

    def _reduce_sparse(self, op: ReduceOp, value: DistributedValues, axis: Optional[int], what: str) -> Any:
        """The replicas' IndexedSlices as one: their rows gathered (SUM), the values
        divided by the number of replicas as well (MEAN); see
        distvals.sparse_collectives. A Mirrored one too: its copies' rows gathered and
        divided are the value itself once applied or made dense."""
        _refuse_sparse_axis(axis, what)
        convert = kinds.to_engine_value if self._on_gpu else kinds.to_numpy
        parts = self._parts(value, what)
        with self._lock:
            return reduce_sparse(
                op, parts, self._total_replicas(), convert, lambda arrays: self._coll.gather(arrays, 0), what
            )

    def _reduce_structure(self, op: ReduceOp, value: Any, what: str) -> Any:
        """``strategy.reduce`` of a nested structure whose leaves are all distributed
        values: one all-reduce for every leaf (small leaves packed), described with the
        whole structure, so that processes of a multi-worker strategy that pass different
        keys or nestings are told so. None when some leaf is not distributed (or is a
        Mirrored under MEAN, which needs no collective): then leaf by leaf."""
        leaves = nest.flatten(value)
        if (
            not leaves
            or not all(
                isinstance(x, DistributedValues) and not (isinstance(x, Mirrored) and op is ReduceOp.MEAN)
                for x in leaves
            )
            or self._via_root is not None
            or any(holds_sparse(x) for x in leaves)  # gathered leaf by leaf (_reduce_sparse)
        ):
            return None
        parts = [self._as_parts(x, what) for x in leaves]
        for ps in parts:
            _first_difference([tuple(p.shape) for p in ps], [p.dtype for p in ps], what)
            dt = ps[0].dtype
            if dt.hasobject or dt.kind not in REDUCIBLE_KINDS:
                return None
        n = len(parts[0])
        rows = [[ps[r] for ps in parts] for r in range(n)]
        with self._lock:
            results = self._all_reduce_leaves(
                op, rows, self._algorithm, 0, nest.pack_sequence_as(value, [ps[0] for ps in parts])
            )
        firsts = [unwrap_part(x.values[0]) for x in leaves]
        return nest.pack_sequence_as(value, [kinds.restore(o, f) for o, f in zip(results[0], firsts)])

    def _as_parts(self, value: DistributedValues, what: str) -> List[Any]:
        return self._part_values(value, what)

    def _agree_structure(self, what: str, value: Any) -> None:
        """Before a structure's leaves are reduced or gathered one by one: nothing to agree
        on within one process (a multi-worker strategy makes its workers agree on the
        structure here)."""

    def _reduce_along(self, op: ReduceOp, parts: List[Any], axis: int, what: str) -> Any:
        """``strategy.reduce`` with an axis: each part reduced along it (on the host), then
        across replicas; MEAN is the global mean over every element along the axis."""
        from . import devices

        hosts = [devices.to_host(p) for p in parts]
        axes = [normalize_axis(axis, h.ndim, what, r) for r, h in enumerate(hosts)]
        # Checked before each part is reduced alone, as gather checks them: the parts
        # would otherwise meet in replica 0's dtype (an integer one truncated the others'
        # floats) or be compared by their reduced shapes.
        for r, h in enumerate(hosts):
            if h.ndim != hosts[0].ndim:
                raise ValueError(
                    f"{what}: replica {r} has rank {h.ndim}, replica 0 has rank {hosts[0].ndim}; "
                    f"shapes may differ only along axis {axes[0]}"
                )
        _first_difference([tuple(h.shape) for h in hosts], [h.dtype for h in hosts], what, axes[0])
        # 16-bit floats accumulate in float32 (as every other path does), both along the
        # axis and across replicas; the result is rounded to their dtype once, at the end.
        acc = accumulator_dtype(hosts[0].dtype)
        if op is ReduceOp.MEAN:
            numer = [
                np.asarray(np.sum(h, axis=a, dtype=acc if acc is not None else work_dtype(h.dtype, op)))
                for h, a in zip(hosts, axes)
            ]
            count = self._coll.total(sum(h.shape[a] if h.ndim else 1 for h, a in zip(hosts, axes)))
            total = self._coll.reduce(ReduceOp.SUM, self._to_places(numer))
            total = devices.to_host(total)
            out = np.asarray(total / total.dtype.type(count) if count else total * np.nan)
        else:
            local = [_local_reduce(op, h, a, acc) for h, a in zip(hosts, axes)]
            out = devices.to_host(self._coll.reduce(op, self._to_places(local)))
        if acc is not None:
            out = _round_to(out, hosts[0].dtype)
        if any(devices.is_device_array(p) for p in parts):
            return devices.to_replica_device(out, self._places[0])
        return out

    def _to_places(self, hosts: List[np.ndarray]) -> List[Any]:
        from . import devices

        if not self._on_gpu:
            return hosts
        return [
            devices.to_replica_device(h, p) if devices.can_place(h.dtype) else h for h, p in zip(hosts, self._places)
        ]

    def _reduce_plain(self, op: ReduceOp, value: Any, axis: Optional[int], what: str) -> Any:
        if op in (ReduceOp.SUM, ReduceOp.PRODUCT) and self._total_replicas() > 1:
            raise ValueError(
                f"{what}: a non-distributed value cannot be reduced with {op.name} across "
                f"{self._total_replicas()} replicas (it is not one value per replica); pass a PerReplica, such "
                "as the result of strategy.run"
            )
        refuse_masked(value, None, what)
        if is_sparse(value):
            # One IndexedSlices that stands for every replica's (MEAN), or the one
            # replica's: the value itself, for the ops that reduce IndexedSlices.
            refuse_op(op, what)
            _refuse_sparse_axis(axis, what)
            return value
        if axis is None:
            part = unwrap_part(value)
            one = reduced_alone(op, part)
            if one is not part:
                return one
            # The value itself is its reduction; an array comes back as a new array (on
            # the host or its GPU, in its framework), as every other reduction's result
            # does: one that the caller then changes in place must not change the value it
            # came from.
            return _new_copy(part, value)
        from . import devices

        a = kinds.to_numpy(unwrap_part(value))
        ax = normalize_axis(axis, a.ndim, what, 0)
        acc = accumulator_dtype(a.dtype)
        if a.ndim == 0:
            out = reduced_alone(op, a)
        elif op is ReduceOp.MEAN:
            out = np.asarray(np.mean(a, axis=ax, dtype=acc or work_dtype(a.dtype, op)))
        else:
            out = _local_reduce(op, a, ax, acc)
        if acc is not None:
            out = _round_to(out, a.dtype)
        if devices.is_device_array(value):
            # A GPU value was reduced on the host; its result goes back where it came from.
            return devices.to_replica_device(out, devices.place_of(value))
        return kinds.restore(out, unwrap_part(value))

    def _gather_one(self, value: Any, axis: int, what: str, label: str = "") -> Any:
        if not isinstance(value, DistributedValues):
            a = kinds.to_engine_value(unwrap_part(value)) if self._on_gpu else kinds.to_numpy(unwrap_part(value))
            normalize_axis(axis, a.ndim, what, 0)
            if a.ndim == 0 and self._total_replicas() == 1 and isinstance(a, np.ndarray):
                # The one replica's 0-d value (run returns it plain): gathered as every
                # replica's 0-d parts are, into a vector (of one element).
                a = a.reshape(1)
            # A new array, as a gather of parts makes (``a`` may be the caller's own).
            return _new_copy(a, unwrap_part(value))
        parts = self._part_values(value, what)
        ax = normalize_axis(axis, parts[0].ndim, what, 0)
        for r, p in enumerate(parts):
            if p.ndim != parts[0].ndim:
                raise ValueError(
                    f"{what}: replica {r} has rank {p.ndim}, replica 0 has rank {parts[0].ndim}; "
                    f"shapes may differ only along axis {ax}"
                )
        _first_difference([tuple(p.shape) for p in parts], [p.dtype for p in parts], what, ax)
        with self._lock:
            out = self._coll.gather(parts, ax, label=label)
        return kinds.restore(out, unwrap_part(value.values[0]))

    def _place_of(self, device: str) -> Optional[int]:
        """The place of a destination device: a replica's own CUDA device, else as named."""
        from . import devices

        if device in self._devices:
            return self._places[self._devices.index(device)]
        return devices.place_of_device(device)

    def _placed(self, result: Any, original: Any) -> Any:
        """A result bound for replicas' devices: a device array stays one when the value
        came from numpy or Python (it lives where its destination is); otherwise it goes
        back to the original's framework."""
        if not self._on_gpu:
            return kinds.restore(result, original)
        from . import devices

        if devices.is_device_array(result) and kinds.framework_of(original) in ("numpy", "other"):
            return result
        return kinds.restore(result, original)

    def _put(self, value: Any, device: str, copy: bool) -> Any:
        """``value`` on ``device`` (a copy when ``copy``): a device array on a GPU
        destination, host memory on a CPU one, in the framework of ``value``."""
        from . import devices

        if is_sparse(value):
            values, indices = self._put(value.values, device, copy), self._put(value.indices, device, copy)
            return IndexedSlices(values, indices, value.dense_shape)
        place = self._place_of(device) if self._on_gpu else None
        v = kinds.to_engine_value(value) if self._on_gpu else kinds.to_numpy(value)
        if place is None or not devices.can_place(v.dtype):
            host = devices.to_host(v)
            out = np.array(host, copy=True) if copy else host
        else:
            out = devices.to_replica_device(v, place, copy=copy)
        return self._placed(out, value)

    def _spread(self, out: Any, dests: List[str], fresh: bool = True) -> Any:
        """``out`` on every destination: the value itself for one, a Mirrored of copies.
        ``fresh``: ``out`` is a new value of this call's own (else every destination gets
        a copy, so that changing a result in place cannot change the caller's value)."""
        if len(dests) == 1:
            return self._put(out, dests[0], copy=not fresh)
        return Mirrored(tuple(self._put(out, d, copy=i > 0 or not fresh) for i, d in enumerate(dests)))

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a PerReplica, or a plain value present on every replica) onto
        ``destinations``: a Mirrored with one copy per destination device, or the value
        itself for one destination; each copy lives on its destination device."""
        self._require_cross_replica("extended.reduce_to")
        op = as_reduce_op(reduce_op)
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        dests = self._destinations(destinations, "reduce_to")
        if not isinstance(value, DistributedValues) and nest.is_nested(value):
            # A structure (of PerReplica values): reduced leaf by leaf, as TensorFlow does.
            return nest.map_structure(lambda v: self.reduce_to(op, v, destinations, options), value)
        if not isinstance(value, DistributedValues):
            out = self._reduce_plain(op, value, None, "reduce_to")
            if len(dests) == self._n and dests == list(self._devices) and self._n > 1:
                return Mirrored(tuple(self._broadcast_value(out)))
            return self._spread(out, dests)
        if holds_sparse(value):
            return self._spread(self._reduce_sparse(op, value, None, "reduce_to"), dests)
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
            # Every copy is the value, so its mean is the value itself (in a MEAN's dtype):
            # copied, as every reduction's result is new.
            part = unwrap_part(value.values[0])
            mean = reduced_alone(op, part)
            return self._spread(mean, dests, fresh=mean is not part)
        parts = self._part_values(value, "reduce_to")
        original = unwrap_part(value.values[0])
        # (Values that are not numbers take the general path, which reduces Python
        # objects and names anything else.)
        if dests == list(self._devices) and self._n > 1 and _numeric(parts[0].dtype):
            _first_difference([tuple(p.shape) for p in parts], [p.dtype for p in parts], "reduce_to")
            with self._lock:
                outs = self._all_reduce_leaves(op, [[p] for p in parts], self._algorithm_of(options), 0)
            return Mirrored(tuple(self._placed(o[0], original) for o in outs))
        out = kinds.restore(self._reduce_one(op, value, None, "reduce_to"), original)
        return self._spread(out, dests)

    def _algorithm_of(self, options: Optional[CommunicationOptions]) -> str:
        """The all-reduce algorithm of a call with ``options``: theirs, unless they leave
        it to the library ("auto"), then the strategy's."""
        if options is None or options.implementation == "auto":
            return self._algorithm
        return options.implementation

    def _broadcast_value(self, value: Any) -> List[Any]:
        """N copies of ``value``, one where each replica's values live."""
        v = kinds.to_engine_value(unwrap_part(value)) if self._on_gpu else kinds.to_numpy(unwrap_part(value))
        # Local copies only (a value every process already has): the collectives of this
        # process, never the ones across processes.
        local = getattr(self._coll, "local", self._coll)
        with self._lock:
            outs = local.broadcast([[v]] * self._n, 0)
        return [self._placed(o[0], unwrap_part(value)) for o in outs]

    def batch_reduce_to(
        self, reduce_op: Any, value_destination_pairs: Sequence[Tuple[Any, Any]], options: Any = None
    ) -> List[Any]:
        """``reduce_to`` for a list of (value, destinations) pairs."""
        self._require_cross_replica("extended.batch_reduce_to")
        if not isinstance(value_destination_pairs, (list, tuple)):
            raise TypeError("batch_reduce_to: value_destination_pairs must be a list of (value, destinations) pairs")
        op = as_reduce_op(reduce_op)
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        out: List[Any] = [None] * len(value_destination_pairs)
        fused: List[int] = []
        for i, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"batch_reduce_to: item {i} is not a (value, destinations) pair")
            value, dests = pair
            # Which items travel together depends on the values alone (never on local
            # replica counts or destinations), so that every process of a multi-worker
            # strategy makes the same collective calls.
            if (
                isinstance(value, DistributedValues)
                and self._via_root is None
                and not (isinstance(value, Mirrored) and op is ReduceOp.MEAN)
                and not holds_sparse(value)  # its rows are gathered, not reduced (reduce_to)
                and not _holds_objects(value)  # Python numbers: numpy's object arithmetic (reduce_to)
            ):
                fused.append(i)
            else:
                out[i] = self.reduce_to(op, value, dests, options)
        if fused:
            # Every distributed value in one all-reduce: the small leaves travel packed
            # (one engine call per dtype), as TensorFlow's batch_reduce_to fuses gradients.
            values = [value_destination_pairs[i][0] for i in fused]
            with self._together("extended.batch_reduce_to", values, f"({op.name})"):
                results = self._batch_all_reduce(op, fused, values, options)
            devices_here = list(self._devices)
            placed = self._placed
            for k, i in enumerate(fused):
                original = unwrap_part(values[k].values[0])
                dests = self._destinations(value_destination_pairs[i][1], "batch_reduce_to")
                if dests == devices_here:
                    out[i] = Mirrored._of(tuple([placed(results[r][k], original) for r in range(self._n)]))
                else:
                    out[i] = self._spread(kinds.restore(results[0][k], original), dests)
        return out

    def _batch_all_reduce(self, op: ReduceOp, fused: List[int], values: List[Any], options: Any) -> List[List[Any]]:
        """The fused items of ``batch_reduce_to`` (indices ``fused``, distributed
        ``values``) checked, then all-reduced together: results[r][k] for replica r."""
        parts = [self._part_values(v, "batch_reduce_to") for v in values]
        for k, ps in enumerate(parts):
            p0 = ps[0]
            shape, dtype = p0.shape, p0.dtype
            if not _numeric(dtype):
                raise TypeError(
                    f"batch_reduce_to (item {fused[k]}): cannot reduce replica 0's value of type "
                    f"{type_name(values[k].values[0], p0)} with {op.name}; pass numbers or arrays of numbers "
                    "(reduce_to reduces Python numbers such as Fractions)"
                )
            for p in ps:
                if p.shape != shape or p.dtype != dtype:
                    # Named here, before any data moves.
                    _first_difference(
                        [tuple(p.shape) for p in ps], [p.dtype for p in ps], f"batch_reduce_to (item {fused[k]})"
                    )
        leaves = [[ps[r] for ps in parts] for r in range(self._n)]
        opts = self._options if options is None else self._options.merge(options)
        with self._lock:
            return self._all_reduce_leaves(
                op, leaves, self._algorithm_of(options), opts.bytes_per_pack, [v.values[0] for v in values]
            )

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies a non-distributed ``tensor`` to every destination device: a Mirrored
        (or the value itself for one destination)."""
        self._require_cross_replica("extended.broadcast_to")
        if isinstance(tensor, PerReplica):
            raise ValueError("broadcast_to: the value is a PerReplica; reduce it first (reduce_to)")
        dests = self._destinations(destinations, "broadcast_to")
        value = unwrap_part(tensor.values[0]) if isinstance(tensor, DistributedValues) else unwrap_part(tensor)
        _refuse_structure(value, "broadcast_to")
        if len(dests) == 1:
            # A copy, as for several destinations: changing the result in place must not
            # change the caller's value.
            return self._put(value, dests[0], copy=True)
        if dests == list(self._devices):
            return Mirrored(tuple(self._broadcast_value(value)))
        # Every copy new, as above: changing one in place changes neither the others nor
        # the caller's value.
        return Mirrored(tuple(self._put(value, d, copy=True) for d in dests))


def _new_copy(a: Any, original: Any) -> Any:
    """A copy of ``a`` (``original``'s value, or a view or conversion of it) that shares no
    memory with ``original``, in ``original``'s kind: numpy arrays and device arrays are
    copied where they live; a Python value that is not an array comes back as it is."""
    from . import devices

    if isinstance(a, (np.generic, int, float, complex, bool)):
        return a  # immutable
    if isinstance(a, np.ndarray) or devices.is_device_array(a) or kinds.framework_of(a) != "other":
        return kinds.restore(devices.copy(a), original)
    return a


def reduced_alone(op: ReduceOp, x: Any) -> Any:
    """``op`` over one value that stands for every replica's (a plain value, or a
    Mirrored's copy under MEAN): ``x`` itself, or a new value of ``x``'s kind, where it
    lives, in the dtype ``op`` gives with any number of replicas where that differs (an
    integer MEAN's float dtype, the int64 SUM or PRODUCT of bools)."""
    from . import devices

    if devices.is_device_array(x):
        dt = np.dtype(x.dtype)
        work = work_dtype(dt, op)
        return x if work == dt else devices.cast(x, work)
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, (int, float, complex, np.generic)) or kinds.framework_of(x) != "other":
        a = kinds.to_numpy(x)
    else:
        return x
    work = work_dtype(a.dtype, op)
    if work == a.dtype or a.dtype.kind not in "iub":
        return x
    return kinds.restore(np.asarray(a, dtype=work), x)


def _refuse_sparse_axis(axis: Optional[int], what: str) -> None:
    if axis is not None:
        raise ValueError(
            f"{what}: IndexedSlices are reduced across replicas only (axis=None), got axis={axis}; make them "
            "dense arrays first to reduce along an axis"
        )


def _refuse_structure(value: Any, what: str) -> None:
    """TypeError when ``value`` is a structure rather than one array-like value (a list
    of numbers is one; a list holding a dict or arrays of other shapes is not): made into
    one array, it would become an array of Python objects."""
    if nest.is_mapping(value):
        bad = True
    elif isinstance(value, (list, tuple)):
        try:
            bad = np.asarray(value).dtype.hasobject
        except ValueError:  # ragged
            bad = True
    else:
        return
    if bad:
        raise TypeError(
            f"{what}: the value is a {type(value).__name__} of several values, not one array; "
            f"call {what} on each of its arrays"
        )


def unwrap_part(x: Any) -> Any:
    return x._read() if isinstance(x, Variable) else x


def _round_to(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """A float32 result rounded to its 16-bit dtype; past its range it is infinite, as
    the same sum in the engine gives (no warning, as there)."""
    with np.errstate(over="ignore"):
        return np.asarray(x.astype(dt))


def _local_reduce(op: ReduceOp, a: np.ndarray, axis: int, acc: Optional[np.dtype] = None) -> np.ndarray:
    """One part reduced along ``axis`` with ``op`` (SUM and PRODUCT in ``acc`` when given,
    else in the part's dtype, wrapping as numpy does). MIN and MAX of an empty part give
    the op's identity (-inf / +inf, or the integer type's extremes, as TensorFlow's
    reduce_max / reduce_min do), so that an empty part, the tail of a last partial batch,
    leaves the others' result alone."""
    if a.ndim == 0:
        return a
    if op is ReduceOp.SUM or op is ReduceOp.PRODUCT:
        # (numpy's sum takes a dtype in native byte order only.)
        dtype = acc if acc is not None else (a.dtype.newbyteorder("=") if a.dtype.kind != "b" else None)
        if op is ReduceOp.SUM:
            return np.asarray(np.sum(a, axis=axis, dtype=dtype))
        return np.asarray(np.prod(a, axis=axis, dtype=dtype))
    ufunc: np.ufunc = np.minimum if op is ReduceOp.MIN else np.maximum
    if a.shape[axis] == 0:
        initial = _identity(op, a.dtype)
        if initial is not None:
            return np.asarray(ufunc.reduce(a, axis=axis, initial=initial))
    return np.asarray(ufunc.reduce(a, axis=axis))


def _identity(op: ReduceOp, dt: np.dtype) -> Any:
    """MIN's (MAX's) identity in ``dt``: what no value is above (below); None if none."""
    big = op is ReduceOp.MIN
    if dt.kind == "f" or dt.name == "bfloat16":
        return dt.type(np.inf if big else -np.inf)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.max if big else info.min
    if dt.kind == "b":
        return big
    return None


def _holds_objects(value: DistributedValues) -> bool:
    """Whether replica 0's part of ``value`` is Python objects (Fractions, Decimals, an
    object array): ``reduce_to`` reduces those with numpy's object arithmetic, or names
    what is not a number; the fused all-reduce takes numbers only."""
    p = unwrap_part(value.values[0])
    dt = getattr(p, "dtype", None)
    if dt is None:
        try:
            dt = np.asarray(p).dtype
        except (TypeError, ValueError):  # a ragged list: the fused path names it
            return False
    return isinstance(dt, np.dtype) and dt.hasobject


def _numeric(dt: np.dtype) -> bool:
    """Whether values of ``dt`` reduce as numbers (in the engine, or with numpy)."""
    return not dt.hasobject and (dt.kind in REDUCIBLE_KINDS or engine_supports(dt))


def _numpy_objects(op: ReduceOp, parts: List[Any], first: Any, what: str) -> np.ndarray:
    """Parts numpy cannot reduce as numbers: Python objects that support the operation
    (Fraction, Decimal) are reduced by numpy; anything else is a TypeError naming it."""
    a = parts[0]
    if not a.dtype.hasobject:
        raise TypeError(
            f"{what}: cannot reduce replica 0's value of type {type_name(first, a)} with {op.name}; "
            "pass numbers or arrays of numbers"
        )
    try:
        return numpy_reduce(np.stack(parts), op, a.dtype)
    except TypeError as e:
        raise TypeError(
            f"{what}: cannot reduce replica 0's value of type {type_name(first, a)} with {op.name} "
            f"({e}); pass numbers or arrays of numbers"
        ) from None


def _first_difference(
    shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[Any], what: str, axis: Optional[int] = None
) -> None:
    """Cross-replica checks of the parts of one value (TypeError for dtypes, ValueError
    for shapes), naming the first replica that differs."""
    s0, d0 = shapes[0], dtypes[0]
    for r, (s, d) in enumerate(zip(shapes, dtypes)):
        if d != d0:
            raise TypeError(
                f"{what}: replica {r} has dtype {d}, replica 0 has {d0}; every replica's value needs the same dtype"
            )
        if axis is None:
            if s != s0:
                raise ValueError(
                    f"{what}: replica {r} has shape {s}, replica 0 has {s0}; every replica's value needs the same shape"
                )
        elif len(s) != len(s0) or any(a != b for i, (a, b) in enumerate(zip(s, s0)) if i != axis):
            raise ValueError(
                f"{what}: replica {r} has shape {tuple(s)}, replica 0 has shape {tuple(s0)}; "
                f"shapes may differ only along axis {axis}"
            )
