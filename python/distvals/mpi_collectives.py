"""Collectives across MPI processes ("workers"), each holding local replicas on the engine.

A worker is one MPI process; its replicas are threads that meet in the C++ engine.
Every collective is hierarchical, so that only one buffer per worker crosses MPI::

    worker 0: replica 0  replica 1        worker 1: replica 2  replica 3
                  \\        /                           \\        /
    step 1:      engine reduce  ------------------->  engine reduce      (to local replica 0)
                      |                                    |
    step 2:      MPI Allreduce   <===================>  MPI Allreduce    (local roots only)
                      |                                    |
    step 3:      engine broadcast                      engine broadcast  (from local replica 0)

Large buffers go in chunks: while MPI carries chunk i (a blocking MPI_Allreduce on a
thread of its own), the engine already reduces chunk i+1, and chunk i is broadcast
locally while MPI still carries chunk i+1. Inside ``strategy.run`` the replica threads
of a worker first meet, and local replica 0 runs that pipeline over all their buffers.

Before the data, the local roots exchange a small header (which collective, dtype,
size, op, chunk size), so workers that pass different things get a clear error on every
worker instead of a corrupt result. Small messages are nonblocking MPI calls polled
against the strategy's timeout; the calling thread waits for the MPI thread's calls
against the same deadline. A wait that runs out (a worker never arrived) cannot be
cancelled in MPI, so the job is aborted with a message naming this worker.

One collective finishes before the next starts, and the chunks of one go through one
thread in order, so the calls reach MPI in the same order on every worker.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ._core import AbortedError, MismatchError
from .cross_device import _numpy_reduce
from .mpi_runtime import WAIT_SLICE, MpiJob, LocalMeeting, MpiThread, poll
from .reduce_op import ReduceOp

__all__ = ["HierarchicalCollectives", "DEFAULT_CHUNK_BYTES", "BLOCKING_MIN_BYTES", "mpi_op_name"]

#: Chunk size of the pipelined hierarchical all-reduce.
DEFAULT_CHUNK_BYTES = 4 << 20

_monotonic = time.monotonic
#: Buffers of at least this many bytes are all-reduced by blocking MPI calls on the MPI
#: thread; smaller ones by a nonblocking call that the calling thread polls.
BLOCKING_MIN_BYTES = 64 << 10

# Header kinds: which collective a worker is in.
_ALL_REDUCE, _ALL_GATHER, _BROADCAST, _GATHER, _VALUE, _FLAG = 1, 2, 3, 4, 5, 6
_KIND_NAMES = {_ALL_REDUCE: "all-reduce", _ALL_GATHER: "all-gather", _BROADCAST: "broadcast",
               _GATHER: "gather", _VALUE: "variable creation", _FLAG: "checkpoint"}
_OP_CODES = {"sum": 1, "mean": 2, "min": 3, "max": 4, "prod": 5}
_OP_NAMES = {v: k for k, v in _OP_CODES.items()}
_ENGINE_OPS = {ReduceOp.SUM: "sum", ReduceOp.MEAN: "mean", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
               ReduceOp.PRODUCT: "prod"}
_BY_NAME = {"sum": ReduceOp.SUM, "mean": ReduceOp.MEAN, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
            "prod": ReduceOp.PRODUCT, "product": ReduceOp.PRODUCT}
# Shapes in headers: rank, then up to this many dimensions.
_MAX_RANK = 32
_F32 = np.dtype(np.float32)


def mpi_op_name(op: Any) -> str:
    """The canonical name ("sum", "mean", "min", "max", "prod") of an op given as a
    ReduceOp or an engine name in any case."""
    if isinstance(op, ReduceOp):
        return _ENGINE_OPS[op]
    if isinstance(op, str):
        found = _BY_NAME.get(op.strip().lower())
        if found is not None:
            return _ENGINE_OPS[found]
    raise ValueError(f"unknown reduce op {op!r}; expected sum, mean, min, max or prod (any case)")


def _dtype_code(dtype: np.dtype) -> int:
    # dtype.num is not stable for dtypes registered at run time (bfloat16), the name is.
    return zlib.crc32(f"{dtype.name}/{dtype.str}".encode())


def _native_mpi(dtype: np.dtype, op: str) -> bool:
    """True when MPI reduces ``dtype`` with ``op`` itself (mpi4py maps it to an MPI type)."""
    if not dtype.isnative:
        return False
    if dtype.kind == "f":
        return dtype.itemsize in (4, 8)
    if dtype.kind in "iu":
        return dtype.itemsize in (1, 2, 4, 8)
    if dtype.kind == "c":
        return dtype.itemsize in (8, 16) and op in ("sum", "mean", "prod")
    return False


def _via_float32(dtype: np.dtype) -> bool:
    """float16 and bfloat16 cross MPI as float32 (MPI has no reduction for them)."""
    return dtype.name in ("float16", "bfloat16")


def _contiguous(a: Any) -> np.ndarray:
    # Unlike numpy.ascontiguousarray, keeps 0-d arrays 0-d.
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


class HierarchicalCollectives:
    """Collectives over every replica of every worker: the engine inside a worker, MPI
    between workers.

    ``local``: this worker's engine group (a ReplicaGroup; None for one replica).
    ``comm``: the workers' communicator (the strategy passes its own duplicate).
    ``local_counts``: the number of replicas of every worker, in rank order.

    The per-replica methods (``replica_all_reduce``, ``replica_all_gather``,
    ``replica_broadcast``) take the local replica index and match the engine group's, so
    the packing code of ``distvals.cross_device`` runs on top of them unchanged; replica
    ids given as roots are global. The ``*_workers`` methods combine one value per worker
    and are called by one thread per worker (cross-replica context).
    """

    def __init__(self, local: Any, comm: Any, local_counts: Sequence[int], timeout: float, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_fatal: Optional[Callable[[str], None]] = None) -> None:
        self._local = local
        self._comm = comm
        self.rank = comm.Get_rank()
        self.num_workers = comm.Get_size()
        self.local_counts = tuple(int(c) for c in local_counts)
        self.n_local = self.local_counts[self.rank]
        self.offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.local_counts)[:-1]]))
        self.offset = self.offsets[self.rank]
        self.total = int(sum(self.local_counts))
        self.timeout = float(timeout)
        self.chunk_bytes = max(1, int(chunk_bytes))
        self._mpi_thread = MpiThread()
        self._meeting = LocalMeeting(self.n_local)
        self._on_fatal = on_fatal
        from mpi4py import MPI

        self._MPI = MPI
        self._ops = {"sum": MPI.SUM, "mean": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}

    # ---- waiting -------------------------------------------------------------------------
    def _deadline(self, timeout: Optional[float]) -> Tuple[float, float]:
        t = self.timeout if timeout is None else float(timeout)
        return t, _monotonic() + t

    def _wait(self, req: Any, what: str, timeout: Optional[float] = None) -> None:
        """Polls ``req`` until it completes; past the timeout the job is aborted."""
        t, deadline = self._deadline(timeout)
        if not poll(req, deadline, lambda: self._stop_if_aborted(what)):
            self._timed_out(what, t)

    def _stop_if_aborted(self, what: str) -> None:
        # A local replica failed: the step is lost (and the job will be aborted), so stop
        # waiting for the other workers.
        if self._local is not None and self._local.aborted:
            raise AbortedError(f"worker {self.rank}: {what} released because a local replica failed")

    def _timed_out(self, what: str, timeout: float) -> None:
        msg = (f"worker {self.rank}: {what} waited {timeout:g} s for the other workers, which did not "
               "all arrive; an MPI collective cannot be cancelled, so the job must end (the timeout is "
               "CommunicationOptions.timeout_seconds)")
        if self._on_fatal is not None:
            self._on_fatal(msg)
        from ._core import CollectiveTimeoutError

        raise CollectiveTimeoutError(msg)

    # ---- agreement on what is exchanged ------------------------------------------------------
    def _agree(self, kind: int, what: str, fields: Sequence[int], timeout: Optional[float] = None,
               compare: Optional[Sequence[int]] = None) -> np.ndarray:
        """Every worker's header row (kind, then ``fields``); MismatchError on every worker
        when the positions in ``compare`` (default: all) differ from worker 0's."""
        mine = np.array([kind, *fields], dtype=np.int64)
        table = np.empty((self.num_workers, mine.size), dtype=np.int64)
        self._wait(self._comm.Iallgather(mine, table), what, timeout)
        cols = slice(None) if compare is None else [0] + [1 + c for c in compare]
        ref = table[0, cols]
        bad = [w for w in range(1, self.num_workers) if not np.array_equal(table[w, cols], ref)]
        if bad:
            w = bad[0]
            if table[w, 0] != table[0, 0]:
                why = (f"worker {w} is in a {_KIND_NAMES.get(int(table[w, 0]), '?')} while worker 0 is in a "
                       f"{_KIND_NAMES.get(int(table[0, 0]), '?')}")
            else:
                why = f"worker {w} passes {self._describe(kind, table[w])}, worker 0 passes {self._describe(kind, table[0])}"
            raise MismatchError(
                f"{what}: worker {self.rank}: the workers disagree ({why}; worker(s) "
                f"{', '.join(map(str, bad))} differ from worker 0); every worker must make the same "
                "collective calls, in the same order, with values of the same dtype and shape"
            )
        return table

    @staticmethod
    def _describe(kind: int, row: np.ndarray) -> str:
        if kind in (_ALL_REDUCE,):
            chunks = f" in chunks of {int(row[4])} bytes" if row[4] else ""
            return f"{int(row[2])} bytes (dtype code {int(row[1])}) with op {_OP_NAMES.get(int(row[3]), '?')}{chunks}"
        if kind in (_VALUE, _GATHER, _ALL_GATHER):
            nd = int(row[2])
            return f"shape {tuple(int(d) for d in row[3: 3 + nd])} (dtype code {int(row[1])})"
        if kind == _BROADCAST:
            return f"{int(row[2])} bytes (dtype code {int(row[1])}) from root {int(row[3])}"
        return str(row.tolist())

    @staticmethod
    def _shape_fields(a: np.ndarray, what: str) -> List[int]:
        if a.ndim > _MAX_RANK:
            raise ValueError(f"{what}: rank {a.ndim} is above the supported {_MAX_RANK}")
        return [_dtype_code(a.dtype), a.ndim, *a.shape, *([-1] * (_MAX_RANK - a.ndim))]

    # ---- MPI all-reduce of buffers (local roots) ----------------------------------------------
    def _start(self, view: np.ndarray, op: str, blocking: bool) -> MpiJob:
        """Starts the all-reduce of ``view`` between the workers."""
        buf = view.astype(_F32) if _via_float32(view.dtype) else view
        job = MpiJob(buf, view if buf is not view else None)
        mpi_op = self._ops[op]
        in_place = self._MPI.IN_PLACE
        if blocking:
            comm = self._comm
            self._mpi_thread.submit(job, lambda: comm.Allreduce(in_place, buf, mpi_op))
        else:
            job.req = self._comm.Iallreduce(in_place, buf, mpi_op)
        return job

    def _complete(self, job: MpiJob, what: str, timeout: float, deadline: float) -> None:
        """Waits for ``job`` (at most until ``deadline``), then copies a float32 stand-in back."""
        if job.req is not None:
            if not poll(job.req, deadline, lambda: self._stop_if_aborted(what)):
                self._timed_out(what, timeout)
        else:
            while not job.done.wait(WAIT_SLICE):
                self._stop_if_aborted(what)
                if _monotonic() > deadline:
                    self._timed_out(what, timeout)
            if job.error is not None:
                # The MPI library reported an error: its state is unknown, the job ends.
                msg = f"worker {self.rank}: {what}: MPI failed: {job.error}"
                if self._on_fatal is not None:
                    self._on_fatal(msg)
                raise RuntimeError(msg) from job.error
        if job.target is not None:
            job.target[...] = job.buf.astype(job.target.dtype)

    def _chunks(self, count: int, itemsize: int) -> List[Tuple[int, int]]:
        step = max(1, self.chunk_bytes // max(1, itemsize))
        return [(lo, min(count, lo + step)) for lo in range(0, count, step)] or [(0, 0)]

    def _hierarchical(self, flat: np.ndarray, op: str, what: str, timeout: float, deadline: float,
                      reduce_chunk: Optional[Callable[[int, int], None]],
                      broadcast_chunk: Optional[Callable[[int, int], None]]) -> None:
        """The three steps, chunk by chunk, on the calling thread (the local root). ``flat``
        is the local root's buffer; the callbacks run this worker's engine reduce and
        broadcast of elements lo:hi (None with one local replica, which still makes the
        same MPI calls as the others)."""
        chunks = self._chunks(flat.size, flat.itemsize)
        # Decided by the size alone, so every worker makes the same kind of calls.
        blocking = flat.nbytes >= BLOCKING_MIN_BYTES
        jobs: List[MpiJob] = []
        # Steps 1 and 2 overlap: chunk i travels between the workers (on the MPI
        # thread) while the engine reduces chunk i+1.
        for lo, hi in chunks:
            if reduce_chunk is not None:
                reduce_chunk(lo, hi)
            jobs.append(self._start(flat[lo:hi], op, blocking))
        # Step 3 overlaps step 2: chunk i is broadcast locally while MPI carries chunk i+1.
        for i, (lo, hi) in enumerate(chunks):
            self._complete(jobs[i], what, timeout, deadline)
            if broadcast_chunk is not None:
                broadcast_chunk(lo, hi)

    # ---- per-replica style (inside strategy.run) -----------------------------------------------
    def replica_all_reduce(self, replica: int, array: np.ndarray, op: str = "sum", algorithm: str = "auto",
                           timeout_seconds: Optional[float] = None, out: Optional[np.ndarray] = None) -> None:
        """All-reduce ``array`` in place (or into ``out``) over every replica of every worker
        (``replica`` is the local index; every local replica calls this from its own thread)."""
        local = self._local
        if self.num_workers == 1:
            local.replica_all_reduce(replica, array, op, algorithm, timeout_seconds, out=out)
            return
        if out is not None:
            # The pipeline below works in place: start from a copy of the input.
            np.copyto(out, array)
            array = out
        name = mpi_op_name(op)
        if name == "mean" and array.dtype.kind not in "fc" and array.dtype.name != "bfloat16":
            raise TypeError(f"replica {self.offset + replica}: mean all-reduce needs a floating dtype, got {array.dtype}")
        if not array.flags.c_contiguous:
            raise ValueError(f"replica {self.offset + replica}: the array must be C-contiguous")
        if self.n_local == 1:
            self.all_reduce([array], name, timeout_seconds=timeout_seconds)
            return
        timeout, deadline = self._deadline(timeout_seconds)

        def check(missing: List[int]) -> None:
            if self._local.aborted:
                raise AbortedError(f"replica {self.offset + replica}: all_reduce released because a local "
                                   "replica failed")
            if _monotonic() > deadline:
                from ._core import CollectiveTimeoutError

                raise CollectiveTimeoutError(
                    f"replica {self.offset + replica}: all_reduce waited {timeout:g} s for local replica(s) "
                    f"{', '.join(str(self.offset + r) for r in missing)}")

        self._meeting.run(replica, array,
                          lambda bufs: self.all_reduce(bufs, name, timeout_seconds=timeout_seconds), check)

    def replica_all_gather(self, replica: int, array: np.ndarray, timeout_seconds: Optional[float] = None) -> np.ndarray:
        """Every replica's ``array`` (all of one shape) concatenated along axis 0 in global
        replica order (0-d arrays give a vector); a new array per replica."""
        local = self._local
        if self.num_workers == 1:
            return local.replica_all_gather(replica, array, timeout_seconds)
        a = _contiguous(array)
        what = "all_gather"
        timeout, _ = self._deadline(timeout_seconds)
        n = self.n_local
        if n > 1:
            mine = local.replica_all_gather(replica, a, timeout_seconds)
        else:
            mine = a.reshape(1) if a.ndim == 0 else a
        shape = (self.total,) if a.ndim == 0 else (self.total * a.shape[0],) + a.shape[1:]
        out = np.empty(shape, dtype=a.dtype)
        if replica == 0:
            self._agree(_ALL_GATHER, what, self._shape_fields(a, what), timeout)
            counts = [c * a.nbytes for c in self.local_counts]
            displs = [o * a.nbytes for o in self.offsets]
            req = self._comm.Iallgatherv([_as_bytes(_contiguous(mine)), self._MPI.BYTE],
                                         [_as_bytes(out), counts, displs, self._MPI.BYTE])
            self._wait(req, what, timeout)
        if n > 1 and out.size:
            local.replica_broadcast(replica, _as_bytes(out), root=0, timeout_seconds=timeout_seconds)
        return out

    def replica_broadcast(self, replica: int, array: np.ndarray, root: int = 0,
                          timeout_seconds: Optional[float] = None) -> None:
        """Global replica ``root``'s ``array`` into every replica's ``array`` (in place)."""
        local = self._local
        if self.num_workers == 1:
            local.replica_broadcast(replica, array, root=root, timeout_seconds=timeout_seconds)
            return
        if not 0 <= root < self.total:
            raise ValueError(f"broadcast: root {root} is not a replica (there are {self.total})")
        if not array.flags.c_contiguous:
            raise ValueError(f"replica {self.offset + replica}: the array must be C-contiguous")
        what = "broadcast"
        timeout, _ = self._deadline(timeout_seconds)
        w_root = int(np.searchsorted(self.offsets, root, side="right")) - 1
        raw = _as_bytes(array)
        n = self.n_local
        if replica == 0:
            self._agree(_BROADCAST, what, [_dtype_code(array.dtype), array.nbytes, root], timeout)
        if self.rank == w_root and n > 1 and raw.size:
            local.replica_broadcast(replica, raw, root=root - self.offset, timeout_seconds=timeout_seconds)
        if replica == 0 and raw.size:
            self._wait(self._comm.Ibcast([raw, self._MPI.BYTE], root=w_root), what, timeout)
        if self.rank != w_root and n > 1 and raw.size:
            local.replica_broadcast(replica, raw, root=0, timeout_seconds=timeout_seconds)

    # ---- single-call style: one thread holds every local buffer ------------------------------------
    def all_reduce(self, buffers: Sequence[np.ndarray], op: str = "sum", algorithm: str = "auto",
                   timeout_seconds: Optional[float] = None) -> None:
        """All-reduce this worker's local ``buffers`` (one per local replica, C-contiguous,
        one shape and dtype) in place with every other worker's."""
        local = self._local
        n = self.n_local
        if len(buffers) != n:
            raise ValueError(f"all_reduce: {len(buffers)} buffers for {n} local replicas")
        if self.num_workers == 1:
            if n > 1:
                local.all_reduce(list(buffers), op=op, algorithm=algorithm)
            return
        name = mpi_op_name(op)
        a0 = buffers[0]
        for r, b in enumerate(buffers):
            if b.dtype != a0.dtype or b.shape != a0.shape or not b.flags.c_contiguous:
                raise ValueError(f"all_reduce: replica {self.offset + r}: every buffer needs replica "
                                 f"{self.offset}'s dtype {a0.dtype} and shape {a0.shape}, C-contiguous")
        if name == "mean" and a0.dtype.kind not in "fc" and a0.dtype.name != "bfloat16":
            raise TypeError(f"all_reduce: mean needs a floating dtype, got {a0.dtype}")
        what = "all_reduce"
        timeout, deadline = self._deadline(timeout_seconds)
        self._agree(_ALL_REDUCE, what, [_dtype_code(a0.dtype), a0.nbytes, _OP_CODES[name], self.chunk_bytes], timeout)
        local_op = "sum" if name == "mean" else name
        flats = [b.reshape(-1) for b in buffers]
        if flats[0].size:
            if n == 1:
                self._hierarchical(flats[0], local_op, what, timeout, deadline, None, None)
            else:
                def reduce_chunk(lo: int, hi: int) -> None:
                    local.reduce([f[lo:hi] for f in flats], root=0, op=local_op)

                def broadcast_chunk(lo: int, hi: int) -> None:
                    local.broadcast([f[lo:hi] for f in flats], root=0)

                self._hierarchical(flats[0], local_op, what, timeout, deadline, reduce_chunk, broadcast_chunk)
        if name == "mean":
            for b in buffers:
                b /= b.dtype.type(self.total)

    # ---- one value per worker (cross-replica context) -------------------------------------------------
    def all_reduce_workers(self, value: np.ndarray, op: str, what: str,
                           timeout_seconds: Optional[float] = None) -> np.ndarray:
        """Reduces this worker's ``value`` with every other worker's (element-wise); returns
        the result (``value`` itself, reduced in place, when MPI can do it in place).
        ``op`` "mean" is not divided here: the caller knows by what."""
        if self.num_workers == 1:
            return value
        name = mpi_op_name(op)
        a = _contiguous(value)
        timeout, deadline = self._deadline(timeout_seconds)
        self._agree(_ALL_REDUCE, what, [_dtype_code(a.dtype), a.nbytes, _OP_CODES[name], 0], timeout)
        if not a.size:
            return a
        if _native_mpi(a.dtype, name) or _via_float32(a.dtype):
            if a is value and not a.flags.writeable:
                a = a.copy()
            flat = a.reshape(-1)
            self._complete(self._start(flat, "sum" if name == "mean" else name, flat.nbytes >= BLOCKING_MIN_BYTES),
                           what, timeout, deadline)
            return a
        # Other dtypes (bool, long double, complex MIN/MAX...): gather every worker's
        # bytes and reduce with numpy, in worker order on every worker.
        table = np.empty((self.num_workers, a.nbytes), dtype=np.uint8)
        self._wait(self._comm.Iallgather([_as_bytes(a), self._MPI.BYTE], [table, self._MPI.BYTE]), what, timeout)
        stacked = table.view(a.dtype).reshape((self.num_workers,) + a.shape)
        red = ReduceOp.SUM if name == "mean" else _BY_NAME[name]
        return np.asarray(_numpy_reduce(stacked, red, a.dtype)).astype(a.dtype, copy=False)

    def gather_workers(self, value: np.ndarray, axis: int, what: str,
                       timeout_seconds: Optional[float] = None) -> np.ndarray:
        """Concatenates every worker's ``value`` along ``axis`` (sizes may differ along it
        only) in worker order."""
        if self.num_workers == 1:
            return value
        timeout, _ = self._deadline(timeout_seconds)
        moved = _contiguous(np.moveaxis(value, axis, 0))
        fields = self._shape_fields(moved, what)
        # Compare everything but the length along the axis (field 2 is the first dim).
        table = self._agree(_GATHER, what, fields, timeout,
                            compare=[0, 1] + list(range(3, len(fields))))
        sizes = [int(table[w, 3]) for w in range(self.num_workers)]
        row = moved[0].nbytes if moved.shape[0] else int(np.prod(moved.shape[1:], dtype=np.int64)) * moved.itemsize
        out = np.empty((sum(sizes),) + moved.shape[1:], dtype=moved.dtype)
        counts = [s * row for s in sizes]
        displs = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
        req = self._comm.Iallgatherv([_as_bytes(moved), self._MPI.BYTE], [_as_bytes(out), counts, displs, self._MPI.BYTE])
        self._wait(req, what, timeout)
        return np.moveaxis(out, 0, axis) if axis else out

    def broadcast_from_chief(self, value: np.ndarray, what: str, timeout_seconds: Optional[float] = None) -> np.ndarray:
        """Worker 0's ``value`` on every worker (every worker passes one of the same dtype
        and shape: MismatchError on all of them otherwise)."""
        if self.num_workers == 1:
            return value
        timeout, _ = self._deadline(timeout_seconds)
        self._agree(_VALUE, what, self._shape_fields(value, what), timeout)
        out = np.array(value, order="C", copy=True)
        if out.size:
            self._wait(self._comm.Ibcast([_as_bytes(out), self._MPI.BYTE], root=0), what, timeout)
        return out

    def chief_flag(self, ok: bool, what: str, timeout_seconds: Optional[float] = None) -> bool:
        """Worker 0's ``ok`` on every worker (the others wait for it)."""
        if self.num_workers == 1:
            return ok
        timeout, _ = self._deadline(timeout_seconds)
        flag = np.array([_FLAG, int(bool(ok))], dtype=np.int64)
        self._wait(self._comm.Ibcast(flag, root=0), what, timeout)
        return bool(flag[1])

    def sum_counts(self, count: int, what: str, timeout_seconds: Optional[float] = None) -> int:
        """The sum over workers of an integer."""
        if self.num_workers == 1:
            return int(count)
        timeout, _ = self._deadline(timeout_seconds)
        buf = np.array([count], dtype=np.int64)
        self._wait(self._comm.Iallreduce(self._MPI.IN_PLACE, buf, self._MPI.SUM), what, timeout)
        return int(buf[0])

    def close(self) -> None:
        self._mpi_thread.close()

    def __repr__(self) -> str:
        return (f"HierarchicalCollectives(worker={self.rank}, num_workers={self.num_workers}, "
                f"local_counts={list(self.local_counts)})")
