"""Strategies: ``MirroredStrategy``, ``OneDeviceStrategy`` and the default strategy.

A strategy owns N replicas (one per device), an engine group for their collectives and
a thread per replica beyond the first. ``run`` calls a function once per replica in
parallel; ``reduce``, ``gather`` and the ``extended`` methods combine per-replica values
in cross-replica context.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import context, cross_device, device_collectives, nest
from . import devices as device_util
from ._core import AbortedError, ClosedError, CollectiveTimeoutError, MismatchError, parse_device
from .group import ReplicaGroup
from .options import (
    DEFAULT_TIMEOUT_SECONDS,
    CollectiveAllReduce,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
)
from .reduce_op import ReduceOp, as_reduce_op
from .runner import MergeBarrier, ReplicaRunner, _StepTimeout
from .values import DistributedValues, Mirrored, PerReplica, contains_distributed, regroup, select_replica

__all__ = ["Strategy", "StrategyExtended", "MirroredStrategy", "OneDeviceStrategy"]

_FULL_PREFIX = "/job:localhost/replica:0/task:0/device:"
# How long a new step waits for replicas of an abandoned step that were just released
# (they return within milliseconds unless busy in their own code).
_BUSY_WAIT = 0.2


def _full_name(device: str) -> str:
    return _FULL_PREFIX + device


def _gpu_count() -> int:
    """How many GPU replicas can run here: logical GPUs (``distvals.config``), so that
    "GPU:3" works on one GPU after ``set_logical_gpus(4)``."""
    import distvals

    cuda = getattr(distvals, "cuda", None)
    count = getattr(cuda, "logical_device_count", None) or getattr(cuda, "device_count", None)
    if count is None:
        return 0
    try:
        return int(count() if callable(count) else count)
    except Exception:  # noqa: BLE001 - no driver, no GPU
        return 0


def _no_gpu_hint(have: int) -> str:
    if have:
        return ("several replicas can share one GPU: distvals.config.set_logical_gpus(k) makes each GPU "
                "appear as k logical GPUs")
    import distvals

    cuda = getattr(distvals, "cuda", None)
    reason = getattr(cuda, "unavailable_reason", None)
    why = ""
    if callable(reason):
        try:
            why = str(reason())
        except Exception:  # noqa: BLE001 - the reason is only a hint
            why = ""
    return (f"{why + '; ' if why else ''}use CPU devices such as 'CPU:0', 'CPU:1' for logical replicas")


def _canonical_devices(devices: Any, what: str) -> List[str]:
    if devices is None:
        gpus = _gpu_count()
        return [f"GPU:{i}" for i in range(gpus)] if gpus else ["CPU:0"]
    if isinstance(devices, str):
        raise TypeError(f"{what}: devices must be a list of device names such as ['CPU:0', 'CPU:1'], not one string")
    try:
        devices = list(devices)
    except TypeError:
        raise TypeError(f"{what}: devices must be a list of device names, got {type(devices).__name__}") from None
    if not devices:
        raise ValueError(f"{what}: devices must not be empty")
    out: List[str] = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"{what}: device names must be strings, got {type(d).__name__} {d!r}")
        try:
            c = parse_device(d)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if c in out:
            raise ValueError(f"{what}: device {d!r} ({c}) is listed twice; every replica needs its own device")
        out.append(c)
    gpus = [c for c in out if c.startswith("GPU:")]
    if gpus:
        if len(gpus) != len(out):
            raise ValueError(
                f"{what}: {out} mixes CPU and GPU devices; a strategy's replicas are either all CPUs "
                "or all GPUs"
            )
        have = _gpu_count()
        missing = [c for c in gpus if int(c.split(":")[1]) >= have]
        if missing:
            raise ValueError(
                f"{what}: {', '.join(missing)} requested, but distvals sees {have} GPU(s); "
                + _no_gpu_hint(have)
            )
    return out


def _replica_error(failure) -> BaseException:
    """The exception to raise for a replica's failure: the same type, its message
    prefixed with the replica, the original chained as the cause."""
    e, r = failure.error, failure.replica
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return e
    prefix = f"replica {r}: "
    msg = str(e)
    if msg.startswith(prefix):
        new = None
    else:
        try:
            new = type(e)(prefix + msg)
        except Exception:  # noqa: BLE001 - exception types with other signatures
            new = None
        if new is not None and type(new) is not type(e):
            new = None
    if new is None:
        if e.args and isinstance(e.args[0], str) and not msg.startswith(prefix):
            e.args = (prefix + e.args[0],) + tuple(e.args[1:])
        _set_replica(e, r)
        return e
    _set_replica(new, getattr(e, "replica", r))
    new.__cause__ = e
    return new


def _dtype_mismatch(failures, original: BaseException) -> Optional[BaseException]:
    """When the replicas' all-reduce calls differed because their dtypes did, a
    MismatchError naming the replica whose dtype differs and both dtypes (the engine only
    sees the calls, e.g. an all-gather of raw bytes for a dtype it cannot reduce)."""
    dtypes = {}
    for f in failures:
        d = getattr(f.error, "_distvals_dtypes", None)
        if d is not None:
            dtypes[f.replica] = d
    if len(set(dtypes.values())) < 2:
        return None
    replicas = sorted(dtypes)
    counts = {d: sum(1 for r in replicas if dtypes[r] == d) for d in dtypes.values()}
    # The dtype most replicas pass (ties: the lowest replica's) is the reference.
    common = max((dtypes[r] for r in replicas), key=lambda d: (counts[d], -replicas.index(
        next(r for r in replicas if dtypes[r] == d))))
    odd = next(r for r in replicas if dtypes[r] != common)
    ref = next(r for r in replicas if dtypes[r] == common)

    def show(d: Tuple[str, ...]) -> str:
        return d[0] if len(d) == 1 else "(" + ", ".join(d) + ")"

    error = MismatchError(
        f"replica {odd}: all_reduce: replica {odd} passes dtype {show(dtypes[odd])}, replica {ref} passes "
        f"{show(common)}; every replica's value needs the same dtype"
    )
    _set_replica(error, odd)
    return error


def _set_replica(e: BaseException, r: int) -> None:
    try:
        e.replica = r
    except (AttributeError, TypeError):
        pass


class StrategyExtended:
    """The strategy's lower-level interface (``strategy.extended``)."""

    # GPU replicas: whether there are any, and each replica's place (its CUDA device,
    # or None for a CPU replica); see distvals.devices.
    _on_gpu = False
    _places: Tuple[Optional[int], ...] = ()

    def __init__(self, container_strategy: "Strategy", devices: Sequence[str]) -> None:
        self._container = container_strategy
        self._devices = tuple(devices)
        self._n = len(self._devices)

    # ---- devices -----------------------------------------------------------------------
    @property
    def worker_devices(self) -> Tuple[str, ...]:
        """The replicas' devices, in full form ("/job:localhost/replica:0/task:0/device:CPU:0")."""
        return tuple(_full_name(d) for d in self._devices)

    @property
    def parameter_devices(self) -> Tuple[str, ...]:
        """Where variables live: the replicas' devices."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    def _destinations(self, destinations: Any, what: str) -> List[str]:
        """Canonical device names of ``destinations`` (a device string, a list of them,
        or a distributed value / variable, meaning its devices)."""
        if destinations is None:
            return list(self._devices)
        if isinstance(destinations, DistributedValues):
            if len(destinations.values) == self._n:
                return list(self._devices)
            return list(self._devices[: len(destinations.values)])
        if isinstance(destinations, str):
            items = [destinations]
        elif isinstance(destinations, (list, tuple)):
            items = list(destinations)
        elif isinstance(destinations, np.ndarray):
            # A host array lives on the host (numpy 2's array-API `.device` is "cpu").
            items = ["CPU:0"]
        else:
            dev = getattr(destinations, "device", None)
            if isinstance(dev, str):
                items = [dev]
            else:
                raise TypeError(
                    f"{what}: destinations must be a device string, a list of them, or a distributed "
                    f"value, got {type(destinations).__name__}"
                )
        out = []
        for d in items:
            if not isinstance(d, str):
                raise TypeError(f"{what}: destination devices must be strings, got {type(d).__name__}")
            try:
                out.append(parse_device(d))
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
        if not out:
            raise ValueError(f"{what}: destinations must not be empty")
        return out

    # ---- hooks for strategies whose replicas span several processes ----------------------
    def _initial_value(self, value: np.ndarray) -> np.ndarray:
        """The value a new distributed variable starts from (a multi-worker strategy gives
        every process the chief's)."""
        return value

    def _write_checkpoint(self, write: Callable[[], None]) -> None:
        """Runs ``write``, the file write of ``save_variables`` (a multi-worker strategy
        lets only the chief write)."""
        write()

    def _require_cross_replica(self, what: str) -> None:
        ctx = context.current_run_context()
        if ctx is not None:
            raise RuntimeError(
                f"{what} must be called in cross-replica context, not inside strategy.run (replica "
                f"{ctx.replica_id_in_sync_group}); inside run use ReplicaContext.all_reduce or "
                "all_gather, or reach cross-replica context with "
                "get_replica_context().merge_call(fn)"
            )


class _LocalExtended(StrategyExtended):
    """N replicas in this process, collectives on the engine."""

    def __init__(self, container_strategy: "Strategy", devices: Sequence[str],
                 cross_device_ops: Optional[CrossDeviceOps], options: Optional[CommunicationOptions],
                 what: str, make_group: bool = True) -> None:
        super().__init__(container_strategy, devices)
        if cross_device_ops is None:
            cross_device_ops = CollectiveAllReduce()
        if not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"{what}: cross_device_ops must be a CollectiveAllReduce or ReductionToOneDevice, "
                f"got {type(cross_device_ops).__name__}"
            )
        if options is None:
            options = CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"{what}: communication_options must be a CommunicationOptions, got {type(options).__name__}")
        self._cross_device_ops = cross_device_ops
        self._options = options
        self._via_one_device = isinstance(cross_device_ops, ReductionToOneDevice)
        self._root = 0
        if self._via_one_device and cross_device_ops.reduce_to_device is not None:
            if cross_device_ops.reduce_to_device not in self._devices:
                raise ValueError(
                    f"{what}: ReductionToOneDevice(reduce_to_device={cross_device_ops.reduce_to_device!r}) "
                    f"is not one of the strategy's devices {list(self._devices)}"
                )
            self._root = self._devices.index(cross_device_ops.reduce_to_device)
        algorithm = options.implementation
        if algorithm == "auto" and isinstance(cross_device_ops, CollectiveAllReduce):
            algorithm = cross_device_ops.algorithm
        self._algorithm = algorithm
        self._group: Optional[ReplicaGroup] = None
        if make_group:
            try:
                # No spinning: replica threads take turns on the GIL, and a waiter that
                # spins holds the core its peer needs to reach the collective (measured:
                # 2 replicas, 1 KiB all-reduce in run, ~35 us instead of ~80 us).
                self._group = ReplicaGroup(list(self._devices), timeout_seconds=options.timeout_seconds,
                                           spin_us=0)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
            self._timeout = self._group.timeout_seconds
        else:
            self._timeout = options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self._on_gpu = any(device_util.is_gpu(d) for d in self._devices)
        if self._on_gpu and self._group is not None:
            # The CUDA devices the engine group mapped the replicas to when it was made
            # (a later set_logical_gpus does not move existing replicas).
            self._places = tuple(self._group.engine.gpus)
        else:
            self._places = tuple(device_util.place_of_device(d) for d in self._devices)
        self._runner = ReplicaRunner(self._n)
        self._barrier = MergeBarrier(self._n)
        self._contexts = tuple(context.ReplicaContext(container_strategy, r, _num_replicas=self._n)
                               for r in range(self._n))
        self._entries = tuple(c._entry for c in self._contexts)
        self._run_lock = threading.Lock()
        # Variables created under this strategy's scope get one copy per replica.
        self._distributed_variables = False
        self._reset_identity_slots()
        # Set when a step leaves state behind (failure, timeout, merge_call, checked
        # variable updates); the next step clears it.
        self._dirty = False
        self._closed = False

    # ---- run ---------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Callable, args: Sequence, kwargs: Optional[dict]) -> Any:
        if not callable(fn):
            raise TypeError(f"strategy.run: fn must be callable, got {type(fn).__name__}")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"strategy.run: positional args must be a list or tuple, got {type(args).__name__}")
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise ValueError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}")
        ctx = context.current_run_context()
        if ctx is not None:
            raise RuntimeError(
                f"strategy.run cannot be called inside strategy.run (replica "
                f"{ctx.replica_id_in_sync_group}); call the function directly, or use "
                "merge_call to reach cross-replica context"
            )
        if self._closed:
            raise ClosedError(f"{self._container!r} is closed")
        if not self._run_lock.acquire(False):
            raise RuntimeError(
                f"{self._container!r} is already running a step (strategy.run from merge_fn or from "
                "another thread); one step at a time"
            )
        try:
            return self._step(fn, args, kwargs)
        finally:
            self._run_lock.release()

    def _step(self, fn: Callable, args: Sequence, kwargs: dict) -> Any:
        n = self._n
        runner = self._runner
        group = self._group
        if self._dirty:
            # The last step failed, timed out or used merge_call / checked updates:
            # clear that state (a clean step skips all this).
            busy = runner.busy_replicas(_BUSY_WAIT)
            if busy:
                raise RuntimeError(
                    f"replica(s) {', '.join(map(str, busy))} still run a step that timed out or was "
                    "interrupted; the strategy can run again once they return"
                )
            if group is not None and group.aborted:
                group.reset()
            self._barrier.reset()
            self._reset_identity_slots()
            self._dirty = False
        elif group is not None and group.aborted:
            # Aborted or timed out outside any step (a collective started on the group
            # directly): clear it, unless that collective is still inside the engine, in
            # which case this step's collectives report the abort.
            try:
                group.reset()
            except Exception:  # noqa: BLE001 - a collective is in flight
                pass
        self._barrier.begin_step()
        if contains_distributed(args, n, "strategy.run") or contains_distributed(kwargs, n, "strategy.run"):
            per = [(select_replica(r, args), select_replica(r, kwargs)) for r in range(n)]
        else:
            per = [(args, kwargs)] * n
        if n > 1:
            per = [((r, fn, a, k), None) for r, (a, k) in enumerate(per)]
            call = self._call_replica
        else:
            call = fn
        try:
            results = runner.step(call, per, self._entries, self._on_error, self._timeout, self._on_wait_failed)
        except _StepTimeout:
            stuck = [w for w in runner.busy_replicas()]
            raise CollectiveTimeoutError(
                f"replica {stuck[0] if stuck else '?'}: strategy.run did not finish within "
                f"{self._timeout:g} s (replica(s) still running: {', '.join(map(str, stuck)) or 'none'}); "
                "the timeout is CommunicationOptions.timeout_seconds"
            ) from None
        finally:
            if self._dirty:
                self._recover()
        failures = runner.failures
        if failures:
            runner.failures = []
            primary = min(failures, key=lambda f: (isinstance(f.error, AbortedError), f.order))
            if isinstance(primary.error, MismatchError):
                mismatch = _dtype_mismatch(failures, primary.error)
                if mismatch is not None:
                    raise mismatch from primary.error
            error = _replica_error(primary)
            if error is primary.error:
                raise error
            raise error from primary.error
        return regroup(results)

    def _call_replica(self, r: int, fn: Callable, args: Sequence, kwargs: dict) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            # A replica that returns cannot arrive at merge_call any more.
            self._barrier.finished(r)

    def _on_error(self, replica: int, error: BaseException) -> None:
        # Runs on the failing replica's thread: release the others at once.
        self._dirty = True
        self._runner.record_failure(replica, error)
        why = f"replica {replica} raised {type(error).__name__}: {error}"
        group = self._group
        if group is not None and not group.aborted:
            group.abort(replica, why)
        self._barrier.abort(replica, why)

    def _on_wait_failed(self, stuck: List[int], why: BaseException) -> None:
        self._dirty = True
        r = stuck[0] if stuck else -1
        if isinstance(why, _StepTimeout):
            msg = f"replica {r} did not finish strategy.run within {self._timeout:g} s"
        else:
            msg = f"strategy.run interrupted ({type(why).__name__}) while waiting for replica(s) {stuck}"
        group = self._group
        if group is not None and not group.aborted:
            group.abort(r, msg)
        self._barrier.abort(r, msg)

    def _recover(self) -> None:
        group = self._group
        if group is not None and group.aborted and not self._runner.busy_replicas():
            try:
                group.reset()
            except Exception:  # noqa: BLE001 - a replica is still inside; the next run retries
                pass

    # ---- replica context collectives ---------------------------------------------------------
    def _timeout_for(self, options: Optional[CommunicationOptions]) -> Optional[float]:
        if options is None:
            return None
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        return options.timeout_seconds

    def _replica_all_reduce(self, ctx: context.ReplicaContext, reduce_op: Any, value: Any,
                            options: Optional[CommunicationOptions]) -> Any:
        op = _OPS.get(reduce_op) if isinstance(reduce_op, str) else None
        if op is None:
            op = as_reduce_op(reduce_op)
        opts = self._options if options is None else self._options.merge(options)
        algorithm = self._algorithm if options is None or options.implementation == "auto" else options.implementation
        if self._on_gpu:
            return device_collectives.replica_all_reduce(
                self._group, self._places, ctx._replica_id, self._n, op, value,
                algorithm=algorithm, timeout=self._timeout_for(options), bytes_per_pack=opts.bytes_per_pack,
                via_one_device=self._via_one_device, root=self._root,
            )
        return cross_device.replica_all_reduce(
            self._group, ctx._replica_id, self._n, op, value,
            algorithm=algorithm, timeout=self._timeout_for(options), bytes_per_pack=opts.bytes_per_pack,
            via_one_device=self._via_one_device, root=self._root,
        )

    def _reset_identity_slots(self) -> None:
        # Two alternating rows: a replica can be at most one update ahead of another,
        # since each update's all-reduce waits for every replica.
        self._identity_slots = ([None] * self._n, [None] * self._n)
        self._identity_seq = [0] * self._n

    def _replica_all_reduce_checked(self, ctx: context.ReplicaContext, op: ReduceOp, local: Any,
                                    original: Any) -> Tuple[Any, bool]:
        """All-reduces ``local`` and tells whether every replica passed the very same
        object ``original`` (a plain value shared by all replicas)."""
        r = ctx._replica_id
        self._dirty = True
        seq = self._identity_seq
        slots = self._identity_slots[seq[r] & 1]
        seq[r] += 1
        slots[r] = original
        result = self._replica_all_reduce(ctx, op, local, None)
        # The all-reduce returned, so every replica has filled its slot of this row.
        same = all(x is original for x in slots)
        return result, same

    def _replica_broadcast(self, ctx: context.ReplicaContext, value: Any, root: int = 0) -> Any:
        """Replica ``root``'s ``value``, on every replica (one engine call)."""
        if self._on_gpu:
            return device_collectives.replica_broadcast(self._group, self._places, ctx._replica_id, self._n,
                                                        value, root)
        return cross_device.replica_broadcast(self._group, ctx._replica_id, self._n, value, root)

    def _replica_all_gather(self, ctx: context.ReplicaContext, value: Any, axis: int,
                            options: Optional[CommunicationOptions]) -> Any:
        if self._on_gpu:
            return device_collectives.replica_all_gather(self._group, self._places, ctx._replica_id, self._n,
                                                         value, axis, timeout=self._timeout_for(options))
        return cross_device.replica_all_gather(self._group, ctx._replica_id, self._n, value, axis,
                                               timeout=self._timeout_for(options))

    def _merge_call(self, ctx: context.ReplicaContext, merge_fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not callable(merge_fn):
            raise TypeError(f"merge_call: merge_fn must be callable, got {type(merge_fn).__name__}")
        strategy = self._container
        if self._n == 1 or not ctx._in_run:
            with _CrossReplica(strategy):
                return merge_fn(strategy, *args, **kwargs)

        def merge(payloads: List[Any]) -> Any:
            fn = payloads[0][0]
            merged_args = regroup([p[1] for p in payloads], what="merge_call", scalars_by_identity=True)
            merged_kwargs = regroup([p[2] for p in payloads], what="merge_call", scalars_by_identity=True)
            with _CrossReplica(strategy):
                return fn(strategy, *merged_args, **merged_kwargs)

        self._dirty = True
        result = self._barrier.meet(ctx._replica_id, (merge_fn, args, kwargs), merge, self._timeout)
        return select_replica(ctx._replica_id, result)

    # ---- cross-replica collectives ----------------------------------------------------------
    def _parts(self, value: DistributedValues, what: str) -> List[Any]:
        parts = value.values
        if len(parts) != self._n:
            raise ValueError(
                f"{what}: a {type(value).__name__} with {len(parts)} values cannot be combined by a "
                f"strategy with {self._n} replicas"
            )
        return list(parts)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: Optional[int], what: str) -> Any:
        if not isinstance(value, DistributedValues):
            return self._reduce_plain(op, value, axis, what)
        if self._on_gpu:
            return self._reduce_one_gpu(op, value, axis, what)
        parts = [cross_device.as_array(p) for p in self._parts(value, what)]
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN and axis is None:
            return np.array(parts[0], copy=True)
        if axis is None:
            out = cross_device.reduce_parts(self._group, parts, op, what)
            return cross_device.restore_kind(out, value.values[0])
        return _reduce_along(self._group, op, parts, axis, what)

    def _reduce_one_gpu(self, op: ReduceOp, value: DistributedValues, axis: Optional[int], what: str) -> Any:
        """``_reduce_one`` for GPU replicas: device parts give a DeviceArray on the first
        replica's GPU (see distvals.device_collectives)."""
        parts = self._parts(value, what)
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN and axis is None:
            return device_util.copy(device_collectives.as_values(parts[:1])[0])
        if axis is None:
            out = device_collectives.reduce_parts(self._group, self._places, parts, op, what)
            return cross_device.restore_kind(out, value.values[0])
        # Along an axis each replica first reduces its own part, which needs kernels the
        # engine does not have: the parts go through the host, the result back to the GPU.
        vals = device_collectives.as_values(parts)
        out = _reduce_along(None, op, [device_util.to_host(v) for v in vals], axis, what)
        if any(device_util.is_device_array(v) for v in vals):
            return device_util.to_replica_device(out, self._places[0])
        return out

    def _reduce_plain(self, op: ReduceOp, value: Any, axis: Optional[int], what: str) -> Any:
        if op in (ReduceOp.SUM, ReduceOp.PRODUCT) and self._n > 1:
            raise ValueError(
                f"{what}: a non-distributed value cannot be reduced with {op.name} across "
                f"{self._n} replicas (it is not one value per replica); pass a PerReplica, such "
                "as the result of strategy.run"
            )
        if axis is None:
            return value
        a = cross_device.as_array(value)
        ax = cross_device._normalize_axis(axis, a.ndim, what, 0)
        if a.ndim == 0:
            out = a
        elif op is ReduceOp.MEAN:
            out = np.asarray(np.mean(a, axis=ax))
        else:
            out = _local_reduce(op, a, ax)
        if a is not value and device_util.is_device_array(value):
            # A GPU value was reduced on the host; its result goes back where it came from.
            return device_util.to_replica_device(out, device_util.place_of(value))
        return out

    def _place_of(self, device: str) -> Optional[int]:
        """The place of a destination device: a replica's own CUDA device, else as named."""
        if device in self._devices:
            return self._places[self._devices.index(device)]
        return device_util.place_of_device(device)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Optional[CommunicationOptions] = None) -> Any:
        """Reduces ``value`` (a PerReplica, or a plain value present on every replica)
        onto ``destinations``: a Mirrored with one copy per destination device, or the
        value itself for one destination. With GPU replicas every copy is placed on its
        destination: a ``DeviceArray`` on a GPU, a numpy array for a CPU device."""
        self._require_cross_replica("extended.reduce_to")
        op = as_reduce_op(reduce_op)
        self._timeout_for(options)
        dests = self._destinations(destinations, "reduce_to")
        if self._on_gpu:
            return self._reduce_to_gpu(op, value, dests)
        if not isinstance(value, DistributedValues):
            out = self._reduce_plain(op, value, None, "reduce_to")
            if len(dests) == 1:
                return out
            return Mirrored(tuple(cross_device.broadcast_value(self._group, out, len(dests)))
                            if len(dests) == self._n else
                            tuple(np.array(cross_device.as_array(out), copy=True) for _ in dests))
        if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
            base = value.values[0]
            if len(dests) == 1:
                return base
            return Mirrored(tuple(np.array(cross_device.as_array(base), copy=True) for _ in dests))
        parts = self._parts(value, "reduce_to")
        if dests == list(self._devices) and self._n > 1:
            outs = cross_device.all_reduce_parts(self._group, parts, op, self._algorithm,
                                                 self._via_one_device, self._root, "reduce_to")
            return Mirrored(tuple(cross_device.restore_kind(o, parts[0]) for o in outs))
        out = cross_device.restore_kind(cross_device.reduce_parts(self._group, parts, op, "reduce_to"), parts[0])
        if len(dests) == 1:
            return out
        return Mirrored(tuple(out if i == 0 else np.array(out, copy=True) for i in range(len(dests))))

    def _reduce_to_gpu(self, op: ReduceOp, value: Any, dests: List[str]) -> Any:
        """``reduce_to`` for GPU replicas: every result is placed on its destination
        device (a DeviceArray on a GPU destination)."""
        places = [self._place_of(d) for d in dests]
        if isinstance(value, DistributedValues) and not (isinstance(value, Mirrored) and op is ReduceOp.MEAN):
            parts = self._parts(value, "reduce_to")
            if dests == list(self._devices) and self._n > 1:
                outs = device_collectives.all_reduce_parts(self._group, self._places, parts, op, self._algorithm,
                                                           self._via_one_device, self._root, "reduce_to")
                return Mirrored(tuple(cross_device.restore_kind(o, parts[0]) for o in outs))
            out = device_collectives.reduce_parts(self._group, self._places, parts, op, "reduce_to")
            out = cross_device.restore_kind(out, parts[0])
        elif isinstance(value, DistributedValues):
            out = device_collectives.as_values(value.values[:1])[0]  # a Mirrored's MEAN is its value
        else:
            out = self._reduce_plain(op, value, None, "reduce_to")
        if len(dests) == 1:
            return _put(out, places[0])
        if dests == list(self._devices):
            copies = device_collectives.broadcast_value(self._group, self._places, out, self._n)
        else:
            copies = [_put(out, p, copy=True) for p in places]
        return Mirrored(tuple(cross_device.restore_kind(c, out) for c in copies))

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Sequence[Tuple[Any, Any]],
                        options: Optional[CommunicationOptions] = None) -> List[Any]:
        """``reduce_to`` for a list of (value, destinations) pairs."""
        self._require_cross_replica("extended.batch_reduce_to")
        if not isinstance(value_destination_pairs, (list, tuple)):
            raise TypeError("batch_reduce_to: value_destination_pairs must be a list of (value, destinations) pairs")
        out = []
        for i, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"batch_reduce_to: item {i} is not a (value, destinations) pair")
            out.append(self.reduce_to(reduce_op, pair[0], pair[1], options))
        return out

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies a non-distributed ``tensor`` to every destination device: a Mirrored
        (or the value itself for one destination)."""
        self._require_cross_replica("extended.broadcast_to")
        if isinstance(tensor, PerReplica):
            raise ValueError("broadcast_to: the value is a PerReplica; reduce it first (reduce_to)")
        dests = self._destinations(destinations, "broadcast_to")
        value = tensor.values[0] if isinstance(tensor, DistributedValues) else tensor
        if self._on_gpu:
            places = [self._place_of(d) for d in dests]
            if len(dests) == 1:
                return _put(value, places[0])
            if dests == list(self._devices):
                copies = device_collectives.broadcast_value(self._group, self._places, value, self._n)
            else:
                copies = [_put(value, p, copy=True) for p in places]
            return Mirrored(tuple(cross_device.restore_kind(c, value) for c in copies))
        if len(dests) == 1:
            return value
        if len(dests) == self._n:
            copies = cross_device.broadcast_value(self._group, value, self._n)
        else:
            copies = [np.array(cross_device.as_array(value), copy=True) for _ in dests]
        return Mirrored(tuple(cross_device.restore_kind(c, value) for c in copies))

    def update(self, var: Any, fn: Callable, args: Sequence = (), kwargs: Optional[dict] = None, group: bool = True) -> Any:
        """Runs ``fn(copy, *args, **kwargs)`` on each of ``var``'s per-replica copies (each
        getting its replica's part of distributed arguments) and returns the results,
        regrouped as a Mirrored (or as is, when every copy returned the same object)."""
        from .variables import DistributedVariable, Variable

        self._require_cross_replica("extended.update")
        if kwargs is None:
            kwargs = {}
        if isinstance(var, DistributedVariable):
            copies = var.values
        elif isinstance(var, Variable):
            copies = (var,)
        else:
            raise TypeError(f"extended.update: var must be a variable, got {type(var).__name__}")
        n = len(copies)
        contains_distributed(args, n, "extended.update")
        contains_distributed(kwargs, n, "extended.update")
        results = [fn(c, *select_replica(i, tuple(args)), **select_replica(i, kwargs)) for i, c in enumerate(copies)]
        if not group:
            return tuple(results)
        return regroup(results, wrap=Mirrored, what="extended.update")

    def read_var(self, var: Any) -> Any:
        """The value of ``var`` in cross-replica context (aggregated for SyncOnRead)."""
        from .variables import Variable

        self._require_cross_replica("extended.read_var")
        if not isinstance(var, Variable):
            raise TypeError(f"extended.read_var: expected a variable, got {type(var).__name__}")
        return var.read_value()

    def value_container(self, value: Any) -> Any:
        """The distributed variable holding ``value`` (or ``value`` itself)."""
        container = getattr(value, "_distributed_container", None)
        return container() if callable(container) and container() is not None else value

    def close(self) -> None:
        self._closed = True
        self._runner.close()
        if self._group is not None:
            self._group.close()


_OPS = {name: op for op in ReduceOp for name in (op.name, op.name.lower(), op.name.capitalize())}
_OPS.update({"prod": ReduceOp.PRODUCT, "PROD": ReduceOp.PRODUCT})


def _put(value: Any, place: Optional[int], copy: bool = False) -> Any:
    """``value`` at ``place``: a host value bound for the host stays as it is (or is
    copied); values whose dtype a GPU cannot hold stay on the host."""
    if place is None and not device_util.is_device_array(value):
        return np.array(cross_device.as_array(value), copy=True) if copy else value
    v = device_collectives.as_values([value])[0]
    if place is not None and not device_util.can_place(v.dtype):
        return np.array(v, copy=True) if copy else v
    return device_util.to_replica_device(v, place, copy=copy)


def _reduce_along(group: Any, op: ReduceOp, parts: List[np.ndarray], axis: int, what: str) -> Any:
    """``strategy.reduce`` with an axis: each host part reduced along it, then across."""
    axes = [cross_device._normalize_axis(axis, p.ndim, what, r) for r, p in enumerate(parts)]
    if op is ReduceOp.MEAN:
        work = [cross_device.work_dtype(p.dtype, op) for p in parts]
        numer = [np.asarray(np.sum(p, axis=a, dtype=w)) for p, a, w in zip(parts, axes, work)]
        count = sum(p.shape[a] if p.ndim else 1 for p, a in zip(parts, axes))
        total = cross_device.reduce_parts(group, numer, ReduceOp.SUM, what)
        return np.asarray(total / total.dtype.type(count) if count else total * np.nan)
    local = [_local_reduce(op, p, a) for p, a in zip(parts, axes)]
    return cross_device.reduce_parts(group, local, op, what)


def _local_reduce(op: ReduceOp, a: np.ndarray, axis: int) -> np.ndarray:
    if a.ndim == 0:
        return a
    if op is ReduceOp.SUM:
        return np.asarray(np.sum(a, axis=axis, dtype=a.dtype if a.dtype.kind != "b" else None))
    if op is ReduceOp.PRODUCT:
        return np.asarray(np.prod(a, axis=axis, dtype=a.dtype if a.dtype.kind != "b" else None))
    if op is ReduceOp.MIN:
        return np.asarray(np.min(a, axis=axis))
    return np.asarray(np.max(a, axis=axis))


class _CrossReplica:
    """Pushes cross-replica context of ``strategy`` on this thread."""

    __slots__ = ("_entry",)

    def __init__(self, strategy: "Strategy") -> None:
        self._entry = (strategy, None)

    def __enter__(self) -> None:
        context._stack().append(self._entry)

    def __exit__(self, *exc) -> None:
        context._stack().pop()


class Strategy:
    """Distributes computation over a set of replicas (the tf.distribute.Strategy API)."""

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step."""
        return self._extended._n

    def scope(self):
        """A context manager making this the current strategy (cross-replica context);
        variables created inside are distributed. Entering another strategy's scope
        inside it is an error."""
        return context._Scope(self)

    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[dict] = None, options: Any = None) -> Any:
        """Calls ``fn(*args, **kwargs)`` once per replica, in parallel.

        DistributedValues anywhere in ``args``/``kwargs`` (lists, tuples, dicts,
        namedtuples) are replaced by each replica's part. Returns the results in the
        same structure with PerReplica leaves (a leaf that is the same object on every
        replica is returned as it is). An exception in any replica releases the others
        and is raised here, prefixed with the replica's id, the original chained.
        Waits for the replicas at most ``CommunicationOptions.timeout_seconds`` (300 s
        by default) after replica 0 finished.
        """
        return self._extended._call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: Optional[int] = None) -> Any:
        """Combines per-replica values into one (cross-replica context only).

        ``axis=None``: element-wise across replicas. With an axis, SUM (MIN, MAX,
        PRODUCT) reduces inside each replica along it, then across; MEAN is the global
        mean over all elements along the axis (replicas weigh by their count). A
        non-distributed value: MEAN (MIN, MAX) returns it, SUM with several replicas is
        an error. Integer MEAN gives float64. Nested structures are reduced leaf by leaf.

        On GPU replicas, parts that are device arrays are reduced on the GPUs and the
        result is a ``DeviceArray`` on the first replica's GPU (read it with
        ``.numpy()``, or hand it to cupy/torch without a copy); parts that are all host
        values (a Python float loss) are reduced on the host and come back as numpy.
        """
        self._extended._require_cross_replica("strategy.reduce")
        op = as_reduce_op(reduce_op)
        ext = self._extended
        if nest.is_nested(value):
            return nest.map_structure(lambda v: ext._reduce_one(op, v, axis, "strategy.reduce"), value)
        return ext._reduce_one(op, value, axis, "strategy.reduce")

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' parts along ``axis`` (sizes may differ along it
        only); a non-distributed value is returned as an array. Nested structures too.
        On GPU replicas, device parts give a ``DeviceArray`` on the first replica's GPU."""
        ext = self._extended
        ext._require_cross_replica("strategy.gather")

        def one(v: Any) -> Any:
            if isinstance(v, DistributedValues):
                parts = ext._parts(v, "strategy.gather")
                if ext._on_gpu:
                    return device_collectives.gather_parts(ext._group, ext._places, parts, axis)
                return cross_device.gather_parts(ext._group, parts, axis)
            a = device_collectives.as_values([v])[0] if ext._on_gpu else cross_device.as_array(v)
            cross_device._normalize_axis(axis, a.ndim, "strategy.gather", 0)
            return a

        if nest.is_nested(value):
            return nest.map_structure(one, value)
        return one(value)

    def experimental_local_results(self, value: Any) -> Tuple[Any, ...]:
        """The per-replica parts of ``value`` as a tuple (``(value,)`` for a plain value;
        for a nested structure, one structure per replica)."""
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        n = self._extended._n
        if nest.is_nested(value) and any(isinstance(x, DistributedValues) for x in nest.flatten(value)):
            contains_distributed(value, n, "experimental_local_results")
            return tuple(_select_all(r, value) for r in range(n))
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None):
        """Splits every global batch of ``dataset`` over the replicas (see
        ``distvals.input.DistributedDataset``)."""
        from .input import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None):
        """Calls ``dataset_fn(InputContext)`` and hands consecutive elements of the
        dataset it returns to consecutive replicas."""
        from .input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """A PerReplica of ``value_fn(ValueContext(replica_id, num_replicas))`` per replica."""
        from .input import ValueContext, place_element

        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
        ext = self._extended
        n = ext._n
        values = [value_fn(ValueContext(r, n)) for r in range(n)]
        if ext._on_gpu:
            # Array leaves go to their replica's GPU, as a dataset's batches do.
            values = [place_element(v, ext._places[r]) for r, v in enumerate(values)]
        return regroup(values, what="experimental_distribute_values_from_function")

    def close(self) -> None:
        """Stops the replica threads and the engine group (optional: both also go when the
        strategy is garbage collected). Idempotent; a closed strategy refuses to run."""
        self._extended.close()

    def __enter__(self) -> "Strategy":
        """``with MirroredStrategy(...) as s:`` closes ``s`` at the end of the block (it does
        not enter the strategy's scope: use ``s.scope()`` for that)."""
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._extended._devices)!r})"


def _select_all(r: int, value: Any) -> Any:
    # Like select_replica, but variables give their copy too (inspection, not running).
    if isinstance(value, DistributedValues):
        return value.values[r]
    if nest.is_nested(value):
        return nest.pack_sequence_as(value, [_select_all(r, x) for x in nest.flatten(value)])
    return value


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the replicas of one process.

    ``devices``: e.g. ``["CPU:0", "CPU:1"]`` (any number of CPU replicas; "/cpu:1" and
    full names such as "/job:localhost/replica:0/task:0/device:CPU:1" work too); None
    means every GPU when there are any, else ``["CPU:0"]``. Duplicates are an error.
    ``cross_device_ops``: ``CollectiveAllReduce(algorithm)`` (default) or
    ``ReductionToOneDevice(reduce_to_device)``. ``communication_options``:
    ``CommunicationOptions`` (its ``timeout_seconds`` bounds every collective and every
    wait of ``run``; default 300 s).

    GPU replicas: ``MirroredStrategy(["GPU:0", "GPU:1"])`` (a strategy's replicas are all
    CPUs or all GPUs). ``"GPU:k"`` is a logical GPU (``distvals.config.set_logical_gpus``
    lets several replicas share one GPU, each with its own stream); the replicas keep
    the CUDA devices they had when the strategy was made. Values distributed by the
    strategy (datasets, ``experimental_distribute_values_from_function``, variables)
    are ``distvals.cuda.DeviceArray`` objects on each replica's GPU; cupy arrays and
    torch CUDA tensors are accepted wherever a value is. ``run`` passes each replica its
    part and regroups whatever ``fn`` returns; ``ReplicaContext.all_reduce`` and
    ``all_gather`` give each replica a DeviceArray on its own GPU. Results read in
    cross-replica context (``reduce``, ``gather``, SyncOnRead variables) are DeviceArrays
    on the first replica's GPU. A DeviceArray has no arithmetic: compute with cupy or
    torch (``cupy.asarray(x)`` views it without a copy) or copy it with ``.numpy()``.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, cross_device_ops: Optional[CrossDeviceOps] = None,
                 communication_options: Optional[CommunicationOptions] = None) -> None:
        devs = _canonical_devices(devices, "MirroredStrategy")
        super().__init__(_LocalExtended(self, devs, cross_device_ops, communication_options, "MirroredStrategy"))
        self._extended._distributed_variables = True


class OneDeviceStrategy(Strategy):
    """Everything on one device: ``run`` calls the function once, in a replica context;
    variables are plain single-copy variables."""

    def __init__(self, device: str) -> None:
        if not isinstance(device, str):
            raise TypeError(f"OneDeviceStrategy: device must be a device string, got {type(device).__name__}")
        devs = _canonical_devices([device], "OneDeviceStrategy")
        super().__init__(_LocalExtended(self, devs, None, None, "OneDeviceStrategy", make_group=False))

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self._extended._devices[0]!r})"


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica, on the calling thread."""

    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self))

    def scope(self):
        return context._NullScope()

    def close(self) -> None:
        """Nothing to close: the default strategy has no threads and lives as long as the
        process (closing it would break every later call outside a scope)."""

    def __repr__(self) -> str:
        return "DefaultStrategy()"


class _DefaultExtended(_LocalExtended):
    def __init__(self, container_strategy: Strategy) -> None:
        super().__init__(container_strategy, ["CPU:0"], None, None, "default strategy", make_group=False)
        # Its run happens in the default replica context.
        self._contexts = (context.ReplicaContext(container_strategy, 0, _in_run=False, _num_replicas=1),)
        self._entries = (self._contexts[0]._entry,)
