"""Arrays come back in their own framework: torch in, torch out (CPU here; bfloat16 and
tensors that require grad included), JAX and cupy where installed; numpy by default,
and no framework imported unless the caller passes one of its arrays.

torch is imported by the ``torch`` fixture, when these tests run (not when pytest
collects them), and this module is named to run after the ones that check, in the test
process, that distvals imported no framework.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import distvals as dv


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def rid():
    return dv.get_replica_context().replica_id_in_sync_group


def parts(r, dtype=None):
    import torch

    return (torch.arange(6, dtype=torch.float64).reshape(2, 3) * (r + 1) - 3 * r).to(dtype or torch.float32)


def reference(n, op="sum"):
    stack = np.stack([parts(r).double().numpy() for r in range(n)])
    return stack.sum(axis=0) if op == "sum" else stack.mean(axis=0)


def test_all_reduce_and_all_gather_give_torch_tensors(s3, torch):
    def fn():
        ctx = dv.get_replica_context()
        x = parts(rid())
        return (
            ctx.all_reduce("SUM", x),
            ctx.all_reduce("MEAN", {"w": x, "b": [x[0]]}),
            ctx.all_gather(x, axis=0),
            ctx.all_reduce("MAX", torch.tensor(float(rid()))),
        )

    total, mean, gathered, top = s3.run(fn)
    for r in range(3):
        assert isinstance(total.values[r], torch.Tensor) and total.values[r].dtype == torch.float32
        np.testing.assert_allclose(total.values[r].numpy(), reference(3), rtol=1e-6)
        np.testing.assert_allclose(mean["w"].values[r].numpy(), reference(3, "mean"), rtol=1e-6)
        np.testing.assert_allclose(mean["b"][0].values[r].numpy(), reference(3, "mean")[0], rtol=1e-6)
        assert isinstance(mean["b"], list) and isinstance(mean["b"][0].values[r], torch.Tensor)
        assert gathered.values[r].shape == (6, 3)
        np.testing.assert_array_equal(gathered.values[r].numpy(), np.concatenate([parts(q).numpy() for q in range(3)]))
        assert top.values[r].shape == () and float(top.values[r]) == 2.0  # 0-d stays 0-d
    # Every replica has its own result tensor.
    assert len({t.data_ptr() for t in total.values}) == 3


def test_tensors_that_require_grad_are_reduced_as_their_data(s2, torch):
    def fn():
        w = parts(rid()).requires_grad_()
        loss = (w * w).sum()
        loss.backward()
        return dv.get_replica_context().all_reduce("MEAN", w.grad)

    def data():
        return dv.get_replica_context().all_reduce("SUM", parts(rid()).requires_grad_())

    grads = s2.run(fn)
    want = np.mean([2 * parts(r).numpy() for r in range(2)], axis=0)
    for g in grads.values:
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)
    for t in s2.run(data).values:
        assert isinstance(t, torch.Tensor) and not t.requires_grad
        np.testing.assert_allclose(t.numpy(), reference(2), rtol=1e-6)


def test_bfloat16_tensors(s2, torch):
    def fn():
        x = parts(rid(), torch.bfloat16)
        ctx = dv.get_replica_context()
        return ctx.all_reduce("SUM", x), ctx.all_reduce("MEAN", x), ctx.all_gather(x, axis=1)

    total, mean, gathered = s2.run(fn)
    for r in range(2):
        assert total.values[r].dtype == torch.bfloat16 == mean.values[r].dtype == gathered.values[r].dtype
        np.testing.assert_allclose(total.values[r].float().numpy(), reference(2), rtol=1e-2)
        np.testing.assert_allclose(mean.values[r].float().numpy(), reference(2, "mean"), rtol=1e-2)
        assert gathered.values[r].shape == (2, 6)
    per_replica = s2.run(lambda: parts(rid(), torch.bfloat16))
    out = s2.reduce("SUM", per_replica, axis=None)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(), reference(2), rtol=1e-2)
    assert s2.gather(per_replica, axis=0).dtype == torch.bfloat16


def test_cross_replica_methods_give_torch_tensors(s2, torch):
    pr = s2.run(lambda: parts(rid()))
    checks = {
        "reduce": (s2.reduce("SUM", pr, axis=None), reference(2)),
        "reduce along an axis": (
            s2.reduce("MEAN", pr, axis=0),
            np.mean(np.concatenate([parts(r).numpy() for r in range(2)]), axis=0),
        ),
        "gather": (s2.gather(pr, axis=0), np.concatenate([parts(r).numpy() for r in range(2)])),
        "reduce_to one device": (s2.extended.reduce_to("SUM", pr, "CPU:0"), reference(2)),
        "reduce of a plain tensor": (s2.reduce("MEAN", parts(0), axis=None), parts(0).numpy()),
    }
    for what, (got, want) in checks.items():
        assert isinstance(got, torch.Tensor), what
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, err_msg=what)
    assert s2.reduce("MEAN", pr, axis=None).dtype == torch.float32
    assert s2.reduce("SUM", s2.run(lambda: torch.tensor([1.0, 2.0]).sum() * (rid() + 1)), axis=None).shape == ()
    mirrored = s2.extended.reduce_to("SUM", pr, pr)
    batch = s2.extended.batch_reduce_to("MEAN", [(pr, "CPU:1"), (pr, pr)])
    copies = s2.extended.broadcast_to(parts(5), pr)
    for m in (mirrored, batch[1], copies):
        assert isinstance(m, dv.Mirrored) and all(isinstance(v, torch.Tensor) for v in m.values)
    np.testing.assert_allclose(batch[0].numpy(), reference(2, "mean"), rtol=1e-6)
    np.testing.assert_allclose(copies.values[1].numpy(), parts(5).numpy())


def test_merge_call_results_in_torch(s2, torch):
    def merge_fn(strategy, x):
        return strategy.reduce("SUM", x, axis=None)

    out = s2.run(lambda: dv.get_replica_context().merge_call(merge_fn, args=(parts(rid()),)))
    # torch tensors cannot be made read-only: every replica but the first gets a copy of
    # its own (so run returns them as a PerReplica).
    first, second = s2.experimental_local_results(out)
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first is not second
    for t in (first, second):
        np.testing.assert_allclose(t.numpy(), reference(2), rtol=1e-6)


def test_a_torch_tensor_from_merge_fn_changed_in_place_changes_one_replica(s2, torch):
    def step():
        total = dv.get_replica_context().merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(parts(rid()),))
        if rid() == 0:
            total += 100  # in place, in replica 0 only
        dv.get_replica_context().all_reduce("SUM", np.float32(1))  # the other replica reads after it
        return total.clone()

    first, second = s2.experimental_local_results(s2.run(step))
    np.testing.assert_allclose(first.numpy(), reference(2) + 100, rtol=1e-6)
    np.testing.assert_allclose(second.numpy(), reference(2), rtol=1e-6)


def test_tensors_with_the_negative_or_conjugate_bit(s2, torch):
    # z.conj().imag holds -imag lazily: its memory has +imag. Read as its values
    # everywhere; written in place by the engine, refused (nothing changes).
    z = torch.tensor([1 + 2j, 3 + 4j, 5 + 6j, 7 + 8j])
    neg = z.conj().imag
    assert neg.is_neg()
    np.testing.assert_array_equal([float(x) for x in dv.data.Dataset.from_tensor_slices(neg)], [-2, -4, -6, -8])
    batch = next(iter(s2.experimental_distribute_dataset([neg])))
    np.testing.assert_array_equal(np.concatenate(s2.experimental_local_results(batch)), [-2, -4, -6, -8])
    g = dv.ReplicaGroup(2)
    other = torch.tensor([10.0, 20.0, 30.0, 40.0])
    for call in (g.all_gather, g.all_reduce):  # the engine views memory (in place, for all_reduce)
        with pytest.raises(TypeError, match="replica 0: a torch tensor with its negative bit set"):
            call([neg, other])
    np.testing.assert_array_equal(other.numpy(), [10, 20, 30, 40])
    g.all_reduce([neg.resolve_neg(), other])
    np.testing.assert_array_equal(other.numpy(), [8, 16, 24, 32])
    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", [neg, z.conj()][0]))
    np.testing.assert_array_equal(s2.experimental_local_results(out)[1].numpy(), [-4, -8, -12, -16])
    total = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", z.conj()))
    np.testing.assert_array_equal(s2.experimental_local_results(total)[0].numpy(), 2 * np.conj(z.numpy()))


def test_bfloat16_and_grad_tensors_in_variables_and_datasets(s2, torch):
    x = torch.tensor([1.5, -2.0, 3.25, 4.0], dtype=torch.bfloat16)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with s2.scope():
        v = dv.Variable(x)
        u = dv.Variable(w)
    assert v.dtype == np.dtype(ml_dtypes.bfloat16) and u.dtype == np.float32
    v.assign(x * 2)
    np.testing.assert_array_equal(np.asarray(v.numpy(), np.float32), [3.0, -4.0, 6.5, 8.0])
    s2.run(lambda: u.assign(w * 3))
    np.testing.assert_array_equal(u.numpy(), [3.0, 6.0, 9.0, 12.0])
    rows = [np.asarray(e, np.float32).item() for e in dv.data.Dataset.from_tensor_slices(x)]
    assert rows == [1.5, -2.0, 3.25, 4.0]
    assert [float(e) for e in dv.data.Dataset.from_tensor_slices(w)] == [1.0, 2.0, 3.0, 4.0]
    batch = next(iter(s2.experimental_distribute_dataset([x])))
    np.testing.assert_array_equal(np.asarray(s2.experimental_local_results(batch)[1], np.float32), [3.25, 4.0])
    g = dv.ReplicaGroup(2)
    xs = [x.clone(), x.clone() * 2]
    g.all_reduce(xs)  # in place, through the same bits
    np.testing.assert_array_equal(xs[1].float().numpy(), [4.5, -6.0, 9.75, 12.0])


def test_a_dataset_of_a_torch_tensor_keeps_its_memory_in_place(torch):
    # The dataset reads the caller's tensor as it iterates, through a view: torch then
    # refuses a resize_ that would move the memory under it (instead of the dataset
    # reading freed memory).
    t = torch.arange(4.0)
    ds = dv.data.Dataset.from_tensor_slices(t)
    assert [float(x) for x in ds] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(4_000_000)
    t[:2] = torch.tensor([10.0, 20.0])
    assert [x.tolist() for x in ds.batch(3)] == [[10, 20, 2], [3]]


def test_a_tensorflow_string_tensor_is_refused_not_a_crash():
    pytest.importorskip("tensorflow")
    script = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
import distvals as dv
g = dv.ReplicaGroup(2)
try:
    g.all_gather([tf.constant(["a"]), tf.constant(["b"])])
except TypeError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: replica 0: a TensorFlow string tensor" in out.stdout


def test_results_from_numpy_share_memory_with_the_engine_output(s2, torch):
    # torch.from_numpy: no copy between the engine's result and the tensor handed back.
    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", torch.ones(1024) * (rid() + 1)))
    for t in out.values:
        assert t.is_contiguous() and float(t[0]) == 3.0
        t += 1  # results are the caller's to change
    assert float(out.values[0][0]) == 4.0 and float(out.values[1][0]) == 4.0


def test_non_contiguous_tensors(s2, torch):
    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", parts(rid()).T))
    np.testing.assert_allclose(out.values[0].numpy(), reference(2).T, rtol=1e-6)
    assert out.values[0].shape == (3, 2)


def test_jax_arrays_come_back_as_jax_arrays(s2):
    jnp = pytest.importorskip("jax.numpy")

    def fn():
        x = jnp.arange(4.0, dtype=jnp.float32) * (rid() + 1)
        return dv.get_replica_context().all_reduce("SUM", x)

    out = s2.run(fn)
    for v in out.values:
        assert type(v).__module__.split(".")[0] in ("jax", "jaxlib")
        np.testing.assert_allclose(np.asarray(v), np.arange(4.0) * 3)
    total = s2.reduce("SUM", s2.run(lambda: jnp.ones(3) * rid()), axis=None)
    assert type(total).__module__.split(".")[0] in ("jax", "jaxlib")
    np.testing.assert_allclose(np.asarray(total), [1.0, 1.0, 1.0])


class _FakeJaxArray:
    """Stands for a jax.Array on a device: __array__, devices()."""

    def __init__(self, host, device):
        self.host, self.device = np.asarray(host), device

    def __array__(self, dtype=None, copy=None):
        return self.host if dtype is None else self.host.astype(dtype)

    def devices(self):
        return {self.device}

    @property
    def shape(self):
        return self.host.shape

    @property
    def dtype(self):
        return self.host.dtype


_FakeJaxArray.__module__ = "jaxlib.xla_extension"


def test_jax_code_path_with_a_stand_in(s2, monkeypatch):
    # Without JAX installed, a stand-in module checks that results go back to JAX, onto
    # the device the input was on.
    import types

    placed = []
    fake = types.ModuleType("jax")

    def device_put(host, device):
        placed.append(device)
        return _FakeJaxArray(host, device)

    fake.device_put = device_put
    fake.numpy = types.SimpleNamespace(asarray=lambda a: _FakeJaxArray(a, "default"))
    monkeypatch.setitem(sys.modules, "jax", fake)
    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", _FakeJaxArray(np.ones(3) * (rid() + 1), "cpu:7")))
    for v in out.values:
        assert isinstance(v, _FakeJaxArray) and v.device == "cpu:7"
        np.testing.assert_array_equal(v.host, [3.0, 3.0, 3.0])
    assert placed == ["cpu:7", "cpu:7"]
    total = s2.reduce("MEAN", s2.run(lambda: _FakeJaxArray(np.full(2, float(rid())), "cpu:7")), axis=None)
    assert isinstance(total, _FakeJaxArray) and total.host.tolist() == [0.5, 0.5]


def test_cupy_arrays_come_back_as_cupy_arrays(s2):
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        pytest.skip(f"cupy without a usable GPU: {e}")

    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", cupy.arange(4.0) * (rid() + 1)))
    for v in out.values:
        assert isinstance(v, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(v), np.arange(4.0) * 3)


def test_no_framework_is_imported_for_numpy_values():
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import distvals as dv
        s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
        rid = lambda: dv.get_replica_context().replica_id_in_sync_group
        pr = s.run(lambda: dv.get_replica_context().all_reduce("SUM", {"a": np.ones(3) * rid(), "b": 1.0}))
        s.reduce("SUM", pr["a"], axis=None); s.gather(pr["a"], axis=0)
        s.extended.reduce_to("MEAN", pr["a"], pr["a"]); s.extended.broadcast_to(np.ones(2), "CPU:1")
        s.run(lambda: dv.get_replica_context().all_gather(np.ones((1, 2)), axis=0))
        ds = dv.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4)
        list(s.experimental_distribute_dataset(ds)); s.experimental_distribute_dataset(ds).element_spec
        with s.scope():
            v = dv.Variable(np.zeros(4))
        v.scatter_add(dv.IndexedSlices(np.ones(1), np.array([0])))
        s.close()
        loaded = [m for m in ("torch", "tensorflow", "jax", "cupy") if m in sys.modules]
        print(",".join(loaded) or "none")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


def test_readme_torch_ddp_example_runs(capsys, torch):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Coming from torch DDP") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {"__name__": "readme_ddp"}
    try:
        exec(compile(code, "README.md (torch DDP)", "exec"), scope)
        loss = scope["strategy"].reduce("MEAN", scope["loss"], axis=None)
    finally:
        scope["strategy"].close()
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "True"
    assert isinstance(scope["w"], torch.Tensor) and isinstance(loss, torch.Tensor) and float(loss) < 1e-6
