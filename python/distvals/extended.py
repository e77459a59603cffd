"""``StrategyExtended``: the lower-level interface of a strategy (``strategy.extended``).

This base holds what every strategy offers in the same way: its devices, destinations,
``update``, ``value_container``, ``call_for_each_replica`` and the checkpoint and summary
flags. ``distvals.local_extended.LocalExtended`` adds the replicas of one process and
their collectives.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import context
from ._core import parse_device
from .device_names import full_name
from .values import DistributedValues, Mirrored, contains_distributed, regroup, select_replica

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """The strategy's lower-level interface, as ``tf.distribute.StrategyExtended``.

    ``worker_devices``, ``parameter_devices``, ``reduce_to``, ``batch_reduce_to``,
    ``broadcast_to``, ``update``, ``read_var``, ``value_container``,
    ``variable_created_in_scope``, ``call_for_each_replica``,
    ``worker_devices_by_replica``, ``non_slot_devices``, ``update_non_slot``, ``colocate_vars_with``,
    ``should_checkpoint``, ``should_save_summary``, ``experimental_should_init``.
    """

    def __init__(self, container_strategy: Any, devices: Sequence[str]) -> None:
        self._container = container_strategy
        self._devices = tuple(devices)
        self._n = len(self._devices)

    # ---- devices -------------------------------------------------------------------------
    @property
    def worker_devices(self) -> Tuple[str, ...]:
        """The replicas' devices, in full form ("/job:localhost/replica:0/task:0/device:CPU:0")."""
        return tuple(full_name(d) for d in self._devices)

    @property
    def parameter_devices(self) -> Tuple[str, ...]:
        """Where variables live: the replicas' devices."""
        return self.worker_devices

    @property
    def worker_devices_by_replica(self) -> Tuple[Tuple[str, ...], ...]:
        """Each replica's devices (one each)."""
        return tuple((d,) for d in self.worker_devices)

    def non_slot_devices(self, var_list: Any) -> Tuple[str, ...]:
        """Where state that is not a variable's slot lives: every replica's device."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether datasets must have static shapes (False: no distvals strategy needs them;
        TensorFlow's TPU strategies say True)."""
        return False

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process should write checkpoints (always, in one process)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this process should write summaries (always, in one process)."""
        return True

    @property
    def experimental_should_init(self) -> bool:
        """Whether this process should run initializers (always)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own copy of the program: True for
        MultiWorkerMirroredStrategy, False for the strategies of one process."""
        return False

    def _destinations(self, destinations: Any, what: str) -> List[str]:
        """Canonical device names of ``destinations`` (a device string, a list of them,
        or a distributed value / variable, meaning its devices)."""
        if destinations is None:
            return list(self._devices)
        if isinstance(destinations, DistributedValues):
            if len(destinations.values) == self._n:
                return list(self._devices)
            return list(self._devices[: len(destinations.values)])
        if isinstance(destinations, str):
            items = [destinations]
        elif isinstance(destinations, (list, tuple)):
            items = list(destinations)
        elif isinstance(destinations, (np.ndarray, np.generic)):
            # A host array lives on the host (numpy 2's array-API `.device` is "cpu").
            items = ["CPU:0"]
        else:
            dev = getattr(destinations, "device", None)
            if isinstance(dev, str):
                items = [dev]
            else:
                raise TypeError(
                    f"{what}: destinations must be a device string, a list of them, or a distributed "
                    f"value, got {type(destinations).__name__}"
                )
        out = []
        for d in items:
            if not isinstance(d, str):
                raise TypeError(f"{what}: destination devices must be strings, got {type(d).__name__}")
            try:
                out.append(parse_device(d))
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
        if not out:
            raise ValueError(f"{what}: destinations must not be empty")
        return out

    def _require_cross_replica(self, what: str) -> None:
        ctx = context.current_run_context()
        if ctx is not None:
            raise RuntimeError(
                f"{what} must be called in cross-replica context, not inside strategy.run (replica "
                f"{ctx.replica_id_in_sync_group}); inside run use ReplicaContext.all_reduce or "
                "all_gather, or reach cross-replica context with "
                "get_replica_context().merge_call(fn)"
            )

    # ---- hooks for strategies whose replicas span several processes ------------------------
    def _initial_value(self, value: np.ndarray, name: str, kind: str = "") -> np.ndarray:
        """The value a new distributed variable ``name`` (of ``kind``: its synchronization
        and aggregation) starts from (a multi-worker strategy gives every process the
        chief's)."""
        return value

    def _first_replica_value(self, part: Any, what: str, label: str = "") -> Any:
        """The first replica's value, given ``part``, this process's first replica's (a
        multi-worker strategy gives every process the chief's; ``label``: what the call is
        for, see ``Collectives.all_reduce``)."""
        return part

    def _every_replica_part(self, parts: Sequence[Any], what: str, label: str = "") -> List[Any]:
        """Every replica's part, in replica order, given this process's replicas' arrays
        ``parts`` (their sizes may differ along the first axis; a multi-worker strategy
        gathers every worker's; ``label``: what the call is for)."""
        return list(parts)

    # ---- running ---------------------------------------------------------------------------
    def call_for_each_replica(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        """``fn(*args, **kwargs)`` once per replica: the same as ``strategy.run``."""
        return self._call_for_each_replica(fn, args, kwargs)

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]
    ) -> Any:
        raise NotImplementedError

    # ---- variables ---------------------------------------------------------------------------
    def variable_created_in_scope(self, v: Any) -> bool:
        """True when ``v`` was created under this strategy's scope."""
        return (
            getattr(v, "_strategy", None) is self._container
            or getattr(getattr(v, "distribute_strategy", None), "extended", None) is self
        )

    def value_container(self, value: Any) -> Any:
        """The distributed variable holding ``value`` (one of its per-replica copies), or
        ``value`` itself."""
        ref = getattr(value, "_distributed_container", None)
        container = ref() if callable(ref) else None
        return container if container is not None else value

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(copy, *args, **kwargs)`` on each of ``var``'s per-replica copies (each
        getting its replica's part of distributed arguments) and returns the results,
        regrouped as a Mirrored (or as is, when every copy returned the same object).

        Inside ``strategy.run`` it meets the other replicas in ``merge_call`` first (their
        arguments become PerReplica values), as TensorFlow does, so every copy is updated
        once with its own replica's arguments and each replica gets its own result."""
        from .variables import DistributedVariable, Variable

        if kwargs is None:
            kwargs = {}
        ctx = context.current_run_context()
        if ctx is not None:
            if ctx._strategy is not self._container:
                raise RuntimeError(f"extended.update of {self._container!r} called inside the run of {ctx._strategy!r}")

            def merge_fn(strategy: Any, *merged_args: Any, **merged_kwargs: Any) -> Any:
                return self.update(var, fn, merged_args, merged_kwargs, group)

            return ctx.merge_call(merge_fn, args=tuple(args), kwargs=kwargs)
        if isinstance(var, DistributedVariable):
            copies = var.values
        elif isinstance(var, Variable):
            copies = (var,)
        else:
            raise TypeError(f"extended.update: var must be a variable, got {type(var).__name__}")
        return self._call_per_copy(
            len(copies),
            len(copies),
            lambda i, a, k: fn(copies[i], *a, **k),
            tuple(args),
            kwargs,
            group,
            "extended.update",
            isinstance(var, DistributedVariable),
        )

    def _call_per_copy(
        self,
        count: int,
        parts: int,
        call: Callable[[int, Tuple[Any, ...], Dict[str, Any]], Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        group: bool,
        what: str,
        in_update_copy: bool = True,
    ) -> Any:
        """``call(i, args_i, kwargs_i)`` for copies ``i`` < ``count``, with part ``i`` of
        distributed arguments (which must have ``parts`` parts), in copy ``i``'s update
        context (where the strategy's distributed variables, an optimizer's slots say, read
        and update their copy ``i`` only) or, without ``in_update_copy``, in cross-replica
        context; the results regrouped as a Mirrored (as is, when every call returned the
        same object), or their tuple without ``group``."""
        # Arguments without a per-replica value are the same for every copy: no walk.
        split_args = contains_distributed(args, parts, what)
        split_kwargs = contains_distributed(kwargs, parts, what)
        results = []
        for i in range(count):
            with context.UpdateCopy(self._container, i) if in_update_copy else context.CrossReplica(self._container):
                results.append(
                    call(
                        i,
                        select_replica(i, args) if split_args else args,
                        select_replica(i, kwargs) if split_kwargs else kwargs,
                    )
                )
        if not group:
            return tuple(results)
        return regroup(results, wrap=Mirrored, what=what)

    def colocate_vars_with(self, colocate_with_variable: Any) -> Any:
        """A context manager placing new variables with ``colocate_with_variable``: every
        distributed variable already has a copy on every replica's device, so there is
        nothing to move (accepted for TensorFlow code that asks)."""
        import contextlib

        return contextlib.nullcontext()

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn`` once per device of ``colocate_with`` (state that is not a variable's
        slot, such as an optimizer's step counter, kept on each of those devices), as
        TensorFlow does: call ``i`` in an update context for copy ``i`` (distributed
        variables read and update their copy ``i``), with the ``i``-th part of distributed
        arguments. Returns the results regrouped as a Mirrored (as is, when every call
        returned the same object), or their tuple when ``group`` is False."""
        self._require_cross_replica("extended.update_non_slot")
        devices = self._destinations(colocate_with, "extended.update_non_slot")  # never empty
        if len(devices) > self._n:
            raise ValueError(
                f"extended.update_non_slot: colocate_with must name 1 to {self._n} devices (see "
                f"non_slot_devices), got {len(devices)}"
            )
        return self._call_per_copy(
            len(devices),
            self._n,
            lambda i, a, k: fn(*a, **k),
            tuple(args),
            kwargs or {},
            group,
            "extended.update_non_slot",
        )

    def read_var(self, var: Any) -> Any:
        """The value of ``var`` in cross-replica context (aggregated for SyncOnRead)."""
        from .variables import Variable

        self._require_cross_replica("extended.read_var")
        if not isinstance(var, Variable):
            raise TypeError(f"extended.read_var: expected a variable, got {type(var).__name__}")
        return var.read_value()

    # ---- collectives (LocalExtended implements them) -------------------------------------------
    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a PerReplica, or a plain value present on every replica) with
        ``reduce_op`` onto ``destinations``: a Mirrored with one copy per destination
        device, or the value itself for one destination. ``options``: a
        CommunicationOptions (its ``implementation`` is the all-reduce algorithm).
        Cross-replica context only."""
        raise NotImplementedError

    def batch_reduce_to(
        self, reduce_op: Any, value_destination_pairs: Sequence[Tuple[Any, Any]], options: Any = None
    ) -> List[Any]:
        """``reduce_to`` for each (value, destinations) pair; the results, in the pairs'
        order. The distributed values are all-reduced together (small ones packed, one
        engine call per dtype), as TensorFlow fuses gradients."""
        raise NotImplementedError

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies a value that is not per-replica to every destination device: a Mirrored,
        or the value itself for one destination (ValueError for a PerReplica: reduce it
        first). Cross-replica context only."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases threads and engine groups."""
