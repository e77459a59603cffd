"""distvals: tf.distribute-style synchronous data parallelism on a C++ collective engine."""

from ._core import __version__
from .errors import AbortedError, ClosedError, CollectiveTimeoutError, CudaError, MismatchError
from .group import ReplicaGroup
from . import config, cuda, data
from .context import (
    ReplicaContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from .input import InputContext, InputOptions, ValueContext
from .options import (
    CollectiveAllReduce,
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
)
from .reduce_op import ReduceOp
from .strategy import MirroredStrategy, OneDeviceStrategy, Strategy, StrategyExtended
from .multi_worker import MultiWorkerMirroredStrategy
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from .checkpoint import load_variables, save_variables

__all__ = [
    "__version__",
    "AbortedError",
    "ClosedError",
    "CollectiveTimeoutError",
    "CudaError",
    "MismatchError",
    "ReplicaGroup",
    "config",
    "cuda",
    "data",
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "ReduceOp",
    "Strategy",
    "StrategyExtended",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "MultiWorkerMirroredStrategy",
    "ReplicaContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "experimental_set_strategy",
    "CommunicationOptions",
    "CommunicationImplementation",
    "CrossDeviceOps",
    "CollectiveAllReduce",
    "ReductionToOneDevice",
    "InputContext",
    "InputOptions",
    "ValueContext",
    "Variable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableSynchronization",
    "VariableAggregation",
    "save_variables",
    "load_variables",
]
