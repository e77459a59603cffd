"""One strategy suite, run on every backend and in every execution mode.

Every test runs with CPU replicas inline and on threads, on the simulated GPU backend of
``simulated_cuda`` (two simulated GPUs over host memory, whose copies and collectives
check every pointer they are handed; it checks the Python layer's placement, packing
and which buffers reach which collective), and on a real GPU (marked ``gpu``; replicas
are logical GPUs of the machine's GPUs, skipped with the reason when there is none).
Results are compared with float64 numpy references, every replica checked, distinct
values per replica. A few tests only make sense on GPUs and skip on CPU replicas.

The tests at the end need no GPU at all: the device abstraction on host values, logical
GPU counting, and the errors when GPU replicas are asked for without a GPU.
"""

from __future__ import annotations

import math
import operator
import pathlib

import numpy as np
import pytest
from conftest import distinct_values, reference, tolerance
from simulated_cuda import SimulatedCuda, install

import distvals as dv
from distvals import config, devices
from distvals import cuda as dvc
from distvals.device_names import canonical_devices as _canonical_devices
from distvals.device_names import gpu_count as _gpu_count

SUM = dv.VariableAggregation.SUM
MEAN = dv.VariableAggregation.MEAN
FIRST = dv.VariableAggregation.ONLY_FIRST_REPLICA
NONE = dv.VariableAggregation.NONE
ON_READ = dv.VariableSynchronization.ON_READ

REAL_GPUS = dvc.device_count()
SIMULATED_GPUS = 2


class Env:
    """Where the replicas of a test run: CPU replicas (inline or threads), the simulated
    GPU backend or the real one."""

    def __init__(self, kind: str, physical: int, backend=None, execution: str = "auto") -> None:
        self.kind = kind
        self.physical = physical
        self.backend = backend
        self.execution = execution
        self.logical = 1
        self._strategies = []

    @property
    def on_gpu(self) -> bool:
        return self.kind in ("simulated", "cuda")

    def device(self, k: int) -> str:
        return f"GPU:{k}" if self.on_gpu else f"CPU:{k}"

    def strategy(self, n: int, **kwargs) -> dv.MirroredStrategy:
        """n replicas; GPU replicas spread over the physical GPUs (several per GPU when
        needed)."""
        if self.on_gpu:
            self.logical = math.ceil(n / self.physical)
            config.set_logical_gpus(self.logical)
        else:
            kwargs.setdefault("execution", self.execution)
        s = dv.MirroredStrategy([self.device(k) for k in range(n)], **kwargs)
        self._strategies.append(s)
        return s

    def place(self, r: int):
        """Where replica r's values live: its CUDA device, or None (host memory)."""
        return r // self.logical if self.on_gpu else None

    def needs_gpu(self) -> None:
        if not self.on_gpu:
            pytest.skip("a GPU-only behaviour")

    def close(self) -> None:
        for s in self._strategies:
            s.close()


BACKENDS = [
    pytest.param("cpu-inline", id="cpu-inline"),
    pytest.param("cpu-threads", id="cpu-threads"),
    pytest.param("simulated", id="simulated"),
    # One GPU, every replica a logical one on it: the machines GPU checks run on.
    pytest.param("simulated-1", id="simulated-1gpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(dvc.logical_device_count() == 0, reason=f"no CUDA device: {dvc.unavailable_reason()}"),
        ],
    ),
]


@pytest.fixture(params=BACKENDS)
def env(request, monkeypatch):
    before = config.get_logical_gpus()
    if request.param.startswith("cpu-"):
        e = Env("cpu", 0, execution=request.param.split("-")[1])
    elif request.param.startswith("simulated"):
        gpus = 1 if request.param == "simulated-1" else SIMULATED_GPUS
        sim = SimulatedCuda(gpus)
        install(sim, monkeypatch.setattr)
        e = Env("simulated", gpus, sim)
    else:
        e = Env("cuda", REAL_GPUS)
    try:
        yield e
    finally:
        e.close()
        config.set_logical_gpus(before)


def rid() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def host_of(x) -> np.ndarray:
    return devices.to_host(x)


def assert_on(x, gpu, what: str) -> None:
    """``x`` lives at ``gpu``: a DeviceArray on that CUDA device, or host memory (numpy)
    for None."""
    if gpu is None:
        assert isinstance(x, (np.ndarray, np.generic)), f"{what}: a {type(x).__name__}, not a numpy array"
        return
    assert isinstance(x, dvc.DeviceArray), f"{what}: a {type(x).__name__}, not a DeviceArray"
    assert x.device == gpu, f"{what}: on CUDA device {x.device}, expected {gpu}"


def ptr_of(x) -> int:
    return x.ptr if isinstance(x, dvc.DeviceArray) else np.asarray(x).ctypes.data


def readonly(x) -> bool:
    return x.readonly if isinstance(x, dvc.DeviceArray) else not np.asarray(x).flags.writeable


def check_close(got, want, dtype, what: str) -> None:
    tol = tolerance(dtype)
    g = np.asarray(host_of(got), dtype=np.float64)
    assert g.shape == np.shape(want), f"{what}: shape {g.shape}, want {np.shape(want)}"
    np.testing.assert_allclose(g, want, rtol=tol, atol=tol, err_msg=what)


def distribute(s, host):
    return s.experimental_distribute_values_from_function(lambda ctx: host[ctx.replica_id_in_sync_group])


NS = [2, 3]


# ---- run, values from a function ------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_run_hands_each_replica_its_part_on_its_gpu(env, n):
    s = env.strategy(n)
    host = distinct_values(n, (3, 4), np.float32)
    x = distribute(s, host)
    for r in range(n):
        assert_on(x.values[r], env.place(r), f"replica {r}'s part")
        np.testing.assert_array_equal(host_of(x.values[r]), host[r], err_msg=f"replica {r}")

    def step(v):
        r = rid()
        assert_on(v, env.place(r), f"replica {r} inside run")
        return v, r

    parts, ids = s.run(step, args=(x,))
    assert s.experimental_local_results(ids) == tuple(range(n))
    for r, p in enumerate(s.experimental_local_results(parts)):
        assert_on(p, env.place(r), f"replica {r}'s result")
        np.testing.assert_array_equal(host_of(p), host[r], err_msg=f"replica {r}")


def test_values_from_function_keep_python_numbers_and_host_only_dtypes(env):
    s = env.strategy(2)
    out = s.experimental_distribute_values_from_function(
        lambda ctx: {
            "lr": 0.5,
            "mask": np.array([True, ctx.replica_id_in_sync_group == 1]),
            "x": np.full(2, ctx.replica_id_in_sync_group, np.int64),
        }
    )
    assert out["lr"].values == (0.5, 0.5) and all(type(v) is float for v in out["lr"].values)
    for r in range(2):
        assert isinstance(out["mask"].values[r], np.ndarray)  # a GPU holds no bool
        np.testing.assert_array_equal(out["mask"].values[r], [True, r == 1])
        assert_on(out["x"].values[r], env.place(r), f"replica {r}")
        np.testing.assert_array_equal(host_of(out["x"].values[r]), [r, r])


# ---- cross-replica reduce and gather ------------------------------------------------------

REDUCE_CASES = [
    ("float32", "SUM"),
    ("float32", "MEAN"),
    ("float64", "MIN"),
    ("float64", "MAX"),
    ("int32", "SUM"),
    ("int32", "MEAN"),
    ("int8", "PRODUCT"),
    ("float16", "SUM"),
    ("uint8", "MAX"),
]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype,op", REDUCE_CASES)
def test_reduce_matches_the_float64_reference(env, n, dtype, op):
    s = env.strategy(n)
    host = distinct_values(n, (5, 3), dtype, op.lower())
    per = s.run(lambda v: v, args=(distribute(s, host),))
    out = s.reduce(op, per, axis=None)
    assert_on(out, env.place(0), "strategy.reduce")
    if op == "MEAN" and np.dtype(dtype).kind == "i":
        assert out.dtype == np.float64  # integer MEAN is computed in float64
    else:
        assert out.dtype == np.dtype(dtype)
    want = reference(host, op)
    if op == "SUM" and np.dtype(dtype).kind in "iu":
        want = np.sum(np.stack(host), axis=0, dtype=np.dtype(dtype)).astype(np.float64)
    if op == "PRODUCT":
        want = np.prod(np.stack(host), axis=0, dtype=np.dtype(dtype)).astype(np.float64)
    check_close(out, want, dtype, f"reduce {op} {dtype}")
    for r in range(n):  # the inputs are left alone
        np.testing.assert_array_equal(host_of(per.values[r]), host[r], err_msg=f"replica {r}'s part changed")


@pytest.mark.parametrize("n", NS)
def test_reduce_along_an_axis_and_of_host_values(env, n):
    s = env.strategy(n)
    host = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) for r in range(n)]
    per = distribute(s, host)
    stacked = np.concatenate([h.astype(np.float64) for h in host], axis=0)
    out = s.reduce("SUM", per, axis=0)
    assert_on(out, env.place(0), "reduce SUM axis 0")
    check_close(out, stacked.sum(axis=0), "float32", "SUM along axis 0")
    out = s.reduce("MEAN", per, axis=1)
    check_close(
        out, np.sum([h.astype(np.float64).sum(axis=1) for h in host], axis=0) / (3 * n), "float32", "MEAN along axis 1"
    )
    # Python floats returned by the replicas are reduced on the host, as numbers.
    loss = s.run(lambda: float(rid()) + 0.5)
    total = s.reduce("SUM", loss, axis=None)
    assert not isinstance(total, dvc.DeviceArray)
    assert float(total) == pytest.approx(sum(r + 0.5 for r in range(n)))
    # A Mirrored's MEAN is a copy of its value.
    m = s.extended.broadcast_to(np.arange(3.0), destinations=per)
    mean = s.reduce("MEAN", m, axis=None)
    assert_on(mean, env.place(0), "MEAN of a Mirrored")
    assert ptr_of(mean) != ptr_of(m.values[0])
    np.testing.assert_array_equal(host_of(mean), np.arange(3.0))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("axis,uneven", [(0, False), (0, True), (1, False), (1, True), (-1, False)])
def test_gather(env, n, axis, uneven):
    s = env.strategy(n)
    rng = np.random.default_rng(n)
    host = []
    for r in range(n):
        extra = r if uneven else 0
        shape = (2 + extra, 3) if axis == 0 else (2, 3 + extra)
        host.append(rng.integers(-50, 50, size=shape).astype(np.float32) + 100 * r)
    out = s.gather(distribute(s, host), axis=axis)
    assert_on(out, env.place(0), "strategy.gather")
    np.testing.assert_array_equal(host_of(out), np.concatenate(host, axis=axis))


def test_gather_of_scalars_gives_a_vector(env):
    s = env.strategy(3)
    per = distribute(s, [np.array(10.0 * r) for r in range(3)])
    out = s.gather(per, axis=0)
    assert_on(out, env.place(0), "gather of 0-d parts")
    np.testing.assert_array_equal(host_of(out), [0.0, 10.0, 20.0])


# ---- replica context: all_reduce and all_gather -------------------------------------------

RUN_CASES = [
    ("float32", "sum"),
    ("float64", "mean"),
    ("int32", "max"),
    ("int64", "min"),
    ("float16", "sum"),
    ("int32", "product"),
]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype,op", RUN_CASES)
def test_all_reduce_in_replica_context(env, n, dtype, op):
    s = env.strategy(n)
    host = distinct_values(n, (7,), dtype, op)
    x = distribute(s, host)
    out = s.run(lambda v: dv.get_replica_context().all_reduce(op, v), args=(x,))
    want = reference(host, op)
    if op == "product":
        want = np.prod(np.stack(host), axis=0, dtype=np.dtype(dtype)).astype(np.float64)
    for r in range(n):
        got = out.values[r]
        assert_on(got, env.place(r), f"replica {r}'s all_reduce")
        assert got.dtype == np.dtype(dtype)
        check_close(got, want, dtype, f"replica {r}")
        np.testing.assert_array_equal(host_of(x.values[r]), host[r], err_msg=f"replica {r}'s input changed")


@pytest.mark.parametrize("implementation", ["ring", "tree"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_floats_accumulate_in_float32_whatever_the_implementation(env, implementation, dtype):
    # Ring and tree round each partial result to the dtype in the engine; a strategy's
    # collectives promise float32 accumulation (one rounding at the end) on every path:
    # one array, a structure, and strategy.reduce. Partial sums in the dtype would give
    # float16 2048 + 1 + 1 = 2048 and bfloat16 256 + 1 + 1 = 256, a MEAN of 60000s inf and
    # a product 300 * 300 * 0 NaN (the partial 90000 is inf in float16).
    dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    big = 2048.0 if dtype == "float16" else 256.0
    n = 4
    s = env.strategy(n, communication_options=dv.CommunicationOptions(implementation=implementation))
    sums = [big, 1.0, 1.0, 0.0]
    prods = [300.0, 300.0, 0.0, 1.0]
    # float16: 60000s overflow a partial sum; bfloat16: 256 + 1 + 1 + 2 loses the ones.
    means = [60000.0] * n if dtype == "float16" else [256.0, 1.0, 1.0, 2.0]
    mean = float(np.mean(means))

    def step():
        r = rid()
        x = np.full(5, sums[r]).astype(dt)
        m = np.full(3, means[r]).astype(dt)
        p = np.full(2, prods[r]).astype(dt)
        tree = {"s": x, "m": m, "p": p}
        ctx = dv.get_replica_context()
        return (
            ctx.all_reduce("SUM", x),
            ctx.all_reduce("MEAN", m),
            ctx.all_reduce("PRODUCT", p),
            ctx.all_reduce("SUM", tree)["s"],
            ctx.all_reduce("MEAN", tree)["m"],
        )

    outs = s.run(step)
    wants = [big + 2.0, mean, 0.0, big + 2.0, mean]
    names = ["SUM", "MEAN", "PRODUCT", "SUM of a structure", "MEAN of a structure"]
    for out, want, name in zip(outs, wants, names):
        for r, got in enumerate(s.experimental_local_results(out)):
            g = host_of(got)
            assert g.dtype == dt, (name, r, g.dtype)
            want_dt = np.float32(want).astype(dt).astype(np.float64)
            np.testing.assert_array_equal(
                g.astype(np.float64), np.full(g.shape, want_dt), err_msg=f"{name}, replica {r}"
            )
    per = s.run(lambda: np.full(5, sums[rid()]).astype(dt))
    got = host_of(s.reduce("SUM", per, axis=None))
    np.testing.assert_array_equal(got.astype(np.float64), np.full(5, big + 2.0), err_msg="strategy.reduce SUM")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("bytes_per_pack", [0, 24])
def test_all_reduce_of_a_nested_structure_with_host_leaves(env, n, bytes_per_pack):
    opts = dv.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    s = env.strategy(n, communication_options=opts)
    rng = np.random.default_rng(5)
    trees = [
        {
            "w": rng.integers(-9, 10, size=(3, 4)).astype(np.float32) + r,
            "b": rng.integers(-9, 10, size=(5,)).astype(np.float32) - r,
            "count": np.array([r + 1, 2 * r], dtype=np.int32),
            "scale": np.array(r + 0.25),
        }  # 0-d float64
        for r in range(n)
    ]
    x = distribute(s, trees)

    def step(tree):
        r = rid()
        value = dict(tree, loss=float(r) * 1.5, host=np.full(2, r, np.float64))
        return dv.get_replica_context().all_reduce("SUM", value)

    out = s.run(step, args=(x,))
    for r in range(n):
        got = {k: v.values[r] for k, v in out.items()}
        for key in ("w", "b", "count", "scale"):
            assert_on(got[key], env.place(r), f"replica {r} '{key}'")
            want = np.sum([t[key].astype(np.float64) for t in trees], axis=0)
            check_close(got[key], want, trees[0][key].dtype, f"replica {r} '{key}'")
            assert got[key].dtype == trees[0][key].dtype
        # Host leaves come back as host values.
        assert isinstance(got["loss"], np.floating) and got["loss"] == pytest.approx(1.5 * sum(range(n)))
        assert isinstance(got["host"], np.ndarray)
        np.testing.assert_array_equal(got["host"], np.full(2, sum(range(n)), np.float64))


@pytest.mark.parametrize("n", NS)
def test_integer_mean_and_reduction_to_one_device(env, n):
    s = env.strategy(n, cross_device_ops=dv.ReductionToOneDevice(reduce_to_device=env.device(n - 1)))
    host = distinct_values(n, (4,), np.int32)
    x = distribute(s, host)
    out = s.run(lambda v: dv.get_replica_context().all_reduce("MEAN", v), args=(x,))
    summed = s.run(lambda v: dv.get_replica_context().all_reduce("SUM", (v, v)), args=(x,))
    want = reference(host, "mean")
    for r in range(n):
        assert_on(out.values[r], env.place(r), f"replica {r}")
        assert out.values[r].dtype == np.float64
        check_close(out.values[r], want, "float64", f"replica {r} MEAN")
        for i in range(2):
            check_close(summed[i].values[r], reference(host, "sum"), "int32", f"replica {r} SUM leaf {i}")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_in_replica_context(env, n, axis):
    s = env.strategy(n)
    host = [
        np.arange((r + 1) * 2, dtype=np.float32).reshape(-1, 2).T.copy() * (r + 1)
        if axis == 1
        else np.arange((r + 1) * 2, dtype=np.float32).reshape(-1, 2) * (r + 1)
        for r in range(n)
    ]
    x = distribute(s, host)

    def step(v):
        ctx = dv.get_replica_context()
        return ctx.all_gather(v, axis=axis), ctx.all_gather(np.array([ctx.replica_id_in_sync_group]), axis=0)

    out, ids = s.run(step, args=(x,))
    want = np.concatenate(host, axis=axis)
    for r in range(n):
        assert_on(out.values[r], env.place(r), f"replica {r}")
        np.testing.assert_array_equal(host_of(out.values[r]), want, err_msg=f"replica {r}")
        assert isinstance(ids.values[r], np.ndarray)
        np.testing.assert_array_equal(ids.values[r], np.arange(n))


# ---- merge_call and the extended methods --------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_merge_call_reduce_to_in_cross_replica_context(env, n):
    s = env.strategy(n)
    host = distinct_values(n, (6,), np.float32)
    x = distribute(s, host)

    def merge(strategy, v):
        return strategy.extended.reduce_to("SUM", v, destinations=v)

    out = s.run(lambda v: dv.get_replica_context().merge_call(merge, args=(v,)), args=(x,))
    for r in range(n):
        assert_on(out.values[r], env.place(r), f"replica {r}")
        check_close(out.values[r], reference(host, "sum"), "float32", f"replica {r}")


@pytest.mark.parametrize("n", NS)
def test_reduce_to_batch_reduce_to_broadcast_to(env, n):
    s = env.strategy(n)
    a = distinct_values(n, (4,), np.float32, seed=1)
    b = distinct_values(n, (2, 2), np.float64, seed=2)
    pa, pb = distribute(s, a), distribute(s, b)
    m = s.extended.reduce_to("MEAN", pa, destinations=pa)
    assert isinstance(m, dv.Mirrored)
    for r in range(n):
        assert_on(m.values[r], env.place(r), f"reduce_to copy {r}")
        check_close(m.values[r], reference(a, "mean"), "float32", f"reduce_to copy {r}")
    assert len({ptr_of(v) for v in m.values}) == n  # every replica its own copy
    ra, rb = s.extended.batch_reduce_to("SUM", [(pa, pa), (pb, pb)])
    for r in range(n):
        check_close(ra.values[r], reference(a, "sum"), "float32", f"batch item 0, replica {r}")
        check_close(rb.values[r], reference(b, "sum"), "float64", f"batch item 1, replica {r}")
        assert_on(rb.values[r], env.place(r), f"batch item 1, replica {r}")
    one = s.extended.reduce_to("MAX", pa, destinations=env.device(n - 1))
    assert_on(one, env.place(n - 1), "reduce_to one device")
    check_close(one, reference(a, "max"), "float32", "reduce_to one GPU")
    on_host = s.extended.reduce_to("SUM", pb, destinations="CPU:0")
    assert isinstance(on_host, np.ndarray)
    check_close(on_host, reference(b, "sum"), "float64", "reduce_to CPU:0")
    bc = s.extended.broadcast_to(np.arange(5, dtype=np.int64), destinations=pa)
    for r in range(n):
        assert_on(bc.values[r], env.place(r), f"broadcast_to copy {r}")
        np.testing.assert_array_equal(host_of(bc.values[r]), np.arange(5))


# ---- variables ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_mirrored_variable_copies_live_on_each_gpu(env, n):
    s = env.strategy(n)
    init = np.arange(6, dtype=np.float32).reshape(2, 3)
    with s.scope():
        v = dv.Variable(init, aggregation=SUM, name="w")
    assert isinstance(v, dv.MirroredVariable)
    for r, c in enumerate(v.values):
        assert_on(c.value(), env.place(r), f"copy {r}")
        assert readonly(c.value())
        np.testing.assert_array_equal(host_of(c), init)
    assert len({ptr_of(c.value()) for c in v.values}) == n
    assert v.shape == (2, 3) and v.dtype == np.float32
    assert "numpy=array([[0., 1., 2.]" in repr(v.values[0])

    def read():
        value = v.read_value()
        assert_on(value, env.place(rid()), f"replica {rid()} reading")
        return value

    seen = s.run(read)
    for r in range(n):
        np.testing.assert_array_equal(host_of(seen.values[r]), init)
    np.testing.assert_array_equal(host_of(v), init)


@pytest.mark.parametrize("n", NS)
def test_mirrored_variable_updates_in_replica_context(env, n):
    s = env.strategy(n)
    init = np.linspace(-1, 1, 6).astype(np.float32).reshape(2, 3)
    deltas = distinct_values(n, (2, 3), np.float32, seed=3)
    with s.scope():
        vs = dv.Variable(init, aggregation=SUM)
        vm = dv.Variable(init, aggregation=MEAN)
        vf = dv.Variable(init, aggregation=FIRST)
        vn = dv.Variable(init, aggregation=NONE)
        vi = dv.Variable(np.arange(4, dtype=np.int32), aggregation=SUM)
    d = distribute(s, deltas)
    ints = distribute(s, [np.full(4, r + 1, np.int32) for r in range(n)])

    def step(delta, k):
        vs.assign_add(delta)
        vm.assign_sub(delta)
        vf.assign(delta)
        vn.assign_add(delta)
        vi.assign_sub(k)
        return vs.read_value()

    seen = s.run(step, args=(d, ints))
    total = np.sum([x.astype(np.float64) for x in deltas], axis=0)
    for r in range(n):
        assert_on(seen.values[r], env.place(r), f"replica {r}")
        check_close(vs.values[r].value(), init + total, "float32", f"SUM copy {r}")
        check_close(vm.values[r].value(), init - total / n, "float32", f"MEAN copy {r}")
        check_close(vf.values[r].value(), deltas[0], "float32", f"ONLY_FIRST_REPLICA copy {r}")
        check_close(vn.values[r].value(), init + deltas[r], "float32", f"NONE copy {r}")
        np.testing.assert_array_equal(host_of(vi.values[r]), np.arange(4) - n * (n + 1) // 2, err_msg=f"int copy {r}")
        for var in (vs, vm, vf, vn, vi):
            assert_on(var.values[r].value(), env.place(r), f"copy {r} after the update")
            assert readonly(var.values[r].value())


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
def test_a_deep_copy_of_a_distributed_variable_is_independent_on_the_same_strategy(env, n, sync):
    # As TensorFlow: copy.deepcopy keeps the strategy, places and policy and copies each
    # copy's value (GPU ones into new device memory); updates of either do not show in
    # the other. A shallow copy shares the copies.
    import copy

    s = env.strategy(n)
    init = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    with s.scope():
        v = dv.Variable(init, aggregation=SUM, synchronization=getattr(dv.VariableSynchronization, sync), name="w")
    deltas = distinct_values(n, (2, 3), np.float32, seed=5)
    if sync == "ON_READ":  # copies that differ: each must be copied as it is
        s.run(lambda d: v.assign_add(d), args=(distribute(s, deltas),))
    before = [host_of(c).copy() for c in v.values]
    d = copy.deepcopy(v)
    assert type(d) is type(v) and d.distribute_strategy is s and d.name == v.name
    assert d.aggregation == v.aggregation and d.synchronization == v.synchronization
    assert copy.copy(v).values == v.values
    for r in range(n):
        assert d.values[r] is not v.values[r]
        # Each new copy belongs to the new variable (optimizer state found by container).
        assert s.extended.value_container(d.values[r]) is d, r
        assert s.extended.value_container(v.values[r]) is v, r
        assert_on(d.values[r].value(), env.place(r), f"deep copy {r}")
        np.testing.assert_array_equal(host_of(d.values[r]), before[r], err_msg=f"copy {r}")
    if env.on_gpu:
        assert not {ptr_of(c.value()) for c in d.values} & {ptr_of(c.value()) for c in v.values}
    # Updates of the original (in replica context) leave the deep copy as it was ...
    s.run(lambda x: v.assign_add(x), args=(distribute(s, deltas),))
    for r in range(n):
        np.testing.assert_array_equal(host_of(d.values[r]), before[r], err_msg=f"copy {r} after v's update")
    # ... and the other way round.
    with s.scope():
        d.assign(np.zeros((2, 3), np.float32))
    for r in range(n):
        assert not np.array_equal(host_of(v.values[r]), np.zeros((2, 3))), r
    # The same variable twice in one deepcopy is one new variable; inside another
    # strategy's scope it is an error.
    pair = copy.deepcopy([v, v])
    assert pair[0] is pair[1] and pair[0] is not v
    other = env.strategy(1)
    with other.scope(), pytest.raises(RuntimeError, match="copy.deepcopy of variable 'w:0'"):
        copy.deepcopy(v)


@pytest.mark.parametrize("n", NS)
def test_a_deep_copy_of_a_strategy_is_a_strategy_of_its_own(env, n):
    # As TensorFlow's copy.deepcopy of a strategy: the same configuration, and a strategy
    # that runs, scopes and closes apart from the original.
    import copy

    opts = dv.CommunicationOptions(timeout_seconds=42.0, bytes_per_pack=24)
    s = env.strategy(
        n, cross_device_ops=dv.ReductionToOneDevice(reduce_to_device=env.device(1)), communication_options=opts
    )
    c = copy.deepcopy(s)
    assert type(c) is type(s) and c is not s and c.extended is not s.extended
    assert c.extended.worker_devices == s.extended.worker_devices and c.num_replicas_in_sync == n
    assert c.execution == s.execution
    assert isinstance(c.extended._cross_device_ops, dv.ReductionToOneDevice)
    assert c.extended._cross_device_ops is not s.extended._cross_device_ops
    assert c.extended._cross_device_ops.reduce_to_device == env.device(1)
    assert c.extended._options.timeout_seconds == 42.0 and c.extended._options.bytes_per_pack == 24
    # Each strategy reduces its own replicas' values, placed where the original's are.
    host = distinct_values(n, (5,), np.float32, seed=11)
    for strategy in (c, s):
        out = strategy.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(distribute(strategy, host),))
        for r in range(n):
            assert_on(out.values[r], env.place(r), f"replica {r}")
            check_close(out.values[r], reference(host, "sum"), np.float32, f"replica {r}")
    # Variables made under the copy's scope are the copy's.
    with c.scope():
        v = dv.Variable(np.zeros(2, np.float32))
    assert v.distribute_strategy is c and dv.get_strategy() is not c
    # Closing the copy leaves the original running.
    c.close()
    with pytest.raises(RuntimeError):
        c.run(lambda: None)
    out = s.run(lambda: float(rid() + 1))
    assert [float(host_of(x)) for x in s.experimental_local_results(out)] == [r + 1.0 for r in range(n)]


def test_deep_copies_of_the_other_strategies():
    import copy

    one = dv.OneDeviceStrategy("/cpu:0")
    c = copy.deepcopy(one)
    assert type(c) is dv.OneDeviceStrategy and c is not one and c.extended.worker_devices == one.extended.worker_devices
    assert c.run(lambda x: x * 2, args=(np.float32(3),)) == 6
    c.close()
    assert one.run(lambda: 1) == 1
    one.close()
    # One default strategy per process.
    default = dv.get_strategy()
    assert copy.deepcopy(default) is default
    # A multi-worker strategy is made by every worker together: a copy on one is refused.
    mw = dv.MultiWorkerMirroredStrategy.__new__(dv.MultiWorkerMirroredStrategy)
    with pytest.raises(TypeError, match="MultiWorkerMirroredStrategy cannot be deep-copied.*on every worker"):
        copy.deepcopy(mw)


@pytest.mark.parametrize("n", NS)
def test_mirrored_variable_updates_in_cross_replica_context(env, n):
    s = env.strategy(n)
    with s.scope():
        v = dv.Variable(np.zeros(3, np.float64), aggregation=MEAN)
    v.assign([1.0, 2.0, 3.0])
    v.assign_add(np.ones(3))
    per = distribute(s, distinct_values(n, (3,), np.float64, seed=4))
    v.assign_sub(per)  # a PerReplica is reduced by the aggregation (MEAN) first
    want = np.array([2.0, 3.0, 4.0]) - reference([host_of(p) for p in per.values], "mean")
    for r in range(n):
        assert_on(v.values[r].value(), env.place(r), f"copy {r}")
        check_close(v.values[r].value(), want, "float64", f"copy {r}")


def test_updates_check_value_ranges_and_keep_host_only_dtypes_on_the_host(env):
    # Integers that do not fit the variable are refused from device values too (a cast
    # would wrap 300 to 44 in int8), and variables of dtypes GPUs do not hold (int16,
    # big-endian) take device values of other dtypes, in and out of run.
    s = env.strategy(2)
    with s.scope():
        v8 = dv.Variable(np.zeros(3, np.int8), aggregation=FIRST)
        v16 = dv.Variable(np.zeros(3, np.int16), aggregation=SUM)
        vbe = dv.Variable(np.arange(3, dtype=">f4"), aggregation=SUM)
    wide = distribute(s, [np.array([300, -200, 5], np.int64), np.array([1, 2, 3], np.int64)])
    with pytest.raises(TypeError, match=r"replica 0: assign of variable 'Variable:0': -200 does not fit in int8"):
        s.run(lambda d: v8.assign(d), args=(wide,))
    with pytest.raises(TypeError, match="-200 does not fit in int8"):
        v8.assign(wide)
    for r in range(2):
        np.testing.assert_array_equal(host_of(v8.values[r].value()), [0, 0, 0], err_msg=f"int8 copy {r} unchanged")
    small = distribute(s, [np.full(3, r + 1, np.int8) for r in range(2)])
    s.run(lambda d: v16.assign_add(d), args=(small,))
    s.run(lambda: vbe.assign_add(np.full(3, rid() + 1, ">f4")))
    for r in range(2):
        got16 = host_of(v16.values[r].value())
        assert got16.dtype == np.int16
        np.testing.assert_array_equal(got16, [3, 3, 3], err_msg=f"int16 SUM copy {r}")
        gotbe = host_of(vbe.values[r].value())
        assert gotbe.dtype == np.dtype(">f4")
        np.testing.assert_array_equal(gotbe, [3.0, 4.0, 5.0], err_msg=f"big-endian SUM copy {r}")
    v16.assign(small)  # cross-replica: the SUM of the parts
    for r in range(2):
        np.testing.assert_array_equal(host_of(v16.values[r].value()), [3, 3, 3], err_msg=f"int16 assign copy {r}")


@pytest.mark.parametrize("n", NS)
def test_sync_on_read_variable(env, n):
    s = env.strategy(n)
    with s.scope():
        total = dv.Variable(np.zeros(2, np.float32), synchronization=ON_READ, aggregation=SUM)
        mean = dv.Variable(np.zeros(2, np.float32), synchronization=ON_READ, aggregation=MEAN)
    local = distinct_values(n, (2,), np.float32, seed=6)
    x = distribute(s, local)

    def step(v):
        total.assign_add(v)
        mean.assign_add(v)
        mean.assign_add(v)

    s.run(step, args=(x,))
    for r in range(n):
        assert_on(total.values[r].value(), env.place(r), f"copy {r}")
        np.testing.assert_array_equal(host_of(total.values[r]), local[r])
    read = total.read_value()
    assert_on(read, env.place(0), "SyncOnRead SUM read")
    check_close(read, reference(local, "sum"), "float32", "SUM read")
    check_close(mean.read_value(), 2 * reference(local, "mean"), "float32", "MEAN read")
    total.assign(np.array([4.0, 8.0], np.float32))  # each copy holds value / n
    check_close(total.read_value(), [4.0, 8.0], "float32", "SUM read after assign")


def test_variables_survive_a_checkpoint(env, tmp_path):
    s = env.strategy(2)
    with s.scope():
        v = dv.Variable(np.arange(4, dtype=np.float32), name="v")
        t = dv.Variable(np.zeros(4, np.float32), synchronization=ON_READ, aggregation=SUM, name="t")
    s.run(lambda: t.assign_add(np.full(4, rid() + 1, np.float32)))
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, [v, t])
    with np.load(path) as data:
        np.testing.assert_array_equal(data["v"], np.arange(4))
        np.testing.assert_array_equal(data["t"], np.full(4, 3.0))
    v.assign(np.zeros(4, np.float32))
    dv.load_variables(path, [v, t])
    for r in range(2):
        assert_on(v.values[r].value(), env.place(r), f"restored copy {r}")
        np.testing.assert_array_equal(host_of(v.values[r]), np.arange(4))
    np.testing.assert_array_equal(host_of(t.read_value()), np.full(4, 3.0))


def test_variables_convert_to_python_values_as_numpy_does(env):
    # A DeviceArray used to take len() for its truth value: any non-empty GPU variable was
    # True whatever it held.
    s = env.strategy(2)
    with s.scope():
        zero = dv.Variable(np.zeros(1, np.float32), name="zero")
        pair = dv.Variable(np.zeros(2, np.float32), name="pair")
        count = dv.Variable(np.int32(2), name="count")
        z = dv.Variable(np.complex64(1 + 2j), synchronization=ON_READ, aggregation=FIRST, name="z")
        own = dv.Variable(np.float32(0), synchronization=ON_READ, aggregation=NONE, name="own")
    want = {"zero": False, "float": 2.0, "int": 2, "index": 30, "range": [0, 1], "complex": 1 + 2j}

    def convert():
        with pytest.raises(ValueError, match="ambiguous"):
            bool(pair)
        with pytest.raises(TypeError):
            operator.index(zero)
        return {
            "zero": bool(zero),
            "float": float(count),
            "int": int(count),
            "index": [10, 20, 30][count],
            "range": list(range(count)),
            "complex": complex(z),
        }

    assert convert() == want
    assert all(got == want for got in s.experimental_local_results(s.run(convert)))

    def own_truth():
        own.assign(np.float32(rid()))  # replica 0's copy 0.0, replica 1's 1.0
        return bool(own), float(own)

    assert s.experimental_local_results(s.run(own_truth)) == ((False, 0.0), (True, 1.0))


# ---- datasets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_distributed_dataset_batches_are_copied_to_each_gpu(env, n):
    s = env.strategy(n)
    x = np.arange(22 * 3, dtype=np.float32).reshape(22, 3)
    y = (np.arange(22) % 2).astype(bool)
    ds = dv.data.Dataset.from_tensor_slices((x, y)).batch(8)
    seen = 0
    for xb, yb in s.experimental_distribute_dataset(ds):
        parts = s.experimental_local_results(xb)
        labels = s.experimental_local_results(yb)
        sizes = [p.shape[0] for p in parts]
        batch = sum(sizes)
        assert sizes == [batch // n + (1 if r < batch % n else 0) for r in range(n)]
        start = seen
        for r, (p, lab) in enumerate(zip(parts, labels)):
            assert_on(p, env.place(r), f"replica {r}'s batch")
            np.testing.assert_array_equal(host_of(p), x[start : start + sizes[r]], err_msg=f"replica {r}")
            assert isinstance(lab, np.ndarray)  # bool labels stay on the host
            np.testing.assert_array_equal(lab, y[start : start + sizes[r]])
            start += sizes[r]
        seen += batch
    assert seen == 22


def test_fetch_to_device_false_keeps_batches_on_the_host(env):
    s = env.strategy(2)
    ds = dv.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4)
    opts = dv.InputOptions(experimental_fetch_to_device=False)
    batch = next(iter(s.experimental_distribute_dataset(ds, options=opts)))
    for r, p in enumerate(batch.values):
        assert isinstance(p, np.ndarray)
        np.testing.assert_array_equal(p, [2.0 * r, 2.0 * r + 1])


def test_device_batches_are_split_on_the_gpu(env):
    env.needs_gpu()
    s = env.strategy(2)
    source = [dvc.to_device(np.arange(10, dtype=np.int32).reshape(5, 2) + 100 * k, 0) for k in range(2)]
    out = list(s.experimental_distribute_dataset(source))
    for k, batch in enumerate(out):
        want = np.arange(10, dtype=np.int32).reshape(5, 2) + 100 * k
        parts = batch.values
        assert_on(parts[0], env.place(0), "replica 0")
        assert_on(parts[1], env.place(1), "replica 1")
        np.testing.assert_array_equal(parts[0].numpy(), want[:3])
        np.testing.assert_array_equal(parts[1].numpy(), want[3:])
        if env.place(0) == 0:
            assert parts[0].ptr == source[k].ptr  # a view of the batch, not a copy


@pytest.mark.parametrize("n", NS)
def test_datasets_from_function(env, n):
    s = env.strategy(n)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return dv.data.Dataset.from_tensor_slices(np.arange(10 * 2, dtype=np.float64).reshape(10, 2)).batch(3)

    dist = s.distribute_datasets_from_function(dataset_fn)
    assert contexts[0].num_replicas_in_sync == n
    batches = [np.arange(20.0).reshape(10, 2)[i : i + 3] for i in range(0, 10, 3)]
    got = list(dist)
    assert len(got) == math.ceil(len(batches) / n)
    for step, element in enumerate(got):
        for r, p in enumerate(element.values):
            assert_on(p, env.place(r), f"step {step} replica {r}")
            i = step * n + r
            want = batches[i] if i < len(batches) else np.empty((0, 2))
            np.testing.assert_array_equal(host_of(p), want, err_msg=f"step {step} replica {r}")


def test_one_device_strategy_on_a_gpu(env):
    env.needs_gpu()
    env.logical = 1
    config.set_logical_gpus(1)
    gpu = env.physical - 1
    s = dv.OneDeviceStrategy(f"GPU:{gpu}")
    env._strategies.append(s)
    with s.scope():
        v = dv.Variable(np.arange(3, dtype=np.float32))
    assert type(v) is dv.Variable
    assert_on(v.value(), gpu, "the variable")
    batch = next(iter(s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.arange(4.0)).batch(4))))
    assert_on(batch, gpu, "the batch")

    def step(x):
        v.assign_add(np.ones(3, np.float32))
        return dv.get_replica_context().all_reduce("SUM", x)

    out = s.run(step, args=(batch,))
    assert_on(out, gpu, "all_reduce with one replica")
    assert out.ptr != batch.ptr
    np.testing.assert_array_equal(host_of(out), np.arange(4.0))
    np.testing.assert_array_equal(host_of(v), np.arange(3) + 1.0)
    red = s.reduce("SUM", out, axis=None)  # a plain value: returned as it is
    np.testing.assert_array_equal(host_of(red), np.arange(4.0))


def test_a_cpu_strategy_takes_device_batches_to_the_host(env):
    env.needs_gpu()
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    env._strategies.append(s)
    source = [dvc.to_device(np.arange(6, dtype=np.float32).reshape(3, 2), 0)]
    batch = next(iter(s.experimental_distribute_dataset(source)))
    assert all(type(p) is np.ndarray for p in batch.values)
    np.testing.assert_array_equal(batch.values[0], [[0, 1], [2, 3]])
    np.testing.assert_array_equal(batch.values[1], [[4, 5]])
    per = dv.PerReplica(tuple(dvc.to_device(np.full(2, r + 1.0), 0) for r in range(2)))
    np.testing.assert_array_equal(s.reduce("SUM", per, axis=None), [3.0, 3.0])  # through the host


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "int8", "uint8"])
def test_element_wise_updates_on_a_gpu(env, dtype):
    env.needs_gpu()
    env.strategy(1)  # sets the logical GPUs of this backend
    rng = np.random.default_rng(3)
    dt = np.dtype(dtype)
    lo, hi = (0, 200) if dt.kind == "u" else (-100, 100)
    a = rng.integers(lo, hi, size=(4, 5)).astype(dt)
    b = rng.integers(lo, hi, size=(4, 5)).astype(dt)
    if dt.kind == "i" and dt.itemsize == 1:
        a[0, 0], b[0, 0] = -128, -128  # wraps like numpy
    da, db = dvc.to_device(a, 0), dvc.to_device(b, 0)
    with np.errstate(over="ignore"):
        want_add, want_sub = a + b, a - b
    got_add, got_sub = devices.add(da, db), devices.subtract(da, db)
    for got, want, what in ((got_add, want_add, "add"), (got_sub, want_sub, "subtract")):
        assert_on(got, 0, what)
        assert got.dtype == dt
        np.testing.assert_array_equal(host_of(got), want, err_msg=what)
    np.testing.assert_array_equal(host_of(da), a)
    np.testing.assert_array_equal(host_of(db), b)
    # An operand on the host, or in a smaller shape after a larger one, still works.
    np.testing.assert_array_equal(devices.subtract(dvc.to_device(a[:2], 0), b[:2]).numpy(), want_sub[:2])
    with pytest.raises(ValueError, match="same shape and dtype"):
        devices.add(da, b[:2])


# ---- failures ------------------------------------------------------------------------------------


def test_a_failing_replica_releases_the_others_and_the_strategy_runs_again(env):
    n = 3
    s = env.strategy(n, communication_options=dv.CommunicationOptions(timeout_seconds=30))
    x = distribute(s, distinct_values(n, (4,), np.float32))

    def step(v):
        if rid() == 1:
            raise KeyError("bad batch")
        return dv.get_replica_context().all_reduce("SUM", v)

    with pytest.raises(KeyError, match="replica 1"):
        s.run(step, args=(x,))
    out = s.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(x,))
    want = reference([host_of(p) for p in x.values], "sum")
    for r in range(n):
        check_close(out.values[r], want, "float32", f"replica {r} after the failure")


def test_masked_arrays_are_refused_before_anything_is_reduced(env):
    # The collectives read an array's data whole: a masked array's mask would be dropped
    # and its masked-out values counted, a wrong result with no error. Refused, naming
    # the replica, on every path a value enters by; the next collective still works.
    n = 2
    s = env.strategy(n, communication_options=dv.CommunicationOptions(timeout_seconds=30))
    masked = np.ma.array([1.0, 1e6, 3.0], mask=[False, True, False])
    host = distinct_values(n, (3,), np.float64)
    match = "replica 1: .*: a numpy masked array, whose mask would be dropped"
    if env.on_gpu:
        # Copied to a GPU, a value keeps no mask: refused on the way there, naming the
        # replica (with one GPU, every replica's copy goes to GPU 0).
        with pytest.raises(TypeError, match=r"replica 1: a copy to GPU \d+: a numpy masked array"):
            distribute(s, [host[0], masked])
        per = None
    else:
        per = distribute(s, [host[0], masked])

    def in_replica(call):
        def step(v):
            return call(dv.get_replica_context(), masked if rid() == 1 else v)

        return step

    calls = {
        "all_reduce": lambda: s.run(in_replica(lambda c, v: c.all_reduce("SUM", v)), args=(x,)),
        "all_reduce of a structure": lambda: s.run(in_replica(lambda c, v: c.all_reduce("SUM", [v, v])), args=(x,)),
        "all_gather": lambda: s.run(in_replica(lambda c, v: c.all_gather(v, axis=0)), args=(x,)),
        "strategy.reduce": lambda: s.reduce("SUM", per, axis=None),
        "strategy.reduce along an axis": lambda: s.reduce("SUM", per, axis=0),
        "strategy.gather": lambda: s.gather(per, axis=0),
        "reduce_to": lambda: s.extended.reduce_to("SUM", per, env.device(0)),
        "batch_reduce_to": lambda: s.extended.batch_reduce_to("SUM", [(per, env.device(0))]),
    }
    x = distribute(s, host)
    for what, call in calls.items():
        if per is None and "all" not in what:
            continue
        with pytest.raises(TypeError, match=match):
            call()
        out = s.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(x,))
        for r in range(n):
            check_close(out.values[r], host[0] + host[1], "float64", f"replica {r} after the refused {what}")
    with pytest.raises(TypeError, match="^strategy.reduce: a numpy masked array"):
        s.reduce("MEAN", masked, axis=None)


def test_a_value_on_another_gpu_is_moved_to_the_replicas_gpu(env):
    env.needs_gpu()
    if env.physical < 2:
        pytest.skip("needs 2 GPUs")
    s = env.strategy(2)  # one replica per GPU
    other = [dvc.to_device(np.full(3, 1.0 + r, np.float32), 1 - r) for r in range(2)]  # swapped GPUs
    per = dv.PerReplica(tuple(other))
    out = s.run(lambda v: dv.get_replica_context().all_reduce("SUM", v), args=(per,))
    for r in range(2):
        assert_on(out.values[r], r, f"replica {r}")
        np.testing.assert_array_equal(host_of(out.values[r]), np.full(3, 3.0))
    red = s.reduce("SUM", per, axis=None)
    assert_on(red, 0, "reduce")
    np.testing.assert_array_equal(host_of(red), np.full(3, 3.0))


def test_simulated_backend_refuses_host_memory_as_device_memory():
    # The checks the simulated tests rely on: a host pointer is not device memory.
    sim = SimulatedCuda(1)
    g = sim.Group(["GPU:0", "GPU:1"], 2)
    host = np.zeros(4, np.float32)
    dev = sim.DeviceBuffer(16, 0)
    with pytest.raises(ValueError, match="not simulated device memory"):
        g.run(
            "all_reduce",
            "float32",
            "sum",
            "auto",
            0,
            [(host.ctypes.data, 4, 0), (dev.ptr, 4, 0)],
            [(host.ctypes.data, 4, 0), (dev.ptr, 4, 0)],
        )
    with pytest.raises(ValueError, match="needs CUDA device 1, but there are 1"):
        sim.Group(["GPU:0", "GPU:1"], 1)  # GPU:1 needs a second device: refused at creation
    with pytest.raises(ValueError, match="replica 1: input lives on CUDA device 0, but replica 1 runs on 1"):
        sim2 = SimulatedCuda(2)
        a, b = sim2.DeviceBuffer(16, 0), sim2.DeviceBuffer(16, 0)
        sim2.Group(["GPU:0", "GPU:1"], 1).run(
            "all_reduce", "float32", "sum", "auto", 0, [(a.ptr, 4, 0), (b.ptr, 4, 0)], [(a.ptr, 4, 0), (b.ptr, 4, 0)]
        )
    with pytest.raises(ValueError, match="past the end"):
        sim.copy_to_device(dev.ptr, 0, np.zeros(8, np.float32).view(np.uint8))


# ---- no GPU needed: the device abstraction on host values ------------------------------------------


def test_host_values_are_not_device_arrays():
    class CpuDlpack:
        def __dlpack_device__(self):
            return (1, 0)

    class CudaDlpack:
        def __dlpack_device__(self):
            return (2, 1)

        def __dlpack__(self, **kw):
            raise BufferError("never called here")

    class Cai:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0x1000, False), "version": 3}

    for x in (np.zeros(3), np.float32(1), 1.5, 3, [1, 2], {"a": 1}, None, CpuDlpack()):
        assert not devices.is_device_array(x), type(x)
        assert devices.place_of(x) is None
    assert devices.is_device_array(CudaDlpack())
    assert devices.is_device_array(Cai())
    fake = dvc.DeviceArray._view(0x2000, (2,), np.dtype(np.float32), 3, None)  # never dereferenced
    assert devices.is_device_array(fake) and devices.place_of(fake) == 3
    assert devices.as_value(fake) is fake


def test_placement_names():
    assert devices.place_of_device(None) is None
    assert devices.place_of_device("CPU:3") is None
    assert devices.place_of_device("/job:localhost/replica:0/task:0/device:CPU:1") is None
    assert devices.place_of_device(2) == 2
    assert devices.is_gpu("GPU:0") and not devices.is_gpu("CPU:0")
    before = config.get_logical_gpus()
    try:
        config.set_logical_gpus(4)
        assert devices.place_of_device("GPU:5") == 1
        assert devices.place_of_device("/gpu:3") == 0
    finally:
        config.set_logical_gpus(before)
    assert devices.can_place(np.float16) and devices.can_place("int64")
    assert not devices.can_place(bool) and not devices.can_place(np.int16) and not devices.can_place(">f4")


def test_moving_host_values_to_the_host():
    a = np.arange(6.0).reshape(2, 3)
    assert devices.to_host(a) is a
    assert devices.to_replica_device(a, "CPU:1") is a
    c = devices.to_replica_device(a, None, copy=True)
    assert not np.shares_memory(c, a)
    np.testing.assert_array_equal(c, a)
    np.testing.assert_array_equal(devices.to_host([1, 2]), [1, 2])
    assert devices.to_host(2.5) == 2.5


def test_array_helpers_on_host_values():
    a = np.arange(12, dtype=np.int32).reshape(4, 3)
    e = devices.empty((2, 2), np.float16, "CPU:0")
    assert isinstance(e, np.ndarray) and e.shape == (2, 2) and e.dtype == np.float16
    el = devices.empty_like(a)
    assert el.shape == a.shape and el.dtype == a.dtype and not np.shares_memory(el, a)
    c = devices.copy(a)
    np.testing.assert_array_equal(c, a)
    assert not np.shares_memory(c, a)
    f = devices.freeze(np.ones(2))
    assert not f.flags.writeable
    np.testing.assert_array_equal(devices.reshape(a, (3, 4)), a.reshape(3, 4))
    rows = devices.slice_rows(a, 1, 3)
    np.testing.assert_array_equal(rows, a[1:3])
    assert np.shares_memory(rows, a)
    assert devices.cast(a, np.int32) is a
    np.testing.assert_array_equal(devices.cast(a, np.float64), a.astype(np.float64))
    np.testing.assert_array_equal(devices.concat_rows([a[:1], a[1:]], None), a)
    packed = devices.pack([a, np.array([1.5, 2.5])], np.float64, None)
    np.testing.assert_array_equal(packed, np.concatenate([a.reshape(-1), [1.5, 2.5]]).astype(np.float64))
    first, second = devices.unpack(packed, [(4, 3), (2,)])
    np.testing.assert_array_equal(first, a)
    np.testing.assert_array_equal(second, [1.5, 2.5])
    b = np.arange(12, dtype=np.int32).reshape(4, 3) * 7
    np.testing.assert_array_equal(devices.add(a, b), a.astype(np.float64) + b)
    np.testing.assert_array_equal(devices.subtract(a, b), a.astype(np.float64) - b)
    assert devices.add(a, b).dtype == np.int32


# ---- no GPU needed: counting logical GPUs, errors without a GPU ------------------------------------


@pytest.fixture
def one_simulated_gpu(monkeypatch):
    install(SimulatedCuda(1), monkeypatch.setattr)
    before = config.get_logical_gpus()
    yield
    config.set_logical_gpus(before)


def test_strategies_count_logical_gpus(one_simulated_gpu):
    assert dvc.device_count() == 1
    config.set_logical_gpus(4)
    assert dvc.logical_device_count() == 4
    assert _gpu_count() == 4
    assert _canonical_devices(None, "MirroredStrategy") == ["GPU:0", "GPU:1", "GPU:2", "GPU:3"]
    assert _canonical_devices(["/gpu:3"], "MirroredStrategy") == ["GPU:3"]
    config.set_logical_gpus(1)
    with pytest.raises(ValueError, match=r"GPU:3 requested, but distvals sees 1 GPU.*set_logical_gpus"):
        dv.MirroredStrategy(["GPU:0", "GPU:3"])


def test_a_strategy_keeps_the_gpus_it_was_made_with(one_simulated_gpu):
    config.set_logical_gpus(2)
    s = dv.MirroredStrategy(["GPU:0", "GPU:1"])
    try:
        config.set_logical_gpus(1)  # later settings do not move existing replicas
        assert s.extended._places == (0, 0)
        out = s.run(lambda: dv.get_replica_context().all_reduce("SUM", dvc.to_device(np.full(2, rid() + 1.0), 0)))
        for r in range(2):
            assert_on(out.values[r], 0, f"replica {r}")
            np.testing.assert_array_equal(out.values[r].numpy(), [3.0, 3.0])
    finally:
        s.close()


def test_cpu_and_gpu_replicas_cannot_be_mixed(one_simulated_gpu):
    config.set_logical_gpus(2)
    with pytest.raises(ValueError, match="mixes CPU and GPU devices"):
        dv.MirroredStrategy(["CPU:0", "GPU:0"])


def _nvidia_device_nodes() -> bool:
    return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


@pytest.mark.skipif(REAL_GPUS > 0 or _nvidia_device_nodes(), reason="this machine has a GPU")
def test_gpu_replicas_without_a_gpu_fail_clearly():
    reason = dvc.unavailable_reason()
    assert reason
    for make in (lambda: dv.MirroredStrategy(["GPU:0", "GPU:1"]), lambda: dv.OneDeviceStrategy("GPU:0")):
        with pytest.raises(ValueError, match=r"requested, but distvals sees 0 GPU\(s\)") as info:
            make()
        assert reason in str(info.value)
        assert "CPU:0" in str(info.value)


@pytest.mark.skipif(REAL_GPUS > 0 or _nvidia_device_nodes(), reason="this machine has a GPU")
def test_without_a_gpu_default_devices_are_one_cpu_and_cpu_paths_work():
    s = dv.MirroredStrategy()
    try:
        assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
        assert not s.extended._on_gpu and s.extended._places == (None,)
    finally:
        s.close()
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        assert s.extended._places == (None, None)
        out = s.run(lambda: dv.get_replica_context().all_reduce("SUM", np.full(3, rid() + 1.0)))
        for r in range(2):
            assert type(out.values[r]) is np.ndarray
            np.testing.assert_array_equal(out.values[r], np.full(3, 3.0))
    finally:
        s.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no os.fork")
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+: fork with threads
def test_a_gpu_strategy_made_before_a_fork_refuses_to_run_in_the_child(env):
    """CUDA cannot be used in a forked child: a GPU strategy made before the fork raises a
    RuntimeError there that says what to do; a CPU strategy works in the child, with
    this step's values. The parent's strategy works either way."""
    import os

    s = env.strategy(2)

    def step():
        return dv.get_replica_context().all_reduce("sum", np.full(3, float(rid() + 1)))

    s.run(step)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status, never return into pytest
        code = 3
        try:
            out = s.run(step)
            got = [host_of(x) for x in s.experimental_local_results(out)]
            ok = all(np.array_equal(g, np.full(3, 3.0)) for g in got)
            code = 0 if ok else 4
        except RuntimeError as e:
            refused = "created before os.fork()" in str(e) and "create the strategy in the child" in str(e)
            code = 10 if refused else 5
        except BaseException:
            code = 6
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == (10 if env.on_gpu else 0), f"child exit code {code}"
    out = s.run(step)
    for x in s.experimental_local_results(out):
        np.testing.assert_array_equal(host_of(x), np.full(3, 3.0))
