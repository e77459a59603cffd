"""Which strategy is in force and where code runs: default, scope, run, merge_call, and a
ReplicaContext kept after its run."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from strategy_checks import assert_usable, mirrored

import distvals as dv


def test_default_context_outside_any_scope():
    assert not dv.has_strategy()
    assert not dv.in_cross_replica_context()
    default = dv.get_strategy()
    assert default.num_replicas_in_sync == 1
    ctx = dv.get_replica_context()
    assert ctx is not None
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.strategy is default
    assert dv.get_strategy() is default  # the same object every time


def test_default_strategy_works_on_plain_values():
    default = dv.get_strategy()
    x = np.array([1.0, 2.0])
    assert default.run(lambda v: v * 3, args=(x,)).tolist() == [3.0, 6.0]
    for op in ("SUM", "MEAN"):
        got = default.reduce(op, x)
        np.testing.assert_array_equal(got, x)
        assert not np.shares_memory(got, x)  # a new array, as all_reduce's below
    assert default.experimental_local_results(x) == (x,)
    out = dv.get_replica_context().all_reduce("SUM", x)
    np.testing.assert_array_equal(out, x)
    assert out is not x
    merged = dv.get_replica_context().merge_call(lambda s, v: (s, v + 1), args=(1,))
    assert merged == (default, 2)
    with default.scope():
        assert not dv.has_strategy()


def test_scope(s2):
    with s2.scope() as entered:
        assert entered is s2
        assert dv.get_strategy() is s2
        assert dv.has_strategy()
        assert dv.in_cross_replica_context()
        assert dv.get_replica_context() is None
    assert not dv.has_strategy()
    assert dv.get_replica_context() is not None


def test_same_scope_twice_nests(s2):
    with s2.scope():
        with s2.scope():
            assert dv.get_strategy() is s2
        assert dv.get_strategy() is s2
    assert not dv.has_strategy()


def test_another_strategys_scope_inside_is_an_error(s2, s3):
    with s2.scope():
        with pytest.raises(RuntimeError, match="mixing different strategies"), s3.scope():
            pass
        assert dv.get_strategy() is s2  # nothing was left behind
    assert not dv.has_strategy()


def test_replica_context_inside_run(s3):
    def fn():
        ctx = dv.get_replica_context()
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            ctx.strategy is s3,
            dv.get_strategy() is s3,
            dv.has_strategy(),
            dv.in_cross_replica_context(),
            ctx.devices,
        )

    ids, nums, same, current, has, cross, devices = s3.run(fn)
    assert ids.values == (0, 1, 2)
    # As in TensorFlow, the very same object on every replica (a Python number or bool
    # too) comes back as it is; distinct ones make a PerReplica.
    assert nums == 3 and same is True and current is True and has is True
    assert cross is False
    # A tuple per replica regroups into a tuple of PerReplica.
    assert devices[0].values == s3.extended.worker_devices
    # After run the calling thread is back where it was.
    assert not dv.has_strategy()


def test_run_inside_scope_and_back(s2):
    with s2.scope():
        ids = s2.run(lambda: dv.get_replica_context().replica_id_in_sync_group)
        assert ids.values == (0, 1)
        assert dv.in_cross_replica_context()


def test_scope_inside_run_is_an_error(s2):
    def fn():
        with s2.scope():
            pass

    with pytest.raises(RuntimeError, match="cross-replica context"):
        s2.run(fn)


def test_merge_call_runs_once_in_cross_replica_context(s3):
    calls = []

    def merge_fn(strategy, value, scale=1):
        calls.append(threading.get_ident())
        assert strategy is s3
        assert dv.in_cross_replica_context() and dv.get_replica_context() is None
        assert isinstance(value, dv.PerReplica)
        return strategy.reduce("SUM", value) * scale

    def fn():
        ctx = dv.get_replica_context()
        x = np.array([float(ctx.replica_id_in_sync_group + 1)])
        out = ctx.merge_call(merge_fn, args=(x,), kwargs={"scale": 10})
        # Back in replica context after merge_call.
        assert dv.get_replica_context() is ctx
        return out

    result = s3.run(fn)
    assert len(calls) == 1
    # The same object to every replica: returned as is.
    np.testing.assert_array_equal(result, [60.0])


def test_merge_call_hands_per_replica_results_back_by_replica(s2):
    def fn():
        ctx = dv.get_replica_context()
        mine = ctx.replica_id_in_sync_group * 10
        return ctx.merge_call(lambda s, v: dv.PerReplica(tuple(p + 1 for p in v.values)), args=(mine,))

    assert s2.run(fn).values == (1, 11)


def test_merge_call_hands_plain_arrays_back_read_only(s3):
    # merge_fn returns one array (reduce_to onto one device does), alone and inside a
    # structure: every replica gets the same values, and a replica that changes them in
    # place gets an error instead of changing what the others read; merge_fn's own array
    # stays writeable.
    made = []

    def merge_fn(s, v):
        total = s.extended.reduce_to("SUM", v, "cpu:0")
        made.append(total)
        return total, {"also": [total * 2, 5]}

    def fn():
        ctx = dv.get_replica_context()
        r = ctx.replica_id_in_sync_group
        total, rest = ctx.merge_call(merge_fn, args=(np.full(4, 10.0 * (r + 1)),))
        seen = (total.copy(), rest["also"][0].copy())
        refused = 0
        for a in (total, rest["also"][0]):
            try:
                a += r + 1
            except ValueError as e:
                assert "read-only" in str(e)
                refused += 1
        return seen, refused, total

    seen, refused, total = s3.run(fn)
    for r, (t, d) in enumerate(s3.experimental_local_results(seen)):
        np.testing.assert_array_equal(t, np.full(4, 60.0), err_msg=f"replica {r} saw another's change")
        np.testing.assert_array_equal(d, np.full(4, 120.0), err_msg=f"replica {r} saw another's change")
    assert refused == 2  # every replica refused both (the same int: run returns it plain)
    # One object for every replica, as in TensorFlow: run returns it as it is.
    assert isinstance(total, np.ndarray) and not total.flags.writeable
    np.testing.assert_array_equal(total, np.full(4, 60.0))
    assert made[0].flags.writeable


def test_merge_call_identical_args_stay_plain(s2):
    seen = []
    shared = object()

    def fn():
        return dv.get_replica_context().merge_call(lambda s, v: seen.append(v), args=(shared,))

    s2.run(fn)
    assert seen == [shared]


@pytest.mark.parametrize("caller", [0, 1])
def test_merge_call_missing_in_one_replica_is_an_error(s2, caller):
    # Either replica may be the one that makes the call (with threads, replica 1 may
    # arrive after replica 0 has returned: its message names its own call too).
    other = 1 - caller

    def fn():
        ctx = dv.get_replica_context()
        if ctx.replica_id_in_sync_group == caller:
            if caller == 1:
                time.sleep(0.05)  # replica 0 has returned by now
            ctx.merge_call(lambda s: None)

    with pytest.raises(
        dv.MismatchError,
        match=f"replica {caller}: replica {caller} waits in merge_call, but replica\\(s\\) {other} "
        "returned from the replica function without making that call",
    ):
        s2.run(fn)
    assert s2.run(lambda: 5) == 5


@pytest.mark.parametrize("n", [1, 2])
def test_merge_call_hands_each_replica_its_part_of_a_distributed_result_with_any_count(execution, n):
    # With one replica too: its part, never the PerReplica (code using .shape on it
    # worked with two replicas and failed with one).
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution)

    def fn():
        ctx = dv.get_replica_context()
        out = ctx.merge_call(
            lambda st: st.experimental_distribute_values_from_function(
                lambda c: np.array([1.0, 2.0]) * (c.replica_id_in_sync_group + 1)
            )
        )
        assert isinstance(out, np.ndarray), type(out)
        return out * 10

    got = s.experimental_local_results(s.run(fn))
    assert [g.tolist() for g in got] == [[10.0 * (r + 1), 20.0 * (r + 1)] for r in range(n)]
    s.close()


def test_merge_fn_runs_on_the_callers_thread(s3):
    # As TensorFlow's merge_fn runs on its main thread: thread-local state is the
    # caller's, whichever replica arrived last (with threads, the last one resolved).
    caller = threading.current_thread()
    seen = []

    def fn():
        ctx = dv.get_replica_context()
        time.sleep(0.01 * (2 - ctx.replica_id_in_sync_group))  # replica 0 arrives last...
        ctx.merge_call(lambda st: seen.append(threading.current_thread()))
        time.sleep(0.01 * ctx.replica_id_in_sync_group)  # ...then first
        ctx.merge_call(lambda st: seen.append(threading.current_thread()))

    for _ in range(3):
        s3.run(fn)
    assert seen == [caller] * 6


def test_merge_fn_may_wait_for_another_thread_that_calls_the_strategy(s2):
    # merge_fn runs without the strategy's lock held: a thread it waits for may reduce.
    import concurrent.futures

    got = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def merge_fn(st, x):
            return pool.submit(lambda: st.reduce("SUM", x, axis=None)).result(timeout=10)

        def fn():
            ctx = dv.get_replica_context()
            got.append(float(ctx.merge_call(merge_fn, args=(np.float64(ctx.replica_id_in_sync_group + 1),))))

        s2.run(fn)
    assert got == [3.0, 3.0]


def test_an_empty_list_from_merge_fn_is_each_replicas_own(s3):
    sizes = []

    def fn():
        ctx = dv.get_replica_context()
        acc = ctx.merge_call(lambda st: [])
        box = ctx.merge_call(lambda st: {})
        acc.append(ctx.replica_id_in_sync_group)
        box[ctx.replica_id_in_sync_group] = 1
        ctx.all_reduce("SUM", np.float32(1))  # every replica has appended by now
        sizes.append((len(acc), len(box)))

    s3.run(fn)
    assert sizes == [(1, 1)] * 3


def test_merge_call_bad_args(s2):
    with pytest.raises(ValueError, match="args must be a list or tuple"):
        dv.get_replica_context().merge_call(lambda s: None, args=5)


def test_contexts_are_per_thread(s2):
    seen = {}

    def other():
        seen["has"] = dv.has_strategy()
        seen["ctx"] = dv.get_replica_context()

    with s2.scope():
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert seen["has"] is False
    assert seen["ctx"] is not None and seen["ctx"].num_replicas_in_sync == 1


def test_experimental_set_strategy_is_a_plain_function(s2, s3):
    # As in TensorFlow: it returns None, the strategy stays current until cleared, and a
    # second call replaces the first.
    try:
        assert dv.experimental_set_strategy(s2) is None
        assert dv.get_strategy() is s2 and dv.has_strategy() and dv.in_cross_replica_context()
        with s2.scope():  # its own scope inside counts, and leaves it current
            assert dv.get_strategy() is s2
        assert dv.get_strategy() is s2
        with pytest.raises(RuntimeError, match="mixing different strategies"):
            s3.scope().__enter__()
        dv.experimental_set_strategy(s3)
        assert dv.get_strategy() is s3
    finally:
        dv.experimental_set_strategy(None)
    assert not dv.has_strategy() and dv.get_replica_context() is not None
    with s2.scope(), pytest.raises(RuntimeError, match="must not be called inside a strategy's scope"):
        dv.experimental_set_strategy(s3)
    assert not dv.has_strategy()


def test_replica_context_repr_and_range(s2):
    assert repr(dv.get_replica_context()) == "ReplicaContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)"
    with pytest.raises(ValueError, match="out of range"):
        dv.ReplicaContext(s2, 2)


def test_replica_context_used_after_its_run_is_refused():
    s = mirrored(2, timeout=1.0)
    try:
        contexts = s.run(dv.get_replica_context)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="strategy.run"):
            contexts.values[1].all_reduce("sum", np.ones(2))
        assert time.monotonic() - t0 < 0.5
        assert_usable(s)
        for call in (lambda c: c.all_gather(np.ones(2), axis=0), lambda c: c.merge_call(lambda strategy: 1)):
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
