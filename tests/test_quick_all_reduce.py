"""distvals._core.quick_all_reduce: the meeting where every inline replica all-reduces
one array, checked and reduced in one call; None (and nothing touched) for anything
else, which the strategy's general path then reduces or names."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import distinct_values, reference, tolerance
from strategy_checks import engine_all_reduces

import distvals as dv
from distvals import _core
from distvals.replicas import QUICK_ALL_REDUCE, Request

OPS = {
    "sum": dv.ReduceOp.SUM,
    "mean": dv.ReduceOp.MEAN,
    "min": dv.ReduceOp.MIN,
    "max": dv.ReduceOp.MAX,
    "prod": dv.ReduceOp.PRODUCT,
}


def requests(arrays, op, marker=QUICK_ALL_REDUCE):
    return [(marker, op, a) for a in arrays]


DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
# Integer MEAN (which gives float64) is the general path's: see the refusals below.
OP_DTYPES = [(op, dt) for op in sorted(OPS) for dt in DTYPES if not (op == "mean" and np.dtype(dt).kind in "iu")]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op,dtype", OP_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2048,)])
def test_every_replica_gets_the_float64_reference_in_a_new_array(n, op, dtype, shape):
    ins = distinct_values(n, shape, dtype, op, seed=n)
    before = [a.copy() for a in ins]
    with dv.ReplicaGroup(n) as g:
        out = _core.quick_all_reduce(g._group, requests(ins, OPS[op]), QUICK_ALL_REDUCE)
    assert out is not None and len(out) == n
    want = reference(before, op)
    for r, got in enumerate(out):
        assert got.shape == ins[r].shape and got.dtype == ins[r].dtype, r
        assert got.flags.c_contiguous and got.flags.writeable, r
        assert not np.shares_memory(got, ins[r]), r
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance(dtype), err_msg=str(r))
    for a, b in zip(ins, before):  # the inputs are only read
        np.testing.assert_array_equal(a, b)


def test_results_of_one_call_survive_the_next():
    # Outputs of 4 KiB and more come from the pool: a later call must not reuse a block
    # that a result still holds.
    n = 2
    first = _core.quick_all_reduce
    with dv.ReplicaGroup(n) as g:
        a = [np.full(4096, r + 1, np.float32) for r in range(n)]
        out1 = first(g._group, requests(a, dv.ReduceOp.SUM), QUICK_ALL_REDUCE)
        b = [np.full(4096, 10 * (r + 1), np.float32) for r in range(n)]
        out2 = first(g._group, requests(b, dv.ReduceOp.SUM), QUICK_ALL_REDUCE)
    for r in range(n):
        np.testing.assert_array_equal(out1[r], np.full(4096, 3, np.float32))
        np.testing.assert_array_equal(out2[r], np.full(4096, 30, np.float32))
    assert not np.shares_memory(out1[0], out1[1])
    assert not any(np.shares_memory(x, y) for x in out1 for y in out2)


def _not_quick_cases():
    f = [np.arange(6, dtype=np.float32) + r for r in range(2)]
    yield "another marker", requests(f, dv.ReduceOp.SUM, marker=object())
    yield "a Request", [Request("all_reduce", (dv.ReduceOp.SUM,), f[0]), (QUICK_ALL_REDUCE, dv.ReduceOp.SUM, f[1])]
    yield "a longer tuple", [(QUICK_ALL_REDUCE, dv.ReduceOp.SUM, f[0], None), (QUICK_ALL_REDUCE, dv.ReduceOp.SUM, f[1])]
    yield "ops differ", [(QUICK_ALL_REDUCE, dv.ReduceOp.SUM, f[0]), (QUICK_ALL_REDUCE, dv.ReduceOp.MAX, f[1])]
    yield "dtypes differ", requests([f[0], f[1].astype(np.float64)], dv.ReduceOp.SUM)
    yield "shapes differ", requests([f[0], f[1].reshape(2, 3)], dv.ReduceOp.SUM)
    yield "sizes differ", requests([f[0], f[1][:5].copy()], dv.ReduceOp.SUM)
    yield "not contiguous", requests([f[0], np.arange(12, dtype=np.float32)[::2]], dv.ReduceOp.SUM)
    yield "not an array", requests([f[0], list(f[1])], dv.ReduceOp.SUM)
    yield "an ndarray subclass", requests([f[0], np.ma.masked_array(f[1])], dv.ReduceOp.SUM)
    yield "int16", requests([np.arange(4, dtype=np.int16)] * 2, dv.ReduceOp.SUM)
    yield "bool", requests([np.ones(4, bool)] * 2, dv.ReduceOp.SUM)
    yield "big-endian", requests([np.arange(4, dtype=">f4")] * 2, dv.ReduceOp.SUM)
    yield "integer MEAN", requests([np.arange(4, dtype=np.int32)] * 2, dv.ReduceOp.MEAN)
    yield "one request short", requests(f[:1], dv.ReduceOp.SUM)
    yield "not an op", requests(f, "sum")


@pytest.mark.parametrize("case", list(_not_quick_cases()), ids=lambda c: c[0])
def test_anything_else_returns_none_and_touches_nothing(case):
    _, reqs = case
    kept = [np.array(q[2], copy=True) if isinstance(q, tuple) else None for q in reqs]
    with dv.ReplicaGroup(2) as g:
        assert _core.quick_all_reduce(g._group, reqs, QUICK_ALL_REDUCE) is None
    for q, k in zip(reqs, kept):
        if k is not None:
            np.testing.assert_array_equal(np.asarray(q[2]), k)


@pytest.mark.timeout(60)
def test_inline_steps_take_it_and_mismatches_are_still_named(monkeypatch):
    strategy = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution="inline")
    calls = []
    real = _core.quick_all_reduce

    def counting(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("distvals.local_extended._quick_all_reduce", counting)
    x = strategy.experimental_distribute_values_from_function(
        lambda c: np.arange(5, dtype=np.float32) * (c.replica_id_in_sync_group + 1)
    )
    engine = engine_all_reduces(monkeypatch, strategy)
    out = strategy.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(x,))
    assert calls == [True] and engine == []  # one quick call, no other engine call
    for r, got in enumerate(strategy.experimental_local_results(out)):
        np.testing.assert_array_equal(got, np.arange(5, dtype=np.float32) * 6, err_msg=str(r))

    def differing(v):
        ctx = dv.get_replica_context()
        return ctx.all_reduce("SUM", v if ctx.replica_id_in_sync_group != 1 else v.astype(np.float64))

    with pytest.raises(dv.MismatchError, match="replica 1"):
        strategy.run(differing, args=(x,))
    assert calls[-1] is False  # refused by the quick call, named by the general path
    # and the next step works
    out = strategy.run(lambda v: dv.get_replica_context().all_reduce("MAX", v), args=(x,))
    for got in strategy.experimental_local_results(out):
        np.testing.assert_array_equal(got, np.arange(5, dtype=np.float32) * 3)
