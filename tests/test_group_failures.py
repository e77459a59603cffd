"""ReplicaGroup when a replica fails or never comes: timeouts (per group, per call, from the
environment), abort and reset, closed groups, and Ctrl-C in a blocked collective."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from conftest import PER_REPLICA_METHODS, SINGLE_CALL_METHODS, assert_replicas_close, call_collective, run_threads

import distvals as dv

# ---- timeouts ------------------------------------------------------------------------------------


def test_missing_replica_times_out_naming_it():
    with dv.ReplicaGroup(3, timeout_seconds=0.2) as g:
        # Replicas 0 and 1 come; replica 2 never does.
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, np.ones(4, np.float32)), timeout=30)
        assert all(isinstance(e, TimeoutError) for e in errs), errs
        assert any("replica(s) 2 never arrived" in str(e) for e in errs), errs
        assert g.aborted
        g.reset()
        bufs = [np.ones(4, np.float32) * (r + 1) for r in range(3)]
        g.all_reduce(bufs)
        assert_replicas_close(bufs, np.full(4, 6.0), np.float32)


def test_timeout_seconds_must_be_a_number():
    with pytest.raises(TypeError, match="timeout_seconds must be a number"):
        dv.ReplicaGroup(2, timeout_seconds="5")
    with pytest.raises(TypeError, match="timeout_seconds must be a number"):
        dv.ReplicaGroup(2, timeout_seconds=True)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_seconds must be positive"):
            dv.ReplicaGroup(2, timeout_seconds=bad)


@pytest.mark.parametrize("seconds", [0.0004, 1e-4])
def test_sub_millisecond_timeouts_are_kept(seconds):
    with dv.ReplicaGroup(2, timeout_seconds=seconds) as g:
        assert g.timeout_seconds == pytest.approx(seconds)
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="never arrived"):
            g.replica_all_reduce(0, np.ones(4, np.float32))
        assert time.monotonic() - t0 < 2
        g.reset()
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:  # per call, too
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError):
            g.replica_all_reduce(0, np.ones(4, np.float32), timeout_seconds=seconds)
        assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("seconds", [float("inf"), 2.0**70, 1e308])
def test_infinite_and_huge_timeouts_mean_no_timeout(seconds):
    with dv.ReplicaGroup(2, timeout_seconds=seconds) as g:
        assert g.timeout_seconds == float("inf")
        # still cancellable: abort releases the waiter at once
        timer = threading.Timer(0.1, g.abort, args=(1, "stop"))
        timer.start()
        with pytest.raises(dv.AbortedError, match="stop"):
            g.replica_all_reduce(0, np.ones(4, np.float32))
        timer.join()


@pytest.mark.parametrize(
    "value,want", [("inf", float("inf")), ("1e308", float("inf")), ("0.0004", 0.0004), ("  7.5 ", 7.5)]
)
def test_timeout_environment_variable(monkeypatch, value, want):
    monkeypatch.setenv("DISTVALS_TIMEOUT_SECONDS", value)
    with dv.ReplicaGroup(2) as g:
        assert g.timeout_seconds == pytest.approx(want)


@pytest.mark.parametrize("value", ["five", "-3", "0", "nan", "5s"])
def test_garbage_timeout_environment_variable_warns_and_uses_the_default(monkeypatch, value):
    monkeypatch.setenv("DISTVALS_TIMEOUT_SECONDS", value)
    with pytest.warns(RuntimeWarning, match="DISTVALS_TIMEOUT_SECONDS"):
        g = dv.ReplicaGroup(2)
    with g:
        assert g.timeout_seconds == 300.0


# ---- abort and close ---------------------------------------------------------------------------


def test_abort_releases_waiters_with_replica_id():
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        err = []

        def waiter():
            try:
                g.replica_all_reduce(0, np.ones(4, np.float32))
            except Exception as e:
                err.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        g.abort(1, "ValueError in replica 1")
        t.join(10)
        assert not t.is_alive()
        assert isinstance(err[0], dv.AbortedError) and err[0].replica == 1
        assert "ValueError in replica 1" in str(err[0])


@pytest.mark.parametrize("method", SINGLE_CALL_METHODS + PER_REPLICA_METHODS)
def test_closed_group_refuses_every_method(method):
    g = dv.ReplicaGroup(2)
    g.close()
    g.close()  # idempotent
    assert g.closed
    arrays = [np.ones(4, np.float32), np.ones(4, np.float32)]
    errs = call_collective(g, method, arrays)
    for e in errs:
        assert isinstance(e, dv.ClosedError), e
    np.testing.assert_array_equal(arrays[0], 1)


@pytest.mark.parametrize("method", ["replica_all_reduce", "replica_all_gather", "replica_broadcast"])
def test_close_while_another_thread_waits(method):
    g = dv.ReplicaGroup(3, timeout_seconds=60)
    out = {}

    def waiter():
        t0 = time.monotonic()
        try:
            getattr(g, method)(0, np.ones(8, np.float32))
        except BaseException as e:
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    g.close()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(out["error"], dv.ClosedError), out
    assert out["took"] < 5
    with pytest.raises(dv.ClosedError):
        g.all_reduce([np.ones(2, np.float32)] * 3)


# ---- Ctrl-C ------------------------------------------------------------------------------------


def _sigint_main_after(delay: float) -> threading.Thread:
    main = threading.main_thread().ident

    def fire():
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_keyboard_interrupt_during_a_blocked_collective_returns_within_a_second():
    # Replica 2 never arrives; the timeout is a minute. Ctrl-C must end the wait.
    g = dv.ReplicaGroup(3, timeout_seconds=60)
    other = {}

    def replica1():
        t0 = time.monotonic()
        try:
            g.replica_all_reduce(1, np.ones(8, np.float32))
        except BaseException as e:
            other["error"] = e
        other["at"] = time.monotonic()
        other["took"] = other["at"] - t0

    t1 = threading.Thread(target=replica1, daemon=True)
    t1.start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        firing = _sigint_main_after(0.3)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            g.replica_all_reduce(0, np.ones(8, np.float32))
        returned = time.monotonic()
        firing.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert returned - t0 < 0.3 + 1.0, f"returned after {returned - t0:.2f} s"
    t1.join(5)
    assert not t1.is_alive()
    # The other waiting replica is released too, with AbortedError naming no replica.
    assert isinstance(other["error"], dv.AbortedError), other
    assert other["error"].replica == -1 and "interrupted" in str(other["error"])
    assert other["at"] - t0 < 0.3 + 1.0
    # The group is usable again after reset().
    assert g.aborted
    g.reset()
    bufs = [np.full(4, r, np.float32) for r in range(3)]
    _, errs = run_threads(3, lambda r: g.replica_all_reduce(r, bufs[r], timeout_seconds=10))
    assert errs == [None] * 3
    for b in bufs:
        np.testing.assert_array_equal(b, np.full(4, 3.0, np.float32))
    g.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_custom_signal_handler_exception_reaches_the_caller():
    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop("stop requested")

    g = dv.ReplicaGroup(2, timeout_seconds=60)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        _sigint_main_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(Stop, match="stop requested"):
            g.replica_all_gather(0, np.ones(3, np.int32))
        assert time.monotonic() - t0 < 1.2
    finally:
        signal.signal(signal.SIGINT, previous)
    g.reset()
    g.close()
