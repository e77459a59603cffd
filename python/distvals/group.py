"""``ReplicaGroup``: the direct Python face of the engine's group of local replicas."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np

from . import _core, options

__all__ = ["ReplicaGroup"]


def _devices(devices: Union[int, Sequence[str]]) -> Union[int, List[str]]:
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"a ReplicaGroup needs at least 1 replica, got {devices}")
        return int(devices)
    if isinstance(devices, str):
        raise TypeError("devices must be a list of device names or a replica count, not one string")
    return [str(d) for d in devices]


def _on_gpu(devices: Union[int, List[str]]) -> bool:
    """True for a list of GPU devices; mixing CPU and GPU replicas is an error."""
    if isinstance(devices, int):
        return False
    kinds = {_core.parse_device(d).split(":")[0] for d in devices}
    if kinds == {"CPU", "GPU"}:
        raise ValueError(f"a ReplicaGroup runs either CPU or GPU replicas, not both: {devices}")
    return kinds == {"GPU"}


class ReplicaGroup:
    """N local replicas that run collectives together on the C++ engine.

    ``ReplicaGroup(["CPU:0", "CPU:1"])`` or ``ReplicaGroup(2)``. Every collective takes
    one numpy array per replica (same shape and dtype), works without copying, and
    releases the GIL while the engine runs on its worker threads.

    ``all_reduce``, ``reduce`` and ``broadcast`` work in place; ``all_gather`` and
    ``reduce_scatter`` return new arrays. ``timeout_seconds`` bounds every wait, to the
    nanosecond (default 300 s, or ``DISTVALS_TIMEOUT_SECONDS``; ``math.inf``: no timeout,
    waits then end only on abort, close or Ctrl-C). ``spin_us``: how long a wait spins
    before it blocks (negative: the engine's default; 0 suits threads that hand over the
    GIL, since a spinning waiter would hold a core the other replica needs).

    The ``replica_*`` methods are the per-replica style: N threads, one per replica,
    each pass their own array and meet inside the engine.
    """

    def __init__(self, devices: Union[int, Sequence[str]], *, timeout_seconds: Optional[float] = None,
                 threads: int = 0, chunk_bytes: int = 0, spin_us: int = -1):
        devs = _devices(devices)
        timeout_seconds = options.effective_timeout_seconds(timeout_seconds)
        if _on_gpu(devs):
            # GPU replicas run on the CUDA backend, behind the same method names.
            from .cuda_group import CudaReplicaGroup

            self._group = CudaReplicaGroup(devs, timeout_seconds=timeout_seconds, chunk_bytes=chunk_bytes)
        else:
            self._group = _core.Group(devs, timeout_seconds, threads, chunk_bytes, spin_us)
        # Bind the hot methods once: a call then costs one attribute lookup.
        g = self._group
        self.all_reduce = g.all_reduce
        self.reduce = g.reduce
        self.broadcast = g.broadcast
        self.all_gather = g.all_gather
        self.reduce_scatter = g.reduce_scatter
        self.replica_all_reduce = g.replica_all_reduce
        self.replica_all_gather = g.replica_all_gather
        self.replica_broadcast = g.replica_broadcast
        self.replica_reduce = g.replica_reduce
        self.replica_reduce_scatter = g.replica_reduce_scatter

    # The methods above are bound in __init__; these stubs carry the documentation.
    if False:  # pragma: no cover
        def all_reduce(self, buffers, op="sum", algorithm="auto", out=None):
            """All-reduce in place (or into ``out``); op: sum, mean, min, max, prod."""

    @property
    def num_replicas(self) -> int:
        return self._group.size

    @property
    def devices(self) -> List[str]:
        return self._group.devices

    @property
    def timeout_seconds(self) -> float:
        return self._group.timeout_seconds

    @property
    def engine(self) -> "_core.Group":
        """The underlying engine group (for timing loops)."""
        return self._group

    def abort(self, replica: int, why: str) -> None:
        """Release every replica waiting in a collective with AbortedError naming ``replica``."""
        self._group.abort(replica, why)

    def reset(self) -> None:
        """Clear an abort so the group runs again (only when no collective is in flight)."""
        self._group.reset()

    @property
    def aborted(self) -> bool:
        return self._group.aborted

    @property
    def closed(self) -> bool:
        return self._group.closed

    def close(self) -> None:
        """Stop the worker threads; later calls raise ClosedError. Idempotent."""
        self._group.close()

    def __enter__(self) -> "ReplicaGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplicaGroup(devices={self.devices!r})"
