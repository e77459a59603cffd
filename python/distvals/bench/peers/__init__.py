"""Peer implementations the benchmark compares against, each a script run as a subprocess.

Every runner takes the same command line (see ``bench_data.runner_parser``) and prints
JSON lines: ``start`` (version, detail), one ``result`` per size, ``done``; or
``missing`` / ``unsupported`` / ``error`` with a reason. They run under any interpreter
that has numpy (``--peer-python``), with or without distvals installed there.
"""

from __future__ import annotations

import os
from typing import Dict

__all__ = ["PEERS", "runner_path"]

# Name shown in tables -> runner script beside this file.
PEERS: Dict[str, str] = {
    "numpy": "numpy_peer.py",
    "tensorflow": "tensorflow_peer.py",
    "torch-gloo": "torch_peer.py",
    "mpi4py": "mpi_peer.py",
}


def runner_path(name: str) -> str:
    """Absolute path of the runner script for peer ``name``."""
    try:
        script = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}") from None
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
