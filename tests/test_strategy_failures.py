"""MirroredStrategy when things go wrong, in both execution modes: exceptions in replicas,
timeouts, Ctrl-C and other signals, closing, concurrent callers, resources over many
steps, and os.fork().

Every failure must release the other replicas quickly, name the replica, keep the
original traceback and leave the strategy usable. A KeyboardInterrupt may land between
any two bytecodes of the runner; afterwards the next run either works with its own
step's data on every replica, or raises, and never refuses forever."""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import EXECUTION_MODES, fork_with_deadline
from process_stats import forks_while_threads_allocate, needs_plain_malloc, os_threads, rss_bytes, settle_threads
from strategy_checks import LONG, assert_usable, frames_of, mirrored, on_main_thread, replica_id

import distvals as dv
from distvals.options import DEFAULT_TIMEOUT_SECONDS


@pytest.fixture(scope="module", params=EXECUTION_MODES)
def s3(request):
    """Three replicas that wait a minute at most (conftest's wait the default 300 s)."""
    s = mirrored(3, execution=request.param)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's own SIGINT handler for every test here, as in an interactive program: a
    process started in the background by a shell without job control (``cmd &`` in a
    script, ``nohup``) begins with SIGINT ignored, and then the inline watchdog cannot
    interrupt a blocked call on the main thread (see the SIG_IGN test below)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def tagged_step(tag: int):
    """Every replica all-reduces a value made of the step's tag and its id."""
    v = np.full(8, tag * 10 + replica_id(), np.int64)
    return dv.get_replica_context().all_reduce("sum", v)


def check_step(out, tag: int, n: int) -> None:
    want = sum(tag * 10 + r for r in range(n))
    for r in range(n):
        got = np.asarray(out.values[r])
        assert np.all(got == want), f"step {tag}, replica {r}: {got} where {want} was due (steps mixed)"


# ---- an exception in one replica ----------------------------------------------------------


class StepError(Exception):
    pass


@pytest.mark.parametrize("where", ["before", "during", "after"])
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_exception_around_a_collective_releases_the_others(s3, where, bad):
    """Replica 0 is the first to run (the caller's thread, or the first coroutine inline),
    replica 2 the last: inline, a failing replica 1 leaves one replica waiting in the
    collective and one not started yet."""

    def failing_step():
        r = replica_id()
        ctx = dv.get_replica_context()
        if where == "before" and r == bad:
            raise StepError("broken batch")
        value = np.full(4, r, np.float32)
        if where == "during" and r == bad:
            value = object()  # not an array: refused inside the collective
        out = ctx.all_reduce("sum", value)
        if where == "after" and r == bad:
            raise StepError("broken after the collective")
        return out

    t0 = time.monotonic()
    expected = TypeError if where == "during" else StepError
    with pytest.raises(expected) as info:
        s3.run(failing_step)
    took = time.monotonic() - t0
    assert took < 5, f"the other replicas were released after {took:.1f} s"
    err = info.value
    assert str(err).startswith(f"replica {bad}: "), str(err)
    assert getattr(err, "replica", None) == bad
    # The original traceback reaches the caller: the failing function's frame is on it.
    assert "failing_step" in frames_of(err), frames_of(err)
    if where != "during":
        # The replica's own exception, unchanged, is the cause; the message only gains
        # the replica's name.
        cause = err.__cause__
        message = "broken batch" if where == "before" else "broken after the collective"
        assert isinstance(cause, StepError) and str(cause) == message, repr(cause)
        assert cause.__traceback__ is not None
        assert str(err) == f"replica {bad}: {message}", str(err)
    assert_usable(s3)


def test_exception_inside_a_collective_of_a_replica_thread_names_it(execution):
    """The failing replica is a worker thread (or coroutine) while replica 0 waits."""
    s = mirrored(2, execution=execution)
    try:

        def step():
            ctx = dv.get_replica_context()
            if replica_id() == 1:
                return ctx.all_reduce("sum", object())
            return ctx.all_reduce("sum", np.ones(2))

        t0 = time.monotonic()
        with pytest.raises(TypeError, match="^replica 1: ") as info:
            s.run(step)
        assert time.monotonic() - t0 < 5
        assert info.value.replica == 1
        assert_usable(s)
    finally:
        s.close()


class OddError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")
        self.code = code


def test_exception_with_unusual_constructor(s2):
    def fn():
        if dv.get_replica_context().replica_id_in_sync_group == 1:
            raise OddError(7, "odd")

    with pytest.raises(OddError, match="replica 1: code 7: odd") as info:
        s2.run(fn)
    assert info.value.code == 7


def test_exception_in_merge_fn_and_before_merge_call(s3):
    # KeyError too: its str() quotes its argument.
    for make_error, text in (
        (lambda: ArithmeticError("merge failed"), "merge failed"),
        (lambda: KeyError("from merge"), "from merge"),
    ):

        def merge_raises():
            def merge_fn(strategy, v):
                raise make_error()

            return dv.get_replica_context().merge_call(merge_fn, args=(replica_id(),))

        t0 = time.monotonic()
        with pytest.raises(type(make_error()), match=text) as info:
            s3.run(merge_raises)
        assert time.monotonic() - t0 < 5
        assert "merge_fn" in frames_of(info.value)
        assert_usable(s3)

    def one_skips_merge():
        if replica_id() == 1:
            raise StepError("no merge today")
        return dv.get_replica_context().merge_call(lambda strategy: 1)

    t0 = time.monotonic()
    with pytest.raises(StepError, match="^replica 1: no merge today") as info:
        s3.run(one_skips_merge)
    assert time.monotonic() - t0 < 5
    assert info.value.replica == 1 and "one_skips_merge" in frames_of(info.value)
    assert_usable(s3)


def test_exception_in_a_variable_update_changes_no_copy(s3):
    with s3.scope():
        v = dv.Variable(np.arange(3, dtype=np.float32), aggregation=dv.VariableAggregation.MEAN)
    start = [np.array(x, copy=True) for x in v.values]

    def bad_update():
        r = replica_id()
        v.assign_add(np.ones(3 if r != 1 else 4, np.float32))

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="^replica 1: ") as info:
        s3.run(bad_update)
    assert time.monotonic() - t0 < 5
    assert info.value.replica == 1 and "bad_update" in frames_of(info.value)
    for r, (x, x0) in enumerate(zip(v.values, start)):
        np.testing.assert_array_equal(np.asarray(x), x0, err_msg=f"replica {r}'s copy changed")
    # A good update afterwards keeps every copy equal: the mean of 0, 1, 2 added.
    s3.run(lambda: v.assign_add(np.full(3, replica_id(), np.float32)))
    for r, x in enumerate(v.values):
        np.testing.assert_array_equal(np.asarray(x), start[0] + 1.0, err_msg=f"replica {r}")


def test_exception_in_a_dataset_iterator(s3):
    def batches():
        for i in range(6):
            if i == 3:
                raise OSError("the input file went away")
            yield np.arange(6, dtype=np.float32) + 10 * i

    sums = []
    with pytest.raises(OSError, match="the input file went away") as info:
        for batch in s3.experimental_distribute_dataset(batches()):
            out = s3.run(lambda b: dv.get_replica_context().all_reduce("sum", b.sum()), args=(batch,))
            sums.append(float(out.values[0]))
    assert "batches" in frames_of(info.value)
    assert sums == [float(np.sum(np.arange(6) + 10 * i)) for i in range(3)]
    assert_usable(s3)

    def dataset_fn(input_context):
        raise LookupError("no shard for this pipeline")

    with pytest.raises(LookupError, match="no shard"):
        for _ in s3.distribute_datasets_from_function(dataset_fn):
            pass
    assert_usable(s3)


# ---- timeouts: per call, per strategy, per step ---------------------------------------------


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_per_call_timeout_option(collective, execution):
    """CommunicationOptions(timeout_seconds=) passed to one call overrides the
    strategy's minute; the error comes from a replica that waited there and names the
    replica that never arrived (threads: the others wait for a replica still busy in its
    own code; inline: the watchdog interrupts the busy replica once the first one has
    waited at the call for its timeout)."""
    s = mirrored(3, timeout=20.0, execution=execution)
    opts = dv.CommunicationOptions(timeout_seconds=0.3)
    release = threading.Event()

    def step():
        ctx = dv.get_replica_context()
        if replica_id() == 2:
            release.wait(5.0)  # busy well past the call's timeout
        if collective == "all_reduce":
            return ctx.all_reduce("sum", np.ones(3), options=opts)
        return ctx.all_gather(np.ones(3), axis=0, options=opts)

    try:
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError) as info:
            s.run(step)
        took = time.monotonic() - t0
        assert 0.25 < took < 2.5, took
        msg = str(info.value)
        # A replica that waited (threads: whichever wait ended first; inline: the first).
        assert info.value.replica in ((0,) if execution == "inline" else (0, 1)), msg
        assert msg.startswith(f"replica {info.value.replica}: "), msg
        assert f"{collective}" in msg and "timed out after 0.3" in msg, msg
        assert "replica(s) 2 never arrived" in msg, msg
        assert isinstance(info.value, TimeoutError)
        assert_usable(s)  # threads: replica 2's thread is still busy: a fresh one runs this step
        out = s.run(lambda: dv.get_replica_context().all_reduce("sum", replica_id() + 1.0, options=opts))
        assert [float(v) for v in s.experimental_local_results(out)] == [6.0] * 3
    finally:
        release.set()
        s.close()


def test_per_call_timeout_lasts_only_until_its_meeting_is_resolved(execution):
    """After a call with a short timeout of its own is resolved, the replicas may run
    longer than that timeout before the step ends: only the step's timeout applies."""
    s = mirrored(2, timeout=20.0, execution=execution)
    opts = dv.CommunicationOptions(timeout_seconds=0.2)
    try:

        def step():
            ctx = dv.get_replica_context()
            x = ctx.all_reduce("sum", np.full(2, replica_id() + 1.0), options=opts)
            time.sleep(0.4)  # each replica, in turn when inline: 0.8 s in all
            return ctx.all_reduce("max", x + replica_id())

        out = s.run(step)
        for r, v in enumerate(s.experimental_local_results(out)):
            np.testing.assert_array_equal(v, np.full(2, 4.0))
        assert_usable(s)
    finally:
        s.close()


def test_a_caught_timeout_never_pairs_a_late_call_with_a_later_one(execution):
    """A replica that catches its call's timeout and goes on to another collective must
    not meet the late replica's first call there (the sum of two different calls' values,
    with no error): every later collective of the step raises, the step fails, and the
    next step is right."""
    s = mirrored(2, timeout=20.0, execution=execution)
    quick = dv.CommunicationOptions(timeout_seconds=0.2)
    got = {}

    def step():
        ctx = dv.get_replica_context()
        r = replica_id()
        if r == 1:
            time.sleep(0.6)  # late for the first call
        try:
            got[r, "a"] = float(ctx.all_reduce("sum", np.float64(1 + r), options=quick))
        except dv.CollectiveTimeoutError:
            got[r, "a"] = "timeout"
        got[r, "b"] = float(ctx.all_reduce("sum", np.float64(100 * (1 + r))))
        return got[r, "b"]

    try:
        with pytest.raises((dv.CollectiveTimeoutError, dv.AbortedError)) as info:
            s.run(step)
        # A sum of the two calls' values (1 + 200 or 2 + 100) would be a wrong result.
        wrong = {k: v for k, v in got.items() if v not in ("timeout", 3.0, 300.0)}
        assert not wrong, (wrong, got)
        assert "timed out after 0.2" in str(info.value), str(info.value)
        out = s.run(lambda: dv.get_replica_context().all_reduce("sum", np.float64(replica_id() + 1)))
        assert [float(v) for v in s.experimental_local_results(out)] == [3.0, 3.0]
    finally:
        s.close()


def test_strategy_timeout_option(execution):
    s = mirrored(2, timeout=0.4, execution=execution)
    release = threading.Event()
    try:

        def step():
            if replica_id() == 1:
                release.wait(3.0)  # never reaches the collective in time
            return dv.get_replica_context().all_reduce("max", np.ones(2))

        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="0.4 s") as info:
            s.run(step)
        assert time.monotonic() - t0 < 2
        msg = str(info.value)
        if execution == "threads":
            # Replica 0 waits in the collective and names the replica that never came.
            assert msg.startswith("replica 0: ") and "replica(s) 1 never arrived" in msg, msg
        else:
            # Inline, the step's watchdog ends the busy replica and names it.
            assert msg.startswith("replica 1: ") and "still running: 1" in msg, msg
        assert_usable(s)
    finally:
        release.set()
        s.close()


def test_default_timeout_is_finite(monkeypatch):
    monkeypatch.delenv("DISTVALS_TIMEOUT_SECONDS", raising=False)
    assert DEFAULT_TIMEOUT_SECONDS == 300.0
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        assert s.extended._group.timeout_seconds == DEFAULT_TIMEOUT_SECONDS
    finally:
        s.close()
    monkeypatch.setenv("DISTVALS_TIMEOUT_SECONDS", "12.5")
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        assert s.extended._group.timeout_seconds == 12.5
    finally:
        s.close()


def test_run_waits_at_most_the_timeout(execution):
    s = dv.MirroredStrategy(
        ["CPU:0", "CPU:1"], communication_options=dv.CommunicationOptions(timeout_seconds=0.3), execution=execution
    )
    try:
        release = threading.Event()

        def fn():
            if dv.get_replica_context().replica_id_in_sync_group == 1:
                release.wait(20)

        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="did not finish within 0.3 s"):
            s.run(fn)
        assert time.monotonic() - t0 < 3
        # The next step works at once: a replica thread still stuck in the abandoned step
        # is replaced, never waited for or refused.
        assert s.run(lambda: 4) == 4
        release.set()
        assert s.run(lambda: 5) == 5
    finally:
        s.close()


def test_inline_timeout_with_sigint_ignored_ends_the_step_when_the_blocked_call_returns():
    # With SIGINT ignored the watchdog cannot interrupt a C call blocked on the main thread
    # (only a signal can); its exception lands as soon as the call returns: the step
    # still ends with the timeout's error, and the next one works.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    opts = dv.CommunicationOptions(timeout_seconds=0.3)
    with dv.MirroredStrategy(["CPU:0", "CPU:1"], communication_options=opts, execution="inline") as s:
        release = threading.Event()

        def fn():
            if replica_id() == 1:
                release.wait(1.0)
            return dv.get_replica_context().all_reduce("sum", np.full(2, replica_id() + 1.0))

        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="0.3 s"):
            s.run(fn)
        took = time.monotonic() - t0
        assert 0.9 < took < 5, took
        out = s.run(lambda: dv.get_replica_context().all_reduce("sum", np.full(2, replica_id() + 1.0)))
        for part in s.experimental_local_results(out):
            np.testing.assert_array_equal(part, [3.0, 3.0])


def test_inline_replicas_waiting_for_each_other_end_with_the_timeout():
    # A replica that waits for another outside the strategy's collectives cannot go on
    # inline; the step's timeout ends it with an error that says what to do.
    opts = dv.CommunicationOptions(timeout_seconds=0.5)
    with dv.MirroredStrategy(["CPU:0", "CPU:1"], communication_options=opts, execution="inline") as s:
        barrier = threading.Barrier(2, timeout=30)
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="execution='threads'"):
            s.run(barrier.wait)
        assert time.monotonic() - t0 < 5
        busy = threading.Event()

        def spin():
            while not busy.is_set():  # pure Python: the watchdog's exception lands here
                pass

        with pytest.raises(dv.CollectiveTimeoutError, match="did not reach a meeting or return within 0.5 s"):
            s.run(spin)
        assert s.run(lambda: 7) == 7


# ---- Ctrl-C and other signals -----------------------------------------------------------------


def _sigint_main_after(delay: float) -> None:
    main = threading.main_thread().ident

    def fire():
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def test_keyboard_interrupt_passes_through(s2):
    def fn():
        ctx = dv.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            raise KeyboardInterrupt
        ctx.all_reduce("sum", np.ones(3))

    with pytest.raises(KeyboardInterrupt):
        s2.run(fn)
    out = s2.run(lambda: dv.get_replica_context().all_reduce("max", np.arange(3.0)))
    np.testing.assert_array_equal(out.values[1], [0.0, 1.0, 2.0])


@on_main_thread
def test_ctrl_c_while_the_others_wait_in_a_collective(execution):
    s = mirrored(3, execution=execution)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:

        def step():
            if replica_id() == 0:
                time.sleep(LONG)  # the caller's thread: interrupted by Ctrl-C
            return dv.get_replica_context().all_reduce("sum", np.ones(4))

        _sigint_main_after(0.3)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.run(step)
        took = time.monotonic() - t0
        assert took < 0.3 + 1.0, f"returned {took:.2f} s after the start"
        assert_usable(s)

        # Replicas 0 and 2 have returned and the caller waits for replica 1, which
        # interrupts it, then blocks in a collective that only an abort can end.
        main = threading.main_thread().ident

        def interrupting():
            if replica_id() == 1:
                signal.pthread_kill(main, signal.SIGINT)
                dv.get_replica_context().all_reduce("sum", np.ones(2))

        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.run(interrupting)
        took = time.monotonic() - t0
        assert took < 1.0, f"returned {took:.2f} s after the start"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_usable(s)
    s.close()


@on_main_thread
def test_ctrl_c_while_replica_zero_waits_in_the_engine(execution):
    s = mirrored(3, execution=execution)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:

        def step():
            if replica_id() == 2:
                time.sleep(0.6)  # late: replicas 0 and 1 wait in the engine meanwhile
            return dv.get_replica_context().all_reduce("sum", np.ones(4))

        _sigint_main_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.run(step)
        took = time.monotonic() - t0
        assert took < 0.2 + 1.0, f"returned {took:.2f} s after the start"
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.6)
    assert_usable(s)
    s.close()


@on_main_thread
def test_ctrl_c_returns_within_a_second_while_a_replica_computes(execution):
    s = mirrored(2, timeout=10, execution=execution)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    release = threading.Event()
    try:

        def step():
            if replica_id() == 1:
                release.wait(4)  # a long computation of replica 1's own
            return dv.get_replica_context().all_reduce("sum", np.ones(4))

        _sigint_main_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            s.run(step)
        took = time.monotonic() - t0
        # The next step works at once, with this step's data on every replica: a thread
        # still busy in the interrupted step is replaced, never waited for or mixed in.
        t1 = time.monotonic()
        assert_usable(s)
        next_step = time.monotonic() - t1
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
        time.sleep(0.2)
        s.close()
    assert took < 0.2 + 1.0, f"returned {took:.2f} s after the start"
    assert next_step < 1.0, f"the next run took {next_step:.2f} s"


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
    s = mirrored(n, timeout=20.0, execution=execution)

    # The timer is process-directed: the kernel may hand it to another thread (an engine
    # worker) late, so that Python runs the handler on the main thread only after the
    # step it was meant for. It raises only while a step runs; a late one does nothing.
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
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
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, span))
                try:
                    out = s.run(tagged_step, args=(tag,))
                finally:
                    armed[0] = False
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


# ---- closing and aborting ---------------------------------------------------------------------


def test_closed_strategy_refuses_to_run(execution):
    s = mirrored(2, execution=execution)
    s.close()
    s.close()  # idempotent
    with pytest.raises(dv.ClosedError, match="is closed"):
        s.run(lambda: 1)


def test_closing_a_strategy_while_another_thread_runs_a_step_names_a_replica(execution):
    """close() from another thread while replicas loop on collectives: the step raises
    ClosedError as one of its replicas' errors (``replica k:``, ``.replica``), which each
    replica could catch where it waited, in both modes."""
    s = mirrored(2, timeout=20.0, execution=execution)
    x = np.ones(1 << 12, np.float32)
    started = threading.Event()
    caught = [0, 0]

    def fn():
        ctx = dv.get_replica_context()
        started.set()
        for _ in range(10**6):
            try:
                ctx.all_reduce("sum", x)
            except dv.ClosedError:
                caught[replica_id()] += 1
                raise

    got = []

    def caller():
        try:
            s.run(fn)
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=caller)
    t.start()
    assert started.wait(10)
    time.sleep(0.05)
    s.close()
    t.join(20)
    assert not t.is_alive()
    (e,) = got
    assert isinstance(e, dv.ClosedError), repr(e)
    assert e.replica in (0, 1) and str(e).startswith(f"replica {e.replica}: "), str(e)
    assert sum(caught) >= 1, caught


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_with_statement_closes_the_strategy_and_releases_its_threads(execution):
    with mirrored(2, execution=execution) as warm:  # process-wide threads (the inline watchdog)
        assert_usable(warm)
    gc.collect()
    base = settle_threads(os_threads())
    with mirrored(4, execution=execution) as s:
        assert isinstance(s, dv.MirroredStrategy)
        assert_usable(s)
        # Three replica threads in thread mode, plus the engine's workers in both.
        assert os_threads() >= base + (3 if execution == "threads" else 1)
    assert settle_threads(base) <= base
    with pytest.raises(dv.ClosedError):
        s.run(lambda: 1)
    s.close()  # closing again is harmless
    s.__exit__(None, None, None)

    # An exception in the block still closes it, and is not swallowed.
    with pytest.raises(StepError, match="inside the block"), mirrored(3, execution=execution) as s2:
        raise StepError("inside the block")
    with pytest.raises(dv.ClosedError):
        s2.run(lambda: 1)
    assert settle_threads(base) <= base

    # The default strategy cannot be closed: it serves every call outside a scope.
    with dv.get_strategy() as default:
        pass
    assert default.run(lambda: 5) == 5


def test_closing_a_strategy_with_a_stuck_replica_prints_nothing(monkeypatch):
    """No 'Exception in thread ...' from a replica thread when its strategy is closed or
    dropped while the replica is still busy."""
    reports = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reports.append(args))
    release = threading.Event()
    s = mirrored(2, timeout=0.3, execution="threads")

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


def test_group_aborted_outside_a_step_is_reset_by_the_next_run():
    s = mirrored(2, timeout=1.0)
    try:
        s.extended._group.abort(1, "aborted between steps")
        assert s.extended._group.aborted
        assert_usable(s)
        assert not s.extended._group.aborted
    finally:
        s.close()


# ---- several threads ----------------------------------------------------------------------------


def test_one_step_at_a_time(s2):
    inside = threading.Event()
    release = threading.Event()
    result = {}

    def slow():
        if dv.get_replica_context().replica_id_in_sync_group == 0:
            inside.set()
            release.wait(20)
        return 1

    t = threading.Thread(target=lambda: result.setdefault("v", s2.run(slow)))
    t.start()
    try:
        assert inside.wait(20)
        with pytest.raises(RuntimeError, match="already running a step"):
            s2.run(lambda: 0)
    finally:
        release.set()
        t.join(20)
    assert result["v"] == 1


def test_steps_from_three_threads_at_once_each_run_whole_or_are_refused(s2):
    """Three threads call run on one strategy as fast as they can, with thread switches
    forced as often as the interpreter allows, so that a claim on the step is read while
    its step ends and another begins: every call returns its own step's all-reduce on
    every replica, or is refused as a step already running; nothing else."""
    ok, refused, other, wrong = [0], [0], [], []
    end = time.monotonic() + 1.5

    def fn(b):
        return dv.get_replica_context().all_reduce("SUM", np.float64(b + replica_id()))

    def drive(k: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            b = float(k * 1_000_000 + i)
            try:
                got = [float(v) for v in s2.experimental_local_results(s2.run(fn, args=(b,)))]
            except RuntimeError as e:
                if "already running a step" in str(e):
                    refused[0] += 1
                else:
                    other.append(repr(e))
                continue
            except Exception as e:  # reported below
                other.append(repr(e))
                continue
            if got == [2 * b + 1] * 2:
                ok[0] += 1
            else:
                wrong.append((b, got))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=drive, args=(k,)) for k in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in ts)
    assert wrong == [] and other[:3] == []
    assert ok[0] > 0 and refused[0] > 0
    assert_usable(s2)


def test_a_claim_on_the_step_whose_call_is_over_is_taken_over(s2):
    """A step that an interrupt cut short before it let go of its claim leaves one whose
    call has returned; one whose thread has ended is as stale, and so is another thread's
    from before a fork (in a forked child a new thread can have that thread's id, and its
    frame looks as if it still ran). The next run takes each over; a step that runs is
    refused."""
    from distvals.replicas import fork_generation

    def returned_frame():
        return sys._getframe()

    ext = s2.extended
    gen = fork_generation()
    ext._claims[0] = (threading.get_ident(), returned_frame(), gen)
    assert_usable(s2)
    done = []
    t = threading.Thread(target=lambda: done.append((threading.get_ident(), sys._getframe(), gen)))
    t.start()
    t.join(20)
    ext._claims[0] = done[0]
    assert_usable(s2)
    assert ext._claims == {}

    parked, release = threading.Event(), threading.Event()
    frames = []

    def park():
        frames.append(sys._getframe())
        parked.set()
        release.wait(20)

    t = threading.Thread(target=park)
    t.start()
    try:
        assert parked.wait(20)
        ext._claims[0] = (t.ident, frames[0], gen - 1)  # running, but from before a fork
        assert_usable(s2)
        assert ext._claims == {}
    finally:
        release.set()
        t.join(20)

    inside = threading.Event()
    release = threading.Event()

    def slow():
        if replica_id() == 0:
            inside.set()
            release.wait(20)
        return 1

    t = threading.Thread(target=s2.run, args=(slow,))
    t.start()
    try:
        assert inside.wait(20)
        with pytest.raises(RuntimeError, match="already running a step"):
            ext._claim_step((threading.get_ident(), sys._getframe(), gen))
    finally:
        release.set()
        t.join(20)
    assert_usable(s2)


@pytest.mark.parametrize("inner", EXECUTION_MODES)
def test_a_step_times_out_while_its_merge_fn_runs_another_strategys_step(inner):
    """The step of an inline strategy ends at its own timeout while its merge_fn runs a
    step of another strategy (whose timeout is long) that computes on."""
    a = mirrored(2, timeout=1.0, execution="inline")
    b = mirrored(2, execution=inner)
    stop = threading.Event()

    def b_fn():
        if replica_id() == 1:
            t0 = time.monotonic()
            while not stop.is_set() and time.monotonic() - t0 < 20:
                pass  # Python work, which an interrupt can end
        return dv.get_replica_context().all_reduce("SUM", np.float64(1))

    def a_fn():
        return dv.get_replica_context().merge_call(lambda _: b.experimental_local_results(b.run(b_fn)))

    try:
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="within 1 s"):
            a.run(a_fn)
        assert time.monotonic() - t0 < 6
        stop.set()
        assert_usable(a)
        assert_usable(b)
    finally:
        stop.set()
        a.close()
        b.close()


def test_two_strategies_from_two_threads_at_once():
    errors = []

    def drive(k: int, n: int) -> None:
        s = mirrored(n)
        try:
            for step in range(300):
                out = s.run(
                    lambda: dv.get_replica_context().all_reduce(
                        "sum", np.full(7, k * 1000 + step + replica_id(), np.int64)
                    )
                )
                want = sum(k * 1000 + step + r for r in range(n))
                for r in range(n):
                    if not np.all(out.values[r] == want):
                        errors.append(f"strategy {k} step {step} replica {r}: {out.values[r]} != {want}")
                        return
        except Exception as e:  # reported below
            errors.append(f"strategy {k}: {e!r}")
        finally:
            s.close()

    ts = [threading.Thread(target=drive, args=(k, n)) for k, n in ((0, 2), (1, 3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert errors == []


def test_a_replica_thread_in_another_replicas_context_is_refused_by_name():
    """Threads mode: a replica thread that enters another replica's context and calls a
    collective there while that replica waits in one is a clear error (it used to take
    the other's place in the meeting: an AttributeError from the resolver)."""
    s = mirrored(3, execution="threads")
    contexts = {}
    entered = threading.Event()

    def step():
        ctx = dv.get_replica_context()
        r = replica_id()
        contexts[r] = ctx
        if r == 2:
            assert entered.wait(5.0)
            time.sleep(0.05)  # replica 0 waits in its all_reduce by now
            with contexts[0]:
                return contexts[0].all_reduce("sum", np.full(4, 100.0))
        if r == 0:
            entered.set()
        return ctx.all_reduce("sum", np.full(4, 10.0**r))

    try:
        with pytest.raises(RuntimeError, match="two threads use replica 0's context at once") as info:
            s.run(step)
        assert str(info.value).startswith("replica 2: replica 0: all_reduce(SUM) was called while replica 0 already")
        assert_usable(s)
    finally:
        s.close()


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_cross_replica_calls_from_another_thread_while_run_loops(execution):
    """strategy.reduce of earlier results from a logging thread while the main thread
    loops on run: both get right numbers, nothing crashes."""
    n = 2
    s = mirrored(n, timeout=20.0, execution=execution)
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
        # 1.5 s of steps, and at least 11 of them however loaded the machine is.
        deadline = time.monotonic() + 1.5
        tag = 0
        while time.monotonic() < deadline or tag <= 10:
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


# ---- resources ----------------------------------------------------------------------------------


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_strategies_release_their_threads_when_closed_or_collected(execution):
    with mirrored(2, execution=execution) as warm:  # process-wide threads (the inline watchdog)
        assert_usable(warm)
    gc.collect()
    base = settle_threads(os_threads())
    made = [mirrored(3, execution=execution) for _ in range(8)]
    for s in made:
        assert_usable(s)
    # Two replica threads each in thread mode, plus the engine's workers in both.
    assert os_threads() >= base + 8 * (2 if execution == "threads" else 1)
    for s in made[:4]:
        s.close()
    del made[:4]
    del s
    del made  # the other four are only collected
    gc.collect()
    left = settle_threads(base)
    assert left <= base, [t.name for t in threading.enumerate()]


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_a_step_keeps_no_reference_to_its_inputs_results_or_errors(execution):
    """Once run has returned (or raised) and the caller drops what it got, the step's
    inputs, results and exceptions are freed: neither the runner, nor a reused replica
    greenlet or thread, nor the last meeting keeps them (they may be large, or GPU
    memory) until the next step."""
    with mirrored(2, execution=execution) as s:
        for step in range(3):  # the first step (new greenlets and threads) and later ones
            parts = [np.arange(4096, dtype=np.float32) + 10 * r + step for r in range(2)]
            x = s.experimental_distribute_values_from_function(lambda ctx, p=parts: p[ctx.replica_id_in_sync_group])
            out = s.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(x,))
            got = s.experimental_local_results(out)
            for r in range(2):
                np.testing.assert_array_equal(got[r], (parts[0].astype(np.float64) + parts[1]).astype(np.float32))
            inputs, results = [weakref.ref(p) for p in parts], [weakref.ref(g) for g in got]
            del parts, x, out, got
            gc.collect()
            assert [w() is None for w in inputs] == [True, True], f"step {step}: inputs kept"
            assert [w() is None for w in results] == [True, True], f"step {step}: results kept"

        class Boom(Exception):
            pass

        big = [np.ones(4096, np.float32) * (r + 1) for r in range(2)]
        y = s.experimental_distribute_values_from_function(lambda ctx, b=big: b[ctx.replica_id_in_sync_group])

        def fails(v):
            if dv.get_replica_context().replica_id_in_sync_group == 1:
                raise Boom(v)  # the error (and its traceback's frames) refer to the input
            return v

        # Freed by reference counting alone, not only once the garbage collector has
        # broken a cycle (an error's traceback holds frames, which must not hold the
        # error, the step or its inputs): large inputs must not pile up between
        # collections.
        gc.disable()
        try:
            try:
                s.run(fails, args=(y,))
            except Boom as e:
                errors = weakref.ref(e)
            inputs = [weakref.ref(b) for b in big]
            del big, y
            assert errors() is None, "the replica's exception is kept"
            assert [w() is None for w in inputs] == [True, True], "a failed step's inputs are kept"
        finally:
            gc.enable()
        assert_usable(s)


def test_a_step_ended_by_its_timeout_keeps_no_reference_to_its_inputs(execution):
    """A step that its timeout ends, with one replica waiting in a collective: once the
    caller drops the error, the inputs are freed (inline: the suspended replica is ended
    with the step, its finally block run; threads: once the late replica's thread is
    back)."""
    finished = []
    with mirrored(2, timeout=0.3, execution=execution) as s:
        assert_usable(s)  # inline: the timed-out step reuses the greenlets of a clean one
        big = [np.ones(1 << 16, np.float32) * (r + 1) for r in range(2)]
        y = s.experimental_distribute_values_from_function(lambda ctx, b=big: b[ctx.replica_id_in_sync_group])

        def late(v):
            try:
                if dv.get_replica_context().replica_id_in_sync_group == 1:
                    time.sleep(0.8)
                return dv.get_replica_context().all_reduce("SUM", v)
            finally:
                finished.append(dv.get_replica_context().replica_id_in_sync_group)

        with pytest.raises(dv.CollectiveTimeoutError):
            s.run(late, args=(y,))
        if execution == "inline":
            assert sorted(finished) == [0, 1], finished  # both replicas' finally blocks ran
        else:
            time.sleep(1.0)  # replica 1's thread reaches its collective and ends
        inputs = [weakref.ref(b) for b in big]
        del big, y
        gc.collect()
        assert [w() is None for w in inputs] == [True, True], "a timed-out step's inputs are kept"
        assert_usable(s)


def late_step(late_for: float, cleanup):
    """A replica function: replica 1 is busy for ``late_for`` seconds, then every replica
    all-reduces its id + 1; ``cleanup(ctx, replica)`` runs in each replica's finally."""

    def fn():
        ctx = dv.get_replica_context()
        r = ctx.replica_id_in_sync_group
        try:
            if r == 1:
                time.sleep(late_for)
            return ctx.all_reduce("SUM", np.float64(r + 1))
        finally:
            cleanup(ctx, r)

    return fn


def test_the_cleanup_of_a_cut_short_steps_replica_runs_as_that_replica(execution, monkeypatch):
    """A replica waiting in a collective when its step times out runs its finally block
    in its own replica context (an unaggregated variable update there changes its own
    copy, as with threads); a collective there is refused, never paired with the calls of
    the step that timed out; an error there is reported, not lost."""
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reported.append(args.exc_value))
    with mirrored(2, timeout=0.4, execution=execution) as s:
        with s.scope():
            v = dv.Variable(0.0)
        seen = []

        def cleanup(ctx, r):
            if r == 0:  # replica 0 waited in the all-reduce
                seen.append((dv.get_strategy() is s, dv.get_replica_context() is ctx))
                v.assign_add(1.0)  # aggregation NONE: this replica's copy only
                if execution == "inline":
                    try:
                        ctx.all_reduce("SUM", np.float64(5.0))
                    except dv.AbortedError as e:
                        seen.append(str(e))
                    raise OSError("the cleanup failed")

        with pytest.raises(dv.CollectiveTimeoutError):
            s.run(late_step(1.0, cleanup))  # replica 1 outlives the step's timeout
        time.sleep(1.0)  # threads: replica 1 comes back
        assert seen[0] == (True, True), seen
        assert [float(np.asarray(c)) for c in s.experimental_local_results(v)] == [1.0, 0.0]
        if execution == "inline":
            assert "was called while the replica was being ended" in seen[1], seen
            assert [type(e) for e in reported] == [OSError], reported
        assert_usable(s)


def test_a_call_in_the_cleanup_of_a_replica_the_timeout_interrupted_pairs_with_nothing():
    """Inline: the watchdog interrupts the replica that never arrived; a collective in its
    finally block must not complete the call the others wait in (with its own values)."""
    with mirrored(2, timeout=0.4, execution="inline") as s:
        got = []

        def cleanup(ctx, r):
            if r == 1:
                try:
                    got.append(ctx.all_reduce("SUM", np.float64(100.0)))
                except dv.AbortedError as e:
                    got.append(e)

        with pytest.raises((dv.CollectiveTimeoutError, dv.AbortedError)) as info:
            s.run(late_step(2.0, cleanup))  # replica 1 is interrupted by the step's timeout
        assert not isinstance(info.value, dv.MismatchError)
        assert len(got) == 1 and isinstance(got[0], dv.AbortedError), got
        assert_usable(s)


@pytest.mark.timeout(120, method="thread")
def test_ctrl_c_while_replica_zero_waits_leaves_the_meeting_clean():
    """Threads: a Ctrl-C lands while replica 0 waits in a collective; a collective in its
    finally block is a new arrival (it meets replica 1's late call), not a meeting
    completed with a missing request (which raised an internal AttributeError)."""
    s = mirrored(2, timeout=20.0, execution="threads")
    seen = []

    def cleanup(ctx, r):
        if r == 0:
            try:
                seen.append(float(ctx.all_reduce("SUM", np.float64(1.0))))
            except Exception as e:  # the test looks at it
                seen.append(e)

    fn = late_step(0.8, cleanup)

    def alarm(signum, frame):
        raise KeyboardInterrupt("alarm")

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            s.run(fn)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(seen) == 1 and not isinstance(seen[0], AttributeError), seen
    time.sleep(1.0)
    assert_usable(s)
    s.close()


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
        mirrored(8, timeout=20.0, execution="threads")
    monkeypatch.undo()
    assert len(started) == 3
    gc.collect()
    assert settle_threads(base) <= base
    with mirrored(2, timeout=20.0, execution="threads") as s:  # and the next strategy starts fine
        check_step(s.run(tagged_step, args=(3,)), 3, 2)


@needs_plain_malloc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100000_steps_keep_memory_and_threads_stable():
    s = mirrored(2)
    try:
        x = [np.arange(16, dtype=np.float32) + r for r in range(2)]
        want = x[0] + x[1]

        def step():
            return dv.get_replica_context().all_reduce("sum", x[replica_id()])

        marks = {}
        t0 = time.monotonic()
        for i in range(1, 100_001):
            out = s.run(step)
            if i % 10_000 == 0:
                np.testing.assert_array_equal(out.values[1], want)
                gc.collect()
                marks[i] = (rss_bytes(), os_threads())
        took = time.monotonic() - t0
        rss10, thr10 = marks[10_000]
        rss100, thr100 = marks[100_000]
        grown = rss100 - rss10
        assert grown < 2 * 2**20, f"RSS grew by {grown / 2**20:.2f} MiB from step 10,000 to 100,000"
        assert thr100 == thr10, f"threads: {thr10} at step 10,000, {thr100} at step 100,000"
        print(f"100,000 steps in {took:.1f} s; RSS {rss10 / 2**20:.1f} -> {rss100 / 2**20:.1f} MiB; {thr100} threads")
    finally:
        s.close()


# ---- os.fork() ----------------------------------------------------------------------------------


def _run_in_forked_child(body) -> int:
    """Runs ``body()`` in a forked child; the child's exit status (0 when body returns)."""
    return fork_with_deadline(body, 120.0)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@forks_while_threads_allocate
@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_a_strategy_works_in_a_forked_child(execution):
    n = 3
    s = mirrored(n, timeout=5.0, execution=execution)
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@forks_while_threads_allocate
def test_a_child_forked_while_a_thread_is_inside_an_update_or_next_can_use_them(execution):
    """A thread of the parent that is inside a variable's update, or inside next() of a
    distributed iterator, when the process forks does not exist in the child: the child
    must still update the variable and read the iterator (the locks that thread held
    stayed held in the child, forever)."""
    s = mirrored(2, timeout=5.0, execution=execution)
    with s.scope():
        mv = dv.Variable(np.zeros(2))
        mean = dv.Variable(np.zeros(2), aggregation=dv.VariableAggregation.MEAN)
    pv = dv.Variable(np.zeros(2))
    dist_it = iter(s.experimental_distribute_dataset(dv.data.Dataset.range(100).batch(4)))
    release = threading.Event()
    entered = threading.Semaphore(0)

    def hold(lock):
        # What a thread caught half-way through an update or a next() holds.
        with lock:
            entered.release()
            release.wait(30)

    # (The strategy's own lock: what a thread holds in the middle of a step's collective
    # or a cross-replica reduce; and the one a thread holds while it takes over a stale
    # claim on the step, which the child's first run finds below.)
    locks = [pv._lock, mv.values[1]._lock, dist_it._lock, s.extended._lock, s.extended._claim_lock]
    threads = [threading.Thread(target=hold, args=(lock,), daemon=True) for lock in locks]
    for t in threads:
        t.start()
    for _ in threads:
        assert entered.acquire(timeout=10)

    def returned_frame():
        return sys._getframe()

    from distvals.replicas import fork_generation

    s.extended._claims[0] = (threading.get_ident(), returned_frame(), fork_generation())

    def child():
        t0 = time.monotonic()
        # Each lock is renewed as what it was (the strategy's is reentrant).
        assert type(s.extended._lock) is type(threading.RLock())
        pv.assign_add(np.full(2, 5.0))
        assert pv.numpy().tolist() == [5.0, 5.0]
        mv.values[1].assign_add(np.ones(2))  # a copy's own update, as a replica's thread makes it
        assert mv.values[1].numpy().tolist() == [1.0, 1.0]
        got = [np.asarray(x).tolist() for x in s.experimental_local_results(next(dist_it))]
        assert got == [[0, 1], [2, 3]]
        s.run(lambda: mean.assign_add(np.full(2, 2.0 * replica_id() + 1)))
        assert [c.numpy().tolist() for c in mean.values] == [[2.0, 2.0], [2.0, 2.0]]
        check_step(s.run(tagged_step, args=(3,)), 3, 2)
        assert s.reduce("SUM", s.run(lambda: np.float64(replica_id() + 1)), axis=None) == 3.0
        assert time.monotonic() - t0 < 5

    try:
        with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nothing():
            code = fork_with_deadline(child, 30.0)
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert code == 0
    pv.assign_add(np.ones(2))  # the parent's variable and its lock are untouched
    assert pv.numpy().tolist() == [1.0, 1.0]
    s.close()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no setitimer")
@pytest.mark.timeout(240, method="thread")  # SIGALRM is this test's own
# An interrupt may also land in a garbage-collector callback, which Python reports as
# "exception ignored" (and pytest as this warning): not what this test looks at.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("agg", ["MEAN", "ONLY_FIRST_REPLICA"])
def test_ctrl_c_at_random_moments_never_leaves_mirrored_copies_unequal(execution, agg):
    """Ctrl-C (a KeyboardInterrupt from a signal handler) at random moments of steps
    that make one aggregated update each: every copy got the update, or none did. The
    copies stay equal and step by step the value is a whole number of updates."""
    n = 3
    s = mirrored(n, execution=execution)
    with s.scope():
        v = dv.Variable(np.zeros(4), aggregation=getattr(dv.VariableAggregation, agg))

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        v.assign_add(np.full(4, 1.0 + r))  # MEAN over 3 replicas, or the first's: +2 or +1

    inc = 2.0 if agg == "MEAN" else 1.0
    rng = random.Random(7)
    t0 = time.perf_counter()
    for _ in range(20):
        s.run(step)
    span = 3 * (time.perf_counter() - t0) / 20
    done = 20

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        for i in range(600):
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, span))
                    s.run(step)
                    done += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
            copies = [c.numpy().copy() for c in v.values]
            assert all(np.array_equal(c, copies[0]) for c in copies), f"step {i}: copies {copies}"
            k = copies[0][0] / inc
            assert k == int(k) and done <= k <= done + interrupted and np.all(copies[0] == copies[0][0]), copies
    finally:
        signal.signal(signal.SIGALRM, old)
    assert interrupted > 0
    s.run(step)
    assert all(np.array_equal(c.numpy(), v.values[0].numpy()) for c in v.values)
    s.close()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no setitimer")
@pytest.mark.timeout(240, method="thread")  # SIGALRM is this test's own
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_around_a_scope_never_leaves_it_entered():
    """Ctrl-C at random moments around `with strategy.scope():` (nested too): once the
    statement is left, by its end or by the interrupt, no scope stays entered."""
    s = mirrored(2)
    rng = random.Random(3)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        for i in range(20_000):
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 3e-5))
                    with s.scope(), s.scope():
                        pass
                    for _ in range(20):
                        pass
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                pass
            assert not dv.has_strategy(), f"a scope stayed entered after try {i}"
    finally:
        signal.signal(signal.SIGALRM, old)
    assert type(dv.Variable(1.0)) is dv.Variable
    s.close()


def test_a_step_ended_by_its_timeout_leaves_mirrored_copies_equal(execution):
    """Replicas loop on aggregated updates until the step's timeout ends it: the copies
    are equal afterwards (the updates that landed, landed on every copy), and the next
    step works."""
    n = 3
    s = dv.MirroredStrategy(
        [f"CPU:{i}" for i in range(n)],
        execution=execution,
        communication_options=dv.CommunicationOptions(timeout_seconds=0.2),
    )
    with s.scope():
        v = dv.Variable(np.zeros(4), aggregation=dv.VariableAggregation.MEAN)

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        while True:
            v.assign_add(np.full(4, 1.0 + r))

    for t in range(12):
        with pytest.raises(dv.CollectiveTimeoutError):
            s.run(step)
        copies = [c.numpy().copy() for c in v.values]
        assert all(np.array_equal(c, copies[0]) for c in copies), f"trial {t}: copies {copies}"
        out = s.run(lambda t=t: dv.get_replica_context().all_reduce("sum", np.full(3, 10.0 * t + replica_id())))
        for part in s.experimental_local_results(out):
            np.testing.assert_array_equal(part, np.full(3, 30.0 * t + 3))
    s.close()


def _check_group_in_both_styles(g, n: int, counts, op: str) -> None:
    """Single calls (sum) and per-replica calls from n threads (``op``) of ``g``, with
    distinct values per replica, checked on every replica against numpy."""
    for count in counts:
        bufs = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(n)]
        want = np.arange(count, dtype=np.float64) * sum(range(1, n + 1))
        g.all_reduce(bufs)
        for r in range(n):
            np.testing.assert_array_equal(bufs[r], want.astype(np.float32), err_msg=f"single call, replica {r}")
        parts = [np.arange(count, dtype=np.float32) * (r + 2) for r in range(n)]
        errors = [None] * n

        def replica(r, parts=parts, errors=errors):
            try:
                g.replica_all_reduce(r, parts[r], op=op)
            except BaseException as e:
                errors[r] = e

        threads = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert errors == [None] * n, errors
        stacked = np.stack([np.arange(count, dtype=np.float64) * (r + 2) for r in range(n)])
        want = stacked.max(axis=0) if op == "max" else stacked.sum(axis=0)
        for r in range(n):
            np.testing.assert_array_equal(parts[r], want.astype(np.float32), err_msg=f"per-replica call, replica {r}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@forks_while_threads_allocate
def test_a_replica_group_works_in_a_forked_child():
    """A group made (and used) before os.fork() works in the child in both call styles,
    with distinct values per replica and sizes the engine splits over its threads, and
    is untouched in the parent."""
    n = 3
    g = dv.ReplicaGroup(n, timeout_seconds=5.0)
    small = [np.full(7, r + 1, np.float64) for r in range(n)]
    g.all_reduce(small)
    for r in range(n):
        np.testing.assert_array_equal(small[r], np.full(7, 6.0), err_msg=f"replica {r}")

    def child():
        t0 = time.monotonic()
        _check_group_in_both_styles(g, n, (5, 1 << 20), "max")
        assert time.monotonic() - t0 < 5

    with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nothing():
        code = _run_in_forked_child(child)
    assert code == 0
    g.all_reduce(small)  # the parent's group is untouched
    for r in range(n):
        np.testing.assert_array_equal(small[r], np.full(7, 18.0), err_msg=f"replica {r}")
    g.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@forks_while_threads_allocate
@pytest.mark.parametrize("style", ["single_call", "per_replica"])
def test_a_replica_group_works_in_a_child_forked_while_other_threads_are_in_its_calls(style):
    """Threads of the parent loop over calls of a group (big enough to run on the
    engine's worker threads) while the main thread forks, 8 times: each child's first
    calls, in both styles, finish with the right results (the child renews the group's
    locks, gate and workers), and the parent's loop goes on unharmed."""
    n = 3
    g = dv.ReplicaGroup(n, timeout_seconds=20.0)
    stop = threading.Event()
    errors: list = []
    count = 1 << 18

    def single_loop():
        bufs = [np.full(count, r + 1.0, np.float32) for r in range(n)]
        outs = [np.empty_like(b) for b in bufs]
        while not stop.is_set():
            g.all_reduce(bufs, out=outs)
            if not all(np.all(o == 6.0) for o in outs):
                errors.append("parent single call")

    # The replicas stop together: the barrier's action decides once per round.
    stopping = [False]
    barrier = threading.Barrier(n, action=lambda: stopping.__setitem__(0, stop.is_set()))

    def replica_loop(r):
        x = np.zeros(count, np.float32)
        while True:
            barrier.wait(30)
            if stopping[0]:
                return
            x[:] = r + 1.0
            g.replica_all_reduce(r, x, op="max")
            if not np.all(x == n):
                errors.append(f"parent replica {r}")

    if style == "single_call":
        threads = [threading.Thread(target=single_loop, daemon=True)]
    else:
        threads = [threading.Thread(target=replica_loop, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()

    def child():
        _check_group_in_both_styles(g, n, (5, count), "sum")

    codes = []
    try:
        with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nothing():
            for _ in range(8):
                time.sleep(0.02)
                codes.append(fork_with_deadline(child, 30.0))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert codes == [0] * 8, codes
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    g.close()


def test_a_collective_from_a_greenlet_inside_a_replica(execution):
    # Inline, the replicas are greenlets: a collective from a greenlet that the replica
    # function started cannot reach the scheduler, and says so (it once returned the
    # scheduler's request to that greenlet, silently). Threads: the call works.
    greenlet = pytest.importorskip("greenlet")
    s = mirrored(2, execution=execution)
    vals = [np.arange(3.0) + 1000 * r for r in range(2)]

    def fn():
        ctx = dv.get_replica_context()
        x = vals[ctx.replica_id_in_sync_group]
        caller = greenlet.getcurrent()
        # The greenlet hands its result back by switching, not by returning: greenlet
        # (3.5.6) may deliver to the parent of a greenlet that returns the GreenletExit
        # message of another greenlet of its thread that lost its last reference on
        # another thread in the meantime (seen here once in a few runs under
        # AddressSanitizer; see test_inline_steps_stay_right_when_greenlets_die_on_another_thread).
        return greenlet.greenlet(lambda: caller.switch(ctx.all_reduce("SUM", x))).switch()

    try:
        if execution == "inline":
            with pytest.raises(RuntimeError, match=r"replica \d: all_reduce was called from a greenlet") as info:
                s.run(fn)
            assert "execution='threads'" in str(info.value)
        else:
            out = s.run(fn)
            for r in range(2):
                np.testing.assert_array_equal(out.values[r], vals[0] + vals[1])
        assert_usable(s)
    finally:
        s.close()


def test_inline_steps_stay_right_when_greenlets_die_on_another_thread():
    # A strategy's replica greenlets whose last reference goes on another thread are
    # killed later, on their own thread, at its next greenlet call (greenlet's rule); a
    # greenlet that returns may then hand its parent the GreenletExit's message instead
    # of its value (a greenlet defect). Inline replicas switch explicitly and never
    # return a value: the steps of another strategy on that thread keep their results.
    vals = [np.arange(3.0) + 10 * r for r in range(2)]
    b = mirrored(2, execution="inline")
    try:
        for _ in range(20):
            a = mirrored(2, execution="inline")
            a.run(lambda: dv.get_replica_context().all_reduce("SUM", np.ones(2)))
            box = [a]
            del a
            ready = threading.Event()

            def drop():
                ready.wait()
                box.clear()  # the last reference, on this thread: the greenlets are queued
                gc.collect()

            th = threading.Thread(target=drop)
            th.start()

            def fn():
                ctx = dv.get_replica_context()
                if ctx.replica_id_in_sync_group == 0:
                    ready.set()
                    th.join()
                return ctx.all_reduce("SUM", vals[ctx.replica_id_in_sync_group])

            out = b.run(fn)
            for r in range(2):
                assert isinstance(out.values[r], np.ndarray)
                np.testing.assert_array_equal(out.values[r], vals[0] + vals[1])
    finally:
        b.close()


def test_a_replica_thread_of_a_timed_out_step_changes_no_variable_afterwards():
    # Threads: the caller gets the step's timeout while replica 1 still sleeps; what that
    # thread then writes to its copies (local updates, which meet nobody) is dropped.
    s = mirrored(3, timeout=0.3, execution="threads")
    with s.scope():
        on_read = dv.Variable(
            np.zeros(2), synchronization=dv.VariableSynchronization.ON_READ, aggregation=dv.VariableAggregation.SUM
        )
        local = dv.Variable(np.zeros(2), aggregation=dv.VariableAggregation.NONE)
    woke = threading.Event()

    def step():
        ctx = dv.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            time.sleep(0.8)
            try:
                on_read.assign_add(np.full(2, 100.0))
                local.assign_add(np.full(2, 100.0))
            finally:
                woke.set()
        return ctx.all_reduce("SUM", np.ones(2))

    try:
        with pytest.raises(dv.CollectiveTimeoutError):
            s.run(step)
        assert woke.wait(10)
        time.sleep(0.1)
        np.testing.assert_array_equal(on_read.numpy(), np.zeros(2))
        for copy in local.values:
            np.testing.assert_array_equal(copy.numpy(), np.zeros(2))
        assert_usable(s)
    finally:
        s.close()


def test_importing_distvals_leaves_ctypes_pythonapi_as_it_was():
    # The usual way to raise in another thread must keep working for everyone else.
    import ctypes

    fn = ctypes.pythonapi.PyThreadState_SetAsyncExc
    assert fn.argtypes is None
    # An unknown thread id: nothing to do, 0 threads modified.
    assert fn(ctypes.c_ulong(0), ctypes.py_object(KeyboardInterrupt)) == 0


@pytest.mark.parametrize("execution", EXECUTION_MODES)
@pytest.mark.parametrize("where", ["start", "between"])
def test_a_replica_raising_greenlet_exit_fails_like_any_error(execution, where):
    """GreenletExit is what kills an abandoned inline replica; raised by the replica's own
    code it is that replica's failure (named, the others released, the next run fine),
    not a greenlet that ends without an outcome."""
    import greenlet

    with mirrored(2, timeout=20.0, execution=execution) as s:

        def step():
            r = replica_id()
            if where == "between":
                dv.get_replica_context().all_reduce("SUM", np.float64(r))
            if r == 1:
                raise greenlet.GreenletExit(f"replica {r} ends")
            return dv.get_replica_context().all_reduce("SUM", np.float64(r + 1))

        t0 = time.monotonic()
        with pytest.raises(greenlet.GreenletExit, match="replica 1 ends") as caught:
            s.run(step)
        assert time.monotonic() - t0 < 5.0
        assert getattr(caught.value, "replica", 1) == 1
        assert_usable(s)


def test_ctrl_c_while_the_inline_watchdog_starts_leaves_timeouts_working(tmp_path):
    """A Ctrl-C that lands while the first inline step starts the watchdog thread (here:
    raised by the thread-starting call itself, once, before any thread exists) reaches
    the caller as KeyboardInterrupt; the next step starts the watchdog, and its timeout
    fires. (Started by threading.Thread.start, an interrupt there left a Thread object
    that never ran, taken for the running watchdog: no timeout fired again.)"""
    script = tmp_path / "watchdog_start.py"
    script.write_text(
        """
import _thread, threading, time
import distvals as dv

def interrupted_once(original):
    calls = []
    def start(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    return start

_thread.start_new_thread = interrupted_once(_thread.start_new_thread)
threading.Thread.start = interrupted_once(threading.Thread.start)
s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution="inline",
                        communication_options=dv.CommunicationOptions(timeout_seconds=0.5))
try:
    s.run(lambda: None)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted")
t0 = time.monotonic()
try:
    s.run(lambda: time.sleep(5) if dv.get_replica_context().replica_id_in_sync_group else None)
    print("no timeout")
except dv.CollectiveTimeoutError:
    print("timed out after %.1f s" % (time.monotonic() - t0))
"""
    )
    import subprocess

    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[0] == "interrupted", proc.stdout
    assert lines[1].startswith("timed out after"), proc.stdout
    assert float(lines[1].split()[3]) < 4.0, proc.stdout


def test_ctrl_c_in_the_first_steps_of_new_inline_strategies_never_hangs_later_ones(tmp_path):
    """Interrupts at random points of new inline strategies' first steps and closes (the
    process-wide watchdog registers each runner then): no lock is left held, so later
    strategies keep stepping, closing and timing out."""
    script = tmp_path / "first_steps.py"
    script.write_text(
        """
import random, signal, sys, time
import numpy as np
import distvals as dv

def handler(sig, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, handler)
rng = random.Random(int(sys.argv[1]))
step = lambda: dv.get_replica_context().all_reduce("SUM", np.float64(1.0))
end = time.monotonic() + 3.0
tries = 0
while time.monotonic() < end:
    tries += 1
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution="inline")
    try:
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 3e-4))
        try:
            s.run(step)
            s.close()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        pass
    try:
        s.close()
    except KeyboardInterrupt:  # the interrupt was still pending when the timer stopped
        s.close()
# And after all that, a step timeout still fires.
s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution="inline",
                        communication_options=dv.CommunicationOptions(timeout_seconds=0.5))
try:
    s.run(lambda: time.sleep(3) if dv.get_replica_context().replica_id_in_sync_group else None)
except dv.CollectiveTimeoutError:
    print("timed out as asked after", tries, "tries")
"""
    )
    import subprocess

    for seed in (1, 2):
        proc = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "timed out as asked" in proc.stdout, proc.stdout + proc.stderr[-3000:]
