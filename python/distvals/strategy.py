"""Strategies: ``MirroredStrategy``, ``OneDeviceStrategy`` and the default strategy.

A strategy owns N replicas (one per device), a runner that calls the replica function
once per replica (inline coroutines or threads, see ``execution``), and one
implementation of the collectives (see ``distvals.collectives``). ``run`` calls a
function once per replica; ``reduce``, ``gather`` and the ``extended`` methods combine
per-replica values in cross-replica context.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

from . import context, nest
from .device_names import canonical_devices
from .extended import StrategyExtended
from .local_extended import LocalExtended
from .options import CommunicationOptions, CrossDeviceOps
from .reduce_op import as_reduce_op
from .values import DistributedValues, contains_distributed, regroup

if TYPE_CHECKING:  # pragma: no cover
    from .input import DistributedDataset, DistributedDatasetsFromFunction, InputContext, ValueContext

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "RunOptions", "Strategy", "StrategyExtended"]


class RunOptions:
    """Options of ``strategy.run`` (TensorFlow's ``tf.distribute.RunOptions``).

    ``experimental_enable_dynamic_batch_size`` and ``experimental_bucketizing_dynamic_shape``
    are accepted and change nothing (there is no graph to compile); ``experimental_xla_options``
    and ``experimental_xla_sharding`` are refused by ``run`` with NotImplementedError."""

    def __init__(
        self,
        experimental_enable_dynamic_batch_size: bool = True,
        experimental_bucketizing_dynamic_shape: bool = False,
        experimental_xla_options: Any = None,
    ) -> None:
        self.experimental_enable_dynamic_batch_size = experimental_enable_dynamic_batch_size
        self.experimental_bucketizing_dynamic_shape = experimental_bucketizing_dynamic_shape
        self.experimental_xla_options = experimental_xla_options

    def __repr__(self) -> str:
        return (
            f"RunOptions(experimental_enable_dynamic_batch_size={self.experimental_enable_dynamic_batch_size}, "
            f"experimental_bucketizing_dynamic_shape={self.experimental_bucketizing_dynamic_shape})"
        )


def _check_run_options(options: Any) -> None:
    if options is None:
        return
    if not isinstance(options, RunOptions):
        raise TypeError(f"strategy.run: options must be a distvals.RunOptions, got {type(options).__name__}")
    if options.experimental_xla_options is not None:
        raise NotImplementedError("strategy.run: RunOptions.experimental_xla_options has no meaning without XLA")


class Strategy:
    """Distributes computation over a set of replicas (the tf.distribute.Strategy API)."""

    # experimental_distribute_values_from_function gives the plain value (strategies of
    # one device that are not a MirroredStrategy).
    _plain_values = False

    def __init__(self, extended: LocalExtended) -> None:
        self._extended = extended

    @property
    def extended(self) -> LocalExtended:
        """The strategy's lower-level interface (``reduce_to``, ``update``, ``read_var``,
        ``worker_devices``, ...), as ``tf.distribute.Strategy.extended``."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step."""
        return self._extended._n

    def scope(self) -> ContextManager[Strategy]:
        """A context manager making this the current strategy (cross-replica context);
        variables created inside are distributed. Entering another strategy's scope
        inside it is an error."""
        return context._Scope(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        options: Optional[RunOptions] = None,
    ) -> Any:
        """Calls ``fn(*args, **kwargs)`` once per replica.

        DistributedValues anywhere in ``args``/``kwargs`` (lists, tuples, dicts,
        namedtuples) are replaced by each replica's part. Returns the results in the
        same structure with PerReplica leaves; a leaf that is the very same object on
        every replica (a Python number or string too) is returned as it is. An exception
        in any replica releases the others and is raised here, prefixed with the
        replica's id, the original chained. The whole step is bounded by
        ``CommunicationOptions.timeout_seconds`` (300 s by default).
        """
        if options is not None:
            _check_run_options(options)
        return self._extended._call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: Optional[int] = None) -> Any:
        """Combines per-replica values into one (cross-replica context only).

        ``axis=None``: element-wise across replicas. With an axis, SUM (MIN, MAX,
        PRODUCT) reduces inside each replica along it, then across; MEAN is the global
        mean over all elements along the axis (replicas weigh by their count). A
        non-distributed value: MEAN (MIN, MAX) returns it, SUM with several replicas is
        an error. Integer MEAN gives float64 (float32 for 8- and 16-bit integers, as
        TensorFlow's division). Nested structures are reduced leaf by leaf. IndexedSlices
        parts (SUM or MEAN, axis=None) give one IndexedSlices of every replica's rows, as
        ``ReplicaContext.all_reduce`` does.
        The result is in the parts' framework (numpy, torch, cupy, JAX); on GPU replicas
        device parts give a device array on the first replica's GPU.
        """
        ext = self._extended
        ext._require_cross_replica("strategy.reduce")
        op = as_reduce_op(reduce_op)
        if nest.is_nested(value):
            if axis is None:
                fused = ext._reduce_structure(op, value, "strategy.reduce")
                if fused is not None:
                    return fused
            ext._agree_structure("strategy.reduce", value)
            return nest.map_structure(lambda v: ext._reduce_one(op, v, axis, "strategy.reduce"), value)
        return ext._reduce_one(op, value, axis, "strategy.reduce")

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' parts along ``axis`` (sizes may differ along it
        only); a non-distributed value is returned as an array. Nested structures too."""
        ext = self._extended
        ext._require_cross_replica("strategy.gather")
        if nest.is_nested(value):
            return nest.map_structure(lambda v: ext._gather_one(v, axis, "strategy.gather"), value)
        return ext._gather_one(value, axis, "strategy.gather")

    def experimental_local_results(self, value: Any) -> Tuple[Any, ...]:
        """The per-replica parts of ``value`` as a tuple (``(value,)`` for a plain value;
        for a nested structure, one structure per replica, also when no leaf is
        distributed, as in TensorFlow)."""
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        n = self._extended._n
        if nest.is_nested(value):
            contains_distributed(value, n, "experimental_local_results")
            return tuple(_select_all(r, value) for r in range(n))
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> DistributedDataset:
        """Splits every global batch of ``dataset`` over the replicas (see
        ``distvals.input.DistributedDataset``)."""
        from .input import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: Any = None
    ) -> DistributedDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext)`` and hands consecutive elements of the
        dataset it returns to consecutive replicas."""
        from .input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: Any = None
    ) -> DistributedDatasetsFromFunction:
        """TensorFlow's older name of ``distribute_datasets_from_function``."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """A PerReplica of ``value_fn(ValueContext(replica_id, num_replicas))`` per replica
        (always a PerReplica, also when every replica gets the same object; the plain
        value on a ``OneDeviceStrategy`` and the default strategy, as in TensorFlow)."""
        from .input import ValueContext, place_element
        from .values import PerReplica

        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
        ext = self._extended
        n = ext._n
        values = [value_fn(ValueContext(r, n)) for r in range(n)]
        if self._plain_values:
            return values[0]
        if getattr(ext, "_on_gpu", False):
            # Array leaves go to their replica's GPU, as a dataset's batches do.
            values = [place_element(v, ext._places[r], r) for r, v in enumerate(values)]
        if not nest.is_nested(values[0]):
            return PerReplica(tuple(values))
        return regroup(values, what="experimental_distribute_values_from_function", always_wrap=True)

    def close(self) -> None:
        """Stops the replica threads and the engine group (optional: both also go when the
        strategy is garbage collected). Idempotent; a closed strategy refuses to run."""
        self._extended.close()

    def __enter__(self) -> Strategy:
        """``with MirroredStrategy(...) as s:`` closes ``s`` at the end of the block (it does
        not enter the strategy's scope: use ``s.scope()`` for that)."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._extended._devices)!r})"

    def __deepcopy__(self, memo: Dict[int, Any]) -> Strategy:
        """A strategy of its own with this one's configuration, as deep-copying a
        ``tf.distribute`` strategy gives one: the same class, devices, cross-device ops,
        communication options and execution mode, with its own engine group and replicas
        (the copy runs steps independently of the original; closing one leaves the other
        open). Attributes a subclass added are deep-copied too. Variables made under the
        original stay with it."""
        cls = type(self)
        result = cls.__new__(cls)
        memo[id(self)] = result
        self._init_copy(result, memo)
        for k, v in self.__dict__.items():
            if k != "_extended":
                setattr(result, k, copy.deepcopy(v, memo))
        return result

    def _init_copy(self, result: Strategy, memo: Dict[int, Any]) -> None:
        """Makes ``result`` (a bare instance of this class) a new strategy with this one's
        configuration."""
        raise TypeError(f"{type(self).__name__} cannot be deep-copied")


def _select_all(r: int, value: Any) -> Any:
    # Like select_replica, but variables give their copy too (inspection, not running).
    if isinstance(value, DistributedValues):
        return value.values[r]
    if nest.is_nested(value):
        return nest.pack_sequence_as(value, [_select_all(r, x) for x in nest.flatten(value)])
    return value


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the replicas of one process.

    ``devices``: e.g. ``["CPU:0", "CPU:1"]`` (any number of CPU replicas; "/cpu:1" and
    full names such as "/job:localhost/replica:0/task:0/device:CPU:1" work too); None
    means every GPU when there are any, else the logical CPUs of
    ``distvals.config.set_logical_cpus`` (one by default). Duplicates are an error.
    ``cross_device_ops``: ``CollectiveAllReduce(algorithm)`` (default) or
    ``ReductionToOneDevice(reduce_to_device)``. ``communication_options``:
    ``CommunicationOptions`` (its ``timeout_seconds`` bounds every collective and every
    step; default 300 s).

    ``execution``: how the replica functions of ``run`` execute.

    - ``"inline"``: every replica is a coroutine on the calling thread; a replica runs
      until it reaches a collective (or ``merge_call``, an aggregated variable update),
      the collective runs once for all replicas, and each resumes with its result. No
      thread hand-offs: the fastest for steps of numpy work and collectives. Replicas
      must not wait for one another outside the strategy's collectives (an Event set by
      another replica): the timeout then ends the step with an error.
    - ``"threads"``: one thread per replica, so Python code of different replicas
      overlaps where it releases the GIL (long numpy operations, I/O).
    - ``"auto"`` (default): inline (threads when greenlet is not installed). GPU
      replicas always run inline.

    GPU replicas: ``MirroredStrategy(["GPU:0", "GPU:1"])`` (a strategy's replicas are all
    CPUs or all GPUs). ``"GPU:k"`` is a logical GPU (``distvals.config.set_logical_gpus``
    lets several replicas share one GPU, each with its own stream); the replicas keep
    the CUDA devices they had when the strategy was made. Values distributed by the
    strategy (datasets, ``experimental_distribute_values_from_function``, variables)
    are ``distvals.cuda.DeviceArray`` objects on each replica's GPU; cupy arrays and
    torch CUDA tensors are accepted wherever a value is and come back in their own
    framework. A DeviceArray has no arithmetic: compute with cupy or torch
    (``cupy.asarray(x)`` views it without a copy) or copy it with ``.numpy()``.
    """

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        cross_device_ops: Optional[CrossDeviceOps] = None,
        communication_options: Optional[CommunicationOptions] = None,
        execution: str = "auto",
    ) -> None:
        devs = canonical_devices(devices, "MirroredStrategy")
        super().__init__(
            LocalExtended(self, devs, cross_device_ops, communication_options, "MirroredStrategy", execution=execution)
        )
        self._extended._distributed_variables = True

    @property
    def execution(self) -> str:
        """ "inline" or "threads": how this strategy runs its replicas."""
        return self._extended.execution

    def _init_copy(self, result: Strategy, memo: Dict[int, Any]) -> None:
        ext = self._extended
        MirroredStrategy.__init__(
            result,  # type: ignore[arg-type]
            list(ext._devices),
            copy.deepcopy(ext._cross_device_ops, memo),
            copy.deepcopy(ext._options, memo),
            execution=ext.execution,
        )


class OneDeviceStrategy(Strategy):
    """Everything on one device: ``run`` calls the function once, in a replica context;
    variables are plain single-copy variables."""

    def __init__(self, device: str) -> None:
        if not isinstance(device, str):
            raise TypeError(f"OneDeviceStrategy: device must be a device string, got {type(device).__name__}")
        devs = canonical_devices([device], "OneDeviceStrategy")
        super().__init__(LocalExtended(self, devs, None, None, "OneDeviceStrategy", make_group=False))

    _plain_values = True

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self._extended._devices[0]!r})"

    def _init_copy(self, result: Strategy, memo: Dict[int, Any]) -> None:
        OneDeviceStrategy.__init__(result, self._extended._devices[0])  # type: ignore[arg-type]


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica, on the calling thread."""

    _plain_values = True

    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self))

    def scope(self) -> ContextManager[Strategy]:
        return context._NullScope()

    def close(self) -> None:
        """Nothing to close: the default strategy has no threads and lives as long as the
        process (closing it would break every later call outside a scope)."""

    def __repr__(self) -> str:
        return "DefaultStrategy()"

    def __deepcopy__(self, memo: Dict[int, Any]) -> Strategy:
        """The default strategy itself: there is one per process."""
        return self


class _DefaultExtended(LocalExtended):
    def __init__(self, container_strategy: Strategy) -> None:
        super().__init__(container_strategy, ["CPU:0"], None, None, "default strategy", make_group=False)
        # Its run happens in the default replica context.
        self._contexts = (context.ReplicaContext(container_strategy, 0, _in_run=False, _num_replicas=1),)
        self._entries = (self._contexts[0]._entry,)


context.default_strategy_factory = _DefaultStrategy
