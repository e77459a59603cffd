"""``ReplicaGroup``: the direct Python face of the engine's group of local replicas."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, TypeVar, Union

import numpy as np

from . import _core, options

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import TypeGuard

    from .cuda_group import CudaReplicaGroup

__all__ = ["ReplicaGroup"]


def _devices(devices: Union[int, Sequence[str]]) -> Union[int, List[str]]:
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"a ReplicaGroup needs at least 1 replica, got {devices}")
        return int(devices)
    if isinstance(devices, str):
        raise TypeError("devices must be a list of device names or a replica count, not one string")
    # A bool gets here too (not iterable: TypeError).
    return [str(d) for d in devices]  # type: ignore[union-attr]


def _on_gpu(devices: Union[int, List[str]]) -> TypeGuard[List[str]]:
    """True for a list of GPU devices; mixing CPU and GPU replicas is an error."""
    if isinstance(devices, int):
        return False
    kinds = {_core.parse_device(d).split(":")[0] for d in devices}
    if kinds == {"CPU", "GPU"}:
        raise ValueError(f"a ReplicaGroup runs either CPU or GPU replicas, not both: {devices}")
    return kinds == {"GPU"}


_F = TypeVar("_F", bound=Callable[..., Any])


def _checked_by_the_engine(prototype: _F) -> Callable[[Callable[..., Any]], _F]:
    """Give a loosely-typed forwarding method the signature and documentation of
    ``prototype`` (for ``help()``, ``inspect`` and type checkers)."""

    def give(method: Callable[..., Any]) -> _F:
        sig = inspect.signature(prototype)
        # `self` as a method shows it: without the annotation the prototype needs.
        first, *rest = sig.parameters.values()
        method.__signature__ = sig.replace(parameters=[first.replace(annotation=first.empty), *rest])  # type: ignore[attr-defined]
        method.__doc__ = prototype.__doc__
        return method  # type: ignore[return-value]

    return give


def _proto_all_reduce(
    self: ReplicaGroup,
    replica: int,
    array: Any,
    op: str = "sum",
    algorithm: str = "auto",
    timeout_seconds: Optional[float] = None,
    out: Any = None,
) -> None:
    """Replica ``replica``'s part of an all-reduce, in place (or into ``out``, CPU replicas);
    every replica calls it from its own thread."""


def _proto_reduce(
    self: ReplicaGroup,
    replica: int,
    array: Any,
    root: int = 0,
    op: str = "sum",
    timeout_seconds: Optional[float] = None,
) -> None:
    """Replica ``replica``'s part of a reduce: the root's array receives the reduction, in place."""


def _proto_broadcast(
    self: ReplicaGroup, replica: int, array: Any, root: int = 0, timeout_seconds: Optional[float] = None
) -> None:
    """Replica ``replica``'s part of a broadcast: ``array`` receives the root's array, in place."""


def _proto_all_gather(self: ReplicaGroup, replica: int, array: Any, timeout_seconds: Optional[float] = None) -> Any:
    """Replica ``replica``'s part of an all-gather: a new array, every replica's array
    concatenated along axis 0."""


def _proto_reduce_scatter(
    self: ReplicaGroup, replica: int, array: Any, op: str = "sum", timeout_seconds: Optional[float] = None
) -> Any:
    """Replica ``replica``'s part of a reduce-scatter: a new array, block ``replica`` of the
    reduction."""


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

    def __init__(
        self,
        devices: Union[int, Sequence[str]],
        *,
        timeout_seconds: Optional[float] = None,
        threads: int = 0,
        chunk_bytes: int = 0,
        spin_us: int = -1,
    ):
        devs = _devices(devices)
        self._group: Union[_core.Group, CudaReplicaGroup]
        timeout_seconds = options.effective_timeout_seconds(timeout_seconds)
        if _on_gpu(devs):
            # GPU replicas run on the CUDA backend, behind the same method names.
            from .cuda_group import CudaReplicaGroup

            self._group = CudaReplicaGroup(devs, timeout_seconds=timeout_seconds, chunk_bytes=chunk_bytes)
        else:
            self._group = _core.Group(devs, timeout_seconds, threads, chunk_bytes, spin_us)
        self._gpu = not isinstance(self._group, _core.Group)

    # ---- single-call style: one call with every replica's array -------------------------
    def all_reduce(
        self,
        buffers: Sequence[Any],
        op: str = "sum",
        algorithm: str = "auto",
        out: Optional[Sequence[Any]] = None,
        *,
        stream: Any = None,
    ) -> None:
        """All-reduce in place, or into ``out`` (one array per replica, same dtype and shape).

        ``op``: sum, mean, min, max, prod. ``algorithm``: auto, ring, tree or direct.
        ``stream`` (GPU replicas only): enqueue on this CUDA stream instead of waiting.
        """
        if stream is None:
            self._group.all_reduce(buffers, op, algorithm, out)
        else:
            self._on_stream("all_reduce").all_reduce(buffers, op, algorithm, out, stream=stream)

    def reduce(
        self, buffers: Sequence[Any], root: int = 0, op: str = "sum", *, out: Any = None, stream: Any = None
    ) -> None:
        """Reduce in place into ``buffers[root]``, or into ``out`` (one array of the
        inputs' dtype and shape, where the root's values live); the other arrays are only
        read."""
        if stream is None and not self._gpu:
            self._group.reduce(buffers, root, op, out)
        else:
            self._on_stream("reduce").reduce(buffers, root, op, stream=stream, out=out)

    def broadcast(self, buffers: Sequence[Any], root: int = 0, *, stream: Any = None) -> None:
        """Copy ``buffers[root]`` into every other array, in place."""
        if stream is None:
            self._group.broadcast(buffers, root)
        else:
            self._on_stream("broadcast").broadcast(buffers, root, stream=stream)

    def all_gather(self, buffers: Sequence[Any], *, stream: Any = None) -> List[Any]:
        """New arrays, one per replica: every replica's array concatenated along axis 0
        (0-d arrays give shape ``(N,)``)."""
        if stream is None:
            return self._group.all_gather(buffers)
        return self._on_stream("all_gather").all_gather(buffers, stream=stream)

    def reduce_scatter(self, buffers: Sequence[Any], op: str = "sum", *, stream: Any = None) -> List[Any]:
        """New arrays: replica r gets block r (of N along axis 0) of the reduction."""
        if stream is None:
            return self._group.reduce_scatter(buffers, op)
        return self._on_stream("reduce_scatter").reduce_scatter(buffers, op, stream=stream)

    def _on_stream(self, what: str) -> CudaReplicaGroup:
        if not self._gpu:
            raise TypeError(f"{what}: stream= applies to GPU replicas; this group runs CPU replicas")
        return self._group  # type: ignore[return-value]  # _gpu: it is the CUDA group

    # ---- per-replica style: N threads, one per replica ----------------------------------
    # These take their arguments loosely and hand them to the engine as given: a call with
    # a bad or missing argument must still reach the engine, which releases the other
    # replicas with the same error instead of leaving them to wait for this one. Tools
    # see the signatures of the prototypes.
    @_checked_by_the_engine(_proto_all_reduce)
    def replica_all_reduce(self, *args: Any, **kwargs: Any) -> None:
        self._group.replica_all_reduce(*args, **kwargs)

    @_checked_by_the_engine(_proto_reduce)
    def replica_reduce(self, *args: Any, **kwargs: Any) -> None:
        self._group.replica_reduce(*args, **kwargs)

    @_checked_by_the_engine(_proto_broadcast)
    def replica_broadcast(self, *args: Any, **kwargs: Any) -> None:
        self._group.replica_broadcast(*args, **kwargs)

    @_checked_by_the_engine(_proto_all_gather)
    def replica_all_gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._group.replica_all_gather(*args, **kwargs)

    @_checked_by_the_engine(_proto_reduce_scatter)
    def replica_reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._group.replica_reduce_scatter(*args, **kwargs)

    @property
    def num_replicas(self) -> int:
        """The number of replicas in the group."""
        return self._group.size

    @property
    def devices(self) -> List[str]:
        """The replicas' device names, one per replica in replica order, in canonical form
        (``["CPU:0", "CPU:1"]`` for ``ReplicaGroup(2)``)."""
        return self._group.devices

    @property
    def timeout_seconds(self) -> float:
        """The bound on each wait in a collective, in seconds (``math.inf``: no timeout); the
        ``replica_*`` calls may pass their own ``timeout_seconds``."""
        return self._group.timeout_seconds

    @property
    def engine(self) -> Any:
        """The underlying engine group (``_core.Group``, or the CUDA group), for timing loops."""
        return self._group

    def abort(self, replica: int, why: str) -> None:
        """Release every replica waiting in a collective with AbortedError naming ``replica``
        (-1: no replica, the caller's own reason)."""
        n = self._group.size
        if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) or not -1 <= replica < n:
            # An AbortedError naming a replica that does not exist would send the reader
            # looking for a failure that never happened.
            raise ValueError(f"abort: replica must be -1 or a replica id in 0..{n - 1}, got {replica!r}")
        if not isinstance(why, str):
            raise TypeError(f"abort: why must be a str, got {type(why).__name__}")
        self._group.abort(int(replica), why)

    def reset(self) -> None:
        """Clear an abort so the group runs again (only when no collective is in flight)."""
        self._group.reset()

    @property
    def aborted(self) -> bool:
        """True once the group is aborted (by ``abort()``, a timeout, Ctrl-C or a replica's
        failure) until ``reset()``; collectives raise AbortedError meanwhile."""
        return self._group.aborted

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run; later calls raise ClosedError."""
        return self._group.closed

    def set_linger_us(self, us: int) -> int:
        """How long idle worker threads keep spinning for the next collective after one
        ends, in microseconds, on top of ``spin_us`` (0 to 100,000); returns the previous
        value; values outside that range are clamped. A standing setting for a caller
        whose collectives follow one another at once: no call then waits for a sleeping
        thread to wake up (tens of microseconds on a virtual machine). For one run of
        calls, ``batch()`` does the same and cannot be left raised by overlapping
        callers. GPU groups have no worker threads: 0, no effect."""
        if isinstance(self._group, _core.Group):
            return self._group.set_linger_us(min(max(int(us), 0), 100_000))
        return 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """``with group.batch():`` around collectives issued back to back (the leaves of
        a structure, one by one): while any batch is open, idle worker threads keep
        spinning between calls instead of going to sleep, so no call waits for a thread
        to wake up. Batches may overlap (from several threads); the threads sleep again
        when the last one closes. GPU groups: no effect."""
        engine = self._group if isinstance(self._group, _core.Group) else None
        if engine is not None:
            engine.batch(True)
        try:
            yield
        finally:
            if engine is not None:
                engine.batch(False)

    def close(self) -> None:
        """Stop the worker threads; later calls raise ClosedError. Idempotent."""
        self._group.close()

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplicaGroup(devices={self.devices!r})"
