"""``distvals.data.Options``: the options of a dataset, as ``tf.data.Options`` has them.

A pipeline written for tf.data sets its options and calls ``with_options``; the same
lines run here. One option changes what distvals does: ``experimental_distribute.
auto_shard_policy``, which says how ``MultiWorkerMirroredStrategy.
experimental_distribute_dataset`` divides a dataset between the workers (see
``AutoShardPolicy``). The others are accepted and kept, with the types tf.data checks,
and change nothing, except two that tf.data honours too: ``experimental_optimization.
map_and_batch_fusion = False`` (or ``apply_default_optimizations = False`` without it)
stops a batch right after a map from failing whole when the map fails for one element.
distvals' datasets make their elements one at a time, in order, on the thread that
asks, so they are always deterministic and use no thread pool.

As in tf.data: every option starts unset (its default); setting one that does not exist
is an ``AttributeError``, a value of the wrong type a ``TypeError``; ``with_options``
merges, an option set later winning over one set before, and an unset one changing
nothing; the options a dataset returns from ``options()`` cannot be changed (set new ones
with ``with_options``).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Dict, Tuple

__all__ = [
    "AutoShardPolicy",
    "AutotuneAlgorithm",
    "AutotuneOptions",
    "DistributeOptions",
    "ExternalStatePolicy",
    "OptimizationOptions",
    "Options",
    "ThreadingOptions",
]


class AutoShardPolicy(enum.IntEnum):
    """How ``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` divides a
    dataset between the workers (tf.data.experimental.AutoShardPolicy, same values).

    - ``AUTO`` (the default) and ``DATA``: every worker reads the same dataset, and each
      global batch is split over every worker's replicas; each worker keeps its own
      replicas' rows (tf.data's DATA: "each worker will process the whole dataset and
      discard the portion that is not for itself").
    - ``OFF``: no sharding; each worker reads its own copy of the dataset (the whole of
      it, or the part the worker selected itself, with ``shard`` say). The rows of a
      worker's batches are re-batched as tf.data does it: piece sizes cycle through the
      split of the first batch's size B over the ``num_replicas_in_sync`` replicas
      (the first B mod N one row larger), each worker starting at its first replica's
      size, and the worker's replicas take consecutive pieces; so every step takes B
      rows across the workers, and with equal replica counts a batch lasts as many
      steps as there are workers.
    - ``FILE``: distvals' datasets read no files to divide, so a multi-worker strategy
      refuses it (tf.data raises when it finds no files).
    - ``HINT``: not supported; a multi-worker strategy refuses it. Shard inside
      ``distribute_datasets_from_function`` instead.

    A single-process strategy has one worker and nothing to divide: it accepts every
    policy and changes nothing, as TensorFlow's MirroredStrategy does.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class AutotuneAlgorithm(enum.IntEnum):
    """tf.data.experimental.AutotuneAlgorithm (accepted; nothing is tuned)."""

    DEFAULT = 0
    HILL_CLIMB = 1
    GRADIENT_DESCENT = 2
    MAX_PARALLELISM = 3
    STAGE_BASED = 4


class ExternalStatePolicy(enum.IntEnum):
    """tf.data.experimental.ExternalStatePolicy (accepted; distvals checkpoints no
    dataset state)."""

    WARN = 0
    IGNORE = 1
    FAIL = 2


class _OptionGroup:
    """A set of typed options, each unset (None, or a default group) until given a value;
    frozen once a dataset holds it."""

    #: name -> (type, default); a group-typed option defaults to a new, empty group.
    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = {}
    #: Other names for the same option (tf.data's deprecated spellings).
    _ALIASES: ClassVar[Dict[str, str]] = {}

    def __init__(self) -> None:
        values: Dict[str, Any] = {}
        for name, (kind, default) in self._FIELDS.items():
            values[name] = kind() if issubclass(kind, _OptionGroup) else default
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_frozen", False)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        name = self._ALIASES.get(name, name)
        if values is None or name not in values:
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        name = self._ALIASES.get(name, name)
        field = self._FIELDS.get(name)
        if field is None:
            raise AttributeError(f"Cannot set the property {name} on {type(self).__name__}.")
        if self._frozen:
            raise ValueError(
                f"the {type(self).__name__} a dataset returns from options() cannot be changed (changing them would "
                "have no effect); set options with dataset.with_options(options)"
            )
        kind = field[0]
        if not isinstance(value, kind):  # (a bool is an int, to tf.data too)
            raise TypeError(
                f'Property "{name}" of {type(self).__name__} must be of type {kind.__name__}, got: {value!r} '
                f"(type: {type(value).__name__})"
            )
        self._values[name] = value

    def _set_fields(self) -> Dict[str, Any]:
        """The options given a value (groups: those with anything set)."""
        out = {}
        for name, value in self._values.items():
            if isinstance(value, _OptionGroup):
                if value._set_fields():
                    out[name] = value
            elif value is not None and value != self._FIELDS[name][1]:
                out[name] = value
        return out

    def _merged(self, other: _OptionGroup) -> Any:
        """A new group: this one's options, with those ``other`` sets in their place."""
        out = type(self)()
        for name, value in self._values.items():
            theirs = other._values[name]
            if isinstance(value, _OptionGroup):
                out._values[name] = value._merged(theirs)
            elif theirs is not None and theirs != self._FIELDS[name][1]:
                out._values[name] = theirs
            else:
                out._values[name] = value
        return out

    def _freeze(self) -> Any:
        for value in self._values.values():
            if isinstance(value, _OptionGroup):
                value._freeze()
        object.__setattr__(self, "_frozen", True)
        return self

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._set_fields() == other._set_fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __dir__(self) -> Any:
        return sorted(set(super().__dir__()) | set(self._FIELDS) | set(self._ALIASES))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._set_fields().items())
        return f"{type(self).__name__}({inner})"


class DistributeOptions(_OptionGroup):
    """tf.data.experimental.DistributeOptions: ``auto_shard_policy`` (an
    ``AutoShardPolicy``, default AUTO) and ``num_devices``."""

    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = {
        "auto_shard_policy": (AutoShardPolicy, AutoShardPolicy.AUTO),
        "num_devices": (int, None),
    }


class ThreadingOptions(_OptionGroup):
    """tf.data.ThreadingOptions (accepted; distvals' datasets use no threads)."""

    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = {
        "max_intra_op_parallelism": (int, None),
        "private_threadpool_size": (int, None),
    }


class AutotuneOptions(_OptionGroup):
    """tf.data.experimental.AutotuneOptions (accepted; nothing is tuned)."""

    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = {
        "enabled": (bool, None),
        "cpu_budget": (int, None),
        "ram_budget": (int, None),
        "autotune_algorithm": (AutotuneAlgorithm, None),
        "initial_parallelism": (int, None),
        "min_parallelism": (int, None),
    }


class OptimizationOptions(_OptionGroup):
    """tf.data.experimental.OptimizationOptions (accepted; distvals' pipelines are not
    rewritten, but ``map_and_batch_fusion = False`` and ``apply_default_optimizations =
    False`` turn off the fused map-and-batch failure, as in tf.data)."""

    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = dict.fromkeys(
        (
            "apply_default_optimizations",
            "filter_fusion",
            "filter_parallelization",
            "inject_prefetch",
            "map_and_batch_fusion",
            "map_and_filter_fusion",
            "map_fusion",
            "map_parallelization",
            "noop_elimination",
            "parallel_batch",
            "seq_interleave_prefetch",
            "shuffle_and_repeat_fusion",
        ),
        (bool, None),
    )


class Options(_OptionGroup):
    """tf.data.Options: set its options, then ``dataset.with_options(options)``. (Not
    ``experimental_service``: there is no tf.data service.)"""

    _FIELDS: ClassVar[Dict[str, Tuple[type, Any]]] = {
        "autotune": (AutotuneOptions, None),
        "dataset_name": (str, None),
        "deterministic": (bool, None),
        "experimental_distribute": (DistributeOptions, None),
        "experimental_external_state_policy": (ExternalStatePolicy, None),
        "experimental_optimization": (OptimizationOptions, None),
        "experimental_slack": (bool, None),
        "experimental_symbolic_checkpoint": (bool, None),
        "experimental_warm_start": (bool, None),
        "framework_type": (list, None),
        "threading": (ThreadingOptions, None),
    }
    _ALIASES: ClassVar[Dict[str, str]] = {
        "experimental_deterministic": "deterministic",
        "experimental_threading": "threading",
    }

    def merge(self, options: Options) -> Options:
        """New options: these, with those ``options`` sets in their place."""
        if not isinstance(options, Options):
            raise TypeError(f"Options.merge: options must be distvals.data.Options, got {type(options).__name__}")
        merged: Options = self._merged(options)
        return merged


def fuses_map_and_batch(options: Options) -> bool:
    """Whether a batch right after a map fails whole when the map fails (tf.data's
    map-and-batch fusion, a default optimization): unless ``options`` turn it off."""
    opt = options.experimental_optimization
    if opt.map_and_batch_fusion is not None:
        return bool(opt.map_and_batch_fusion)
    return opt.apply_default_optimizations is not False
