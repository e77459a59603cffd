"""Out-of-place all-reduce results through the CPU kernels' streaming-store path.

Outputs that alias no input and are large enough are written with non-temporal stores
(whole 64-byte lines; plain stores for the partial lines at either end), then fenced
before the step is published. These tests compare such results, for every dtype and op,
with inputs and outputs at offsets that align them to their elements but to no vector or
cache line, against a float64 numpy reference: at sizes above the
default threshold, and with the threshold lowered so that small sizes (heads and tails
only, a few lines) take the path too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import distvals
from distvals import _core

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max", "mean"]
CASES = [(d, op) for d in DTYPES for op in OPS if op != "mean" or not d.startswith(("int", "uint"))]


def _dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@pytest.fixture
def threshold():
    """Sets the streaming threshold for one test; the previous value comes back after."""
    previous = []

    def set_to(nbytes):
        previous.append(_core.set_streaming_store_min_bytes(nbytes))

    yield set_to
    if previous:
        _core.set_streaming_store_min_bytes(previous[0])


def _view(dt, count, offset_bytes, fill=None):
    """``count`` elements of ``dt`` starting ``offset_bytes`` into a fresh buffer (any
    offset, so the view may be misaligned for every cache line, or for its dtype)."""
    raw = np.zeros(count * dt.itemsize + offset_bytes + 64, np.uint8)
    v = np.frombuffer(raw.data, dt, count, offset=offset_bytes)
    if fill is not None:
        v[...] = fill
    return v


def _inputs(n, count, dt, op, rng, offsets):
    # Small integers: every sum and product of up to three is exact in every dtype.
    lo = 0 if dt.kind == "u" else -3
    return [
        _view(dt, count, offsets[r % len(offsets)], rng.integers(lo, 4, count).astype(np.float64).astype(dt))
        for r in range(n)
    ]


def _reference(ins, op, dt):
    st = np.stack([a.astype(np.float64) for a in ins])
    ref = {"sum": st.sum(0), "prod": st.prod(0), "min": st.min(0), "max": st.max(0), "mean": st.mean(0)}[op]
    return ref


def _check(outs, ins, op, dt):
    ref = _reference(ins, op, dt)
    for r, o in enumerate(outs):
        got = o.astype(np.float64)
        if op == "mean":
            # Rounded once to the dtype: compare with the reference rounded the same way.
            np.testing.assert_allclose(
                got, ref.astype(dt).astype(np.float64), rtol=1e-2, atol=0, err_msg=f"replica {r}"
            )
        else:
            np.testing.assert_array_equal(got, ref, err_msg=f"replica {r}")


@pytest.mark.parametrize("dtype,op", CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_small_outputs_with_the_threshold_at_zero(threshold, dtype, op, n):
    threshold(0)
    dt = _dtype(dtype)
    rng = np.random.default_rng(7)
    with distvals.ReplicaGroup(n) as g:
        for count in (1, 13, 64, 2048 + 5, 70_001):
            for in_off, out_off in ((0, 0), (dt.itemsize, 3 * dt.itemsize), (5 * dt.itemsize, 33 * dt.itemsize)):
                ins = _inputs(n, count, dt, op, rng, [in_off, 0])
                keep = [a.copy() for a in ins]
                outs = [_view(dt, count, out_off + 8 * r, fill=0) for r in range(n)]
                g.all_reduce(ins, op, "auto", out=outs)
                _check(outs, ins, op, dt)
                for a, b in zip(ins, keep):  # inputs untouched
                    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in ("int8", "uint8")])
@pytest.mark.parametrize("which", ["input", "output"])
def test_buffers_not_aligned_to_their_elements_are_refused_untouched(dtype, which):
    # The kernels load and store whole elements: a pointer between two is refused with
    # the replica named, before anything is written.
    dt = _dtype(dtype)
    n, count = 2, 2048 + 5
    with distvals.ReplicaGroup(n) as g:
        ins = _inputs(n, count, dt, "sum", np.random.default_rng(5), [1 if which == "input" else 0, 0])
        outs = [_view(dt, count, (1 if which == "output" else 0) + 8 * r, fill=0) for r in range(n)]
        with pytest.raises(ValueError, match=rf"replica 0: .*not aligned to its {dt.itemsize}-byte elements"):
            g.all_reduce(ins, "sum", "auto", out=outs)
        for o in outs:
            assert not o.astype(np.float64).any()


@pytest.mark.parametrize("dtype,op", CASES)
def test_outputs_above_the_default_threshold(dtype, op):
    dt = _dtype(dtype)
    n = 2
    with distvals.ReplicaGroup(n) as g:
        # One kernel call writes N * S / threads bytes: make that at least the threshold.
        per_call = _core.streaming_store_min_bytes()
        count = (per_call * g.engine.threads) // (n * dt.itemsize) + 4099
        rng = np.random.default_rng(11)
        ins = _inputs(n, count, dt, op, rng, [0, 5 * dt.itemsize])
        outs = [_view(dt, count, 24 + 40 * r, fill=1) for r in range(n)]
        g.all_reduce(ins, op, "auto", out=outs)
        _check(outs, ins, op, dt)
        # Used output arrays (the case streaming stores are for): again, other values.
        ins2 = _inputs(n, count, dt, op, np.random.default_rng(12), [dt.itemsize, 0])
        g.all_reduce(ins2, op, "direct", out=outs)
        _check(outs, ins2, op, dt)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_every_algorithm_and_mixed_in_place_and_out_of_place(threshold, algorithm):
    threshold(0)
    dt = np.dtype(np.float32)
    n = 3
    rng = np.random.default_rng(3)
    with distvals.ReplicaGroup(n, chunk_bytes=64 << 10) as g:
        count = 300_007
        ins = _inputs(n, count, dt, "sum", rng, [4, 0, 12])
        want = _reference(ins, "sum", dt)
        # Replica 1 in place, the others into their own outputs.
        outs = [_view(dt, count, 20, fill=0), ins[1], _view(dt, count, 0, fill=0)]
        g.all_reduce(ins, "sum", algorithm, out=outs)
        for o in outs:
            np.testing.assert_array_equal(o.astype(np.float64), want)


def test_threshold_round_trip_and_its_default():
    default = _core.streaming_store_min_bytes()
    assert default > 0
    if "DISTVALS_STREAMING_MIN_BYTES" not in os.environ:
        # An eighth of the last-level cache, at most 8 MiB (a VM reads the whole host
        # socket's L3, which it shares with other tenants).
        assert default <= 8 << 20
    previous = _core.set_streaming_store_min_bytes(123)
    try:
        assert previous == default and _core.streaming_store_min_bytes() == 123
    finally:
        _core.set_streaming_store_min_bytes(previous)
    assert _core.streaming_store_min_bytes() == default
