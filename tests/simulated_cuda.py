"""A simulated CUDA backend for testing the Python layer on machines without a GPU.

``SimulatedCuda`` offers the functions and the ``Group`` class of ``distvals._core.cuda``
that the Python layer calls, over host memory standing in for device memory: every
"device" allocation is registered with the GPU it belongs to, and every copy and every
collective checks that the pointers it is handed lie inside allocations of the GPU they
claim (so a host array passed as device memory, a buffer on the wrong GPU, an
out-of-bounds copy or overlapping outputs fail loudly, as the real backend would
refuse them). Collectives compute with numpy in the buffers' dtype (16-bit floats in
float32, as the kernels do).

It checks the Python layer (placement, packing, which buffers reach which collective);
the CUDA executor itself is tested on the host model of the CUDA runtime by the C++ tests
(cpp/tests/test_cuda_executor.cpp), and the kernels by the ``gpu`` tests on a real GPU.
The per-replica calls meet in a small meeting point of this module, standing in for the
engine's, with the same rules: every replica checks every posted call, a replica's bad
arguments reach all of them, and replica 0 runs the collective for all.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from distvals import _core

__all__ = ["CoreWithBackend", "SimulatedCuda", "install"]

_ALIGN = 256  # cudaMalloc's alignment


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class SimulatedCuda:
    """Stands in for ``distvals._core.cuda`` with ``gpus`` simulated devices."""

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        # Reentrant: a garbage collection inside a locked section can free a DeviceBuffer
        # whose __del__ takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._allocs: Dict[int, Tuple[int, int, np.ndarray]] = {}  # ptr -> (end, gpu, storage)
        self.calls: List[Tuple[str, str, str, Tuple[int, ...]]] = []  # (kind, dtype, op, gpus)
        self.waited: List[Tuple[int, int]] = []  # producer streams the collectives were told to follow
        self.allocations = 0  # DeviceBuffers made, to see what the hot paths allocate
        backend = self

        class DeviceBuffer:
            """Owning simulated device memory, freed (unregistered) with the object."""

            def __init__(self, nbytes: int, gpu: int) -> None:
                if not 0 <= gpu < backend.gpus:
                    raise _core.CudaError(f"distvals: CUDA device {gpu} does not exist ({backend.gpus} devices)")
                self.nbytes = int(nbytes)
                self.gpu = int(gpu)
                self.ptr = backend._allocate(self.nbytes, self.gpu) if self.nbytes else 0
                backend.allocations += 1

            def __del__(self) -> None:
                if getattr(self, "ptr", 0):
                    backend._free(self.ptr)

            def __reduce__(self) -> Any:
                # As the real one (a native object): a copy would free the memory twice.
                raise TypeError("cannot pickle 'DeviceBuffer' object")

        class Group(_SimulatedGroup):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(backend, *args, **kwargs)

        self.DeviceBuffer = DeviceBuffer
        self.Group = Group

    # ---- memory ---------------------------------------------------------------------
    def _allocate(self, nbytes: int, gpu: int) -> int:
        storage = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
        base = storage.ctypes.data
        ptr = (base + _ALIGN - 1) // _ALIGN * _ALIGN
        # Poison fresh memory, as uninitialized device memory would be garbage.
        ctypes.memset(ptr, 0xA5, nbytes)
        with self._lock:
            self._allocs[ptr] = (ptr + nbytes, gpu, storage)
        return ptr

    def _free(self, ptr: int) -> None:
        with self._lock:
            self._allocs.pop(ptr, None)

    def live_allocations(self) -> int:
        with self._lock:
            return len(self._allocs)

    def _gpu_of(self, ptr: int, nbytes: int, what: str) -> int:
        """The GPU of the allocation holding ``[ptr, ptr + nbytes)``; ValueError if none."""
        with self._lock:
            allocs = list(self._allocs.items())  # a free during the walk must not change it
        for base, (end, gpu, _) in allocs:
            if base <= ptr < end or (nbytes == 0 and ptr == end):
                if ptr + nbytes > end:
                    raise ValueError(f"{what}: {nbytes} bytes at {ptr:#x} run past the end of their allocation")
                return gpu
        raise ValueError(f"{what}: {ptr:#x} is not simulated device memory")

    # ---- the module functions ----------------------------------------------------------
    def device_count(self) -> int:
        return self.gpus

    def unavailable_reason(self) -> str:
        return "" if self.gpus else "no simulated GPU"

    def pointer_device(self, ptr: int) -> int:
        try:
            return self._gpu_of(ptr, 0, "pointer_device")
        except ValueError:
            return -1

    def copy_to_device(self, dst: int, gpu: int, src: np.ndarray, timeout_seconds: Any = None) -> None:
        assert src.flags.c_contiguous
        self._gpu_of(dst, src.nbytes, "copy_to_device")
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def copy_to_host(self, dst: np.ndarray, src: int, gpu: int, timeout_seconds: Any = None) -> None:
        assert dst.flags.c_contiguous and dst.flags.writeable
        self._gpu_of(src, dst.nbytes, "copy_to_host")
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, gpu: int, timeout_seconds: Any = None) -> None:
        self._gpu_of(dst, nbytes, "copy_device (destination)")
        self._gpu_of(src, nbytes, "copy_device (source)")
        ctypes.memmove(dst, src, nbytes)

    def fill_bytes(self, ptr: int, value: int, nbytes: int, gpu: int) -> None:
        self._gpu_of(ptr, nbytes, "fill_bytes")
        ctypes.memset(ptr, value, nbytes)

    def synchronize_stream(self, stream: int, gpu: int = -1, timeout_seconds: Any = None) -> None:
        pass

    def view(self, ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
        """A numpy view of simulated device memory (for the collectives)."""
        nbytes = count * dtype.itemsize
        if not nbytes:
            return np.empty(0, dtype)
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return np.frombuffer(raw, dtype=np.uint8).view(dtype)


class _SimulatedGroup:
    """N replicas on simulated GPUs, with the argument checks of the real group."""

    def __init__(
        self,
        backend: SimulatedCuda,
        devices: Sequence[str],
        logical_per_gpu: int = 1,
        timeout_seconds: Optional[float] = None,
        chunk_bytes: int = 0,
        peer_access: bool = True,
    ) -> None:
        self._b = backend
        self.devices = [_core.parse_device(d) for d in devices]
        self.gpus = [int(d.split(":")[1]) // logical_per_gpu for d in self.devices]
        for r, g in enumerate(self.gpus):
            if g >= backend.gpus:
                raise ValueError(f"replica {r} ({self.devices[r]}) needs CUDA device {g}, but there are {backend.gpus}")
        self.size = len(self.devices)
        self.timeout_seconds = 300.0 if timeout_seconds is None else float(timeout_seconds)
        self.aborted = False
        self.closed = False
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._posts: Dict[int, Dict[str, Any]] = {}
        self._round = 0
        self._result: Optional[BaseException] = None

    def _check(self, r: int, buf: Tuple[int, int, int], itemsize: int, what: str) -> None:
        ptr, count, gpu = buf
        if count == 0:
            return
        if gpu != self.gpus[r]:
            raise ValueError(f"replica {r}: {what} lives on CUDA device {gpu}, but replica {r} runs on {self.gpus[r]}")
        real = self._b._gpu_of(ptr, count * itemsize, f"replica {r}'s {what}")
        if real != gpu:
            raise ValueError(f"replica {r}: {what} claims CUDA device {gpu} but is memory of device {real}")
        if ptr % itemsize:
            raise ValueError(f"replica {r}: {what} is not aligned to its {itemsize}-byte elements")

    def run(
        self,
        kind: str,
        dtype: str,
        op: str,
        algorithm: str,
        root: int,
        ins: Sequence[Tuple[int, int, int]],
        outs: Sequence[Tuple[int, int, int]],
        stream: Any = None,
        stream_device: int = -1,
        wait_for: Sequence[Tuple[int, int]] = (),
    ) -> None:
        self._b.waited.extend(wait_for)
        if self.closed:
            raise _core.ClosedError("distvals: the group is closed")
        if self.aborted:
            raise _core.AbortedError("distvals: the group was aborted")
        n = self.size
        if len(ins) != n or len(outs) != n:
            raise ValueError(f"expected {n} input and output buffers, got {len(ins)} and {len(outs)}")
        dt = _np_dtype(dtype)
        count = ins[0][1]
        for r in range(n):
            if ins[r][1] != count:
                raise ValueError(f"replica {r} has {ins[r][1]} elements, replica 0 has {count}")
        want_out = {"all_gather": count * n, "reduce_scatter": count // n if n else 0}.get(kind, count)
        if kind == "reduce_scatter" and count % n:
            raise ValueError(f"reduce_scatter of {count} elements over {n} replicas")
        writes, reads = [], []
        for r in range(n):
            read = kind != "broadcast" or r == root
            write = kind != "reduce" or r == root
            if read:
                self._check(r, ins[r], dt.itemsize, "input")
            if write:
                if outs[r][1] != want_out:
                    raise ValueError(f"replica {r}: output has {outs[r][1]} elements, expected {want_out}")
                self._check(r, outs[r], dt.itemsize, "output")
            ib, ob = ins[r][0], outs[r][0]
            inplace = ib == ob and ins[r][1] == outs[r][1]
            if write and want_out:
                writes.append((ob, ob + want_out * dt.itemsize, r))
            if read and count and not (inplace and write):
                reads.append((ib, ib + count * dt.itemsize, r))
        for i, (b, e, r) in enumerate(writes):
            for b2, e2, r2 in writes[i + 1 :] + reads:
                if b < e2 and b2 < e:
                    raise ValueError(f"replica {r}'s output overlaps replica {r2}'s buffer")
        with self._lock:
            self._b.calls.append((kind, dtype, op, tuple(self.gpus)))
            data = [self._b.view(p, c, dt).copy() for p, c, _ in ins]
            stack = np.stack(data) if data else np.empty((0, 0), dt)
            if kind in ("all_reduce", "reduce", "reduce_scatter"):
                red = self._reduce(stack, op, dt)
            for r in range(n):
                if kind == "reduce" and r != root:
                    continue
                if kind in ("all_reduce", "reduce"):
                    result = red
                elif kind == "broadcast":
                    result = data[root]
                elif kind == "all_gather":
                    result = np.concatenate(data)
                else:
                    block = count // n
                    result = red[r * block : (r + 1) * block]
                if result.size:
                    self._b.view(outs[r][0], result.size, dt)[...] = result

    @staticmethod
    def _reduce(stack: np.ndarray, op: str, dt: np.dtype) -> np.ndarray:
        op = op.lower()
        # The kernels fold 16-bit floats in float32 and round once (cuda/kernels.cu).
        acc = np.dtype(np.float32) if dt.itemsize == 2 and (dt.kind == "f" or dt.name == "bfloat16") else dt
        with np.errstate(over="ignore"):
            if op == "sum":
                return np.sum(stack, axis=0, dtype=acc).astype(dt)
            if op == "mean":
                return (np.sum(stack.astype(np.float64), axis=0) / len(stack)).astype(dt)
            if op in ("prod", "product"):
                return np.prod(stack, axis=0, dtype=acc).astype(dt)
            if op == "min":
                return np.min(stack, axis=0)
            if op == "max":
                return np.max(stack, axis=0)
        raise ValueError(f"unknown op {op!r}")

    # ---- the per-replica style -------------------------------------------------------------
    def _meet(self, replica: int, post: Dict[str, Any], timeout_seconds: Optional[float]) -> None:
        """Posts replica `replica`'s call and waits for every replica's; replica 0 runs the
        collective for all, the others wait for it; every replica raises the same error."""
        timeout = self.timeout_seconds if timeout_seconds is None else float(timeout_seconds)
        with self._cv:
            if self.closed:
                raise _core.ClosedError("distvals: the group is closed")
            if self.aborted:
                raise _core.AbortedError("distvals: the group is aborted")
            rnd = self._round
            self._posts[replica] = post
            self._cv.notify_all()
            if not self._cv.wait_for(
                lambda: len(self._posts) == self.size or self._round != rnd or self.aborted, timeout
            ):
                self.aborted = True
                self._cv.notify_all()
                missing = sorted(set(range(self.size)) - set(self._posts))
                raise _core.CollectiveTimeoutError(f"distvals: replica(s) {missing} never arrived")
            if self.aborted and self._round == rnd:
                raise _core.AbortedError("distvals: the group is aborted")
            if replica == 0:
                posts = [self._posts[r] for r in range(self.size)]
                self._result = None
                try:
                    self._agree(posts)
                    p0 = posts[0]
                    self.run(
                        p0["kind"],
                        p0["dtype"],
                        p0["op"],
                        p0["algorithm"],
                        p0["root"],
                        [p["input"] for p in posts],
                        [p["output"] for p in posts],
                    )
                except BaseException as e:  # every replica raises it
                    self._result = e
                self._posts = {}
                self._round += 1
                self._cv.notify_all()
                result = self._result
            else:
                self._cv.wait_for(lambda: self._round != rnd or self.aborted, timeout)
                result = self._result
        if result is not None:
            raise result

    @staticmethod
    def _agree(posts: List[Dict[str, Any]]) -> None:
        for r, p in enumerate(posts):
            if "error" in p:
                why, type_error = p["error"]
                raise (TypeError if type_error else ValueError)(why + f" (reported by replica {r})")
        keys = ("kind", "dtype", "shape", "op", "root", "algorithm")
        for r, p in enumerate(posts[1:], start=1):
            for k in keys:
                if p[k] != posts[0][k]:
                    raise _core.MismatchError(
                        f"distvals: replicas called different collectives: replica 0 passed {k} {posts[0][k]}, "
                        f"replica {r} passed {k} {p[k]}"
                    )

    def replica_run(
        self,
        replica: int,
        kind: str,
        dtype: str,
        op: str,
        algorithm: str,
        root: int,
        input: Tuple[int, int, int],
        output: Tuple[int, int, int],
        shape: Sequence[int],
        timeout_seconds: Optional[float] = None,
        wait_stream: Any = None,
        wait_device: int = -1,
    ) -> None:
        self._meet(
            replica,
            dict(
                kind=kind,
                dtype=dtype,
                op=op,
                algorithm=algorithm if kind == "all_reduce" else "direct",
                root=root,
                input=input,
                output=output,
                shape=tuple(shape),
            ),
            timeout_seconds,
        )

    def report_invalid(self, replica: int, why: str, type_error: bool, timeout_seconds: Optional[float] = None) -> None:
        self._meet(replica, dict(error=(why, type_error)), timeout_seconds)

    def abort(self, replica: int, why: str) -> None:
        with self._cv:
            self.aborted = True
            self._cv.notify_all()

    def cancel(self) -> None:
        self.abort(-1, "cancelled")

    def reset(self) -> None:
        with self._cv:
            self.aborted = False
            self._posts = {}

    def close(self) -> None:
        self.closed = True

    def replica_stream(self, replica: int) -> int:
        return 0x1000 + self.gpus[replica]  # a stand-in handle: never dereferenced

    def direct_access(self, a: int, b: int) -> bool:
        return True


class CoreWithBackend:
    """``distvals._core`` with its ``cuda`` submodule replaced."""

    def __init__(self, backend: SimulatedCuda) -> None:
        self.cuda = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(_core, name)


def install(backend: Any, patch: Any = setattr, modules: Sequence[Any] = ()) -> CoreWithBackend:
    """Puts ``backend`` behind ``distvals.cuda``, ``CudaReplicaGroup`` and ``modules`` (their
    ``_core``), with fresh element-wise helper groups and constants (those belong to the
    backend that made them). ``patch``: pytest's ``monkeypatch.setattr`` (undone after the
    test), or plain ``setattr`` (a worker script)."""
    from distvals import cuda, cuda_group, devices

    core = CoreWithBackend(backend)
    for module in (cuda, cuda_group, *modules):
        patch(module, "_core", core)
    patch(devices, "_pairs", {})
    patch(devices, "_minus_ones", {})
    return core
