"""Process-wide settings of distvals.

``set_logical_gpus(n)`` makes every physical GPU appear as ``n`` logical GPUs, the
way TensorFlow's logical devices do: device ``"GPU:k"`` is logical GPU ``k``, and it
runs on CUDA device ``k // n``. Each logical replica keeps its own stream and its own
buffers, so ``MirroredStrategy(["GPU:0", "GPU:1", "GPU:2", "GPU:3"])`` works on a
machine with one GPU after ``set_logical_gpus(4)``. The environment variable
``DISTVALS_LOGICAL_GPUS`` sets the starting value.

``set_logical_cpus(n)`` says how many CPU replicas ``MirroredStrategy()`` makes when it
is given no devices and there is no GPU (``"CPU:0"`` .. ``"CPU:n-1"``; one by default),
as TensorFlow's logical CPU configuration does. ``DISTVALS_LOGICAL_CPUS`` sets the
starting value.
"""

from __future__ import annotations

import os

__all__ = ["get_logical_cpus", "get_logical_gpus", "physical_gpu", "set_logical_cpus", "set_logical_gpus"]


def _from_env(name: str) -> int:
    raw = os.environ.get(name, "1")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return n


def _positive(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} needs an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{what} needs n >= 1, got {n}")
    return n


_logical_gpus = _from_env("DISTVALS_LOGICAL_GPUS")
_logical_cpus = _from_env("DISTVALS_LOGICAL_CPUS")


def set_logical_gpus(n: int) -> None:
    """Share each physical GPU between ``n`` logical replicas (``n >= 1``; 1 is the default).

    ``"GPU:k"`` then names logical GPU ``k`` on CUDA device ``k // n``. Groups and
    strategies read the setting when they are created; existing ones keep theirs.
    """
    global _logical_gpus
    _logical_gpus = _positive(n, "set_logical_gpus")


def get_logical_gpus() -> int:
    """How many logical replicas share each physical GPU."""
    return _logical_gpus


def physical_gpu(logical: int) -> int:
    """The CUDA device that logical GPU ``logical`` runs on."""
    if logical < 0:
        raise ValueError(f"GPU index must not be negative, got {logical}")
    return logical // _logical_gpus


def set_logical_cpus(n: int) -> None:
    """Make ``MirroredStrategy()`` without devices (and without GPUs) use ``n`` CPU
    replicas, ``"CPU:0"`` .. ``"CPU:n-1"`` (``n >= 1``; 1 is the default)."""
    global _logical_cpus
    _logical_cpus = _positive(n, "set_logical_cpus")


def get_logical_cpus() -> int:
    """How many CPU replicas ``MirroredStrategy()`` makes when it has no GPU."""
    return _logical_cpus
