"""Thread replicas: one persistent thread per replica beyond the first.

Replica 0 runs on the calling thread; replicas 1..N-1 each own a thread that lives as
long as the runner. Python code of different replicas overlaps wherever it releases the
GIL (large numpy operations, I/O), which is what this mode is for.

Every step is an object of its own (``_Step``): its tasks, results, failures and its
meeting. A step abandoned half-way (Ctrl-C between any two bytecodes of the caller, a
timeout) is never resumed or mixed with a later one: a replica thread still busy with an
abandoned step is replaced by a fresh thread for the next step, and the old thread ends
once its function returns (an asynchronous AbortedError hurries it along when it runs
Python code). Nothing is refused forever.

Replicas meet (collectives, ``merge_call``, aggregated variable updates) in the step's
``_Meeting``: the last replica to arrive runs ``resolve`` for everyone, while the others
wait with the step's timeout; a replica that fails or returns early releases them.
"""

from __future__ import annotations

import _thread
import contextlib
import contextvars
import itertools
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import context
from ._core import AbortedError, CollectiveTimeoutError, MismatchError
from .replicas import (
    Failure,
    Raise,
    Request,
    StepTimeout,
    fork_generation,
    names,
    set_async_exception,
)

__all__ = ["ThreadRunner", "committing"]

_EMPTY: Dict[str, Any] = {}
_STOP = None
_allocate_lock = _thread.allocate_lock
_monotonic = time.monotonic
# Longest single blocking wait, so that a signal (Ctrl-C) is handled soon.
_SLICE = 0.05
# How long a new step waits for a thread still busy with an abandoned step before it
# replaces the thread.
_GRACE = 0.2


# The step each thread runs a replica of (replica 0's on the caller's thread).
_current = threading.local()


def _is_merge(request: Any) -> bool:
    return getattr(request, "kind", None) == "merge_call"


class _Meeting:
    """Where the replicas of one step meet; the last to arrive resolves, except a
    merge_call, which replica 0 resolves: merge_fn runs on the caller's thread (as
    TensorFlow's runs on its main thread), never on whichever replica thread came last.

    Built on plain locks used only in ``with`` blocks (and a per-replica wake-up lock
    waited on in slices) rather than on ``threading.Condition``, whose Python code can be
    cut short by a KeyboardInterrupt right after it has taken its lock: an interrupt on
    the caller's thread (replica 0) must never leave a lock held.
    """

    __slots__ = (
        "count",
        "failed",
        "finished",
        "generation",
        "handoff",
        "mu",
        "n",
        "outcomes",
        "requests",
        "resolve",
        "wake",
    )

    def __init__(self, n: int, resolve: Callable[[List[Request]], List[Any]]) -> None:
        self.n = n
        self.mu = _allocate_lock()
        # wake[r] is held while replica r has nothing new to see; releasing it wakes r
        # (a stale release only causes one spurious check).
        self.wake = [_allocate_lock() for _ in range(n)]
        for lock in self.wake:
            lock.acquire()
        self.requests: List[Optional[Request]] = [None] * n
        self.count = 0
        self.generation = 0
        self.outcomes: Optional[List[Any]] = None
        # A merge_call's requests, when every replica has arrived but replica 0 (which
        # resolves it) was not the last.
        self.handoff: Optional[List[Any]] = None
        self.failed: Optional[Tuple[int, str]] = None
        self.finished = [False] * n
        self.resolve = resolve

    def _wake_all(self) -> None:
        for r in range(self.n):
            self._wake(r)

    def _wake(self, replica: int) -> None:
        lock = self.wake[replica]
        if lock.locked():
            try:
                lock.release()
            except RuntimeError:  # released meanwhile
                pass

    def abort(self, replica: int, why: str) -> None:
        with self.mu:
            if self.failed is None:
                self.failed = (replica, why)
        self._wake_all()

    def finish(self, replica: int) -> None:
        """``replica`` returned from its function: it will not arrive again."""
        with self.mu:
            self.finished[replica] = True
            waiting = self.count
        if waiting:
            self._wake_all()

    def _check(self, replica: int, request: Request) -> None:
        if self.failed is not None:
            _, why = self.failed
            raise AbortedError(f"replica {replica}: released from {request.describe()} because {why}")
        gone = [r for r in range(self.n) if self.finished[r] and self.requests[r] is None]
        if gone:
            # This replica's own request too, which is not in the list yet when it arrives.
            pending = list(self.requests)
            pending[replica] = request
            calls = "; ".join(f"replica {r} waits in {q.describe()}" for r, q in enumerate(pending) if q is not None)
            err = MismatchError(
                f"replica {replica}: {calls}, but replica(s) {names(gone)} returned from the replica "
                "function without making that call; every replica must make the same collective, "
                "merge_call and variable-update calls in the same order"
            )
            err.replica = replica  # type: ignore[attr-defined]
            raise err

    def meet(self, replica: int, request: Request, deadline: float, timeout: float) -> Any:
        if request.timeout is not None and request.timeout < timeout:
            timeout = request.timeout
            deadline = min(deadline, _monotonic() + timeout)
        handed = False
        with self.mu:
            self._check(replica, request)
            waiting = self.requests[replica]
            if waiting is not None:
                # Two threads in one replica's context (a replica thread that entered
                # another's): the second call would take the first's place in the meeting.
                raise RuntimeError(
                    f"replica {replica}: {request.describe()} was called while replica {replica} already waits in "
                    f"{waiting.describe()}: two threads use replica {replica}'s context at once (a thread that "
                    "entered another replica's context); each replica makes its calls from its own thread"
                )
            generation = self.generation
            self.requests[replica] = request
            self.count += 1
            last = self.count == self.n
            if last:
                requests: List[Any] = list(self.requests)
                if replica != 0 and _is_merge(requests[0]):
                    self.handoff = requests
                    last = False
                    handed = True
        if last:
            return self._resolve_as(replica, requests)
        if handed:
            self._wake(0)
        wake = self.wake[replica]
        timed_out = ""
        while True:
            try:
                wake.acquire(True, min(max(deadline - _monotonic(), 0.0), _SLICE))
            except BaseException:
                # Ctrl-C (or another asynchronous exception) while waiting: this replica
                # leaves the meeting, and the meeting ends for the step, as on a timeout
                # (a call from its cleanup would pair with the others' current one).
                with self.mu:
                    if self.generation == generation and self.requests[replica] is request:
                        self.requests[replica] = None
                        self.count -= 1
                        self.handoff = None
                        if self.failed is None:
                            self.failed = (replica, f"replica {replica} was interrupted in {request.describe()}")
                self._wake_all()
                raise
            with self.mu:
                if self.generation != generation:
                    return self._mine(replica)
                try:
                    self._check(replica, request)
                except BaseException:
                    self.requests[replica] = None
                    self.count -= 1
                    self.handoff = None
                    raise
                # A hand-off and the deadline are read under one lock: a last replica that
                # hands the meeting over just as the deadline passes is not left waiting.
                handoff = self.handoff if replica == 0 else None
                if handoff is not None:
                    self.handoff = None
                elif _monotonic() >= deadline:
                    missing = [r for r in range(self.n) if self.requests[r] is None]
                    self.requests[replica] = None
                    self.count -= 1
                    why = (
                        f"replica(s) {names(missing)} never arrived"
                        if missing
                        else "every replica arrived, but resolving the call (a merge_fn, the collective) took longer"
                    )
                    timed_out = f"replica {replica}: {request.describe()} timed out after {timeout:g} s: {why}"
                    # The meeting ends for the whole step: a late replica's call would
                    # otherwise pair with this replica's next one (one that catches the
                    # error and goes on), mixing two different calls' values.
                    if self.failed is None:
                        ended = "a collective that timed out ends every later one of the step"
                        self.failed = (
                            replica,
                            f"replica {replica}'s {request.describe()} timed out after {timeout:g} s ({why}); {ended}",
                        )
            if handoff is not None:
                return self._resolve_as(replica, handoff)
            if timed_out:
                self._wake_all()
                raise CollectiveTimeoutError(timed_out)

    def _resolve_as(self, replica: int, requests: List[Any]) -> Any:
        """Resolves the meeting of ``requests`` on this thread, holding no lock (resolve
        may take long), wakes the others, and returns ``replica``'s outcome."""
        try:
            outcomes = self.resolve(requests)
        except BaseException as e:  # noqa: BLE001 - every waiting replica must hear of it
            outcomes = [Raise(e)] * self.n
        with self.mu:
            self.outcomes = outcomes
            self.requests = [None] * self.n
            self.count = 0
            self.generation += 1
        self._wake_all()
        return self._mine(replica)

    def _mine(self, replica: int) -> Any:
        o = self.outcomes[replica]  # type: ignore[index]
        if type(o) is Raise:
            raise o.error
        return o


class _Step:
    """One run of the replica function on every replica."""

    __slots__ = (
        "__weakref__",
        "abandoned",
        "commit_lock",
        "deadline",
        "done",
        "failures",
        "fn",
        "lock",
        "meeting",
        "on_fail",
        "order",
        "pending",
        "results",
        "timeout",
    )

    def __init__(
        self,
        n: int,
        fn: Callable[..., Any],
        resolve: Callable[[List[Request]], List[Any]],
        order: Iterator[int],
        timeout: float,
        on_fail: Callable[[int, str], None],
    ) -> None:
        self.fn = fn
        self.meeting = _Meeting(n, resolve)
        self.results: List[Any] = [None] * n
        self.failures: List[Failure] = []
        self.pending = n - 1
        self.done = threading.Lock()
        self.done.acquire()
        self.lock = threading.Lock()
        self.order = order
        self.timeout = timeout
        self.deadline = _monotonic() + timeout
        self.abandoned = False
        # Held while variable copies change (see committing): the step is abandoned only
        # between two such changes, never half-way through one.
        self.commit_lock = threading.RLock()
        self.on_fail = on_fail

    def fail(self, replica: int, error: BaseException) -> None:
        """Records ``error`` of ``replica`` and releases everybody waiting in the step."""
        with self.lock:
            self.failures.append(Failure(next(self.order), replica, error))
        why = f"replica {replica} raised {type(error).__name__}: {error}"
        self.meeting.abort(replica, why)
        self.on_fail(replica, why)

    def worker_done(self) -> None:
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.done.release()


class _Worker:
    """One replica thread and its task queue."""

    __slots__ = ("current", "replica", "retired", "tasks", "thread")

    def __init__(self, replica: int, name: str) -> None:
        self.replica = replica
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.current: Optional[_Step] = None
        self.retired = False
        self.thread = threading.Thread(target=_worker_main, args=(self,), name=f"{name}-{replica}", daemon=True)


def _worker_main(w: _Worker) -> None:
    # Only `w` is referenced here, never the runner or its strategy, so both can be
    # garbage collected while the thread waits for work.
    local = context._local
    get = w.tasks.get
    try:
        while True:
            task = get()
            if task is _STOP:
                return
            step, args, kwargs, entry, ctx = task
            task = None
            if step.abandoned:
                step.worker_done()
                continue
            w.current = step
            _current.step = step
            local.stack = [entry]
            try:
                step.results[w.replica] = ctx.run(step.fn, *args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - every failure reaches the caller
                step.fail(w.replica, e)
                e = None  # type: ignore[assignment]
            finally:
                step.meeting.finish(w.replica)
                # Nothing of the step may stay referenced from this frame between steps
                # (the entry holds the strategy), or the strategy is never collected.
                args = kwargs = entry = ctx = None
                local.stack = []
                _current.step = None
                w.current = None
                step.worker_done()
                step = None
            if w.retired:
                return
    except BaseException:
        if not w.retired:
            raise


def committing(what: Callable[[], str]) -> Any:
    """Context for changing variable copies from a replica thread of a step: it waits
    for no one, but the step cannot be abandoned while it is held, and it raises
    AbortedError (``what()`` says what was dropped) when the step already was. Outside a
    threads step (inline replicas, cross-replica code) it does nothing."""
    step = getattr(_current, "step", None)
    if step is None:
        return contextlib.nullcontext()
    return _Commit(step, what)


class _Commit:
    __slots__ = ("_step", "_what")

    def __init__(self, step: _Step, what: Callable[[], str]) -> None:
        self._step = step
        self._what = what

    def __enter__(self) -> None:
        self._step.commit_lock.acquire()
        if self._step.abandoned:
            self._step.commit_lock.release()
            raise AbortedError(self._what())

    def __exit__(self, *exc: object) -> None:
        self._step.commit_lock.release()


def _stop_workers(workers: List[Optional[_Worker]]) -> None:
    for w in workers:
        if w is not None:
            w.retired = True
            w.tasks.put(_STOP)


class ThreadRunner:
    """Runs one callable per replica: replica 0 on the calling thread, the others on
    their own threads. Same interface as ``InlineRunner``."""

    mode = "threads"
    # (Inline runners set it when their watchdog interrupted a replica; threads never.)
    _fired = 0

    def __init__(
        self,
        num_replicas: int,
        resolve: Callable[[List[Request]], List[Any]],
        on_fail: Callable[[int, str], None],
        name: str = "distvals-replica",
    ) -> None:
        self.n = num_replicas
        self._resolve = resolve
        self._on_fail = on_fail
        self._name = name
        self.failures: List[Failure] = []
        self._order = itertools.count()
        self._step: Optional[_Step] = None
        self._workers: List[Optional[_Worker]] = [None] * num_replicas
        self._fork = fork_generation()
        try:
            for r in range(1, num_replicas):
                self._start(r)
        except BaseException:
            # Threads already started must not outlive the failure (e.g. an address-space
            # limit reached half-way through 64 replicas).
            _stop_workers(self._workers)
            raise
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def _start(self, r: int) -> _Worker:
        w = _Worker(r, self._name)
        w.thread.start()
        self._workers[r] = w
        return w

    # ---- meeting (called by a replica) -------------------------------------------------
    def meet(self, replica: int, request: Request) -> Any:
        # The step of the calling thread, not the runner's latest: a thread still busy
        # with an abandoned step must meet (and be released) there, never in a new step.
        step = getattr(_current, "step", None)
        if step is None:
            raise RuntimeError("no step is running on this thread")
        return step.meeting.meet(replica, request, step.deadline, step.timeout)

    # ---- one step ------------------------------------------------------------------------
    def _ready_workers(self) -> List[_Worker]:
        """The replica threads, each idle: threads lost to a fork are started again, and
        a thread still busy with an abandoned step gets a moment, then a successor."""
        if self._fork != fork_generation():
            self._fork = fork_generation()
            self._workers = [None] * self.n
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        out: List[_Worker] = []
        grace = None
        for r in range(1, self.n):
            w = self._workers[r]
            if w is not None and w.current is not None:
                if grace is None:
                    grace = _monotonic() + _GRACE
                while w.current is not None and _monotonic() < grace:
                    time.sleep(0.001)
                if w.current is not None:
                    self._retire(w)
                    w = None
            if w is None:
                w = self._start(r)
            out.append(w)
        return out

    def _retire(self, w: _Worker) -> None:
        w.retired = True
        w.tasks.put(_STOP)
        set_async_exception(w.thread.ident, AbortedError)

    def step(
        self,
        fn: Callable[..., Any],
        per_replica: Sequence[Tuple[Tuple[Any, ...], Optional[Dict[str, Any]]]],
        entries: Sequence[context.Entry],
        timeout: float,
    ) -> List[Any]:
        """Runs ``fn`` once per replica; returns the N results. Failures land in
        ``failures``; replicas still running ``timeout`` seconds after the start (or a
        Ctrl-C while waiting) abandon the step: StepTimeout / KeyboardInterrupt."""
        n = self.n
        workers = self._ready_workers()
        step = _Step(n, fn, self._resolve, self._order, timeout, self._on_fail)
        self._step = step
        self.failures = step.failures
        try:
            # Each replica runs in a copy of the caller's context variables: what one sets
            # reaches neither another replica, nor a later step, nor the caller.
            base = contextvars.copy_context()
            for w, (args, kwargs), entry in zip(workers, per_replica[1:], entries[1:]):
                w.tasks.put((step, args, kwargs or _EMPTY, entry, base.copy()))
            args, kwargs = per_replica[0]
            local = context._local
            saved = local.stack
            # A step may run inside another strategy's step on this thread (from its
            # merge_fn): that one's step is this thread's again afterwards.
            outer = getattr(_current, "step", None)
            try:
                # (Inside the try: an interrupt between any two lines leaves no replica
                # context behind on the caller's thread.)
                local.stack = [entries[0]]
                _current.step = step
                step.results[0] = base.run(fn, *args, **(kwargs or _EMPTY))
            except BaseException as e:
                step.fail(0, e)
                if not isinstance(e, Exception):
                    raise  # Ctrl-C, SystemExit: return at once, the step is abandoned
            finally:
                _current.step = outer
                local.stack = saved
                step.meeting.finish(0)
            if n > 1:
                self._wait(step)
        except BaseException:
            self._abandon(step, "strategy.run was interrupted")
            # A replica still busy in the abandoned step records its late failure there
            # (with the frames of its traceback, and so the step's inputs): nothing here
            # keeps the step, which goes with that replica's thread once it is back.
            self._step = None
            raise
        # Every replica is done: the results are the caller's now, and neither the runner
        # nor the step's last meeting keeps them (they may be large) until the next step.
        self._step = None
        step.meeting.outcomes = None
        return step.results

    def _wait(self, step: _Step) -> None:
        """Waits for replicas 1..N-1 until the step's deadline. Once a replica has failed
        (the others are released), a replica still busy in its own code gets a short
        grace, then the step is abandoned: the failure reaches the caller now."""
        acquire = step.done.acquire
        failed_at = None
        while not acquire(True, _SLICE):
            now = _monotonic()
            if step.failures:
                if failed_at is None:
                    failed_at = now
                elif now - failed_at > _GRACE:
                    self._abandon(step, "another replica failed")
                    return
            if now > step.deadline:
                stuck = [w.replica for w in self._workers if w is not None and w.current is step]
                raise StepTimeout(step.timeout, stuck, f"replica(s) {names(stuck)} did not finish")

    def _abandon(self, step: _Step, why: str) -> None:
        """Releases every replica of ``step`` still waiting or running: the step is over."""
        with step.commit_lock:  # an update of variable copies in progress lands whole first
            step.abandoned = True
        stuck = [w.replica for w in self._workers if w is not None and w.current is step]
        step.meeting.abort(stuck[0] if stuck else -1, why)
        self._on_fail(stuck[0] if stuck else -1, why)

    def busy_replicas(self) -> List[int]:
        """Replica threads still running an abandoned step."""
        return [w.replica for w in self._workers if w is not None and w.current is not None]

    def close(self) -> None:
        """Stops the replica threads (idle ones at once, busy ones when they return)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"ThreadRunner(num_replicas={self.n})"
