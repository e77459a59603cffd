"""``python -m distvals.bench``: the all-reduce benchmark and the side-by-side comparison."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .peers import bench_data as bd

if TYPE_CHECKING:
    from .results import Report

__all__ = ["build_plan", "main", "parse_args", "parse_size", "sweep_sizes"]

_QUICK = {"min_bytes": 8, "max_bytes": 1 << 20, "iters": 50, "min_iters": 3}


def parse_size(text: str) -> int:
    """``"256M"``, ``"1KiB"``, ``"64"``, ``"4k"`` -> bytes (binary units)."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = 1
    for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8, 1K, 16M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"sizes must be at least 1 byte, got {text!r}")
    return value


def _threshold(text: str) -> int:
    """``"never"`` -> the largest threshold (no streaming stores), else a size (0: always)."""
    t = text.strip().lower()
    if t == "never":
        return 2**64 - 1
    if t in ("0", "always"):
        return 0
    return parse_size(text)


def _sizes_list(text: str) -> List[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def sweep_sizes(min_bytes: int, max_bytes: int) -> List[int]:
    """Powers of 4 between the bounds, plus ``min_bytes`` itself when it is not one."""
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
    sizes = [min_bytes]
    p = 1
    while p <= max_bytes:
        if p > min_bytes:
            sizes.append(p)
        p *= 4
    return sizes


def build_plan(sizes: Sequence[int], dtype: str, max_iters: int, min_iters: int) -> List[Tuple[int, int]]:
    """(bytes, iterations) per size, sizes rounded down to whole elements (at least one)."""
    itemsize = bd.resolve_dtype(dtype).itemsize
    out: List[Tuple[int, int]] = []
    for s in sizes:
        nb = max(1, s // itemsize) * itemsize
        if all(b != nb for b, _ in out):  # a size given twice (or rounding to one) once
            out.append((nb, bd.iterations(nb, max_iters, min_iters)))
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m distvals.bench",
        description="All-reduce benchmark in the style of nccl-tests, with CPU replicas in one process; "
        "--compare runs numpy, TensorFlow, torch.distributed (gloo) and mpi4py side by side.",
    )
    p.add_argument(
        "--replicas", "-n", type=int, nargs="+", metavar="N", help="replica counts (default 2; with --compare 2 and 4)"
    )
    p.add_argument(
        "--algo",
        default="all",
        choices=["ring", "tree", "direct", "auto", "all"],
        help="all-reduce algorithm (default all: ring, tree, direct and auto)",
    )
    p.add_argument("--dtype", default="float32", choices=bd.DTYPES)
    p.add_argument("--op", default="sum", choices=list(bd.OPS) + ["product"])
    p.add_argument("--min-bytes", type=parse_size, default=None, help="smallest message (default 8)")
    p.add_argument("--max-bytes", type=parse_size, default=None, help="largest message (default 256M)")
    p.add_argument("--sizes", type=_sizes_list, default=None, help="explicit sizes, e.g. 1K,1M,16M")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed iterations for small messages; fewer for large ones (default 1000)",
    )
    p.add_argument("--min-iters", type=int, default=None, help="timed iterations at least (default 5)")
    p.add_argument("--quick", action="store_true", help="8 B to 1 MiB, few iterations: a smoke run")
    p.add_argument(
        "--api",
        choices=["group", "strategy", "all"],
        default=None,
        help="distvals levels: ReplicaGroup, strategy.run + all_reduce, or both (default group; with --compare all)",
    )
    p.add_argument(
        "--out-of-place",
        action="store_true",
        help="also time each algorithm from the inputs into separate, already-used output arrays "
        "(rows marked 'out', and their ratio to the in-place time)",
    )
    p.add_argument(
        "--streaming-min-bytes",
        type=_threshold,
        default=None,
        metavar="SIZE|never",
        help="set the CPU kernels' streaming-store threshold for this run: the smallest output of "
        "one kernel call written with non-temporal stores when out of place (default: the "
        "engine's, an eighth of the last-level cache)",
    )
    p.add_argument("--compare", action="store_true", help="also run the peers, side by side")
    p.add_argument(
        "--peers",
        default=None,
        help="comma list of peers for --compare (default all): numpy,tensorflow,torch-gloo,mpi4py",
    )
    p.add_argument(
        "--peer-python", default=sys.executable, help="interpreter that has the peers installed (default: this one)"
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=1800.0,
        help="seconds one peer may take for one replica count (default 1800)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the report as JSON to PATH (without PATH: to stdout, instead of the table)",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="write the plots (needs matplotlib)")
    p.add_argument(
        "--load", default=None, metavar="JSON", help="do not measure: print, plot or convert a report written by --json"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    a = p.parse_args(argv)
    quick = _QUICK if a.quick else {}
    a.min_bytes = a.min_bytes or quick.get("min_bytes", 8)
    a.max_bytes = a.max_bytes or quick.get("max_bytes", 256 << 20)
    a.iters = quick.get("iters", 1000) if a.iters is None else a.iters
    a.min_iters = quick.get("min_iters", 5) if a.min_iters is None else a.min_iters
    a.replicas = a.replicas or ([2, 4] if a.compare else [2])
    a.api = a.api or ("all" if a.compare else "group")
    if any(n < 1 for n in a.replicas):
        p.error(f"--replicas must be at least 1, got {a.replicas}")
    if a.iters < 1 or a.min_iters < 1:
        p.error("--iters and --min-iters must be at least 1")
    try:
        a.op = bd.canonical_op(a.op)
        bd.check_op_dtype(a.op, a.dtype)
        bd.resolve_dtype(a.dtype)
        from .compare import peer_names

        a.peer_list = peer_names(a.peers) if a.compare else []
        a.sizes = a.sizes or sweep_sizes(a.min_bytes, a.max_bytes)
    except ValueError as e:
        p.error(str(e))
    return a


def _machine() -> Dict[str, Any]:
    import numpy as np

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from .memory import cache_levels

    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    caches, source = cache_levels()
    return {
        "distvals": __version__,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "caches": [{"level": c.level, "size": c.size, "shared_cpus": c.shared_cpus} for c in caches],
        "caches_source": source,
        "load_average_at_start": load,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _measure(a: argparse.Namespace, command: str) -> Report:
    from .. import _core
    from .core import ALGORITHMS
    from .results import Report

    plan = build_plan(a.sizes, a.dtype, a.iters, a.min_iters)
    # --api strategy measures steps only: no group rows, so no algorithms.
    algos = [] if a.api == "strategy" else list(ALGORITHMS) if a.algo == "all" else [a.algo]
    report = Report(
        command=command,
        machine=_machine(),
        settings={
            "replicas": a.replicas,
            "dtype": a.dtype,
            "op": a.op,
            "algorithms": algos,
            "api": a.api,
            "plan": [{"bytes": b, "iters": i} for b, i in plan],
            "compare": a.compare,
            "peers": a.peer_list,
            "peer_python": a.peer_python if a.compare else None,
            "out_of_place": a.out_of_place,
        },
    )
    previous = None
    if a.streaming_min_bytes is not None:
        previous = _core.set_streaming_store_min_bytes(a.streaming_min_bytes)
    try:
        report.settings["streaming_min_bytes"] = int(_core.streaming_store_min_bytes())
        return _sweep(a, report, plan, algos)
    finally:
        if previous is not None:
            _core.set_streaming_store_min_bytes(previous)


def _sweep(a: argparse.Namespace, report: Report, plan: List[Tuple[int, int]], algos: List[str]) -> Report:
    """The measurements of :func:`_measure`, into ``report``."""
    from .compare import run_peer
    from .core import has_strategy, mode_label, strategy_modes, sweep_distvals
    from .progress import Progress

    strategy = a.api in ("strategy", "all")
    if strategy and not has_strategy():
        report.notes.append("strategy level not measured: this distvals has no MirroredStrategy")
        strategy = False
    modes = strategy_modes() if strategy else []
    if strategy:
        report.settings["execution_modes"] = [mode_label(m) for m in modes]
        if modes == [None]:
            report.notes.append(
                "this MirroredStrategy takes no execution= argument: its one mode "
                "(replica threads) is listed as 'default'"
            )
    per_size = len(algos) + len(modes) + len(a.peer_list)
    enabled = sys.stderr.isatty() if a.progress is None else a.progress
    with Progress(len(a.replicas) * len(plan) * per_size, enabled) as bar:
        for n in a.replicas:
            rows, bounds = sweep_distvals(
                n,
                plan,
                a.dtype,
                a.op,
                algos,
                strategy,
                bar.tick,
                report.notes,
                out_of_place=a.out_of_place,
                modes=modes,
            )
            report.rows.extend(rows)
            report.bounds.extend(bounds)
            for name in a.peer_list:
                status, prow = run_peer(name, n, plan, a.dtype, a.op, a.peer_python, a.peer_timeout, bar.tick)
                for r in prow:
                    r.finish(report.bound_us(n, r.bytes))
                report.rows.extend(prow)
                report.peers.append(status)
                # Keep the bar honest when a peer stops early.
                for _ in range(len(plan) - len(prow)):
                    bar.tick(f"N={n} {name} ({status.status})")
    if hasattr(os, "getloadavg"):
        # Other work on the machine shows up as noise in every figure: record it.
        report.machine["load_average_at_end"] = list(os.getloadavg())
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    from .results import Report
    from .table import format_report

    if a.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    command = "python -m distvals.bench" + ("" if not argv else " " + shlex.join(argv))
    if a.load:
        with open(a.load) as f:
            report = Report.from_json(json.load(f))
    else:
        report = _measure(a, command)
    doc = report.to_json()
    if a.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(report))
        sys.stdout.flush()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
    if a.plot:
        from .plot import plot_report

        plot_report(report, a.plot)
        print(f"# plot written to {a.plot}", file=sys.stderr)
    wrong = sum(r.wrong for r in report.rows)
    if wrong:
        print(f"# ERROR: {wrong} wrong result elements", file=sys.stderr)
        return 1
    return 0
