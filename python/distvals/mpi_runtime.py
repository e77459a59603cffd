"""What the multi-worker collectives run on: mpi4py, loaded on demand; waits on MPI
requests that poll against a deadline; the thread that runs blocking MPI calls in
order; and ending the job.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .daemon import start_daemon

__all__ = [
    "SPIN_TIGHT",
    "WAIT_SLICE",
    "MpiJob",
    "MpiThread",
    "load_mpi",
    "native_request_calls",
    "poll",
    "poll_all",
    "report_and_abort",
]

_monotonic = time.monotonic
# A polling wait first spins this long without pause, then yields the core between
# tests until _SPIN, then naps this long per test.
SPIN_TIGHT = 2e-4
_SPIN = 1e-2
_NAP = 1e-4
# Longest single blocking wait on a thread event, in seconds (keeps Ctrl-C responsive).
WAIT_SLICE = 0.1


def load_mpi(what: str = "MultiWorkerMirroredStrategy") -> ModuleType:
    """``mpi4py.MPI`` (initializing MPI), or ImportError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            f"{what} needs mpi4py and an MPI library (Open MPI); install them with "
            f'pip install "distvals[mpi]" (cannot import mpi4py.MPI: {e})'
        ) from e
    return MPI


class MpiJob:
    """One MPI all-reduce of a buffer (a chunk): posted nonblocking by the calling thread
    (``req``), or run blocking by the MPI thread (``done`` is set when it returns)."""

    __slots__ = ("buf", "done", "error", "req", "target")

    def __init__(self, buf: np.ndarray, target: Optional[np.ndarray]) -> None:
        # float16/bfloat16 chunks travel as float32 in `buf`, copied back into `target`.
        self.buf = buf
        self.target = target
        self.req: Any = None
        self.done: Optional[threading.Event] = None
        self.error: Optional[BaseException] = None


class MpiThread:
    """Runs blocking MPI all-reduces in order, one after the other, so that the thread
    that hands them over can go on reducing the next chunk in the engine meanwhile.

    Blocking calls, because Open MPI's blocking all-reduce algorithms are much faster
    than its nonblocking ones (measured: 1 MiB between 2 processes, ~110-140 us against
    ~220-260 us with Iallreduce, even when polled without pause). The thread that waits
    for a job does so against the deadline; an MPI call cannot be cancelled, so a job
    that never returns means the job is aborted.
    """

    def __init__(self) -> None:
        # Guards starting the loop. A plain lock, taken by ``with`` in C: a Ctrl-C cannot
        # land between its acquire and the block that releases it (a Condition's
        # __enter__ is Python code, where one can, leaving the lock held for good).
        self._lock = threading.Lock()
        self._stop = False
        # The job queue of the one loop that takes jobs (None: none started yet). Each
        # loop has its own: a loop whose queue is not the current one gets no job.
        self._jobs: Optional[queue.SimpleQueue[Optional[Tuple[MpiJob, Callable[[], None]]]]] = None

    def submit(self, job: MpiJob, run: Callable[[], None]) -> None:
        job.done = threading.Event()
        with self._lock:
            jobs = self._jobs
            if jobs is None:
                # A Ctrl-C raised as the start call returns leaves it unknown whether a
                # loop started: its queue is given up then, and a loop that started with
                # it stops, so that only the next submit's loop takes jobs (two loops
                # would run MPI calls out of order, from two threads).
                jobs = self._jobs = queue.SimpleQueue()
                try:
                    start_daemon(lambda: self._loop(jobs), "distvals-mpi")
                except BaseException:
                    self._jobs = None
                    raise
            jobs.put((job, run))  # in C: the job is queued whole or not at all

    def _loop(self, jobs: queue.SimpleQueue[Optional[Tuple[MpiJob, Callable[[], None]]]]) -> None:
        while True:
            try:
                item = jobs.get(timeout=1.0)
            except queue.Empty:
                if self._stop or self._jobs is not jobs:
                    return
                continue
            if item is None:  # close()
                return
            job, run = item
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - an MPI error reaches the waiting thread
                job.error = e
            job.done.set()  # type: ignore[union-attr]  # submit() gave the job its event
            del job, run, item

    def close(self) -> None:
        with self._lock:
            self._stop = True
            if self._jobs is not None:
                self._jobs.put(None)


def native_request_calls(MPI: ModuleType) -> Optional[Tuple[int, int]]:
    """The addresses of ``MPI_Start`` and ``MPI_Test`` in the MPI library that mpi4py
    loaded, for native code that starts and tests a persistent request without Python
    in between (``distvals._core.WorkerSmallPlan``); None where they cannot be
    found (another platform, an mpi4py that loads MPI some other way): the Python path
    then makes the same calls. The library is already loaded: looking it up through
    mpi4py's own extension module finds the very functions mpi4py calls."""
    try:
        import ctypes

        lib = ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        start = ctypes.cast(lib.MPI_Start, ctypes.c_void_p).value
        test = ctypes.cast(lib.MPI_Test, ctypes.c_void_p).value
    except (AttributeError, OSError, TypeError, ImportError):
        return None
    if not start or not test:
        return None
    return int(start), int(test)


def poll(req: Any, deadline: float, stop: Optional[Callable[[], None]] = None) -> bool:
    """Tests ``req`` until it completes (True) or the deadline passes (False); ``stop()``
    is called while napping (it raises to give up, e.g. when a local replica failed).

    Three phases, because each ``Test`` is also what moves a nonblocking MPI collective
    along: first a tight loop (a small collective between processes that each have a
    core completes within microseconds, and any pause adds to its latency), then a loop
    that yields the core between tests (with more processes than cores, the peer we
    wait for may need ours), then short naps (a worker that is far behind must not cost
    a core for the whole wait).
    """
    return _poll(req.Test, deadline, stop)


def poll_all(reqs: List[Any], deadline: float, stop: Optional[Callable[[], None]] = None) -> bool:
    """``poll`` of several requests (a send and a receive): True once all completed."""
    testall = reqs[0].Testall
    return _poll(lambda: testall(reqs), deadline, stop)


def _poll(test: Callable[[], bool], deadline: float, stop: Optional[Callable[[], None]]) -> bool:
    if test():
        return True
    now = _monotonic()
    spin_until = now + SPIN_TIGHT
    yield_until = now + _SPIN
    while True:
        if test():
            return True
        now = _monotonic()
        if now < spin_until:
            continue
        if now < yield_until:
            os.sched_yield()
            continue
        if now > deadline:
            return False
        if stop is not None:
            stop()
        time.sleep(_NAP)


def report_and_abort(comm_world: Any, message: str, code: int = 1) -> None:
    """Prints ``message`` to stderr (flushed, so it survives the abort) and aborts every
    process of the job."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout must not stop the abort
        pass
    try:
        sys.stderr.write(f"distvals: {message}\ndistvals: aborting the MPI job\n")
        sys.stderr.flush()
    finally:
        comm_world.Abort(code)
