"""The report as text: nccl-tests-style tables, speed-ups and peer status."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .results import Report, Row, bus_factor

__all__ = [
    "format_bound_summary",
    "format_out_of_place",
    "format_report",
    "format_size",
    "format_speedups",
    "format_strategy",
    "format_table",
    "over_bound",
]

_HEAD = "{:>12} {:>11} {:>8} {:>5} {:>5}  {:<26} {:>11} {:>9} {:>8} {:>8} {:>7} {:>8}"
_UNITS = ("(B)", "(elements)", "", "", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", "", "")
_NAMES = (
    "size",
    "count",
    "type",
    "redop",
    "level",
    "implementation",
    "time",
    "py-time",
    "algbw",
    "busbw",
    "%bound",
    "#wrong",
)
# A row faster than its bound by more than the size's noise is flagged with this mark.
_OVER = "!"


def format_size(nbytes: int) -> str:
    """8 -> "8 B", 1024 -> "1 KiB", 3 MiB -> "3 MiB" (exact multiples only)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _num(x: Optional[float], width: int = 0, digits: int = 2) -> str:
    if x is None:
        return "-"
    if x >= 1e5:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def _order(r: Row) -> Tuple[int, int, int, str]:
    """distvals rows first (algorithms, in place then out of place; then strategy modes),
    then the peers in a fixed order."""
    algo = {"ring": 0, "tree": 1, "direct": 2, "auto": 3}
    if r.impl == "distvals":
        if r.level == "group":
            return (0, algo.get(r.algorithm, 4), int(r.out_of_place), "")
        return (0, 5, 0, r.mode or "")
    peers = {"numpy": 0, "tensorflow": 1, "torch-gloo": 2, "mpi4py": 3}
    return (1, peers.get(r.impl, 9), 0, r.impl)


def _noise(b: Optional[Dict[str, Any]]) -> Optional[float]:
    return None if b is None else b.get("noise_pct")


def over_bound(r: Row, b: Optional[Dict[str, Any]]) -> bool:
    """Whether a row beats its bound by more than the noise measured at its size."""
    if r.bound_pct is None:
        return False
    noise = _noise(b) or 0.0
    return r.bound_pct > 100.0 + noise


def _bound_label(b: Dict[str, Any]) -> str:
    if "threads" not in b:  # a version-1 report: a copy-based bound
        return "(memory bound, copy)"
    return f"(memory bound, {b['threads']} thr" + (", nt)" if b.get("streaming") else ")")


def format_table(report: Report, replicas: int) -> str:
    """The nccl-tests-style table for one replica count, one block of rows per size."""
    rows = [r for r in report.rows if r.replicas == replicas and r.level != "strategy-trivial"]
    # Header lines start with "#" in the first column, as in nccl-tests.
    lines = ["#" + _HEAD.format(*_NAMES)[1:], "#" + _HEAD.format(*_UNITS)[1:]]
    sizes = sorted({r.bytes for r in rows} | {b["bytes"] for b in report.bounds if b["replicas"] == replicas})
    for nbytes in sizes:
        block = sorted((r for r in rows if r.bytes == nbytes), key=_order)
        b = report.bound(replicas, nbytes)
        level = (b or {}).get("level", "")
        for r in block:
            pct = _num(r.bound_pct, digits=1)
            if over_bound(r, b):
                pct += _OVER
            lines.append(
                _HEAD.format(
                    r.bytes,
                    r.count,
                    r.dtype,
                    r.op,
                    level,
                    r.label,
                    _num(r.time_us),
                    _num(r.py_time_us),
                    _num(r.algbw_gbps, digits=3),
                    _num(r.busbw_gbps, digits=3),
                    pct,
                    r.wrong,
                )
            )
        if b is not None:
            bound = b["bound_us"]
            count = block[0].count if block else nbytes
            algbw = nbytes / (bound * 1e-6) / 1e9
            noise = _noise(b)
            lines.append(
                _HEAD.format(
                    nbytes,
                    count,
                    "",
                    "",
                    level,
                    _bound_label(b),
                    _num(bound),
                    "",
                    _num(algbw, digits=3),
                    _num(algbw * bus_factor(replicas), digits=3),
                    "100.0" if noise is None else f"±{noise:.1f}",
                    "",
                )
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def format_bound_summary(report: Report, replicas: int) -> str:
    """The run's noise and every row that beats its bound by more than that noise."""
    bounds = [b for b in report.bounds if b["replicas"] == replicas]
    noises = [(b["noise_pct"], b["bytes"]) for b in bounds if b.get("noise_pct") is not None]
    if not noises:
        return ""
    samples = sorted({b.get("samples", 0) for b in bounds})
    vals = sorted(x for x, _ in noises)
    worst = max(noises)
    lines = [
        (
            f"# noise, N={replicas}: the bound was measured {'/'.join(str(s) for s in samples)} times per size, "
            "between the rows; the spread (slowest / fastest - 1) of its medians is the size's noise (±x in the "
            f"bound's %bound column): median {statistics.median(vals):.1f}%, largest {worst[0]:.1f}% at "
            f"{format_size(worst[1])}"
        )
    ]
    over = []
    for r in report.rows:
        if r.replicas != replicas or r.level == "strategy-trivial":
            continue
        b = report.bound(replicas, r.bytes)
        if over_bound(r, b):
            over.append(f"{r.label} at {format_size(r.bytes)}: {r.bound_pct:.1f}% (noise ±{_noise(b) or 0:.1f}%)")
    if over:
        lines.append(f"# rows above 100% of the bound by more than the noise ({_OVER}): " + "; ".join(over))
    else:
        lines.append("# rows above 100% of the bound by more than the noise: none")
    return "\n".join(lines)


def format_out_of_place(report: Report, replicas: int) -> str:
    """Out-of-place time / in-place time per algorithm and size (both timed in the engine).
    None for one replica, whose in-place call has nothing to do."""
    if replicas == 1:
        return ""
    rows = [r for r in report.rows if r.replicas == replicas and r.impl == "distvals" and r.level == "group"]
    pairs: Dict[Tuple[int, str], Dict[bool, Row]] = {}
    for r in rows:
        pairs.setdefault((r.bytes, r.algorithm), {})[r.out_of_place] = r
    algos = [
        a
        for a in ("ring", "tree", "direct", "auto")
        if any(k[1] == a and True in v and False in v for k, v in pairs.items())
    ]
    if not algos:
        return ""
    lines = [
        (
            f"# out of place / in place, N={replicas}: engine time from the inputs into separate, already-used "
            "output arrays, over the in-place time (same run)"
        ),
        "#" + f"{'size':>11} " + " ".join(f"{a:>10}" for a in algos),
    ]
    for nbytes in sorted({k[0] for k in pairs}):
        cells = []
        for a in algos:
            p = pairs.get((nbytes, a), {})
            ok = True in p and False in p and p[False].time_us > 0
            cells.append(f"{(f'{p[True].time_us / p[False].time_us:.2f}x' if ok else '-'):>10}")
        lines.append(f"{nbytes:>12} " + " ".join(cells))
    return "\n".join(lines)


def format_strategy(report: Report, replicas: int) -> str:
    """strategy.run per execution mode, side by side: trivial, with all_reduce, ratio."""
    rows = [r for r in report.rows if r.replicas == replicas]
    strat = [
        r for r in rows if r.impl == "distvals" and r.level in ("strategy", "strategy-trivial", "strategy-structure")
    ]
    if not strat:
        return ""
    modes: List[str] = []
    for r in strat:
        m = r.mode or "default"
        if m not in modes:
            modes.append(m)
    cell: Dict[Tuple[int, str, str], Row] = {(r.bytes, r.mode or "default", r.level): r for r in strat}
    tf = {r.bytes: r.time_us for r in rows if r.impl == "tensorflow"}
    lines = [
        (
            f"# strategy.run, N={replicas}: median us per call from Python. trivial: fn does nothing; "
            "all_reduce: fn calls ctx.all_reduce on its replica's array; structure: on the same bytes as a "
            "dict of 6 arrays; group: one ReplicaGroup.all_reduce of the same arrays (from Python, in place), "
            "timed alongside each mode's steps, and ratio: the step's time over it; group out / out ratio: the "
            "same call into separate, already-used outputs (run returns new arrays); new-mem bound / bound "
            "ratio: the memory bound of reading the arrays into such outputs, the least a step that returns "
            "new arrays can take here (twice the in-place working set)"
        )
    ]
    head = f"#{'size':>11}"
    for m in modes:
        head += (
            f" | {m + ': group':>15} {'group out':>10} {'trivial':>10} {'all_reduce':>10} {'ratio':>7} "
            f"{'out ratio':>9} {'new-mem bound':>13} {'bound ratio':>11} {'structure':>10} {'ratio':>7}"
        )
    if tf:
        head += f" | {'tensorflow':>10} {'tf/' + modes[0]:>9}"
    lines.append(head)
    for nbytes in sorted({r.bytes for r in strat}):
        line = f"{nbytes:>12}"
        for m in modes:
            t = cell.get((nbytes, m, "strategy-trivial"))
            a = cell.get((nbytes, m, "strategy"))
            st = cell.get((nbytes, m, "strategy-structure"))
            # Each ratio is to the group call timed alongside that mode's steps: the one
            # printed in the same block.
            ratio = a.ratio_to_group if a is not None else None
            out_ratio = a.ratio_to_group_out if a is not None else None
            st_ratio = st.ratio_to_group if st is not None else None
            b_ratio = a.ratio_to_out_bound if a is not None else None
            line += (
                f" | {_num(a.group_py_us if a else None):>15} {_num(a.group_out_py_us if a else None):>10} "
                f"{_num(t.time_us if t else None):>10} {_num(a.time_us if a else None):>10} "
                f"{(f'{ratio:.2f}x' if ratio else '-'):>7} {(f'{out_ratio:.2f}x' if out_ratio else '-'):>9} "
                f"{_num(a.out_bound_us if a else None):>13} {(f'{b_ratio:.2f}x' if b_ratio else '-'):>11} "
                f"{_num(st.time_us if st else None):>10} {(f'{st_ratio:.2f}x' if st_ratio else '-'):>7}"
            )
        if tf:
            a0 = cell.get((nbytes, modes[0], "strategy"))
            tf_us = tf.get(nbytes)
            sp = f"{tf_us / a0.time_us:.1f}x" if tf_us and a0 and a0.time_us > 0 else "-"
            line += f" | {_num(tf_us):>10} {sp:>9}"
        lines.append(line)
    return "\n".join(lines)


def format_speedups(report: Report, replicas: int) -> str:
    """Speed-up of distvals over each peer at each size (peer time / distvals time)."""
    from .compare import speedups

    sp = [s for s in speedups(report) if s["replicas"] == replicas]
    if not sp:
        return ""
    peers: List[str] = []
    levels: List[str] = []
    for s in sp:
        if s["peer"] not in peers:
            peers.append(s["peer"])
        if s["distvals"] not in levels:
            levels.append(s["distvals"])
    peers.sort(key=lambda p: _order(Row(p, "peer", "", 0, 0, 0, "", "", 0, 0, 0, 0)))
    table: Dict[Tuple[int, str, str], float] = {(s["bytes"], s["distvals"], s["peer"]): s["speedup"] for s in sp}
    width = max(12, max(len(p) for p in peers) + 2)

    def title(lv: str) -> str:
        if lv == "group":
            return "ReplicaGroup.all_reduce, algorithm auto"
        mode = lv.split(" ", 1)[1] if " " in lv else ""
        return "strategy.run + ReplicaContext.all_reduce" + (f", execution {mode}" if mode else "")

    lines = [
        (
            f"# speed-up of distvals over each peer, N={replicas}: peer time / distvals time, "
            "both timed per call from Python"
        )
    ]
    for lv in levels:
        lines.append(f"# distvals = {title(lv)}")
        lines.append("#" + f"{'size':>11} " + " ".join(f"{p:>{width}}" for p in peers))
        for nbytes in sorted({s["bytes"] for s in sp}):
            cells = []
            for p in peers:
                v = table.get((nbytes, lv, p))
                cells.append(f"{'-' if v is None else f'{v:.2f}x':>{width}}")
            lines.append(f"{nbytes:>12} " + " ".join(cells))
    return "\n".join(lines)


def _cache_line(m: Dict[str, Any]) -> List[str]:
    caches = m.get("caches")
    if not caches:
        return []
    from .memory import Cache

    desc = ", ".join(Cache(c["level"], c["size"], c["shared_cpus"]).describe() for c in caches)
    return [
        f"# caches ({m.get('caches_source', '?')}): {desc}.",
        "#   level: the first cache that holds the size's working set, N*S bytes (split over the bound's",
        "#   threads for a cache private to each core); DRAM when none does.",
    ]


def _header(report: Report, replicas: int) -> List[str]:
    s, m = report.settings, report.machine
    devs = f"CPU:0..CPU:{replicas - 1}" if replicas > 1 else "CPU:0"
    placement = "in place" + (", and out of place (rows marked 'out')" if s.get("out_of_place") else "")
    lines = [
        (
            f"# distvals {m.get('distvals', '?')} all-reduce, {replicas} replicas ({devs}), "
            f"{s.get('dtype')} {s.get('op')}, {placement}"
        ),
        (
            f"# {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, {m.get('platform', '?')}, "
            f"Python {m.get('python', '?')}, numpy {m.get('numpy', '?')}"
        ),
        "# time: median per call. distvals group rows: timed inside the engine; py-time: one",
        "#   ReplicaGroup.all_reduce call timed from Python. Strategy and peer rows: per call from Python.",
        "# busbw = algbw * 2(N-1)/N. %bound = memory-bound time / the row's time. The bound: the fastest way,",
    ]
    if report.bounds and any("threads" in b for b in report.bounds):
        lines += [
            "#   measured in this run on the size's own buffers, to read N*S bytes and write N*S in place:",
            "#   t threads ('t thr'; the group's, or the calling thread alone) read and store back every byte,",
            "#   plain or streaming stores ('nt'), handed out and timed like the collective. Fastest median of",
            "#   several measurements interleaved with the rows; their spread is the noise (±x).",
        ]
    else:
        lines += ["#   time to copy 2*N*S bytes with N threads (a version-1 report: not a true bound)."]
    lines += [
        "# #wrong: result elements, over all replicas, that differ from a float64 reference",
        "#   (distinct values per replica; checked in this run).",
    ]
    return lines + _cache_line(m) + _load_line(m)


def _load_line(m: Dict[str, Any]) -> List[str]:
    a, b = m.get("load_average_at_start"), m.get("load_average_at_end")
    if not a:
        return []
    text = f"# load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in a)}"
    if b:
        text += f"; at end: {', '.join(f'{x:.2f}' for x in b)}"
    return [text]


def _peer_lines(report: Report, replicas: int) -> List[str]:
    out = []
    for p in report.peers:
        if p.replicas != replicas:
            continue
        ver = f" {p.version}" if p.version else ""
        if p.status == "ok":
            out.append(f"#   {p.name}{ver}: ok ({p.detail})")
        else:
            out.append(f"#   {p.name}{ver}: {p.status.upper()}: {p.reason}")
    return (["# peers:"] + out) if out else []


def format_report(report: Report, replicas_list: Optional[Sequence[int]] = None) -> str:
    """The whole text report: per replica count, the table, peers and speed-ups."""
    if replicas_list is None:
        replicas_list = sorted({r.replicas for r in report.rows} | {p.replicas for p in report.peers})
    parts = [f"# command: {report.command}"]
    for n in replicas_list:
        parts.append("\n".join(_header(report, n)))
        parts.append(format_table(report, n))
        for extra in (format_bound_summary(report, n), format_out_of_place(report, n), format_strategy(report, n)):
            if extra:
                parts.append(extra)
        peer = _peer_lines(report, n)
        if peer:
            parts.append("\n".join(peer))
        sp = format_speedups(report, n)
        if sp:
            parts.append(sp)
        rows = [r for r in report.rows if r.replicas == n]
        wrong = sum(r.wrong for r in rows)
        checked = sum(r.checked for r in rows)
        parts.append(f"# wrong elements, N={n}: {wrong} of {checked} checked")
    if report.notes:
        parts.append("\n".join(f"# note: {x}" for x in report.notes))
    return "\n\n".join(parts) + "\n"
