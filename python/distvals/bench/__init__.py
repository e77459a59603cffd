"""The distvals all-reduce benchmark: ``python -m distvals.bench``.

A table in the style of nccl-tests (size, count, dtype, op, algorithm, median time,
algbw, busbw, percentage of the memory bound, wrong elements) for CPU replicas in one
process, every result checked against a float64 reference in the same run; with
``--compare``, numpy, TensorFlow MirroredStrategy, torch.distributed (gloo) and mpi4py
(Open MPI) side by side, each run as a subprocess, with speed-ups, ``--json`` and
``--plot``.
"""

from .cli import main

__all__ = ["main"]
