"""``InputOptions`` and ``InputReplicationMode``: how a dataset is distributed.

As in TensorFlow:

- ``experimental_replication_mode=PER_WORKER`` (the default): one input pipeline feeds
  every replica of the process. ``PER_REPLICA``: ``distribute_datasets_from_function``
  calls ``dataset_fn`` once per replica (``InputContext(num_input_pipelines=N,
  input_pipeline_id=r)``) and replica r reads only its own dataset; with
  ``experimental_distribute_dataset`` it is a NotImplementedError, as in TensorFlow.
- ``experimental_fetch_to_device``: True (default) copies GPU replicas' parts to their
  GPUs; False keeps them in host memory. CPU replicas' parts are in host memory anyway.
- ``experimental_place_dataset_on_device``: only with ``PER_REPLICA`` and
  ``experimental_fetch_to_device=False`` (ValueError otherwise, as in TensorFlow); each
  replica's elements are then made on its device (GPU replicas) or in host memory.
- ``experimental_per_replica_buffer_size``: accepted and without effect: elements are
  produced when the iterator is asked for them, there is no device prefetch to size.
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Optional

__all__ = ["InputOptions", "InputReplicationMode", "check_options"]


class InputReplicationMode(enum.Enum):
    """Whether one input pipeline feeds all replicas of a process (PER_WORKER) or each
    replica has its own (PER_REPLICA)."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


_Fields = collections.namedtuple(  # type: ignore[name-match]  # typename: the public class's name
    "InputOptions",
    [
        "experimental_fetch_to_device",
        "experimental_replication_mode",
        "experimental_place_dataset_on_device",
        "experimental_per_replica_buffer_size",
    ],
)


class InputOptions(_Fields):
    """Options of ``experimental_distribute_dataset`` and
    ``distribute_datasets_from_function`` (``tf.distribute.InputOptions``; see the module
    doc for what each does here)."""

    __slots__ = ()

    def __new__(
        cls,
        experimental_fetch_to_device: Optional[bool] = None,
        experimental_replication_mode: Any = InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int = 1,
    ) -> InputOptions:
        if experimental_fetch_to_device is None:
            experimental_fetch_to_device = True
        return super().__new__(
            cls,
            experimental_fetch_to_device,
            experimental_replication_mode,
            experimental_place_dataset_on_device,
            experimental_per_replica_buffer_size,
        )


def _mode(options: Any) -> InputReplicationMode:
    mode = getattr(options, "experimental_replication_mode", InputReplicationMode.PER_WORKER)
    if isinstance(mode, InputReplicationMode):
        return mode
    name = getattr(mode, "name", getattr(mode, "value", mode))  # TensorFlow's enum, or a string
    if isinstance(name, str) and name.upper() in InputReplicationMode.__members__:
        return InputReplicationMode[name.upper()]
    raise ValueError(
        f"InputOptions.experimental_replication_mode must be InputReplicationMode.PER_WORKER or "
        f"PER_REPLICA, got {mode!r}"
    )


def check_options(options: Any, what: str, per_replica_allowed: bool = False) -> InputReplicationMode:
    """Validates ``options`` (None, distvals' or TensorFlow's InputOptions) for ``what``;
    returns the replication mode."""
    if options is None:
        return InputReplicationMode.PER_WORKER
    if not isinstance(options, InputOptions) and type(options).__name__ != "InputOptions":
        raise TypeError(f"{what}: options must be an InputOptions, got {type(options).__name__}")
    mode = _mode(options)
    buffer = getattr(options, "experimental_per_replica_buffer_size", 1)
    if isinstance(buffer, bool) or not isinstance(buffer, int):
        raise TypeError(
            f"{what}: InputOptions.experimental_per_replica_buffer_size must be an int, got {type(buffer).__name__}"
        )
    place = bool(getattr(options, "experimental_place_dataset_on_device", False))
    fetch = getattr(options, "experimental_fetch_to_device", True)
    if mode is InputReplicationMode.PER_REPLICA:
        if not per_replica_allowed:
            raise NotImplementedError(
                f"{what}: InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA) is only "
                "supported by MirroredStrategy's distribute_datasets_from_function"
            )
        if place and fetch is not False:
            raise ValueError(
                f"{what}: InputOptions.experimental_place_dataset_on_device cannot be True when "
                "experimental_fetch_to_device is True and the replication mode is PER_REPLICA"
            )
    elif place and per_replica_allowed:
        raise ValueError(
            f"{what}: InputOptions.experimental_place_dataset_on_device needs "
            "experimental_replication_mode=InputReplicationMode.PER_REPLICA"
        )
    return mode
