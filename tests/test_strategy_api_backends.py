"""The TensorFlow API additions on every backend of the strategy suite (CPU replicas
inline and on threads, simulated GPUs, a real GPU marked ``gpu``): sparse variable
updates and reads, variables created inside run, input options and optionals. At the
end, torch, cupy and JAX device arrays in and out, on a real GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from test_strategy_backends import BACKENDS, Env, assert_on, env, host_of  # noqa: F401 - env is a fixture

import distvals as dv
from distvals import cuda as dvc

SUM = dv.VariableAggregation.SUM
ON_READ = dv.VariableSynchronization.ON_READ
_ = (BACKENDS, Env)


def rid() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def test_sparse_updates_and_reads_on_gpu_copies(env):
    s = env.strategy(2)
    with s.scope():
        v = dv.Variable(np.arange(8, dtype=np.float32).reshape(4, 2), aggregation=SUM)
    v.scatter_add(dv.IndexedSlices(np.ones((2, 2), np.float32), np.array([0, 3])))
    s.run(lambda: v.scatter_nd_add(np.array([[rid(), 1]]), np.array([10.0 * (rid() + 1)], np.float32)))
    want = np.arange(8, dtype=np.float64).reshape(4, 2)
    want[[0, 3]] += 1
    want[0, 1] += 10
    want[1, 1] += 20
    for r, c in enumerate(v.values):
        assert_on(c.value(), env.place(r), f"copy {r}")
        np.testing.assert_array_equal(host_of(c.value()), want)
    rows = s.run(lambda: v.sparse_read([3, rid()]))
    for r in range(2):
        assert_on(rows.values[r], env.place(r), f"sparse_read of replica {r}")
        np.testing.assert_array_equal(host_of(rows.values[r]), want[[3, r]])
    picked = v.gather_nd([[1, 1]])
    assert_on(picked, env.place(0), "gather_nd in cross-replica context")
    np.testing.assert_array_equal(host_of(picked), [want[1, 1]])


def test_integer_sum_sync_on_read_split_and_count_up_to_on_gpus(env):
    s = env.strategy(2)
    with s.scope():
        total = dv.Variable(0, synchronization=ON_READ, aggregation=SUM)
        steps = dv.Variable(np.int64(0), aggregation=dv.VariableAggregation.ONLY_FIRST_REPLICA)
    total.assign(7)
    assert [int(host_of(c.value())) for c in total.values] == [4, 3]
    assert int(host_of(total.read_value())) == 7
    assert int(steps.count_up_to(3)) == 0
    assert int(s.run(lambda: steps.count_up_to(3)).values[0]) == 1
    assert [int(host_of(c.value())) for c in steps.values] == [2, 2]
    for r, c in enumerate(steps.values):
        assert_on(c.value(), env.place(r), f"counter copy {r}")


def test_variable_created_inside_run_on_gpus(env):
    s = env.strategy(2)
    v = s.run(lambda: dv.Variable(np.full(3, rid() + 1.0, np.float32)))
    assert isinstance(v, dv.MirroredVariable)
    for r, c in enumerate(v.values):
        assert_on(c.value(), env.place(r), f"copy {r}")
        np.testing.assert_array_equal(host_of(c.value()), [1.0, 1.0, 1.0])


def test_input_options_and_optionals_on_gpus(env):
    s = env.strategy(2)
    ds = dv.data.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32)).batch(4)
    it = iter(s.experimental_distribute_dataset(ds))
    opt = it.get_next_as_optional()
    assert opt.has_value()
    for r in range(2):
        assert_on(opt.get_value().values[r], env.place(r), f"batch part {r}")
    assert it.element_spec == dv.specs.PerReplicaSpec(dv.TensorSpec((None,)), dv.TensorSpec((None,)))

    def dataset_fn(ctx):
        return dv.data.Dataset.from_tensor_slices(np.arange(4, dtype=np.float32) + 10 * ctx.input_pipeline_id).batch(2)

    per_replica = dv.InputReplicationMode.PER_REPLICA
    placed = s.distribute_datasets_from_function(
        dataset_fn,
        dv.InputOptions(
            experimental_replication_mode=per_replica,
            experimental_fetch_to_device=False,
            experimental_place_dataset_on_device=True,
        ),
    )
    first = next(iter(placed))
    for r in range(2):
        assert_on(first.values[r], env.place(r), f"placed part {r}")
        np.testing.assert_array_equal(host_of(first.values[r]), np.array([0.0, 1.0]) + 10 * r)
    host = next(
        iter(
            s.distribute_datasets_from_function(
                dataset_fn,
                dv.InputOptions(experimental_replication_mode=per_replica, experimental_fetch_to_device=False),
            )
        )
    )
    assert all(isinstance(p, np.ndarray) for p in host.values)


# ---- framework arrays on a real GPU -----------------------------------------------------------------

real_gpu = pytest.mark.skipif(dvc.logical_device_count() == 0, reason=f"no CUDA device: {dvc.unavailable_reason()}")


@pytest.fixture
def gpu_strategy():
    before = dv.config.get_logical_gpus()
    dv.config.set_logical_gpus(2)
    s = dv.MirroredStrategy(["GPU:0", "GPU:1"])
    try:
        yield s
    finally:
        s.close()
        dv.config.set_logical_gpus(before)


@pytest.mark.gpu
@real_gpu
def test_torch_cuda_tensors_in_and_out(gpu_strategy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    s = gpu_strategy

    def fn():
        x = (torch.arange(6, device="cuda", dtype=torch.float32) * (rid() + 1)).requires_grad_()
        ctx = dv.get_replica_context()
        return (
            ctx.all_reduce("SUM", x),
            ctx.all_reduce("MEAN", x.detach().to(torch.bfloat16)),
            ctx.all_gather(x.detach().reshape(2, 3).T, axis=0),
        )  # a non-contiguous view too

    total, mean, gathered = s.run(fn)
    for r in range(2):
        assert total.values[r].is_cuda and total.values[r].dtype == torch.float32
        np.testing.assert_allclose(total.values[r].cpu().numpy(), np.arange(6) * 3)
        assert mean.values[r].dtype == torch.bfloat16 and mean.values[r].is_cuda
        np.testing.assert_allclose(mean.values[r].float().cpu().numpy(), np.arange(6) * 1.5, rtol=1e-2)
        assert gathered.values[r].shape == (6, 2) and gathered.values[r].is_cuda
        np.testing.assert_allclose(
            gathered.values[r].cpu().numpy(),
            np.concatenate([(np.arange(6.0) * (q + 1)).reshape(2, 3).T for q in range(2)]),
        )
    reduced = s.reduce("SUM", s.run(lambda: torch.ones(3, device="cuda") * (rid() + 1)), axis=None)
    assert isinstance(reduced, torch.Tensor) and reduced.is_cuda
    np.testing.assert_allclose(reduced.cpu().numpy(), [3.0, 3.0, 3.0])
    # CPU replicas take CUDA tensors through the host and give CUDA tensors back.
    cpu_strategy = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        back = cpu_strategy.run(
            lambda: dv.get_replica_context().all_reduce(
                "SUM", torch.full((2,), rid() + 1.0, device="cuda", dtype=torch.bfloat16)
            )
        )
        for t in back.values:
            assert t.is_cuda and t.dtype == torch.bfloat16 and t.float().cpu().tolist() == [3.0, 3.0]
    finally:
        cpu_strategy.close()


@pytest.mark.gpu
@real_gpu
def test_mirrored_strategy_without_devices_uses_every_gpu():
    s = dv.MirroredStrategy()
    try:
        n = dvc.logical_device_count()
        assert s.num_replicas_in_sync == n
        assert s.extended.worker_devices == tuple(f"/job:localhost/replica:0/task:0/device:GPU:{k}" for k in range(n))
    finally:
        s.close()


@pytest.mark.gpu
@real_gpu
def test_cupy_and_jax_device_arrays_in_and_out(gpu_strategy):
    s = gpu_strategy
    cupy = pytest.importorskip("cupy")
    out = s.run(lambda: dv.get_replica_context().all_reduce("SUM", cupy.arange(4.0) * (rid() + 1)))
    for v in out.values:
        assert isinstance(v, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(v), np.arange(4.0) * 3)
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX without a GPU")
    got = s.run(lambda: dv.get_replica_context().all_reduce("SUM", jnp.arange(4.0) * (rid() + 1)))
    for v in got.values:
        assert type(v).__module__.split(".")[0] in ("jax", "jaxlib")
        np.testing.assert_allclose(np.asarray(v), np.arange(4.0) * 3)
    cpu_strategy = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        back = cpu_strategy.run(lambda: dv.get_replica_context().all_reduce("MEAN", cupy.ones(2) * rid()))
        assert all(isinstance(v, cupy.ndarray) for v in back.values)  # via the host, back to the GPU
        np.testing.assert_allclose(cupy.asnumpy(back.values[1]), [0.5, 0.5])
    finally:
        cpu_strategy.close()


@pytest.mark.parametrize("n", [1, 2])
def test_reducing_or_gathering_a_plain_value_gives_a_new_array(env, n):
    # The value stands for every replica's; its reduction (MEAN, or any op with one
    # replica) and gather are the value itself, but as a new array: changing the input
    # afterwards (in place, as a later collective or a framework's in-place op would)
    # must not change them.
    s = env.strategy(n)
    start = np.arange(1, 5, dtype=np.float32)

    def make():
        x = np.array(start)
        return dvc.to_device(x, env.place(0)) if env.on_gpu else x

    def overwrite(x):
        if env.on_gpu:
            x.copy_from(np.full(4, 99, np.float32))
        else:
            x[...] = 99

    calls = {
        "strategy.reduce MEAN": lambda x: s.reduce("MEAN", x, axis=None),
        "reduce_to MEAN, one device": lambda x: s.extended.reduce_to("MEAN", x, env.device(0)),
    }
    if n == 1:
        calls["strategy.reduce SUM"] = lambda x: s.reduce("SUM", x, axis=None)
        calls["strategy.gather"] = lambda x: s.gather(x, axis=0)
        calls["0-d strategy.gather"] = None
    for what, call in calls.items():
        if call is None:
            x = np.array(7.0, np.float32)
            got = s.gather(x, axis=0)
            x[...] = 99
            np.testing.assert_array_equal(host_of(got), [7.0], err_msg=what)
            continue
        x = make()
        got = call(x)
        overwrite(x)
        np.testing.assert_array_equal(host_of(got), start, err_msg=f"{what}: changing the input changed the result")


def test_indexing_a_variable_reads_and_assigns_a_part_or_says_why_not(env):
    s = env.strategy(2)
    with s.scope():
        v = dv.Variable(np.arange(6, dtype=np.float32))
    if env.on_gpu:
        # A DeviceArray has no indexing: the error says what to use instead, and nothing changes.
        with pytest.raises(TypeError, match=r"DeviceArray on a GPU.*v\.numpy\(\)\[key\].*scatter_nd_update"):
            v[1:3].assign([7.0, 8.0])
        want = np.arange(6, dtype=np.float32)
    else:
        v[1:3].assign([7.0, 8.0])
        want = np.array([0, 7, 8, 3, 4, 5], np.float32)
    for r, c in enumerate(v.values):
        np.testing.assert_array_equal(host_of(c.value()), want, err_msg=f"copy {r}")
