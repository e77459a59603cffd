"""What the two ways of running replicas share: meetings, failures, fork safety.

A strategy runs one step (``strategy.run``) by calling the replica function once per
replica. Two runners do that, chosen per strategy (see ``MirroredStrategy(execution=)``):

- ``distvals.replicas_inline.InlineRunner``: every replica is a coroutine (a greenlet)
  on the calling thread;
- ``distvals.replicas_threads.ThreadRunner``: one persistent thread per replica.

Both meet the same way. A replica that reaches a cross-replica point (a collective, a
``merge_call``, an aggregated variable update) hands the runner a ``Request`` and waits.
Once every replica has handed one in, the runner calls ``resolve(requests)`` once, on one
thread: it checks that the replicas asked for the same thing (else every replica gets
the same ``MismatchError``), runs the collective once for all of them in the engine's
single-call style, and returns one outcome per replica. Each replica then resumes with
its outcome (or raises the error it carries).

A replica that returns while others wait at a meeting, or that raises, is noticed at
once: the waiting replicas are released with ``MismatchError`` or ``AbortedError``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Type

if TYPE_CHECKING:  # pragma: no cover
    from _ctypes import CFuncPtr

__all__ = [
    "QUICK",
    "QUICK_ALL_REDUCE",
    "QUICK_TREE",
    "Failure",
    "Request",
    "Resolve",
    "StepTimeout",
    "TreeExtra",
    "as_request",
    "executing",
    "foreign_greenlet_error",
    "fork_generation",
    "names",
    "set_async_exception",
]


class Request:
    """What one replica asks for at a meeting.

    ``kind`` names the meeting ("all_reduce", "all_gather", "merge_call", ...);
    ``params`` are the arguments every replica must agree on (the op, the axis), as a
    tuple compared with ``==``; ``value`` is the replica's own value (a nested structure
    of arrays, or the merge function's arguments); ``extra`` carries what the resolver
    needs beside them (options, the original object of a variable update).
    """

    __slots__ = ("extra", "kind", "params", "timeout", "value")

    def __init__(
        self, kind: str, params: Tuple[Any, ...], value: Any, extra: Any = None, timeout: Optional[float] = None
    ) -> None:
        self.kind = kind
        self.params = params
        self.value = value
        self.extra = extra
        # The longest this replica waits for the others at this meeting (None: the
        # step's timeout); from CommunicationOptions passed to the call.
        self.timeout = timeout

    def describe(self) -> str:
        """How error messages name the call: ``all_reduce(SUM)``, ``merge_call``."""
        if not self.params:
            return self.kind
        return f"{self.kind}({', '.join(_show(p) for p in self.params)})"

    def __repr__(self) -> str:
        return f"Request({self.describe()})"


# The quick form of the commonest request, used by inline replicas: the tuple
# (QUICK_ALL_REDUCE, op, array) means an all-reduce of one array without options. It
# costs no object construction in the replica; ``as_request`` turns it into a Request
# wherever the general path needs one.
QUICK_ALL_REDUCE = object()
QUICK = ("quick",)  # the ``extra`` of a Request made from the quick form
# (QUICK_TREE, op, structure, leaves): an all-reduce of a list, tuple or dict of numpy
# arrays without options, its leaves already flattened; its outcome is the replica's
# result, packed as its structure (the general path's is a list of result leaves).
QUICK_TREE = object()


class TreeExtra(tuple):  # type: ignore[type-arg]
    """The ``extra`` (leaves, options) of a Request made from the quick tree form: the
    general path packs its outcome as the request's structure, as the quick path does."""

    __slots__ = ()


def as_request(m: Any) -> Request:
    """``m`` (a Request, or one of the quick tuple forms) as a Request."""
    if type(m) is tuple:
        if m[0] is QUICK_ALL_REDUCE:
            return Request("all_reduce", (m[1],), m[2], QUICK)
        if m[0] is QUICK_TREE:
            return Request("all_reduce", (m[1],), m[2], TreeExtra((m[3], None)))
    return m  # type: ignore[no-any-return]


def _show(p: Any) -> str:
    name = getattr(p, "name", None)
    return name if isinstance(name, str) else repr(p)


Resolve = Callable[[List[Request]], List[Any]]
"""``resolve(requests)``: one request per replica in, one outcome per replica out. An
outcome that is a ``Raise`` raises its error in its replica; anything else is returned."""


class Failure:
    """An exception raised by one replica during a step, with its order of arrival."""

    __slots__ = ("error", "order", "replica")

    def __init__(self, order: int, replica: int, error: BaseException) -> None:
        self.order = order
        self.replica = replica
        self.error = error

    def __repr__(self) -> str:
        return f"Failure(replica={self.replica}, error={self.error!r})"


class Raise:
    """An outcome that makes its replica raise ``error`` instead of returning."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class StepTimeout(Exception):
    """A step that did not finish within its timeout (turned into
    CollectiveTimeoutError by the strategy, which knows what to say)."""

    def __init__(self, timeout: float, stuck: Sequence[int], why: str = "") -> None:
        super().__init__(timeout, list(stuck), why)
        self.timeout = timeout
        self.stuck = list(stuck)
        self.why = why


def names(replicas: Sequence[int]) -> str:
    """``"0, 2"`` for error messages."""
    return ", ".join(str(r) for r in replicas)


# ---- fork ----------------------------------------------------------------------------
# Threads do not survive os.fork(): in the child, a runner's replica threads and the
# engine's worker threads are gone. Runners and strategies compare this counter with
# the one they were made under and rebuild what the child lacks.
fork_counter = [0]


def _after_fork_in_child() -> None:
    fork_counter[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """Counts the forks this process is a child of (0 in the original process)."""
    return fork_counter[0]


# ---- releasing a thread stuck in Python code --------------------------------------------
_set_async_exc: Optional[CFuncPtr]
try:
    # A handle of our own: ctypes.pythonapi's function objects are shared by every user
    # in the process, and setting argtypes on one would change it for all of them.
    _set_async_exc = ctypes.PyDLL(ctypes.pythonapi._name, handle=ctypes.pythonapi._handle).PyThreadState_SetAsyncExc
    # A pointer, not py_object: clearing takes NULL, which py_object cannot express.
    _set_async_exc.argtypes = (ctypes.c_ulong, ctypes.c_void_p)
    _set_async_exc.restype = ctypes.c_int
except (AttributeError, OSError):  # not CPython
    _set_async_exc = None


def set_async_exception(thread_id: Optional[int], exc_type: Optional[Type[BaseException]]) -> bool:
    """Makes ``exc_type`` raise in thread ``thread_id`` at its next Python bytecode
    (``None`` clears a pending one). A thread blocked in C (a lock, a sleep) sees it
    only once the call returns. False where the interpreter cannot do it."""
    if _set_async_exc is None or thread_id is None:
        return False
    # id() of a live type object is its address; the type outlives the pending call.
    done: int = _set_async_exc(thread_id, None if exc_type is None else id(exc_type))
    return done == 1


def executing(frame: Any, thread_id: Optional[int]) -> bool:
    """True while ``frame``, the frame of a function call on thread ``thread_id``, has
    not returned. Not by looking for the frame on the thread's current stack: an ``f_back``
    chain seen from another thread can end early (inside greenlets and generators), and a
    call that runs would look over. A running frame refuses ``clear()`` (and so does one
    suspended in a greenlet); clearing one that has returned drops its locals at once,
    running their finalizers on the calling thread (call it holding no lock that those
    might need). A thread that no longer exists runs nothing. (In a forked child, a
    thread of the child may have the id of one of the parent's, and the frame of that
    one stays "running": see the claims in ``LocalExtended._claim_step``.)"""
    if frame is None or thread_id not in sys._current_frames():
        return False
    try:
        frame.clear()
    except RuntimeError:
        return True
    return False


def main_thread_id() -> Optional[int]:
    return threading.main_thread().ident


def foreign_greenlet_error(replica: int, what: str) -> RuntimeError:
    """The error of a cross-replica call made from a greenlet that the replica function
    started (gevent, say), not from the replica's own: the scheduler would resume the
    replica's greenlet with the outcome, which the caller would never see."""
    return RuntimeError(
        f"replica {replica}: {what} was called from a greenlet started inside the replica function; "
        "inline replicas meet only from their own greenlet: call it from the replica function itself, "
        "or create the strategy with execution='threads'"
    )
