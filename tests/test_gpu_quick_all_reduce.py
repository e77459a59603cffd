"""The quick path of inline GPU replicas' ``ctx.all_reduce(op, x)`` with x one DeviceArray
(on the simulated CUDA backend): taken when every replica passes a DeviceArray on its own
GPU of one engine dtype and shape with one op, giving each replica a new result in one
engine call; every other case goes the general way, with the same results and errors."""

from __future__ import annotations

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
    blocks = cuda_memory.allocate_many(dvc._require_backend(), 1000, places)
    assert [b.gpu for b in blocks] == list(places)
    assert len({b.ptr for b in blocks}) == len(places) and all(b.nbytes == 1024 for b in blocks)
    ptrs = {b.ptr for b in blocks}
    del blocks
    again = cuda_memory.allocate_many(dvc._require_backend(), 600, places)
    assert {b.ptr for b in again} == ptrs  # the same size class: the dropped blocks again
