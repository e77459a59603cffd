"""What the functions that build input are told: ``InputContext`` and ``ValueContext``."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["InputContext", "ValueContext"]


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


class InputContext:
    """What ``dataset_fn`` of ``distribute_datasets_from_function`` is told: how many
    input pipelines there are, which one this is, and how many replicas consume them."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._num_input_pipelines = _check_count(num_input_pipelines, "num_input_pipelines", 1)
        self._input_pipeline_id = _check_count(input_pipeline_id, "input_pipeline_id", 0)
        self._num_replicas_in_sync = _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        if self._input_pipeline_id >= self._num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {input_pipeline_id} is out of range for {num_input_pipelines} input pipelines"
            )

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines (calls of ``dataset_fn``) feed the replicas: 1 in one
        process, the number of workers for MultiWorkerMirroredStrategy, the number of
        replicas with ``InputReplicationMode.PER_REPLICA``."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """Which input pipeline this call of ``dataset_fn`` builds, 0..num_input_pipelines-1
        (the worker's rank, or the replica for PER_REPLICA); use it to shard the data."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas, over every worker, consume the input pipelines in each step
        (the divisor of ``get_per_replica_batch_size``)."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` // ``num_replicas_in_sync``; ValueError when it does not divide."""
        global_batch_size = _check_count(global_batch_size, "global_batch_size", 0)
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self._num_replicas_in_sync} replicas in sync"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._replica_id = _check_count(replica_id_in_sync_group, "replica_id_in_sync_group", 0)
        self._num_replicas = _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        if self._replica_id >= self._num_replicas:
            raise ValueError(
                f"replica_id_in_sync_group {replica_id_in_sync_group} is out of range for "
                f"{num_replicas_in_sync} replicas"
            )

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica whose value ``value_fn`` is asked for, 0..num_replicas_in_sync-1 (its
        global id, over every worker, in a multi-worker strategy)."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas are in sync, over every worker (``value_fn`` is called once for
        each of them, by the process that runs it)."""
        return self._num_replicas

    def __repr__(self) -> str:
        return f"ValueContext(replica_id_in_sync_group={self._replica_id}, num_replicas_in_sync={self._num_replicas})"
