"""Variables: state that a strategy keeps in sync across its replicas.

``Variable(initial_value, ...)`` outside any strategy scope (or under a
``OneDeviceStrategy``) is a plain single-copy variable. Under a ``MirroredStrategy``'s
scope it has one copy per replica:

- ``MirroredVariable`` (synchronization ON_WRITE or AUTO): every update keeps the copies
  equal. In cross-replica context an update goes to every copy (a PerReplica argument is
  reduced by the aggregation first). Inside ``strategy.run`` the aggregation decides:
  NONE updates the replica's own copy only; SUM and MEAN all-reduce the replicas'
  arguments on the engine and apply the result to every copy; ONLY_FIRST_REPLICA applies
  replica 0's argument everywhere.
- ``SyncOnReadVariable`` (ON_READ): updates inside ``run`` touch the local copy only;
  reading in cross-replica context aggregates the copies (SUM, MEAN or the first copy);
  ``assign`` in cross-replica context stores value/N per copy for SUM, value for the
  others.

A variable's value is an immutable snapshot: an update replaces the stored array, so a
value read earlier never changes under the reader.

On GPU replicas each copy is a read-only ``distvals.cuda.DeviceArray`` on its replica's
GPU: reading a variable inside ``strategy.run`` gives the replica's DeviceArray, the
all-reduce of an update runs on the GPUs, and ``assign_add``/``assign_sub`` compute the
new value on the copy's GPU with the engine. ``numpy()``, ``repr`` and checkpoints copy
the value to the host. Arithmetic operators on such a variable are not offered (a
DeviceArray has none): use ``numpy()``, or cupy/torch on the value.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Tuple

import numpy as np

from . import context, devices, kinds
from .reduce_op import ReduceOp
from .values import DistributedValues, Mirrored, PerReplica

__all__ = [
    "Variable",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableSynchronization",
    "VariableAggregation",
]


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronized."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How the replicas' updates (or, for ON_READ, their copies) combine."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


def _enum(value: Any, enum_type, what: str):
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str) and value.upper() in enum_type.__members__:
        return enum_type[value.upper()]
    name = getattr(value, "name", None)  # the same enum from TensorFlow
    if isinstance(name, str) and name.upper() in enum_type.__members__:
        return enum_type[name.upper()]
    raise ValueError(f"{what} must be one of {', '.join(enum_type.__members__)}, got {value!r}")


def _initial_array(initial_value: Any, dtype: Any) -> np.ndarray:
    from .data import _convert_leaf  # Python numbers convert as in TensorFlow

    if callable(initial_value):
        initial_value = initial_value()
    if isinstance(initial_value, Variable):
        initial_value = initial_value.read_value()
    if devices.is_device_array(initial_value):
        # Placed on every replica's device later, from the host.
        initial_value = devices.to_host(initial_value)
    if dtype is not None:
        a = np.array(kinds.to_numpy(initial_value), dtype=np.dtype(dtype), copy=True)
    else:
        a = np.array(_convert_leaf(initial_value, "Variable"), copy=True)
    if a.dtype == object:
        raise TypeError(f"Variable: cannot hold values of type {type(initial_value).__name__}")
    a.flags.writeable = False
    return a


class _VariableMeta(type):
    """``Variable(...)`` picks the kind of variable the strategy in force wants."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is Variable:
            return _create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _create_variable(initial_value: Any = None, trainable: bool = True, name: Optional[str] = None,
                     dtype: Any = None, synchronization: Any = VariableSynchronization.AUTO,
                     aggregation: Any = VariableAggregation.NONE, shape: Any = None) -> "Variable":
    if initial_value is None:
        raise ValueError("Variable: initial_value must be given")
    sync = _enum(synchronization, VariableSynchronization, "synchronization")
    agg = _enum(aggregation, VariableAggregation, "aggregation")
    base = "Variable" if name is None else str(name)
    if base.endswith(":0"):
        base = base[:-2]
    ctx = context.current_run_context()
    if ctx is not None:
        raise RuntimeError(
            f"replica {ctx.replica_id_in_sync_group}: create variables in cross-replica context, "
            "under strategy.scope() and outside strategy.run"
        )
    strategy = context.get_strategy()
    ext = strategy.extended
    value = _initial_array(initial_value, dtype)
    if shape is not None and tuple(shape) != value.shape:
        raise ValueError(f"Variable '{base}': initial value has shape {value.shape}, not the given shape {tuple(shape)}")
    places = tuple(getattr(ext, "_places", ()))
    if len(places) != len(ext._devices):
        places = (None,) * len(ext._devices)
    if not context.has_strategy() or not getattr(ext, "_distributed_variables", False):
        return type.__call__(Variable, _placed(value, places[0]), trainable=trainable, name=base,
                             synchronization=sync, aggregation=agg, device=ext._devices[0])
    if sync is VariableSynchronization.NONE:
        raise ValueError(
            f"Variable '{base}': synchronization NONE is not supported under a distribution strategy; "
            "use AUTO, ON_WRITE or ON_READ"
        )
    if agg is VariableAggregation.MEAN and value.dtype.kind not in "fc" and value.dtype.name != "bfloat16":
        raise ValueError(
            f"Variable '{base}': aggregation MEAN needs a floating dtype, got {value.dtype}; use SUM or "
            "a float variable"
        )
    value = ext._initial_value(value)
    copies = []
    for r, device in enumerate(ext._devices):
        copy_name = base if r == 0 else f"{base}/replica_{r}"
        if places[r] is not None:
            stored = _placed(value, places[r])
        else:
            stored = value if r == 0 else value.copy()
            stored.flags.writeable = False
        copies.append(type.__call__(Variable, stored, trainable=trainable, name=copy_name, synchronization=sync,
                                    aggregation=agg, device=device))
    kind = SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable
    return type.__call__(kind, strategy, tuple(copies), base, sync, agg, trainable)


def _placed(value: np.ndarray, place: Any) -> Any:
    """The initial value as a copy's stored value: the host array itself for a CPU copy,
    a read-only DeviceArray on the GPU for a GPU copy (dtypes a GPU cannot hold stay on
    the host)."""
    if place is None or not devices.can_place(value.dtype):
        return value
    return devices.freeze(devices.to_replica_device(value, place))


def _unwrap(o: Any) -> Any:
    if isinstance(o, DistributedValues):
        o = o._current()
    if isinstance(o, Variable):
        return o._read()
    return o


class Variable(metaclass=_VariableMeta):
    """A mutable value: ``Variable(initial_value, trainable=True, name=None, dtype=None,
    synchronization=AUTO, aggregation=NONE)``.

    ``initial_value`` may be an array-like or a callable returning one; Python floats
    become float32 and ints int32, as in TensorFlow. Under a ``MirroredStrategy``'s scope
    this returns a ``MirroredVariable`` or (ON_READ) a ``SyncOnReadVariable``.

    Equality and hashing are by identity (so variables can be dict keys); compare values
    with ``v.numpy() == x``.
    """

    def __init__(self, value: np.ndarray, *, trainable: bool, name: str, synchronization: VariableSynchronization,
                 aggregation: VariableAggregation, device: str) -> None:
        self._value = value
        self._trainable = bool(trainable)
        self._name = name
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._device = device

    # ---- reading ------------------------------------------------------------------------
    def _read(self) -> np.ndarray:
        return self._value

    def value(self) -> np.ndarray:
        """The current value (a read-only array that later updates leave alone)."""
        return self._read()

    def read_value(self) -> np.ndarray:
        """The current value, as ``value()``; for a SyncOnReadVariable in cross-replica
        context, the aggregate of its copies."""
        return self._read()

    def numpy(self) -> Any:
        """A writable host copy of the value (a numpy scalar for a 0-d variable)."""
        a = np.array(devices.to_host(self.read_value()), copy=True)
        return a[()] if a.ndim == 0 else a

    @property
    def name(self) -> str:
        return f"{self._name}:0"

    @property
    def shape(self) -> Tuple[int, ...]:
        return self._read_meta().shape

    @property
    def dtype(self) -> np.dtype:
        return self._read_meta().dtype

    @property
    def ndim(self) -> int:
        return self._read_meta().ndim

    def _read_meta(self) -> np.ndarray:
        return self._value

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def device(self) -> str:
        """Where this copy lives, e.g. "/job:localhost/replica:0/task:0/device:CPU:0"."""
        return "/job:localhost/replica:0/task:0/device:" + self._device

    # ---- updating -----------------------------------------------------------------------
    def _coerce(self, value: Any, what: str) -> np.ndarray:
        if isinstance(value, DistributedValues):
            raise TypeError(
                f"{what} of variable '{self.name}': got a {type(value).__name__}; a single-copy "
                "variable takes a plain value"
            )
        return _coerce_value(self, _unwrap(value), what)

    def _apply(self, kind: str, value: Any) -> None:
        # `value` is already checked and of this variable's dtype and shape.
        if not isinstance(self._value, np.ndarray):
            # A copy on a GPU: the new value is computed there (see distvals.devices).
            self._value = devices.freeze(_device_update(kind, self._value, value))
            return
        if not isinstance(value, np.ndarray):
            value = devices.to_host(value)
        if kind == "assign":
            new = np.array(value, copy=True)
        elif kind == "assign_add":
            new = np.asarray(self._value + value, dtype=self._value.dtype)
        else:
            new = np.asarray(self._value - value, dtype=self._value.dtype)
        if new is self._value or np.shares_memory(new, value):
            new = new.copy()
        new.flags.writeable = False
        self._value = new

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        self._apply(kind, self._coerce(value, kind))
        return self if read_value else None

    def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        """Sets the value; returns the variable (None with ``read_value=False``)."""
        return self._update("assign", value, read_value)

    def assign_add(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        """Adds ``delta``; returns the variable (None with ``read_value=False``)."""
        return self._update("assign_add", delta, read_value)

    def assign_sub(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        """Subtracts ``delta``; returns the variable (None with ``read_value=False``)."""
        return self._update("assign_sub", delta, read_value)

    # ---- behaving as the value ------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        a = self.read_value()
        if copy:
            return np.array(a, dtype=dtype, copy=True)
        return np.asarray(a, dtype=dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(_unwrap(x) for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __add__(self, o): return self.read_value() + _unwrap(o)
    def __radd__(self, o): return _unwrap(o) + self.read_value()
    def __sub__(self, o): return self.read_value() - _unwrap(o)
    def __rsub__(self, o): return _unwrap(o) - self.read_value()
    def __mul__(self, o): return self.read_value() * _unwrap(o)
    def __rmul__(self, o): return _unwrap(o) * self.read_value()
    def __truediv__(self, o): return self.read_value() / _unwrap(o)
    def __rtruediv__(self, o): return _unwrap(o) / self.read_value()
    def __floordiv__(self, o): return self.read_value() // _unwrap(o)
    def __rfloordiv__(self, o): return _unwrap(o) // self.read_value()
    def __mod__(self, o): return self.read_value() % _unwrap(o)
    def __rmod__(self, o): return _unwrap(o) % self.read_value()
    def __pow__(self, o): return self.read_value() ** _unwrap(o)
    def __rpow__(self, o): return _unwrap(o) ** self.read_value()
    def __matmul__(self, o): return self.read_value() @ _unwrap(o)
    def __rmatmul__(self, o): return _unwrap(o) @ self.read_value()
    def __lt__(self, o): return self.read_value() < _unwrap(o)
    def __le__(self, o): return self.read_value() <= _unwrap(o)
    def __gt__(self, o): return self.read_value() > _unwrap(o)
    def __ge__(self, o): return self.read_value() >= _unwrap(o)
    def __neg__(self): return -self.read_value()
    def __pos__(self): return +self.read_value()
    def __abs__(self): return abs(self.read_value())
    def __getitem__(self, key): return self.read_value()[key]
    def __float__(self): return float(self.read_value())
    def __int__(self): return int(self.read_value())

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        a = devices.to_host(self._value)
        shown = repr(a.item()) if a.ndim == 0 else repr(a)
        return f"<{type(self).__name__} '{self.name}' shape={a.shape} dtype={a.dtype}, numpy={shown}>"


def _device_update(kind: str, current: Any, value: Any) -> Any:
    """The new value of a GPU copy holding ``current``."""
    if kind == "assign":
        return devices.to_replica_device(value, devices.place_of(current), copy=True)
    if kind == "assign_add":
        return devices.add(current, value)
    return devices.subtract(current, value)


def _coerce_value(var: Any, value: Any, what: str) -> Any:
    dtype, shape = var.dtype, var.shape
    # A device array stays where it is (as a DeviceArray); anything else becomes numpy.
    a = devices.as_value(value)
    if tuple(a.shape) != shape:
        raise ValueError(f"{what} of variable '{var.name}': value has shape {tuple(a.shape)}, the variable {shape}")
    if a.dtype != dtype:
        python_number = not isinstance(value, (np.ndarray, np.generic)) and not devices.is_device_array(value)
        if not python_number and not np.can_cast(a.dtype, dtype, casting="same_kind"):
            raise TypeError(f"{what} of variable '{var.name}': cannot use a {a.dtype} value for a {dtype} variable")
        a = devices.cast(a, dtype)
    return a


class DistributedVariable(DistributedValues, Variable):
    """A variable with one copy (a ``Variable``) per replica; ``.values`` are the copies."""

    _select_whole = True

    def __init__(self, strategy: Any, copies: Tuple[Variable, ...], name: str,
                 synchronization: VariableSynchronization, aggregation: VariableAggregation, trainable: bool) -> None:
        DistributedValues.__init__(self, copies)
        self._strategy = strategy
        self._name = name
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._trainable = trainable
        self._n = len(copies)

    @property
    def distribute_strategy(self) -> Any:
        return self._strategy

    @property
    def device(self) -> str:
        return self._local_copy().device

    def _read_meta(self) -> np.ndarray:
        return self._values[0]._value

    def _replica_context(self) -> Optional[context.ReplicaContext]:
        """This strategy's replica context when called inside its ``run``."""
        ctx = context.current_run_context()
        if ctx is not None and ctx._strategy is self._strategy:
            return ctx
        if ctx is not None:
            raise RuntimeError(
                f"variable '{self.name}' belongs to {self._strategy!r}, not to the strategy running now "
                f"({ctx._strategy!r})"
            )
        return None

    def _local_copy(self) -> Variable:
        ctx = self._replica_context()
        return self._values[ctx._replica_id if ctx is not None else 0]

    def _current(self):
        ctx = self._replica_context()
        if ctx is not None:
            return self._values[ctx._replica_id]
        return self._cross_replica_part()

    def _read(self) -> Any:
        part = self._current()
        return part._read() if isinstance(part, Variable) else part

    def value(self) -> np.ndarray:
        return self._read()

    def read_value(self) -> np.ndarray:
        return self._read()

    def _coerce_parts(self, value: Any, what: str) -> np.ndarray:
        return _coerce_value(self, _unwrap(value), what)

    def __repr__(self) -> str:
        return DistributedValues.__repr__(self)

    def __str__(self) -> str:
        return DistributedValues.__str__(self)


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable whose copies are kept equal by every update (see the module doc)."""

    def _cross_replica_part(self):
        return self._values[0]

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        ctx = self._replica_context()
        agg = self._aggregation
        if ctx is None:
            self._update_cross_replica(kind, value)
            return self if read_value else None
        r = ctx._replica_id
        if agg is VariableAggregation.NONE or self._strategy.num_replicas_in_sync == 1:
            self._values[r]._apply(kind, self._coerce_parts(value, kind))
            return self if read_value else None
        ext = self._strategy.extended
        local = self._coerce_parts(value, kind)
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            result = ext._replica_broadcast(ctx, local)
        else:
            op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
            # The resolver refuses a SUM update that got the very same plain object on
            # every replica: it would count it once per replica.
            result = ext._replica_update_all_reduce(ctx, self.name, kind, op, local, value)
        self._values[r]._apply(kind, devices.cast(devices.as_value(result), self.dtype))
        return self if read_value else None

    def _update_cross_replica(self, kind: str, value: Any) -> None:
        if isinstance(value, PerReplica) or (isinstance(value, DistributedVariable) and isinstance(value, SyncOnReadVariable)):
            if isinstance(value, PerReplica):
                value = self._aggregate(value, kind)
            else:
                value = value.read_value()
        elif isinstance(value, DistributedValues):
            value = value.values[0]
        coerced = self._coerce_parts(value, kind)
        for c in self._values:
            c._apply(kind, coerced)

    def _aggregate(self, value: PerReplica, kind: str) -> Any:
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"{kind} of variable '{self.name}' got a PerReplica value in cross-replica context, but the "
                "variable's aggregation is NONE; create it with aggregation SUM, MEAN or ONLY_FIRST_REPLICA, "
                "or reduce the value first"
            )
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            return value.values[0]
        op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        return self._strategy.reduce(op, value, axis=None)


class SyncOnReadVariable(DistributedVariable):
    """A variable whose copies are combined only when read in cross-replica context
    (see the module doc)."""

    def _cross_replica_part(self):
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._values[0]._value
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"cannot read SyncOnReadVariable '{self.name}' in cross-replica context: its aggregation is "
                "NONE; read its copies with .values, or create it with SUM, MEAN or ONLY_FIRST_REPLICA"
            )
        op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        parts = [c._value for c in self._values]
        out = self._strategy.extended._reduce_one(op, PerReplica(tuple(parts)), None, "read")
        # A DeviceArray on the first replica's GPU for GPU copies (see distvals.cuda_collectives).
        out = devices.cast(devices.as_value(out), self.dtype)
        return devices.freeze(np.asarray(out) if isinstance(out, np.ndarray) else out)

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        ctx = self._replica_context()
        if ctx is not None:
            self._values[ctx._replica_id]._apply(kind, self._coerce_parts(value, kind))
            return self if read_value else None
        agg = self._aggregation
        if isinstance(value, PerReplica):
            if len(value.values) != self._n:
                raise ValueError(f"{kind} of variable '{self.name}': a PerReplica with {len(value.values)} values "
                                 f"for {self._n} copies")
            parts = [self._coerce_parts(v, kind) for v in value.values]
            for c, p in zip(self._values, parts):
                c._apply(kind, p)
            return self if read_value else None
        if kind != "assign" and agg is VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable '{self.name}' with aggregation SUM does not support {kind} in "
                "cross-replica context (the change could not be split across the copies); use assign"
            )
        coerced = self._coerce_parts(value, kind)
        if kind == "assign" and agg is VariableAggregation.SUM:
            # Keep the sum: each copy stores value/N (cast back to the dtype, as TF does).
            coerced = np.asarray(devices.to_host(coerced) / self._strategy.num_replicas_in_sync).astype(self.dtype)
        for c in self._values:
            c._apply(kind, coerced)
        return self if read_value else None
