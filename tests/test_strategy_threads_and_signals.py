"""MirroredStrategy under signals, forks and concurrent callers, in both execution modes.

A KeyboardInterrupt may land between any two bytecodes of the runner; afterwards the
next run either works with its own step's data on every replica, or raises, and never
refuses forever. Strategies survive os.fork() in the child, a failed thread start
leaks no threads, and cross-replica calls from another thread never corrupt memory.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

import distvals as dv
from conftest import EXECUTION_MODES
from process_stats import os_threads, settle_threads

on_main_thread = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                    reason="signals are delivered to the main thread")


def replica_id() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def mirrored(n: int, execution: str, timeout: float = 20.0) -> dv.MirroredStrategy:
    return dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution,
                               communication_options=dv.CommunicationOptions(timeout_seconds=timeout))


def tagged_step(tag: int):
    """Every replica all-reduces a value made of the step's tag and its id."""
    v = np.full(8, tag * 10 + replica_id(), np.int64)
    return dv.get_replica_context().all_reduce("sum", v)


def check_step(out, tag: int, n: int) -> None:
    want = sum(tag * 10 + r for r in range(n))
    for r in range(n):
        got = np.asarray(out.values[r])
        assert np.all(got == want), f"step {tag}, replica {r}: {got} where {want} was due (steps mixed)"


class _Alarm(BaseException):
    """What the timer's handler raises: a stand-in for Ctrl-C."""


@on_main_thread
@pytest.mark.timeout(240, method="thread")
# The timer's KeyboardInterrupt may also land inside a finalizer the interpreter runs at
# that moment (a weak set's callback, say), which Python reports as "Exception ignored":
# that says nothing about the strategy, whose results are what this test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("execution", EXECUTION_MODES)
@pytest.mark.parametrize("seed", [11, 23, 37])
def test_interrupts_at_random_offsets_never_mix_steps_nor_refuse_forever(execution, seed):
    """Real signals at random microsecond offsets during thousands of steps: a timer
    (setitimer, SIGALRM; the test's own timeout watches from a thread meanwhile) whose
    handler raises KeyboardInterrupt, as Ctrl-C does."""
    n = 3
    steps = 1200
    rng = random.Random(seed)
    s = mirrored(n, execution)

    def handler(signum, frame):
        raise KeyboardInterrupt

    # Offsets spread over a few steps' time, so that many steps are interrupted, at every
    # point of the runner, and many complete (a step right after an interrupted one is
    # slower: it starts fresh coroutines or threads).
    times = []
    for tag in range(30):
        t0 = time.perf_counter()
        check_step(s.run(tagged_step, args=(tag,)), tag, n)
        times.append(time.perf_counter() - t0)
    span = 3.0 * sorted(times)[len(times) // 2]
    previous = signal.signal(signal.SIGALRM, handler)
    interrupted = completed = errors = 0
    try:
        for tag in range(steps):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, span))
                try:
                    out = s.run(tagged_step, args=(tag,))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
                continue
            except (dv.AbortedError, dv.CollectiveTimeoutError, RuntimeError) as e:
                # Allowed: a step that raises. Never a wrong result (checked below), and
                # a clean run afterwards must work (checked every 100 steps).
                errors += 1
                assert "already running" not in str(e), e
                continue
            check_step(out, tag, n)
            completed += 1
            if tag % 100 == 99:
                # Without the timer, the next run works at once, whatever came before.
                check_step(s.run(tagged_step, args=(10_000 + tag,)), 10_000 + tag, n)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    check_step(s.run(tagged_step, args=(99_999,)), 99_999, n)
    s.close()
    assert interrupted > steps // 20, f"only {interrupted} of {steps} steps were interrupted: the test did not bite"
    assert completed > steps // 20, f"only {completed} of {steps} steps completed"
    assert errors < steps // 4, f"{errors} steps raised"


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_cross_replica_calls_from_another_thread_while_run_loops(execution):
    """strategy.reduce of earlier results from a logging thread while the main thread
    loops on run: both get right numbers, nothing crashes."""
    n = 2
    s = mirrored(n, execution)
    stop = threading.Event()
    problems = []
    results = []

    def logger():
        try:
            while not stop.is_set():
                if results:
                    tag, out = results[-1]
                    total = s.reduce("SUM", out, axis=None)
                    want = n * sum(tag * 10 + r for r in range(n))
                    if not np.all(np.asarray(total) == want):
                        problems.append(f"reduce of step {tag}: {total} != {want}")
        except Exception as e:  # reported below
            problems.append(repr(e))

    t = threading.Thread(target=logger)
    t.start()
    try:
        deadline = time.monotonic() + 1.5
        tag = 0
        while time.monotonic() < deadline:
            out = s.run(tagged_step, args=(tag,))
            check_step(out, tag, n)
            results.append((tag, out))
            del results[:-2]
            tag += 1
    finally:
        stop.set()
        t.join(30)
        s.close()
    assert not t.is_alive()
    assert problems == []
    assert tag > 10


def _run_in_forked_child(body) -> int:
    """Runs ``body()`` in a forked child; the child's exit status (0 when body returns)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            body()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported through the exit status
            try:
                sys.stderr.write(f"child failed: {e!r}\n")
            finally:
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_a_strategy_works_in_a_forked_child(execution):
    n = 3
    s = mirrored(n, execution, timeout=5.0)
    check_step(s.run(tagged_step, args=(1,)), 1, n)

    def child():
        t0 = time.monotonic()
        for tag in range(2, 6):
            check_step(s.run(tagged_step, args=(tag,)), tag, n)
        assert time.monotonic() - t0 < 5

    with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nothing():
        code = _run_in_forked_child(child)
    assert code == 0
    check_step(s.run(tagged_step, args=(7,)), 7, n)  # the parent's strategy is untouched
    s.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_failed_thread_start_leaks_no_threads(monkeypatch):
    """Starting replica threads stops half-way (an address-space limit, say): the
    threads already started are stopped, and the error reaches the caller."""
    gc.collect()
    base = settle_threads(os_threads())
    real_start = threading.Thread.start
    started = []

    def failing_start(self):
        if self.name.startswith("distvals-replica") and len(started) >= 3:
            raise RuntimeError("can't start new thread")
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        mirrored(8, "threads")
    monkeypatch.undo()
    assert len(started) == 3
    gc.collect()
    assert settle_threads(base) <= base
    with mirrored(2, "threads") as s:  # and the next strategy starts fine
        check_step(s.run(tagged_step, args=(3,)), 3, 2)


def test_closing_a_strategy_with_a_stuck_replica_prints_nothing(monkeypatch):
    """No 'Exception in thread ...' from a replica thread when its strategy is closed or
    dropped while the replica is still busy."""
    reports = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reports.append(args))
    release = threading.Event()
    s = mirrored(2, "threads", timeout=0.3)

    def stuck():
        if replica_id() == 1:
            release.wait(1.0)

    with pytest.raises(dv.CollectiveTimeoutError):
        s.run(stuck)
    s.close()
    del s
    gc.collect()
    release.set()
    time.sleep(0.3)
    assert reports == []


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_big_endian_and_timedelta_values_are_reduced(execution):
    with mirrored(2, execution) as s:
        def step():
            r = replica_id()
            big = np.arange(4, dtype=">f8") + r
            dt = np.array([r + 1, 2 * r], dtype="timedelta64[s]")
            ctx = dv.get_replica_context()
            return ctx.all_reduce("sum", big), ctx.all_reduce("sum", dt)

        big, dt = s.run(step)
        for r in range(2):
            np.testing.assert_array_equal(big.values[r], 2 * np.arange(4) + 1)
            np.testing.assert_array_equal(dt.values[r], np.array([3, 2], dtype="timedelta64[s]"))
