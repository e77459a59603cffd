"""Device names of strategies: "CPU:0", "/cpu:1", "GPU:0", full TensorFlow names."""

from __future__ import annotations

from typing import Any, List

from ._core import parse_device

__all__ = ["LOCAL_PREFIX", "canonical_devices", "full_name", "gpu_count", "no_gpu_hint"]

LOCAL_PREFIX = "/job:localhost/replica:0/task:0/device:"


def full_name(device: str) -> str:
    """``"CPU:0"`` -> ``"/job:localhost/replica:0/task:0/device:CPU:0"``."""
    return LOCAL_PREFIX + device


def gpu_count() -> int:
    """How many GPU replicas can run here: logical GPUs (``distvals.config``), so that
    "GPU:3" works on one GPU after ``set_logical_gpus(4)``."""
    from . import devices

    return devices.gpu_count()


def no_gpu_hint(have: int) -> str:
    if have:
        return (
            "several replicas can share one GPU: distvals.config.set_logical_gpus(k) makes each GPU "
            "appear as k logical GPUs"
        )
    from . import cuda

    try:
        why = str(cuda.unavailable_reason())
    except Exception:  # noqa: BLE001 - the reason is only a hint
        why = ""
    return f"{why + '; ' if why else ''}use CPU devices such as 'CPU:0', 'CPU:1' for logical replicas"


def default_devices() -> List[str]:
    """What ``MirroredStrategy()`` uses: every GPU, else every logical CPU configured
    with ``distvals.config.set_logical_cpus`` (one by default)."""
    from . import config

    gpus = gpu_count()
    if gpus:
        return [f"GPU:{i}" for i in range(gpus)]
    return [f"CPU:{i}" for i in range(config.get_logical_cpus())]


def canonical_devices(devices: Any, what: str) -> List[str]:
    """The strategy's device list in canonical form ("CPU:0", "GPU:1"), checked: not
    empty, no duplicates, not CPUs and GPUs mixed, GPUs that exist."""
    if devices is None:
        return default_devices()
    if isinstance(devices, str):
        raise TypeError(f"{what}: devices must be a list of device names such as ['CPU:0', 'CPU:1'], not one string")
    try:
        devices = list(devices)
    except TypeError:
        raise TypeError(f"{what}: devices must be a list of device names, got {type(devices).__name__}") from None
    if not devices:
        raise ValueError(f"{what}: devices must not be empty")
    out: List[str] = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"{what}: device names must be strings, got {type(d).__name__} {d!r}")
        try:
            c = parse_device(d)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if c in out:
            raise ValueError(f"{what}: device {d!r} ({c}) is listed twice; every replica needs its own device")
        out.append(c)
    gpus = [c for c in out if c.startswith("GPU:")]
    if gpus:
        if len(gpus) != len(out):
            raise ValueError(
                f"{what}: {out} mixes CPU and GPU devices; a strategy's replicas are either all CPUs or all GPUs"
            )
        have = gpu_count()
        missing = [c for c in gpus if int(c.split(":")[1]) >= have]
        if missing:
            raise ValueError(
                f"{what}: {', '.join(missing)} requested, but distvals sees {have} GPU(s); " + no_gpu_hint(have)
            )
    return out
