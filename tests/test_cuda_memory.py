"""The cache of device memory behind every DeviceArray (distvals.cuda_memory), on the
simulated CUDA backend: reuse of dropped arrays' memory, no allocation in a training
loop's steady state, the cap, the release on a failed allocation, empty_cache."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from conftest import distinct_values, fork_with_deadline
from simulated_cuda import SimulatedCuda, install

import distvals as dv
from distvals import config, cuda_memory
from distvals import cuda as dvc


@pytest.fixture
def sim(monkeypatch):
    backend = SimulatedCuda(2)
    install(backend, monkeypatch.setattr)
    before, limit = config.get_logical_gpus(), cuda_memory.get_cache_limit()
    config.set_logical_gpus(2)
    dvc.empty_cache()
    yield backend
    dvc.set_cache_limit(limit)
    dvc.empty_cache()
    config.set_logical_gpus(before)


def test_a_dropped_arrays_memory_serves_the_next_array_of_its_size_class(sim):
    a = dvc.to_device(np.arange(100, dtype=np.float32), 1)
    ptr = a.ptr
    del a
    made = sim.allocations
    # 400 bytes and 300 bytes are both in the 512-byte class; another device is not.
    b = dvc.empty((75,), np.float32, 1)
    assert b.ptr == ptr and sim.allocations == made
    assert dvc.cached_bytes(1) == 0
    c = dvc.empty((75,), np.float32, 1)  # b is alive: new memory
    assert c.ptr != ptr and sim.allocations == made + 1
    d = dvc.empty((75,), np.float32, 0)
    assert d.device == 0 and sim.allocations == made + 2
    # A value written through one array is not seen through a live other one.
    b.copy_from(np.full(75, 1.0, np.float32))
    c.copy_from(np.full(75, 2.0, np.float32))
    np.testing.assert_array_equal(b.numpy(), np.full(75, 1.0))


def test_a_training_loop_allocates_no_device_memory_in_its_steady_state(sim):
    n = 4
    s = dv.MirroredStrategy([f"GPU:{k}" for k in range(n)])
    host = distinct_values(n, (3, 5), np.float32)
    per = s.experimental_distribute_values_from_function(
        lambda ctx: dvc.to_device(host[ctx.replica_id_in_sync_group], s.extended._places[ctx.replica_id_in_sync_group])
    )
    want = np.sum([h.astype(np.float64) for h in host], axis=0)

    def step(x):
        ctx = dv.get_replica_context()
        return ctx.all_reduce("sum", x), ctx.all_reduce("max", x)

    for _ in range(3):  # warm-up: the results' memory is made once
        s.run(step, args=(per,))
    made = sim.allocations
    for _ in range(5):
        total, top = s.run(step, args=(per,))
        for r in range(n):
            np.testing.assert_allclose(s.experimental_local_results(total)[r].numpy(), want, rtol=1e-6)
            np.testing.assert_array_equal(s.experimental_local_results(top)[r].numpy(), np.max(host, axis=0))
        del total, top
    assert sim.allocations == made, f"{sim.allocations - made} device allocations in 5 steady steps"
    s.close()


def test_the_cap_keeps_the_most_recently_freed_and_zero_keeps_nothing(sim):
    block = 1 << 20
    dvc.set_cache_limit(2 * block)
    arrays = [dvc.empty((block,), np.uint8, 0) for _ in range(3)]
    ptrs = [a.ptr for a in arrays]
    while arrays:  # freed in order 0, 1, 2
        arrays.pop(0)
    assert dvc.cached_bytes(0) == 2 * block
    live = sim.live_allocations()
    again = [dvc.empty((block,), np.uint8, 0) for _ in range(2)]
    assert sorted(a.ptr for a in again) == sorted(ptrs[1:]), "the oldest freed block is the one released"
    assert sim.live_allocations() == live
    del again
    assert dvc.set_cache_limit(0) == 2 * block
    assert dvc.cached_bytes(0) == 0
    assert sim.live_allocations() == live - 2
    a = dvc.empty((block,), np.uint8, 0)
    del a
    assert dvc.cached_bytes(0) == 0
    with pytest.raises(ValueError, match="cache limit"):
        dvc.set_cache_limit(-1)


def test_a_failed_allocation_releases_the_idle_memory_and_tries_again(sim):
    real = sim.DeviceBuffer

    class Tight(real):
        """A device that holds at most four blocks."""

        def __init__(self, nbytes, gpu):
            if sim.live_allocations() >= 4:
                raise dv._core.CudaError("cudaErrorMemoryAllocation: out of memory")
            super().__init__(nbytes, gpu)

    sim.DeviceBuffer = Tight
    kept = [dvc.empty((256,), np.float32, 0) for _ in range(2)]
    idle = [dvc.empty((256,), np.float32, 0) for _ in range(2)]
    del idle
    assert dvc.cached_bytes(0) == 2048
    big = dvc.empty((4096,), np.float32, 0)  # another class: the device is full of idle blocks
    assert dvc.cached_bytes(0) == 0 and big.nbytes == 16384
    big.copy_from(np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(big.numpy(), np.arange(4096))
    # Full again, with nothing idle to give back: the device's error reaches the caller.
    kept.append(dvc.empty((256,), np.float32, 0))
    with pytest.raises(dv._core.CudaError, match="out of memory"):
        dvc.empty((8192,), np.float32, 0)
    assert len(kept) == 3


def test_empty_cache_frees_what_is_idle_and_keeps_live_arrays(sim):
    live = dvc.to_device(np.arange(10.0), 0)
    dropped = [dvc.empty((64,), np.float64, g) for g in (0, 1)]
    del dropped
    assert dvc.cached_bytes() == 1024 and dvc.cached_bytes(1) == 512
    assert dvc.empty_cache(1) == 512 and dvc.cached_bytes() == 512
    assert dvc.empty_cache() == 512 and dvc.cached_bytes() == 0
    np.testing.assert_array_equal(live.numpy(), np.arange(10.0))


def test_memory_of_another_backend_is_never_handed_out(sim, monkeypatch):
    a = dvc.empty((16,), np.float32, 0)
    del a
    assert dvc.cached_bytes(0) == 512
    other = SimulatedCuda(1)
    install(other, monkeypatch.setattr)
    b = dvc.empty((16,), np.float32, 0)
    assert isinstance(b._owner.buffer, other.DeviceBuffer) and other.allocations == 1
    assert dvc.cached_bytes(0) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_child_forked_while_a_thread_holds_the_cache_still_allocates(sim):
    # A parent's thread inside the cache when the process forks does not exist in the
    # child: the lock it held must not stay held there.
    entered, release = threading.Event(), threading.Event()

    def hold():
        with cuda_memory._cache._lock:
            entered.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(10)

        def child():
            a = dvc.to_device(np.arange(6.0), 0)
            del a
            assert dvc.cached_bytes(0) == 512

        code = fork_with_deadline(child, 30.0)
    finally:
        release.set()
        t.join()
    assert code == 0, f"child exit status {code} (-1: it hung)"
