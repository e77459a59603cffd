"""Worker script: GPU replicas across workers.

Each worker's replicas are GPUs: the local collective runs on the devices, MPI carries
a host buffer between the workers, and the result goes back to every local GPU. Without
``--real`` the GPUs are the simulated backend of tests/simulated_cuda.py (host memory
that checks every pointer it is handed); with it, the machine's GPUs.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _check import expect, expect_close, finish, local_count, parse_args, value_for  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distvals as dv  # noqa: E402


def use_simulated_gpus(count: int) -> None:
    from simulated_cuda import SimulatedCuda, install

    install(SimulatedCuda(count))


def main() -> int:
    a = parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    n = local_count(a.replicas, rank)
    gpus = 2
    if a.mode == "real":
        # Every worker uses the machine's GPUs (one GPU: the workers share it).
        gpus = dv.cuda.device_count()
    else:
        use_simulated_gpus(gpus)
    # Enough logical GPUs per physical one for this worker's replicas.
    dv.config.set_logical_gpus(max(1, -(-n // gpus)))
    s = dv.MultiWorkerMirroredStrategy(
        [f"GPU:{i}" for i in range(n)], communication_options=dv.CommunicationOptions(timeout_seconds=a.timeout)
    )
    ext = s.extended
    total, offset = s.num_replicas_in_sync, ext._offset
    checks = 0
    for dtype, op, shape in [
        ("float32", "sum", (5,)),
        ("float64", "mean", (2, 3)),
        ("int32", "max", (7,)),
        ("float32", "sum", (60_000,)),
    ]:

        def step():
            g = dv.get_replica_context().replica_id_in_sync_group
            x = dv.cuda.to_device(value_for(g, shape, dtype, op), ext._places[g - offset])
            return dv.get_replica_context().all_reduce(op, x)

        out = s.run(step)
        want = np.stack([value_for(g, shape, dtype, op).astype(np.float64) for g in range(total)])
        want = {"sum": want.sum(0), "mean": want.mean(0), "max": want.max(0)}[op]
        for r, part in enumerate(s.experimental_local_results(out)):
            expect(
                isinstance(part, dv.cuda.DeviceArray),
                rank,
                f"{dtype} {op}: replica {r}'s result is a {type(part).__name__}, not a DeviceArray",
            )
            expect(part.device == ext._places[r], rank, f"{dtype} {op}: replica {r}'s result on GPU {part.device}")
            expect_close(
                part.numpy(),
                want,
                rank,
                f"{dtype} {op} shape {shape}, replica {r}",
                1e-6 if dtype == "float32" else 1e-12 if dtype == "float64" else 0.0,
            )
        checks += 1
        total_value = s.reduce("sum", out, axis=None)
        expect_close(
            dv.cuda.as_device_array(total_value).numpy() if not isinstance(total_value, np.ndarray) else total_value,
            want * total,
            rank,
            f"strategy.reduce of {dtype} {op}",
            1e-5,
        )
        checks += 1
    checks += check_input_on_the_gpus(s, rank)
    checks += check_errors_name_the_global_replica(s, rank)
    return finish(rank, checks, s)


def check_errors_name_the_global_replica(s, rank: int) -> int:
    """A value refused on its way to a GPU names its replica by its global id (a local
    index would name another worker's replica)."""
    last = s.num_replicas_in_sync - 1
    masked = np.ma.array([1.0, 2.0], mask=[False, True])
    mine = last - s.extended._offset < s.extended._n
    try:
        s.experimental_distribute_values_from_function(
            lambda ctx: masked if ctx.replica_id_in_sync_group == last else np.zeros(2)
        )
    except TypeError as e:
        expect(mine and str(e).startswith(f"replica {last}: a copy to GPU "), rank, f"refused with: {e}")
    else:
        expect(not mine, rank, f"replica {last}'s masked array was not refused")
    return 1


def check_input_on_the_gpus(s, rank: int) -> int:
    """Distributed datasets hand each GPU replica its part on its own GPU, with the
    global batch's rows (InputOptions(experimental_fetch_to_device=False) keeps them on
    the host)."""
    ext = s.extended
    total, offset, n = s.num_replicas_in_sync, ext._offset, ext._n
    x = np.arange(3 * total * 2, dtype=np.float32).reshape(3 * total, 2)
    checks = 0
    for options, on_device in [(None, True), (dv.InputOptions(experimental_fetch_to_device=False), False)]:
        dist = s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(x).batch(total), options)
        for step, element in enumerate(dist):
            for r, part in enumerate(s.experimental_local_results(element)):
                g = offset + r
                if on_device:
                    expect(
                        isinstance(part, dv.cuda.DeviceArray) and part.device == ext._places[r],
                        rank,
                        f"step {step}: replica {g}'s part is a {type(part).__name__} on {getattr(part, 'device', None)}",
                    )
                    part = part.numpy()
                else:
                    expect(isinstance(part, np.ndarray), rank, f"host part: {type(part).__name__}")
                expect_close(part, x[step * total + g : step * total + g + 1], rank, f"step {step}: replica {g}'s rows")
            checks += 1
    dist = s.distribute_datasets_from_function(lambda ctx: [x[i : i + 1] for i in range(n)])
    for element in dist:
        for r, part in enumerate(s.experimental_local_results(element)):
            expect(
                isinstance(part, dv.cuda.DeviceArray) and part.device == ext._places[r],
                rank,
                f"from_function: replica {offset + r}'s part is a {type(part).__name__}",
            )
            expect_close(part.numpy(), x[r : r + 1], rank, f"from_function: replica {offset + r}'s rows")
        checks += 1
    return checks


if __name__ == "__main__":
    sys.exit(main())
