"""The quick path of inline GPU replicas' ``ctx.all_reduce(op, x)`` with x one DeviceArray
(on the simulated CUDA backend): taken when every replica passes a DeviceArray on its own
GPU of one engine dtype and shape with one op, giving each replica a new result in one
engine call; every other case goes the general way, with the same results and errors."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from conftest import distinct_values
from simulated_cuda import SimulatedCuda, install

import distvals as dv
from distvals import config, cuda_memory
from distvals import cuda as dvc
from distvals.local_extended import LocalExtended

# (simulated GPUs, replicas): logical GPUs sharing one device, and one GPU per replica.
LAYOUTS = [(1, 4), (3, 3)]


@pytest.fixture(params=LAYOUTS, ids=lambda p: f"{p[0]}gpu-{p[1]}replicas")
def setup(request, monkeypatch):
    gpus, n = request.param
    backend = SimulatedCuda(gpus)
    install(backend, monkeypatch.setattr)
    before = config.get_logical_gpus()
    config.set_logical_gpus(-(-n // gpus))
    dvc.empty_cache()
    taken = []
    original = LocalExtended._resolve_quick_gpu

    def counted(self, requests):
        out = original(self, requests)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(LocalExtended, "_resolve_quick_gpu", counted)
    s = dv.MirroredStrategy([f"GPU:{k}" for k in range(n)])
    yield s, backend, taken
    s.close()
    dvc.empty_cache()
    config.set_logical_gpus(before)


def _on_gpus(s, host):
    places = s.extended._places
    return s.experimental_distribute_values_from_function(
        lambda ctx: dvc.to_device(host[ctx.replica_id_in_sync_group], places[ctx.replica_id_in_sync_group])
    )


def _reference(op, host):
    stacked = np.stack([h.astype(np.float64) for h in host])
    return {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0), "min": stacked.min(0)}[op]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
def test_every_replica_gets_the_reduction_in_one_engine_call(setup, op, dtype):
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    if op == "mean" and np.dtype(dtype).kind == "i":
        pytest.skip("integer MEAN is a float result: the general path (tested below)")
    host = distinct_values(n, (5, 3), dtype)
    per = _on_gpus(s, host)
    calls = len(backend.calls)
    out = s.run(lambda x: dv.get_replica_context().all_reduce(op, x), args=(per,))
    assert taken == [True]
    assert len(backend.calls) == calls + 1, backend.calls[calls:]
    want = _reference(op, host)
    rtol = 1e-3 if dtype == np.float16 else 1e-6
    results = s.experimental_local_results(out)
    for r, res in enumerate(results):
        assert type(res) is dvc.DeviceArray and res.device == s.extended._places[r]
        assert res.dtype == np.dtype(dtype) and res.shape == (5, 3)
        np.testing.assert_allclose(res.numpy().astype(np.float64), want, rtol=rtol, err_msg=f"replica {r}")
    # New memory for every replica, none of it an input's; the inputs are untouched.
    ptrs = {res.ptr for res in results} | {x.ptr for x in s.experimental_local_results(per)}
    assert len(ptrs) == 2 * n
    for r, x in enumerate(s.experimental_local_results(per)):
        np.testing.assert_array_equal(x.numpy(), host[r])


def test_results_kept_across_steps_are_never_overwritten(setup):
    # The cache hands out memory of dropped arrays only: a result the caller still holds
    # keeps its value while later steps reuse the memory of the ones it dropped.
    s, _, taken = setup
    n = s.num_replicas_in_sync
    kept = []
    for step in range(6):
        host = distinct_values(n, (64,), np.float32, seed=step)
        out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(_on_gpus(s, host),))
        if step % 2 == 0:
            kept.append((out, _reference("sum", host)))
        del out
    assert taken == [True] * 6
    for out, want in kept:
        for r, res in enumerate(s.experimental_local_results(out)):
            np.testing.assert_allclose(res.numpy(), want, rtol=1e-6, err_msg=f"replica {r}")


def test_steady_steps_allocate_no_device_memory(setup):
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    host = distinct_values(n, (7, 2), np.float32)
    per = _on_gpus(s, host)
    step = lambda x: dv.get_replica_context().all_reduce("sum", x)  # noqa: E731
    for _ in range(2):
        s.run(step, args=(per,))
    made = backend.allocations
    for _ in range(4):
        out = s.run(step, args=(per,))
        for res in s.experimental_local_results(out):
            np.testing.assert_allclose(res.numpy(), _reference("sum", host), rtol=1e-6)
        del out, res
    assert backend.allocations == made
    assert all(taken)


def _values(s, host, r, kind):
    places = s.extended._places
    if kind == "numpy":
        return host[r]
    if kind == "other-gpu":
        return dvc.to_device(host[r], places[(r + 1) % len(places)])
    return dvc.to_device(host[r], places[r])


@pytest.mark.parametrize("odd", ["numpy", "other-gpu"])
def test_one_replica_passing_another_kind_of_value_goes_the_general_way(setup, odd):
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    if odd == "other-gpu" and backend.gpus == 1:
        pytest.skip("one GPU: every replica's array is on it")
    host = distinct_values(n, (4,), np.float32)

    def step():
        # Made inside the step: distributed values would be moved to the replica's GPU.
        r = dv.get_replica_context().replica_id_in_sync_group
        x = _values(s, host, r, odd if r == n - 1 else "")
        return dv.get_replica_context().all_reduce("sum", x)

    out = s.run(step)
    assert True not in taken
    for r, res in enumerate(s.experimental_local_results(out)):
        got = res if isinstance(res, np.ndarray) else res.numpy()
        np.testing.assert_allclose(got, _reference("sum", host), rtol=1e-6, err_msg=f"replica {r}")


def test_integer_mean_and_bfloat16_go_the_general_way(setup):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    s, _, taken = setup
    n = s.num_replicas_in_sync
    ints = distinct_values(n, (6,), np.int32)
    out = s.run(lambda x: dv.get_replica_context().all_reduce("mean", x), args=(_on_gpus(s, ints),))
    for r, res in enumerate(s.experimental_local_results(out)):
        assert res.dtype == np.float64
        np.testing.assert_allclose(res.numpy(), _reference("mean", ints), err_msg=f"replica {r}")
    bf = [h.astype(ml_dtypes.bfloat16) for h in distinct_values(n, (6,), np.float32)]
    out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(_on_gpus(s, bf),))
    for r, res in enumerate(s.experimental_local_results(out)):
        np.testing.assert_allclose(res.numpy().astype(np.float64), _reference("sum", bf), rtol=1e-2)
    assert True not in taken


@pytest.mark.parametrize("differ", ["shape", "dtype", "op"])
def test_replicas_that_differ_get_the_general_paths_error_naming_them(setup, differ):
    s, _, taken = setup
    n = s.num_replicas_in_sync
    last = n - 1

    def make(ctx):
        r = ctx.replica_id_in_sync_group
        shape = (3,) if differ == "shape" and r == last else (4,)
        dtype = np.float64 if differ == "dtype" and r == last else np.float32
        return dvc.to_device(np.full(shape, r + 1, dtype), s.extended._places[r])

    per = s.experimental_distribute_values_from_function(make)

    def step(x):
        ctx = dv.get_replica_context()
        op = "max" if differ == "op" and ctx.replica_id_in_sync_group == last else "sum"
        return ctx.all_reduce(op, x)

    with pytest.raises(dv.MismatchError, match=f"replica {last}"):
        s.run(step, args=(per,))
    assert taken == [False]
    # The next step pairs as before.
    host = distinct_values(n, (4,), np.float32)
    out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(_on_gpus(s, host),))
    for res in s.experimental_local_results(out):
        np.testing.assert_allclose(res.numpy(), _reference("sum", host), rtol=1e-6)


def test_the_cache_hands_out_one_block_per_device_in_one_visit(setup):
    s, backend, _ = setup
    places = s.extended._places
    blocks = cuda_memory.allocate_many(dvc._require_backend(), [1000] * len(places), places)
    assert [b.gpu for b in blocks] == list(places)
    assert len({b.ptr for b in blocks}) == len(places) and all(b.nbytes == 1024 for b in blocks)
    ptrs = {b.ptr for b in blocks}
    del blocks
    again = cuda_memory.allocate_many(dvc._require_backend(), [600] * len(places), places)
    assert {b.ptr for b in again} == ptrs  # the same size class: the dropped blocks again


# ---- structures of DeviceArrays (a model's gradients) ------------------------------------------
Pair = collections.namedtuple("Pair", "w b")


def _tree_host(n, op, seed=0):
    """Per replica: host arrays of a nested structure with several dtypes and shapes
    (an integer leaf only where the op keeps integers integers)."""
    shapes = [((5, 3), np.float32), ((3,), np.float64), ((4, 2), np.float16), ((2,), np.int32)]
    if op == "mean":
        shapes[3] = ((2,), np.float32)
    leaves = [distinct_values(n, shape, dt, seed=seed + i) for i, (shape, dt) in enumerate(shapes)]
    return [[leaves[i][r] for i in range(len(shapes))] for r in range(n)]


def _nest(leaves):
    return {"dense": [leaves[0], leaves[1]], "emb": Pair(w=leaves[2], b=leaves[3])}


def _tree_on_gpus(s, host):
    places = s.extended._places
    return s.experimental_distribute_values_from_function(
        lambda ctx: _nest(
            [dvc.to_device(h, places[ctx.replica_id_in_sync_group]) for h in host[ctx.replica_id_in_sync_group]]
        )
    )


def _check_tree(s, out, host, op):
    n = s.num_replicas_in_sync
    for r, res in enumerate(s.experimental_local_results(out)):
        assert set(res) == {"dense", "emb"} and type(res["dense"]) is list and type(res["emb"]) is Pair
        got = [res["dense"][0], res["dense"][1], res["emb"].w, res["emb"].b]
        for i, g in enumerate(got):
            want = _reference(op, [host[q][i] for q in range(n)])
            assert type(g) is dvc.DeviceArray and g.device == s.extended._places[r]
            assert g.dtype == host[r][i].dtype and g.shape == host[r][i].shape
            rtol = 1e-3 if g.dtype == np.float16 else 1e-6
            np.testing.assert_allclose(g.numpy().astype(np.float64), want, rtol=rtol, err_msg=f"replica {r} leaf {i}")


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_a_structure_of_device_arrays_takes_one_engine_call_per_leaf(setup, op):
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    host = _tree_host(n, op)
    per = _tree_on_gpus(s, host)
    calls = len(backend.calls)
    out = s.run(lambda x: dv.get_replica_context().all_reduce(op, x), args=(per,))
    assert taken == [True]
    assert [c[0] for c in backend.calls[calls:]] == ["all_reduce"] * 4
    _check_tree(s, out, host, op)
    # New memory for every result leaf, none of it an input's; the inputs are untouched.
    ins = [x for t in s.experimental_local_results(per) for x in dv.nest.flatten(t)]
    outs = [x for t in s.experimental_local_results(out) for x in dv.nest.flatten(t)]
    assert len({x.ptr for x in ins + outs}) == 2 * 4 * n
    for r, t in enumerate(s.experimental_local_results(per)):
        for i, x in enumerate(dv.nest.flatten(t)):
            np.testing.assert_array_equal(x.numpy(), host[r][i])


def test_a_structures_calls_after_the_first_are_queued_with_one_host_wait(setup, monkeypatch):
    # The first call is synchronous (it follows the copies that made the inputs); the
    # others go to replica 0's own stream without a host wait each, and one wait on
    # that stream ends the step's all-reduce.
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    events = []
    group_run = type(s.extended._gpu_quick._group).run

    def run(self, kind, dtype, op, algorithm, root, ins, outs, stream=None, stream_device=-1, wait_for=()):
        events.append(("run", stream, stream_device))
        return group_run(self, kind, dtype, op, algorithm, root, ins, outs, stream, stream_device, wait_for)

    monkeypatch.setattr(type(s.extended._gpu_quick._group), "run", run)
    monkeypatch.setattr(
        backend, "synchronize_stream", lambda st, gpu=-1, timeout_seconds=None: events.append(("wait", st, gpu))
    )
    host = _tree_host(n, "sum")
    out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(_tree_on_gpus(s, host),))
    own = (s.extended._gpu_quick._group.replica_stream(0), s.extended._places[0])
    assert taken == [True]
    assert events == [("run", None, -1)] + [("run", *own)] * 3 + [("wait", *own)]
    _check_tree(s, out, host, "sum")


def test_structure_results_kept_across_steps_stay_and_steady_steps_allocate_nothing(setup):
    # Every result leaf of a replica's GPU shares one block of the cache: one kept leaf
    # keeps it, and the memory of dropped steps is what later steps reuse.
    s, backend, taken = setup
    step = lambda x: dv.get_replica_context().all_reduce("sum", x)  # noqa: E731
    n = s.num_replicas_in_sync
    kept = []
    for k in range(6):
        host = _tree_host(n, "sum", seed=10 * k)
        out = s.run(step, args=(_tree_on_gpus(s, host),))
        if k % 2 == 0:
            # Only one leaf of one replica kept: the others are dropped.
            last = s.experimental_local_results(out)[n - 1]["emb"].w
            kept.append((last, _reference("sum", [h[2] for h in host])))
        del out
    assert taken == [True] * 6
    per = _tree_on_gpus(s, _tree_host(n, "sum"))
    for k in range(6):
        if k == 2:
            made = backend.allocations
        s.run(step, args=(per,))
    assert backend.allocations == made
    for leaf, want in kept:
        np.testing.assert_allclose(leaf.numpy().astype(np.float64), want, rtol=1e-3)


@pytest.mark.parametrize("differ", ["structure", "shape", "numpy-leaf"])
def test_structures_that_differ_go_the_general_way(setup, differ):
    s, _, taken = setup
    n = s.num_replicas_in_sync
    last = n - 1
    host = _tree_host(n, "sum")

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        leaves = [dvc.to_device(h, s.extended._places[r]) for h in host[r]]
        if r == last and differ == "structure":
            leaves = {"dense": leaves[:2], "emb": [leaves[2], leaves[3]]}
        elif r == last and differ == "shape":
            leaves[1] = dvc.to_device(np.zeros(4), s.extended._places[r])
        elif r == last:
            leaves[0] = host[r][0]
        return dv.get_replica_context().all_reduce("sum", leaves if isinstance(leaves, dict) else _nest(leaves))

    if differ == "numpy-leaf":
        out = s.run(step)
        for r, res in enumerate(s.experimental_local_results(out)):
            got = res["dense"][0]
            got = got if isinstance(got, np.ndarray) else got.numpy()
            np.testing.assert_allclose(got, _reference("sum", [h[0] for h in host]), rtol=1e-6, err_msg=f"replica {r}")
    else:
        with pytest.raises(dv.MismatchError, match=f"replica {last}"):
            s.run(step)
    assert True not in taken
    out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(_tree_on_gpus(s, host),))
    _check_tree(s, out, host, "sum")


def test_new_arrays_of_a_step_share_one_aligned_block_per_device(setup):
    s, _, _ = setup
    places = s.extended._places
    specs = [
        ((3,), np.dtype(np.float16)),
        ((700,), np.dtype(np.float64)),
        ((0,), np.dtype(np.float32)),
        ((2, 2), np.dtype(np.int8)),
    ]
    rows = dvc.DeviceArray._new_set(specs, places)
    spans = []
    for r, row in enumerate(rows):
        assert [(a.shape, a.dtype) for a in row] == specs and all(a.device == places[r] for a in row)
        # At offsets of whole 512-byte classes from a block as aligned as cudaMalloc's (256).
        assert all(a.ptr % 256 == 0 and (a.ptr - a._owner.ptr) % 512 == 0 for a in row)
        spans += [(a.device, a.ptr, a.ptr + a.nbytes) for a in row if a.nbytes]
    # One block per device, and no two arrays overlap.
    for d in set(places):
        assert len({a._owner for row, p in zip(rows, places) if p == d for a in row}) == 1
    spans.sort()
    for (d1, _, e1), (d2, b2, _) in itertools.pairwise(spans):
        assert d1 != d2 or e1 <= b2
    # Each array writes and reads back its own values.
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            a.copy_from(np.full(a.shape, r * 10 + i, a.dtype))
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            np.testing.assert_array_equal(a.numpy(), np.full(a.shape, r * 10 + i, a.dtype))


def test_new_arrays_of_devices_holding_different_numbers_of_replicas(monkeypatch):
    # Two replicas on GPU 0, one on GPU 1: a block of two parts there, one of one part here.
    install(SimulatedCuda(2), monkeypatch.setattr)
    specs = [((5,), np.dtype(np.float32)), ((130,), np.dtype(np.int64))]
    rows = dvc.DeviceArray._new_set(specs, [0, 1, 0])
    assert [[a.device for a in row] for row in rows] == [[0, 0], [1, 1], [0, 0]]
    assert rows[0][0]._owner is rows[2][1]._owner and rows[1][0]._owner is not rows[0][0]._owner
    assert rows[0][0]._owner.nbytes >= 2 * (512 + 1536) and rows[1][0]._owner.nbytes >= 512 + 1536
    ptrs = sorted(a.ptr for i in (0, 2) for a in rows[i])
    assert all(b - a >= 512 for a, b in itertools.pairwise(ptrs))
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            a.copy_from(np.arange(a.size, dtype=a.dtype) * (r + 1) + i)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            np.testing.assert_array_equal(a.numpy(), np.arange(a.size, dtype=a.dtype) * (r + 1) + i)


def test_a_call_refused_midway_waits_for_the_queued_ones_then_reports(setup, monkeypatch):
    s, backend, taken = setup
    n = s.num_replicas_in_sync
    events = []
    group_type = type(s.extended._gpu_quick._group)
    group_run = group_type.run

    def run(self, *args, **kwargs):
        events.append("run")
        if len(events) == 3:
            raise RuntimeError("the third leaf's call, refused")
        return group_run(self, *args, **kwargs)

    monkeypatch.setattr(group_type, "run", run)
    monkeypatch.setattr(backend, "synchronize_stream", lambda st, gpu=-1, timeout_seconds=None: events.append("wait"))
    step = lambda x: dv.get_replica_context().all_reduce("sum", x)  # noqa: E731
    host = _tree_host(n, "sum")
    with pytest.raises(RuntimeError, match="third leaf"):
        s.run(step, args=(_tree_on_gpus(s, host),))
    assert events == ["run", "run", "run", "wait"]
    # The strategy stays usable: the next step is right.
    _check_tree(s, s.run(step, args=(_tree_on_gpus(s, host),)), host, "sum")
    assert taken == [True]  # (the refused step raised through the counter)
