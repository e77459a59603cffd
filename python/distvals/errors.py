"""Exceptions raised by distvals (all derive from Python's builtin ones)."""

from typing import TYPE_CHECKING, Optional

from ._core import AbortedError, ClosedError, CollectiveTimeoutError, CudaError, MismatchError

if TYPE_CHECKING:  # pragma: no cover
    from .replicas import Failure

__all__ = [
    "AbortedError",
    "ClosedError",
    "CollectiveTimeoutError",
    "CudaError",
    "InvalidArgumentError",
    "MismatchError",
    "OutOfRangeError",
    "replica_error",
]


class InvalidArgumentError(ValueError):
    """An argument TensorFlow would refuse with ``tf.errors.InvalidArgumentError`` (an index
    out of range in a scatter or gather, ``Optional.get_value`` without a value); a
    ValueError, so code that catches either works."""


class OutOfRangeError(IndexError):
    """A limit was reached, where TensorFlow raises ``tf.errors.OutOfRangeError``
    (``Variable.count_up_to``). The end of a dataset is StopIteration, as for any Python
    iterator."""


def replica_error(failure: "Failure") -> BaseException:
    """The exception ``strategy.run`` raises for a replica's failure: the same type, its
    message prefixed with ``replica k: ``, ``.replica == k``, the original chained as the
    cause (or the original itself when its type cannot be rebuilt; Ctrl-C and
    SystemExit as they are)."""
    e, r = failure.error, failure.replica
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return e
    prefix = f"replica {r}: "
    msg = str(e)
    new: Optional[BaseException] = None
    if not msg.startswith(prefix):
        try:
            new = type(e)(prefix + msg)
        except Exception:  # noqa: BLE001 - exception types with other signatures
            new = None
        if new is not None and type(new) is not type(e):
            new = None
    if new is None:
        if e.args and isinstance(e.args[0], str) and not msg.startswith(prefix):
            e.args = (prefix + e.args[0],) + tuple(e.args[1:])
        _set_replica(e, r)
        return e
    _set_replica(new, getattr(e, "replica", r))
    new.__cause__ = e
    return new


def _set_replica(e: BaseException, r: int) -> None:
    try:
        e.replica = r  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
