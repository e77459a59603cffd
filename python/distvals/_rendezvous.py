"""Per-replica calls on top of a single-call collective.

N threads, one per replica, each call ``meet`` with their own arguments. The last one
to arrive checks that all agree, runs the collective once over everybody's arguments
and hands each replica its own result. Every wait is bounded; an abort, a timeout or a
bad argument in one replica reaches all of them, naming the replica.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._core import AbortedError, CollectiveTimeoutError, MismatchError

__all__ = ["Rendezvous"]


class Rendezvous:
    """The meeting point of ``n`` replicas; one collective at a time."""

    def __init__(self, n: int, timeout_seconds: float):
        self._n = n
        self._timeout = float(timeout_seconds)
        self._cond = threading.Condition()
        self._posted: List[Optional[Tuple[Any, Any, Optional[BaseException]]]] = [None] * n
        self._arrived = 0
        self._round = 0          # rounds started (all replicas arrived)
        self._completed = 0      # rounds whose results are available
        self._last: Tuple[int, Optional[Sequence[Any]], Optional[BaseException]] = (-1, None, None)
        self._failure: Optional[BaseException] = None
        self._inside = 0

    def _raise_failure(self) -> None:
        raise copy.copy(self._failure)

    def meet(self, replica: int, key: Any, args: Any, run_all: Callable[[List[Any]], Sequence[Any]],
             timeout_seconds: Optional[float] = None, error: Optional[BaseException] = None) -> Any:
        """Post ``args`` (or this replica's argument ``error``) and return this replica's
        part of ``run_all([args of replica 0, ..., args of replica n-1])``.

        Every replica must pass an equal ``key`` (the collective and its shape), or all
        of them raise MismatchError.
        """
        timeout = self._timeout if timeout_seconds is None else float(timeout_seconds)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._failure is not None:
                self._raise_failure()
            if self._posted[replica] is not None:
                raise RuntimeError(f"replica {replica} called twice in one collective")
            self._inside += 1
            try:
                self._posted[replica] = (key, args, error)
                self._arrived += 1
                my_round = self._round
                if self._arrived == self._n:
                    return self._run(replica, my_round, run_all)
                while self._completed <= my_round:
                    if self._failure is not None:
                        self._raise_failure()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._time_out(replica, my_round, timeout)
                    self._cond.wait(min(left, 0.05))
                return self._result(replica, my_round)
            finally:
                self._inside -= 1

    # Called with the lock held by the last replica to arrive.
    def _run(self, replica: int, my_round: int, run_all: Callable[[List[Any]], Sequence[Any]]) -> Any:
        posted = list(self._posted)
        self._posted = [None] * self._n
        self._arrived = 0
        self._round += 1
        results: Optional[Sequence[Any]] = None
        exc: Optional[BaseException] = None
        bad = next((j for j, p in enumerate(posted) if p[2] is not None), None)
        if bad is not None:
            e = posted[bad][2]
            exc = type(e)(f"{e} (reported by replica {bad})") if bad != replica else e
        else:
            key0 = posted[0][0]
            odd = next((j for j, p in enumerate(posted) if p[0] != key0), None)
            if odd is not None:
                exc = MismatchError(
                    f"distvals: replicas called different collectives: replica 0 called {key0}, "
                    f"replica {odd} called {posted[odd][0]}"
                )
            else:
                self._cond.release()
                try:
                    results = run_all([p[1] for p in posted])
                except BaseException as e:  # noqa: BLE001 - delivered to every replica
                    exc = e
                finally:
                    self._cond.acquire()
        self._last = (my_round, results, exc)
        self._completed = my_round + 1
        self._cond.notify_all()
        return self._result(replica, my_round)

    def _result(self, replica: int, my_round: int) -> Any:
        round_, results, exc = self._last
        assert round_ == my_round
        if exc is not None:
            raise copy.copy(exc)
        return None if results is None else results[replica]

    def _time_out(self, replica: int, my_round: int, timeout: float) -> None:
        if self._round == my_round:
            missing = [str(j) for j, p in enumerate(self._posted) if p is None]
            why = f"replica(s) {', '.join(missing)} never arrived"
        else:
            why = "the collective did not finish"
        self._failure = CollectiveTimeoutError(
            f"distvals: collective timed out after {timeout:g} s in replica {replica}: {why}"
        )
        self._cond.notify_all()
        self._raise_failure()

    def abort(self, replica: int, why: str) -> None:
        """Release every waiting replica with AbortedError naming ``replica``; later
        calls fail the same way until ``reset``."""
        with self._cond:
            if self._failure is None:
                who = f" by replica {replica}" if replica >= 0 else ""
                e = AbortedError(f"distvals: collective aborted{who}: {why}")
                e.replica = replica
                self._failure = e
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def reset(self) -> None:
        """Clear a failure; only when no replica is inside ``meet``."""
        with self._cond:
            if self._inside:
                raise RuntimeError("reset() called while replicas are inside a collective")
            self._failure = None
            self._posted = [None] * self._n
            self._arrived = 0
