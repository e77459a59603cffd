"""ReplicaGroup when a replica fails or never comes: timeouts (per group, per call, from the
environment), abort and reset, closed groups, Ctrl-C and signal handlers in a blocked
collective, and both call styles used at once from several threads."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from _group_helpers import ALGOS, PER_REPLICA, SINGLE, _call, check_all, reduce_ref, run_threads

import distvals as dv

# ---- timeouts ------------------------------------------------------------------------------


def test_missing_replica_times_out_naming_it():
    g = dv.ReplicaGroup(3, timeout_seconds=0.2)
    errs = []

    def replica(r):
        try:
            g.replica_all_reduce(r, np.ones(4, np.float32))
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert len(errs) == 2
    assert any("replica(s) 2 never arrived" in str(e) for e in errs)
    assert all(isinstance(e, TimeoutError) for e in errs)
    assert g.aborted
    g.reset()
    bufs = [np.ones(4, np.float32) * (r + 1) for r in range(3)]
    g.all_reduce(bufs)
    check_all(bufs, np.full(4, 6.0), np.float32)


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


# ---- abort and close -----------------------------------------------------------------------


def test_abort_releases_waiters_with_replica_id():
    g = dv.ReplicaGroup(2, timeout_seconds=60)
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


@pytest.mark.parametrize("replica", [2, -2, 1.0, True, "1"])
def test_abort_refuses_a_replica_that_does_not_exist(replica):
    g = dv.ReplicaGroup(2, timeout_seconds=60)
    with pytest.raises(ValueError, match=r"replica must be -1 or a replica id in 0\.\.1"):
        g.abort(replica, "stop")
    assert not g.aborted  # refused before anything changed
    xs = [np.ones(2, np.float32), np.full(2, 2.0, np.float32)]
    g.all_reduce(xs)  # in place
    np.testing.assert_array_equal(xs[0], [3.0, 3.0])
    np.testing.assert_array_equal(xs[1], [3.0, 3.0])
    g.abort(np.int64(-1), "from outside")
    assert g.aborted


def test_closed_group_raises():
    g = dv.ReplicaGroup(2)
    g.close()
    g.close()  # idempotent
    with pytest.raises(dv.ClosedError):
        g.all_reduce([np.ones(2, np.float32), np.ones(2, np.float32)])
    assert g.closed


@pytest.mark.parametrize("method", SINGLE + PER_REPLICA)
def test_closed_group_refuses_every_method(method):
    g = dv.ReplicaGroup(2)
    g.close()
    arrays = [np.ones(4, np.float32), np.ones(4, np.float32)]
    errs = _call(g, method, arrays)
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


# ---- Ctrl-C and signal handlers ------------------------------------------------------------


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


# ---- concurrency: several groups, both call styles, buffers held while a replica waits -----


def test_two_groups_from_two_threads_at_once():
    """Single-call groups driven from two Python threads, plus two per-replica groups
    driven by their own replica threads, all at the same time."""
    errors = []

    def single_call_loop(k):
        with dv.ReplicaGroup(3) as g:
            for it in range(200):
                bufs = [np.full(1000 + k, k * 100 + r + it, np.int64) for r in range(3)]
                want = reduce_ref(bufs, "sum", np.int64)
                g.all_reduce(bufs, algorithm=ALGOS[it % 4])
                for r, b in enumerate(bufs):
                    if not np.array_equal(b, want):
                        errors.append(f"group {k} iteration {it} replica {r}")
                        return

    def per_replica_group(k, n):
        g = dv.ReplicaGroup(n, timeout_seconds=30)

        def replica(r):
            for it in range(100):
                x = np.full(17, k * 1000 + r + it, np.float64)
                g.replica_all_reduce(r, x)
                want = sum(k * 1000 + j + it for j in range(n))
                if not np.all(x == want):
                    raise AssertionError(f"group {k} iteration {it} replica {r}: {x[0]} != {want}")

        _, errs = run_threads(n, replica)
        g.close()
        errors.extend(str(e) for e in errs if e is not None)

    ts = [threading.Thread(target=single_call_loop, args=(k,)) for k in range(2)]
    ts += [threading.Thread(target=per_replica_group, args=(k + 2, n)) for k, n in enumerate((2, 3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert errors == []


def _run_script(body: str, timeout: float = 120):
    """Runs `body` in a fresh interpreter (a crash must fail the test, not end the run)."""
    import subprocess
    import sys
    import textwrap

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_buffer_export_is_held_while_the_replica_waits():
    """A bytearray passed to a per-replica call cannot be resized while the engine may
    still write into it: the resize raises BufferError, and the result is right."""
    out = _run_script("""
        import threading, time
        import numpy as np
        import distvals as dv

        g = dv.ReplicaGroup(2, timeout_seconds=60)
        for attempt in range(3):
            ba = bytearray(range(64))
            other = np.arange(64, dtype=np.uint8)
            errors = []
            t = threading.Thread(target=lambda: g.replica_all_reduce(0, ba))
            t.start()
            time.sleep(0.1)  # replica 0 now waits inside the engine for replica 1
            try:
                ba.extend(b"x" * 100000)
                errors.append("resized while the engine held it")
            except BufferError:
                pass
            g.replica_all_reduce(1, other)
            t.join(30)
            assert not t.is_alive()
            assert errors == [], errors
            want = (np.arange(64) * 2).astype(np.uint8)
            assert bytes(ba) == want.tobytes(), bytes(ba)
            ba.extend(b"ok")  # released once the call returned
        print("fine")
    """)
    assert "fine" in out


def test_both_call_styles_from_three_threads_never_crash_or_corrupt():
    """One thread in the single-call style, two in the per-replica style, on one group:
    the engine serializes them; every result is right and nobody fails."""
    out = _run_script("""
        import threading, time
        import numpy as np
        import distvals as dv

        g = dv.ReplicaGroup(2, timeout_seconds=60)
        rounds = 400  # both replicas run the same number of per-replica collectives
        done = threading.Event()
        problems = []
        counts = [0, 0]

        def per_replica(r):
            x = np.zeros(5000, np.float32)
            for it in range(rounds):
                x[:] = r + 1 + it
                try:
                    g.replica_all_reduce(r, x)
                except Exception as e:
                    problems.append(repr(e)); return
                if not np.all(x == 3 + 2 * it):
                    problems.append(f"replica {r} round {it}: {x[:3]}")
                if r == 0:
                    counts[0] += 1

        def single():
            a, b = np.zeros(5000, np.float32), np.zeros(5000, np.float32)
            while not done.is_set():
                a[:] = 10; b[:] = 20
                try:
                    g.all_reduce([a, b])
                except Exception as e:
                    problems.append(repr(e)); return
                if not (np.all(a == 30) and np.all(b == 30)):
                    problems.append("single call wrong")
                counts[1] += 1

        ts = [threading.Thread(target=per_replica, args=(r,)) for r in range(2)]
        s = threading.Thread(target=single)
        for t in ts + [s]:
            t.start()
        for t in ts:
            t.join(120)
        done.set()
        s.join(60)
        assert not any(t.is_alive() for t in ts + [s]), "a thread hung"
        assert problems == [], problems[:5]
        assert counts[0] == rounds and counts[1] > 0, counts
        print("fine", counts)
    """)
    assert "fine" in out


@pytest.mark.parametrize("caller", ["single_call", "per_replica", "inline", "threads"])
def test_interpreter_exit_while_a_daemon_thread_is_in_a_collective(caller):
    """The main thread returns while a daemon thread loops over collectives: the process
    exits with status 0 (no abort or crash from the thread taking the GIL back), five
    times in a row, and the daemon thread's results were right while it ran."""
    body = f"""
        import threading, time
        import numpy as np
        import distvals as dv

        caller = {caller!r}
        done = [0]
        bad = []

        def check(y, want):
            if not np.all(y == want):
                bad.append((float(y.flat[0]), want))
            done[0] += 1

        if caller in ("single_call", "per_replica"):
            g = dv.ReplicaGroup(2, timeout_seconds=600)
        else:
            s = dv.MirroredStrategy(["cpu:0", "cpu:1"], execution=caller)

        def loop(r=0):
            # Big enough that the thread spends most of its time in the engine.
            xs = [np.full(1 << 17, 3.0 + j, np.float32) for j in range(2)]
            outs = [np.empty_like(x) for x in xs]
            while True:
                if caller == "single_call":
                    g.all_reduce(xs, "sum", out=outs)
                    for y in outs:
                        check(y, 7.0)
                elif caller == "per_replica":
                    x = np.full(1 << 17, 3.0 + r, np.float32)
                    g.replica_all_reduce(r, x, "sum")
                    check(x, 7.0)
                else:
                    out = s.run(lambda: dv.get_replica_context().all_reduce(
                        "SUM", xs[dv.get_replica_context().replica_id_in_sync_group]))
                    for y in s.experimental_local_results(out):
                        check(y, 7.0)

        for r in range(2 if caller == "per_replica" else 1):
            threading.Thread(target=loop, args=(r,), daemon=True).start()
        deadline = time.monotonic() + 30
        while done[0] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done[0] >= 20 and bad == [], (done, bad[:3])
        print("ok")
    """
    for _ in range(5):
        assert _run_script(body).strip() == "ok"


def test_two_threads_passing_the_same_replica_index_get_an_error_at_once():
    """A second thread in a call as replica 0 (while the first waits for replica 1) is
    refused at once with an error naming the replica, instead of both waiting out the
    timeout; the first call then completes with the right values once replica 1 comes."""
    g = dv.ReplicaGroup(2, timeout_seconds=60)
    first = np.full(5, 1.0)
    done = []
    t = threading.Thread(target=lambda: done.append(g.replica_all_reduce(0, first)))
    t.start()
    time.sleep(0.1)  # replica 0's first caller now waits inside the engine
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^replica 0: another thread is already in a call as this replica"):
        g.replica_all_reduce(0, np.full(5, 7.0))
    assert time.monotonic() - t0 < 5
    second = np.full(5, 2.0)
    g.replica_all_reduce(1, second)
    t.join(30)
    assert not t.is_alive() and done == [None]
    np.testing.assert_array_equal(first, np.full(5, 3.0))
    np.testing.assert_array_equal(second, np.full(5, 3.0))
    g.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_while_a_bad_argument_is_reported_is_raised_then_not_later():
    # Replica 0 passes a list (not an array) and reports it to the others, waiting for
    # replica 1, which never comes; Ctrl-C arrives meanwhile. It must be raised by this
    # call, not kept to surface from the next successful one (of another group even).
    g = dv.ReplicaGroup(2, timeout_seconds=30)
    g2 = dv.ReplicaGroup(2, timeout_seconds=10)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        firing = _sigint_main_after(0.3)
        with pytest.raises(KeyboardInterrupt):
            g.replica_all_reduce(0, [1.0] * 8)
        firing.join()
        bufs = [np.full(4, r + 1.0, np.float32) for r in range(2)]
        t = threading.Thread(target=g2.replica_all_reduce, args=(1, bufs[1]), daemon=True)
        t.start()
        g2.replica_all_reduce(0, bufs[0])  # completes, and raises nothing
        t.join(10)
        for b in bufs:
            np.testing.assert_array_equal(b, np.full(4, 3.0, np.float32))
    finally:
        signal.signal(signal.SIGINT, previous)
        g.close()
        g2.close()


def test_ctrl_c_while_a_replica_reads_its_arguments_aborts_the_others_not_reports_a_bad_argument():
    # Ctrl-C landing while replica 0's array is read (here: raised by the array-like's own
    # protocol) is not a bad argument of replica 0: the others are released with
    # AbortedError naming no replica, as from an interrupted wait, and their arrays keep
    # their values.
    class Interrupting:
        @property
        def __array_interface__(self):
            raise KeyboardInterrupt

        def __dlpack__(self, *args, **kwargs):
            raise KeyboardInterrupt

        def __dlpack_device__(self):
            raise KeyboardInterrupt

    g = dv.ReplicaGroup(3, timeout_seconds=10)
    bufs = {r: np.full(4, r + 1.0, np.float32) for r in (1, 2)}
    errors = {}

    def replica(r):
        try:
            g.replica_all_reduce(r, bufs[r])
        except BaseException as e:  # recorded for the asserts
            errors[r] = e

    threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in (1, 2)]
    try:
        for t in threads:
            t.start()
        with pytest.raises(KeyboardInterrupt):
            g.replica_all_reduce(0, Interrupting())
        for t in threads:
            t.join(10)
        for r in (1, 2):
            e = errors.get(r)
            assert isinstance(e, dv.AbortedError) and e.replica == -1, f"replica {r}: {e!r}"
            assert "interrupted (KeyboardInterrupt)" in str(e), f"replica {r}: {e}"
            np.testing.assert_array_equal(bufs[r], np.full(4, r + 1.0, np.float32))
        # After reset() the group works again.
        g.reset()
        outs = [np.full(4, r + 1.0, np.float32) for r in range(3)]
        g.all_reduce(outs)
        for o in outs:
            np.testing.assert_array_equal(o, np.full(4, 6.0, np.float32))
    finally:
        g.close()


def test_a_refused_single_call_leaves_the_group_aborted():
    # An abort stays until reset(): a single call refused meanwhile must not clear it,
    # or a late per-replica caller would wait for replicas that already left.
    g = dv.ReplicaGroup(3, timeout_seconds=30)
    try:
        x = [np.ones(4, np.float32) for _ in range(3)]
        errors = {}

        def replica(r):
            try:
                g.replica_all_reduce(r, x[r])
            except Exception as e:
                errors[r] = e

        ts = [threading.Thread(target=replica, args=(r,), daemon=True) for r in (0, 1)]
        for t in ts:
            t.start()
        time.sleep(0.2)
        g.abort(1, "stop")
        for t in ts:
            t.join(10)
        assert all(isinstance(errors[r], dv.AbortedError) for r in (0, 1))
        with pytest.raises(dv.AbortedError):
            g.all_reduce([np.ones(2) for _ in range(3)])
        assert g.aborted
        t0 = time.monotonic()
        late = threading.Thread(target=replica, args=(2,), daemon=True)
        late.start()
        late.join(10)
        assert not late.is_alive() and time.monotonic() - t0 < 5
        assert isinstance(errors[2], dv.AbortedError), errors.get(2)
        np.testing.assert_array_equal(x[2], np.ones(4, np.float32))
        g.reset()
        g.all_reduce(x)
        for a in x:
            np.testing.assert_array_equal(a, np.full(4, 3.0, np.float32))
    finally:
        g.close()


def test_first_calls_with_converted_inputs_from_several_threads_at_once_do_not_deadlock():
    # The first conversion of a non-numpy array (here memoryviews) imports a Python
    # helper; replicas making their first calls together must not deadlock the process
    # on it (it did in about half of fresh processes). Each try is a fresh process.
    import subprocess
    import sys

    script = (
        "import threading, numpy as np, distvals\n"
        "g = distvals.ReplicaGroup(4, timeout_seconds=10)\n"
        "bufs = [bytearray(np.full(8, r, np.float32).tobytes()) for r in range(4)]\n"
        "ts = [threading.Thread(target=g.replica_all_reduce, args=(r, memoryview(bufs[r]).cast('f'))) "
        "for r in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert all(np.frombuffer(b, np.float32).tolist() == [6.0] * 8 for b in bufs)\n"
    )
    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
