"""A simulated CUDA backend for testing the Python layer on machines without a GPU.

``SimulatedCuda`` offers the functions and the ``Group`` class of ``distvals._core.cuda``
that the Python layer calls, over host memory standing in for device memory: every
"device" allocation is registered with the GPU it belongs to, and every copy and every
collective checks that the pointers it is handed lie inside allocations of the GPU they
claim (so a host array passed as device memory, a buffer on the wrong GPU, an
out-of-bounds copy or overlapping outputs fail loudly, as the real backend would
refuse them). Collectives compute with numpy in the buffers' dtype.

It checks the Python layer (placement, packing, which buffers reach which collective);
the CUDA kernels themselves are tested by the ``gpu`` tests on a real GPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from distvals import _core

__all__ = ["SimulatedCuda", "CoreWithBackend"]

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
        self._lock = threading.Lock()
        self._allocs: Dict[int, Tuple[int, int, np.ndarray]] = {}  # ptr -> (end, gpu, storage)
        self.calls: List[Tuple[str, str, str, Tuple[int, ...]]] = []  # (kind, dtype, op, gpus)
        backend = self

        class DeviceBuffer:
            """Owning simulated device memory, freed (unregistered) with the object."""

            def __init__(self, nbytes: int, gpu: int) -> None:
                if not 0 <= gpu < backend.gpus:
                    raise _core.CudaError(f"distvals: CUDA device {gpu} does not exist ({backend.gpus} devices)")
                self.nbytes = int(nbytes)
                self.gpu = int(gpu)
                self.ptr = backend._allocate(self.nbytes, self.gpu) if self.nbytes else 0

            def __del__(self) -> None:
                if getattr(self, "ptr", 0):
                    backend._free(self.ptr)

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
            for base, (end, gpu, _) in self._allocs.items():
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

    def __init__(self, backend: SimulatedCuda, devices: Sequence[str], logical_per_gpu: int = 1,
                 timeout_seconds: Optional[float] = None, chunk_bytes: int = 0, peer_access: bool = True) -> None:
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

    def run(self, kind: str, dtype: str, op: str, algorithm: str, root: int, ins: Sequence[Tuple[int, int, int]],
            outs: Sequence[Tuple[int, int, int]], stream: Any = None, stream_device: int = -1) -> None:
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
            for b2, e2, r2 in writes[i + 1:] + reads:
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
                    result = red[r * block:(r + 1) * block]
                if result.size:
                    self._b.view(outs[r][0], result.size, dt)[...] = result

    @staticmethod
    def _reduce(stack: np.ndarray, op: str, dt: np.dtype) -> np.ndarray:
        op = op.lower()
        with np.errstate(over="ignore"):
            if op == "sum":
                return np.sum(stack, axis=0, dtype=dt)
            if op == "mean":
                return (np.sum(stack.astype(np.float64), axis=0) / len(stack)).astype(dt)
            if op in ("prod", "product"):
                return np.prod(stack, axis=0, dtype=dt)
            if op == "min":
                return np.min(stack, axis=0)
            if op == "max":
                return np.max(stack, axis=0)
        raise ValueError(f"unknown op {op!r}")

    def abort(self, replica: int, why: str) -> None:
        self.aborted = True

    def cancel(self) -> None:
        pass

    def reset(self) -> None:
        self.aborted = False

    def close(self) -> None:
        self.closed = True

    def replica_stream(self, replica: int) -> int:
        return 0

    def direct_access(self, a: int, b: int) -> bool:
        return True


class CoreWithBackend:
    """``distvals._core`` with its ``cuda`` submodule replaced."""

    def __init__(self, backend: SimulatedCuda) -> None:
        self.cuda = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(_core, name)
