"""Cross-device ops and communication options: how a strategy runs its collectives."""

from __future__ import annotations

import enum
import math
import numbers
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _core

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "CollectiveAllReduce",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "ReductionToOneDevice",
]

#: Longest wait of any collective, and of ``strategy.run`` for its replicas, when
#: ``CommunicationOptions.timeout_seconds`` is None.
DEFAULT_TIMEOUT_SECONDS = 300.0

#: The environment variable that overrides DEFAULT_TIMEOUT_SECONDS.
TIMEOUT_ENV = "DISTVALS_TIMEOUT_SECONDS"


def parse_timeout_seconds(value: object, what: str = "timeout_seconds") -> Optional[float]:
    """``value`` as a timeout in seconds: None stays None (the default), a positive int or
    float is kept exactly (sub-millisecond values too), ``math.inf`` means no timeout.
    TypeError for anything but a number (a string such as "5", a bool), ValueError for
    NaN, zero and negative values."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be positive (inf: no timeout), got {value!r}")
    return seconds


def env_timeout_seconds() -> Optional[float]:
    """The timeout ``DISTVALS_TIMEOUT_SECONDS`` sets, or None when it is unset or empty.

    The value must be a positive number of seconds ("0.5", "120", "inf" for no timeout);
    anything else is ignored with a RuntimeWarning naming it, and the default applies.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds <= 0:
        warnings.warn(
            f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds; "
            f"using the default timeout of {DEFAULT_TIMEOUT_SECONDS:g} s",
            RuntimeWarning,
            stacklevel=3,
        )
        return DEFAULT_TIMEOUT_SECONDS
    return seconds


def effective_timeout_seconds(value: object) -> Optional[float]:
    """``value`` checked (see parse_timeout_seconds), or when None the environment's
    timeout (see env_timeout_seconds), or None for the built-in default."""
    seconds = parse_timeout_seconds(value)
    return env_timeout_seconds() if seconds is None else seconds


class CommunicationImplementation(enum.Enum):
    """The engine's all-reduce algorithms, by name (``AUTO`` chooses by size)."""

    AUTO = "auto"
    RING = "ring"
    TREE = "tree"
    DIRECT = "direct"


def _algorithm(name: Union[str, CommunicationImplementation], what: str) -> str:
    if isinstance(name, CommunicationImplementation):
        return name.value
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a string such as 'auto' or 'ring', got {type(name).__name__}")
    try:
        return _core.parse_algorithm(name)
    except ValueError:
        raise ValueError(f"unknown {what} {name!r}; expected 'auto', 'ring', 'tree' or 'direct'") from None


class CommunicationOptions:
    """Options of the collectives a strategy runs.

    ``bytes_per_pack``: when positive, ``ReplicaContext.all_reduce`` and
    ``batch_reduce_to`` pack small values of one dtype into buffers of at most this many
    bytes (one engine call each); 0: the library's choice (on CPU replicas, packs of at
    most 32 KiB; on GPUs, one buffer per dtype).
    ``timeout_seconds``: longest wait of any collective and of ``strategy.run`` for its
    replicas to finish, kept to the nanosecond; ``math.inf`` means no timeout; None means
    ``DEFAULT_TIMEOUT_SECONDS`` (300 s), or the environment variable
    ``DISTVALS_TIMEOUT_SECONDS`` when it holds a positive number.
    ``implementation``: the all-reduce algorithm, "auto", "ring", "tree" or "direct".
    """

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: Optional[float] = None,
        implementation: Union[str, CommunicationImplementation] = "auto",
    ):
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int):
            raise TypeError(f"bytes_per_pack must be an int, got {type(bytes_per_pack).__name__}")
        if bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be non-negative, got {bytes_per_pack}")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = parse_timeout_seconds(timeout_seconds)
        self.implementation = _algorithm(implementation, "implementation")

    def merge(self, other: Optional[CommunicationOptions]) -> CommunicationOptions:
        """These options with the fields ``other`` sets (non-default) taking precedence."""
        if other is None:
            return self
        if not isinstance(other, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(other).__name__}")
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=other.timeout_seconds if other.timeout_seconds is not None else self.timeout_seconds,
            implementation=other.implementation if other.implementation != "auto" else self.implementation,
        )

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation!r})"
        )


class CrossDeviceOps:
    """Base of the ways a strategy reduces across its replicas.

    Passed to ``MirroredStrategy(cross_device_ops=...)``, it chooses how the strategy runs
    its collectives. Like ``tf.distribute.CrossDeviceOps`` it also has ``reduce``,
    ``batch_reduce`` and ``broadcast``, called in cross-replica context (not inside
    ``strategy.run``). They run on the collectives of the strategy the values belong to:
    the strategy of a distributed variable among the values or destinations, else the
    strategy whose ``scope()`` is entered, else the one open strategy made with this
    object, else the default strategy. A value that is not distributed (or a distributed
    value of one part) is one replica's value, as in TensorFlow: every reduce op gives it
    back, copied to the destinations.
    """

    def reduce(
        self,
        reduce_op: Any,
        per_replica_value: Any,
        destinations: Any,
        options: Optional[CommunicationOptions] = None,
    ) -> Any:
        """Reduces ``per_replica_value`` (a PerReplica, Mirrored, distributed variable, or
        one replica's value) with ``reduce_op`` onto ``destinations`` (a device string, a
        list of them, or a distributed value meaning its devices): a Mirrored with one
        copy per destination device, or the value itself for one destination. A Mirrored
        reduces as its copies do: SUM gives N times the value, MEAN the value."""
        from .cross_device_calls import reduce

        return reduce(self, reduce_op, per_replica_value, destinations, options)

    def batch_reduce(
        self,
        reduce_op: Any,
        value_destination_pairs: Sequence[Tuple[Any, Any]],
        options: Optional[CommunicationOptions] = None,
    ) -> List[Any]:
        """``reduce`` for each (value, destinations) pair, the results in the pairs' order;
        the distributed values are reduced together (``extended.batch_reduce_to``)."""
        from .cross_device_calls import batch_reduce

        return batch_reduce(self, reduce_op, value_destination_pairs, options)

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` (one value, or a Mirrored: its value) to ``destinations``: a
        Mirrored, or the value itself for one destination. ValueError for a PerReplica."""
        from .cross_device_calls import broadcast

        return broadcast(self, tensor, destinations)

    def _call_options(self, options: Optional[CommunicationOptions]) -> Optional[CommunicationOptions]:
        """The options ``reduce`` and ``batch_reduce`` pass on: ``options`` as given."""
        return options

    def _bind(self, strategy: Any) -> None:
        """Records ``strategy`` as one made with this object (weakly: it may go away)."""
        refs = [r for r in self.__dict__.get("_strategy_refs", ()) if r() is not None]
        refs.append(weakref.ref(strategy))
        self._strategy_refs = refs

    def _strategies(self) -> List[Any]:
        """The open strategies made with this object."""
        out = []
        for r in self.__dict__.get("_strategy_refs", ()):
            s = r()
            if s is not None and not s.extended._closed:
                out.append(s)
        return out

    def __getstate__(self) -> Dict[str, Any]:
        # A copy (or an unpickled one) belongs to no strategy yet: a deep-copied strategy
        # binds its own copy.
        state = dict(self.__dict__)
        state.pop("_strategy_refs", None)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CollectiveAllReduce(CrossDeviceOps):
    """All-reduce every replica's value on the engine with ``algorithm``
    ("auto", "ring", "tree" or "direct"). The default cross-device ops.

    Its ``reduce`` and ``batch_reduce`` all-reduce with ``algorithm`` (unless their
    ``options`` name one) where the strategy all-reduces; a strategy made with
    ``ReductionToOneDevice`` reduces onto one device instead.
    """

    def __init__(self, algorithm: Union[str, CommunicationImplementation] = "auto"):
        self.algorithm = _algorithm(algorithm, "algorithm")

    def _call_options(self, options: Optional[CommunicationOptions]) -> Optional[CommunicationOptions]:
        """``options`` with this object's algorithm where they leave it to the library
        ("auto"), so that ``reduce`` and ``batch_reduce`` all-reduce with it."""
        if self.algorithm == "auto":
            return options
        return CommunicationOptions(implementation=self.algorithm).merge(options)

    def __repr__(self) -> str:
        return f"CollectiveAllReduce(algorithm={self.algorithm!r})"


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce onto one replica's device, then broadcast the result to the others.

    ``reduce_to_device``: a device of the strategy (default: its first device).

    Its ``reduce``, ``batch_reduce`` and ``broadcast`` run on the collectives of the
    strategy the values belong to, which reduce through ``reduce_to_device`` when that
    strategy was made with this object; through another strategy they reduce as it does,
    with the same results.
    """

    def __init__(self, reduce_to_device: Optional[str] = None):
        if reduce_to_device is not None:
            if not isinstance(reduce_to_device, str):
                raise TypeError(f"reduce_to_device must be a device string, got {type(reduce_to_device).__name__}")
            reduce_to_device = _core.parse_device(reduce_to_device)
        self.reduce_to_device = reduce_to_device

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"
