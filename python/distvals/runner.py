"""Persistent replica threads: run one callable per replica, in parallel.

Replica 0 runs on the calling thread (it saves a thread handoff per step); replicas
1..N-1 each own a thread that lives as long as the runner. A step hands work over with
two plain locks per thread (``go`` released by the caller, ``done`` released by the
replica), which costs a few microseconds, and the engine releases the GIL while a
replica waits in a collective, so the replicas' native work overlaps.

The threads hold no reference to the runner or to a strategy between steps, so both
can be garbage collected; a finalizer then stops the threads.
"""

from __future__ import annotations

import _thread
import itertools
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import context

__all__ = ["ReplicaRunner", "ReplicaFailure", "MergeBarrier"]

_STOP = object()
_EMPTY: dict = {}
_monotonic = time.monotonic
# Longest single blocking wait of the calling thread, in seconds.
_SLICE = 0.1
# After Ctrl-C, how long the caller waits for the replicas the abort released (those
# blocked in a collective return within milliseconds); replicas busy in their own code
# are left running, marked busy, so that control returns at once.
_INTERRUPT_GRACE = 0.2


class ReplicaFailure:
    """An exception raised by one replica during a step, with its order of arrival."""

    __slots__ = ("order", "replica", "error")

    def __init__(self, order: int, replica: int, error: BaseException) -> None:
        self.order = order
        self.replica = replica
        self.error = error


class _Worker:
    """The state one replica thread shares with the caller."""

    __slots__ = ("replica", "go", "done", "task", "result", "busy", "thread")

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.task: Any = None
        self.result: Any = None
        self.busy = False
        self.thread: Optional[threading.Thread] = None


def _worker_loop(w: _Worker) -> None:
    # Only `w` is referenced here: never the runner or its strategy.
    stack = context._stack()
    go = w.go.acquire
    done = w.done.release
    while True:
        go()
        task = w.task
        w.task = None
        if task is _STOP:
            done()
            return
        fn, args, kwargs, entry, on_error = task
        task = None
        stack.append(entry)
        try:
            w.result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
            w.result = None
            on_error(w.replica, e)
            e = None
        finally:
            stack.pop()
        fn = args = kwargs = entry = on_error = None
        done()


def _stop_workers(workers: List[_Worker]) -> None:
    # A busy thread finds _STOP when its current task ends and exits then.
    for w in workers:
        w.task = _STOP
        try:
            w.go.release()
        except RuntimeError:  # already released: the thread has not taken its task yet
            pass


class ReplicaRunner:
    """Runs ``fn`` once per replica, replica 0 on the calling thread.

    ``step(fn, per_replica_args, entries, on_error, timeout)`` returns the list of
    results; failures go to ``on_error(replica, exception)`` (called on the failing
    thread) and the caller inspects ``failures`` afterwards.
    """

    def __init__(self, num_replicas: int, name: str = "distvals-replica") -> None:
        if num_replicas < 1:
            raise ValueError(f"a runner needs at least 1 replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self.failures: List[ReplicaFailure] = []
        self._order = itertools.count()
        self._workers: List[_Worker] = []
        for r in range(1, num_replicas):
            w = _Worker(r)
            t = threading.Thread(target=_worker_loop, args=(w,), name=f"{name}-{r}", daemon=True)
            w.thread = t
            t.start()
            self._workers.append(w)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ---- failures ---------------------------------------------------------------------
    def record_failure(self, replica: int, error: BaseException) -> None:
        """Note that ``replica`` raised ``error`` (any thread)."""
        self.failures.append(ReplicaFailure(next(self._order), replica, error))

    # ---- one step -----------------------------------------------------------------------
    def busy_replicas(self, wait: float = 0.0) -> List[int]:
        """Replicas still running a step that was abandoned after a timeout or an
        interrupt, after waiting at most ``wait`` seconds for them to return."""
        if wait > 0:
            self._wait_released(wait)
        out = []
        for w in self._workers:
            if w.busy:
                if w.done.acquire(False):
                    w.busy = False
                    w.result = None
                else:
                    out.append(w.replica)
        return out

    def step(self, fn: Callable, per_replica_args: Sequence[Tuple[tuple, dict]], entries: Sequence[tuple],
             on_error: Callable[[int, BaseException], None], timeout: float,
             on_wait_failed: Callable[[List[int], BaseException], None]) -> List[Any]:
        """Runs one step and returns the N results (None for failed replicas).

        Waits for replicas 1..N-1 at most ``timeout`` seconds after replica 0 finished;
        if one is still running then (or the wait is interrupted, e.g. by Ctrl-C),
        ``on_wait_failed(still_running, why)`` is called (it should release replicas
        blocked in collectives), the others get a short grace period, and the exception
        is raised.
        """
        self.failures = []
        workers = self._workers
        for w, (args, kwargs), entry in zip(workers, itertools.islice(per_replica_args, 1, None),
                                             itertools.islice(entries, 1, None)):
            w.task = (fn, args, kwargs or _EMPTY, entry, on_error)
            w.busy = True
            w.go.release()
        args, kwargs = per_replica_args[0]
        stack = context._stack()
        stack.append(entries[0])
        interrupted = False
        try:
            r0 = fn(*args, **(kwargs or _EMPTY))
        except BaseException as e:  # noqa: BLE001
            r0 = None
            interrupted = not isinstance(e, Exception)  # Ctrl-C, SystemExit
            on_error(0, e)
        finally:
            stack.pop()
        results = [r0]
        if not workers:
            return results
        if interrupted:
            # on_error released the replicas waiting in collectives; do not wait for the
            # ones computing: the caller gets control back now.
            self._wait_released(_INTERRUPT_GRACE)
            return results + [None] * len(workers)
        deadline = _monotonic() + timeout
        try:
            for w in workers:
                # Wait in slices: a signal (Ctrl-C) that lands just before a blocking
                # acquire is only handled when the acquire returns, so never block long.
                acquire = w.done.acquire
                while not acquire(True, _SLICE):
                    if _monotonic() > deadline:
                        raise _StepTimeout(timeout)
                w.busy = False
                results.append(w.result)
                w.result = None
        except BaseException as why:  # timeout, KeyboardInterrupt
            stuck = [w.replica for w in workers if w.busy]
            on_wait_failed(stuck, why)
            # Replicas blocked in the engine or in merge_call come back at once now.
            self._wait_released(min(timeout, 5.0) if isinstance(why, Exception) else _INTERRUPT_GRACE)
            raise
        return results

    def _wait_released(self, seconds: float) -> None:
        """Waits at most ``seconds`` for busy replicas to return; the ones that do not
        stay marked busy (the next step refuses to start until they return)."""
        grace = _monotonic() + seconds
        for w in self._workers:
            while w.busy:
                # In slices, so that a signal is handled soon.
                remaining = grace - _monotonic()
                if remaining <= 0:
                    break
                if w.done.acquire(True, min(remaining, _SLICE)):
                    w.busy = False
                    w.result = None

    def close(self) -> None:
        """Stops the replica threads (idle ones at once). Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"ReplicaRunner(num_replicas={self.num_replicas})"


class _StepTimeout(Exception):
    """Raised inside ``step`` when replicas did not finish in time."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self.timeout = timeout


class MergeBarrier:
    """Where the replicas meet in ``merge_call``: the last to arrive runs the merge
    function; the others wait (with a timeout, and released at once by ``abort``)."""

    def __init__(self, num_replicas: int) -> None:
        self.n = num_replicas
        self._cond = threading.Condition(threading.Lock())
        self.reset()

    def reset(self) -> None:
        """Clears the state for a new step (no replica may be running)."""
        n = self.n
        self._payloads: List[Any] = [None] * n
        self._arrived = [False] * n
        self._count = 0
        self._generation = 0
        self._outcome: Any = None
        self._failed: Optional[Tuple[int, str]] = None
        # finished[r] == step: replica r returned from its function in this step.
        self._finished = [0] * n
        self._step = 1

    def begin_step(self) -> None:
        """Marks the start of a step (cheap: no other state is touched)."""
        self._step += 1

    def abort(self, replica: int, why: str) -> None:
        """Releases every waiting replica with AbortedError naming ``replica``."""
        with self._cond:
            if self._failed is None:
                self._failed = (replica, why)
            self._cond.notify_all()

    def finished(self, replica: int) -> None:
        """Notes that ``replica`` returned from its function (it will not arrive again)."""
        self._finished[replica] = self._step
        if self._count:
            with self._cond:
                self._cond.notify_all()

    def meet(self, replica: int, payload: Any, merge: Callable[[List[Any]], Any], timeout: float) -> Any:
        """Deposits ``payload``; once all N have, ``merge(payloads)`` runs on the last
        replica's thread and its result (or exception) reaches everyone."""
        from ._core import AbortedError, CollectiveTimeoutError

        cond = self._cond
        with cond:
            self._raise_if_failed(replica, AbortedError)
            generation = self._generation
            self._payloads[replica] = payload
            self._arrived[replica] = True
            self._count += 1
            last = self._count == self.n
            if not last:
                deadline = _monotonic() + timeout
                while self._generation == generation:
                    self._raise_if_failed(replica, AbortedError)
                    step = self._step
                    gone = [r for r in range(self.n) if self._finished[r] == step and not self._arrived[r]]
                    if gone:
                        raise RuntimeError(
                            f"replica {replica}: merge_call waits for replica(s) {_names(gone)}, which "
                            "returned without calling merge_call; every replica must make the same "
                            "merge_call and collective calls in the same order"
                        )
                    remaining = deadline - _monotonic()
                    if remaining <= 0:
                        missing = [r for r in range(self.n) if not self._arrived[r]]
                        raise CollectiveTimeoutError(
                            f"replica {replica}: merge_call timed out after {timeout:g} s waiting for "
                            f"replica(s) {_names(missing)}"
                        )
                    cond.wait(min(remaining, 0.05))
                result, error, by = self._outcome
                if error is not None:
                    raise AbortedError(
                        f"replica {replica}: merge_fn raised {type(error).__name__} in replica {by}: {error}"
                    )
                return result
            payloads = self._payloads
        try:
            result = merge(payloads)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting replicas, then raised
            with cond:
                self._finish((None, e, replica))
            raise
        with cond:
            self._finish((result, None, replica))
        return result

    def _finish(self, outcome) -> None:
        self._outcome = outcome
        self._payloads = [None] * self.n
        self._arrived = [False] * self.n
        self._count = 0
        self._generation += 1
        self._cond.notify_all()

    def _raise_if_failed(self, replica: int, error_type) -> None:
        if self._failed is not None:
            by, why = self._failed
            raise error_type(f"replica {replica}: released from merge_call because replica {by} failed: {why}")


def _names(replicas: Sequence[int]) -> str:
    return ", ".join(str(r) for r in replicas)
