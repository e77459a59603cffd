"""distvals._core.WorkerSmallPlan, the native steady state of a small all-reduce between
MPI workers, driven here without MPI: ctypes stands in for MPI_Start and
MPI_Test, and the "other worker" adds its contribution to the buffer when the request
completes, as a real all-reduce would. (The MPI jobs in test_multi_worker.py run it
against Open MPI.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import distvals as dv
from distvals import _core

START = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
TEST = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p)
NOT_HERE, PENDING, DISAGREED = 0, 1, 2


class FakeRequest:
    """A persistent all-reduce request of ``flat`` as MPI_Start and MPI_Test see it.
    Completing it combines ``other`` (the other worker's data and flag) into ``flat``
    with ``combine``; ``completes=False``: it never completes."""

    def __init__(self, flat, other, combine=np.add, completes=True):
        self.flat, self.other, self.combine, self.completes = flat, other, combine, completes
        self.handle = ctypes.c_int64(0)
        self.address = ctypes.addressof(self.handle)
        self.starts = 0
        self.active = False
        self.start_fn = START(self._start)
        self.test_fn = TEST(self._test)

    def _start(self, req):
        assert req == self.address and not self.active
        self.starts += 1
        self.active = True
        return 0

    def _test(self, req, flag, status):
        assert req == self.address and self.active
        if self.completes:
            self.combine(self.flat, self.other, out=self.flat)
            self.active = False
        flag[0] = int(not self.active)
        return 0

    def plan(self, data, op, n, local_op=None, mean_divisor=0, agree=0, spin=0.01):
        """A plan of the call ``op`` of ``n`` replicas on this request."""
        start = ctypes.cast(self.start_fn, ctypes.c_void_p).value
        test = ctypes.cast(self.test_fn, ctypes.c_void_p).value
        local_op = op if local_op is None else local_op
        return _core.WorkerSmallPlan(
            data, self.flat, op, local_op, n, mean_divisor, agree, self.address, start, test, spin
        )

    def call(self, ins, data, outs, op, mean_divisor=0, agree=0, spin=0.01):
        """One call of a plan made for ``ins``' replicas."""
        local_op = dv.ReduceOp.SUM if mean_divisor else op
        return self.plan(data, op, len(ins), local_op, mean_divisor, agree, spin).arrays(op, ins, outs)


def kind_buffer(shape, dtype):
    """A small kind's flat buffer (data, then the flag) and its data view."""
    flat = np.full(int(np.prod(shape)) + 1, 99, dtype)
    return flat, flat[:-1].reshape(shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_local_replicas_and_the_other_worker_are_summed_into_new_arrays(dtype, n):
    shape = (3, 4)
    flat, data = kind_buffer(shape, dtype)
    ins = [(np.arange(12).reshape(shape) * (r + 2) + 10 * r).astype(dtype) for r in range(n)]
    other = np.append(np.arange(12) - 7, 0).astype(dtype)  # the other worker's sum; its flag agrees
    req = FakeRequest(flat, other)
    got = req.call(ins, data, None, dv.ReduceOp.SUM)
    want = sum(a.astype(np.float64) for a in ins) + other[:-1].reshape(shape)
    assert type(got) is list and len(got) == n and req.starts == 1
    for r, g in enumerate(got):
        assert g.dtype == dtype and g.shape == shape, r
        np.testing.assert_array_equal(g, want, err_msg=f"replica {r}")
        assert not np.shares_memory(g, flat) and all(not np.shares_memory(g, a) for a in ins)
    assert len({id(g) for g in got}) == n
    assert flat[-1] == 0


def test_a_mean_divides_by_every_workers_replicas_as_numpy_does():
    flat, data = kind_buffer((5,), np.float32)
    ins = [np.array([1, 2, 3, 4, 5], np.float32) * 0.1, np.array([7, 7, 7, 7, 7], np.float32) / 3]
    other = np.array([0.3, 1e-3, 5, -2, 11, 0], np.float32)
    outs = [np.empty(5, np.float32), np.empty(5, np.float32)]
    got = FakeRequest(flat, other).call(ins, data, outs, dv.ReduceOp.SUM, mean_divisor=4)
    assert got is not None and got[0] is outs[0] and got[1] is outs[1]
    total = np.add(np.add(ins[0], ins[1]), other[:-1])  # float32 arithmetic, as the Python path
    for o in outs:
        np.testing.assert_array_equal(o, np.divide(total, 4))
    np.testing.assert_allclose(outs[0], (ins[0].astype(np.float64) + ins[1] + other[:-1]) / 4, rtol=1e-6)


def test_min_keeps_nan_and_integer_sums_wrap_around():
    flat, data = kind_buffer((3,), np.float64)
    ins = [np.array([1.0, np.nan, 5.0]), np.array([0.5, 2.0, 6.0])]
    got = FakeRequest(flat, np.array([9.0, 9.0, -1.0, 1.0]), combine=np.minimum).call(
        ins, data, None, dv.ReduceOp.MIN, agree=1
    )
    np.testing.assert_array_equal(got[0], [0.5, np.nan, -1.0])
    np.testing.assert_array_equal(got[1], got[0])
    flat, data = kind_buffer((2,), np.int32)
    ins = [np.array([2**31 - 1, -5], np.int32), np.array([1, 7], np.int32)]
    got = FakeRequest(flat, np.array([3, 0, 0], np.int32)).call(ins, data, None, dv.ReduceOp.SUM)
    np.testing.assert_array_equal(got[0], np.array([-(2**31) + 3, 2], np.int32))


def test_a_request_that_does_not_complete_is_left_to_the_caller_with_no_result_written():
    flat, data = kind_buffer((4,), np.float32)
    ins = [np.full(4, 1.5, np.float32), np.full(4, 2.0, np.float32)]
    outs = [np.full(4, -1, np.float32), np.full(4, -1, np.float32)]
    req = FakeRequest(flat, np.zeros(5, np.float32), completes=False)
    assert req.call(ins, data, outs, dv.ReduceOp.SUM, spin=1e-4) == PENDING
    assert req.starts == 1 and req.active
    # The local sum and the flag wait in the buffer for the request to complete.
    np.testing.assert_array_equal(flat, [3.5, 3.5, 3.5, 3.5, 0])
    assert (outs[0] == -1).all() and (outs[1] == -1).all()


def test_a_raised_flag_is_reported_with_no_result_written():
    flat, data = kind_buffer((4,), np.float32)
    ins = [np.full(4, 1.5, np.float32)]
    outs = [np.full(4, -1, np.float32)]
    other = np.array([0, 0, 0, 0, 1], np.float32)  # another worker's call was not the expected one
    assert FakeRequest(flat, other).call(ins, data, outs, dv.ReduceOp.SUM) == DISAGREED
    assert (outs[0] == -1).all()


def test_one_plan_serves_every_repeat_and_rows_come_back_a_list_per_replica():
    shape = (2, 3)
    flat, data = kind_buffer(shape, np.float64)
    other = np.append(np.linspace(-1, 1, 6), 0.0)
    req = FakeRequest(flat, other)
    plan = req.plan(data, dv.ReduceOp.SUM, 3)
    for step in range(4):
        ins = [np.arange(6.0).reshape(shape) * (r + 1) + step for r in range(3)]
        want = sum(ins) + other[:-1].reshape(shape)
        if step % 2:
            got = plan.rows(dv.ReduceOp.SUM, [[x] for x in ins] if step == 1 else [(x,) for x in ins])
            assert type(got) is list and [len(row) for row in got] == [1, 1, 1]
            got = [row[0] for row in got]
        else:
            outs = list(ins) if step == 2 else None  # in place: every input read before any output
            got = plan.arrays(dv.ReduceOp.SUM, ins, outs)
            if outs is not None:
                assert all(g is o for g, o in zip(got, outs))
        for r, g in enumerate(got):
            np.testing.assert_array_equal(g, want, err_msg=f"step {step}, replica {r}")
        np.testing.assert_array_equal(plan.data, want)
    assert req.starts == 4


class Sub(np.ndarray):
    pass


def _not_here_cases():
    a = np.arange(6, dtype=np.float32)
    yield "another dtype", [a, a.astype(np.float64)], None
    yield "another shape", [a, a[:5]], None
    yield "a strided array", [a, np.arange(12, dtype=np.float32)[::2]], None
    yield "a subclass", [a, a.view(Sub)], None
    yield "a list", [a, list(a)], None
    yield "an output of another dtype", [a, a], [np.empty(6, np.float32), np.empty(6, np.float64)]
    yield "a read-only output", [a, a], [np.empty(6, np.float32), np.frombuffer(bytes(24), np.float32)]
    yield "too few outputs", [a, a], [np.empty(6, np.float32)]
    yield "a tuple of outputs", [a, a], (np.empty(6, np.float32), np.empty(6, np.float32))
    yield "a tuple of arrays", (a, a), None
    yield "a replica too many", [a, a, a], None
    yield "a replica too few", [a], None


@pytest.mark.parametrize("what,ins,outs", list(_not_here_cases()), ids=[c[0] for c in _not_here_cases()])
def test_anything_but_the_plans_case_is_refused_before_any_data_moves(what, ins, outs):
    flat, data = kind_buffer((6,), np.float32)
    before = flat.copy()
    req = FakeRequest(flat, np.zeros(7, np.float32))
    plan = req.plan(data, dv.ReduceOp.SUM, 2)
    assert plan.arrays(dv.ReduceOp.SUM, ins, outs) == NOT_HERE, what
    if outs is None and isinstance(ins, list):
        assert plan.rows(dv.ReduceOp.SUM, [[x] for x in ins]) == NOT_HERE, what
    assert req.starts == 0
    np.testing.assert_array_equal(flat, before)


def test_rows_of_another_layout_another_op_and_a_closed_plan_are_refused():
    flat, data = kind_buffer((4,), np.int32)
    before = flat.copy()
    req = FakeRequest(flat, np.zeros(5, np.int32))
    plan = req.plan(data, dv.ReduceOp.SUM, 2)
    a = np.arange(4, dtype=np.int32)
    for rows in ([[a], [a, a]], [[a], []], [[a], a], ([a], [a]), [[a], [[a]]]):
        assert plan.rows(dv.ReduceOp.SUM, rows) == NOT_HERE, rows
    assert plan.rows(dv.ReduceOp.MAX, [[a], [a]]) == NOT_HERE
    assert plan.arrays(dv.ReduceOp.MAX, [a, a], None) == NOT_HERE
    assert not plan.closed
    plan.close()
    assert plan.closed
    assert plan.rows(dv.ReduceOp.SUM, [[a], [a]]) == NOT_HERE
    assert plan.arrays(dv.ReduceOp.SUM, [a, a], None) == NOT_HERE
    assert req.starts == 0
    np.testing.assert_array_equal(flat, before)


def test_calls_the_plan_cannot_make_are_refused_when_it_is_made_naming_what():
    for dtype, op, local_op, divisor, match in [
        (np.uint32, dv.ReduceOp.SUM, dv.ReduceOp.SUM, 0, "dtype"),
        (np.complex64, dv.ReduceOp.SUM, dv.ReduceOp.SUM, 0, "dtype"),
        (np.float16, dv.ReduceOp.SUM, dv.ReduceOp.SUM, 0, "16-bit"),
        (np.int32, dv.ReduceOp.MEAN, dv.ReduceOp.SUM, 4, "divides float results only"),
        (np.float32, dv.ReduceOp.MEAN, dv.ReduceOp.MEAN, 0, "local op"),
        (np.float32, dv.ReduceOp.SUM, "SUM", 0, "local op"),
    ]:
        flat, data = kind_buffer((3,), dtype)
        req = FakeRequest(flat, np.zeros(4, dtype))
        with pytest.raises((TypeError, ValueError), match=match):
            req.plan(data, op, 2, local_op, divisor)
    flat, data = kind_buffer((3,), np.float32)
    req = FakeRequest(flat, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="data must be its flat buffer but the last element"):
        req.plan(flat[1:], dv.ReduceOp.SUM, 2)  # not the front of the flat buffer
    with pytest.raises(ValueError, match="data must be its flat buffer"):
        req.plan(np.zeros(3, np.float32), dv.ReduceOp.SUM, 2)
    with pytest.raises(ValueError, match="at least one replica"):
        req.plan(data, dv.ReduceOp.SUM, 0)
    with pytest.raises(ValueError, match="C-contiguous, aligned and writable"):
        ro = flat.copy()
        ro.flags.writeable = False
        FakeRequest(ro, ro).plan(ro[:-1], dv.ReduceOp.SUM, 1)
    assert req.starts == 0


def test_an_mpi_error_is_raised_with_its_code():
    flat, data = kind_buffer((2,), np.float32)
    req = FakeRequest(flat, np.zeros(3, np.float32))
    req.start_fn = START(lambda r: 13)
    with pytest.raises(RuntimeError, match="MPI_Start .* error code 13"):
        req.call([np.ones(2, np.float32)], data, None, dv.ReduceOp.SUM)
