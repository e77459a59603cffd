"""TensorFlow's GPU cross-device ops, by name: ``NcclAllReduce`` and
``HierarchicalCopyAllReduce``.

Code written for ``MirroredStrategy(cross_device_ops=tf.distribute.NcclAllReduce())``
runs unchanged: both are the engine's all-reduce (``CollectiveAllReduce`` with the
algorithm chosen by size), which on GPU replicas is the CUDA engine. ``num_packs`` is
checked as TensorFlow checks it and otherwise has no effect: the engine packs small
values by dtype on its own (``CommunicationOptions.bytes_per_pack``).
"""

from __future__ import annotations

from .options import CollectiveAllReduce

__all__ = ["HierarchicalCopyAllReduce", "NcclAllReduce"]


def _num_packs(num_packs: int, what: str) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, int):
        raise TypeError(f"{what}: num_packs must be an int, got {type(num_packs).__name__}")
    if num_packs < 0:
        raise ValueError(f"{what}: num_packs must be at least 0, got {num_packs}")
    return num_packs


class NcclAllReduce(CollectiveAllReduce):
    """``tf.distribute.NcclAllReduce(num_packs=1)``: the engine's all-reduce."""

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _num_packs(num_packs, "NcclAllReduce")
        super().__init__("auto")

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"


class HierarchicalCopyAllReduce(CollectiveAllReduce):
    """``tf.distribute.HierarchicalCopyAllReduce(num_packs=1)``: the engine's all-reduce."""

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _num_packs(num_packs, "HierarchicalCopyAllReduce")
        super().__init__("auto")

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"
