"""The CUDA backend from Python.

Tests marked ``gpu`` run every collective on GPU replicas (logical replicas of one GPU,
``distvals.config.set_logical_gpus``) against a float64 host reference, with outputs
poisoned first and every replica checked; they skip with the reason when
``distvals.cuda.device_count()`` is 0. The others run everywhere: the build and the
no-GPU behaviour, the device-array protocols (with a pointer that is never
dereferenced), logical GPU mapping, and the Python layer of GPU groups over the
simulated backend of ``simulated_cuda`` (streams, reused outputs, per-replica calls).
"""

from __future__ import annotations

import gc
import os
import pathlib
import threading
import weakref

import numpy as np
import pytest
from conftest import distinct_values, reference, tolerance
from simulated_cuda import SimulatedCuda, install

import distvals as dv
from distvals import _core, config, cuda_group
from distvals import cuda as dvc
from distvals.cuda_group import _stream_arg

try:
    import ml_dtypes

    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False

GPUS = dvc.device_count()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(GPUS == 0, reason=f"no CUDA device: {dvc.unavailable_reason()}")


def _nvidia_device_nodes() -> bool:
    return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


# ---- the build and the machine without a GPU ---------------------------------------------


def test_has_cuda_matches_the_generated_config_header():
    header = pathlib.Path(dv.__file__).parent / "include" / "distvals" / "config.hpp"
    if not header.exists():
        pytest.skip(f"the installed package has no {header}")
    built = "#define DISTVALS_HAS_CUDA 1" in header.read_text()
    assert _core.has_cuda is built
    assert hasattr(_core, "cuda") is built


@pytest.mark.skipif(_nvidia_device_nodes(), reason="this machine has NVIDIA device nodes")
def test_device_count_is_zero_without_a_gpu():
    assert dvc.device_count() == 0
    assert not dvc.is_available()
    assert dvc.logical_device_count() == 0
    assert dvc.unavailable_reason() != ""


def test_device_count_without_the_cuda_backend(monkeypatch):
    class CoreWithoutCuda:
        pass

    monkeypatch.setattr(dvc, "_core", CoreWithoutCuda())
    assert dvc.device_count() == 0
    assert "without the CUDA backend" in dvc.unavailable_reason()
    with pytest.raises(RuntimeError, match="without the CUDA backend"):
        dvc.DeviceArray((2,), np.float32, 0)


@pytest.mark.skipif(not _core.has_cuda, reason="built without the CUDA backend")
@pytest.mark.skipif(GPUS > 0, reason="a GPU is present")
def test_without_a_gpu_gpu_groups_and_arrays_fail_clearly():
    with pytest.raises(dv.CudaError, match="no CUDA device is available"):
        dv.ReplicaGroup(["GPU:0", "GPU:1"])
    with pytest.raises(dv.CudaError, match="no CUDA device is available"):
        dvc.DeviceArray((4,), np.float32, 0)
    with pytest.raises(dv.CudaError):
        dvc.to_device(np.arange(3.0))


def test_a_group_of_cpu_and_gpu_replicas_is_rejected():
    with pytest.raises(ValueError, match="either CPU or GPU"):
        dv.ReplicaGroup(["CPU:0", "GPU:0"])


def test_cpu_groups_still_work_in_this_build():
    bufs = distinct_values(3, (1009,), "float32")
    want = reference(bufs, "sum")
    with dv.ReplicaGroup(["CPU:0", "CPU:1", "CPU:2"]) as g:
        g.all_reduce(bufs)
    for r, b in enumerate(bufs):
        np.testing.assert_allclose(b, want, rtol=1e-6, err_msg=f"replica {r}")


# ---- logical GPUs -------------------------------------------------------------------------------


@pytest.fixture
def logical_gpus():
    before = config.get_logical_gpus()
    yield config.set_logical_gpus
    config.set_logical_gpus(before)


def test_logical_gpus_map_names_to_cuda_devices(logical_gpus):
    logical_gpus(4)
    assert config.get_logical_gpus() == 4
    assert [config.physical_gpu(k) for k in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert dvc.physical_device("GPU:5") == 1
    assert dvc.physical_device("/job:localhost/replica:0/task:0/device:GPU:3") == 0
    assert dvc.physical_device(3) == 3  # an int is a CUDA ordinal already
    assert dvc.logical_device_count() == 4 * dvc.device_count()
    with pytest.raises(ValueError, match="not a GPU"):
        dvc.physical_device("CPU:0")


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError)])
def test_set_logical_gpus_rejects_bad_values(logical_gpus, bad, exc):
    with pytest.raises(exc, match="set_logical_gpus"):
        config.set_logical_gpus(bad)
    assert config.get_logical_gpus() >= 1


# ---- device arrays: the protocols, over memory that is never touched -------------------------


FAKE_PTR = 0x7F0000100000  # looks like a device address; nothing here dereferences it


def _fake(shape, dtype, device=0, owner=None, readonly=False):
    return dvc.DeviceArray._view(FAKE_PTR, tuple(shape), np.dtype(dtype), device, owner, readonly)


class _CAI:
    """A foreign CUDA array (as cupy or numba would expose one)."""

    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


class _DLPackOnly:
    """A foreign array that speaks only DLPack (as jax does)."""

    def __init__(self, inner):
        self._inner = inner

    def __dlpack__(self, **kw):
        return self._inner.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._inner.__dlpack_device__()


def test_cuda_array_interface_describes_the_memory():
    a = _fake((2, 3), np.float32, device=1)
    cai = a.__cuda_array_interface__
    assert cai["shape"] == (2, 3)
    assert np.dtype(cai["typestr"]) == np.float32
    assert cai["data"] == (FAKE_PTR, False)
    assert cai["strides"] is None and cai["version"] == 3
    assert a.__dlpack_device__() == (2, 1)
    assert (a.shape, a.dtype, a.device, a.size, a.nbytes, a.ndim, len(a)) == ((2, 3), np.float32, 1, 6, 24, 2, 2)
    assert repr(a) == "DeviceArray(shape=(2, 3), dtype=float32, device=1)"


def test_foreign_cuda_array_interface_is_viewed_without_copy():
    owner = _CAI({"shape": (4, 5), "typestr": "<i4", "data": (FAKE_PTR, True), "version": 3, "strides": None})
    a = dvc.as_device_array(owner, device=2)
    assert (a.ptr, a.shape, a.dtype, a.device, a.readonly) == (FAKE_PTR, (4, 5), np.int32, 2, True)
    assert a._owner is owner  # kept alive by the view
    # C-contiguous strides spelled out are fine; others are not.
    ok = _CAI({"shape": (4, 5), "typestr": "<f8", "data": (FAKE_PTR, False), "version": 2, "strides": (40, 8)})
    assert dvc.as_device_array(ok, device=0).shape == (4, 5)
    bad = _CAI({"shape": (4, 5), "typestr": "<f8", "data": (FAKE_PTR, False), "version": 2, "strides": (8, 32)})
    with pytest.raises(ValueError, match="not C-contiguous"):
        dvc.as_device_array(bad, device=0)
    masked = _CAI({"shape": (2,), "typestr": "<f4", "data": (FAKE_PTR, False), "version": 2, "mask": object()})
    with pytest.raises(TypeError, match="masked"):
        dvc.as_device_array(masked, device=0)
    odd = _CAI({"shape": (2,), "typestr": "<c8", "data": (FAKE_PTR, False), "version": 2})
    with pytest.raises(TypeError, match="not supported"):
        dvc.as_device_array(odd, device=0)


@pytest.mark.skipif(not _core.has_cuda, reason="built without the CUDA backend")
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bfloat16"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4, 5), (2, 0, 3)])
def test_dlpack_round_trip_keeps_pointer_shape_dtype_and_owner(dtype, shape):
    if dtype == "bfloat16":
        if not HAVE_BF16:
            pytest.skip("bfloat16 needs ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    src = _fake(shape, dt, device=3)
    alive = weakref.ref(src)
    view = dvc.as_device_array(_DLPackOnly(src))
    assert (view.ptr, view.shape, view.dtype, view.device) == (FAKE_PTR, tuple(shape), dt, 3)
    del src
    gc.collect()
    assert alive() is not None, "the exported tensor must keep its owner alive"
    del view
    gc.collect()
    assert alive() is None, "dropping the view must release the exported tensor"


@pytest.mark.skipif(not _core.has_cuda, reason="built without the CUDA backend")
def test_an_unconsumed_dlpack_capsule_releases_its_owner():
    src = _fake((3,), np.float32)
    alive = weakref.ref(src)
    cap = src.__dlpack__()
    del src
    gc.collect()
    assert alive() is not None
    del cap
    gc.collect()
    assert alive() is None
    with pytest.raises(BufferError, match="cannot be exported"):
        _fake((3,), np.float32, device=0).__dlpack__(dl_device=(1, 0))


@pytest.mark.skipif(not HAVE_BF16, reason="bfloat16 needs ml_dtypes")
def test_bfloat16_arrays_offer_dlpack_but_not_the_array_interface():
    a = _fake((4,), ml_dtypes.bfloat16)
    assert not hasattr(a, "__cuda_array_interface__")
    assert hasattr(a, "__dlpack__")


def test_host_arrays_are_not_device_arrays():
    with pytest.raises(TypeError, match="not a CUDA device"):
        dvc.as_device_array(np.arange(4.0))  # numpy speaks DLPack, from the host
    with pytest.raises(TypeError, match="to_device"):
        dvc.as_device_array([1.0, 2.0])
    with pytest.raises(ValueError, match="expected CUDA device 1"):
        dvc.as_device_array(_fake((2,), np.float32, device=0), device=1)


def test_stream_arguments_of_every_kind():
    class CupyLike:
        ptr = 0x1234
        device_id = 1

    class TorchLike:
        class device:
            index = 2

        cuda_stream = 0x5678

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x9ABC)

    assert _stream_arg(None) == (None, -1)
    assert _stream_arg(0) == (0, -1)
    assert _stream_arg(CupyLike()) == (0x1234, 1)
    assert _stream_arg(TorchLike()) == (0x5678, 2)
    assert _stream_arg(Protocol()) == (0x9ABC, -1)
    with pytest.raises(TypeError, match="stream"):
        _stream_arg("default")


# ---- the Python layer of GPU groups, on the simulated backend ----------------------------------------


def _in_threads(n, fn):
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:
            errors[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a replica thread hung"
    return results, errors


@pytest.fixture
def sim(monkeypatch):
    """Two simulated GPUs behind distvals.cuda and CudaReplicaGroup."""
    backend = SimulatedCuda(2)
    install(backend, monkeypatch.setattr)
    before = config.get_logical_gpus()
    config.set_logical_gpus(4)
    yield backend
    config.set_logical_gpus(before)


def _sim_group(n=2):
    return cuda_group.CudaReplicaGroup([f"GPU:{k}" for k in range(n)], timeout_seconds=20)


class _TorchBf16Like:
    """A CUDA tensor whose __cuda_array_interface__ raises TypeError (as torch does for
    bfloat16) but which speaks CUDA DLPack."""

    def __init__(self, inner):
        self._inner = inner

    @property
    def __cuda_array_interface__(self):
        raise TypeError("dtype bfloat16 has no array interface typestr")

    def __dlpack__(self, **kw):
        return self._inner.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._inner.__dlpack_device__()


@pytest.mark.skipif(not _core.has_cuda, reason="built without the CUDA backend")
def test_an_array_interface_that_raises_falls_back_to_dlpack():
    from distvals import devices

    src = _fake((5,), np.float32, device=2)
    x = _TorchBf16Like(src)
    a = dvc.as_device_array(x)
    assert (a.ptr, a.shape, a.device) == (FAKE_PTR, (5,), 2)
    assert devices.is_device_array(x), "a CUDA tensor must not be taken for host data"
    assert dvc.cuda_array_interface(x) is None


def test_a_producer_stream_is_waited_for_on_the_device_not_the_host(sim, monkeypatch):
    synced = []
    monkeypatch.setattr(sim, "synchronize_stream", lambda *a, **k: synced.append(a))
    with _sim_group() as g:
        bufs = [dvc.to_device(np.arange(4.0) + r, 0) for r in range(2)]
        produced = [_CAI(dict(b.__cuda_array_interface__, stream=0x5150 + r)) for r, b in enumerate(bufs)]
        g.all_reduce(produced)
        assert synced == [], "a collective must not wait on the host for the producer's stream"
        assert sorted(sim.waited) == [(0x5150, 0), (0x5151, 0)]
        np.testing.assert_array_equal(bufs[1].numpy(), np.arange(4.0) * 2 + 1)
    # Without a consumer stream (a plain conversion) the host still waits, as before.
    dvc.as_device_array(produced[0])
    assert synced == [(0x5150, 0)]


def test_all_gather_outputs_are_reused_once_dropped(sim):
    with _sim_group() as g:
        xs = [dvc.to_device(np.full(3, r, np.float32), 0) for r in range(2)]
        outs = g.all_gather(xs)
        np.testing.assert_array_equal(outs[1].numpy(), [0, 0, 0, 1, 1, 1])
        del outs
        before = sim.allocations
        for _ in range(5):
            outs = g.all_gather(xs)
            np.testing.assert_array_equal(outs[0].numpy(), [0, 0, 0, 1, 1, 1])
            del outs
        assert sim.allocations == before, "steady-state all_gather allocated device memory"
        kept = g.all_gather(xs)  # still held: the next call gets fresh buffers
        again = g.all_gather(xs)
        assert kept[0].ptr != again[0].ptr
        np.testing.assert_array_equal(kept[1].numpy(), again[1].numpy())


def test_results_of_a_call_enqueued_on_a_stream_name_that_stream(sim):
    with _sim_group() as g:
        xs = [dvc.to_device(np.full(3, r, np.float32), 0) for r in range(2)]
        outs = g.all_gather(xs, stream=0x77)
        assert all(o.__cuda_array_interface__["stream"] == 0x77 for o in outs)
        assert all(o.producer_stream == (0x77, 0) for o in outs)
        done = g.all_gather(xs)  # synchronous: complete on return
        assert all(o.__cuda_array_interface__["stream"] is None for o in done)


def test_gpu_per_replica_calls_meet_in_the_engine(sim):
    with _sim_group(3) as g:
        host = [np.arange(5, dtype=np.float32) + r for r in range(3)]
        bufs = [dvc.to_device(h, 0) for h in host]
        _, errors = _in_threads(3, lambda r: g.replica_all_reduce(r, bufs[r], op="max"))
        assert errors == [None] * 3
        for b in bufs:
            np.testing.assert_array_equal(b.numpy(), host[2])
        gathered, errors = _in_threads(3, lambda r: g.replica_all_gather(r, dvc.to_device(host[r], 0)))
        assert errors == [None] * 3
        for r, x in enumerate(gathered):
            np.testing.assert_array_equal(x.numpy(), np.concatenate(host), err_msg=f"replica {r}")


@pytest.mark.parametrize(
    "bad,kind,other",
    [
        (dict(op=None), TypeError, TypeError),
        (dict(opp="sum"), TypeError, TypeError),
        (dict(timeout_seconds="5"), TypeError, TypeError),
        (dict(array=[1.0, 2.0]), TypeError, TypeError),
        (dict(replica=7), ValueError, dv.AbortedError),
    ],
)
def test_gpu_per_replica_failures_before_the_meeting_reach_every_replica(sim, bad, kind, other):
    with _sim_group(2) as g:
        good = dvc.to_device(np.arange(4, dtype=np.float32), 0)

        def call(r):
            if r == 0:
                return g.replica_all_reduce(0, good)
            kwargs = dict(replica=1, array=dvc.to_device(np.ones(4, np.float32), 0))
            kwargs.update(bad)
            return g.replica_all_reduce(**kwargs)

        _, errors = _in_threads(2, call)
        assert isinstance(errors[1], kind), errors[1]
        assert isinstance(errors[0], other), errors[0]
        np.testing.assert_array_equal(good.numpy(), np.arange(4, dtype=np.float32))


def test_gpu_per_replica_shapes_must_agree(sim):
    with _sim_group(2) as g:
        parts = [dvc.to_device(np.zeros((2, 3), np.float32), 0), dvc.to_device(np.zeros((3, 2), np.float32), 0)]
        _, errors = _in_threads(2, lambda r: g.replica_all_gather(r, parts[r]))
        for r, e in enumerate(errors):
            assert isinstance(e, dv.MismatchError), (r, e)


# ---- on a GPU: every collective, against a float64 reference -------------------------------------

ALGOS = ["ring", "tree", "direct", "auto"]
OPS = ["sum", "prod", "min", "max", "mean"]
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
SIZES = [0, 1, 1009, 70001]
REPLICAS = [1, 2, 3, 4, 8]


def _np_dtype(name):
    if name == "bfloat16":
        if not HAVE_BF16:
            pytest.skip("bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _tol(name):
    return 8e-3 if name == "bfloat16" else tolerance(name)


def _values(n, count, dtype, op, seed=0):
    # Exact in every dtype (bfloat16 included): small integers, distinct per replica.
    base = distinct_values(n, (count,), "int32" if np.dtype(dtype).kind != "u" else "uint8", op, seed)
    return [b.astype(dtype) for b in base]


def _reference(host, op, dt):
    """float64 reference; integer dtypes reduce in their own type, wrapping like numpy."""
    if dt.kind in "iu" and op in ("sum", "prod"):
        stack = np.stack(host)
        red = np.sum(stack, axis=0, dtype=dt) if op == "sum" else np.prod(stack, axis=0, dtype=dt)
        return red.astype(np.float64)
    return reference(host, op)


def _check(outs, want, name):
    tol = _tol(name)
    for r, out in enumerate(outs):
        got = out.numpy().astype(np.float64)
        assert got.shape == want.shape, f"replica {r}: shape {got.shape}, want {want.shape}"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"replica {r}")


_GROUPS = {}


def _group(n, chunk_bytes=4096):
    """A cached group of n logical replicas on GPU 0 (small chunks so rings pipeline)."""
    key = (n, chunk_bytes)
    if key not in _GROUPS:
        before = config.get_logical_gpus()
        config.set_logical_gpus(n)
        try:
            _GROUPS[key] = dv.ReplicaGroup([f"GPU:{k}" for k in range(n)], chunk_bytes=chunk_bytes)
        finally:
            config.set_logical_gpus(before)
    return _GROUPS[key]


ALL_REDUCE_CASES = [
    (n, algo, dtype, size, op)
    for n in REPLICAS
    for algo in ALGOS
    for dtype in DTYPES
    for size in SIZES
    for op in OPS
    if not (op == "mean" and np.dtype("float32" if dtype == "bfloat16" else dtype).kind != "f")
    if not (size == 70001 and op not in ("sum", "mean"))
]


@gpu
@needs_gpu
@pytest.mark.parametrize("n,algo,dtype,size,op", ALL_REDUCE_CASES)
def test_gpu_all_reduce(n, algo, dtype, size, op):
    dt = _np_dtype(dtype)
    host = _values(n, size, dt, op, seed=size + n)
    want = _reference(host, op, dt)
    g = _group(n)
    ins = [dvc.to_device(h, 0) for h in host]
    outs = [dvc.to_device(np.full(size, 99, dtype=dt), 0) for _ in range(n)]  # poisoned
    g.all_reduce(ins, op=op, algorithm=algo, out=outs)
    _check(outs, want, dtype)
    for r, (a, h) in enumerate(zip(ins, host)):
        np.testing.assert_array_equal(a.numpy(), h, err_msg=f"input of replica {r} was modified")
    g.all_reduce(ins, op=op, algorithm=algo)  # in place
    _check(ins, want, dtype)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [0, 1, 1009])
def test_gpu_reduce_broadcast_gather_scatter(n, dtype, size):
    dt = _np_dtype(dtype)
    g = _group(n)
    root = n - 1
    host = _values(n, size, dt, "sum", seed=7)
    # reduce: in place at the root; the others only read
    bufs = [dvc.to_device(h, 0) for h in host]
    g.reduce(bufs, root=root, op="max")
    _check([bufs[root]], reference(host, "max"), dtype)
    for r in range(n - 1):
        np.testing.assert_array_equal(bufs[r].numpy(), host[r], err_msg=f"replica {r} changed by reduce")
    # broadcast: every replica gets the root's data
    bufs = [dvc.to_device(h if r == root else np.full(size, 99, dt), 0) for r, h in enumerate(host)]
    g.broadcast(bufs, root=root)
    _check(bufs, host[root].astype(np.float64), dtype)
    # all_gather: concatenation along axis 0 on every replica
    outs = g.all_gather([dvc.to_device(h, 0) for h in host])
    _check(outs, np.concatenate(host).astype(np.float64), dtype)
    # reduce_scatter: block r of the reduction on replica r
    big = _values(n, size * n, dt, "sum", seed=9)
    ops = ["sum", "mean"] if dt.kind == "f" or dtype == "bfloat16" else ["sum"]
    for op in ops:
        outs = g.reduce_scatter([dvc.to_device(h, 0) for h in big], op=op)
        full = reference(big, op)
        for r, o in enumerate(outs):
            _check([o], full[r * size : (r + 1) * size], dtype)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_per_replica_style_from_threads(n):
    g = _group(n)
    host = _values(n, 4099, np.float32, "sum", seed=3)
    bufs = [dvc.to_device(h, 0) for h in host]
    _, errors = _in_threads(n, lambda r: g.replica_all_reduce(r, bufs[r], op="mean"))
    assert errors == [None] * n
    _check(bufs, reference(host, "mean"), "float32")
    gathered, errors = _in_threads(n, lambda r: g.replica_all_gather(r, dvc.to_device(host[r], 0)))
    assert errors == [None] * n
    _check(gathered, np.concatenate(host).astype(np.float64), "float32")


@gpu
@needs_gpu
def test_gpu_enqueue_on_a_caller_stream_without_waiting():
    g = _group(4)
    host = _values(4, 1 << 20, np.float32, "sum", seed=5)
    bufs = [dvc.to_device(h, 0) for h in host]
    for _ in range(3):  # back to back on the same stream: each call orders after the last
        g.all_reduce(bufs, stream=0)  # the legacy default stream of GPU 0, which .numpy() follows
    want = reference(host, "sum")
    for _ in range(2):
        want = want * 4
    _check(bufs, want, "float32")


@gpu
@needs_gpu
def test_gpu_bad_arguments_name_the_replica():
    g = _group(2)
    a = dvc.to_device(np.zeros(8, np.float32), 0)
    b = dvc.to_device(np.zeros(9, np.float32), 0)
    c = dvc.to_device(np.zeros(8, np.int32), 0)
    with pytest.raises(ValueError, match="replica 1 has shape"):
        g.all_reduce([a, b])
    with pytest.raises(TypeError, match="replica 1 has dtype"):
        g.all_reduce([a, c])
    with pytest.raises(TypeError, match="replica 1"):
        g.all_reduce([a, np.zeros(8, np.float32)])
    with pytest.raises(ValueError, match="overlaps"):
        g.all_reduce([a, a])
    with pytest.raises(TypeError, match="mean"):
        g.all_reduce([c, dvc.to_device(np.zeros(8, np.int32), 0)], op="mean")


@gpu
@needs_gpu
def test_gpu_device_array_round_trip_and_copies():
    host = np.arange(12, dtype=np.float64).reshape(3, 4)
    a = dvc.to_device(host, 0)
    np.testing.assert_array_equal(a.numpy(), host)
    b = a.copy()
    a.copy_from(host * 2)
    np.testing.assert_array_equal(b.numpy(), host)
    np.testing.assert_array_equal(np.asarray(a), host * 2)
    view = dvc.as_device_array(_CAI(a.__cuda_array_interface__))
    assert view.ptr == a.ptr and view.device == 0


@gpu
@needs_gpu
def test_gpu_cupy_arrays_are_taken_without_copies():
    cp = pytest.importorskip("cupy")
    xs = [cp.arange(1000, dtype=cp.float32) + r for r in range(2)]
    _group(2).all_reduce(xs)
    want = np.arange(1000, dtype=np.float64) * 2 + 1
    for r, x in enumerate(xs):
        np.testing.assert_allclose(cp.asnumpy(x), want, err_msg=f"replica {r}")


@gpu
@needs_gpu
def test_gpu_torch_tensors_are_taken_without_copies():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    xs = [torch.arange(1000, dtype=torch.float32, device="cuda:0") + r for r in range(2)]
    _group(2).all_reduce(xs)
    want = np.arange(1000, dtype=np.float64) * 2 + 1
    for r, x in enumerate(xs):
        np.testing.assert_allclose(x.cpu().numpy(), want, err_msg=f"replica {r}")
    t = torch.from_dlpack(dvc.to_device(np.arange(5, dtype=np.float32), 0))
    np.testing.assert_array_equal(t.cpu().numpy(), np.arange(5, dtype=np.float32))


@gpu
@needs_gpu
def test_gpu_torch_bfloat16_tensors_go_through_dlpack():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    xs = [torch.full((1000,), r + 1.5, dtype=torch.bfloat16, device="cuda:0") for r in range(2)]
    _group(2).all_reduce(xs)
    for r, x in enumerate(xs):
        np.testing.assert_array_equal(x.float().cpu().numpy(), np.full(1000, 4.0), err_msg=f"replica {r}")


@gpu
@needs_gpu
def test_gpu_tensors_still_written_on_a_torch_stream_are_waited_for():
    """Under torch.cuda.stream(s) the tensors are written on s; the collective must start
    after that work (through DLPack's stream handshake), not read half-written data."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    g = _group(2)
    s = torch.cuda.Stream()
    xs = [torch.zeros(1 << 22, device="cuda:0") for _ in range(2)]
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)  # keeps s busy for tens of milliseconds
        for r, x in enumerate(xs):
            x.fill_(r + 1)
        g.all_reduce(xs)
    torch.cuda.synchronize()
    for r, x in enumerate(xs):
        np.testing.assert_array_equal(x.cpu().numpy()[::4099], 3.0, err_msg=f"replica {r}")


@gpu
@needs_gpu
def test_gpu_cupy_arrays_on_a_cupy_stream_are_waited_for_without_a_host_sync():
    cp = pytest.importorskip("cupy")
    g = _group(2)
    with cp.cuda.Stream(non_blocking=True):
        xs = [cp.full(1 << 22, r + 1, dtype=cp.float32) for r in range(2)]
        g.all_reduce(xs)
    cp.cuda.Device(0).synchronize()
    for r, x in enumerate(xs):
        np.testing.assert_array_equal(cp.asnumpy(x)[::4099], 3.0, err_msg=f"replica {r}")


@gpu
@needs_gpu
def test_gpu_back_to_back_calls_on_two_caller_streams_stay_in_order():
    g = _group(2)
    host = [np.full(1 << 20, 1.0 if r == 0 else 0.0, np.float32) for r in range(2)]
    bufs = [dvc.to_device(h, 0) for h in host]
    torch = pytest.importorskip("torch")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for i in range(20):
        g.all_reduce(bufs, stream=(a if i % 2 else b))
    torch.cuda.synchronize()
    for r, x in enumerate(bufs):
        np.testing.assert_array_equal(x.numpy(), np.full(1 << 20, 2.0**19, np.float32), err_msg=f"replica {r}")


@gpu
@needs_gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_gpu_one_replica_per_gpu():
    devices = [f"GPU:{k}" for k in range(GPUS)]
    host = _values(GPUS, 70001, np.float32, "sum", seed=11)
    with dv.ReplicaGroup(devices) as g:
        bufs = [dvc.to_device(h, k) for k, h in enumerate(host)]
        g.all_reduce(bufs)
    _check(bufs, reference(host, "sum"), "float32")


if os.environ.get("DISTVALS_REQUIRE_GPU") == "1":  # set by bench/gpu_check.sh

    def test_a_gpu_is_required_here():
        assert GPUS > 0, f"DISTVALS_REQUIRE_GPU=1 but no CUDA device: {dvc.unavailable_reason()}"


def test_no_driver_at_all_is_said_so(monkeypatch):
    # The CUDA runtime reports "insufficient driver" also when there is no driver: the
    # reason says which it is.
    from distvals import cuda as dvc

    class NoDevices:
        def device_count(self):
            return 0

        def unavailable_reason(self):
            return "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"

    monkeypatch.setattr(dvc, "_backend", lambda: NoDevices())
    monkeypatch.setattr(dvc, "_driver_present", lambda: False)
    assert dvc.unavailable_reason().startswith("no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)")
    monkeypatch.setattr(dvc, "_driver_present", lambda: True)
    assert dvc.unavailable_reason().startswith("cudaErrorInsufficientDriver")
