"""Saving and restoring variables: one ``.npz`` file, written atomically.

``save_variables(path, variables)`` stores each variable's value as read in
cross-replica context (the aggregate for a SyncOnReadVariable, the common value for a
MirroredVariable). ``load_variables(path, variables)`` assigns the stored values back
in cross-replica context: every copy of a MirroredVariable gets the value, and a SUM
SyncOnReadVariable gets value/N per copy so that its sum is restored, as in TensorFlow.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np

from . import context
from .variables import Variable

__all__ = ["load_variables", "save_variables"]

Variables = Union[Mapping[str, Variable], Sequence[Variable]]


def _named(variables: Variables, what: str) -> List[Tuple[str, Variable]]:
    if isinstance(variables, Variable):
        variables = [variables]
    if isinstance(variables, Mapping):
        items = [(str(k), v) for k, v in variables.items()]
    elif isinstance(variables, (list, tuple)):
        items = []
        for v in variables:
            if not isinstance(v, Variable):
                raise TypeError(f"{what}: expected variables, got {type(v).__name__}")
            name = v.name[:-2] if v.name.endswith(":0") else v.name
            items.append((name, v))
    else:
        raise TypeError(
            f"{what}: variables must be a list of variables or a dict of name to variable, "
            f"got {type(variables).__name__}"
        )
    seen: Dict[str, Variable] = {}
    for key, v in items:
        if not isinstance(v, Variable):
            raise TypeError(f"{what}: '{key}' is a {type(v).__name__}, not a variable")
        if key in seen:
            raise ValueError(f"{what}: two variables are named '{key}'; pass a dict to give them distinct keys")
        seen[key] = v
    return items


def _require_cross_replica(what: str) -> None:
    ctx = context.current_run_context()
    if ctx is not None:
        raise RuntimeError(
            f"{what} must be called in cross-replica context, not inside strategy.run (replica "
            f"{ctx.replica_id_in_sync_group})"
        )


def save_variables(path: Union[str, os.PathLike[str]], variables: Variables) -> None:
    """Writes the variables' values to ``path`` (an ``.npz`` file) atomically: into a
    temporary file in the same directory first, then renamed over ``path``, so a crash
    never leaves a half-written checkpoint. Keys are the variables' names (without
    ":0"), or the dict's keys. Under a ``MultiWorkerMirroredStrategy`` every worker calls
    it, only the chief writes, and every worker returns once the file is written."""
    _require_cross_replica("save_variables")
    items = _named(variables, "save_variables")
    arrays = {key: np.array(v.read_value(), copy=True) for key, v in items}
    _strategy_of(items).extended._write_checkpoint(lambda: _write_npz(os.fspath(path), arrays))


def _strategy_of(items: List[Tuple[str, Variable]]) -> Any:
    # The variables' strategy decides who writes (with several workers: the chief only).
    for _, v in items:
        strategy = getattr(v, "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return context.get_strategy()


def _write_npz(path: str, arrays: Dict[str, np.ndarray]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # What np.savez writes; np.savez(f, **arrays) would take a variable named
            # "file" or "allow_pickle" for its own argument of that name.
            with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for key, a in arrays.items():
                    with archive.open(key + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asanyarray(a))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_variables(path: Union[str, os.PathLike[str]], variables: Variables) -> None:
    """Assigns the values stored in ``path`` to the variables (matched by key). Every
    key, shape and dtype is checked before any variable changes."""
    _require_cross_replica("load_variables")
    items = _named(variables, "load_variables")
    with np.load(os.fspath(path), allow_pickle=False) as data:
        stored = {}
        for key, v in items:
            if key not in data.files:
                raise KeyError(
                    f"load_variables: {os.fspath(path)} has no value for '{key}' (it holds: "
                    f"{', '.join(sorted(data.files)) or 'nothing'})"
                )
            a = data[key]
            if a.shape != v.shape:
                raise ValueError(f"load_variables: '{key}' is stored with shape {a.shape}, the variable has {v.shape}")
            if a.dtype != v.dtype:
                raise TypeError(f"load_variables: '{key}' is stored as {a.dtype}, the variable is {v.dtype}")
            stored[key] = a
    for key, v in items:
        v.assign(stored[key], read_value=False)
