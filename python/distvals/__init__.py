"""distvals: tf.distribute-style synchronous data parallelism on a C++ collective engine."""

from . import config, cuda, data, experimental
from ._core import __version__
from .checkpoint import load_variables, save_variables
from .context import (
    ReplicaContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from .cross_device_compat import HierarchicalCopyAllReduce, NcclAllReduce
from .errors import AbortedError, ClosedError, CollectiveTimeoutError, CudaError, MismatchError
from .group import ReplicaGroup
from .input import DistributedDataset, DistributedIterator, InputContext, ValueContext
from .input_options import InputOptions, InputReplicationMode
from .multi_worker import MultiWorkerMirroredStrategy
from .options import (
    CollectiveAllReduce,
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
)
from .reduce_op import ReduceOp
from .sparse import IndexedSlices
from .specs import TensorSpec
from .strategy import MirroredStrategy, OneDeviceStrategy, RunOptions, Strategy, StrategyExtended
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)

__all__ = [
    "AbortedError",
    "ClosedError",
    "CollectiveAllReduce",
    "CollectiveTimeoutError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "CudaError",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MismatchError",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "ReplicaGroup",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "TensorSpec",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "__version__",
    "config",
    "cuda",
    "data",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "load_variables",
    "save_variables",
]
