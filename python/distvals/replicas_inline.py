"""Inline replicas: every replica function runs as a coroutine on the calling thread.

Each replica is a greenlet. ``step`` starts replica 0, which runs until it reaches a
meeting (``meet``: a collective, a ``merge_call``, an aggregated variable update) or
returns; then replica 1, and so on. Once every replica waits at a meeting, the
meeting's ``resolve`` runs once, on the calling thread, with every replica's request,
and each replica resumes with its own outcome. No thread wakes up and the GIL never
changes hands: a step with one all-reduce costs a few greenlet switches and one
single-call collective, whose native work the engine still spreads over its worker
threads.

Mismatches are seen at once: a replica that returns (or raises) while the others wait
releases them immediately, with ``MismatchError`` (or ``AbortedError``).

Each replica has its own context stack (``get_replica_context()``, scopes) and its own
copy of the caller's ``contextvars`` context.

What inline replicas cannot do: wait for one another outside the strategy's meetings
(a ``threading.Event`` that another replica would set, a queue). Replicas take turns on
one thread, so the waiting replica holds it and the one that would set the event never
runs. The step's timeout still ends it: a watchdog thread raises ``CollectiveTimeoutError``
in the stuck replica (an asynchronous exception; on the main thread a blocked C-level
wait is interrupted with SIGINT first, when Python's default SIGINT handler is in place).
A replica blocked in such a wait on another thread cannot be interrupted; use
``execution="threads"`` for code like that.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
import os
import signal
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import context
from ._core import AbortedError, CollectiveTimeoutError, MismatchError
from ._core import inline_drive as _drive
from ._core import inline_resume as _resume
from ._core import inline_setup as _inline_setup
from .daemon import start_daemon
from .replicas import (
    Failure,
    Raise,
    Request,
    StepTimeout,
    as_request,
    executing,
    foreign_greenlet_error,
    main_thread_id,
    names,
    set_async_exception,
)
from .replicas import fork_counter as _forks

try:
    import greenlet as _greenlet_module
    from greenlet import GreenletExit as _GreenletExit
    from greenlet import getcurrent as _getcurrent
    from greenlet import greenlet as _Greenlet
except ImportError:  # pragma: no cover - greenlet is a dependency; threads mode still works
    _greenlet_module = None

__all__ = ["InlineRunner", "available"]

_get_ident = threading.get_ident
_getframe = sys._getframe

_EMPTY: Dict[str, Any] = {}
_INF = math.inf
_monotonic = time.monotonic
# Markers a replica greenlet switches to the scheduler with when its function ends.
_DONE = object()
_FAILED = object()


_inline_setup(_DONE, _FAILED, Raise, _EMPTY)


def available() -> bool:
    """True when greenlet is installed (inline replicas need it)."""
    return _greenlet_module is not None


class InlineTimeout(BaseException):
    """Raised by the watchdog inside a replica that outlived the step's timeout; a
    BaseException so that ``except Exception`` in the replica does not swallow it."""


# What a replica greenlet is switched into to run: (fn, args, kwargs).
_Task = Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]


def _replica_main(task: Optional[_Task] = None, runner: Any = None) -> None:
    # The body of every replica greenlet: run a task, switch its outcome to the
    # scheduler (the parent), receive the next task. `runner` is a weak reference to
    # the runner whose replica this is (see the GreenletExit case below). The
    # outcome is a list that the scheduler empties once it has taken it: this frame
    # waits for the next step with it, and must not keep the result (or the
    # exception, with the frames of its traceback) alive until then.
    # The greenlet is started without a task and gets its first one here: arguments
    # of the greenlet's start stay referenced for its whole life (this body never
    # returns), and a step's inputs must not. (One that an interrupt kept from being
    # started that way is started with its first task.)
    if task is None:
        task = _getcurrent().parent.switch()
    while True:
        fn, args, kwargs = task
        task = None
        try:
            out: List[Any] = [_DONE, fn(*args, **kwargs)]
        except _GreenletExit as e:
            # Killed (the greenlet of an abandoned step, or collected): end quietly. The
            # replica's own GreenletExit, in the step that runs it, is its failure.
            owner = runner() if runner is not None else None
            if owner is None or _getcurrent() not in (owner._running or ()):
                return
            out = [_FAILED, e]
        except BaseException as e:  # noqa: BLE001 - every outcome goes to the scheduler
            out = [_FAILED, e]
        fn = args = kwargs = None
        task = _getcurrent().parent.switch(out)


class InlineRunner:
    """Runs one callable per replica, all as greenlets on the calling thread.

    ``resolve(requests)`` (one request per replica) returns one outcome per replica:
    a value, or ``Raise(error)``. ``failures`` lists the replicas' exceptions of the last
    step, in order of arrival.
    """

    mode = "inline"

    # State of the step in progress, set by ``step``: each replica's result, context
    # stack and pending request (a Request or its quick tuple form; None when running).
    # Between steps the results and requests are None.
    _results: Optional[List[Any]]
    _stacks: List[List[context.Entry]]
    _msgs: Optional[List[Any]]
    _waiting: int
    _lost: bool

    def __init__(self, num_replicas: int, resolve: Callable[[List[Request]], List[Any]]) -> None:
        if _greenlet_module is None:
            raise ImportError("inline replicas need the greenlet package: pip install greenlet")
        self.n = num_replicas
        self._resolve = resolve
        self.failures: List[Failure] = []
        self._greenlets: Optional[List[Any]] = None
        self._parent: Any = None  # the scheduler greenlet the replicas switch back to
        # The greenlets of the step in progress (or of one that was abandoned half-way).
        self._abandoned: Optional[List[Any]] = None
        self._owner: Optional[int] = None  # thread that owns the greenlets
        self._order = itertools.count()
        # Watchdog state, guarded by _wd_lock (see _Watchdog).
        self._wd_lock = threading.Lock()
        self._active = False
        self._deadline = math.inf
        self._timeout = math.inf
        self._thread_id: Optional[int] = None
        self._step_frame: Optional[types.FrameType] = None  # the running step's (see _fire)
        self._fired = 0  # 0: no; 1: async exception sent; 2: SIGINT sent instead
        # The greenlets' body, with (a weak reference to) this runner, which tells a
        # replica's own GreenletExit from a kill. A strong one would make a cycle through
        # a suspended greenlet's frame, which the garbage collector cannot see.
        self._main = functools.partial(_replica_main, runner=weakref.ref(self))
        self._registered: Optional[int] = None  # the fork generation it registered in
        # The greenlets of the step that is running (None between steps): their
        # GreenletExit is a replica's failure; any other greenlet's is a kill.
        self._running: Optional[List[Any]] = None
        # A meeting with a timeout of its own (see _meet_within): (replica, request,
        # timeout) of the replica that set the watchdog's deadline for it, and, once the
        # watchdog fired for it, the same in _fired_call.
        self._call: Optional[Tuple[int, Request, float]] = None
        self._fired_call: Optional[Tuple[int, Request, float]] = None
        self._step_deadline = _INF  # the step's own deadline, while a call's applies
        self._steps = 0  # steps started: a meeting's deadline belongs to one step
        # The replicas' context stacks of the step in _abandoned (see _bury).
        self._abandoned_stacks: Optional[List[List[context.Entry]]] = None

    def _bury(self) -> None:
        """Ends the greenlets of an abandoned step (suspended at a meeting) here and now,
        rather than whenever the garbage collector gets to them: their `finally` blocks
        run at a known point, each in its replica's context (as when it ran), a meeting
        they call is refused with AbortedError (the step is over), and nothing they raise
        goes unreported: a Ctrl-C or SystemExit is raised here once every one has ended,
        any other error goes to ``sys.unraisablehook``."""
        old, self._abandoned = self._abandoned, None
        stacks, self._abandoned_stacks = self._abandoned_stacks, None
        self._running = None  # these are killed, not failing
        if not old:
            return
        parent, self._parent = self._parent, _BURYING
        local = context._local
        saved = local.stack
        interrupt: Optional[BaseException] = None
        try:
            for r, g in enumerate(old):
                error: BaseException = _GreenletExit()
                for _ in range(8):  # a cleanup that keeps making calls is left to the collector
                    if g.dead:
                        break
                    if stacks is not None and r < len(stacks):
                        local.stack = stacks[r]
                    try:
                        out = g.throw(error)
                    except _GreenletExit:
                        break
                    if type(out) is list and len(out) == 2 and out[0] is _FAILED:
                        e = out[1]
                        if isinstance(e, _GreenletExit):
                            break
                        if not isinstance(e, Exception):
                            interrupt = interrupt or e
                        else:
                            _report_cleanup_error(r, e)
                        break
                    if type(out) is list or out is None:
                        break  # back at the head of its loop: its frames hold nothing
                    # A meeting's request from a quick path: refused, as meet refuses.
                    error = self.refused(r, "a collective")
        finally:
            local.stack = saved
            self._parent = parent if self._parent is _BURYING else self._parent
        if interrupt is not None:
            raise interrupt

    def refused(self, replica: int, what: str) -> BaseException:
        """The error of a cross-replica call that cannot be made from here: from the
        cleanup of a replica of a step that was cut short, or from a greenlet that the
        replica function started."""
        if self._parent is _BURYING:
            return AbortedError(
                f"replica {replica}: {what} was called while the replica was being ended, after its step was "
                "cut short (a timeout, Ctrl-C, another replica's failure): its replicas no longer meet"
            )
        return foreign_greenlet_error(replica, what)

    # ---- meeting (called by a replica) -------------------------------------------------
    def meet(self, replica: int, request: Request) -> Any:
        """Hands ``request`` to the scheduler and returns this replica's outcome."""
        sched = _getcurrent().parent
        if sched is not self._parent:
            raise self.refused(replica, request.kind)
        if type(request) is Request and request.timeout is not None and self._call is None:
            return self._meet_within(sched, replica, request, request.timeout)
        return sched.switch(request)

    def _meet_within(self, sched: Any, replica: int, request: Request, timeout: float) -> Any:
        """A meeting with a timeout of its own (``CommunicationOptions(timeout_seconds=)``
        passed to the call), reached first by ``replica``: until the meeting is resolved,
        the watchdog ends the step at most ``timeout`` seconds from now, as the waiting
        replica's own wait would end in threads mode. Then the step's deadline applies
        again."""
        deadline = _monotonic() + timeout
        if self._active and deadline >= self._deadline:
            return sched.switch(request)  # the step's deadline comes first
        step, step_timeout = self._steps, self._timeout
        self._step_deadline = self._deadline if self._active else _INF
        self._call = (replica, request, timeout)
        if self._active:
            self._deadline = deadline
            if deadline < _WATCHDOG._wake_at:
                _WATCHDOG.watch(self)
        else:
            self._arm(timeout)
        try:
            return sched.switch(request)
        finally:
            # Only within the same step: a greenlet of an abandoned step ends later.
            # The watchdog stays armed (the step's end disarms it): with the step's own
            # deadline, or with none. A fire it decided on just before this still counts.
            if self._steps == step and self._call is not None and self._call[0] == replica:
                self._call = None
                self._timeout = step_timeout
                self._deadline = self._step_deadline

    # ---- one step ------------------------------------------------------------------------
    def _replica_greenlets(self) -> List[Any]:
        """The replica greenlets for a step under the current greenlet, when those of the
        last step cannot serve (``step`` reuses them when that step ended cleanly, under
        the same scheduler; a step that did not end cleanly dropped them)."""
        gls = self._greenlets
        # Set again once every greenlet is ready: an interrupt in between (a greenlet that
        # dies while it starts, say) leaves none that the next step would take as ready.
        self._greenlets = None
        parent = _getcurrent()
        me = threading.get_ident()
        if gls is None or self._owner != me:
            if self._abandoned and self._owner == me:
                self._bury()
            # Greenlets belong to the thread that made them.
            gls = [_Greenlet(self._main) for _ in range(self.n)]
            self._owner = me
            self._abandoned = gls
        for r, g in enumerate(gls):
            if g.dead:
                gls[r] = g = _Greenlet(self._main)
            if g.parent is not parent:
                g.parent = parent
            if not g:
                g.switch()  # started: it waits for its first task (see _replica_main)
        self._greenlets = gls
        self._parent = parent
        return gls

    def step(
        self,
        fn: Callable[..., Any],
        per_replica: Sequence[Tuple[Tuple[Any, ...], Optional[Dict[str, Any]]]],
        entries: Sequence[context.Entry],
        timeout: float,
    ) -> List[Any]:
        """Runs ``fn`` once per replica; returns the N results (None for a failed one).
        Exceptions of the replicas land in ``failures``; a replica still running after
        ``timeout`` seconds raises StepTimeout here."""
        n = self.n
        failures: List[Failure]
        self.failures = failures = []
        results: List[Any] = [None] * n
        # While this frame runs, the step runs (the watchdog's test, see _fire).
        self._step_frame = _getframe()
        local = context._local
        saved = local.stack
        gls = self._greenlets
        if gls is None or _getcurrent() is not self._parent:
            # Not the greenlets of the last step, which ended cleanly under this scheduler.
            gls = self._replica_greenlets()
        # Marked broken until the step ends cleanly: a KeyboardInterrupt between any two
        # lines below leaves greenlets suspended in this step, and the next step must not
        # resume them (they are this step's to bury, see the end).
        self._greenlets = None
        self._abandoned = gls
        self._results = results
        self._stacks = self._abandoned_stacks = [[e] for e in entries]
        msgs: List[Any]
        self._msgs = msgs = [None] * n
        self._waiting = 0
        self._lost = False
        self._new_step()
        # Each replica has a contextvars context of its own (the greenlet's). When the
        # caller has context variables, each replica starts the step from a copy of them.
        base: Optional[contextvars.Context]
        base = contextvars.copy_context()
        if not len(base):
            base = None
        if timeout < _INF:
            self._arm(timeout)
        try:
            self._running = gls
            # Every replica runs until its first meeting (or its end); then, while every
            # replica waits at a meeting, the meeting is resolved and each resumed with
            # its outcome. The scheduler's loop (_drive, in C) does both and comes back
            # here when a replica failed or returned while others wait. Each switch
            # (_resume, in C, also used by the releases below) notes what the replica
            # switched back with: a request in _msgs (counted in _waiting), its result
            # in _results, or its failure (_note_failure; after an exception out of the
            # switch itself, the step's greenlets are marked lost).
            _drive(self, gls, fn, per_replica, base, local, saved, self._resolve)
            while self._waiting:
                if failures:
                    if not all(isinstance(f.error, Exception) for f in failures):
                        # Ctrl-C, SystemExit, the timeout: return now; the suspended
                        # replicas are dropped with their greenlets.
                        break
                    # A replica failed: release the waiting ones.
                    self._release([r for r in range(n) if msgs[r] is not None], msgs, failures[0], gls)
                elif self._waiting < n:
                    self._release_early_return([r for r in range(n) if msgs[r] is not None], msgs, gls)
                else:
                    _drive(self, gls, None, None, None, local, saved, self._resolve)
            if not self._waiting and not self._lost:
                # Every replica is back at the head of its loop: reusable.
                self._greenlets = gls
                self._abandoned = None
        except (InlineTimeout, KeyboardInterrupt):
            # The watchdog's interrupt landed in the scheduler itself (between replicas).
            if self._fired:
                call = self._fired_call
                if call is not None:
                    missing = [r for r in range(n) if msgs[r] is None]
                    raise self._call_timeout(call, missing) from None
                raise StepTimeout(timeout, [], "the step was interrupted by its timeout") from None
            raise
        finally:
            self._running = None
            local.stack = saved
            fired = self._disarm() if self._active else 0
            self._step_frame = None
            # The step's results and requests are the caller's now: the runner keeps no
            # reference to them (they may be large) until the next step.
            self._results = self._msgs = None
            if self._greenlets is None and self._abandoned is gls:
                # Cut short (a timeout, Ctrl-C): the replicas still suspended in it end
                # now, their finally blocks run, as an interrupted plain Python program's
                # frames unwind, and their frames let go of the step's inputs.
                self._bury()
        if fired:
            self._timeout_failures(failures, timeout, fired)
        return results

    def _new_step(self) -> None:
        # A call's deadline belongs to one step (see _meet_within).
        self._steps += 1
        self._call = self._fired_call = None

    def _note_failure(self, r: int, error: BaseException) -> None:
        """Replica ``r`` failed with ``error`` (its function raised, or its greenlet died)."""
        self.failures.append(Failure(next(self._order), r, error))

    def _release(self, waiting: List[int], msgs: List[Any], first: Failure, gls: List[Any]) -> None:
        """A replica failed: the ones waiting at a meeting raise AbortedError."""
        e = first.error
        for r in waiting:
            req = as_request(msgs[r])
            _resume(
                self,
                gls,
                context._local,
                r,
                None,
                AbortedError(
                    f"replica {r}: released from {req.describe()} because replica {first.replica} raised "
                    f"{type(e).__name__}: {e}"
                ),
            )

    def _release_early_return(self, waiting: List[int], msgs: List[Any], gls: List[Any]) -> None:
        """Some replicas returned while others wait: they can never meet."""
        done = [r for r in range(self.n) if r not in waiting]
        calls = "; ".join(f"replica {r} waits in {as_request(msgs[r]).describe()}" for r in waiting)
        for r in waiting:
            err = MismatchError(
                f"replica {r}: {calls}, but replica(s) {names(done)} returned from the replica function "
                "without making that call; every replica must make the same collective, merge_call and "
                "variable-update calls in the same order"
            )
            err.replica = r  # type: ignore[attr-defined]
            _resume(self, gls, context._local, r, None, err)

    def _timeout_failures(self, failures: List[Failure], timeout: float, fired: int) -> None:
        """After the watchdog fired: the replica it interrupted failed with InlineTimeout
        (or, on the main thread, KeyboardInterrupt); that is a timeout of the step, or of
        the meeting whose own timeout it was (the replica that waited there reports it,
        as in threads mode)."""
        call, self._fired_call = self._fired_call, None
        for f in failures:
            e = f.error
            if isinstance(e, InlineTimeout) or (fired == 2 and isinstance(e, KeyboardInterrupt)):
                if call is not None:
                    raise self._call_timeout(call, [f.replica])
                raise StepTimeout(
                    timeout,
                    [f.replica],
                    (
                        f"replica {f.replica} did not reach a meeting or return within {timeout:g} s; inline "
                        "replicas take turns on one thread, so a replica that waits for another one outside "
                        "the strategy's collectives (an Event, a queue) cannot go on: use "
                        "execution='threads' for such code"
                    ),
                )

    @staticmethod
    def _call_timeout(call: Tuple[int, Request, float], missing: List[int]) -> CollectiveTimeoutError:
        """The error of a call whose own timeout passed while its first replica waited."""
        waiter, request, t = call
        err = CollectiveTimeoutError(
            f"replica {waiter}: {request.describe()} timed out after {t:g} s: replica(s) {names(missing)} never "
            "arrived (inline replicas take turns on one thread: the replica that had not arrived was interrupted)"
        )
        err.replica = waiter  # type: ignore[attr-defined]
        return err

    # ---- watchdog ------------------------------------------------------------------------
    def _arm(self, timeout: float) -> None:
        # No lock: the watchdog reads _active before _deadline, and these are written in
        # the opposite order, so it never pairs this step's flag with a stale deadline
        # (and _fire checks both again under the lock).
        deadline = _monotonic() + timeout
        self._thread_id = _get_ident()
        self._timeout = timeout
        self._deadline = deadline
        self._fired = 0
        self._active = True
        # Steps that end in time cost the watchdog nothing: it is told only when this
        # deadline comes before the one it sleeps until.
        if self._registered != _forks[0] or deadline < _WATCHDOG._wake_at:
            _WATCHDOG.watch(self)

    def _disarm(self) -> int:
        # No lock: a Ctrl-C must not land in a lock's acquire in the step's finally. So
        # a watchdog that saw the step still active (its frame runs until this finally
        # is done) may send its interrupt just after this read of _fired; that interrupt
        # then lands after the step. The window is a few bytecodes at the deadline.
        self._active = False
        fired = self._fired
        if fired:
            self._fired = 0
        if fired:
            # An exception the watchdog sent but the thread has not raised yet must not
            # surface after the step.
            set_async_exception(self._thread_id, None)
        return fired

    def _fire(self, now: float) -> None:
        """Called by the watchdog thread once the deadline has passed. On the main thread
        (with Python's default SIGINT handler) a SIGINT interrupts the replica wherever it
        is, a blocking C call included; on other threads an asynchronous exception
        interrupts Python code (a blocked C call only when it returns). Only one of the
        two is ever sent, so no second exception lands in the handling of the first."""
        with self._wd_lock:
            if not self._active or now < self._deadline or self._fired:
                return
            tid = self._thread_id
            if not executing(self._step_frame, tid):
                # A step interrupted before it could disarm: nothing runs it any more.
                self._active = False
                self._step_frame = None
                return
            call = self._call
            if call is not None and not self._call_waits(call[0]):
                # The call's own timeout bounds only the wait for the others: every
                # replica has reached it (it is being resolved), or its first replica is
                # past it. The step's deadline applies again.
                self._deadline = self._step_deadline
                return
            self._fired_call = call
            if tid == main_thread_id() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._fired = 2
                signal.pthread_kill(tid, signal.SIGINT)  # type: ignore[arg-type]
            else:
                self._fired = 1
                set_async_exception(tid, InlineTimeout)

    def _call_waits(self, first: int) -> bool:
        """Whether replica ``first`` (the first at a call with a timeout of its own) still
        waits there for a replica that has not arrived. Read on the watchdog's thread:
        single reads of a list that the scheduler changes in place."""
        msgs = self._msgs
        if msgs is None or msgs[first] is None:
            return False
        return any(m is None for m in msgs)

    def close(self) -> None:
        """Drops the replica greenlets (a suspended one is ended by the garbage collector)."""
        self._greenlets = None
        _WATCHDOG.forget(self)

    def __repr__(self) -> str:
        return f"InlineRunner(num_replicas={self.n})"


# The scheduler a replica of a step being buried sees (see InlineRunner._bury): never a
# greenlet, so every meeting it tries is refused.
_BURYING = object()


def _report_cleanup_error(replica: int, error: BaseException) -> None:
    """An error raised by the cleanup (``finally``) of a replica of a step that was cut
    short: nobody waits for it any more, so it goes where Python reports such errors."""
    hook_args = types.SimpleNamespace(
        exc_type=type(error),
        exc_value=error,
        exc_traceback=error.__traceback__,
        err_msg=f"Exception ignored in the cleanup of replica {replica}, whose step was cut short",
        object=None,
    )
    sys.unraisablehook(hook_args)


class _Watchdog:
    """One daemon thread for the process: ends inline steps that outlive their timeout.

    A step stores its deadline in its runner; the thread sleeps until the nearest active
    deadline (or for the shortest timeout when no step runs, so a step that starts while
    it computes its next wake-up is seen within one timeout), then interrupts the runners
    whose deadline has passed. Steps that end in time cost one lock and no wake-up.

    Only plain locks, whose acquire and release are single C calls: a Ctrl-C on the
    caller's thread lands before or after them, never half-way. (A Condition's or an
    Event's methods are Python code; an interrupt inside one could leave its lock held,
    and every later step and close of any inline strategy would wait for it.) The thread
    sleeps on ``_bell``, a lock it holds, which ``_ring`` releases to wake it.
    """

    def __init__(self) -> None:
        self._runners: weakref.WeakSet[InlineRunner] = weakref.WeakSet()
        self._pid = 0
        self.after_fork_in_child()

    def after_fork_in_child(self) -> None:
        """No thread, fresh locks (in a forked child: the parent's watchdog thread is
        gone, and with it any lock it held)."""
        self._lock = threading.Lock()
        self._bell = threading.Lock()
        self._bell.acquire()
        self._running = False
        self._wake_at = math.inf

    def _ring(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:
            pass  # already rung: the thread wakes once for both

    def watch(self, runner: InlineRunner) -> None:
        with self._lock:
            self._runners.add(runner)
            runner._registered = _forks[0]
            if not self._running or self._pid != os.getpid():
                self._pid = os.getpid()
                # Marked running once started: an interrupt between the two at worst
                # leaves a second loop later, and firing is idempotent (_fire).
                start_daemon(self._loop, "distvals-inline-watchdog")
                self._running = True
        self._ring()

    def forget(self, runner: InlineRunner) -> None:
        with self._lock:
            self._runners.discard(runner)

    def _loop(self) -> None:
        while True:
            due: List[InlineRunner] = []
            with self._lock:
                now = _monotonic()
                nearest = math.inf
                shortest = math.inf
                for r in list(self._runners):
                    shortest = min(shortest, r._timeout)
                    if r._active:
                        if r._deadline <= now and not r._fired:
                            due.append(r)
                        else:
                            nearest = min(nearest, r._deadline)
                # No strong reference to a runner may survive into the wait: it would keep
                # its strategy (and the strategy's threads) from being collected.
                r = None  # type: ignore[assignment]
                if nearest == math.inf:
                    nearest = now + shortest
                self._wake_at = nearest
            if not due:
                # Until the nearest deadline, or a ring (a new runner, an earlier deadline).
                self._bell.acquire(True, -1 if nearest == math.inf else min(max(nearest - now, 0.001), _MAX_WAIT))
                continue
            for r in due:
                r._fire(now)
            r = None  # type: ignore[assignment]
            due = []


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.after_fork_in_child)
# Lock.acquire takes timeouts up to threading.TIMEOUT_MAX; a longer wait is cut short.
_MAX_WAIT = min(threading.TIMEOUT_MAX, 86400.0)
