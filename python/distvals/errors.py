"""Exceptions raised by distvals (all derive from Python's builtin ones)."""

from ._core import AbortedError, ClosedError, CollectiveTimeoutError, CudaError, MismatchError

__all__ = ["AbortedError", "ClosedError", "CollectiveTimeoutError", "CudaError", "MismatchError"]
