"""``python -m distvals.bench.streaming``: out-of-place all-reduce with and without
streaming stores, against the in-place call, in one run.

For each replica count and size, three engine-timed measurements are interleaved, round
after round, on the same arrays: in place; from the inputs into separate, already-used
outputs with plain stores only (the CPU kernels' streaming threshold set to "never");
and the same with the build's threshold (streaming stores where it says so). Medians
over the rounds, and their ratios to the in-place time. This is how the threshold was
chosen; run it to check it on another machine. Every result is checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import _core
from .cli import _sizes_list
from .peers import bench_data as bd
from .table import format_size

__all__ = ["main", "measure"]

NEVER = 2**64 - 1


def measure(n: int, nbytes: int, rounds: int, dtype: str = "float32", op: str = "sum") -> Dict[str, Any]:
    """Median engine times (us) of in place, out of place plain and out of place as built."""
    import distvals

    dt = bd.resolve_dtype(dtype)
    count = max(1, nbytes // dt.itemsize)
    ins = [bd.fill(np.empty(count, dtype=dt), n, r, dtype, op) for r in range(n)]
    outs = [np.zeros(count, dtype=dt) for _ in range(n)]  # pages touched: used arrays
    iters = bd.iterations(count * dt.itemsize, 1000, 5)
    warmup = bd.warmup_for(iters)
    built = _core.streaming_store_min_bytes()
    times: Dict[str, List[float]] = {"in_place": [], "plain": [], "streaming": []}
    wrong = 0
    with distvals.ReplicaGroup(n) as g:
        e = g.engine
        for k in ("plain", "streaming"):  # check both store paths once
            for o in outs:
                o.fill(0)
            _core.set_streaming_store_min_bytes(NEVER if k == "plain" else built)
            try:
                _core.time_all_reduce(e, ins, op, "auto", 1, 0, out=outs)
            finally:
                _core.set_streaming_store_min_bytes(built)
            wrong += bd.count_wrong(outs, n, dtype, op)
        for _ in range(rounds):
            times["in_place"].append(statistics.median(_core.time_all_reduce(e, outs, op, "auto", iters, warmup)))
            for k in ("plain", "streaming"):
                _core.set_streaming_store_min_bytes(NEVER if k == "plain" else built)
                try:
                    t = _core.time_all_reduce(e, ins, op, "auto", iters, warmup, out=outs)
                finally:
                    _core.set_streaming_store_min_bytes(built)
                times[k].append(statistics.median(t))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    spread = {k: 100.0 * (max(v) / min(v) - 1.0) for k, v in times.items()}
    return {
        "replicas": n,
        "bytes": count * dt.itemsize,
        "iters": iters,
        "rounds": rounds,
        "us": med,
        "spread_pct": spread,
        "threshold": built,
        "wrong": wrong,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distvals.bench.streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", "-n", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--sizes",
        type=_sizes_list,
        default=[16 << 20, 64 << 20, 256 << 20],
        help="bytes per replica (default 16M,64M,256M)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--dtype", default="float32", choices=bd.DTYPES)
    a = p.parse_args(argv)
    print(
        f"# out of place vs in place, {a.dtype} sum, engine time (median of {a.rounds} interleaved rounds, "
        "each a median); streaming threshold of this build: "
        f"{format_size(_core.streaming_store_min_bytes())} per kernel call"
    )
    print("# spread: slowest / fastest round - 1, the largest of the three measurements")
    print(
        f"#{'N':>2} {'size':>9} {'in place':>11} {'out, plain':>11} {'out, built':>11} "
        f"{'plain/in':>9} {'built/in':>9} {'built/plain':>12} {'spread':>7}"
    )
    wrong = 0
    rows: List[Dict[str, Any]] = []
    for n in a.replicas:
        for s in a.sizes:
            r = measure(n, s, a.rounds, a.dtype)
            rows.append(r)
            wrong += r["wrong"]
            u = r["us"]
            print(
                f"{n:>3} {format_size(r['bytes']):>9} {u['in_place']:>11.1f} {u['plain']:>11.1f} "
                f"{u['streaming']:>11.1f} {u['plain'] / u['in_place']:>8.2f}x {u['streaming'] / u['in_place']:>8.2f}x "
                f"{u['streaming'] / u['plain']:>11.2f}x {max(r['spread_pct'].values()):>6.1f}%",
                flush=True,
            )
    print(f"# wrong elements: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
