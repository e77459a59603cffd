"""One measured row of the benchmark and the whole report, with their JSON form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["READABLE_SCHEMAS", "SCHEMA", "PeerStatus", "Report", "Row", "bus_factor"]

SCHEMA = "distvals.bench/2"
# Reports this version can still read (version 1 had a copy-based memory bound and no
# execution modes or out-of-place rows).
READABLE_SCHEMAS = ("distvals.bench/1", SCHEMA)


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(N-1)/N."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


@dataclass
class Row:
    """One implementation at one size and replica count.

    ``time_us`` is the median time per call; for distvals' group rows it is timed
    inside the engine (``timing="engine"``) and ``py_time_us`` is the median time of one
    ``ReplicaGroup.all_reduce`` call from Python. Every other row is timed per call from
    Python (``timing="python"``). ``bound_pct`` is the memory-bound time over
    ``time_us``, in percent. ``wrong`` counts result elements, over all replicas, that
    differ from the float64 reference (``checked`` elements were compared).

    ``out_of_place``: a group row from the inputs into separate output arrays.
    Strategy rows: ``level`` is ``"strategy"`` (``run`` of a function calling
    ``ReplicaContext.all_reduce``), ``"strategy-structure"`` (the same bytes as a dict of
    six arrays) or ``"strategy-trivial"`` (``run`` of a function that
    does nothing), ``mode`` the strategy's execution mode and ``group_py_us`` the median
    of ``ReplicaGroup.all_reduce`` of the same arrays, timed from Python in the same run
    (in place), ``group_out_py_us`` the same into separate, already-used outputs, and
    ``out_bound_us`` the memory bound of reading the arrays into such outputs (the least
    a step that returns new arrays can take here).
    """

    impl: str
    level: str
    algorithm: str
    replicas: int
    bytes: int
    count: int
    dtype: str
    op: str
    time_us: float
    iters: int
    wrong: int
    checked: int
    timing: str = "python"
    py_time_us: Optional[float] = None
    chosen: Optional[str] = None
    out_of_place: bool = False
    mode: Optional[str] = None
    group_py_us: Optional[float] = None
    group_out_py_us: Optional[float] = None
    out_bound_us: Optional[float] = None
    algbw_gbps: float = 0.0
    busbw_gbps: float = 0.0
    bound_us: Optional[float] = None
    bound_pct: Optional[float] = None

    def finish(self, bound_us: Optional[float]) -> Row:
        """Fill the derived columns from the time and the memory-bound time."""
        t = self.time_us * 1e-6
        if self.level == "strategy-trivial" or (self.replicas == 1 and not self.out_of_place and self.level == "group"):
            # Rows that move no data: a step without a collective, and an in-place
            # all-reduce of one replica (nothing to combine). No bandwidth, no bound.
            self.algbw_gbps = self.busbw_gbps = 0.0
            self.bound_us = self.bound_pct = None
            return self
        self.algbw_gbps = self.bytes / t / 1e9 if t > 0 else float("inf")
        self.busbw_gbps = self.algbw_gbps * bus_factor(self.replicas)
        self.bound_us = bound_us
        self.bound_pct = 100.0 * bound_us / self.time_us if bound_us and self.time_us > 0 else None
        return self

    @property
    def label(self) -> str:
        """Short name: ``distvals ring``, ``distvals strategy``, ``tensorflow``..."""
        if self.impl == "distvals":
            if self.level != "group":
                name = {"strategy": "strategy", "strategy-structure": "structure"}.get(self.level, "run trivial")
                return f"distvals {name}" + (f" {self.mode}" if self.mode and self.mode != "default" else "")
            return (
                f"distvals {self.algorithm}"
                + (f"/{self.chosen}" if self.chosen else "")
                + (" out" if self.out_of_place else "")
            )
        return self.impl

    @property
    def ratio_to_group(self) -> Optional[float]:
        """Strategy rows: time / ``ReplicaGroup.all_reduce`` of the same arrays (same run)."""
        if self.group_py_us and self.group_py_us > 0:
            return self.time_us / self.group_py_us
        return None

    @property
    def ratio_to_group_out(self) -> Optional[float]:
        """Strategy rows: time / ``ReplicaGroup.all_reduce(..., out=...)`` of the same arrays
        into already-used outputs (same run): what the step adds to the engine's work."""
        if self.group_out_py_us and self.group_out_py_us > 0:
            return self.time_us / self.group_out_py_us
        return None

    @property
    def ratio_to_out_bound(self) -> Optional[float]:
        """Strategy rows: time / the memory bound of writing the results to new memory."""
        if self.out_bound_us and self.out_bound_us > 0:
            return self.time_us / self.out_bound_us
        return None

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Row:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class PeerStatus:
    """What happened to one peer at one replica count: ok, missing, unsupported, failed."""

    name: str
    replicas: int
    status: str
    reason: str = ""
    version: str = ""
    detail: str = ""

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Report:
    """Everything one run measured: rows, memory bounds, peers, settings."""

    command: str
    settings: Dict[str, Any]
    machine: Dict[str, Any]
    rows: List[Row] = field(default_factory=list)
    bounds: List[Dict[str, Any]] = field(default_factory=list)
    peers: List[PeerStatus] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def bound(self, replicas: int, nbytes: int) -> Optional[Dict[str, Any]]:
        """The memory bound's record of one size (see memory.BoundMeter.result)."""
        for b in self.bounds:
            if b["replicas"] == replicas and b["bytes"] == nbytes:
                return b
        return None

    def bound_us(self, replicas: int, nbytes: int) -> Optional[float]:
        b = self.bound(replicas, nbytes)
        return None if b is None else b["bound_us"]

    def to_json(self) -> Dict[str, Any]:
        from .compare import speedups

        return {
            "schema": SCHEMA,
            "command": self.command,
            "settings": self.settings,
            "machine": self.machine,
            "memory_bound": self.bounds,
            "results": [r.to_json() for r in self.rows],
            "peers": [p.to_json() for p in self.peers],
            "speedups": speedups(self),
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Report:
        if d.get("schema") not in READABLE_SCHEMAS:
            raise ValueError(f"not a distvals benchmark report (schema {d.get('schema')!r}, expected {SCHEMA!r})")
        return cls(
            command=d["command"],
            settings=d["settings"],
            machine=d["machine"],
            rows=[Row.from_json(r) for r in d["results"]],
            bounds=list(d["memory_bound"]),
            peers=[PeerStatus(**p) for p in d["peers"]],
            notes=list(d.get("notes", [])),
        )
