"""distvals: tf.distribute-style synchronous data parallelism on a C++ collective engine."""

from ._core import __version__
from .errors import AbortedError, ClosedError, CollectiveTimeoutError, CudaError, MismatchError
from .group import ReplicaGroup

__all__ = [
    "__version__",
    "AbortedError",
    "ClosedError",
    "CollectiveTimeoutError",
    "CudaError",
    "MismatchError",
    "ReplicaGroup",
]
