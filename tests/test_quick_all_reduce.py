"""distvals._core.quick_all_reduce and quick_all_reduce_tree: the meetings where every
inline replica all-reduces one array, or one structure of arrays, checked and reduced in
one call; None (and nothing touched) for anything else, which the strategy's general
path then reduces or names."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import distinct_values, reference, tolerance
from strategy_checks import engine_all_reduces

import distvals as dv
from distvals import _core, nest
from distvals.local_extended import _QUICK_MASK
from distvals.replicas import QUICK_ALL_REDUCE, QUICK_TREE, Request

OPS = {
    "sum": dv.ReduceOp.SUM,
    "mean": dv.ReduceOp.MEAN,
    "min": dv.ReduceOp.MIN,
    "max": dv.ReduceOp.MAX,
    "prod": dv.ReduceOp.PRODUCT,
}


def requests(arrays, op, marker=QUICK_ALL_REDUCE):
    return [(marker, op, a) for a in arrays]


def meeting_calls(monkeypatch, name):
    """The list that gets, for every call the strategy makes to the meeting function
    ``distvals.local_extended.<name>`` from now on, whether it took the meeting (True)
    or refused it (False)."""
    from distvals import local_extended

    calls = []
    real = getattr(local_extended, name)

    def counting(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(local_extended, name, counting)
    return calls


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
    calls = meeting_calls(monkeypatch, "_quick_all_reduce")
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


# ---- structures ------------------------------------------------------------------------------


def tree_requests(structures, op, marker=QUICK_TREE):
    return [(marker, op, s, nest.flatten(s)) for s in structures]


def tree(r, dtype="float32", seed=0):
    """Replica r's structure: small leaves (packed together) and a large one (on its own, in any dtype),
    nested in a dict, a list and a tuple; distinct values per replica and leaf."""
    rng = np.random.default_rng(seed * 100 + r)

    def leaf(*shape):
        return np.array(rng.integers(1, 9, size=shape) * (r + 1), dtype=dtype)  # 0-d: an array too

    return {"w": leaf(3, 4), "layers": [leaf(5), (leaf(), leaf(20000))], "b": leaf(2)}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "op,dtype", [(op, dt) for op, dt in OP_DTYPES if dt in ("float16", "float32", "float64", "int32")]
)
def test_every_replica_gets_each_leafs_float64_reference(n, op, dtype):
    structures = [tree(r, dtype) for r in range(n)]
    before = [[a.copy() for a in nest.flatten(s)] for s in structures]
    with dv.ReplicaGroup(n) as g:
        trace: list = []
        out = _core.quick_all_reduce_tree(
            g._group, tree_requests(structures, OPS[op]), QUICK_TREE, "auto", 32768, 0, trace=trace
        )
    assert out is not None and len(out) == n
    # The four small leaves travel as one pack, the large one on its own.
    assert sorted(count for _, count in trace) == [12 + 5 + 1 + 2, 20000]
    # Each replica's result comes packed as its structure: a dict of a list of a tuple.
    for r in range(n):
        assert nest.structure_mismatch(out[r], structures[r]) is None
        assert type(out[r]) is dict and list(out[r]) == list(structures[r]), r
        assert type(out[r]["layers"]) is list and type(out[r]["layers"][1]) is tuple, r
    for i in range(len(before[0])):
        want = reference([b[i] for b in before], op)
        for r in range(n):
            got = nest.flatten(out[r])[i]
            assert got.shape == before[r][i].shape and got.dtype == before[r][i].dtype, (r, i)
            assert not np.shares_memory(got, nest.flatten(structures[r])[i]), (r, i)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance(dtype), err_msg=f"{r} {i}")
    for s, b in zip(structures, before):  # the inputs are only read
        for x, y in zip(nest.flatten(s), b):
            np.testing.assert_array_equal(x, y)


def _not_quick_tree_cases():
    a, b = tree(0), tree(1)
    s = dv.ReduceOp.SUM
    yield "another marker", tree_requests([a, b], s, marker=object())
    yield "a single-array request", [tree_requests([a], s)[0], (QUICK_ALL_REDUCE, s, b["w"])]
    yield "ops differ", [tree_requests([a], s)[0], tree_requests([b], dv.ReduceOp.MAX)[0]]
    yield "keys differ", tree_requests([a, {**b, "c": b.pop("b")}], s)
    yield "a list for a tuple", tree_requests([a, {**b, "layers": [b["layers"][0], list(b["layers"][1])]}], s)
    yield "leaf counts differ", [tree_requests([a], s)[0], (QUICK_TREE, s, b, nest.flatten(b)[:-1])]
    yield "dtypes differ", tree_requests([a, tree(1, "float64")], s)
    yield "shapes differ", tree_requests([a, {**tree(1), "w": tree(1)["w"].reshape(4, 3)}], s)
    yield "int16 leaves", tree_requests([tree(0, "int16"), tree(1, "int16")], s)
    yield "big-endian leaves", tree_requests([tree(0, ">f4"), tree(1, ">f4")], s)
    yield "one big-endian leaf", tree_requests([a, {**tree(1), "b": tree(1)["b"].astype(">f4")}], s)
    yield "integer MEAN", tree_requests([tree(0, "int32"), tree(1, "int32")], dv.ReduceOp.MEAN)
    yield "one request short", tree_requests([a], s)
    yield "leaves not a list", [(QUICK_TREE, s, x, tuple(nest.flatten(x))) for x in (a, tree(1))]


@pytest.mark.parametrize("case", list(_not_quick_tree_cases()), ids=lambda c: c[0])
def test_any_other_structure_meeting_returns_none_and_touches_nothing(case):
    _, reqs = case
    kept = [[np.array(x, copy=True) for x in nest.flatten(q[2])] if len(q) == 4 else None for q in reqs]
    with dv.ReplicaGroup(2) as g:
        assert _core.quick_all_reduce_tree(g._group, reqs, QUICK_TREE, "auto", 32768, 0) is None
    for q, k in zip(reqs, kept):
        if k is not None:
            for x, y in zip(nest.flatten(q[2]), k):
                np.testing.assert_array_equal(x, y)


def test_leaves_that_are_views_of_other_arrays_are_read_as_they_are():
    # Strided leaves (copied to contiguous memory for the engine) and leaves that share
    # one buffer: every replica still gets the float64 reference of each leaf.
    n = 3
    bases = [np.arange(40, dtype=np.float64).reshape(5, 8) * (r + 2) for r in range(n)]
    structures = [{"col": b[:, 1], "row": b[2], "same": [b[2], b[2]], "t": b.T} for b in bases]
    with dv.ReplicaGroup(n) as g:
        out = _core.quick_all_reduce_tree(
            g._group, tree_requests(structures, dv.ReduceOp.MAX), QUICK_TREE, "auto", 32768, 0
        )
    assert out is not None
    for i in range(5):
        want = reference([nest.flatten(s)[i] for s in structures], "max")
        for r in range(n):
            np.testing.assert_array_equal(nest.flatten(out[r])[i], want, err_msg=f"{r} {i}")


def test_leaf_arrays_are_the_leaves_only_when_all_are_plain_arrays_of_those_dtypes():
    f = np.zeros(3, np.float32)
    s = {"a": f, "b": [np.zeros(2, np.int64), (np.zeros((), np.complex64),)]}
    got = _core.nest_leaf_arrays(s, _QUICK_MASK)
    assert got is not None and [x is y for x, y in zip(got, nest.flatten(s))] == [True] * 3
    assert _core.nest_leaf_arrays([f, np.zeros(2, object)], _QUICK_MASK) is None
    assert _core.nest_leaf_arrays([f, 1.5], _QUICK_MASK) is None
    assert _core.nest_leaf_arrays([f, np.ma.masked_array(f)], _QUICK_MASK) is None
    assert _core.nest_leaf_arrays([f], 1 << np.dtype(np.float64).num) is None
    assert _core.nest_leaf_arrays([], _QUICK_MASK) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_inline_steps_reduce_structures_in_the_meeting_and_name_what_differs(monkeypatch, op):
    strategy = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution="inline")
    calls = meeting_calls(monkeypatch, "_quick_all_reduce_tree")

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        return dv.get_replica_context().all_reduce(op, tree(r))

    out = strategy.run(step)
    assert calls == [True]
    for i, leaf in enumerate(nest.flatten(out)):
        want = reference([nest.flatten(tree(r))[i] for r in range(3)], op.lower())
        for r, got in enumerate(leaf.values):
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{r} {i}")

    def differing():
        r = dv.get_replica_context().replica_id_in_sync_group
        value = tree(r, "float64" if r == 2 else "float32")
        return dv.get_replica_context().all_reduce(op, value)

    with pytest.raises(dv.MismatchError, match="replica 2"):
        strategy.run(differing)
    assert calls[-1] is False  # refused by the meeting, named by the general path
    out = strategy.run(step)  # and the next step works
    assert calls[-1] is True
    np.testing.assert_allclose(out["b"].values[1], reference([tree(r)["b"] for r in range(3)], op.lower()), rtol=1e-6)


@pytest.mark.timeout(60)
def test_structures_the_meeting_declines_come_back_packed_as_each_replicas_own(monkeypatch):
    # Integer MEAN (computed in float64) is the general path's; each replica still gets its
    # result as its own structure: a dict in its own key order, or an OrderedDict.
    import collections

    strategy = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution="inline")
    calls = meeting_calls(monkeypatch, "_quick_all_reduce_tree")

    def value(r):
        x, y = np.arange(4, dtype=np.int32) * (r + 1), np.full((2, 2), 10 * r + 1, np.int64)
        return [{"y": (y,), "x": x}, collections.OrderedDict(x=x, y=(y,)), {"x": x, "y": (y,)}][r]

    seen = {}

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        seen[r] = dv.get_replica_context().all_reduce("MEAN", value(r))

    strategy.run(step)
    assert calls == [False]
    mean_x = np.mean([np.arange(4, dtype=np.float64) * (r + 1) for r in range(3)], axis=0)
    mean_y = np.full((2, 2), np.mean([10.0 * r + 1 for r in range(3)]))
    for r in range(3):
        got = seen[r]
        assert type(got) is type(value(r)) and list(got) == list(value(r)), r
        assert type(got["y"]) is tuple, r
        np.testing.assert_allclose(got["x"], mean_x, rtol=1e-12, err_msg=str(r))
        np.testing.assert_allclose(got["y"][0], mean_y, rtol=1e-12, err_msg=str(r))
    strategy.close()
