"""Plots of a report (matplotlib, from the optional ``bench`` extra).

One row of two panels per replica count: bus bandwidth against message size on log
axes, one line per implementation with the memory bound drawn as a dashed black line;
and the latency of small messages.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from .results import Report, Row, bus_factor

__all__ = ["SMALL_BYTES", "plot_report", "require_matplotlib"]

# Messages up to this size go into the latency panel.
SMALL_BYTES = 64 * 1024
# The bound's line is drawn from this size on (it is measured at every size, timed like
# the collective, so it means something at every size).
BOUND_FROM_BYTES = 1


def require_matplotlib() -> None:
    """Fail early, before any measurement, when plotting was asked for but cannot work."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install 'distvals[bench]'")


def _series(rows: Sequence[Row]) -> Dict[str, List[Row]]:
    out: Dict[str, List[Row]] = {}
    for r in rows:
        if r.level == "strategy-trivial":
            continue  # no data moved: the strategy table lists it
        key = r.label.split("/")[0]  # "distvals auto/direct" -> one line for auto
        if r.out_of_place and not key.endswith(" out"):
            key += " out"
        out.setdefault(key, []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r.bytes)
    return out


_LABELS = {
    "distvals auto": "distvals auto (timed in the engine)",
    "distvals auto out": "distvals auto, out of place (timed in the engine)",
    "distvals strategy": "distvals strategy.run + all_reduce",
    "distvals strategy inline": "distvals strategy.run + all_reduce, inline",
    "distvals strategy threads": "distvals strategy.run + all_reduce, threads",
    "distvals structure inline": "distvals strategy.run + all_reduce of a 6-array dict, inline",
    "distvals structure threads": "distvals strategy.run + all_reduce of a 6-array dict, threads",
}


def _rank(name: str) -> Tuple[int, str]:
    order = [
        "distvals auto",
        "distvals auto out",
        "distvals strategy",
        "distvals strategy inline",
        "distvals strategy threads",
        "distvals structure inline",
        "distvals structure threads",
        "numpy",
        "tensorflow",
        "torch-gloo",
        "mpi4py",
    ]
    return (order.index(name) if name in order else len(order), name)


def _size_ticks(ax: Any, sizes: Sequence[int]) -> None:
    from .table import format_size

    ticks = [s for s in sizes if s & (s - 1) == 0] or list(sizes)
    if len(ticks) > 8:
        ticks = ticks[:: (len(ticks) + 7) // 8]
    ax.set_xticks(ticks)
    ax.set_xticklabels([format_size(t).replace(" ", "") for t in ticks], rotation=45, ha="right")
    ax.minorticks_off()


def plot_report(report: Report, path: str) -> List[int]:
    """Write the figure to ``path`` (format from the extension); returns the N plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r.replicas for r in report.rows})
    if not ns:
        raise ValueError("the report has no rows to plot")
    fig, axes = plt.subplots(len(ns), 2, figsize=(13, 4.6 * len(ns)), squeeze=False)
    styles = {
        "distvals strategy": "-",
        "distvals strategy inline": "-",
        "distvals strategy threads": "-",
        "distvals auto out": "--",
        "numpy": ":",
        "tensorflow": "-.",
        "torch-gloo": "-.",
        "mpi4py": "--",
    }
    for (ax_bw, ax_lat), n in zip(axes, ns):
        rows = [r for r in report.rows if r.replicas == n]
        series = _series(rows)
        for name, rs in sorted(series.items(), key=lambda kv: _rank(kv[0])):
            style = styles.get(name, "-")
            main = (
                not name.startswith("distvals")
                or name in ("distvals auto", "distvals auto out")
                or name.startswith("distvals strategy")
            )
            # The fixed algorithms are context for auto: thin and faded.
            kw = dict(marker="o", ms=3, lw=2.2 if main else 0.9, alpha=1.0 if main else 0.55)
            label = _LABELS.get(name, name)
            ax_bw.plot([r.bytes for r in rs], [r.busbw_gbps for r in rs], style, label=label, **kw)
            small = [r for r in rs if r.bytes <= SMALL_BYTES]
            if small:
                ax_lat.plot([r.bytes for r in small], [r.time_us for r in small], style, label=label, **kw)
        # The peers are timed per call from Python: distvals the same way beside its
        # engine time, so that the two compare like for like.
        called = [r for r in series.get("distvals auto", []) if r.py_time_us]
        if called:
            ax_bw.plot(
                [r.bytes for r in called],
                [r.bytes / ((r.py_time_us or 0.0) * 1e-6) / 1e9 * bus_factor(n) for r in called],
                "-",
                marker="s",
                ms=3,
                lw=2.2,
                label="distvals auto, one call from Python",
            )
        auto = [r for r in called if r.bytes <= SMALL_BYTES]
        if auto:
            ax_lat.plot(
                [r.bytes for r in auto],
                [r.py_time_us for r in auto],
                "-",
                marker="s",
                ms=3,
                lw=2.2,
                label="distvals auto, one call from Python",
            )
        bounds: List[Tuple[int, float]] = sorted(
            (b["bytes"], b["bound_us"]) for b in report.bounds if b["replicas"] == n and b["bytes"] >= BOUND_FROM_BYTES
        )
        if bounds:
            ax_bw.plot(
                [b for b, _ in bounds],
                [b / (t * 1e-6) / 1e9 * bus_factor(n) for b, t in bounds],
                "k--",
                lw=1.8,
                label="memory bound: N*S read + N*S written in place, same buffers",
            )
        dt = report.settings.get("dtype", "")
        op = report.settings.get("op", "")
        ax_bw.set(
            xscale="log",
            yscale="log",
            xlabel="message size per replica",
            ylabel="bus bandwidth (GB/s)",
            title=f"all-reduce busbw, N={n}, {dt} {op}",
        )
        ax_lat.set(
            xscale="log",
            yscale="log",
            xlabel="message size per replica",
            ylabel="time per call (us, median)",
            title=f"small-message latency, N={n}",
        )
        _size_ticks(ax_bw, sorted({r.bytes for r in rows}))
        _size_ticks(ax_lat, sorted({r.bytes for r in rows if r.bytes <= SMALL_BYTES}))
        for ax in (ax_bw, ax_lat):
            ax.grid(True, which="major", alpha=0.3)
        ax_bw.legend(fontsize=7, loc="lower right")
        ax_lat.legend(fontsize=7, loc="upper left")
    fig.text(
        0.01,
        0.005,
        "distvals group rows: timed inside the engine; strategy and peers: per call from Python",
        fontsize=7,
        alpha=0.7,
    )
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ns
