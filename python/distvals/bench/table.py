"""The report as text: nccl-tests-style tables, speed-ups and peer status."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .results import Report, Row, bus_factor

__all__ = ["format_report", "format_size", "format_speedups", "format_table"]

_HEAD = ("{:>12} {:>11} {:>8} {:>5}  {:<22} {:>11} {:>9} {:>8} {:>8} {:>7} {:>8}")
_UNITS = ("(B)", "(elements)", "", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", "", "")
_NAMES = ("size", "count", "type", "redop", "implementation", "time", "py-time", "algbw", "busbw", "%bound",
          "#wrong")


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


def _order(r: Row) -> Tuple[int, int, str]:
    """distvals rows first (algorithms, then strategy), then the peers in a fixed order."""
    algo = {"ring": 0, "tree": 1, "direct": 2, "auto": 3}
    if r.impl == "distvals":
        return (0, algo.get(r.algorithm, 4) if r.level == "group" else 5, "")
    peers = {"numpy": 0, "tensorflow": 1, "torch-gloo": 2, "mpi4py": 3}
    return (1, peers.get(r.impl, 9), r.impl)


def format_table(report: Report, replicas: int) -> str:
    """The nccl-tests-style table for one replica count, one block of rows per size."""
    rows = [r for r in report.rows if r.replicas == replicas]
    # Header lines start with "#" in the first column, as in nccl-tests.
    lines = ["#" + _HEAD.format(*_NAMES)[1:], "#" + _HEAD.format(*_UNITS)[1:]]
    sizes = sorted({r.bytes for r in rows} | {b["bytes"] for b in report.bounds if b["replicas"] == replicas})
    for nbytes in sizes:
        block = sorted((r for r in rows if r.bytes == nbytes), key=_order)
        for r in block:
            lines.append(_HEAD.format(
                r.bytes, r.count, r.dtype, r.op, r.label, _num(r.time_us), _num(r.py_time_us),
                _num(r.algbw_gbps, digits=3), _num(r.busbw_gbps, digits=3),
                _num(r.bound_pct, digits=1), r.wrong))
        bound = report.bound_us(replicas, nbytes)
        if bound is not None:
            count = block[0].count if block else nbytes
            algbw = nbytes / (bound * 1e-6) / 1e9
            lines.append(_HEAD.format(nbytes, count, "", "", "(memory bound)", _num(bound), "",
                                      _num(algbw, digits=3), _num(algbw * bus_factor(replicas), digits=3),
                                      "100.0", ""))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def format_speedups(report: Report, replicas: int) -> str:
    """Speed-up of distvals over each peer at each size (peer time / distvals time)."""
    from .compare import speedups

    sp = [s for s in speedups(report) if s["replicas"] == replicas]
    if not sp:
        return ""
    peers: List[str] = []
    for s in sp:
        if s["peer"] not in peers:
            peers.append(s["peer"])
    peers.sort(key=lambda p: _order(Row(p, "peer", "", 0, 0, 0, "", "", 0, 0, 0, 0)))
    levels = [lv for lv in ("group", "strategy") if any(s["distvals"] == lv for s in sp)]
    table: Dict[Tuple[int, str, str], float] = {(s["bytes"], s["distvals"], s["peer"]): s["speedup"] for s in sp}
    width = max(12, max(len(p) for p in peers) + 2)
    title = {"group": "ReplicaGroup.all_reduce, algorithm auto",
             "strategy": "strategy.run + ReplicaContext.all_reduce"}
    lines = [f"# speed-up of distvals over each peer, N={replicas}: peer time / distvals time, "
             "both timed per call from Python"]
    for lv in levels:
        lines.append(f"# distvals = {title[lv]}")
        lines.append("#" + f"{'size':>11} " + " ".join(f"{p:>{width}}" for p in peers))
        for nbytes in sorted({s["bytes"] for s in sp}):
            cells = []
            for p in peers:
                v = table.get((nbytes, lv, p))
                cells.append(f"{'-' if v is None else f'{v:.2f}x':>{width}}")
            lines.append(f"{nbytes:>12} " + " ".join(cells))
    return "\n".join(lines)


def _header(report: Report, replicas: int) -> List[str]:
    s, m = report.settings, report.machine
    devs = f"CPU:0..CPU:{replicas - 1}" if replicas > 1 else "CPU:0"
    return [
        f"# distvals {m.get('distvals', '?')} all-reduce, {replicas} replicas ({devs}), "
        f"{s.get('dtype')} {s.get('op')}, in place",
        f"# {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, {m.get('platform', '?')}, "
        f"Python {m.get('python', '?')}, numpy {m.get('numpy', '?')}",
        "# time: median per call. distvals group rows: timed inside the engine; py-time: one",
        "#   ReplicaGroup.all_reduce call timed from Python. Strategy and peer rows: per call from Python.",
        "# busbw = algbw * 2(N-1)/N. %bound: time to move 2*N*S bytes at the copy bandwidth of N threads,",
        "#   measured in this run (best of two medians per size), divided by the row's time.",
        "# #wrong: result elements, over all replicas, that differ from a float64 reference",
        "#   (distinct values per replica; checked in this run).",
    ] + _load_line(m)


def _load_line(m: dict) -> List[str]:
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
