"""``LocalExtended``: the replicas of one process, their steps and their collectives.

A step (``strategy.run``) goes to the strategy's runner (inline coroutines or threads,
see ``distvals.replicas``). Inside it, every cross-replica point of a replica
(``ReplicaContext.all_reduce``, ``all_gather``, ``merge_call``, an aggregated variable
update) becomes a ``Request``; once every replica has made one, ``_resolve`` checks that
they agree (``distvals.meeting``) and runs the collective once for all of them on the
strategy's ``Collectives`` (host engine, CUDA engine or MPI; chosen in the constructor).
Cross-replica methods (``reduce``, ``gather``, ``extended.reduce_to``...) call the same
collectives directly (``distvals.cross_replica``, its base class).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core, context, kinds, nest
from ._convert import refuse_masked
from ._core import AbortedError, ClosedError, CollectiveTimeoutError, MismatchError
from .collectives import (
    REDUCIBLE_KINDS,
    Collectives,
    engine_supports,
    normalize_axis,
    numpy_reduce,
    type_name,
)
from .cross_replica import CrossReplicaExtended
from .cuda import DeviceArray
from .engine_collectives import FUSE_LEAF_BYTES, exact_algorithm, host_pack_bytes
from .errors import replica_error
from .fork_locks import renewed_after_fork
from .meeting import check_calls, check_leaves, check_structures
from .options import (
    DEFAULT_TIMEOUT_SECONDS,
    CollectiveAllReduce,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
)
from .reduce_op import ReduceOp, as_reduce_op
from .replicas import (
    QUICK,
    QUICK_ALL_REDUCE,
    QUICK_TREE,
    Failure,
    Raise,
    Request,
    StepTimeout,
    TreeExtra,
    as_request,
    executing,
    fork_generation,
    names,
)
from .replicas import fork_counter as _forks
from .sparse_collectives import SparseExtra, SparseParts, all_reduce_rows, check_sparse_leaves, is_sparse, sparse_parts
from .values import DistributedValues, PerReplica, per_replica_arguments, regroup, select_replica
from .variables import Variable

__all__ = ["EXECUTION_MODES", "LocalExtended"]

EXECUTION_MODES = ("auto", "inline", "threads")
_EMPTY: Dict[str, Any] = {}
_OPS = {name: op for op in ReduceOp for name in (op.name, op.name.lower(), op.name.capitalize())}
_OPS.update({"prod": ReduceOp.PRODUCT, "PROD": ReduceOp.PRODUCT})


def _take_failures(runner: Any) -> List[Failure]:
    """The failures of the step that just ended, taken from the runner: its list is
    emptied in place, since the step's own objects share it and the failures'
    tracebacks hold frames that hold the step (a cycle would keep the step's inputs
    until the garbage collector runs), and replaced, so that a failure that a late
    replica records in the step's list later does not stay on the runner."""
    failures = list(runner.failures)
    runner.failures.clear()
    runner.failures = []
    return failures


class _SingleRunner:
    """One replica: the function runs on the calling thread; a meeting resolves at once."""

    mode = "inline"
    _fired = 0  # (it has no watchdog to fire)

    def __init__(self, resolve: Callable[[List[Request]], List[Any]]) -> None:
        self._resolve = resolve
        self.failures: List[Failure] = []

    def meet(self, replica: int, request: Request) -> Any:
        o = self._resolve([request])[0]
        if type(o) is Raise:
            raise o.error
        return o

    def step(
        self,
        fn: Callable[..., Any],
        per_replica: Sequence[Tuple[Tuple[Any, ...], Optional[Dict[str, Any]]]],
        entries: Sequence[context.Entry],
        timeout: float,
    ) -> List[Any]:
        self.failures = []
        local = context._local
        saved = local.stack
        local.stack = [entries[0]]
        args, kwargs = per_replica[0]
        try:
            return [fn(*args, **(kwargs or _EMPTY))]
        except BaseException as e:
            self.failures = [Failure(0, 0, e)]
            if not isinstance(e, Exception):
                raise
            return [None]
        finally:
            local.stack = saved

    def close(self) -> None:
        pass


_get_ident = threading.get_ident
_getframe = sys._getframe
try:
    from greenlet import getcurrent as _getcurrent
except ImportError:  # pragma: no cover - inline replicas need greenlet; without it they do not run
    _getcurrent = None


def _unwrap(x: Any) -> Any:
    # A distributed value stands for the current replica's part, a variable for its value.
    if type(x) is np.ndarray:
        return x
    if isinstance(x, DistributedValues):
        x = x._current()
    if isinstance(x, Variable):
        x = x._read()
    return x


class LocalExtended(CrossReplicaExtended):
    """N replicas in this process; ``collectives`` runs their collectives."""

    def __init__(
        self,
        container_strategy: Any,
        devices: Sequence[str],
        cross_device_ops: Optional[CrossDeviceOps],
        options: Optional[CommunicationOptions],
        what: str,
        execution: str = "auto",
        make_group: bool = True,
    ) -> None:
        super().__init__(container_strategy, devices)
        given_ops = cross_device_ops is not None
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
            raise TypeError(
                f"{what}: communication_options must be a CommunicationOptions, got {type(options).__name__}"
            )
        if execution not in EXECUTION_MODES:
            raise ValueError(
                f"{what}: execution must be one of {', '.join(map(repr, EXECUTION_MODES))}, got {execution!r}"
            )
        self._what = what
        self._cross_device_ops = cross_device_ops
        self._options = options
        self._via_root: Optional[int] = None
        if isinstance(cross_device_ops, ReductionToOneDevice):
            self._via_root = 0
            if cross_device_ops.reduce_to_device is not None:
                if cross_device_ops.reduce_to_device not in self._devices:
                    raise ValueError(
                        f"{what}: ReductionToOneDevice(reduce_to_device={cross_device_ops.reduce_to_device!r}) "
                        f"is not one of the strategy's devices {list(self._devices)}"
                    )
                self._via_root = self._devices.index(cross_device_ops.reduce_to_device)
        algorithm = options.implementation
        if algorithm == "auto" and isinstance(cross_device_ops, CollectiveAllReduce):
            algorithm = cross_device_ops.algorithm
        self._algorithm = algorithm
        self._timeout = options.timeout_seconds if options.timeout_seconds is not None else _default_timeout()
        self._on_gpu = any(d.startswith("GPU:") for d in self._devices)
        self._make_group = make_group
        self._execution = self._choose_execution(execution, what)
        self._coll: Collectives = self._make_collectives()
        self._make_quick_paths()
        self._contexts = tuple(
            context.ReplicaContext(container_strategy, r, _num_replicas=self._n) for r in range(self._n)
        )
        self._entries = tuple(c._entry for c in self._contexts)
        for c in self._contexts:
            c._ext = self
        self._runner = self._make_runner()
        self._inline = self._execution == "inline" and self._n > 1
        self._quick_tree = self._quick_tree_ok()
        self._make_gpu_quick_path()
        # One collective at a time per strategy: a step's meetings and cross-replica calls
        # from other threads (a logging thread's strategy.reduce) take turns. A new one in
        # a forked child: a thread that held it in the parent does not exist there.
        self._lock = renewed_after_fork(self, threading.RLock)
        # The step running now, as {0: claim}: a claim is a tuple made for that one call,
        # (its thread's id, its frame, the process's fork generation), put there by
        # dict.setdefault, which claims atomically, and taken away by its own call only.
        # _claim_lock settles who takes over a stale one.
        self._claims: Dict[int, Tuple[int, Any, int]] = {}
        self._claim_lock = renewed_after_fork(self, threading.Lock, "_claim_lock")
        self._step_active = False
        self._fork = fork_generation()
        # Variables created under this strategy's scope get one copy per replica.
        self._distributed_variables = False
        # How many distributed variables were made under it (each one's _serial).
        self._variables_made = 0
        self._closed = False
        if given_ops:
            # Its reduce, batch_reduce and broadcast, called outside any scope, run here.
            cross_device_ops._bind(container_strategy)

    # ---- construction --------------------------------------------------------------------
    def _make_collectives(self) -> Collectives:
        from . import devices as device_util

        n = self._n
        if self._on_gpu:
            from .cuda_collectives import CudaCollectives

            group = None
            places = tuple(device_util.place_of_device(d) for d in self._devices)
            if self._make_group and n > 1:
                group = self._new_group()
                # The CUDA devices the group mapped the replicas to when it was made (a
                # later set_logical_gpus does not move existing replicas).
                places = tuple(group.engine.gpus)
            return CudaCollectives(group, n, places)
        from .host_collectives import HostCollectives

        group = self._new_group() if self._make_group and n > 1 else None
        return HostCollectives(group, n)

    def _make_quick_paths(self) -> None:
        """The quick path of a step's ``ctx.all_reduce(op, x)`` (``_quick``, see
        ``_quick_group``) and how ``_resolve`` reaches it: the engine group itself
        (``_native_quick``), or a quick path that is not one engine group
        (MultiWorkerMirroredStrategy's), whose ``run_arrays(ins, op, outs)`` gets the
        requests' arrays from the native checks (``_quick_runner``)."""
        self._quick = self._quick_group()
        self._native_quick = self._quick if isinstance(self._quick, _core.Group) else None
        self._quick_runner = getattr(self._quick, "run_arrays", None)

    def _quick_group(self) -> Any:
        """The host engine's group when one all-reduce of one numpy array per replica
        can go to it directly (the common case of a step), else None."""
        from .host_collectives import HostCollectives

        if type(self._coll) is HostCollectives and self._via_root is None:
            group = self._coll.group
            return None if group is None else group.engine
        return None

    def _quick_tree_ok(self) -> bool:
        """Whether inline replicas' all-reduces of structures of numpy arrays may go to
        the host engine in one call (QUICK_TREE requests): several CPU replicas of one
        process, reduced together."""
        from .host_collectives import HostCollectives

        coll = self._coll
        return (
            self._inline
            and type(coll) is HostCollectives
            and coll.group is not None
            and self._via_root is None
            and isinstance(self._quick, _core.Group)
        )

    def _make_gpu_quick_path(self) -> None:
        """``_gpu_quick``: the CUDA group when inline GPU replicas' all-reduces of one
        DeviceArray each may go to it directly (the common case of a step on GPUs), else
        None; ``_gpu_places``: each replica's CUDA device."""
        from .cuda_collectives import CudaCollectives

        coll = self._coll
        self._gpu_quick: Any = None
        self._gpu_places: Tuple[int, ...] = ()
        if self._inline and type(coll) is CudaCollectives and coll.group is not None and self._via_root is None:
            self._gpu_quick = coll.group.engine
            self._gpu_places = tuple(int(p) for p in coll.places if p is not None)

    #: Whether MPI exchanges follow the local collectives (MultiWorkerMirroredStrategy).
    _between_workers = False
    # Threads of the engine's group (0: one per replica, at most one per core).
    _group_threads = 0

    def _new_group(self) -> Any:
        from .group import ReplicaGroup

        # Inline, the engine's workers may spin between jobs (the default): the calling
        # thread is the only Python thread, and a worker that spins through the few
        # microseconds of Python between two collectives starts the next one without a
        # wake-up. On threads they must not: replica threads take turns on the GIL, and
        # a waiter that spins holds the core its peer needs.
        # Between workers they must not either: an MPI exchange follows every local
        # collective, and it needs the cores (its peers' too, on a shared machine).
        spin_us = 0 if getattr(self, "_execution", "threads") == "threads" or self._between_workers else -1
        try:
            return ReplicaGroup(
                list(self._devices),
                timeout_seconds=self._options.timeout_seconds,
                spin_us=spin_us,
                threads=self._group_threads,
            )
        except ValueError as e:
            raise ValueError(f"{self._what}: {e}") from None

    def _choose_execution(self, execution: str, what: str) -> str:
        from . import replicas_inline

        if self._on_gpu:
            if execution == "threads":
                raise ValueError(
                    f"{what}: GPU replicas always run inline (one thread enqueues every replica's "
                    "work); execution='threads' is for CPU replicas"
                )
            execution = "inline"
        if execution == "auto":
            execution = "inline" if replicas_inline.available() else "threads"
        if execution == "inline" and not replicas_inline.available():
            raise ImportError(f"{what}: execution='inline' needs the greenlet package (pip install greenlet)")
        return execution

    def _make_runner(self) -> Any:
        if self._n == 1:
            return _SingleRunner(self._resolve)
        if self._execution == "inline":
            from .replicas_inline import InlineRunner

            return InlineRunner(self._n, self._resolve)
        from .replicas_threads import ThreadRunner

        return ThreadRunner(self._n, self._resolve, self._on_replica_failed)

    @property
    def execution(self) -> str:
        """How replicas run: "inline" (coroutines on the calling thread) or "threads"."""
        return self._execution

    @property
    def _group(self) -> Any:
        """The engine group (None for one replica)."""
        return getattr(self._coll, "group", None)

    @property
    def _places(self) -> Tuple[Optional[int], ...]:
        return self._coll.places

    # ---- run -----------------------------------------------------------------------------------
    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]
    ) -> Any:
        if not callable(fn):
            raise TypeError(f"strategy.run: fn must be callable, got {type(fn).__name__}")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"strategy.run: positional args must be a list or tuple, got {type(args).__name__}")
        if kwargs is None:
            kwargs = _EMPTY
        elif not isinstance(kwargs, dict):
            raise ValueError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}")
        stack = context._local.stack
        ctx = stack[-1][1] if stack else None
        if ctx is not None and ctx._in_run:
            raise RuntimeError(
                f"strategy.run cannot be called inside strategy.run (replica "
                f"{ctx.replica_id_in_sync_group}); call the function directly, or use "
                "merge_call to reach cross-replica context"
            )
        if self._closed:
            raise ClosedError(f"{self._container!r} is closed")
        # One bytecode claims the step (the common case: no step running) or finds the
        # claim that holds it, so no other thread ever sees a step without its thread.
        mine = (_get_ident(), _getframe(), _forks[0])
        claims = self._claims
        if claims.setdefault(0, mine) is not mine:
            try:
                self._claim_step(mine)
            except BaseException:
                del mine  # the refusal's traceback holds this frame: no cycle through it
                raise
        try:
            if self._fork != _forks[0]:
                self._after_fork()
            self._step_active = True
            return self._step(fn, args, kwargs)
        finally:
            self._step_active = False
            # Only this call's own claim is let go (never one that took over from it).
            if claims.get(0) is mine:
                del claims[0]
            del mine  # the claim holds this frame: no cycle left for the collector

    def _claim_step(self, mine: Tuple[int, Any, int]) -> None:
        """Makes ``mine`` the claim of the step running, or raises when another step is
        running (its claim was found in place). A claim left behind by a step that a
        KeyboardInterrupt cut short before it could let go (the interrupt may land
        between any two bytecodes) is recognized as stale and taken over: a strategy
        never refuses forever. Stale: its call has returned, or it is another thread's
        claim from before a fork (that thread does not exist here, and a thread of the
        child may have its id and its stack's old place). A live claim's call has not
        returned, so a live one is never taken for stale."""
        claims = self._claims
        while True:
            # Claimed again: the step that held it may have ended since.
            held = claims.setdefault(0, mine)
            if held is mine:
                return
            # Another thread's claim from before a fork is stale without a look.
            if (held[2] == mine[2] or held[0] == mine[0]) and executing(held[1], held[0]):
                del held  # the error's traceback must not keep the running step's frame
                raise RuntimeError(
                    f"{self._container!r} is already running a step (strategy.run from merge_fn or from "
                    "another thread); one step at a time"
                )
            # Stale: taken over, unless its call let go of it since it was read (and
            # another may have claimed the step): then the claim is tried again. Only
            # a stale claim's thread could remove it, and its call has returned. (The
            # test above is outside the lock: clearing a returned frame runs its locals'
            # finalizers, which may call into this strategy.)
            with self._claim_lock:
                if claims.get(0) is held:
                    claims[0] = mine
                    return

    def _step(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        n = self._n
        group = self._quick if self._quick is not None else self._group
        if group is not None and group.aborted:
            # A collective of an earlier step (or of the group used directly) failed or
            # was interrupted: clear that before this step's collectives.
            try:
                group.reset()
            except Exception:  # noqa: BLE001 - still in flight; this step's collectives report it
                pass
        per = per_replica_arguments(args, kwargs, n, "strategy.run")
        runner = self._runner
        try:
            results = runner.step(fn, per, self._entries, self._timeout)
        except StepTimeout as e:
            own = [
                f
                for f in _take_failures(runner)  # the caller's now (see below)
                if isinstance(f.error, Exception) and not isinstance(f.error, AbortedError)
            ]
            if own:
                # A replica's own error (a collective that timed out waiting for the
                # stuck replica, say) says more than "the step timed out". (Not the
                # interrupt that the timeout sent, nor the releases it caused.)
                self._raise_failure(own)
            stuck = e.stuck
            err = CollectiveTimeoutError(
                f"replica {stuck[0] if stuck else '?'}: strategy.run did not finish within {e.timeout:g} s"
                f" (replica(s) still running: {names(stuck) or 'none'}); "
                f"{e.why + '; ' if e.why else ''}the timeout is CommunicationOptions.timeout_seconds"
            )
            if stuck:
                err.replica = stuck[0]  # type: ignore[attr-defined]
            raise err from None
        except BaseException:
            # Ctrl-C, SystemExit: the runner keeps none of the step's failures (their
            # tracebacks hold the replicas' frames, and so the step's inputs).
            _take_failures(runner)
            raise
        if runner.failures:
            # The errors go to the caller, and the runner keeps none of them: with its
            # traceback an error holds the replica's frames, and so the step's inputs.
            # (No local keeps them: the raised error has this frame on its traceback.)
            self._raise_failure(_take_failures(runner))
        return regroup(results)

    @staticmethod
    def _raise_failure(failures: List[Failure]) -> None:
        """Raises the step's primary failure: the first that is not a release of another
        replica's, with the replica named and the original chained."""
        primary = min(failures, key=lambda f: (isinstance(f.error, AbortedError), f.order))
        error = replica_error(primary)
        cause = primary.error
        # This frame goes on the error's traceback: it keeps no reference to the error
        # (a cycle the garbage collector would have to break).
        del failures, primary
        try:
            if error is cause:
                raise error
            raise error from cause
        finally:
            del error, cause

    def _on_replica_failed(self, replica: int, why: str) -> None:
        """Thread mode: a replica failed or the step was abandoned. A collective in flight
        on another thread finishes on its own (single-call collectives never wait for a
        replica), so there is nothing to release in the engine."""

    def _after_fork(self) -> None:
        """In a child process after os.fork(): the engine's threads are gone, so the group
        is made again (the runner restarts its own threads)."""
        if self._on_gpu:
            raise RuntimeError(
                f"{self._container!r} was created before os.fork(); CUDA cannot be used in a forked child: "
                "create the strategy in the child (or use the 'spawn' start method)"
            )
        self._fork = fork_generation()
        old = self._coll
        self._coll = self._make_collectives()
        self._make_quick_paths()
        self._quick_tree = self._quick_tree_ok()
        self._make_gpu_quick_path()
        # The old group's threads do not exist here: never join them.
        if getattr(old, "group", None) is not None:
            _leak(old.group)  # type: ignore[attr-defined]

    # ---- meetings --------------------------------------------------------------------------------
    def _meet(self, ctx: context.ReplicaContext, request: Request) -> Any:
        return self._runner.meet(ctx._replica_id, request)

    def _resolve(self, requests: List[Any]) -> List[Any]:
        """One outcome per replica for a meeting that every replica has reached."""
        if self._runner._fired:
            # Inline, the step's timeout interrupted a replica, whose cleanup (a finally
            # block) made this call: the step is over, and no call of its cleanup may
            # pair with the calls the others wait in.
            return [
                Raise(AbortedError(f"replica {r}: released from {as_request(q).describe()}: the step timed out"))
                for r, q in enumerate(requests)
            ]
        q0 = requests[0]
        if type(q0) is tuple and q0[0] is QUICK_ALL_REDUCE and self._native_quick is not None:
            # Inline replicas that each all-reduce one array: checked, reduced and given
            # new outputs in one call into the engine (None: not all of that form).
            out = _quick_all_reduce(self._native_quick, requests, QUICK_ALL_REDUCE, self._algorithm)
            if out is not None:
                return out
        elif type(q0) is tuple and q0[0] is QUICK_TREE and self._native_quick is not None:
            # Inline replicas that each all-reduce a structure of numpy arrays (sent only
            # where the host engine reduces them): one call for every leaf.
            leaves = _quick_all_reduce_tree(
                self._native_quick,
                requests,
                QUICK_TREE,
                self._algorithm,
                FUSE_LEAF_BYTES,
                host_pack_bytes(self._options.bytes_per_pack),
            )
            if leaves is not None:
                return leaves
        elif type(q0) is tuple and q0[0] is QUICK_ALL_REDUCE and self._quick_runner is not None:
            # The same checks and new outputs natively, the arrays reduced by the runner.
            out = _quick_all_reduce_with(self._quick_runner, self._n, requests, QUICK_ALL_REDUCE)
            if out is not None:
                return out
        elif type(q0) is tuple or q0.extra is _QUICK:
            out = self._resolve_quick(requests)
            if out is not None:
                return out
        # Any replica may have sent a quick form (replica 0 the general one, say): the
        # general path reads Requests only.
        requests = [as_request(q) for q in requests]
        n = len(requests)
        try:
            check_calls(requests)
            if requests[0].kind == "merge_call":
                # Not under the lock: merge_fn is the user's code, whose collectives take
                # it themselves, and which may wait for another thread that makes one.
                return self._resolve_merge(requests)
            with self._lock:
                return _RESOLVERS[requests[0].kind](self, requests)
        except BaseException as e:
            if not isinstance(e, Exception):
                raise
            if isinstance(e, MismatchError):
                return [Raise(_for_replica(e, r)) for r in range(n)]
            return [Raise(e)] * n

    def _resolve_quick(self, requests: List[Any]) -> Optional[List[Any]]:
        """Every replica all-reduces one C-contiguous, aligned numpy array of one engine
        dtype and shape with the same op: one engine call, straight from the replicas' arrays into
        new ones, and each replica's outcome is its result array. None when anything
        differs (the general path then checks and reports it)."""
        if self._gpu_quick is not None:
            return self._resolve_quick_gpu(requests)
        ins = []
        for q in requests:
            if type(q) is tuple:
                if q[0] is not QUICK_ALL_REDUCE:
                    return None
                qop, a = q[1], q[2]
            elif q.extra is _QUICK and q.kind == "all_reduce":
                qop, a = q.params[0], q.value
            else:
                return None
            ins.append(a)
            if len(ins) == 1:
                op, a0, dt, shape = qop, a, a.dtype, a.shape
                # By type number (hashing a dtype is slow): native byte order apart.
                name = _ENGINE_NAMES[op._name_].get(dt.num)
                if name is None or not dt.isnative:
                    return None
            elif qop is not op or a.shape != shape or (a.dtype is not dt and a.dtype != dt):
                return None
            flags = a.flags
            if not (flags.c_contiguous and flags.aligned):
                return None  # the general path copies it as the engine reads it
        if a0.nbytes < _POOL_MIN_BYTES:
            outs = [np.empty(shape, dt) for _ in ins]
        else:
            outs = [_pooled_empty(shape, dt) for _ in ins]
        # No strategy lock: the engine itself runs one single call at a time.
        self._quick.all_reduce(ins, name, self._exact_algorithm(dt, str(name)), outs)
        return outs

    def _exact_algorithm(self, dt: np.dtype, name: str) -> str:
        """The strategy's algorithm for an all-reduce of engine dtype ``dt`` with engine
        op ``name`` (see exact_algorithm: only 2-byte floats may differ)."""
        return self._algorithm if dt.itemsize != 2 else exact_algorithm(self._algorithm, dt, name)

    def _gpu_leaf_spec(self, op: ReduceOp, arrays: List[Any]) -> Optional[Tuple[Any, ...]]:
        """(shape, dtype, engine op, algorithm) of an all-reduce of ``arrays`` (one
        DeviceArray per replica) when each is on its replica's GPU, all of one engine
        dtype and shape; else None (the general path then checks, moves and reports)."""
        a0 = arrays[0]
        dt, shape = a0._dtype, a0._shape
        name = _ENGINE_NAMES[op._name_].get(dt.num)
        if name is None:
            return None
        for a, place in zip(arrays, self._gpu_places):
            if a._shape != shape or (a._dtype is not dt and a._dtype != dt) or a._device != place:
                return None
        return shape, dt, name, self._exact_algorithm(dt, name)

    def _resolve_quick_gpu(self, requests: List[Any]) -> Optional[List[Any]]:
        """Every inline GPU replica all-reduces one DeviceArray on its own GPU, of one
        engine dtype and shape, with the same op: new outputs from the device-memory
        cache and one call into the CUDA engine, none of the general path's conversions
        and copies. None when anything differs (the general path then checks, moves and
        reports)."""
        q0 = requests[0]
        if type(q0) is tuple and q0[0] is QUICK_TREE:
            return self._resolve_quick_gpu_tree(requests)
        ins = []
        for q in requests:
            if type(q) is not tuple or q[0] is not QUICK_ALL_REDUCE or q[1] is not q0[1]:
                return None
            ins.append(q[2])
        spec = self._gpu_leaf_spec(q0[1], ins)
        if spec is None:
            return None
        shape, dt, name, algorithm = spec
        with self._lock:  # cross-replica calls of other threads use the group too
            outs: List[Any] = DeviceArray._new_many(shape, dt, self._gpu_places)
            self._gpu_quick._all_reduce_checked(ins, outs, name, algorithm)
        return outs

    def _resolve_quick_gpu_tree(self, requests: List[Any]) -> Optional[List[Any]]:
        """Every inline GPU replica all-reduces a structure of DeviceArrays (a model's
        gradients), of one nesting, each leaf on the replica's own GPU and of the same
        engine dtype and shape on every replica, with the same op: every output from
        the device-memory cache in one visit and one engine call per leaf, straight from
        the leaves into the outputs, with one host wait for them all. Packing the leaves
        into one buffer instead costs a device copy per leaf and replica each way:
        measured on an H200 with 8 replicas and 50 leaves of 4 KiB, 8.4 ms a step
        against 1.07 ms this way. None when anything differs (the general path then
        checks and reports)."""
        q0 = requests[0]
        op, s0, count = q0[1], q0[2], len(q0[3])
        for q in requests:
            if type(q) is not tuple or q[0] is not QUICK_TREE or q[1] is not op or len(q[3]) != count:
                return None
            if q is not q0 and not nest._same(q[2], s0):
                return None
        # Step 1: check every leaf on every replica before anything runs, so that a
        # mismatch goes to the general path with nothing half done.
        calls = []
        for i in range(count):
            ins = [q[3][i] for q in requests]
            spec = self._gpu_leaf_spec(op, ins)
            if spec is None:
                return None
            calls.append((ins, spec))
        # Step 2: the outputs, then one engine call per leaf, queued back to back with
        # one host wait at the end, under the strategy's lock (cross-replica calls of
        # other threads use the group too).
        with self._lock:
            outs = DeviceArray._new_set([spec[:2] for _, spec in calls], self._gpu_places)
            self._gpu_quick._all_reduce_many_checked(
                [(ins, [o[i] for o in outs], spec[2], spec[3]) for i, (ins, spec) in enumerate(calls)]
            )
        # Step 3: each replica's outputs in its own structure.
        return [nest.pack_sequence_as(q[2], o) for q, o in zip(requests, outs)]

    def _convert(self, leaf: Any) -> Any:
        """A leaf (inside the replica) as the collectives take it."""
        x = _unwrap(leaf)
        if self._on_gpu:
            return kinds.to_engine_value(x)
        return kinds.to_numpy(x)

    # ---- replica context collectives -----------------------------------------------------------
    def _replica_all_reduce(
        self, ctx: context.ReplicaContext, reduce_op: Any, value: Any, options: Optional[CommunicationOptions]
    ) -> Any:
        op = _OPS.get(reduce_op) if isinstance(reduce_op, str) else None
        if op is None:
            op = as_reduce_op(reduce_op)
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        if options is None and type(value) is np.ndarray and self._quick is not None and value.dtype.num in _QUICK_NUMS:
            # The common case: one numpy array of a number dtype, no options. Its outcome
            # is the result array itself (see _resolve_quick); inline, the request goes
            # to the scheduler in its quick tuple form, straight from here.
            if self._inline:
                sched = _getcurrent().parent
                if sched is self._runner._parent:
                    return sched.switch((QUICK_ALL_REDUCE, op, value))
                raise self._runner.refused(ctx._replica_id, "all_reduce")
            if self._n == 1:
                # One local replica: nobody to meet, the collective at once.
                out = self._resolve_quick([(QUICK_ALL_REDUCE, op, value)])
                if out is not None:
                    return out[0]
            return self._runner.meet(ctx._replica_id, Request("all_reduce", (op,), value, _QUICK))
        if options is None and type(value) is DeviceArray and self._gpu_quick is not None:
            # The same for inline GPU replicas: one DeviceArray each (see _resolve_quick_gpu).
            sched = _getcurrent().parent
            if sched is self._runner._parent:
                return sched.switch((QUICK_ALL_REDUCE, op, value))
            raise self._runner.refused(ctx._replica_id, "all_reduce")
        if options is None and self._gpu_quick is not None and nest.is_nested(value):
            # A structure of DeviceArrays of number dtypes (a model's gradients on GPUs):
            # to the scheduler in the quick tree form (see _resolve_quick_gpu_tree).
            leaves = nest.flatten(value)
            if leaves and all(type(x) is DeviceArray and x._dtype.num in _QUICK_NUMS for x in leaves):
                sched = _getcurrent().parent
                if sched is not self._runner._parent:
                    raise self._runner.refused(ctx._replica_id, "all_reduce")
                return sched.switch((QUICK_TREE, op, value, leaves))
        if options is None and self._quick_tree and nest.is_nested(value):
            # A structure of numpy arrays of number dtypes (a model's gradients): to the
            # scheduler in the quick tree form, straight from here.
            # (Its leaves, when all are numpy arrays of those dtypes: one walk in C++.)
            quick_leaves = _leaf_arrays(value, _QUICK_MASK)
            if quick_leaves:
                sched = _getcurrent().parent
                if sched is not self._runner._parent:
                    raise self._runner.refused(ctx._replica_id, "all_reduce")
                return sched.switch((QUICK_TREE, op, value, quick_leaves))
        timeout = None if options is None else options.timeout_seconds
        single = not nest.is_nested(value)
        leaves = [value] if single else nest.flatten(value)
        arrays = leaves
        # Host replicas whose leaves are all numpy arrays (a structure of gradients):
        # nothing to convert there and back. GPU replicas always convert.
        if self._on_gpu or any(type(x) is not np.ndarray for x in leaves):
            if any(is_sparse(_unwrap(x)) for x in leaves):
                return self._replica_all_reduce_sparse(ctx, op, value, single, leaves, options, timeout)
            arrays = [self._convert(x) for x in leaves]
        _check_numbers(ctx._replica_id, leaves, arrays, "all_reduce", "reduce")
        out = self._meet(ctx, Request("all_reduce", (op,), value, (arrays, options), timeout))
        if arrays is leaves:
            return out[0] if single else nest.pack_sequence_as(value, out)
        if single:
            return kinds.restore(out[0], _unwrap(value))
        return nest.pack_sequence_as(value, [kinds.restore(o, _unwrap(x)) for o, x in zip(out, leaves)])

    def _replica_all_reduce_sparse(
        self,
        ctx: context.ReplicaContext,
        op: ReduceOp,
        value: Any,
        single: bool,
        leaves: List[Any],
        options: Optional[CommunicationOptions],
        timeout: Optional[float],
    ) -> Any:
        """``all_reduce`` of a value with IndexedSlices among its leaves: each checked
        here, in the replica, and sent as SparseParts; the resolver gathers their rows
        (see distvals.sparse_collectives) and reduces the dense leaves."""
        r = ctx._replica_id
        paths = None if single else nest.paths(value)
        arrays: List[Any] = []
        for i, x in enumerate(leaves):
            u = _unwrap(x)
            if is_sparse(u):
                where = f" at {paths[i]}" if paths else ""
                arrays.append(sparse_parts(u, op, self._convert, f"replica {r}: all_reduce", where))
            else:
                a = self._convert(x)
                _check_numbers(r, [x], [a], "all_reduce", "reduce")
                arrays.append(a)
        out = self._meet(ctx, Request("all_reduce", (op,), value, SparseExtra((arrays, options)), timeout))
        results = [
            a.result(o) if type(a) is SparseParts else kinds.restore(o, _unwrap(x))
            for o, a, x in zip(out, arrays, leaves)
        ]
        return results[0] if single else nest.pack_sequence_as(value, results)

    def _replica_all_gather(
        self, ctx: context.ReplicaContext, value: Any, axis: int, options: Optional[CommunicationOptions]
    ) -> Any:
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        single = not nest.is_nested(value)
        leaves = [value] if single else nest.flatten(value)
        arrays = [self._convert(x) for x in leaves]
        for leaf, a in zip(leaves, arrays):
            refuse_masked(leaf, ctx._replica_id, "all_gather")
            if a.dtype.hasobject:
                raise TypeError(
                    f"replica {ctx._replica_id}: all_gather cannot send a value of type "
                    f"{type_name(leaf, a)}; pass numbers, strings or arrays of them"
                )
            normalize_axis(axis, a.ndim, "all_gather", ctx._replica_id)
        timeout = None if options is None else options.timeout_seconds
        out = self._meet(ctx, Request("all_gather", (axis,), value, (arrays, options), timeout))
        if single:
            return kinds.restore(out[0], _unwrap(value))
        return nest.pack_sequence_as(value, [kinds.restore(o, _unwrap(x)) for o, x in zip(out, leaves)])

    def _replica_broadcast(self, ctx: context.ReplicaContext, value: Any, root: int = 0) -> Any:
        """Replica ``root``'s ``value`` on every replica, in the kind each passed."""
        arrays = [self._convert(value)]
        out = self._meet(ctx, Request("broadcast", (root,), value, (arrays, None)))
        return kinds.restore(out[0], _unwrap(value))

    def _replica_update_all_reduce(
        self, ctx: context.ReplicaContext, var: Any, kind: str, op: Optional[ReduceOp], local: Any, original: Any
    ) -> None:
        """An aggregated update of MirroredVariable ``var`` (``kind``: assign, assign_add,
        ...): the replicas' values all-reduced with ``op`` (None: the first replica's,
        broadcast), and every copy updated by the resolver at once. A SUM update that got
        the very same plain object on every replica is refused (it would count it N
        times)."""
        arrays = [self._convert(local)]
        shown = op if op is not None else "ONLY_FIRST_REPLICA"
        self._meet(ctx, Request("variable update", (var.name, kind, shown), local, (arrays, original, var)))

    def _merge_call(
        self, ctx: context.ReplicaContext, merge_fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        if not callable(merge_fn):
            raise TypeError(f"merge_call: merge_fn must be callable, got {type(merge_fn).__name__}")
        strategy = self._container
        if not ctx._in_run:
            with context.CrossReplica(strategy):
                return merge_fn(strategy, *args, **kwargs)
        if self._n == 1:
            # Its arrays read-only as with several replicas (see _resolve_merge), so that
            # a step behaves the same with any number of replicas.
            # And its own part of a distributed value that merge_fn returns.
            with context.CrossReplica(strategy):
                return select_replica(0, _read_only_arrays(merge_fn(strategy, *args, **kwargs)))
        return self._meet(ctx, Request("merge_call", (), (merge_fn, args, kwargs)))

    # ---- resolvers: every replica has made the same call ------------------------------------------
    def _options_of(self, request: Request) -> Tuple[str, int]:
        opts = request.extra[1]
        merged = self._options if opts is None else self._options.merge(opts)
        algorithm = self._algorithm if opts is None or opts.implementation == "auto" else opts.implementation
        return algorithm, merged.bytes_per_pack

    def _resolve_all_reduce(self, requests: List[Request]) -> List[Any]:
        if any(q.extra is _QUICK for q in requests):
            # Requests of the quick path that it could not take (they differ, say): the
            # general path, whose outcome for a quick request is its single result.
            quick = [q.extra is _QUICK for q in requests]
            requests = [
                Request(q.kind, q.params, q.value, ([q.value], None)) if k else q for q, k in zip(requests, quick)
            ]
            out = self._resolve_all_reduce(requests)
            return [o[0] if k else o for o, k in zip(out, quick)]
        if any(type(q.extra) is SparseExtra for q in requests):
            return self._resolve_sparse_all_reduce(requests)
        q0 = requests[0]
        op = q0.params[0]
        leaves = [q.extra[0] for q in requests]
        if any(type(q.value) is not np.ndarray for q in requests):
            check_structures(requests, "all_reduce")
        check_leaves(q0.value, leaves, "all_reduce")
        algorithm, bytes_per_pack = self._options_of(q0)
        out = self._all_reduce_leaves(op, leaves, algorithm, bytes_per_pack, q0.value)
        if any(type(q.extra) is TreeExtra for q in requests):
            # Requests of the quick tree path that it could not take: each outcome
            # packed as its replica's structure, as that path gives it.
            return [
                nest.pack_sequence_as(q.value, o) if type(q.extra) is TreeExtra else o for q, o in zip(requests, out)
            ]
        return out

    def _resolve_sparse_all_reduce(self, requests: List[Request]) -> List[Any]:
        """An all-reduce with IndexedSlices among its leaves: checked across replicas
        before anything moves, then the dense leaves all-reduced and the sparse ones'
        rows all-gathered (see distvals.sparse_collectives)."""
        q0 = requests[0]
        op = q0.params[0]
        check_structures(requests, "all_reduce")
        rows = [q.extra[0] for q in requests]
        check_sparse_leaves(q0.value, rows, "all_reduce")
        if nest.is_nested(q0.value):
            # Between workers the calls below name the leaves by path, not the
            # containers' kinds: the workers agree on those first.
            self._agree_structure("all_reduce", q0.value)
        algorithm, bytes_per_pack = self._options_of(q0)
        return all_reduce_rows(
            op,
            rows,
            q0.value,
            self._total_replicas(),
            lambda leaves, value: self._all_reduce_leaves(op, leaves, algorithm, bytes_per_pack, value),
            lambda leaves, axes, value: self._coll.all_gather(leaves, axes, value=value),
        )

    def _all_reduce_leaves(
        self,
        op: ReduceOp,
        leaves: List[List[Any]],
        algorithm: str,
        bytes_per_pack: int,
        value: Any = None,
        label: str = "",
    ) -> List[List[Any]]:
        if self._via_root is not None:
            return self._all_reduce_via_root(op, leaves)
        return self._coll.all_reduce(
            op, leaves, algorithm=algorithm, bytes_per_pack=bytes_per_pack, value=value, label=label
        )

    def _all_reduce_via_root(self, op: ReduceOp, leaves: List[List[Any]]) -> List[List[Any]]:
        """ReductionToOneDevice: reduce onto the root replica, then broadcast."""
        root = self._via_root or 0
        n = len(leaves)
        reduced = [self._coll.reduce(op, [leaves[r][i] for r in range(n)]) for i in range(len(leaves[0]))]
        rows = [[reduced[i] if r == root else leaves[r][i] for i in range(len(reduced))] for r in range(n)]
        return self._coll.broadcast(rows, root)

    def _resolve_all_gather(self, requests: List[Request]) -> List[Any]:
        q0 = requests[0]
        axis = q0.params[0]
        leaves = [q.extra[0] for q in requests]
        check_structures(requests, "all_gather")
        for r, row in enumerate(leaves):
            for i, a in enumerate(row):
                if a.ndim != leaves[0][i].ndim:
                    raise MismatchError(
                        f"all_gather: replica 0 passed rank {leaves[0][i].ndim}, replica {r} "
                        f"passed rank {a.ndim}; shapes may differ only along axis {axis}"
                    )
        axes = [normalize_axis(axis, a.ndim, "all_gather", 0) for a in leaves[0]]
        check_leaves(q0.value, leaves, "all_gather", axes)
        for row in leaves:
            for a in row:
                if a.dtype.hasobject:
                    raise TypeError("all_gather cannot send Python objects; pass numbers, strings or arrays of them")
        return self._coll.all_gather(leaves, axes, value=q0.value)

    def _resolve_broadcast(self, requests: List[Request]) -> List[Any]:
        q0 = requests[0]
        leaves = [q.extra[0] for q in requests]
        check_leaves(q0.value, leaves, "broadcast")
        return self._coll.broadcast(leaves, q0.params[0], value=q0.value)

    def _resolve_update(self, requests: List[Request]) -> List[Any]:
        q0 = requests[0]
        name, kind, op = q0.params
        leaves = [q.extra[0] for q in requests]
        check_leaves(q0.value, leaves, f"{kind} of variable '{name}'")
        original, var = q0.extra[1], q0.extra[2]
        if op is ReduceOp.SUM and self._count_twice(original, requests):
            raise ValueError(
                f"a SUM update ({kind}) of variable '{name}' got the same plain value on every replica, which would "
                f"count it {self._total_replicas()} times; pass each replica's own value, or use aggregation "
                "MEAN or ONLY_FIRST_REPLICA"
            )
        # The variable and the kind of update are part of the call between workers: two
        # variables' updates of one shape and dtype made in different orders on two
        # workers must not pair (each would take the other's values).
        label = var._call_label(kind)
        if isinstance(op, ReduceOp):
            outs = self._all_reduce_leaves(op, leaves, self._algorithm, 0, q0.value, label)
        else:
            outs = self._coll.broadcast(leaves, 0, value=q0.value, label=label)
        first = context.current_run_context()
        var._commit_update(kind, [o[0] for o in outs], first._replica_id if first is not None else 0)
        return [None] * len(requests)

    def _count_twice(self, original: Any, requests: List[Request]) -> bool:
        # Python keeps one object per small int and per bool, so for those, identity does
        # not say that the replicas passed one value: each replica's own count (its batch
        # size, say) is summed as the replicas' values are.
        if type(original) in (int, bool, np.bool_):
            return False
        return all(q.extra[1] is original for q in requests)

    def _total_replicas(self) -> int:
        return self._n

    def _resolve_merge(self, requests: List[Request]) -> List[Any]:
        strategy = self._container
        fn = requests[0].value[0]
        merged_args = regroup([q.value[1] for q in requests], what="merge_call args", scalars_by_identity=True)
        merged_kwargs = regroup([q.value[2] for q in requests], what="merge_call kwargs", scalars_by_identity=True)
        try:
            with context.CrossReplica(strategy):
                result = fn(strategy, *merged_args, **merged_kwargs)
        except Exception as e:  # noqa: BLE001 - replica 0 raises it, the others are released
            released = AbortedError(f"released from merge_call: merge_fn raised {type(e).__name__}: {e}")
            return [Raise(e)] + [Raise(released)] * (len(requests) - 1)
        # A plain array in the result is one object that every replica gets: as a read-only
        # view, so that an in-place change in one replica is an error instead of a change
        # the others see half-way through their steps (TensorFlow's tensors cannot be
        # changed either; a variable's read is read-only for the same reason).
        result = _read_only_arrays(result)
        return [_own_tensors(select_replica(r, result), r) for r in range(len(requests))]

    def close(self) -> None:
        self._closed = True
        self._runner.close()
        self._coll.close()


def _read_only_arrays(value: Any) -> Any:
    """``value`` with a read-only view in place of each writeable numpy array in it (at
    any depth of lists, tuples and mappings; distributed values are left as they are)."""
    if isinstance(value, np.ndarray):
        return _read_only(value)
    if not nest.is_nested(value) or not value:
        return value
    leaves = nest.flatten(value)
    if not any(isinstance(x, np.ndarray) and x.flags.writeable for x in leaves):
        return value
    return nest.pack_sequence_as(value, [_read_only(x) if isinstance(x, np.ndarray) else x for x in leaves])


def _own_tensors(value: Any, replica: int) -> Any:
    """``value`` as replica ``replica`` gets it from merge_call: torch and CuPy arrays,
    which cannot be made read-only, as a copy of its own in every replica but the first,
    so that an in-place change in one replica never shows in another's."""
    if replica == 0:
        return value
    nested = nest.is_nested(value)
    leaves = nest.flatten(value) if nested else [value]
    if not any(kinds.framework_of(x) in _COPY for x in leaves):
        return value
    own = [_COPY[kinds.framework_of(x)](x) if kinds.framework_of(x) in _COPY else x for x in leaves]
    return nest.pack_sequence_as(value, own) if nested else own[0]


# How an array of each framework that has no read-only arrays is copied.
_COPY: Dict[str, Callable[[Any], Any]] = {"torch": lambda t: t.clone(), "cupy": lambda a: a.copy()}


def _read_only(a: np.ndarray) -> np.ndarray:
    if not a.flags.writeable:
        return a
    view: np.ndarray = a.view()
    view.flags.writeable = False
    return view


def _check_numbers(replica: int, leaves: Sequence[Any], arrays: Sequence[Any], what: str, verb: str) -> None:
    """Refuses, in the replica and naming it, values that are not numbers."""
    for leaf, a in zip(leaves, arrays):
        refuse_masked(leaf, replica, what)
        dt = a.dtype
        if dt.hasobject or (dt.kind not in REDUCIBLE_KINDS and not engine_supports(dt)):
            raise TypeError(
                f"replica {replica}: {what} cannot {verb} a value of type {type_name(leaf, a)}; "
                "pass numbers or arrays of numbers"
            )


# What marks a request of the quick path (one numpy array, no options).
_QUICK = QUICK
_POOL_MIN_BYTES = 4096
_pooled_empty = _core.pooled_empty
_quick_all_reduce = _core.quick_all_reduce
_quick_all_reduce_with = _core.quick_all_reduce_with
_quick_all_reduce_tree = _core.quick_all_reduce_tree
_leaf_arrays = _core.nest_leaf_arrays
# (op, dtype) -> the engine op, for what the engine reduces directly (MEAN: floats only).
# Keyed by the op's name: hashing an enum member calls Python code.
_ENGINE_NAMES = {
    op._name_: {
        np.dtype(t).num: op.engine_name
        for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
        if op is not ReduceOp.MEAN or t.startswith("float")
    }
    for op in ReduceOp
}
_QUICK_NUMS = frozenset(
    np.dtype(t).num
    for t in (
        "float16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    )
)

# The same set as a bit mask, for distvals._core.nest_leaf_arrays (type numbers < 64).
_QUICK_MASK = sum(1 << num for num in _QUICK_NUMS)


def _for_replica(e: MismatchError, r: int) -> MismatchError:
    err = MismatchError(str(e))
    err.replica = r  # type: ignore[attr-defined]
    return err


def _leak(group: Any) -> None:
    """Keeps ``group`` alive for good: its threads died with the fork, and destroying it
    (which joins them) would wait forever in the child. One extra reference that is
    never released keeps even interpreter shutdown from destroying it."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _default_timeout() -> float:
    from . import options as options_module

    resolve = getattr(options_module, "default_timeout_seconds", None)
    if callable(resolve):
        return float(resolve())
    import os

    try:
        value = float(os.environ.get("DISTVALS_TIMEOUT_SECONDS", ""))
    except ValueError:
        value = 0.0
    return value if value > 0 else DEFAULT_TIMEOUT_SECONDS


_RESOLVERS = {
    "all_reduce": LocalExtended._resolve_all_reduce,
    "all_gather": LocalExtended._resolve_all_gather,
    "broadcast": LocalExtended._resolve_broadcast,
    "variable update": LocalExtended._resolve_update,
    "merge_call": LocalExtended._resolve_merge,
}

_ = (numpy_reduce, PerReplica)
