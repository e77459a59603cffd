"""``distvals.experimental``: the names TensorFlow keeps in ``tf.distribute.experimental``.

``CommunicationOptions``, ``CommunicationImplementation`` (``CollectiveCommunication``
is its older name), ``CollectiveHints`` (the older form of CommunicationOptions),
``ValueContext`` and ``MultiWorkerMirroredStrategy`` are the same objects as the
top-level ones. TensorFlow's parameter-server, TPU, central-storage and preemption
names have no counterpart here.
"""

from __future__ import annotations

from typing import Optional

from .input import ValueContext
from .multi_worker import MultiWorkerMirroredStrategy
from .options import CommunicationImplementation, CommunicationOptions

__all__ = [
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]

#: TensorFlow's older name of CommunicationImplementation.
CollectiveCommunication = CommunicationImplementation


class CollectiveHints(CommunicationOptions):
    """TensorFlow's older collective options, ``CollectiveHints(bytes_per_pack=0,
    timeout_seconds=None)``: a CommunicationOptions, accepted wherever one is."""

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: Optional[float] = None) -> None:
        super().__init__(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)
