"""``MultiWorkerMirroredStrategy``: synchronous data parallelism over several processes.

One process per host (or per group of devices) is started by ``mpirun``; each process
is a *worker* with its own local replicas, run exactly as by ``MirroredStrategy`` (the
C++ engine between them), while MPI (mpi4py) carries the traffic between workers, see
``distvals.mpi_collectives``. Every worker runs the same program: the same steps, the
same collective calls in the same order.

Replicas are numbered globally: worker w's replicas are ``offset(w)`` ..
``offset(w) + count(w) - 1``, where the workers' local counts may differ.
``strategy.run`` returns PerReplica values of this worker's replicas (as in
TensorFlow); ``strategy.reduce``, ``strategy.gather``, ``ReplicaContext.all_reduce``
and ``all_gather``, ``extended.reduce_to`` and variable updates combine all replicas of
all workers.

When a step fails on one worker (an exception inside ``run``), the other workers wait
in a collective that will never complete; MPI cannot cancel it, so the failing worker
prints a message naming itself and aborts the whole job (``MPI.COMM_WORLD.Abort``). A
worker that never arrives (hung, killed) makes the others abort once
``CommunicationOptions.timeout_seconds`` has passed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import context, devices, kinds, nest
from .fingerprint import fingerprint
from .local_extended import LocalExtended
from .options import CommunicationOptions
from .reduce_op import ReduceOp, as_reduce_op
from .strategy import Strategy
from .values import DistributedValues, Mirrored, PerReplica, regroup, select_replica

if TYPE_CHECKING:  # pragma: no cover
    from .engine_collectives import EngineCollectives
    from .input import InputContext, ValueContext
    from .mpi_collectives import HierarchicalCollectives
    from .multi_worker_input import WorkerDatasetsFromFunction, WorkerDistributedDataset

__all__ = ["MPIClusterResolver", "MultiWorkerMirroredStrategy"]

_NAME_BYTES = 256


class MPIClusterResolver:
    """Where this process stands among the workers (the part of TensorFlow's
    ``ClusterResolver`` that applies): ``task_type`` ("worker"), ``task_id`` (the MPI
    rank), ``num_workers``, ``is_chief`` (rank 0), ``hosts`` (each worker's host name)."""

    def __init__(self, task_id: int, num_workers: int, hosts: Sequence[str], local_counts: Sequence[int]) -> None:
        self.task_type = "worker"
        self.task_id = int(task_id)
        self.num_workers = int(num_workers)
        self.hosts = tuple(hosts)
        self.rpc_layer = "mpi"
        self._local_counts = tuple(local_counts)

    @property
    def is_chief(self) -> bool:
        return self.task_id == 0

    def cluster_spec(self) -> Dict[str, List[str]]:
        """``{"worker": [host of worker 0, host of worker 1, ...]}``."""
        return {"worker": list(self.hosts)}

    def num_accelerators(self) -> Dict[str, int]:
        """This worker's replicas, as ``{"CPU": count}``."""
        return {"CPU": self._local_counts[self.task_id]}

    def __repr__(self) -> str:
        return (
            f"MPIClusterResolver(task_type='worker', task_id={self.task_id}, "
            f"num_workers={self.num_workers}, is_chief={self.is_chief})"
        )


class _WorkerReplicaContext(context.ReplicaContext):
    """A replica's context whose id and count are global; inside, the local index still
    selects this replica's parts and its engine slot."""

    __slots__ = ("_global_id", "_total")

    def __init__(self, strategy: Strategy, local_id: int, global_id: int, total: int, n_local: int) -> None:
        super().__init__(strategy, local_id, _num_replicas=n_local)
        self._global_id = global_id
        self._total = total

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index among all replicas of all workers."""
        return self._global_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._total

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._global_id}, num_replicas_in_sync={self._total})"


def _chunk_bytes() -> int:
    """The pipeline's chunk size: ``DISTVALS_MPI_CHUNK_BYTES`` (the same on every worker;
    0: one chunk, the pipeline off), else the default (0)."""
    from .mpi_collectives import DEFAULT_CHUNK_BYTES

    text = os.environ.get("DISTVALS_MPI_CHUNK_BYTES", "").strip()
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"DISTVALS_MPI_CHUNK_BYTES must be a number of bytes (0: one chunk, the pipeline off), got {text!r}"
        )
    return value


def _wrap_arrays(structure: Any) -> Any:
    def one(x: Any) -> Any:
        return PerReplica((x,)) if isinstance(x, (np.ndarray, np.generic)) else x

    if nest.is_nested(structure):
        return nest.map_structure(one, structure)
    return one(structure)


def _local_devices(devices: Any) -> List[str]:
    from .device_names import canonical_devices

    if devices is None:
        return ["CPU:0"]
    return canonical_devices(devices, "MultiWorkerMirroredStrategy")


_BY_ENGINE_NAME = {op.engine_name: op for op in ReduceOp}


class _WorkerQuick:
    """What the quick all-reduce path of ``LocalExtended`` calls (an engine group's
    ``all_reduce(ins, op, algorithm, out=)``, ``aborted``, ``reset``), for a worker: the
    hierarchical all-reduce of one array per local replica, under the strategy's lock."""

    __slots__ = ("_ext", "_group")

    def __init__(self, ext: _MultiWorkerExtended) -> None:
        self._ext = ext
        # The local engine group (None with one local replica); a strategy that makes new
        # collectives (after a fork) makes a new one of these too.
        self._group = ext._group

    @property
    def aborted(self) -> bool:
        group = self._group
        return group is not None and bool(group.aborted)

    def reset(self) -> None:
        if self._group is not None:
            self._group.reset()

    def all_reduce(self, ins: List[np.ndarray], op: str, algorithm: str, out: List[np.ndarray]) -> None:
        self.run_arrays(ins, _BY_ENGINE_NAME[op], out)

    def run_arrays(self, ins: List[np.ndarray], op: ReduceOp, out: List[np.ndarray]) -> None:
        """What ``_core.quick_all_reduce_with`` calls once it has checked an inline
        meeting's arrays and made their outputs."""
        ext = self._ext
        with ext._lock:
            ext._coll.all_reduce_arrays(op, ins, out)


class _MultiWorkerExtended(LocalExtended):
    """The local replicas of one worker (as MirroredStrategy's) plus the workers' MPI
    communicator; every collective goes through ``HierarchicalCollectives``."""

    _coll: HierarchicalCollectives
    _between_workers = True

    def __init__(
        self,
        container_strategy: Strategy,
        devices: Sequence[str],
        options: Optional[CommunicationOptions],
        communicator: Any,
        execution: str,
    ) -> None:
        from .mpi_runtime import load_mpi

        mpi = load_mpi()
        comm = mpi.COMM_WORLD if communicator is None else communicator
        if not isinstance(comm, mpi.Intracomm) or comm == mpi.COMM_NULL:
            raise TypeError(
                f"MultiWorkerMirroredStrategy: communicator must be an mpi4py intra-communicator such as "
                f"MPI.COMM_WORLD, got {type(comm).__name__}"
            )
        self._mpi = mpi
        self._user_comm = comm
        super().__init__(container_strategy, devices, None, options, "MultiWorkerMirroredStrategy", execution=execution)
        self._distributed_variables = True
        hier = self._coll
        self._rank = hier.rank
        self._num_workers = hier.num_workers
        self._total = hier.num_replicas
        self._offset = hier.offset
        counts = list(hier.local_counts)
        # As in TensorFlow, when every worker has one replica a plain value (what run
        # returns there) is that replica's value. When only some workers have one, their
        # run results are wrapped as PerReplica instead, so that every worker treats
        # every value alike and makes the same collective calls.
        self._plain_is_local = self._num_workers > 1 and max(counts) == 1
        self._wrap_results = self._n == 1 and self._total > 1 and not self._plain_is_local
        self._resolver = MPIClusterResolver(self._rank, self._num_workers, self._hosts, counts)
        self._contexts = tuple(
            _WorkerReplicaContext(container_strategy, r, self._offset + r, self._total, self._n) for r in range(self._n)
        )
        self._entries = tuple(c._entry for c in self._contexts)
        for c in self._contexts:
            c._ext = self
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        if cores == 1 and self._n > 1 and (os.cpu_count() or 1) > 1:
            # mpirun binds each process to one core by default: the replicas (and the
            # engine's threads) would then all share it.
            warnings.warn(
                f"MultiWorkerMirroredStrategy: worker {self._rank} may run on 1 core only, for "
                f"{self._n} replicas; launch with `mpirun --bind-to none` (or bind each process to enough "
                "cores) so that its replicas run in parallel",
                RuntimeWarning,
                stacklevel=3,
            )

    def _make_collectives(self) -> HierarchicalCollectives:
        from .mpi_collectives import HierarchicalCollectives
        from .mpi_exchanges import PAIR_MAX_BYTES_LOCAL

        mpi = self._mpi
        timeout = float(self._timeout)
        # A communicator of its own: the strategy's collectives never match the user's.
        comm, req = self._user_comm.Idup()
        self._wait_setup(req, timeout)
        size = comm.Get_size()
        counts = np.empty(size, dtype=np.int64)
        self._wait_setup(comm.Iallgather(np.array([self._n], dtype=np.int64), counts), timeout)
        name = mpi.Get_processor_name().encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        names = np.empty((size, _NAME_BYTES), dtype=np.uint8)
        self._wait_setup(comm.Iallgather([np.frombuffer(name, np.uint8), mpi.BYTE], [names, mpi.BYTE]), timeout)
        self._hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in names]
        self._comm = comm
        # Workers on one host share its cores: the local engine takes its share of them
        # (more threads than cores would only take turns, and the MPI exchange that
        # follows every local step needs a core on each side).
        sharing = self._hosts.count(self._hosts[comm.Get_rank()])
        if sharing > 1:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            self._group_threads = max(1, cores // sharing)
        # The local replicas' collectives: a HostCollectives or a CudaCollectives.
        local: EngineCollectives = super()._make_collectives()  # type: ignore[assignment]
        # The distributed input's agreement on each element (multi_worker_input) has a
        # communicator of its own: it never pairs with a collective.
        input_comm, req = comm.Idup()
        self._wait_setup(req, timeout)
        self._input_comm = input_comm
        self._input_datasets = 0  # distributed datasets made so far: each one's serial number
        self._input_lock = threading.Lock()  # one exchange on the input's communicator at a time
        # The exchange of a next() that an exception (Ctrl-C) ended while it waited, with
        # its buffers: MPI cannot cancel it, so it is kept until the next exchange has
        # waited for it.
        self._input_pending: Any = None
        hier = HierarchicalCollectives(
            local, comm, counts.tolist(), timeout, chunk_bytes=_chunk_bytes(), on_fatal=self._fatal
        )
        # Whether every worker reduces its replicas inside the exchanges (which depends on
        # its host's cores): only then do two workers swap halves from a smaller size on,
        # and the route of every buffer must be the same on every worker.
        fused = np.array([int(hier.reduces_inside_exchanges)], dtype=np.int64)
        everywhere = np.empty(1, dtype=np.int64)
        self._wait_setup(comm.Iallreduce(fused, everywhere, mpi.MIN), timeout)
        if everywhere[0]:
            hier.set_pair_max_bytes(PAIR_MAX_BYTES_LOCAL)
        return hier

    def _quick_group(self) -> Any:
        """The quick path of a step's ``ctx.all_reduce(op, x)`` (one numpy array per
        replica): the hierarchical all-reduce of the arrays themselves (host replicas)."""
        if self._via_root is not None or self._on_gpu:
            return None
        return _WorkerQuick(self)

    def _wait_setup(self, req: Any, timeout: float) -> None:
        """Waits for a request of the strategy's set-up (every worker constructs the
        strategy) at most ``timeout`` seconds; the job aborts past it."""
        from .mpi_runtime import report_and_abort

        deadline = time.monotonic() + timeout
        while True:
            if req.Test():
                return
            if time.monotonic() > deadline:
                report_and_abort(
                    self._mpi.COMM_WORLD,
                    (
                        f"MPI rank {self._mpi.COMM_WORLD.Get_rank()}: MultiWorkerMirroredStrategy waited "
                        f"{timeout:g} s for the other workers to create it too"
                    ),
                )
            time.sleep(1e-4)

    # ---- where this worker stands ----------------------------------------------------------
    @property
    def worker_devices(self) -> Tuple[str, ...]:
        """This worker's replicas' devices, e.g. "/job:worker/replica:0/task:1/device:CPU:0"."""
        return tuple(f"/job:worker/replica:0/task:{self._rank}/device:{d}" for d in self._devices)

    @property
    def parameter_devices(self) -> Tuple[str, ...]:
        return self.worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """True on the chief (worker 0), the one worker that writes checkpoints."""
        return self._rank == 0

    @property
    def should_save_summary(self) -> bool:
        return self._rank == 0

    @property
    def experimental_should_init(self) -> bool:
        return True

    @property
    def experimental_between_graph(self) -> bool:
        return True

    def _in_multi_worker_mode(self) -> bool:
        return self._num_workers > 1

    # ---- failure ---------------------------------------------------------------------------
    def _fatal(self, message: str) -> None:
        """Ends the job: the other workers wait in collectives that cannot be cancelled."""
        from .mpi_runtime import report_and_abort

        world = self._mpi.COMM_WORLD
        report_and_abort(
            world, f"worker {self._rank} (MPI rank {world.Get_rank()} of {world.Get_size()}) failed: {message}"
        )

    def _step(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        try:
            result = super()._step(fn, args, kwargs)
        except BaseException as e:
            if self._num_workers > 1:
                r = getattr(e, "replica", None)
                text, where = str(e), ""
                if isinstance(r, int) and 0 <= r < self._n:
                    # The error names the replica by its local id: said once, globally.
                    where = f" in replica {self._offset + r} (local replica {r} of this worker)"
                    text = text.removeprefix(f"replica {r}: ")
                self._fatal(f"strategy.run raised {type(e).__name__}{where}: {text}")
            raise
        if self._wrap_results:
            from .multi_worker_input import wrap_single

            return wrap_single(result)
        return result

    def _merge_call(
        self, ctx: context.ReplicaContext, merge_fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        if not self._wrap_results:
            return super()._merge_call(ctx, merge_fn, args, kwargs)
        # The only replica of this worker: its arrays reach merge_fn as PerReplica values,
        # as the other workers' replicas' arrays do.
        result = super()._merge_call(ctx, merge_fn, _wrap_arrays(args), _wrap_arrays(kwargs))
        return select_replica(0, result)

    def _total_replicas(self) -> int:
        return self._total

    def _count_twice(self, original: Any, requests: List[Any]) -> bool:
        # One local replica: a plain value is its own, nothing is counted twice here.
        return self._n > 1 and super()._count_twice(original, requests)

    # ---- cross-replica collectives ---------------------------------------------------------------
    def _as_local_parts(self, value: Any) -> Any:
        if self._plain_is_local and not isinstance(value, DistributedValues):
            return PerReplica((value,))
        return value

    def _local_destinations(self, destinations: Any, what: str) -> List[str]:
        # With one local replica a plain value is that replica's value, so as destinations
        # it means the replica's device (numpy arrays have a `device` of their own, "cpu").
        if (
            self._n == 1
            and self._num_workers > 1
            and destinations is not None
            and not isinstance(destinations, (str, list, tuple, DistributedValues))
        ):
            return list(self._devices)
        return self._destinations(destinations, what)

    def _reduce_objects(self, op: ReduceOp, parts: List[Any], first: Any, what: str) -> np.ndarray:
        # numpy's object arithmetic would reduce this worker's replicas only.
        if self._num_workers > 1:
            item = first.flat[0] if isinstance(first, np.ndarray) and first.size else first
            raise TypeError(
                f"{what}: replica values of dtype object ({type(item).__name__}) cannot be reduced across "
                "workers (MPI reduces numbers); convert them to a numeric dtype first"
            )
        return super()._reduce_objects(op, parts, first, what)

    @contextlib.contextmanager
    def _together(self, what: str, value: Any, how: str = "") -> Iterator[None]:
        """Around a cross-replica collective of ``value``: whatever happens on this
        worker, it makes at least one agreement step with the others, so that every
        worker's call sequence stays the same (the others would otherwise pair this call
        with this worker's next one, whose description may be the same: a wrong result,
        no error).

        - It fails here before its first MPI call: this worker still takes part in the
          agreement step (``HierarchicalCollectives.fail_together``); every worker fails.
        - It succeeds here without any MPI call (a non-distributed value, which each
          worker reduces alone when some worker has several local replicas; a Mirrored
          value under MEAN): the workers agree on the call and on the value's
          fingerprint (and ``how``: the op, the axis). A worker that passed a value to
          reduce across the workers there, or a different value or op, gets a
          MismatchError, as every other worker does: a result that holds on one worker
          only would be a wrong number on the others.

        Inside ``strategy.run`` (where these calls are refused) it adds nothing: each
        replica would make its own agreement step."""
        if self._num_workers == 1 or context.current_run_context() is not None:
            yield
            return
        mark = self._coll.mpi_calls()
        try:
            yield
        except Exception as e:
            if self._coll.mpi_calls() == mark:
                with self._lock:
                    self._coll.fail_together(what, e)
            raise
        if self._coll.mpi_calls() == mark:
            with self._lock:
                description = f"{what}{how} of {_describe_unshared(value)} without communicating"
                self._coll.sync_point(description, what)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: Optional[int], what: str, label: str = "") -> Any:
        with self._together(what, value, f"({op.name}, axis={axis})"):
            return super()._reduce_one(op, self._as_local_parts(value), axis, what, label)

    def _reduce_structure(self, op: ReduceOp, value: Any, what: str) -> Any:
        if self._plain_is_local:
            value = nest.map_structure(self._as_local_parts, value)
        return super()._reduce_structure(op, value, what)

    def _gather_one(self, value: Any, axis: int, what: str, label: str = "") -> Any:
        with self._together(what, value, f"(axis={axis})"):
            return super()._gather_one(self._as_local_parts(value), axis, what, label)

    def _agree_structure(self, what: str, value: Any) -> None:
        # Leaf by leaf, each leaf's own call checks its dtype and shape but not where it
        # sits: the workers agree on the nesting, keys and leaf count first (one exchange).
        if self._num_workers > 1:
            with self._lock:
                self._coll.agree_structure(what, value)

    def _wraps(self, dests: List[str]) -> bool:
        """Whether a value placed on ``dests`` is handed out as a Mirrored of one copy: as
        run's results, a worker with one replica among workers with several does so where
        they hand out Mirrored values, so that every worker treats the value alike in
        later collectives."""
        return self._wrap_results and dests == list(self._devices)

    def _spread(self, out: Any, dests: List[str], fresh: bool = True) -> Any:
        if self._wraps(dests):
            return Mirrored((self._put(out, dests[0], copy=not fresh),))
        return super()._spread(out, dests, fresh)

    def reduce_to(
        self, reduce_op: Any, value: Any, destinations: Any, options: Optional[CommunicationOptions] = None
    ) -> Any:
        """Reduces ``value`` over every replica of every worker onto ``destinations`` (this
        worker's devices): a Mirrored, or the value itself for one destination."""
        with self._together("extended.reduce_to", value, f"({_op_name(reduce_op)})"):
            self._require_cross_replica("extended.reduce_to")
            # A structure's plain leaves too (as _reduce_structure does).
            parts = nest.map_structure(self._as_local_parts, value) if self._plain_is_local else value
            return super().reduce_to(reduce_op, parts, self._local_destinations(destinations, "reduce_to"), options)

    def batch_reduce_to(
        self,
        reduce_op: Any,
        value_destination_pairs: Sequence[Tuple[Any, Any]],
        options: Optional[CommunicationOptions] = None,
    ) -> List[Any]:
        """``reduce_to`` for a list of (value, destinations) pairs."""
        with self._together("extended.batch_reduce_to", value_destination_pairs, f"({_op_name(reduce_op)})"):
            return self._batch_reduce_to(reduce_op, value_destination_pairs, options)

    def _batch_reduce_to(
        self,
        reduce_op: Any,
        value_destination_pairs: Sequence[Tuple[Any, Any]],
        options: Optional[CommunicationOptions],
    ) -> List[Any]:
        self._require_cross_replica("extended.batch_reduce_to")
        if not isinstance(value_destination_pairs, (list, tuple)):
            raise TypeError("batch_reduce_to: value_destination_pairs must be a list of (value, destinations) pairs")
        pairs = []
        for i, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"batch_reduce_to: item {i} is not a (value, destinations) pair")
            pairs.append((self._as_local_parts(pair[0]), self._local_destinations(pair[1], "batch_reduce_to")))
        return super().batch_reduce_to(reduce_op, pairs, options)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies a non-distributed ``tensor`` to this worker's destination devices."""
        self._require_cross_replica("extended.broadcast_to")
        dests = self._local_destinations(destinations, "broadcast_to")
        out = super().broadcast_to(tensor, dests)
        if self._wraps(dests) and not isinstance(out, DistributedValues):
            return Mirrored((out,))  # the base hands one destination its value bare
        return out

    # ---- variables and checkpoints -------------------------------------------------------------------
    def _initial_value(self, value: np.ndarray, name: str, kind: str = "") -> np.ndarray:
        """Every worker's new variable starts from the chief's initial value. The name and
        kind are part of the agreement: workers that create their variables in different
        orders, or one variable as mirrored on one and sync-on-read (or with another
        aggregation) on another, get MismatchError, not each other's values (nor updates
        that pair with another worker's other collectives)."""
        out = self._coll.broadcast_from_chief(value, f"Variable '{name}' ({kind})" if kind else f"Variable '{name}'")
        if out is not value:
            out.flags.writeable = False
        return out

    def _first_replica_value(self, part: Any, what: str, label: str = "") -> Any:
        """Global replica 0's value (the chief's first replica's) on every worker."""
        if self._num_workers == 1:
            return part
        host = np.asarray(devices.to_host(part), order="C")  # 0-d stays 0-d
        out = self._coll.broadcast_from_chief(host, what, label=label)
        out.flags.writeable = False  # a read of the value, like any variable read
        return out

    def _every_replica_part(self, parts: Sequence[Any], what: str, label: str = "") -> List[Any]:
        """Every worker's replicas' parts, in global replica order: one gather of their
        sizes along the first axis, one of the parts themselves, cut apart again."""
        if self._num_workers == 1:
            return list(parts)
        hosts = [np.asarray(devices.to_host(p), order="C") for p in parts]
        sizes = self._gather_one(PerReplica(tuple(np.array([len(h)], np.int64) for h in hosts)), 0, what, label)
        joined = np.asarray(devices.to_host(self._gather_one(PerReplica(tuple(hosts)), 0, what, label)))
        bounds = np.concatenate([[0], np.cumsum(np.asarray(devices.to_host(sizes)))])
        return [joined[lo:hi] for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    def _write_checkpoint(self, write: Callable[[], None]) -> None:
        """The chief writes; every worker returns once it has (or raises if it failed)."""
        error: Optional[BaseException] = None
        if self._rank == 0:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - reported to every worker, then raised
                error = e
        ok = self._coll.chief_flag(error is None, "save_variables")
        if error is not None:
            raise error
        if not ok:
            raise OSError(
                f"save_variables: worker {self._rank}: the chief (worker 0) failed to write the "
                "checkpoint; its error is in its output"
            )


# The multi-worker strategies of this process (see live_worker_ranks).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def live_worker_ranks() -> List[int]:
    """This process's worker rank in each of its multi-worker strategies that spans
    several workers: save_variables lets only the chief process write variables of no
    strategy."""
    return [ext._rank for ext in list(_LIVE) if ext._num_workers > 1]


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the replicas of several MPI processes.

    ``devices``: this worker's replicas, e.g. ``["CPU:0", "CPU:1"]`` (default
    ``["CPU:0"]``; workers may have different counts). ``communication_options``:
    ``CommunicationOptions``; its ``timeout_seconds`` bounds every wait, local and MPI
    (default 300 s). ``communicator``: an mpi4py intra-communicator whose processes are
    the workers (default ``MPI.COMM_WORLD``). Every process of the communicator must
    create the strategy.

    Needs mpi4py and an MPI library: ``pip install "distvals[mpi]"``; launch with
    ``mpirun -n 2 python train.py``.
    """

    _extended: _MultiWorkerExtended

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        communication_options: Optional[CommunicationOptions] = None,
        *,
        communicator: Any = None,
        execution: str = "auto",
    ) -> None:
        devs = _local_devices(devices)
        super().__init__(_MultiWorkerExtended(self, devs, communication_options, communicator, execution))
        _LIVE.add(self._extended)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Strategy:
        """Refused: a new multi-worker strategy is a collective of every worker (each must
        make it at the same time), which a copy made on one worker cannot be."""
        raise TypeError(
            "MultiWorkerMirroredStrategy cannot be deep-copied: every worker must create a new one "
            "together; call MultiWorkerMirroredStrategy(...) on every worker instead"
        )

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step, over all workers."""
        return self._extended._total

    @property
    def cluster_resolver(self) -> MPIClusterResolver:
        """This worker's place: ``task_id``, ``num_workers``, ``is_chief``, ``hosts``."""
        return self._extended._resolver

    def reduce(self, reduce_op: Any, value: Any, axis: Optional[int] = None) -> Any:
        """As ``Strategy.reduce``, over every replica of every worker. Every worker takes
        part in an agreement step even where the call fails on it alone before it
        communicates (an op it does not know), or needs no MPI call there (a plain value
        reduced on each worker alone): it then fails, or differs, on every worker (see
        ``_together``)."""
        with self._extended._together("strategy.reduce", value, f"({_op_name(reduce_op)}, axis={axis})"):
            return super().reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's part (all workers, in global replica order) along
        ``axis``; sizes may differ along it only. Nested structures too."""
        ext = self._extended
        with ext._together("strategy.gather", value, f"(axis={axis})"):
            ext._require_cross_replica("strategy.gather")
            if nest.is_nested(value):
                ext._agree_structure("strategy.gather", value)
                return nest.map_structure(lambda v: ext._gather_one(v, axis, "strategy.gather"), value)
            return ext._gather_one(value, axis, "strategy.gather")

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> WorkerDistributedDataset:
        """Splits every global batch over all replicas of all workers; this worker gets
        its replicas' parts (every worker must iterate the same dataset in the same
        order). See ``distvals.multi_worker_input``."""
        from .multi_worker_input import WorkerDistributedDataset

        return WorkerDistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: Any = None
    ) -> WorkerDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext(num_workers, rank, num_replicas_in_sync))`` on
        every worker; consecutive elements go to this worker's consecutive replicas."""
        from .multi_worker_input import WorkerDatasetsFromFunction

        return WorkerDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """A PerReplica of ``value_fn(ValueContext(global replica id, num_replicas_in_sync))``
        for this worker's replicas."""
        from .input import ValueContext

        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
        ext = self._extended
        values = [value_fn(ValueContext(ext._offset + r, ext._total)) for r in range(ext._n)]
        if ext._on_gpu:
            from .input import place_element

            values = [place_element(v, ext._places[r], ext._offset + r) for r, v in enumerate(values)]
        if ext._wrap_results:
            from .multi_worker_input import wrap_single

            return wrap_single(values[0])
        return regroup(values, what="experimental_distribute_values_from_function", always_wrap=True)

    def __repr__(self) -> str:
        ext = self._extended
        return (
            f"MultiWorkerMirroredStrategy(devices={list(ext._devices)!r}, task_id={ext._rank}, "
            f"num_workers={ext._num_workers})"
        )


def _describe_unshared(value: Any) -> str:
    """A value a collective reduced on each worker alone, as workers compare it: its
    kind, dtype and shape, and a fingerprint of its contents."""
    if isinstance(value, DistributedValues):
        return f"a {type(value).__name__} value of {_describe_unshared(value.values[0])}"
    try:
        a = kinds.to_numpy(value)
        kind = f"{a.dtype.name} {a.shape}"
        leaves: Any = [a]
    except Exception:  # noqa: BLE001 - not an array: its type and its fingerprint
        kind = type(value).__name__
        leaves = [value]
    try:
        return f"a non-distributed value ({kind}, fingerprint {fingerprint(leaves):016x})"
    except TypeError:  # it cannot be pickled: its kind only
        return f"a non-distributed value ({kind}, no fingerprint)"


def _op_name(reduce_op: Any) -> str:
    """The reduce op as every worker spells it ("sum" and ReduceOp.SUM alike); an
    unknown one as given (its own call then fails, on every worker)."""
    try:
        return as_reduce_op(reduce_op).name
    except Exception:  # noqa: BLE001 - named as given; the call reports it
        return repr(reduce_op)
