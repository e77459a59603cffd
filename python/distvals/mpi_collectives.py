"""Collectives across MPI processes ("workers"), each with local replicas on the engine.

``HierarchicalCollectives`` implements ``distvals.collectives.Collectives`` over every
replica of every worker. Inside a worker, a local implementation (host engine or CUDA
engine) does the work; between workers, one buffer per worker crosses MPI::

    worker 0: replica 0  replica 1        worker 1: replica 2  replica 3
                  \\        /                           \\        /
    step 1:      engine reduce  ------------------->  engine reduce      (into the MPI buffer)
                      |                                    |
    step 2:      MPI all-reduce  <===================>  MPI all-reduce   (in place)
                      |                                    |
    step 3:      engine broadcast                      engine broadcast  (from the MPI buffer)

With one local replica there is no step 1 or 3: MPI reduces from the replica's array
straight into its result array. Buffers of 64 KiB and more cross MPI by point-to-point
exchanges of our own (two workers swap, or a ring), straight into the result with no
copy: see ``distvals.mpi_exchanges``. Smaller ones cross in one MPI all-reduce: in a
loop, a persistent request (MPI 4's ``Allreduce_init``) that every worker made at the
same agreed call and starts again at every repeat, on a buffer kept from call to call
(``_flat_expected``); each ``Iallreduce`` would build its schedule anew. On host
replicas that repeat is one native call on a plan bound to the request once
(``_plan_of``: ``distvals._core.WorkerSmallPlan``): the local reduce, the agreement flag,
``MPI_Start`` and ``MPI_Test`` of the request (their addresses taken from the MPI library
mpi4py loaded: distvals does not link MPI) and the copies out; a wait longer than a few
tens of microseconds goes back to the polling below. The public collectives try the plan
of the expected call first (``_planned``), before any other work: its own checks of the
arrays stand in for the general path's, so a repeat costs 1 to 2 µs more than a blocking
``MPI_Allreduce`` of the same bytes (2 workers on one host, 1 KiB).

A buffer can cross in chunks (``DISTVALS_MPI_CHUNK_BYTES``, the same on every worker), so
that with several local replicas the local reduce of chunk i+1 and the broadcast of chunk
i-1 run while MPI carries chunk i on the MPI thread. That pays only where the two phases
use different resources (MPI over a network while spare cores reduce); on one 2-core
machine, with the exchanges, it lost about 20% (2 workers x 2 replicas, 16 MiB: 24.8 ms
in 4 MiB chunks against 20.2-20.8 ms in one; 64 MiB: 91-101 ms against 74-81 ms), so by
default a buffer crosses in one piece (``python -m distvals.bench --mpi`` shows both).

The workers agree on every call without a second round trip: see
``distvals.mpi_agreement``.

Other rules: a wait on MPI polls against the strategy's timeout; one that runs out (a
worker never arrived) cannot be cancelled in MPI, so the job is aborted with a message
naming this worker. float16 and bfloat16 cross MPI as float32; dtypes MPI cannot reduce
(bool, complex MIN...) are gathered and reduced with numpy.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core, devices, nest
from ._core import MismatchError
from .collectives import accumulator_dtype, engine_supports, numpy_reduce, work_dtype
from .host_collectives import new_array
from .mpi_agreement import (
    AGREE,
    Expected,
    WorkerAgreement,
    collective_named,
    describe_call,
    describe_structure,
    dtype_text,
    one_collective,
)
from .mpi_exchanges import FLAG_TAG, NUMPY_OPS, TAG, Exchanges, wire_dtype
from .mpi_runtime import SPIN_TIGHT, WAIT_SLICE, MpiJob, MpiThread, native_request_calls, poll_all
from .reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from .engine_collectives import EngineCollectives
    from .group import ReplicaGroup

__all__ = ["DEFAULT_CHUNK_BYTES", "PIPELINE_CHUNK_BYTES", "SMALL_BYTES", "HierarchicalCollectives"]

#: Chunk size of the pipelined hierarchical all-reduce of large buffers; 0: one chunk
#: (the pipeline off, see the module doc).
DEFAULT_CHUNK_BYTES = 0
#: The chunk size the benchmark compares the default with.
PIPELINE_CHUNK_BYTES = 4 << 20
#: Collectives up to this size carry their agreement inside the data call.
SMALL_BYTES = 64 << 10
# The most remembered calls that hold a persistent MPI request at once.
_MAX_PERSISTENT = 64
# What a distvals._core.WorkerSmallPlan call returns when it did not finish the call:
# not its case (nothing done), or its request started and still running.
_NATIVE_NOT_HERE = 0
_NATIVE_PENDING = 1
# How long the native call tests its request before it hands the wait to Python's
# polling (which spins, then yields the core, and honours the timeout and Ctrl-C): long
# enough for workers in step, whose small all-reduce completes within microseconds; a
# quarter of that polling's own tight spin, so that a late worker adds little spinning.
_NATIVE_SPIN = SPIN_TIGHT / 4
_monotonic = time.monotonic
_LOCAL_OP = {
    ReduceOp.SUM: ReduceOp.SUM,
    ReduceOp.MEAN: ReduceOp.SUM,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.PRODUCT,
}


def _labelled(description: str, label: str) -> str:
    """A call's description with what the call is for, where it says (``label``)."""
    return f"{description} for {label}" if label else description


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous and aligned for its dtype (a copy where it is not)."""
    a = np.ascontiguousarray(a)
    return a if a.flags.aligned else a.copy()


def _native_mpi(dtype: np.dtype, op: ReduceOp) -> bool:
    """True when MPI reduces ``dtype`` with ``op`` itself."""
    if not dtype.isnative:
        return False
    if dtype.kind == "f":
        return dtype.itemsize in (4, 8)
    if dtype.kind in "iu":
        # Not the SUM of 8- and 16-bit integers: Open MPI's AVX reductions (op/avx,
        # Open MPI 5) saturate them (100 + 100 gives 127 in int8) where numpy, and the
        # engine, wrap around; those go through the exchange that numpy reduces.
        if op is ReduceOp.SUM and dtype.itemsize < 4:
            return False
        return dtype.itemsize in (1, 2, 4, 8)
    if dtype.kind == "c":
        return dtype.itemsize in (8, 16) and op in (ReduceOp.SUM, ReduceOp.PRODUCT)
    return False


_NAN_OPS: Dict[ReduceOp, Any] = {}
_FLOATS: Dict[int, np.dtype] = {4: np.dtype(np.float32), 8: np.dtype(np.float64)}


def _nan_op(MPI: Any, op: ReduceOp) -> Any:
    """The MPI op of float MIN or MAX. MPI's own ops keep whichever value compares
    smaller (larger), so a NaN on one worker is lost; this one is numpy's np.minimum
    (np.maximum), which propagates NaN as the engine and numpy do. Made once a process."""
    mpi_op = _NAN_OPS.get(op)
    if mpi_op is None:
        ufunc = np.minimum if op is ReduceOp.MIN else np.maximum

        def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            # MPI's contract: inoutbuf = inbuf op inoutbuf (float32 or float64 here).
            dt = _FLOATS[datatype.Get_size()]
            into = np.frombuffer(inoutbuf, dt)
            ufunc(np.frombuffer(inbuf, dt), into, out=into)

        mpi_op = _NAN_OPS[op] = MPI.Op.Create(combine, commute=True)
    return mpi_op


def _accumulator(dtype: np.dtype, op: ReduceOp) -> Optional[np.dtype]:
    """float32 for sums, means and products of 16-bit floats (float16, bfloat16), which
    accumulate in float32 on every path; None otherwise (min and max are exact)."""
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return None
    return accumulator_dtype(dtype)


# The data view of a kind without a flat buffer of its own (large calls), never used.
_NO_DATA = np.empty(0)
_NO_DATA.flags.writeable = False


class _ArraysKind:
    """A kind of ``all_reduce_arrays`` call (op, dtype, shape): its description (as
    ``all_reduce`` makes it), its work dtype (None: the general path), and for small
    calls the flat buffer it crosses MPI in (the data, then the agreement flag), kept
    from call to call, with ``data``, a view of the data part in the arrays' shape;
    ``sig``, the description's signature; ``op``, the op between workers (SUM for MEAN);
    ``label``: what the call says it is for (``Collectives.all_reduce``'s), "" for most."""

    __slots__ = ("data", "description", "flat", "label", "op", "sig", "work")

    def __init__(
        self, description: str, sig: int, op: ReduceOp, work: Optional[np.dtype], a: np.ndarray, label: str = ""
    ) -> None:
        self.description = description
        self.sig = sig
        self.op = op
        self.work = work
        self.label = label
        self.flat: Optional[np.ndarray] = None
        # Nothing of ``a`` itself is kept: the caller's array must be freed when the
        # caller drops it (the kind lives as long as the strategy).
        self.data: np.ndarray = _NO_DATA
        if work is not None and a.nbytes <= SMALL_BYTES:
            self.flat = np.empty(a.size + 1, dtype=work)
            self.data = self.flat[: a.size].reshape(a.shape)


class HierarchicalCollectives(WorkerAgreement):
    """Collectives over every replica of every worker.

    ``local``: this worker's collectives (``HostCollectives`` or ``CudaCollectives``).
    ``comm``: the workers' communicator (the strategy passes its own duplicate).
    ``local_counts``: every worker's number of replicas, in rank order.
    """

    def __init__(
        self,
        local: EngineCollectives,
        comm: Any,
        local_counts: Sequence[int],
        timeout: float,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_fatal: Optional[Callable[[str], None]] = None,
    ) -> None:
        super().__init__(comm, timeout, on_fatal)
        MPI = self._MPI
        self.local = local
        self.local_counts = tuple(int(c) for c in local_counts)
        self.num_local = self.local_counts[self.rank]
        self.offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.local_counts)[:-1]]))
        self.offset = self.offsets[self.rank]
        self.num_replicas = int(sum(self.local_counts))
        self.places = local.places
        self.chunk_bytes = max(0, int(chunk_bytes))
        self._on_gpu = any(p is not None for p in self.places)
        self._mpi_thread = MpiThread()
        self._in_place = MPI.IN_PLACE
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
        self._what = "all_reduce"
        # Persistent all-reduce requests for small calls (see _flat_expected).
        self._persistent = hasattr(comm, "Allreduce_init")
        # The steady state of small host calls in one native call (_plan_of), where
        # the MPI library's MPI_Start and MPI_Test can be found.
        self._request_calls = native_request_calls(MPI)
        self._native_plans = self._request_calls is not None and not self._on_gpu
        # all_reduce_arrays: (op, dtype, shape) -> what it remembers of such calls.
        self._arrays: Dict[Tuple[Any, ...], _ArraysKind] = {}
        # The last kind looked up, by identity of op and dtype: a training loop repeats
        # one call, and hashing an enum member and a dtype costs more than the rest of
        # the lookup.
        self._last_kind: Tuple[Any, Any, Tuple[int, ...], Optional[_ArraysKind]] = (None, None, (), None)
        # The point-to-point all-reduce of large buffers.
        self._exchanges = Exchanges(self.rank, self.num_workers)
        # Several host replicas and an engine of one thread (the host's cores shared by
        # its workers): their values are reduced on this thread, where handing them to
        # the engine's thread gains nothing. Buffers that cross by the exchanges in one
        # piece are reduced inside them (Exchanges.all_reduce's ``local``); the others,
        # with two replicas, by numpy, whose plain stores leave the buffer in the cache
        # for MPI, which reads it next, where the engine streams large outputs past the
        # cache (measured, 2 workers x 2 replicas on 2 cores, whole call: 1 MiB 375-387
        # against 419-454 us, 16 MiB 7.9-8.3 against 9.8-10.3 ms; the same at 64 MiB).
        group = self.group
        self._local_on_caller = (
            not self._on_gpu and self.num_local >= 2 and getattr(getattr(group, "engine", None), "threads", 0) == 1
        )
        self._numpy_pair_reduce = self._local_on_caller and self.num_local == 2

    @property
    def group(self) -> Any:
        return getattr(self.local, "group", None)

    @property
    def reduces_inside_exchanges(self) -> bool:
        """Whether this worker reduces its several host replicas on the calling thread,
        inside the exchanges (``Exchanges.all_reduce``'s ``local``)."""
        return self._local_on_caller

    def set_pair_max_bytes(self, nbytes: int) -> None:
        """The size up to which two workers swap whole buffers (``Exchanges.route``):
        every worker must set the same, before its first collective."""
        self._exchanges.pair_max_bytes = int(nbytes)

    def _mpi_op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        """The MPI op that reduces ``dtype`` (a wire dtype) with ``op``."""
        if dtype.kind == "f" and (op is ReduceOp.MIN or op is ReduceOp.MAX):
            return _nan_op(self._MPI, op)
        return self._ops[op]

    # ---- MPI all-reduce of one flat buffer ----------------------------------------------------------
    def _mpi_all_reduce(
        self,
        buf: np.ndarray,
        op: ReduceOp,
        what: str,
        timeout: Optional[float],
        send: Optional[np.ndarray] = None,
        last: bool = False,
    ) -> None:
        """``buf`` all-reduced with ``op`` between the workers, on the calling thread: in
        place, or from ``send`` (same size) into ``buf``. float16/bfloat16 travel as float32.
        ``last``: the collective's last MPI call, the flagged one of the steady state (in
        place, the flag last): when it crosses in one nonblocking call in ``buf`` itself,
        an interrupted wait leaves it to ``_settle`` (see ``_wait_last``)."""
        t, deadline = self._deadline(timeout)
        wire = wire_dtype(buf.dtype)
        src = send
        target = None
        if wire != buf.dtype:
            target = buf
            buf = (send if send is not None else buf).astype(wire)
            src = None
        self.stats["data_calls"] += 1
        route = self._exchanges.route(buf.nbytes, buf.dtype)
        if route == "nonblocking":
            sendbuf = self._MPI.IN_PLACE if src is None else src
            req = self._comm.Iallreduce(sendbuf, buf, self._mpi_op(op, buf.dtype))
            if last and target is None and src is None:
                self._wait_last(req, buf, op, what, timeout)
            else:
                self._wait(req, what, timeout, (src, buf))
        elif route == "blocking":
            self._complete(self._submit(buf, op, src), what, t, deadline)
        else:
            self._exchanges.all_reduce(route, buf, op, src, self._polled_exchange(what, t, deadline))
        if target is not None:
            target[...] = buf.astype(target.dtype)

    def _polled_exchange(self, what: str, timeout: float, deadline: float) -> Callable[..., None]:
        """The exchange of ``Exchanges.all_reduce`` made from the calling thread: a
        nonblocking send and receive (and the flags' beside them), polled until the
        deadline."""
        comm = self._comm

        def exchange(out: np.ndarray, into: np.ndarray, dest: int, source: int, flags: Optional[np.ndarray]) -> None:
            reqs = [comm.Irecv(into, source, TAG), comm.Isend(out, dest, TAG)]
            if flags is not None:
                reqs += [comm.Irecv(flags[1:], source, FLAG_TAG), comm.Isend(flags[:1], dest, FLAG_TAG)]
            try:
                done = poll_all(reqs, deadline)
            except BaseException:
                self._held.append((reqs, (out, into, flags)))  # Ctrl-C: see WorkerAgreement._held
                raise
            if not done:
                self._timed_out(what, timeout)

        return exchange

    def carries_agreement(self, count: int, dtype: np.dtype) -> bool:
        """Whether a large all-reduce of ``count`` elements of ``dtype`` in one piece
        crosses by point-to-point exchanges that can carry the agreement flags (see the
        agreement module doc). It depends only on what every worker agrees on."""
        return wire_dtype(dtype) == dtype and self._exchanges.route(count * dtype.itemsize, dtype) in ("pair", "ring")

    def _carried_all_reduce(
        self,
        buf: np.ndarray,
        op: ReduceOp,
        send: Optional[np.ndarray],
        agree: Optional[bool],
        what: str,
        timeout: Optional[float],
        local: Optional[List[np.ndarray]] = None,
        outs: Optional[List[np.ndarray]] = None,
    ) -> bool:
        """``buf`` all-reduced (from ``send`` when given; from the local replicas' arrays
        ``local`` into every one of ``outs`` when given) by the exchanges, with this
        worker's agreement flag riding them unless ``agree`` is None; whether every
        worker's flag was True (when not, ``buf`` holds nothing of use)."""
        t, deadline = self._deadline(timeout)
        self.stats["data_calls"] += 1
        route = self._exchanges.route(buf.nbytes, buf.dtype)
        exchange = self._polled_exchange(what, t, deadline)
        return self._exchanges.all_reduce(route, buf, op, send, exchange, agree, local, outs)

    def _submit(self, buf: np.ndarray, op: ReduceOp, send: Optional[np.ndarray]) -> MpiJob:
        """Starts the all-reduce of ``buf`` (from ``send`` when given) on the MPI thread,
        with blocking calls, routed as ``Exchanges.route`` says (its caller counts it)."""
        job = MpiJob(buf, None)
        comm = self._comm
        mpi_op = self._mpi_op(op, buf.dtype)
        sendbuf = self._MPI.IN_PLACE if send is None else send
        route = self._exchanges.route(buf.nbytes, buf.dtype)
        run: Callable[[], None]
        if route == "blocking":
            run = lambda: comm.Allreduce(sendbuf, buf, mpi_op)  # noqa: E731
        elif route == "nonblocking":
            # The same MPI collective as the calling thread's (a blocking call would not
            # match another worker's nonblocking one).
            run = lambda: comm.Iallreduce(sendbuf, buf, mpi_op).Wait()  # noqa: E731
        else:

            def exchange(
                out: np.ndarray, into: np.ndarray, dest: int, source: int, flags: Optional[np.ndarray]
            ) -> None:
                comm.Sendrecv(out, dest, TAG, into, source, TAG)  # never with flags: see _carried_all_reduce

            def run() -> None:
                self._exchanges.all_reduce(route, buf, op, send, exchange)

        self._mpi_thread.submit(job, run)
        return job

    def _complete(self, job: MpiJob, what: str, timeout: float, deadline: float) -> None:
        while not job.done.wait(WAIT_SLICE):  # type: ignore[union-attr]
            if _monotonic() > deadline:
                self._timed_out(what, timeout)
        if job.error is not None:
            msg = f"worker {self.rank}: {what}: MPI failed: {job.error}"
            if self._on_fatal is not None:
                self._on_fatal(msg)
            raise RuntimeError(msg) from job.error

    def _reduce_flat(
        self,
        flat: np.ndarray,
        op: ReduceOp,
        description: str,
        what: str,
        timeout: Optional[float],
        sig: Optional[int] = None,
        kept: bool = False,
    ) -> None:
        """The worker-level all-reduce, in place, of ``flat``: this worker's local result
        of a small collective, then one element, the agreement flag's place (module doc of
        ``distvals.mpi_agreement``). ``sig``: the description's signature, when the caller
        knows it; ``kept``: the caller keeps ``flat`` from call to call (an
        ``_ArraysKind``'s buffer), so that the persistent request of the call can work on
        it directly."""
        if sig is None:
            sig = self._sig(description)
        if self._interrupted:
            self._settle(what, timeout)
        # Whether the expected call carries a flag is the same on every worker (the
        # memory is), so every worker takes the same path here.
        expected = self._expected.get(self._last)
        if expected is not None and expected.flagged and expected.signature == sig:
            if self._flagged_call(expected, flat, op, what, timeout):
                self._last = sig
                return
            self.stats["flagged"] += 1
        else:
            # Our call is not the expected one: still make the expected MPI call (when it
            # carries a flag), flagged, so that every worker's call is well-formed.
            self._stand_in(what, timeout)
        self._agree_then_reduce(flat, op, sig, description, what, timeout, kept)

    def _agree_then_reduce(
        self,
        flat: np.ndarray,
        op: ReduceOp,
        sig: int,
        description: str,
        what: str,
        timeout: Optional[float],
        kept: bool,
    ) -> None:
        """The end of ``_reduce_flat`` when no call was expected, a flag was raised, or
        the call carries no flag: the workers agree first, then reduce ``flat``. When every
        worker's call changed the same way, no worker used its own buffer before (each
        made a stand-in call); when they differ, the exchange raises."""
        self._exchange(sig, description, what, timeout)
        flat[-1] = AGREE[op]
        self._mpi_all_reduce(flat, op, what, timeout)
        self._remember(self._flat_expected(sig, flat, op, kept))

    def _flagged_call(
        self, expected: Expected, flat: np.ndarray, op: ReduceOp, what: str, timeout: Optional[float]
    ) -> bool:
        """The one MPI call of the expected call (the steady state of a training loop):
        ``flat`` all-reduced with the flag "my call is the expected one"; whether every
        worker's flag said so (if not, ``flat`` holds nothing of use). A call with a
        persistent request starts it, on ``flat`` itself when it is the request's buffer."""
        agree = AGREE[op]
        buf = expected.buf
        if buf is None:
            flat[-1] = agree
            self._mpi_all_reduce(flat, op, what, timeout, last=True)
            return bool(flat[-1] == agree)
        if buf is not flat:
            np.copyto(buf[:-1], flat[:-1])
        buf[-1] = agree
        self._start_persistent(expected, what, timeout, last=True)
        if buf[-1] != agree:
            return False
        if buf is not flat:
            np.copyto(flat, buf)
        return True

    def _flat_expected(self, sig: int, flat: np.ndarray, op: ReduceOp, kept: bool) -> Expected:
        """What the memory keeps of a small call just agreed on every worker: with a
        persistent all-reduce request (MPI 4's ``Allreduce_init``) when the call crosses by
        a nonblocking all-reduce. Starting a persistent request skips the schedule that
        each ``Iallreduce`` builds (measured here, 2 workers, 1 KiB: 3.4 against 6.0 us,
        where a blocking ``Allreduce`` takes 3.1). Every worker makes the request at the
        same call (right after the agreed data call), from what they agreed on alone, so
        that their requests pair up, as their later starts do; at most
        ``_MAX_PERSISTENT`` are held."""
        expected = Expected(sig, flat.size, flat.dtype, op, True)
        if (
            self._persistent
            and expected.wire
            and self._persistent_count < _MAX_PERSISTENT
            and self._exchanges.route(flat.nbytes, flat.dtype) == "nonblocking"
        ):
            buf = flat if kept else np.empty_like(flat)
            try:
                expected.request = self._comm.Allreduce_init(self._in_place, buf, self._mpi_op(op, flat.dtype))
            except (NotImplementedError, self._MPI.Exception):
                # An MPI before 4.0: the same library on every worker, so every worker
                # stops here, at the same call.
                self._persistent = False
            else:
                expected.buf = buf
                expected.address = self._MPI._addressof(expected.request)
                self._persistent_count += 1
        return expected

    # ---- all-reduce --------------------------------------------------------------------------------
    def all_reduce(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        *,
        algorithm: str = "auto",
        bytes_per_pack: int = 0,
        timeout: Optional[float] = None,
        value: Any = None,
        what: str = "all_reduce",
        label: str = "",
    ) -> List[List[Any]]:
        if value is None or type(value) is np.ndarray:
            got = self._planned("all_reduce", op, leaves, None, True, timeout, what, label)
            if got is not None:
                return got  # type: ignore[no-any-return]
        return self._all_reduce_collective(op, leaves, algorithm, bytes_per_pack, timeout, value, what, label)

    @collective_named("all_reduce")
    def _all_reduce_collective(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        algorithm: str,
        bytes_per_pack: int,
        timeout: Optional[float],
        value: Any,
        what: str,
        label: str,
    ) -> List[List[Any]]:
        return self._all_reduce(op, leaves, algorithm, bytes_per_pack, timeout, value, what, label)

    def _all_reduce(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        algorithm: str,
        bytes_per_pack: int,
        timeout: Optional[float],
        value: Any,
        what: str,
        label: str = "",
    ) -> List[List[Any]]:
        """``all_reduce``'s body (``label``: see ``Collectives.all_reduce``, a part of
        every description the call makes)."""
        if self.num_workers == 1:
            return self.local.all_reduce(
                op, leaves, algorithm=algorithm, bytes_per_pack=bytes_per_pack, timeout=timeout
            )
        n = self.num_local
        first = leaves[0]
        if len(first) == 1 and not self._on_gpu and (value is None or not nest.is_nested(value)):
            # One host array per replica: the quick path of all_reduce_arrays (the same
            # description, so the same MPI calls), into new arrays.
            ins = [row[0] for row in leaves]
            kind = self._arrays_kind_of(op, ins, label)
            if kind is not None and kind.work is not None:
                if kind.flat is not None:
                    return [[o] for o in self._all_reduce_small(kind, op, ins, None, timeout, what)]
                outs = [new_array(ins[0].shape, ins[0].dtype) for _ in range(n)]
                self._all_reduce_kind(kind, op, ins, outs, timeout, what, label)
                return [[o] for o in outs]
        self._what = what
        # reduce and all_reduce are the same call between workers (a worker with one
        # local replica may reduce where another all-reduces): one description.
        description = _labelled(describe_call("all_reduce", op, value, leaves[0]), label)
        if not first:
            # No data to move, but still a call: the others must hear of it (they may
            # have passed leaves), and it keeps every worker's call sequence the same.
            self._sync_point(description, what, timeout)
            return [[] for _ in range(n)]
        dtypes = {work_dtype(a.dtype, op) for a in first}
        if len(dtypes) == 1 and all(_native_mpi(wire_dtype(d), _LOCAL_OP[op]) for d in dtypes):
            work = dtypes.pop()
            return self._all_reduce_accumulated(op, leaves, work, description, timeout)
        # Several dtypes, or one MPI cannot reduce: leaf by leaf (each its own call).
        out: List[List[Any]] = [[None] * len(first) for _ in range(n)]
        for i in range(len(first)):
            column = [[leaves[r][i]] for r in range(n)]
            res = self._all_reduce_one_dtype(op, column, f"{description} [leaf {i}]", timeout)
            for r in range(n):
                out[r][i] = res[r][0]
        return out

    def all_reduce_arrays(
        self,
        op: ReduceOp,
        ins: Sequence[np.ndarray],
        outs: Sequence[np.ndarray],
        timeout: Optional[float] = None,
    ) -> None:
        """``outs[r]`` = ``op`` over every replica's array of every worker, from one
        C-contiguous host array per local replica, all of one dtype and shape (what a
        step's ``ctx.all_reduce(op, x)`` passes). The same MPI calls as ``all_reduce``
        of the same values, with less Python around them."""
        if self._planned("all_reduce_arrays", op, ins, outs, False, timeout, "all_reduce") is None:
            self._all_reduce_arrays(op, ins, outs, timeout)

    @collective_named("all_reduce_arrays")
    def _all_reduce_arrays(
        self, op: ReduceOp, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], timeout: Optional[float]
    ) -> None:
        self._all_reduce_kind(self._arrays_kind(op, ins[0]), op, ins, outs, timeout, "all_reduce")

    def _arrays_kind_of(self, op: ReduceOp, ins: Sequence[Any], label: str = "") -> Optional[_ArraysKind]:
        """The kind of ``all_reduce_arrays`` call ``ins`` make, or None when they are not
        numpy arrays of one dtype and shape, or, for a large call (which hands them to
        the engine as flat views), not all C-contiguous and aligned. (Small calls reduce
        them with numpy, which takes any layout.) Every test here runs on every call of a
        training loop, so the cheap ones come first."""
        a0 = ins[0]
        if type(a0) is not np.ndarray:
            return None
        dt, shape = a0.dtype, a0.shape
        kind = self._arrays_kind(op, a0, label)
        for a in ins[1:]:
            if type(a) is not np.ndarray or (a.dtype is not dt and a.dtype != dt) or a.shape != shape:
                return None
        if kind.flat is None:
            for a in ins:
                if not (a.flags.c_contiguous and a.flags.aligned):
                    return None
        return kind

    def _all_reduce_kind(
        self,
        kind: _ArraysKind,
        op: ReduceOp,
        ins: Sequence[np.ndarray],
        outs: Sequence[np.ndarray],
        timeout: Optional[float],
        what: str,
        label: str = "",
    ) -> None:
        a0 = ins[0]
        self._what = what
        if kind.flat is not None:
            self._all_reduce_small(kind, op, ins, outs, timeout, what)
        elif kind.work is not None:
            self._all_reduce_packed(
                op, [[a] for a in ins], kind.work, kind.description, timeout, outs=[o.reshape(-1) for o in outs]
            )
        else:
            res = self._all_reduce(op, [[a] for a in ins], "auto", 0, timeout, a0, what, label)
            for o, r in zip(outs, res):
                np.copyto(o, r[0])

    def _all_reduce_small(
        self,
        kind: _ArraysKind,
        op: ReduceOp,
        ins: Sequence[np.ndarray],
        outs: Optional[Sequence[np.ndarray]],
        timeout: Optional[float],
        what: str,
    ) -> Sequence[np.ndarray]:
        """A small call of ``kind`` (``kind.flat`` is set): the local replicas' arrays
        reduced into a flat buffer (data, then the agreement flag: the kind's own, or the
        expected call's persistent request's, on its plan), across the workers in one MPI
        call, then out to every replica: into ``outs``, or new arrays (returned)."""
        self._what = what
        if self._interrupted:
            self._settle(what, timeout)  # before the local reduce writes the kind's buffer
        flat = kind.flat
        assert flat is not None  # small kinds have their flat buffer
        expected = self._expected.get(self._last)
        if expected is not None and expected.signature == kind.sig:
            # The steady state: the expected call again, in one native call on its plan
            # (local reduce, flag, MPI start and test, spread). The same MPI calls as the
            # Python path (``_flagged_call``), so workers on either path pair up. Not the
            # plan's case (another layout): nothing done, and the Python path does it all.
            plan = self._plan_of(expected, kind, op)
            if plan is not None:
                got = plan.arrays(op, list(ins), None if outs is None else list(outs))
                if type(got) is list or got != _NATIVE_NOT_HERE:
                    return self._planned_end(got, expected, plan, op, ins[0], outs, timeout, what, kind.label)
        data = self._small_local_reduce(kind, ins)
        self._reduce_flat(flat, kind.op, kind.description, what, timeout, kind.sig, True)
        return self._small_spread(data, op, len(ins), outs)

    def _plan_of(self, expected: Expected, kind: _ArraysKind, op: ReduceOp) -> Any:
        """The native plan of the expected call (``kind``'s, with ``op``), made at its
        first repeat, on the persistent request of ``expected`` and that request's own
        buffer. None where there is none: no request, MPI_Start and MPI_Test not found, a
        GPU worker, a dtype the plan does not take (it says which, and is not asked again).
        The plan checks the arrays and the op, which with the call's label (kept on
        ``expected``, for ``_planned``) are all a single-array call's signature is made of."""
        plan = expected.plan
        if plan is None:
            plan = False
            buf = expected.buf
            expected.label = kind.label
            if self._native_plans and buf is not None and expected.address:
                assert self._request_calls is not None  # set with _native_plans
                try:
                    plan = _core.WorkerSmallPlan(
                        buf[:-1].reshape(kind.data.shape),
                        buf,
                        op,
                        kind.op,
                        self.num_local,
                        self.num_replicas if op is ReduceOp.MEAN else 0,
                        AGREE[kind.op],
                        expected.address,
                        *self._request_calls,
                        _NATIVE_SPIN,
                    )
                except (ValueError, TypeError):
                    plan = False
            expected.plan = plan
        return plan or None

    def _planned(
        self,
        name: str,
        op: ReduceOp,
        values: Any,
        outs: Any,
        rows: bool,
        timeout: Optional[float],
        what: str,
        label: str = "",
    ) -> Any:
        """The steady state of a small call from the public collective ``name``, before
        any other work: when the expected call has a plan (``_plan_of``), says what this
        one is for (``label``) and ``values`` are its case (``rows``: a list per replica
        holding its one array; else a list of arrays, into the list ``outs`` or new
        arrays), the whole call in one native call.
        None, with nothing done, otherwise. This is ``one_collective``'s bracket around
        the call, inlined: a training loop's small all-reduce repeats it every step, and
        the plan's own checks stand in for the general path's."""
        expected = self._expected.get(self._last)
        if expected is None or self._open is not None or self._interrupted:
            return None
        plan = expected.plan
        if not plan or expected.label != label:
            return None
        self._open = name
        self._what = what
        got = plan.rows(op, values) if rows else plan.arrays(op, values, outs)
        if type(got) is not list:
            if got == _NATIVE_NOT_HERE:
                self._open = None
                return None
            try:
                x0 = values[0][0] if rows else values[0]
                got = self._planned_end(got, expected, plan, op, x0, outs, timeout, what, label)
            except MismatchError:
                self._open = None
                raise
            if rows:
                got = [[o] for o in got]
            self._open = None
            return got
        stats = self.stats
        stats["data_calls"] += 1
        stats["native"] += 1
        self._last = expected.signature
        self._open = None
        return got

    def _planned_end(
        self,
        got: Any,
        expected: Expected,
        plan: Any,
        op: ReduceOp,
        x0: np.ndarray,
        outs: Optional[Sequence[np.ndarray]],
        timeout: Optional[float],
        what: str,
        label: str,
    ) -> Sequence[np.ndarray]:
        """The end of a call that a plan started (``got``: its results, or its code):
        a request still running is waited for here, as the Python path waits, with its
        timeout and Ctrl-C; a raised flag goes to the agreement exchange (``x0``: one
        replica's array, and ``label``, for the call's description). The results, into
        ``outs`` or new arrays."""
        stats = self.stats
        stats["data_calls"] += 1
        stats["native"] += 1
        if type(got) is list:
            self._last = expected.signature
            return got
        flat = expected.buf
        assert flat is not None  # a plan's request has its buffer
        kind = self._arrays_kind(op, x0, label)
        if got == _NATIVE_PENDING:
            self._wait_last(expected.request, flat, kind.op, what, timeout)
        if flat[-1] == AGREE[kind.op]:
            self._last = expected.signature
        else:
            stats["flagged"] += 1
            self._agree_then_reduce(flat, kind.op, kind.sig, kind.description, what, timeout, True)
        return self._small_spread(plan.data, op, self.num_local, outs)

    def _small_local_reduce(self, kind: _ArraysKind, ins: Sequence[np.ndarray]) -> np.ndarray:
        """Step 1 of a small call: the local replicas' arrays reduced into ``kind.data``
        (returned), in the arrays' own shape, with numpy on this thread (see
        ``_reduce_small``)."""
        data = kind.data
        if len(ins) == 1:
            np.copyto(data, ins[0])
        else:
            self._reduce_small(kind.op, ins, data)
        return data

    def _small_spread(
        self, data: np.ndarray, op: ReduceOp, n: int, outs: Optional[Sequence[np.ndarray]]
    ) -> Sequence[np.ndarray]:
        """Step 3 of a small call: the reduced ``data`` out to the ``n`` local replicas,
        into ``outs`` or new arrays (MEAN divides by every worker's replica count)."""
        if outs is None:
            if op is ReduceOp.MEAN:
                return [np.divide(data, self.num_replicas) for _ in range(n)]
            return [data.copy() for _ in range(n)]
        if op is ReduceOp.MEAN:
            for o in outs:
                np.divide(data, self.num_replicas, out=o)
        else:
            for o in outs:
                np.copyto(o, data)
        return outs

    def _arrays_kind(self, op: ReduceOp, a: np.ndarray, label: str = "") -> _ArraysKind:
        """What ``all_reduce_arrays`` remembers of the kind of call ``a`` (one replica's
        array) makes with ``op``: looked up by (op, dtype, shape), and ``label`` where the
        call has one (its own kind: another description), made once."""
        last = self._last_kind
        if not label and last[0] is op and last[1] is a.dtype and last[2] == a.shape and last[3] is not None:
            return last[3]
        key: Tuple[Any, ...] = (op, a.dtype, a.shape, label) if label else (op, a.dtype, a.shape)
        kind = self._arrays.get(key)
        if kind is not None:
            if not label:
                self._last_kind = (op, a.dtype, a.shape, kind)
            return kind
        work: Optional[np.dtype] = work_dtype(a.dtype, op)
        if (
            work != a.dtype
            or not _native_mpi(wire_dtype(a.dtype), _LOCAL_OP[op])
            or _accumulator(a.dtype, op) is not None
            or self.num_workers == 1
            or self._on_gpu
        ):
            work = None
        # Bounded, as the kinds of small calls hold a buffer each: room for a model's
        # variables' labelled updates beside its other calls, so that a step's calls do
        # not clear each other's kinds every step.
        if len(self._arrays) > 1024:
            self._arrays.clear()
        description = _labelled(describe_call("all_reduce", op, a, [a]), label)
        kind = self._arrays[key] = _ArraysKind(description, self._sig(description), _LOCAL_OP[op], work, a, label)
        if not label:
            self._last_kind = (op, a.dtype, a.shape, kind)
        return kind

    def _all_reduce_one_dtype(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], description: str, timeout: Optional[float]
    ) -> List[List[Any]]:
        work = work_dtype(leaves[0][0].dtype, op)
        if _native_mpi(wire_dtype(work), _LOCAL_OP[op]):
            return self._all_reduce_accumulated(op, leaves, work, description, timeout)
        return self._all_reduce_numpy(op, leaves, description, timeout)

    def _all_reduce_accumulated(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], work: np.dtype, description: str, timeout: Optional[float]
    ) -> List[List[Any]]:
        """``_all_reduce_packed`` in ``work``, except that the sums (and means and
        products) of 16-bit floats run in float32 from the local step on, across the
        workers too, and are rounded to their dtype once at the end: in their own dtype a
        worker's partial sum would already be rounded (bfloat16 256 + 1 + 1 gives 256) or
        overflow to inf."""
        acc = _accumulator(work, op)
        if acc is None:
            return self._all_reduce_packed(op, leaves, work, description, timeout)
        out = self._all_reduce_packed(op, leaves, acc, description, timeout)
        with np.errstate(over="ignore"):  # past the dtype's range: inf, as the engine gives
            return [[self.local._copy(x, r, work) for x in row] for r, row in enumerate(out)]

    def _all_reduce_packed(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        work: np.dtype,
        description: str,
        timeout: Optional[float],
        outs: Optional[List[np.ndarray]] = None,
    ) -> List[List[Any]]:
        """Every leaf of one dtype through one worker-level all-reduce: the local replicas'
        leaves are reduced into one flat host buffer (with room for the agreement flag
        when small), MPI reduces it across workers, and every local replica gets its
        results from it. ``outs``: one flat array of the leaves' total size per local
        replica (host replicas), where the results go (nothing is returned then)."""
        n = self.num_local
        shapes = [tuple(a.shape) for a in leaves[0]]
        total = sum(math.prod(s) for s in shapes)
        local_op = _LOCAL_OP[op]
        what = self._what
        if total * work.itemsize <= SMALL_BYTES:
            flat = self._local_reduce(local_op, leaves, work, total, 1)
            self._reduce_flat(flat, local_op, description, what, timeout)
            data = flat[:total]
            self._finish_mean(op, [data])
            if outs is not None:
                for o in outs:
                    np.copyto(o, data)
                return []
            return self._local_spread(data, shapes, n)
        # Large: agree first (one small exchange), then move the data; or, when the
        # memory expects this very call and its data crosses by exchanges that can carry
        # the flag, both at once.
        chunks = self._chunks(total, work.itemsize)
        if len(chunks) > 1:
            description += f" in chunks of {self.chunk_bytes} bytes"
        sig = self._sig(description)
        carried = len(chunks) == 1 and self.carries_agreement(total, work)
        expected = self._expected.get(self._last)
        fast = carried and expected is not None and expected.carried and expected.signature == sig
        if fast:
            done = self._large_attempt(op, leaves, work, shapes, total, chunks, outs, what, timeout, sig, None)
            if done is not None:
                return done
            # Some worker's call is not this one: it made our MPI calls with zeros.
            self.stats["flagged"] += 1
        # The signatures travel while the local replicas' values are reduced.
        agreed = self._agree_large(
            description, sig, total, work, local_op, what, timeout, carried=carried, stand_in=not fast
        )
        done = self._large_attempt(op, leaves, work, shapes, total, chunks, outs, what, timeout, sig, agreed)
        assert done is not None
        return done

    def _large_attempt(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        work: np.dtype,
        shapes: List[Tuple[int, ...]],
        total: int,
        chunks: List[Tuple[int, int]],
        outs: Optional[List[np.ndarray]],
        what: str,
        timeout: Optional[float],
        sig: int,
        agreed: Optional[Callable[[], None]],
    ) -> Optional[List[List[Any]]]:
        """The three steps of a large ``_all_reduce_packed``. ``agreed``: completes the
        signature exchange (call it before data crosses MPI); None: the flag rides the
        one piece's exchanges instead, and the result is None when some worker's flag
        said "not my call" (the outputs then hold nothing of use; the caller's inputs
        are untouched). ``total``: the leaves' elements."""
        n = self.num_local
        local_op = _LOCAL_OP[op]

        def cross(
            buf: np.ndarray,
            send: Optional[np.ndarray] = None,
            local: Optional[List[np.ndarray]] = None,
            outs: Optional[List[np.ndarray]] = None,
        ) -> bool:
            # The one piece across MPI, with or after the agreement (``local``: the local
            # replicas' arrays, reduced inside the exchanges into every one of ``outs``).
            if agreed is not None:
                agreed()
                if local is None:
                    self._mpi_all_reduce(buf, local_op, what, timeout, send=send)
                else:
                    self._carried_all_reduce(buf, local_op, None, None, what, timeout, local, outs)
                return True
            if not self._carried_all_reduce(buf, local_op, send, True, what, timeout, local, outs):
                return False
            self._last = sig
            return True

        if self._on_gpu:
            flat = self._local_reduce(local_op, leaves, work, total, 0)
            if len(chunks) == 1:
                if not cross(flat):
                    return None
            else:
                agreed()  # type: ignore[misc]  # chunked calls never carry the flag
                for lo, hi in chunks:
                    self._mpi_all_reduce(flat[lo:hi], local_op, what, timeout)
            self._finish_mean(op, [flat])
            return self._local_spread(flat, shapes, n)
        given = outs is not None
        res = outs if outs is not None else [new_array((total,), work) for _ in range(n)]
        if len(leaves[0]) == 1:
            # Contiguous and aligned (a copy otherwise): MPI and the engine's kernels take
            # the buffers as they are, and mpi4py cannot send a misaligned one.
            ins = [_aligned(np.asarray(leaves[r][0], dtype=work)).reshape(-1) for r in range(n)]
        else:
            ins = [self.local._pack(list(leaves[r]), work, r) for r in range(n)]
        if n == 1 and len(chunks) == 1:
            # No local steps: MPI reduces from the replica's values straight into its result.
            if not cross(res[0], ins[0]):
                return None
        elif n == 1:
            agreed()  # type: ignore[misc]
            for lo, hi in chunks:
                self._mpi_all_reduce(res[0][lo:hi], local_op, what, timeout, send=ins[0][lo:hi])
        elif len(chunks) == 1 and self._local_on_caller and self.carries_agreement(total, work):
            # The local reduce and broadcast on this thread, inside the exchanges: each
            # input read once, each result written once (Exchanges.all_reduce).
            if not cross(res[0], None, ins, res):
                return None
        elif len(chunks) == 1:
            # Nothing to overlap: the three steps one after the other, on this thread.
            self._reduce_chunk(local_op, ins, res, 0, total)
            if not cross(res[0]):
                return None
            self._broadcast_chunk(res, 0, total)
        else:
            self._pipeline(local_op, ins, res, chunks, what, timeout, agreed)  # type: ignore[arg-type]
        self._finish_mean(op, res)
        if given:
            return []
        return [self.local._unpack(res[r], shapes) for r in range(n)]

    def _chunks(self, count: int, itemsize: int) -> List[Tuple[int, int]]:
        """The pieces of a large buffer that cross MPI one by one (the same on every worker,
        so that every worker's MPI calls match): with several local replicas, the local
        reduce of chunk i+1 overlaps MPI's work on chunk i. One piece when chunk_bytes is 0."""
        if self.chunk_bytes <= 0:
            return [(0, count)]
        step = max(1, self.chunk_bytes // max(1, itemsize))
        return [(lo, min(count, lo + step)) for lo in range(0, count, step)] or [(0, 0)]

    def _reduce_small(self, op: ReduceOp, ins: Sequence[np.ndarray], flat: np.ndarray) -> None:
        """The local replicas' flat values of a small collective reduced into ``flat``
        with numpy, on this thread: at these sizes waking the engine's threads costs more
        than the arithmetic (measured, 2 replicas of 1 KiB: tens of microseconds against
        one)."""
        fn = NUMPY_OPS[op]
        fn(ins[0], ins[1], out=flat)
        for x in ins[2:]:
            fn(flat, x, out=flat)

    def _reduce_chunk(self, op: ReduceOp, ins: List[np.ndarray], outs: List[np.ndarray], lo: int, hi: int) -> None:
        """Step 1 for elements lo:hi: the local replicas' values reduced into ``outs[0]``
        (the buffer MPI then works on), straight from their arrays: each input read once,
        only ``outs[0]`` written (the other results are written by step 3)."""
        if self._numpy_pair_reduce:
            NUMPY_OPS[op](ins[0][lo:hi], ins[1][lo:hi], out=outs[0][lo:hi])
        elif engine_supports(outs[0].dtype):
            group: ReplicaGroup = self.local.group  # type: ignore[assignment]  # several local replicas
            group.reduce([x[lo:hi] for x in ins], 0, op.engine_name, out=outs[0][lo:hi])
        else:
            np.copyto(outs[0][lo:hi], numpy_reduce(np.stack([x[lo:hi] for x in ins]), op, outs[0].dtype))

    def _broadcast_chunk(self, outs: List[np.ndarray], lo: int, hi: int) -> None:
        """Step 3 for elements lo:hi: ``outs[0]``'s values copied to the other replicas'.
        One copy goes on this thread: the engine would hand it to one of its workers, a
        wake-up for the same bytes (2x2 workers, 1 MiB: 393-401 against 416-422 µs)."""
        if len(outs) > 2 and engine_supports(outs[0].dtype):
            group: ReplicaGroup = self.local.group  # type: ignore[assignment]  # several local replicas
            group.broadcast([o[lo:hi] for o in outs], root=0)
        else:
            for o in outs[1:]:
                np.copyto(o[lo:hi], outs[0][lo:hi])

    def _pipeline(
        self,
        op: ReduceOp,
        ins: List[np.ndarray],
        outs: List[np.ndarray],
        chunks: List[Tuple[int, int]],
        what: str,
        timeout: Optional[float],
        agreed: Callable[[], None],
    ) -> None:
        """The three steps on host memory, chunk by chunk, so that they overlap: while MPI
        carries chunk i (blocking calls on the MPI thread), the engine reduces chunk i+1
        into the buffer MPI sends (replica 0's result); chunk i is broadcast from it to
        the other local replicas while MPI carries chunk i+1."""
        t, deadline = self._deadline(timeout)
        flat = outs[0]
        jobs: List[Optional[MpiJob]] = []
        wire_ok = wire_dtype(flat.dtype) == flat.dtype
        # Steps 1 and 2: reduce chunk i locally into the MPI buffer, hand it to MPI (once
        # the workers agree: ``agreed()`` after the first chunk's local reduce).
        for lo, hi in chunks:
            self._reduce_chunk(op, ins, outs, lo, hi)
            if lo == 0:
                agreed()
            if wire_ok:
                self.stats["data_calls"] += 1
                jobs.append(self._submit(flat[lo:hi], op, None))
            else:
                # float16/bfloat16 cross as float32, synchronously.
                self._mpi_all_reduce(flat[lo:hi], op, what, timeout)
                jobs.append(None)
        # Step 3: as each chunk comes back, the other local replicas get a copy of it.
        for (lo, hi), job in zip(chunks, jobs):
            if job is not None:
                self._complete(job, what, t, deadline)
            self._broadcast_chunk(outs, lo, hi)

    def _finish_mean(self, op: ReduceOp, bufs: Sequence[np.ndarray]) -> None:
        if op is ReduceOp.MEAN:
            for b in bufs:
                b /= self.num_replicas

    def _local_reduce(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], work: np.dtype, total: int, extra: int
    ) -> np.ndarray:
        """This worker's replicas' leaves (``total`` elements each) reduced with ``op`` into
        one new flat host buffer, with ``extra`` more elements after the data (host
        replicas: small collectives only; large ones go by _reduce_chunk)."""
        size = total + extra
        n = self.num_local
        if self._on_gpu:
            # On the GPUs, then one copy down to the host buffer MPI works on.
            packs = [self.local._pack(list(leaves[r]), work, r) for r in range(n)]
            red = self.local.reduce(op, packs) if n > 1 else packs[0]
            flat = np.empty(size, dtype=work)
            flat[: red.size] = devices.to_host(red).reshape(-1)
            return flat
        flat = new_array((size,), work)
        data = flat[:total]
        if n == 1:
            o = 0
            for a in leaves[0]:
                np.copyto(data[o : o + a.size], np.ravel(a), casting="unsafe")
                o += a.size
            return flat
        if len(leaves[0]) == 1:
            ins = [np.ascontiguousarray(np.asarray(leaves[r][0], dtype=work)).reshape(-1) for r in range(n)]
        else:
            ins = [self.local._pack(list(leaves[r]), work, r) for r in range(n)]
        self._reduce_small(op, ins, data)
        return flat

    def _local_spread(self, data: np.ndarray, shapes: List[Tuple[int, ...]], n: int) -> List[List[Any]]:
        """Every local replica's results from the worker's reduced buffer: replica 0's are
        views of it, the others' a broadcast copy (on their GPU for GPU replicas)."""
        rows: List[Any] = [data]
        if self._on_gpu:
            dev = [self.local._copy(data, r) for r in range(n)]
            rows = dev
        elif n > 1:
            # Small (large host buffers go by _broadcast_chunk): copies on this thread.
            rows = [data] + [data.copy() for _ in range(n - 1)]
        return [self.local._unpack(rows[r], shapes) for r in range(n)]

    def _all_reduce_numpy(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], description: str, timeout: Optional[float]
    ) -> List[List[Any]]:
        """Dtypes MPI cannot reduce: every worker's local parts gathered, reduced with numpy
        in global replica order on every worker."""
        n = self.num_local
        hosts = [np.ascontiguousarray(devices.to_host(leaves[r][0])) for r in range(n)]
        gathered = self._gather_rows(np.stack(hosts), description, "all_reduce", timeout)
        # A 0-d value stays 0-d (np.ascontiguousarray made it 1-d above).
        result = numpy_reduce(gathered, op, hosts[0].dtype).reshape(np.shape(leaves[0][0]))
        return [[self.local._copy(result, r) if r else self.local._place_host(result, 0)] for r in range(n)]

    # ---- gathers and broadcasts ---------------------------------------------------------------------
    def _gather_rows(
        self, local: np.ndarray, description: str, what: str, timeout: Optional[float], axis_sizes: Optional[int] = None
    ) -> np.ndarray:
        """Every worker's ``local`` (of one dtype; sizes may differ along axis 0)
        concatenated along axis 0 in worker order."""
        self._sync_point(description, what, timeout)
        row = int(np.prod(local.shape[1:], dtype=np.int64)) * local.itemsize
        sizes = np.empty(self.num_workers, dtype=np.int64)
        mine = np.array([local.shape[0]], dtype=np.int64)
        self._wait(self._comm.Iallgather(mine, sizes), what, timeout, (mine, sizes))
        out = np.empty((int(sizes.sum()),) + local.shape[1:], dtype=local.dtype)
        counts = [int(s) * row for s in sizes]
        displs = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
        raw = np.ascontiguousarray(local).reshape(-1).view(np.uint8)
        self._wait(
            self._comm.Iallgatherv(
                [raw, self._MPI.BYTE], [out.reshape(-1).view(np.uint8), counts, displs, self._MPI.BYTE]
            ),
            what,
            timeout,
            (raw, out),
        )
        return out

    @one_collective
    def all_gather(
        self,
        leaves: Sequence[Sequence[Any]],
        axes: Sequence[int],
        *,
        timeout: Optional[float] = None,
        value: Any = None,
    ) -> List[List[Any]]:
        if self.num_workers == 1:
            return self.local.all_gather(leaves, axes, timeout=timeout)
        n = self.num_local
        count = len(leaves[0])
        out: List[List[Any]] = [[None] * count for _ in range(n)]
        # Each leaf's call names its place in the whole structure, so that workers that
        # pass different keys, nestings or numbers of leaves disagree at the first leaf.
        where = self._leaf_places(value, count)
        if not count:
            self._sync_point(f"all_gather of {where[0]}", "all_gather", timeout)
        for i in range(count):
            parts = [devices.to_host(leaves[r][i]) for r in range(n)]
            # The rank as passed: a 0-d value (gathered as one element) and a 1-element
            # vector are different calls, as within one process.
            rank = parts[0].ndim
            parts = [p.reshape(1) if p.ndim == 0 else p for p in parts]
            ax = axes[i]
            moved = np.concatenate([np.moveaxis(p, ax, 0) for p in parts], axis=0)
            a = parts[0]
            shape_rest = tuple(d for k, d in enumerate(a.shape) if k != ax)
            desc = (
                f"all_gather(axis={ax}) {where[i]} of dtype {dtype_text(a.dtype)} rank {rank} shape (*, {shape_rest})"
            )
            full = self._gather_rows(moved, desc, "all_gather", timeout)
            result = np.moveaxis(full, 0, ax) if ax else full
            for r in range(n):
                out[r][i] = (
                    self.local._copy(result, r) if r else self.local._place_host(np.ascontiguousarray(result), 0)
                )
        return out

    @one_collective
    def broadcast(
        self,
        leaves: Sequence[Sequence[Any]],
        root: int,
        *,
        timeout: Optional[float] = None,
        value: Any = None,
        label: str = "",
    ) -> List[List[Any]]:
        if self.num_workers == 1:
            return self.local.broadcast(leaves, root, timeout=timeout)
        if not 0 <= root < self.num_replicas:
            raise ValueError(f"broadcast: root {root} is not a replica (there are {self.num_replicas})")
        w_root = int(np.searchsorted(self.offsets, root, side="right")) - 1
        n = self.num_local
        count = len(leaves[0])
        out: List[List[Any]] = [[None] * count for _ in range(n)]
        where = self._leaf_places(value, count)  # as in all_gather
        if not count:
            self._sync_point(_labelled(f"broadcast(root={root}) of {where[0]}", label), "broadcast", timeout)
        for i in range(count):
            mine = leaves[root - self.offset][i] if self.rank == w_root else leaves[0][i]
            host = np.array(devices.to_host(mine), order="C", copy=True)
            desc = _labelled(
                f"broadcast(root={root}) {where[i]} of dtype {dtype_text(host.dtype)} shape {host.shape}", label
            )
            self._sync_point(desc, "broadcast", timeout)
            if host.size:
                self._wait(
                    self._comm.Ibcast([host.reshape(-1).view(np.uint8), self._MPI.BYTE], root=w_root),
                    "broadcast",
                    timeout,
                    host,
                )
            for r in range(n):
                out[r][i] = self.local._copy(host, r) if r else self.local._place_host(host, 0)
        return out

    @staticmethod
    def _leaf_places(value: Any, count: int) -> List[str]:
        """How the calls of a leaf-by-leaf collective name each of its ``count`` leaves:
        the leaf's path and number, and for the first the structure ``value`` itself
        (once the first calls agree, so do the structures; for no leaves: the structure
        alone)."""
        if value is None or not nest.is_nested(value):
            return [f"leaf {i} of {count}" for i in range(count)] or ["no leaves"]
        structure = describe_structure(value)
        paths = nest.paths(value)
        if len(paths) != count:  # not the structure of these leaves: say what is known
            paths = [str(i) for i in range(count)]
        places = [f"leaf {p} ({i + 1} of {count})" for i, p in enumerate(paths)]
        if not places:
            return [structure]
        places[0] += f" of {structure}"
        return places

    @one_collective
    def agree_structure(self, what: str, value: Any, timeout: Optional[float] = None) -> None:
        """Before a structure's leaves go through collectives one by one: every worker
        passes the same nesting, keys and number of leaves (the leaves' own calls check
        their dtypes and shapes), or every worker gets a ``MismatchError``."""
        if self.num_workers == 1:
            return
        paths = ", ".join(nest.paths(value))
        self._sync_point(f"{what} of {describe_structure(value)} with leaves at [{paths}]", what, timeout)

    # ---- cross-replica ---------------------------------------------------------------------------------
    @one_collective
    def reduce(self, op: ReduceOp, parts: Sequence[Any], *, timeout: Optional[float] = None, label: str = "") -> Any:
        if self.num_workers == 1:
            return self.local.reduce(op, parts, timeout=timeout)
        res = self._all_reduce(op, [[p] for p in parts], "auto", 0, timeout, parts[0], "reduce", label)
        return res[0][0]

    @one_collective
    def gather(self, parts: Sequence[Any], axis: int, *, timeout: Optional[float] = None, label: str = "") -> Any:
        local = self.local.gather(parts, axis, timeout=timeout)
        if self.num_workers == 1:
            return local
        host = devices.to_host(local)
        moved = np.ascontiguousarray(np.moveaxis(host, axis, 0))
        rest = tuple(d for k, d in enumerate(host.shape) if k != axis)
        description = f"gather(axis={axis}) of dtype {dtype_text(host.dtype)} shape (*, {rest})"
        full = self._gather_rows(moved, _labelled(description, label), "gather", timeout)
        result = np.moveaxis(full, 0, axis) if axis else full
        return self.local._place_host(np.ascontiguousarray(result), 0)

    @one_collective
    def total(self, count: int, *, timeout: Optional[float] = None) -> int:
        if self.num_workers == 1:
            return int(count)
        self._sync_point("total(count)", "reduce", timeout)
        buf = np.array([count], dtype=np.int64)
        self._wait(self._comm.Iallreduce(self._MPI.IN_PLACE, buf, self._MPI.SUM), "reduce", timeout, buf)
        return int(buf[0])

    @one_collective
    def broadcast_from_chief(
        self, value: np.ndarray, what: str, timeout: Optional[float] = None, label: str = ""
    ) -> np.ndarray:
        """Worker 0's ``value`` on every worker (every worker passes one of the same dtype
        and shape: MismatchError on all of them otherwise)."""
        if self.num_workers == 1:
            return value
        description = f"{label or what}: value of dtype {dtype_text(value.dtype)} shape {value.shape}"
        self._sync_point(description, what, timeout)
        out = np.array(value, order="C", copy=True)
        if out.size:
            self._wait(self._comm.Ibcast([out.reshape(-1).view(np.uint8), self._MPI.BYTE], root=0), what, timeout, out)
        return out

    @one_collective
    def chief_flag(self, ok: bool, what: str, timeout: Optional[float] = None) -> bool:
        """Worker 0's ``ok`` on every worker."""
        if self.num_workers == 1:
            return ok
        self._sync_point(f"{what}: chief flag", what, timeout)
        flag = np.array([int(bool(ok))], dtype=np.int64)
        self._wait(self._comm.Ibcast(flag, root=0), what, timeout, flag)
        return bool(flag[0])

    # ---- a collective that failed, or moved nothing, on this worker alone ----------------------
    def mpi_calls(self) -> int:
        """How many MPI calls this worker's collectives have made so far."""
        stats = self.stats
        return stats["data_calls"] + stats["exchanges"] + stats["flagged"]

    @one_collective
    def sync_point(self, description: str, what: str, timeout: Optional[float] = None) -> None:
        """An agreement step of its own for a collective that moved nothing between the
        workers here (``description`` says what it was): a worker whose call there
        differs gets a MismatchError, as this one does."""
        self._sync_point(description, what, timeout)

    def fail_together(self, what: str, error: BaseException, timeout: Optional[float] = None) -> None:
        """This worker's collective failed before its first MPI call (an argument, a shape
        its replicas disagree on), while the other workers may be making it: their
        collective starts with an agreement step, and skipping it here would pair their
        call with this worker's next one (the same description: a wrong result, no error).
        So this worker takes part in that step with a description no call has: the
        collective fails on every worker (a MismatchError naming this error there), and
        every worker's call sequence stays the same. The caller then raises its error."""
        text = f"{type(error).__name__}: {error}"
        if len(text) > 300:
            text = text[:300] + "..."
        description = f"nothing (its {what} failed before it communicated: {text})"
        # The failed collective made no MPI call: this step is the one the others wait
        # in, so the worker is in step again once it completes (see one_collective).
        self._open = "fail_together"
        self._stand_in(what, timeout)
        try:
            self._exchange(self._sig(description), description, what, timeout)
        except MismatchError:
            pass  # the others' collective, or their own failures: theirs is raised there
        self._open = None

    def close(self) -> None:
        self._free_persistent()
        self._mpi_thread.close()
        self.local.close()

    def __repr__(self) -> str:
        return (
            f"HierarchicalCollectives(worker={self.rank}, num_workers={self.num_workers}, "
            f"local_counts={list(self.local_counts)})"
        )
