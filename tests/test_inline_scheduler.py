"""The inline replicas' scheduler (replicas_inline.py and its loop in C, _core.inline_drive):
what each replica sees of the caller's context variables, its arguments, and steps whose
replicas meet many times, with results checked on every replica against numpy."""

from __future__ import annotations

import contextvars
import math
import threading

import numpy as np
import pytest
from strategy_checks import assert_usable, replica_id

import distvals as dv
from distvals import _core
from distvals.replicas import Raise
from distvals.replicas_inline import InlineRunner

colour = contextvars.ContextVar("colour", default="none")


def parts(s, value):
    """Every replica's part of a step's result leaf (a leaf that is the same object on
    every replica comes back as it is)."""
    local = list(s.experimental_local_results(value))
    return local if len(local) == s.num_replicas_in_sync else local * s.num_replicas_in_sync


@pytest.fixture(scope="module")
def s3():
    with dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution="inline") as s:
        yield s


def test_each_replica_starts_from_a_copy_of_the_callers_context_variables(s3):
    def fn():
        r = replica_id()
        before = colour.get()
        colour.set(f"replica {r}")
        # A meeting: every other replica runs (and sets its own value) before this one
        # resumes, which must still see its own.
        total = dv.get_replica_context().all_reduce("SUM", np.float64(r))
        return before, colour.get(), total

    token = colour.set("caller")
    try:
        for _ in range(3):
            out = s3.run(fn)
            got = list(zip(*(parts(s3, x) for x in out)))
            assert got == [("caller", f"replica {r}", 3.0) for r in range(3)]
            # The replicas' values never reach the caller.
            assert colour.get() == "caller"
    finally:
        colour.reset(token)
    # Without context variables of its own, each replica sees the default.
    out = s3.run(lambda: colour.get())
    assert parts(s3, out) == ["none"] * 3


def test_each_replica_gets_its_own_arguments_and_keyword_arguments(s3):
    parts = dv.PerReplica(tuple(np.arange(4.0) + 10 * r for r in range(3)))

    def fn(x, scale=1.0, *, shift):
        return dv.get_replica_context().all_reduce("SUM", x * scale) + shift

    ref = sum(np.arange(4.0) + 10 * r for r in range(3))
    out = s3.run(fn, args=(parts,), kwargs={"scale": 2.0, "shift": dv.PerReplica((0.0, 1.0, 2.0))})
    for r, v in enumerate(s3.experimental_local_results(out)):
        np.testing.assert_array_equal(v, 2.0 * ref + r)
    out = s3.run(fn, args=[parts], kwargs={"shift": 0.5})
    for v in s3.experimental_local_results(out):
        np.testing.assert_array_equal(v, ref + 0.5)


@pytest.mark.parametrize("meetings", [1, 2, 7])
def test_many_meetings_in_one_step_give_every_replica_its_results(s3, meetings):
    rng = np.random.default_rng(meetings)
    xs = [[rng.standard_normal(5 + k) + r for k in range(meetings)] for r in range(3)]

    def fn():
        r = replica_id()
        ctx = dv.get_replica_context()
        got = []
        for k in range(meetings):
            # Alternate the quick single-array meeting, a structure and a merge_call.
            if k % 3 == 0:
                got.append(ctx.all_reduce("SUM", xs[r][k]))
            elif k % 3 == 1:
                got.append(ctx.all_reduce("MAX", {"a": xs[r][k], "b": [xs[r][k] * 2]})["b"][0] / 2)
            else:
                got.append(ctx.merge_call(lambda strategy, v: strategy.reduce("MIN", v, axis=None), args=(xs[r][k],)))
        return got

    for _ in range(2):
        out = s3.run(fn)
        for r in range(3):
            res = [parts(s3, x)[r] for x in out]
            for k in range(meetings):
                stack = np.stack([np.asarray(xs[q][k], np.float64) for q in range(3)])
                want = [stack.sum(0), stack.max(0), stack.min(0)][k % 3]
                np.testing.assert_allclose(res[k], want, rtol=1e-12)


def test_a_replica_failing_after_meetings_releases_the_others_and_the_next_step_works(s3):
    def fn(fail_at):
        ctx = dv.get_replica_context()
        for k in range(4):
            if replica_id() == 1 and k == fail_at:
                raise ValueError(f"replica one stops at {k}")
            ctx.all_reduce("SUM", np.ones(3))
        return replica_id()

    for fail_at in range(4):
        with pytest.raises(ValueError, match=f"^replica 1: replica one stops at {fail_at}"):
            s3.run(fn, args=(fail_at,))
        assert_usable(s3)
    out = s3.run(fn, args=(99,))
    assert list(s3.experimental_local_results(out)) == [0, 1, 2]


# ---- the scheduler loop on its own: a runner whose meetings a test resolves -------------


# The bare runner of the test in progress, where its replica functions find it.
_current_runner: list = []


def test_the_loop_resolves_each_meeting_once_and_resumes_every_replica(s3):
    seen = []

    def resolve(requests):
        seen.append(list(requests))
        return [sum(requests) + r for r in range(3)]

    def fn(runner_box, x):
        got = runner_box[0].meet(replica_id(), x)
        again = runner_box[0].meet(replica_id(), got * 2)
        return x, got, again

    box = []
    runner = InlineRunner(3, resolve)
    box.append(runner)
    per = [((box, x), None) for x in (1, 20, 300)]
    results = runner.step(fn, per, s3.extended._entries, math.inf)
    assert seen == [[1, 20, 300], [642, 644, 646]]
    assert results == [(1, 321, 1932), (20, 322, 1933), (300, 323, 1934)]
    assert runner.failures == [] and runner._waiting == 0 and not runner._lost


def test_a_raise_outcome_fails_only_its_replica_with_that_error(s3):
    def resolve(requests):
        return [Raise(KeyError("only one")) if r == 1 else r for r in range(3)]

    def fn(x):
        return _current_runner[0].meet(replica_id(), x)

    _current_runner.clear()
    runner = InlineRunner(3, resolve)
    _current_runner.append(runner)
    results = runner.step(fn, [((x,), None) for x in range(3)], s3.extended._entries, math.inf)
    assert results == [0, None, 2]
    assert [(f.replica, type(f.error), f.error.args) for f in runner.failures] == [(1, KeyError, ("only one",))]


def test_outcomes_changed_while_replicas_resume_are_not_read_again(s3):
    # resolve keeps the list it returns; replica 0 empties it when it resumes. The loop
    # works on a copy of its own, so replicas 1 and 2 still get their outcomes.
    kept = []

    def resolve(requests):
        kept[:] = [10, 11, 12]
        return kept

    def fn():
        got = _current_runner[0].meet(replica_id(), "x")
        kept.clear()
        return got

    _current_runner.clear()
    runner = InlineRunner(3, resolve)
    _current_runner.append(runner)
    results = runner.step(fn, [((), None)] * 3, s3.extended._entries, math.inf)
    assert results == [10, 11, 12]


def test_a_step_whose_lists_lose_a_replica_raises_instead_of_crashing(s3):
    def fn():
        _current_runner[0].meet(replica_id(), "x")
        if replica_id() == 0:
            _current_runner[0]._stacks.clear()
        return 1

    _current_runner.clear()
    runner = InlineRunner(3, lambda requests: [0, 0, 0])
    _current_runner.append(runner)
    with pytest.raises(RuntimeError, match=r"lost replica \d's slot"):
        runner.step(fn, [((), None)] * 3, s3.extended._entries, math.inf)
    assert_usable(s3)


def test_the_scheduler_loop_refuses_what_it_cannot_drive():
    with pytest.raises(TypeError, match="8 arguments"):
        _core.inline_drive()
    with pytest.raises(TypeError, match="must be a list"):
        _core.inline_drive(None, (), None, None, None, None, None, None)
    with pytest.raises(TypeError, match="6 arguments"):
        _core.inline_resume()
    runner = InlineRunner(2, lambda requests: requests)
    runner._msgs, runner._results, runner._stacks, runner._waiting = [None] * 2, [None] * 2, [[], []], 0
    with pytest.raises(ValueError, match="no replica -1"):
        _core.inline_resume(runner, [None, None], threading.local(), -1, None, None)
    with pytest.raises(RuntimeError, match="not a list of 2 items"):
        runner._results = [None]
        _core.inline_resume(runner, [None, None], threading.local(), 0, None, None)


def test_a_calls_own_timeout_ends_when_every_replica_has_reached_the_call(s3):
    """A call's own timeout bounds the wait for the replicas that have not arrived, not
    the meeting's resolution: a resolve slower than the timeout still succeeds, at every
    meeting of the step; a replica that never arrives still ends it, named."""
    import time

    from distvals.replicas import Request

    def resolve(requests):
        time.sleep(0.25)  # the collective itself, longer than the call's timeout
        return [sum(q.value for q in requests) + r for r in range(3)]

    def fn(x):
        got = 0
        for _ in range(3):
            got = _current_runner[0].meet(replica_id(), Request("all_reduce", ("SUM",), x + got, None, 0.05))
        return got

    _current_runner.clear()
    runner = InlineRunner(3, resolve)
    _current_runner.append(runner)
    results = runner.step(fn, [((x,), None) for x in (1, 20, 300)], s3.extended._entries, 20.0)
    assert runner.failures == [], runner.failures
    # Each meeting: the sum of every replica's value plus the replica's id.
    want = [0, 0, 0]
    for _ in range(3):
        total = sum(x + w for x, w in zip((1, 20, 300), want))
        want = [total + r for r in range(3)]
    assert results == want

    def late(x):
        if replica_id() == 1:
            # Busy in Python (interrupted by the first replica's call timeout even where
            # SIGINT is ignored, which leaves a blocked sleep to run to its end).
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                pass
        return _current_runner[0].meet(replica_id(), Request("all_reduce", ("SUM",), x, None, 0.1))

    t0 = time.monotonic()
    with pytest.raises(
        dv.CollectiveTimeoutError, match=r"^replica 0: all_reduce\('SUM'\) timed out after 0.1 s"
    ) as info:
        runner.step(late, [((x,), None) for x in (1, 20, 300)], s3.extended._entries, 20.0)
    assert time.monotonic() - t0 < 1.5
    assert info.value.replica == 0 and "replica(s) 1 never arrived" in str(info.value)
