"""Variables: state that a strategy keeps in sync across its replicas.

``Variable(initial_value, ...)`` outside any strategy scope (or under a
``OneDeviceStrategy``) is a plain single-copy variable. Under a ``MirroredStrategy``'s
scope it has one copy per replica (see ``distvals.distributed_variables``):

- ``MirroredVariable`` (synchronization ON_WRITE or AUTO): every update keeps the copies
  equal. In cross-replica context an update goes to every copy (a PerReplica argument is
  reduced by the aggregation first). Inside ``strategy.run`` the aggregation decides:
  NONE updates the replica's own copy only; SUM and MEAN all-reduce the replicas'
  arguments on the engine and apply the result to every copy; ONLY_FIRST_REPLICA applies
  replica 0's argument everywhere.
- ``SyncOnReadVariable`` (ON_READ): updates inside ``run`` touch the local copy only;
  reading in cross-replica context aggregates the copies (SUM, MEAN or the first copy);
  ``assign`` in cross-replica context stores about value/N per copy for SUM (split so
  that the copies sum to the value exactly, integers and floats alike), value for the
  others.

A variable created inside ``strategy.run`` is created once, from the first replica's
initial value, and every replica gets that same variable (as in TensorFlow).

A variable's value is an immutable snapshot: an update replaces the stored array, so a
value read earlier never changes under the reader.

Values keep the variable's dtype strictly: a value that does not convert exactly (a
Python float for an integer variable, a float array for an integer variable, an integer
outside the variable's range) is a TypeError, never silently truncated.

As in TensorFlow 2, ``v == x`` compares element-wise, so variables are unhashable; use
``v.ref()`` as a dict key or set member (``ref.deref()`` is the variable).

On GPU replicas each copy is a read-only ``distvals.cuda.DeviceArray`` on its replica's
GPU: reading a variable inside ``strategy.run`` gives the replica's DeviceArray, the
all-reduce of an update runs on the GPUs, and ``assign_add``/``assign_sub`` compute the
new value on the copy's GPU with the engine (sparse updates go through the host).
``numpy()``, ``repr`` and checkpoints copy the value to the host. Arithmetic operators on
such a variable are not offered (a DeviceArray has none): use ``numpy()``, or cupy/torch
on the value.
"""

from __future__ import annotations

import collections
import enum
import itertools
import operator
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Type, TypeVar, Union

import numpy as np

from . import context, devices, kinds, sparse, variable_slices
from ._convert import refuse_masked
from .errors import OutOfRangeError
from .fork_locks import renewed_after_fork
from .values import DistributedValues

if TYPE_CHECKING:
    from .cuda import DeviceArray

__all__ = [
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableRef",
    "VariableSynchronization",
]

_E = TypeVar("_E", bound=enum.Enum)


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


def _enum(value: Any, enum_type: Type[_E], what: str) -> _E:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str) and value.upper() in enum_type.__members__:
        return enum_type[value.upper()]
    name = getattr(value, "name", None)  # the same enum from TensorFlow
    if isinstance(name, str) and name.upper() in enum_type.__members__:
        return enum_type[name.upper()]
    raise ValueError(f"{what} must be one of {', '.join(enum_type.__members__)}, got {value!r}")


def _initial_array(initial_value: Any, dtype: Any, name: str) -> np.ndarray:
    from .data_elements import convert_leaf  # Python numbers convert as in TensorFlow

    if callable(initial_value):
        initial_value = initial_value()
    refuse_masked(initial_value, None, f"the initial value of variable '{name}'")
    if isinstance(initial_value, Variable):
        initial_value = initial_value.read_value()
    if devices.is_device_array(initial_value):
        # Placed on every replica's device later, from the host.
        initial_value = devices.to_host(initial_value)
    if dtype is not None:
        if _is_python_value(initial_value):
            # By the rules of assign: Variable(2.7, dtype="int32") is a TypeError, as in
            # TensorFlow, not a silent 2.
            src = np.asarray(initial_value)
            if src.dtype != np.dtype(dtype):
                _check_dtype(src, np.dtype(dtype), True, name, "the initial value")
        a = np.array(kinds.to_numpy(initial_value), dtype=np.dtype(dtype), copy=True)
    else:
        a = np.array(convert_leaf(initial_value, "Variable"), copy=True)
    if a.dtype == object:
        raise TypeError(f"Variable: cannot hold values of type {type(initial_value).__name__}")
    a.flags.writeable = False
    return a


def _static_shape(shape: Any, what: str) -> Optional[Tuple[Optional[int], ...]]:
    """A ``shape=`` argument as a tuple whose unknown dimensions are None (None for an
    unknown rank)."""
    if shape is None:
        return None
    dims = getattr(shape, "dims", shape)  # a tf.TensorShape
    if dims is None:
        return None
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    try:
        return tuple(None if d is None or getattr(d, "value", d) is None else int(getattr(d, "value", d)) for d in dims)
    except TypeError:
        raise TypeError(f"{what}: shape must be a sequence of ints (None for unknown), got {shape!r}") from None


# The shapes a variable's values may have: exactly its first value's (True), any that fit
# a shape with unknown (None) dimensions (that shape), or any (None).
ShapeRule = Union[Literal[True], Tuple[Optional[int], ...], None]


def _compatible(static: Optional[Tuple[Optional[int], ...]], shape: Tuple[int, ...]) -> bool:
    if static is None:
        return True
    return len(static) == len(shape) and all(s is None or s == d for s, d in zip(static, shape))


class _VariableMeta(type):
    """``Variable(...)`` picks the kind of variable the strategy in force wants."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            return _create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _create_variable(
    initial_value: Any = None,
    trainable: Optional[bool] = None,
    validate_shape: bool = True,
    caching_device: Any = None,
    name: Optional[str] = None,
    variable_def: Any = None,
    dtype: Any = None,
    import_scope: Any = None,
    constraint: Optional[Callable[[Any], Any]] = None,
    synchronization: Any = VariableSynchronization.AUTO,
    aggregation: Any = VariableAggregation.NONE,
    shape: Any = None,
    experimental_enable_variable_lifting: bool = True,
) -> Variable:
    # The signature is TensorFlow's, positions included, so that ported calls bind alike.
    if variable_def is not None or import_scope is not None:
        raise NotImplementedError(
            "Variable: variable_def and import_scope belong to TensorFlow graphs; "
            "create the variable from an initial_value"
        )
    if initial_value is None:
        raise ValueError("Variable: initial_value must be given")
    if constraint is not None and not callable(constraint):
        raise ValueError(f"Variable: constraint must be None or a callable, got {type(constraint).__name__}")
    sync = _enum(synchronization, VariableSynchronization, "synchronization")
    agg = _enum(aggregation, VariableAggregation, "aggregation")
    if trainable is None:
        # As in TensorFlow: ON_READ variables (metrics, counters) are not trained.
        trainable = sync is not VariableSynchronization.ON_READ
    base = "Variable" if name is None else str(name)
    if base.endswith(":0"):
        base = base[:-2]
    static = _static_shape(shape, f"Variable '{base}'")
    # A shape of unknown rank (tf.TensorShape(None)) lets assignments change the shape.
    any_shape = shape is not None and static is None
    spec = dict(
        trainable=bool(trainable),
        validate_shape=bool(validate_shape),
        name=base,
        dtype=dtype,
        constraint=constraint,
        synchronization=sync,
        aggregation=agg,
        static=static,
        any_shape=any_shape,
    )
    ctx = context.current_run_context()
    if ctx is not None:
        return _create_in_replica(ctx, initial_value, spec)
    return _create(_initial_array(initial_value, dtype, base), spec)


def _create_in_replica(ctx: context.ReplicaContext, initial_value: Any, spec: Dict[str, Any]) -> Variable:
    """Inside ``strategy.run``: every replica computes its initial value, then one
    variable is made (in cross-replica context, from the first replica's value) and every
    replica gets that same object, as TensorFlow's MirroredStrategy does."""
    from .values import PerReplica

    value = _initial_array(initial_value, spec["dtype"], spec["name"])

    def create(strategy: Any, first: Any) -> Variable:
        if isinstance(first, PerReplica):
            first = first.values[0]
        return _create(first, spec)

    var: Variable = ctx.merge_call(create, args=(value,))
    return var


def _create(value: np.ndarray, spec: Dict[str, Any]) -> Variable:
    from .distributed_variables import MirroredVariable, SyncOnReadVariable

    base, sync, agg = spec["name"], spec["synchronization"], spec["aggregation"]
    static = spec["static"]
    if not _compatible(static, value.shape):
        raise ValueError(f"Variable '{base}': initial value has shape {value.shape}, not the given shape {static}")
    strategy = context.get_strategy()
    ext = strategy.extended
    places = tuple(getattr(ext, "_places", ()))
    if len(places) != len(ext._devices):
        places = (None,) * len(ext._devices)
    # What later values' shapes must be: the first one's (True), fit a shape with
    # unknown dimensions (that shape), or anything (None).
    rule: ShapeRule = None
    if spec["validate_shape"] and not spec["any_shape"]:
        rule = True if static is None or None not in static else static
    common: Dict[str, Any] = dict(
        trainable=spec["trainable"], aggregation=agg, constraint=spec["constraint"], initial=value, shape_rule=rule
    )
    if not context.has_strategy() or not getattr(ext, "_distributed_variables", False):
        single: Variable = type.__call__(
            Variable, _placed(value, places[0]), name=base, synchronization=sync, device=ext._devices[0], **common
        )
        return single
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
    if sync is VariableSynchronization.AUTO:
        sync = VariableSynchronization.ON_WRITE  # what AUTO means for a mirrored variable, as TF reports
    value = ext._initial_value(value, base, f"synchronization {sync.name}, aggregation {agg.name}")
    common["initial"] = value
    copies: List[Variable] = []
    for r, device in enumerate(ext._devices):
        copy_name = base if r == 0 else f"{base}/replica_{r}"
        if places[r] is not None:
            stored = _placed(value, places[r])
        else:
            stored = value if r == 0 else value.copy()
            stored.flags.writeable = False
        copies.append(type.__call__(Variable, stored, name=copy_name, synchronization=sync, device=device, **common))
    kind = SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable
    container: DistributedVariable = type.__call__(kind, strategy, tuple(copies), base, sync, agg, spec["trainable"])
    container._constraint = spec["constraint"]
    # Its number among the strategy's variables: every worker creates them in one order
    # (their creation is agreed above), so it names this one in the calls between them.
    container._serial = ext._variables_made
    ext._variables_made += 1
    container._initial = value
    container._shape_rule = rule
    ref = weakref.ref(container)
    for c in copies:
        # extended.value_container(copy) finds the variable from any of its copies.
        c._distributed_container = ref
    return container


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


class VariableRef:
    """A hashable reference to a variable (``v.ref()``): equal references name the same
    variable; ``deref()`` gives it back."""

    __slots__ = ("_variable",)

    def __init__(self, variable: Variable) -> None:
        self._variable = variable

    def deref(self) -> Variable:
        return self._variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableRef) and other._variable is self._variable

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __repr__(self) -> str:
        return f"<Reference wrapping {self._variable!r}>"


def _equal(a: Any, b: Any, ufunc: Any) -> Any:
    """Element-wise comparison, as TensorFlow's: shapes that do not broadcast compare
    unequal (one False, or True for ``!=``) instead of raising; None cannot be compared."""
    if b is None:
        raise ValueError("Attempt to compare a variable with None, which is not a value")
    b = _unwrap(b)
    try:
        return ufunc(devices.to_host(a), b)
    except ValueError:
        return np.bool_(ufunc is np.not_equal)


class Variable(metaclass=_VariableMeta):
    """A mutable value: ``Variable(initial_value, trainable=None, validate_shape=True,
    caching_device=None, name=None, variable_def=None, dtype=None, import_scope=None,
    constraint=None, synchronization=AUTO, aggregation=NONE, shape=None)``, TensorFlow's
    signature.

    ``initial_value`` may be an array-like or a callable returning one; Python floats
    become float32 and ints int32, as in TensorFlow. ``trainable`` defaults to True (False
    for ON_READ). ``shape`` may leave dimensions unknown (None), and with
    ``validate_shape=False`` assignments may change the shape. Under a
    ``MirroredStrategy``'s scope this returns a ``MirroredVariable`` or (ON_READ) a
    ``SyncOnReadVariable``; inside ``strategy.run`` it creates one shared variable.

    ``v == x`` is element-wise (as in TensorFlow 2), so variables are unhashable: use
    ``v.ref()`` as a dict key.
    """

    # A copy's stored value: a read-only numpy array, or a read-only DeviceArray for a
    # copy on a GPU.
    _value: Union[np.ndarray, DeviceArray]
    _trainable: bool
    _name: str
    _synchronization: VariableSynchronization
    _aggregation: VariableAggregation
    _device: str
    _constraint: Optional[Callable[[Any], Any]]
    _initial: np.ndarray
    _shape_rule: ShapeRule
    # Set on the copies of a distributed variable (see extended.value_container).
    _distributed_container: weakref.ref[DistributedVariable]

    if TYPE_CHECKING:
        # ``Variable(...)`` goes through _VariableMeta to _create_variable: this is the
        # signature its callers see. (distvals makes the copies with the one below.)
        def __init__(
            self,
            initial_value: Any = None,
            trainable: Optional[bool] = None,
            validate_shape: bool = True,
            caching_device: Any = None,
            name: Optional[str] = None,
            variable_def: Any = None,
            dtype: Any = None,
            import_scope: Any = None,
            constraint: Optional[Callable[[Any], Any]] = None,
            synchronization: Any = VariableSynchronization.AUTO,
            aggregation: Any = VariableAggregation.NONE,
            shape: Any = None,
            experimental_enable_variable_lifting: bool = True,
        ) -> None: ...

    else:

        def __init__(
            self,
            value: Union[np.ndarray, DeviceArray],
            *,
            trainable: bool,
            name: str,
            synchronization: VariableSynchronization,
            aggregation: VariableAggregation,
            device: str,
            constraint: Optional[Callable[[Any], Any]] = None,
            initial: Optional[np.ndarray] = None,
            shape_rule: ShapeRule = True,
        ) -> None:
            self._value = value
            self._trainable = bool(trainable)
            self._name = name
            self._synchronization = synchronization
            self._aggregation = aggregation
            self._device = device
            self._constraint = constraint
            self._initial = value if initial is None else initial
            self._shape_rule = shape_rule
            # Replica threads may update one variable at once (a plain variable, or a
            # copy of a distributed one): each read-modify-write is made whole under it,
            # as TensorFlow's updates hold the variable's lock. (A forked child gets a
            # new one: a parent's thread may have held it at the fork.)
            self._lock = renewed_after_fork(self)

    # ---- reading ------------------------------------------------------------------------
    def _read(self) -> Any:
        return self._value

    def value(self) -> Any:
        """The current value (a read-only array that later updates leave alone): a numpy
        array, or a DeviceArray for a copy on a GPU."""
        return self._read()

    def read_value(self) -> Any:
        """The current value, as ``value()``; for a SyncOnReadVariable in cross-replica
        context, the aggregate of its copies."""
        return self._read()

    def numpy(self) -> Any:
        """A writable host copy of the value (a numpy scalar for a 0-d variable)."""
        a = np.array(devices.to_host(self.read_value()), copy=True)
        return a[()] if a.ndim == 0 else a

    def sparse_read(self, indices: Any, name: Any = None) -> Any:
        """The rows ``indices`` of the value (along its first axis)."""
        return self._on_home(sparse.take_rows(devices.to_host(self.read_value()), indices, "sparse_read"))

    def gather_nd(self, indices: Any, name: Any = None) -> Any:
        """The value gathered at ``indices``, whose last axis addresses the leading axes
        (``tf.gather_nd``)."""
        return self._on_home(sparse.gather_nd(devices.to_host(self.read_value()), indices, "gather_nd"))

    def _on_home(self, host: np.ndarray) -> Any:
        # A read of a GPU copy stays on that GPU.
        current = self.read_value()
        if isinstance(current, np.ndarray) or not devices.can_place(host.dtype):
            return host
        return devices.to_replica_device(host, devices.place_of(current))

    @property
    def name(self) -> str:
        """The name with TensorFlow's output suffix, e.g. "v:0" ("Variable:0" by default;
        a distributed variable's copies after the first are "v/replica_1:0", ...)."""
        return f"{self._name}:0"

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape of the current value, a tuple of ints. It is fixed unless the variable
        was made with ``validate_shape=False`` or a ``shape`` with unknown dimensions; then
        assigning a value of another shape changes it."""
        return tuple(self._read_meta().shape)

    def get_shape(self) -> Tuple[int, ...]:
        """The shape (as ``shape``)."""
        return self.shape

    def set_shape(self, shape: Any) -> None:
        """Checks that ``shape`` (None for unknown dimensions) is compatible with the
        variable's; a variable's shape only changes by assignment."""
        static = _static_shape(shape, f"set_shape of variable '{self.name}'")
        if not _compatible(static, self.shape):
            raise ValueError(
                f"set_shape of variable '{self.name}': shape {static} is not compatible with the "
                f"variable's shape {self.shape}"
            )

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype, fixed at creation: every update converts to it exactly or
        raises TypeError."""
        return self._read_meta().dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions of the value (``len(shape)``)."""
        return self._read_meta().ndim

    def _read_meta(self) -> Union[np.ndarray, DeviceArray]:
        return self._value

    @property
    def initial_value(self) -> np.ndarray:
        """The value the variable was created with (read-only)."""
        return self._initial

    @property
    def constraint(self) -> Optional[Callable[[Any], Any]]:
        """The ``constraint`` given at creation (optimizers apply it after each update)."""
        return self._constraint

    @property
    def trainable(self) -> bool:
        """Whether optimizers should train the variable (by default True, and False for
        ON_READ variables such as metrics, as in TensorFlow)."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """When the copies are synchronized (a VariableSynchronization); AUTO reads as
        ON_WRITE on a MirroredVariable, as TensorFlow reports it."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How the replicas' updates inside ``strategy.run`` combine (a
        VariableAggregation), and for an ON_READ variable how its copies combine when read
        in cross-replica context."""
        return self._aggregation

    @property
    def device(self) -> str:
        """Where this copy lives, e.g. "/job:localhost/replica:0/task:0/device:CPU:0"."""
        return "/job:localhost/replica:0/task:0/device:" + self._device

    def ref(self) -> VariableRef:
        """A hashable reference to this variable (``deref()`` gives it back)."""
        return VariableRef(self)

    def experimental_ref(self) -> VariableRef:
        """TensorFlow's older name of ``ref``."""
        return self.ref()

    def __copy__(self) -> Variable:
        """The variable itself, as TensorFlow's copy.copy of a variable (a shallow copy
        that updates would leave behind is never what a caller wants); copy.deepcopy
        makes an independent variable."""
        return self

    # Deep copies and pickles get a lock of their own (a lock cannot be pickled or shared).
    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = renewed_after_fork(self)

    # ---- updating -----------------------------------------------------------------------
    def _coerce(self, value: Any, what: str) -> Any:
        if isinstance(value, DistributedValues):
            raise TypeError(
                f"{what} of variable '{self.name}': got a {type(value).__name__}; a single-copy "
                "variable takes a plain value"
            )
        return coerce_value(self, _unwrap(value), what)

    def _coerce_update(self, kind: str, value: Any) -> Any:
        """The checked argument of an update: a dense value, or a SparseDelta for the
        scatter kinds (whose raw argument is (indices, updates) for scatter_nd)."""
        if kind in sparse.SCATTER_KINDS:
            return coerce_sparse(self, kind, value)
        return self._coerce(value, kind)

    def _apply(self, kind: str, value: Any) -> None:
        # `value` is already checked and of this variable's dtype and shape.
        with self._lock:
            self._apply_unlocked(kind, value)

    def _apply_unlocked(self, kind: str, value: Any) -> None:
        self._value = self._new_value(kind, value)

    def _new_value(self, kind: str, value: Any) -> Any:
        """The value after update ``kind`` with ``value`` (checked, of this variable's
        dtype and shape); the variable itself does not change."""
        if isinstance(value, sparse.SparseDelta):
            new = sparse.apply_sparse(kind, devices.to_host(self._value), value)
            new.flags.writeable = False
            return _placed(new, devices.place_of(self._value)) if not isinstance(self._value, np.ndarray) else new
        if not isinstance(self._value, np.ndarray):
            # A copy on a GPU: the new value is computed there (see distvals.devices).
            return devices.freeze(_device_update(kind, self._value, value))
        if not isinstance(value, np.ndarray):
            value = devices.to_host(value)
        if kind == "assign":
            new = np.array(value, copy=True)
        elif kind == "assign_add":
            new = np.asarray(self._value + value, dtype=self._value.dtype)
        else:
            new = np.asarray(self._value - value, dtype=self._value.dtype)
        # `new` is always a fresh array (a copy, or a ufunc's result): it shares memory
        # with neither the old value nor the caller's.
        new.flags.writeable = False
        return new

    def _update(self, kind: str, value: Any, read_value: bool) -> Any:
        self._apply(kind, self._coerce_update(kind, value))
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

    # The scatter family: rows of the first axis, from an IndexedSlices(values, indices).
    def scatter_update(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Sets rows ``sparse_delta.indices`` to ``sparse_delta.values``."""
        updated: Variable = self._update("scatter_update", sparse_delta, True)
        return updated

    def scatter_add(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Adds ``sparse_delta.values`` to rows ``sparse_delta.indices`` (repeats add up)."""
        updated: Variable = self._update("scatter_add", sparse_delta, True)
        return updated

    def scatter_sub(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Subtracts ``sparse_delta.values`` from rows ``sparse_delta.indices`` (a repeated
        index subtracts each of its updates); returns the variable."""
        updated: Variable = self._update("scatter_sub", sparse_delta, True)
        return updated

    def scatter_mul(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Multiplies rows ``sparse_delta.indices`` by ``sparse_delta.values`` (a repeated
        index multiplies by each of its updates); returns the variable."""
        updated: Variable = self._update("scatter_mul", sparse_delta, True)
        return updated

    def scatter_div(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Divides rows (integers truncate toward zero, as TensorFlow's kernel)."""
        updated: Variable = self._update("scatter_div", sparse_delta, True)
        return updated

    def scatter_min(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Sets rows ``sparse_delta.indices`` to their element-wise minimum with
        ``sparse_delta.values``; returns the variable."""
        updated: Variable = self._update("scatter_min", sparse_delta, True)
        return updated

    def scatter_max(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Variable:
        """Sets rows ``sparse_delta.indices`` to their element-wise maximum with
        ``sparse_delta.values``; returns the variable."""
        updated: Variable = self._update("scatter_max", sparse_delta, True)
        return updated

    # scatter_nd: indices[..., :K] address the first K axes.
    def scatter_nd_update(self, indices: Any, updates: Any, name: Any = None) -> Variable:
        """Sets the elements (or slices) that ``indices`` address to ``updates``, as
        ``tf.Variable.scatter_nd_update``; returns the variable."""
        updated: Variable = self._update("scatter_nd_update", (indices, updates), True)
        return updated

    def scatter_nd_add(self, indices: Any, updates: Any, name: Any = None) -> Variable:
        """Adds ``updates`` to the elements (or slices) that ``indices`` address (repeats add
        up); returns the variable."""
        updated: Variable = self._update("scatter_nd_add", (indices, updates), True)
        return updated

    def scatter_nd_sub(self, indices: Any, updates: Any, name: Any = None) -> Variable:
        """Subtracts ``updates`` from the elements (or slices) that ``indices`` address
        (repeats subtract each update); returns the variable."""
        updated: Variable = self._update("scatter_nd_sub", (indices, updates), True)
        return updated

    def scatter_nd_min(self, indices: Any, updates: Any, name: Any = None) -> Variable:
        """Sets the elements (or slices) that ``indices`` address to their element-wise
        minimum with ``updates``; returns the variable."""
        updated: Variable = self._update("scatter_nd_min", (indices, updates), True)
        return updated

    def scatter_nd_max(self, indices: Any, updates: Any, name: Any = None) -> Variable:
        """Sets the elements (or slices) that ``indices`` address to their element-wise
        maximum with ``updates``; returns the variable."""
        updated: Variable = self._update("scatter_nd_max", (indices, updates), True)
        return updated

    def count_up_to(self, limit: int) -> np.ndarray:
        """Adds 1 and returns the value from before, or raises OutOfRangeError once the
        value has reached ``limit`` (integer variables; the +1 follows the rules of
        ``assign_add``)."""
        self._check_counter()
        # The read, the check and the +1 make one step: replica threads counting on one
        # variable never pass the limit together.
        with self._lock:
            old = np.asarray(devices.to_host(self._value))
            if old >= limit:
                raise OutOfRangeError(f"count_up_to of variable '{self.name}': reached limit of {limit}")
            self._apply_unlocked("assign_add", np.ones((), self.dtype))
        return old

    def _check_counter(self) -> None:
        if self.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise TypeError(
                f"count_up_to of variable '{self.name}': needs an int32 or int64 variable, got {self.dtype}"
            )

    # ---- behaving as the value ------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        a = self.read_value()
        if copy:
            return np.array(a, dtype=dtype, copy=True)
        return np.asarray(a, dtype=dtype)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(_unwrap(x) for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    # ``v += x`` would rebind the name to a new array and leave the variable as it was
    # (what a torch user expects to update a parameter in place): an error, as
    # TensorFlow's for its variables.
    def _in_place(self, op: str, method: str) -> Any:
        raise RuntimeError(
            f"variable {op} value: variable '{self.name}' would stay as it is and the name would be rebound to "
            f"a new array; use variable.{method}(value) to update it, or out = variable {op[:-1]} value for a new array"
        )

    def __iadd__(self, o: Any) -> Any:
        return self._in_place("+=", "assign_add")

    def __isub__(self, o: Any) -> Any:
        return self._in_place("-=", "assign_sub")

    def __imul__(self, o: Any) -> Any:
        return self._in_place("*=", "assign")

    def __itruediv__(self, o: Any) -> Any:
        return self._in_place("/=", "assign")

    def __ifloordiv__(self, o: Any) -> Any:
        return self._in_place("//=", "assign")

    def __imod__(self, o: Any) -> Any:
        return self._in_place("%=", "assign")

    def __ipow__(self, o: Any) -> Any:
        return self._in_place("**=", "assign")

    def __imatmul__(self, o: Any) -> Any:
        return self._in_place("@=", "assign")

    def __add__(self, o: Any) -> Any:
        return self.read_value() + _unwrap(o)

    def __radd__(self, o: Any) -> Any:
        return _unwrap(o) + self.read_value()

    def __sub__(self, o: Any) -> Any:
        return self.read_value() - _unwrap(o)

    def __rsub__(self, o: Any) -> Any:
        return _unwrap(o) - self.read_value()

    def __mul__(self, o: Any) -> Any:
        return self.read_value() * _unwrap(o)

    def __rmul__(self, o: Any) -> Any:
        return _unwrap(o) * self.read_value()

    def __truediv__(self, o: Any) -> Any:
        return self.read_value() / _unwrap(o)

    def __rtruediv__(self, o: Any) -> Any:
        return _unwrap(o) / self.read_value()

    def __floordiv__(self, o: Any) -> Any:
        return self.read_value() // _unwrap(o)

    def __rfloordiv__(self, o: Any) -> Any:
        return _unwrap(o) // self.read_value()

    def __mod__(self, o: Any) -> Any:
        return self.read_value() % _unwrap(o)

    def __rmod__(self, o: Any) -> Any:
        return _unwrap(o) % self.read_value()

    def __pow__(self, o: Any) -> Any:
        return self.read_value() ** _unwrap(o)

    def __rpow__(self, o: Any) -> Any:
        return _unwrap(o) ** self.read_value()

    def __matmul__(self, o: Any) -> Any:
        return self.read_value() @ _unwrap(o)

    def __rmatmul__(self, o: Any) -> Any:
        return _unwrap(o) @ self.read_value()

    def __and__(self, o: Any) -> Any:
        return self.read_value() & _unwrap(o)

    def __rand__(self, o: Any) -> Any:
        return _unwrap(o) & self.read_value()

    def __or__(self, o: Any) -> Any:
        return self.read_value() | _unwrap(o)

    def __ror__(self, o: Any) -> Any:
        return _unwrap(o) | self.read_value()

    def __xor__(self, o: Any) -> Any:
        return self.read_value() ^ _unwrap(o)

    def __rxor__(self, o: Any) -> Any:
        return _unwrap(o) ^ self.read_value()

    def __lt__(self, o: Any) -> Any:
        return self.read_value() < _unwrap(o)

    def __le__(self, o: Any) -> Any:
        return self.read_value() <= _unwrap(o)

    def __gt__(self, o: Any) -> Any:
        return self.read_value() > _unwrap(o)

    def __ge__(self, o: Any) -> Any:
        return self.read_value() >= _unwrap(o)

    def __neg__(self) -> Any:
        return -self.read_value()

    def __pos__(self) -> Any:
        return +self.read_value()

    def __abs__(self) -> Any:
        return abs(self.read_value())

    def __invert__(self) -> Any:
        return ~self.read_value()

    def __getitem__(self, key: Any) -> Any:
        # The part, which can write itself back: ``v[2:5].assign(x)`` (variable_slices).
        return variable_slices.slice_of(self, self.read_value(), key)

    def __iter__(self) -> Any:
        # Over the value's rows, as numpy and TensorFlow iterate; a 0-d value raises
        # TypeError (without this, Python's old protocol would call __getitem__ until an
        # IndexError and see a scalar as an empty sequence: sum(v) == 0, x in v False).
        return iter(self.read_value())

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __complex__(self) -> complex:
        return complex(self.read_value())

    def __index__(self) -> int:
        # An integer variable of one element as an index (lst[v], range(v)), as numpy's
        # integer arrays are; TypeError for others.
        return operator.index(self.read_value())

    def __bool__(self) -> bool:
        return bool(self.read_value())

    def __eq__(self, o: object) -> Any:
        return _equal(self.read_value(), o, np.equal)

    def __ne__(self, o: object) -> Any:
        return _equal(self.read_value(), o, np.not_equal)

    def __hash__(self) -> int:
        raise TypeError(
            f"Variable is unhashable (== compares values); use variable.ref() as the key. (Variable: {self.name})"
        )

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


def _is_python_value(value: Any) -> bool:
    """True for Python numbers and (nested) lists/tuples of them: values that TensorFlow
    converts to the variable's dtype by value rules."""
    if isinstance(value, (bool, int, float, complex)):
        return not isinstance(value, np.generic)  # np.float64 is a float, but numpy's
    if isinstance(value, (list, tuple)):
        return all(_is_python_value(v) for v in value)
    return False


def _check_dtype(a: Any, dtype: np.dtype, python: bool, name: str, what: str) -> None:
    """TypeError when ``a`` does not convert to ``dtype`` exactly."""
    src = a.dtype
    if src.hasobject:
        raise TypeError(f"{what} of variable '{name}': cannot use a value of type {src} for a {dtype} variable")
    if python:
        # As TensorFlow's conversion of Python values: a float never becomes an integer
        # (not even 2.0), a complex never becomes a real.
        if (src.kind == "f" and dtype.kind in "iub") or (src.kind == "c" and dtype.kind != "c"):
            raise TypeError(
                f"{what} of variable '{name}': cannot convert a Python {'float' if src.kind == 'f' else 'complex'} "
                f"to {dtype}"
            )
    elif not np.can_cast(src, dtype, casting="same_kind"):
        raise TypeError(f"{what} of variable '{name}': cannot use a {src} value for a {dtype} variable")
    if src.kind in "iu" and dtype.kind in "iu" and a.size and not np.can_cast(src, dtype, casting="safe"):
        # Narrowing integers: every value must fit (device values are looked at on the
        # host: a cast there would wrap 300 to 44 in int8).
        host = devices.to_host(a)
        info = np.iinfo(dtype)
        lo, hi = host.min(), host.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise TypeError(f"{what} of variable '{name}': {bad} does not fit in {dtype}")


def _coerce_dtype(var: Any, value: Any, what: str) -> Any:
    """``value`` as an array of ``var``'s dtype (device arrays stay where they are)."""
    refuse_masked(value, None, f"{what} of variable '{var.name}'")
    dtype = var.dtype
    python = _is_python_value(value)
    if python:
        a = np.asarray(value)
    else:
        a = devices.as_value(value)
    if a.dtype != dtype:
        _check_dtype(a, dtype, python, var.name, what)
        a = devices.cast(a, dtype)
    return a


def shape_allowed(var: Any, shape: Tuple[int, ...]) -> bool:
    """Whether ``var`` may take a value of ``shape`` (see ``ShapeRule``)."""
    rule: ShapeRule = var._shape_rule
    if rule is None:
        return True
    if isinstance(rule, tuple):
        return _compatible(rule, tuple(shape))
    return tuple(shape) == tuple(var.shape)


def shape_text(var: Any) -> str:
    """The shapes ``var`` takes, for an error message."""
    rule: ShapeRule = var._shape_rule
    return f"{var.shape}" if rule is True else f"{tuple(var.shape)} (declared {rule})"


def coerce_value(var: Any, value: Any, what: str) -> Any:
    a = _coerce_dtype(var, value, what)
    if not shape_allowed(var, tuple(a.shape)):
        raise ValueError(
            f"{what} of variable '{var.name}': value has shape {tuple(a.shape)}, the variable {shape_text(var)}"
        )
    return a


def commit_copies(copies: Sequence[Variable], kind: str, values: Sequence[Any]) -> None:
    """Updates every copy of a distributed variable (copy i with ``values[i]``) as one
    change: the new values are computed first (an error or Ctrl-C there changes
    nothing), then set in one loop of C calls, which no signal handler can interrupt
    half-way (they run between bytecodes). So a failed or interrupted update leaves the
    copies equal: all updated, or none."""
    # The copies share one lock (see DistributedVariable): another thread's update, of
    # every copy or of one, never lands between the reads below and the writes, where
    # it would be lost on some copies and kept on others.
    with copies[0]._lock:
        news = [c._new_value(kind, v) for c, v in zip(copies, values)]
        collections.deque(map(setattr, copies, itertools.repeat("_value"), news), maxlen=0)


def coerce_sparse(var: Any, kind: str, value: Any) -> sparse.SparseDelta:
    if isinstance(value, sparse.SparseDelta):
        return value
    # (_coerce_dtype names the variable itself: it gets the update's kind alone.)
    coerce = lambda v, what: _coerce_dtype(var, _unwrap(v), kind)  # noqa: E731
    if kind.startswith("scatter_nd_"):
        indices, updates = value
        return sparse.nd_delta(indices, updates, var.shape, coerce, f"{kind} of variable '{var.name}'")
    return sparse.sparse_delta(value, var.shape, coerce, f"{kind} of variable '{var.name}'")


# The distributed kinds live in their own module; they are part of this one's API.
from .distributed_variables import DistributedVariable, MirroredVariable, SyncOnReadVariable  # noqa: E402
