"""MirroredStrategy under faults and misuse: failing replicas, timeouts, interrupts,
mismatched collectives, values of other strategies, and resource hygiene over many
steps. Every failure must release the other replicas quickly, name the replica, keep
the original traceback and leave the strategy usable."""

from __future__ import annotations

import gc
import signal
import threading
import time
import traceback

import numpy as np
import pytest

import distvals as dv
from conftest import EXECUTION_MODES
from process_stats import needs_plain_malloc, os_threads, rss_bytes, settle_threads
from distvals.options import DEFAULT_TIMEOUT_SECONDS

# Long enough that a test which passes by hitting it would be slow and obvious; every
# failure below must be seen long before it.
LONG = 60.0


def mirrored(n: int, timeout: float = LONG, execution: str = "auto") -> dv.MirroredStrategy:
    return dv.MirroredStrategy([f"CPU:{i}" for i in range(n)],
                               communication_options=dv.CommunicationOptions(timeout_seconds=timeout),
                               execution=execution)


def replica_id() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def assert_usable(s: dv.MirroredStrategy) -> None:
    """One more step with a collective, checked on every replica against numpy."""
    n = s.num_replicas_in_sync
    vals = [np.arange(5, dtype=np.float64) * (r + 1) for r in range(n)]
    out = s.run(lambda: dv.get_replica_context().all_reduce("sum", vals[replica_id()]))
    want = np.sum(vals, axis=0)
    for r in range(n):
        np.testing.assert_array_equal(out.values[r], want, err_msg=f"replica {r}")


def frames_of(error: BaseException) -> list:
    """Function names on the traceback of ``error`` and of its cause."""
    names = []
    for e in (error, error.__cause__):
        if e is not None and e.__traceback__ is not None:
            names += [f.name for f in traceback.extract_tb(e.__traceback__)]
    return names


@pytest.fixture(scope="module", params=EXECUTION_MODES)
def s3(request):
    s = mirrored(3, execution=request.param)
    yield s
    s.close()


# ---- an exception in one replica ----------------------------------------------------------

class StepError(Exception):
    pass


@pytest.mark.parametrize("where", ["before", "during", "after"])
@pytest.mark.parametrize("bad", [0, 2])
def test_exception_around_a_collective_releases_the_others(s3, where, bad):
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
    assert_usable(s3)


def test_exception_in_merge_fn_and_before_merge_call(s3):
    def merge_raises():
        def merge_fn(strategy, v):
            raise ArithmeticError("merge failed")
        return dv.get_replica_context().merge_call(merge_fn, args=(replica_id(),))

    t0 = time.monotonic()
    with pytest.raises(ArithmeticError, match="merge failed") as info:
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


# ---- timeouts: per call and per strategy ----------------------------------------------------

@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_per_call_timeout_option(collective):
    """CommunicationOptions(timeout_seconds=) passed to one call overrides the
    strategy's minute; the error names the replica that never arrived (threads: the
    others wait for a replica still busy in its own code)."""
    s = mirrored(3, execution="threads")
    opts = dv.CommunicationOptions(timeout_seconds=0.3)
    release = threading.Event()

    def step():
        ctx = dv.get_replica_context()
        if replica_id() == 2:
            release.wait(2.0)  # busy well past the call's timeout
        if collective == "all_reduce":
            return ctx.all_reduce("sum", np.ones(3), options=opts)
        return ctx.all_gather(np.ones(3), axis=0, options=opts)

    try:
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError) as info:
            s.run(step)
        took = time.monotonic() - t0
        assert 0.25 < took < 1.5, took
        assert f"{collective}" in str(info.value) and "timed out after 0.3" in str(info.value), str(info.value)
        assert "replica(s) 2 never arrived" in str(info.value), str(info.value)
        assert isinstance(info.value, TimeoutError)
        assert_usable(s)  # replica 2's thread is still busy: a fresh one runs this step
    finally:
        release.set()
        s.close()


@pytest.mark.parametrize("execution", EXECUTION_MODES)
def test_strategy_timeout_option(execution):
    s = mirrored(2, timeout=0.4, execution=execution)
    release = threading.Event()
    try:
        def step():
            if replica_id() == 1:
                release.wait(3.0)  # never reaches the collective in time
            return dv.get_replica_context().all_reduce("max", np.ones(2))

        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="0.4 s"):
            s.run(step)
        assert time.monotonic() - t0 < 2
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


# ---- interrupts ------------------------------------------------------------------------------

def _sigint_main_after(delay: float) -> None:
    main = threading.main_thread().ident

    def fire():
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_while_the_others_wait_in_a_collective():
    s = mirrored(3)
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
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_usable(s)
    s.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_while_replica_zero_waits_in_the_engine():
    s = mirrored(3)
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


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
@pytest.mark.parametrize("execution", EXECUTION_MODES)
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


# ---- misuse -------------------------------------------------------------------------------------

def test_replicas_calling_different_collectives(s3):
    def different():
        ctx = dv.get_replica_context()
        if replica_id() == 1:
            return ctx.all_gather(np.ones(3), axis=0)
        return ctx.all_reduce("sum", np.ones(3))

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError, match="replicas called different collectives") as info:
        s3.run(different)
    assert time.monotonic() - t0 < 5
    assert "all_reduce" in str(info.value) and "all_gather" in str(info.value)
    assert_usable(s3)

    def other_order():
        ctx = dv.get_replica_context()
        if replica_id() == 0:
            a = ctx.all_reduce("sum", np.ones(3))
            b = ctx.all_gather(np.ones(2), axis=0)
        else:
            b = ctx.all_gather(np.ones(2), axis=0)
            a = ctx.all_reduce("sum", np.ones(3))
        return a, b

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError, match="replicas called different collectives"):
        s3.run(other_order)
    assert time.monotonic() - t0 < 5
    assert_usable(s3)


@pytest.mark.parametrize("odd", [0, 2])
def test_dtype_differing_in_one_replica_names_it_and_both_dtypes(s3, odd):
    """complex128 goes through the engine as raw bytes while float64 is reduced by it:
    the error still speaks of dtypes, not of the engine calls."""
    def step():
        r = replica_id()
        x = np.arange(3, dtype=np.complex128 if r == odd else np.float64) + r
        return dv.get_replica_context().all_reduce("sum", x)

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError) as info:
        s3.run(step)
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert msg.startswith("replica "), msg
    assert f"replica {odd} passed dtype complex128" in msg and "passed dtype float64" in msg, msg
    assert "all_gather" not in msg and "uint8" not in msg, msg
    assert_usable(s3)

    # Same for nested values: every leaf dtype is shown.
    def nested():
        r = replica_id()
        return dv.get_replica_context().all_reduce(
            "sum", {"a": np.ones(2, np.float32), "b": np.ones(2, np.int32 if r == odd else np.int64)})

    first, other = ("int32", "int64") if odd == 0 else ("int64", "int32")
    with pytest.raises(dv.MismatchError, match=f"passed dtype {first}, replica .* passed dtype {other} at \\['b'\\]"):
        s3.run(nested)
    assert_usable(s3)


@pytest.mark.parametrize("bad", [object(), "text", np.array([object(), object()])])
def test_values_that_are_not_numbers_are_refused_by_name(s3, bad):
    def step():
        r = replica_id()
        return dv.get_replica_context().all_reduce("sum", bad if r == 1 else np.ones(2))

    t0 = time.monotonic()
    with pytest.raises(TypeError, match="^replica 1: all_reduce cannot reduce a value of type") as info:
        s3.run(step)
    assert time.monotonic() - t0 < 5
    assert "Cannot change data-type" not in str(info.value)
    assert ("object" if not isinstance(bad, str) else "str") in str(info.value)
    assert info.value.replica == 1
    assert_usable(s3)

    if not isinstance(bad, str):
        with pytest.raises(TypeError, match="^replica 1: all_gather cannot send a value of type .*object"):
            s3.run(lambda: dv.get_replica_context().all_gather(bad if replica_id() == 1 else np.ones(2), axis=0))
        assert_usable(s3)


def test_strategy_reduce_of_objects_names_the_type(s3):
    parts = s3.run(lambda: object())
    with pytest.raises(TypeError, match="^strategy.reduce: cannot reduce replica 0's value of type object with SUM"):
        s3.reduce("sum", parts, axis=None)
    words = s3.run(lambda: "abc"[replica_id()])
    with pytest.raises(TypeError, match="strategy.reduce: cannot reduce .* str_ \\(dtype <U1\\) with MAX"):
        s3.reduce("max", words, axis=None)
    # Python numbers that numpy reduces as objects still work.
    from fractions import Fraction

    thirds = s3.run(lambda: Fraction(replica_id() + 1, 3))
    assert s3.reduce("sum", thirds, axis=None) == sum(Fraction(r + 1, 3) for r in range(3))


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
    with pytest.raises(StepError, match="inside the block"):
        with mirrored(3, execution=execution) as s2:
            raise StepError("inside the block")
    with pytest.raises(dv.ClosedError):
        s2.run(lambda: 1)
    assert settle_threads(base) <= base

    # The default strategy cannot be closed: it serves every call outside a scope.
    with dv.get_strategy() as default:
        pass
    assert default.run(lambda: 5) == 5


def test_different_ops_shapes_and_dtypes_across_replicas(s3):
    for make in (lambda r: ("sum" if r else "max", np.ones(3)),
                 lambda r: ("sum", np.ones(3 + r)),
                 lambda r: ("sum", np.ones(3, np.float32 if r == 1 else np.float64))):
        def step():
            op, x = make(replica_id())
            return dv.get_replica_context().all_reduce(op, x)

        t0 = time.monotonic()
        with pytest.raises(ValueError, match="^replica \\d: "):
            s3.run(step)
        assert time.monotonic() - t0 < 5
        assert_usable(s3)


def test_reduce_inside_a_replica_context_is_an_error(s3):
    def step():
        return s3.reduce("sum", np.ones(2), axis=None)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cross-replica context") as info:
        s3.run(step)
    assert time.monotonic() - t0 < 5
    assert str(info.value).startswith("replica ")
    assert_usable(s3)


def test_all_reduce_in_cross_replica_context_has_no_replica_context(s3):
    with s3.scope():
        assert dv.in_cross_replica_context()
        assert dv.get_replica_context() is None


def test_replica_context_used_after_its_run_is_refused():
    s = mirrored(2, timeout=1.0)
    try:
        contexts = s.run(dv.get_replica_context)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="strategy.run"):
            contexts.values[1].all_reduce("sum", np.ones(2))
        assert time.monotonic() - t0 < 0.5
        assert_usable(s)
        for call in (lambda c: c.all_gather(np.ones(2), axis=0),
                     lambda c: c.merge_call(lambda strategy: 1)):
            for c in contexts.values:
                with pytest.raises(RuntimeError, match=f"replica {c.replica_id_in_sync_group} called outside"):
                    call(c)
        assert time.monotonic() - t0 < 0.5
        assert_usable(s)

        # Inside a run, another replica's context (from the earlier run) is refused too.
        def uses_a_stale_context():
            return contexts.values[0].all_reduce("sum", np.ones(2))

        with pytest.raises(RuntimeError, match="^replica \\d: ReplicaContext.all_reduce of replica 0"):
            s.run(uses_a_stale_context)
        assert time.monotonic() - t0 < 0.5
        assert_usable(s)
    finally:
        s.close()


def test_group_aborted_outside_a_step_is_reset_by_the_next_run():
    s = mirrored(2, timeout=1.0)
    try:
        s.extended._group.abort(1, "aborted between steps")
        assert s.extended._group.aborted
        assert_usable(s)
        assert not s.extended._group.aborted
    finally:
        s.close()


def test_values_of_another_strategy(s3):
    other = mirrored(2)
    try:
        with other.scope():
            v = dv.Variable(np.zeros(2))
        with pytest.raises(RuntimeError, match="belongs to MirroredStrategy"):
            s3.run(lambda: v.assign_add(np.ones(2)))
        pair = other.run(lambda: np.full(2, replica_id(), np.float64))
        with pytest.raises(ValueError, match="a PerReplica with 2 values"):
            s3.run(lambda x: x, args=(pair,))
        with pytest.raises(ValueError, match="a PerReplica with 2 values"):
            s3.reduce("sum", pair, axis=None)
        assert_usable(s3)
        assert_usable(other)
    finally:
        other.close()


def test_closed_strategy_refuses_to_run():
    s = mirrored(2)
    s.close()
    with pytest.raises(dv.ClosedError):
        s.run(lambda: 1)


# ---- concurrency ------------------------------------------------------------------------------------

def test_two_strategies_from_two_threads_at_once():
    errors = []

    def drive(k: int, n: int) -> None:
        s = mirrored(n)
        try:
            for step in range(300):
                out = s.run(lambda: dv.get_replica_context().all_reduce(
                    "sum", np.full(7, k * 1000 + step + replica_id(), np.int64)))
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


# ---- resources -----------------------------------------------------------------------------------------

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
        print(f"100,000 steps in {took:.1f} s; RSS {rss10 / 2**20:.1f} -> {rss100 / 2**20:.1f} MiB; "
              f"{thr100} threads")
    finally:
        s.close()
