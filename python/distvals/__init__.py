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
from .input import DistributedDataset, DistributedIterator, InputContext, ValueContext
from .input_options import InputOptions, InputReplicationMode
from .options import (
    CollectiveAllReduce,
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
)
from .reduce_op import ReduceOp
from .cross_device_compat import HierarchicalCopyAllReduce, NcclAllReduce
from .strategy import MirroredStrategy, OneDeviceStrategy, RunOptions, Strategy, StrategyExtended
from .multi_worker import MultiWorkerMirroredStrategy
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from .sparse import IndexedSlices
from .specs import TensorSpec
from .checkpoint import load_variables, save_variables
from . import experimental

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
    "experimental",
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "ReduceOp",
    "Strategy",
    "StrategyExtended",
    "RunOptions",
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
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "DistributedDataset",
    "DistributedIterator",
    "TensorSpec",
    "IndexedSlices",
    "Variable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableSynchronization",
    "VariableAggregation",
    "save_variables",
    "load_variables",
]
