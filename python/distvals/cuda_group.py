"""``CudaReplicaGroup``: N replicas on CUDA devices, the GPU face of the engine.

The single-call collectives take one device array per replica (``DeviceArray``,
cupy, torch CUDA tensors, ...) and run the same ring/tree/direct schedules as the
CPU engine, as kernels on one stream per replica. Without ``stream`` a call returns
when every output is complete; with ``stream`` (a ``cudaStream_t`` as an int, or a
cupy or torch stream) it is enqueued there and returns at once.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from . import _core, config
from ._rendezvous import Rendezvous
from .cuda import DeviceArray, as_device_array, unavailable_reason

__all__ = ["CudaReplicaGroup"]


def _stream_arg(stream: Any) -> Tuple[Optional[int], int]:
    """(cudaStream_t as an int, its CUDA device or -1) for an int or a cupy/torch stream."""
    if stream is None:
        return None, -1
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream, -1
    if hasattr(stream, "__cuda_stream__"):  # the CUDA Python stream protocol: (version, handle)
        return int(stream.__cuda_stream__()[1]), -1
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        dev = getattr(getattr(stream, "device", None), "index", None)
        return int(stream.cuda_stream), -1 if dev is None else int(dev)
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr), int(getattr(stream, "device_id", -1))
    raise TypeError(f"stream must be a cudaStream_t (int) or a cupy/torch stream, got {type(stream).__name__}")


class CudaReplicaGroup:
    """N replicas on GPUs: ``CudaReplicaGroup(["GPU:0", "GPU:1"])``.

    ``"GPU:k"`` is a logical GPU on CUDA device ``k // distvals.config.get_logical_gpus()``,
    so several replicas may share one GPU, each with its own stream. Arrays must live on
    their replica's CUDA device; ``all_reduce``, ``reduce`` and ``broadcast`` work in
    place, ``all_gather`` and ``reduce_scatter`` return new DeviceArrays.
    """

    def __init__(self, devices: Sequence[str], *, timeout_seconds: Optional[float] = None,
                 chunk_bytes: int = 0, peer_access: bool = True):
        backend = getattr(_core, "cuda", None)
        if backend is None:
            raise RuntimeError(f"GPU replicas need the CUDA backend: {unavailable_reason()}")
        names = [_core.parse_device(str(d)) for d in devices]
        self._group = backend.Group(names, config.get_logical_gpus(), timeout_seconds, chunk_bytes, peer_access)
        self._gpus: List[int] = list(self._group.gpus)
        self._meet = Rendezvous(self.size, self._group.timeout_seconds)

    # ---- description ---------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._group.size

    num_replicas = size

    @property
    def devices(self) -> List[str]:
        return self._group.devices

    @property
    def gpus(self) -> List[int]:
        """The CUDA device of each replica."""
        return list(self._gpus)

    @property
    def timeout_seconds(self) -> float:
        return self._group.timeout_seconds

    @property
    def engine(self) -> Any:
        """The underlying engine group (for timing loops)."""
        return self._group

    # ---- argument handling -------------------------------------------------------------
    def _arrays(self, buffers: Sequence[Any], what: str, writable: bool) -> List[DeviceArray]:
        n = self.size
        if len(buffers) != n:
            raise ValueError(f"{what} needs one array per replica: {n} expected, got {len(buffers)}")
        out = []
        for r, b in enumerate(buffers):
            try:
                a = as_device_array(b)
            except (TypeError, ValueError) as e:
                raise type(e)(f"replica {r}: {e}") from None
            if a.size and a.device != self._gpus[r]:
                raise ValueError(
                    f"replica {r}: the array lives on CUDA device {a.device}, but replica {r} "
                    f"({self.devices[r]}) runs on CUDA device {self._gpus[r]}"
                )
            if writable and a.readonly:
                raise ValueError(f"replica {r}: the array is read-only, but {what} writes into it")
            out.append(a)
        a0 = out[0]
        for r, a in enumerate(out[1:], start=1):
            if a.dtype != a0.dtype:
                raise TypeError(
                    f"replica {r} has dtype {a.dtype.name}, replica 0 has {a0.dtype.name}; "
                    "all replicas need the same dtype"
                )
            if a.shape != a0.shape:
                raise ValueError(
                    f"replica {r} has shape {a.shape}, replica 0 has shape {a0.shape}; "
                    "all replicas need the same shape"
                )
        return out

    @staticmethod
    def _raw(arrays: Sequence[DeviceArray]) -> List[Tuple[int, int, int]]:
        return [(a.ptr, a.size, a.device) for a in arrays]

    def _run(self, kind: str, arrays: Sequence[DeviceArray], outs: Sequence[DeviceArray], op: str,
             algorithm: str, root: int, stream: Any) -> None:
        handle, dev = _stream_arg(stream)
        self._group.run(kind, arrays[0].dtype.name, op, algorithm, root, self._raw(arrays), self._raw(outs),
                        handle, dev)

    def _check_root(self, root: int) -> int:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is out of range for {self.size} replicas")
        return root

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(self, buffers: Sequence[Any], op: str = "sum", algorithm: str = "auto",
                   out: Optional[Sequence[Any]] = None, stream: Any = None) -> None:
        """All-reduce in place (or into ``out``); op: sum, mean, min, max, prod."""
        ins = self._arrays(buffers, "all_reduce", out is None)
        outs = ins if out is None else self._arrays(out, "all_reduce output", True)
        if outs[0].dtype != ins[0].dtype or outs[0].shape != ins[0].shape:
            raise ValueError("all_reduce: outputs must have the inputs' dtype and shape")
        self._run("all_reduce", ins, outs, op, algorithm, 0, stream)

    def reduce(self, buffers: Sequence[Any], root: int = 0, op: str = "sum", stream: Any = None) -> None:
        """Reduce in place into ``buffers[root]``; the other arrays are only read."""
        ins = self._arrays(buffers, "reduce", False)
        self._check_root(root)
        if ins[root].readonly:
            raise ValueError(f"replica {root}: the root array is read-only, but reduce writes into it")
        self._run("reduce", ins, ins, op, "direct", root, stream)

    def broadcast(self, buffers: Sequence[Any], root: int = 0, stream: Any = None) -> None:
        """Copy ``buffers[root]`` into every other array, in place."""
        ins = self._arrays(buffers, "broadcast", True)
        self._run("broadcast", ins, ins, "sum", "direct", self._check_root(root), stream)

    def all_gather(self, buffers: Sequence[Any], stream: Any = None) -> List[DeviceArray]:
        """New arrays, each the concatenation of all replicas' arrays along axis 0
        (0-d parts give shape (N,))."""
        ins = self._arrays(buffers, "all_gather", False)
        shape = ins[0].shape
        gathered = (self.size,) if not shape else (shape[0] * self.size,) + shape[1:]
        outs = [DeviceArray(gathered, ins[0].dtype, g) for g in self._gpus]
        self._run("all_gather", ins, outs, "sum", "direct", 0, stream)
        return outs

    def reduce_scatter(self, buffers: Sequence[Any], op: str = "sum", stream: Any = None) -> List[DeviceArray]:
        """New arrays: replica r gets block r (of N along axis 0) of the reduction."""
        ins = self._arrays(buffers, "reduce_scatter", False)
        shape = ins[0].shape
        if not shape or shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter needs a first dimension divisible by {self.size} replicas, got shape {shape}"
            )
        part = (shape[0] // self.size,) + shape[1:]
        outs = [DeviceArray(part, ins[0].dtype, g) for g in self._gpus]
        self._run("reduce_scatter", ins, outs, op, "direct", 0, stream)
        return outs

    # ---- per-replica style: N threads, one per replica ---------------------------------
    # Each replica checks its own array, then they meet; the last to arrive runs the
    # single-call collective for all of them.
    def _replica(self, replica: int, array: Any, writable: bool) -> Tuple[Optional[DeviceArray], Any]:
        if not 0 <= replica < self.size:
            raise ValueError(f"replica {replica} is out of range for a group of {self.size}")
        try:
            a = as_device_array(array)
            if a.size and a.device != self._gpus[replica]:
                raise ValueError(
                    f"the array lives on CUDA device {a.device}, but replica {replica} "
                    f"({self.devices[replica]}) runs on CUDA device {self._gpus[replica]}"
                )
            if writable and a.readonly:
                raise ValueError("the array is read-only, but the collective writes into it")
            return a, None
        except (TypeError, ValueError) as e:
            return None, type(e)(f"replica {replica}: {e}")

    def _meet_call(self, replica: int, array: Any, writable: bool, key: Tuple[Any, ...], run_all: Any,
                   timeout_seconds: Optional[float]) -> Any:
        a, err = self._replica(replica, array, writable)
        full_key = key + ((a.dtype.name, a.shape) if a is not None else ())
        return self._meet.meet(replica, full_key, a, run_all, timeout_seconds, err)

    def replica_all_reduce(self, replica: int, array: Any, op: str = "sum", algorithm: str = "auto",
                           timeout_seconds: Optional[float] = None) -> None:
        """Replica ``replica``'s part of an in-place all-reduce; every replica calls it
        from its own thread."""
        def run(arrays: List[DeviceArray]) -> None:
            self.all_reduce(arrays, op, algorithm)
        self._meet_call(replica, array, True, ("all_reduce", op, algorithm), run, timeout_seconds)

    def replica_reduce(self, replica: int, array: Any, root: int = 0, op: str = "sum",
                       timeout_seconds: Optional[float] = None) -> None:
        def run(arrays: List[DeviceArray]) -> None:
            self.reduce(arrays, root, op)
        self._meet_call(replica, array, replica == root, ("reduce", root, op), run, timeout_seconds)

    def replica_broadcast(self, replica: int, array: Any, root: int = 0,
                          timeout_seconds: Optional[float] = None) -> None:
        def run(arrays: List[DeviceArray]) -> None:
            self.broadcast(arrays, root)
        self._meet_call(replica, array, True, ("broadcast", root), run, timeout_seconds)

    def replica_all_gather(self, replica: int, array: Any, timeout_seconds: Optional[float] = None) -> DeviceArray:
        return self._meet_call(replica, array, False, ("all_gather",), self.all_gather, timeout_seconds)

    def replica_reduce_scatter(self, replica: int, array: Any, op: str = "sum",
                               timeout_seconds: Optional[float] = None) -> DeviceArray:
        def run(arrays: List[DeviceArray]) -> List[DeviceArray]:
            return self.reduce_scatter(arrays, op)
        return self._meet_call(replica, array, False, ("reduce_scatter", op), run, timeout_seconds)

    # ---- failure handling ----------------------------------------------------------------
    def abort(self, replica: int, why: str) -> None:
        """Release every waiting replica (and a host wait on the GPU) with AbortedError
        naming ``replica``; the group stays aborted until ``reset()``."""
        self._meet.abort(replica, why)
        self._group.abort(replica, why)

    def reset(self) -> None:
        self._meet.reset()
        self._group.reset()

    @property
    def aborted(self) -> bool:
        return self._group.aborted or self._meet.failed

    @property
    def closed(self) -> bool:
        return self._group.closed

    def close(self) -> None:
        """Free streams, events and scratch memory; later calls raise ClosedError."""
        self._group.close()

    def __enter__(self) -> "CudaReplicaGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CudaReplicaGroup(devices={self.devices!r}, gpus={self._gpus!r})"
