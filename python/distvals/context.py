"""Which strategy is in force and where code runs: cross-replica or replica context.

Each thread keeps its own stack of (strategy, replica context) entries:

- outside any scope the default strategy is in force, in its default replica context
  (``get_replica_context()`` is a ReplicaContext with one replica);
- ``with strategy.scope():`` pushes (strategy, None): cross-replica context;
- inside ``strategy.run`` each replica thread has (strategy, its ReplicaContext);
- ``merge_fn`` of ``ReplicaContext.merge_call`` runs in cross-replica context again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ._core import install_scope_exit

if TYPE_CHECKING:  # pragma: no cover
    from .local_extended import LocalExtended
    from .options import CommunicationOptions
    from .reduce_op import ReduceOp
    from .strategy import Strategy

    # An entry of a thread's context stack: the strategy in force and the replica
    # context, None in cross-replica context.
    Entry = Tuple[Strategy, Optional["ReplicaContext"]]

__all__ = [
    "ReplicaContext",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class _Local(threading.local):
    def __init__(self) -> None:
        # Entries are (strategy, replica_context or None); empty means the strategy set
        # with experimental_set_strategy, else the default.
        self.stack: List[Entry] = []
        self.base: Optional[Entry] = None
        # (entry, i) while extended.update runs its function on copy i in the
        # cross-replica context `entry` (see UpdateCopy).
        self.updating: Optional[Tuple[Entry, int]] = None


_local = _Local()
_default_strategy: Optional[Strategy] = None
_default_replica_context: Optional[ReplicaContext] = None
# Set by distvals.strategy when it is imported: makes the default strategy. This module
# needs no import of the strategy module (which imports this one).
default_strategy_factory: Optional[Callable[[], Strategy]] = None


def _defaults() -> Entry:
    global _default_strategy, _default_replica_context
    if _default_strategy is None:
        factory = default_strategy_factory
        if factory is None:
            raise RuntimeError("distvals.context: the default strategy is made once distvals.strategy is imported")
        strategy = factory()
        _default_replica_context = strategy.extended._contexts[0]
        _default_strategy = strategy
    return _default_strategy, _default_replica_context


def _stack() -> List[Entry]:
    """This thread's context stack."""
    return _local.stack


def _top() -> Entry:
    s = _local.stack
    if s:
        return s[-1]
    base = _local.base
    if base is not None:
        return base
    return _defaults()


def get_replica_context() -> Optional[ReplicaContext]:
    """The current ReplicaContext, or None in cross-replica context.

    Outside any ``strategy.scope()`` this is the default strategy's replica context (one
    replica); inside a scope it is None; inside ``strategy.run`` it is the replica's
    context; inside ``merge_call``'s ``merge_fn`` it is None again.
    """
    s = _local.stack
    if s:
        return s[-1][1]
    if _local.base is not None:
        return None
    return _defaults()[1]


def in_cross_replica_context() -> bool:
    """True inside a ``strategy.scope()`` (or a ``merge_fn``), outside ``strategy.run``."""
    s = _local.stack
    if s:
        return s[-1][1] is None
    return _local.base is not None


def get_strategy() -> Strategy:
    """The strategy in force: the one whose scope or ``run`` we are in, else the default
    strategy (one replica, no threads)."""
    return _top()[0]


def has_strategy() -> bool:
    """True when a strategy other than the default one is in force."""
    return _top()[0] is not _defaults()[0]


def current_run_context() -> Optional[ReplicaContext]:
    """The ReplicaContext when called inside ``strategy.run``, else None."""
    s = _local.stack
    if s:
        ctx = s[-1][1]
        if ctx is not None and ctx._in_run:
            return ctx
    return None


class _Scope:
    """What ``strategy.scope()`` returns: a context manager.

    As TensorFlow's: entering the scope of the strategy already in force (nested, or
    re-entering the same object) only counts, and the matching exit only uncounts; the
    exit of the scope that made the strategy current makes it no longer current, in
    whatever order the scopes are left. So the stack never holds stale entries and
    ``has_strategy()`` is False once the outermost scope is left."""

    __slots__ = ("_again", "_entry", "_strategy")

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._entry = (strategy, None)
        self._again = 0

    def __enter__(self) -> Strategy:
        strategy = self._strategy
        current, ctx = _top()
        default = _defaults()[0]
        if current is not default and current is not strategy:
            raise RuntimeError(
                f"mixing different strategies: cannot enter the scope of {strategy!r} inside "
                f"the scope (or run) of {current!r}; leave that scope first"
            )
        if current is strategy and ctx is not None:
            raise RuntimeError(
                f"cannot enter {strategy!r}'s scope inside strategy.run (replica "
                f"{ctx.replica_id_in_sync_group}): it needs cross-replica context; use "
                "get_replica_context().merge_call() to run code there"
            )
        # A Ctrl-C handled right after the change below (before the with statement has
        # taken over, so __exit__ would never run) undoes it: no scope stays entered.
        if current is strategy:
            try:
                self._again += 1
            except BaseException:
                self._again -= 1
                raise
        else:
            stack = _local.stack
            try:
                stack.append(self._entry)
            except BaseException:
                _drop(stack, self._entry)
                raise
        return strategy

    def __exit__(self, *exc: object) -> None:
        # Replaced below by the same steps written in C (distvals._core): a Python
        # __exit__ begins with a check for signals, so a Ctrl-C landing there would raise
        # before the scope is left, and leave it entered for good.
        if self._again:
            self._again -= 1
        else:
            _drop(_local.stack, self._entry)

    def __repr__(self) -> str:
        return f"_Scope({self._strategy!r})"


def _drop(stack: List[Entry], entry: Entry) -> None:
    """Removes ``entry`` (by identity) from ``stack``, the innermost first."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            del stack[i]
            return


install_scope_exit(_Scope, _local)


class _NullScope:
    """The default strategy's scope: nothing to enter."""

    def __enter__(self) -> Strategy:
        return _defaults()[0]

    def __exit__(self, *exc: object) -> None:
        return None


class CrossReplica:
    """Pushes cross-replica context of ``strategy`` on this thread (merge_fn, updates)."""

    __slots__ = ("_entry",)

    def __init__(self, strategy: Strategy) -> None:
        self._entry = (strategy, None)

    def __enter__(self) -> None:
        _local.stack.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        s = _local.stack
        if s and s[-1] is self._entry:
            s.pop()


class UpdateCopy(CrossReplica):
    """The cross-replica context in which ``extended.update`` runs its function on copy
    ``i`` of a variable: there the strategy's distributed variables read and update
    their copy ``i`` only, as in TensorFlow (so an optimizer's function that updates a
    slot variable updates the slot's matching copy, once)."""

    __slots__ = ("_i", "_saved")

    def __init__(self, strategy: Strategy, i: int) -> None:
        super().__init__(strategy)
        self._i = i
        self._saved: Optional[Tuple[Entry, int]] = None

    def __enter__(self) -> None:
        super().__enter__()
        self._saved = _local.updating
        _local.updating = (self._entry, self._i)

    def __exit__(self, *exc: object) -> None:
        _local.updating = self._saved
        super().__exit__(*exc)


def updating_copy(strategy: Strategy) -> Optional[int]:
    """The copy of ``strategy``'s variables that ``extended.update`` is updating in the
    current context, or None."""
    u = _local.updating
    if u is None:
        return None
    s = _local.stack
    entry = u[0]
    return u[1] if s and s[-1] is entry and entry[0] is strategy else None


def experimental_set_strategy(strategy: Optional[Strategy]) -> None:
    """Makes ``strategy`` the current strategy of this thread, as if its scope were
    entered and left open; ``None`` clears it (back to the default strategy). As in
    TensorFlow, a plain function (it returns None) that must not be called inside a
    strategy's scope or ``run``; a strategy it set is replaced by the next call."""
    if _local.stack:
        raise RuntimeError("experimental_set_strategy must not be called inside a strategy's scope or run")
    if strategy is None or strategy is _defaults()[0]:
        _local.base = None
    else:
        _local.base = (strategy, None)


class ReplicaContext:
    """The view of one replica inside ``strategy.run``.

    ``replica_id_in_sync_group`` (0..N-1), ``num_replicas_in_sync``, ``strategy``;
    collectives ``all_reduce`` and ``all_gather`` (every replica must call them, in the
    same order), and ``merge_call`` to run code once in cross-replica context.
    """

    __slots__ = ("_entry", "_ext", "_in_run", "_num_replicas", "_replica_id", "_strategy")

    def __init__(
        self,
        strategy: Strategy,
        replica_id_in_sync_group: int,
        *,
        _in_run: bool = True,
        _num_replicas: Optional[int] = None,
    ) -> None:
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)
        self._num_replicas = strategy.num_replicas_in_sync if _num_replicas is None else _num_replicas
        if not 0 <= self._replica_id < self._num_replicas:
            raise ValueError(
                f"replica_id_in_sync_group {replica_id_in_sync_group} is out of range for {self._num_replicas} replicas"
            )
        self._in_run = _in_run
        self._entry = (strategy, self)
        self._ext: Optional[LocalExtended] = None  # the strategy's extended object, set by it (a shortcut)

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, 0..num_replicas_in_sync-1."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step in sync, over every worker of a multi-worker
        strategy (1 in the default replica context)."""
        return self._num_replicas

    @property
    def strategy(self) -> Strategy:
        """The strategy whose ``run`` this replica belongs to (the default strategy in the
        default replica context)."""
        return self._strategy

    @property
    def devices(self) -> Tuple[str, ...]:
        """This replica's device, as a one-element tuple."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def _require_current(self, what: str) -> None:
        """Refuses a collective unless this is the context of the ``strategy.run`` now
        running on this thread: a context kept from a finished run (or used from another
        thread) would wait for replicas that never come and leave the group timed out."""
        if not self._in_run:
            return  # the default strategy's context: one replica, no collective to wait for
        s = _local.stack
        if s and s[-1][1] is self and self._strategy.extended._step_active:
            return
        raise RuntimeError(
            f"ReplicaContext.{what} of replica {self._replica_id} called outside the strategy.run "
            "that made it (after that run returned, from another thread, or from merge_fn); "
            "call dv.get_replica_context() inside strategy.run and use that context"
        )

    def all_reduce(
        self, reduce_op: Union[ReduceOp, str], value: Any, options: Optional[CommunicationOptions] = None
    ) -> Any:
        """All-reduce ``value`` (an array, number or nested structure of them) across the
        replicas with ``reduce_op`` (a ReduceOp or a string such as "sum"); every replica
        gets the result. Leaves of one dtype travel together in one engine call. Integer
        MEAN gives float64 (float32 for 8- and 16-bit integers, as TensorFlow's division).
        An ``IndexedSlices`` leaf (SUM or MEAN only) is not added element by element: as in
        TensorFlow, every replica gets an IndexedSlices of every replica's indices and
        values concatenated in replica order (MEAN divides the values by the number of
        replicas), its dense_shape kept; replicas may pass different numbers of rows.
        Only inside the ``strategy.run`` this context belongs to."""
        ext = self._ext
        s = _local.stack
        if not (s and s[-1][1] is self and ext is not None and ext._step_active):
            self._require_current("all_reduce")
            ext = self._strategy.extended
        return ext._replica_all_reduce(self, reduce_op, value, options)

    def all_gather(self, value: Any, axis: int, options: Optional[CommunicationOptions] = None) -> Any:
        """Concatenate every replica's ``value`` (nested structures too) along ``axis``;
        sizes may differ along ``axis`` only."""
        self._require_current("all_gather")
        return self._strategy.extended._replica_all_gather(self, value, axis, options)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context,
        after every replica has called ``merge_call``; arguments that differ across
        replicas arrive as PerReplica values. Every replica gets the result (its own part
        when the result is a PerReplica)."""
        self._require_current("merge_call")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"merge_call: args must be a list or tuple, got {type(args).__name__}")
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise ValueError(f"merge_call: kwargs must be a dict, got {type(kwargs).__name__}")
        return self._strategy.extended._merge_call(self, merge_fn, tuple(args), kwargs)

    def __enter__(self) -> ReplicaContext:
        _local.stack.append(self._entry)
        return self

    def __exit__(self, *exc: object) -> None:
        s = _local.stack
        if not s or s[-1] is not self._entry:
            raise RuntimeError("replica contexts were exited out of order (or from another thread)")
        s.pop()

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, num_replicas_in_sync={self._num_replicas})"
