"""Saving and restoring variables: one ``.npz`` file, written atomically.

``save_variables(path, variables)`` stores each variable's value as read in
cross-replica context (the aggregate for a SyncOnReadVariable, the common value for a
MirroredVariable). ``load_variables(path, variables)`` assigns the stored values back
in cross-replica context: every copy of a MirroredVariable gets the value, and a SUM
SyncOnReadVariable gets about value/N per copy, as in TensorFlow, split so that its sum
is restored exactly.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zipfile
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np

from . import context
from .variables import Variable, shape_allowed, shape_text

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


def _require_cross_replica(what: str, items: List[Tuple[str, Variable]]) -> None:
    ctx = context.current_run_context()
    if ctx is not None:
        raise RuntimeError(
            f"{what} must be called in cross-replica context, not inside strategy.run (replica "
            f"{ctx.replica_id_in_sync_group})"
        )
    for key, v in items:
        strategy = getattr(v, "distribute_strategy", None)
        copy = None if strategy is None else context.updating_copy(strategy)
        if copy is not None:
            # There a variable reads and updates one copy: a SUM SyncOnReadVariable
            # would be saved as one replica's part and loaded whole into every copy.
            raise RuntimeError(
                f"{what} must be called in cross-replica context, not inside the function of "
                f"extended.update (which is updating copy {copy} of '{key}')"
            )


def save_variables(path: Union[str, os.PathLike[str]], variables: Variables) -> None:
    """Writes the variables' values to ``path`` (an ``.npz`` file) atomically: into a
    temporary file in the same directory first, then renamed over ``path``, so a crash
    never leaves a half-written checkpoint. Keys are the variables' names (without
    ":0"), or the dict's keys. Under a ``MultiWorkerMirroredStrategy`` every worker calls
    it, only the chief writes, and every worker returns once the file is written."""
    items = _named(variables, "save_variables")
    _require_cross_replica("save_variables", items)
    for key, _ in items:
        _check_key(key)
    arrays = {key: np.array(v.read_value(), copy=True) for key, v in items}
    path = os.fspath(path)
    strategy = _strategy_of(items)
    if getattr(strategy.extended, "_between_workers", False):
        # Its chief writes; every worker returns once the file is written.
        strategy.extended._write_checkpoint(lambda: _write_npz(path, arrays))
    elif _chief_process():
        # Variables of a local strategy, or of none: every process of a multi-worker job
        # has such variables of its own, and only one may write the file (the chief
        # process, at once).
        _write_npz(path, arrays)


def _strategy_of(items: List[Tuple[str, Variable]]) -> Any:
    """The strategy of the variables (one between workers first, whatever the variables'
    order: its workers must all wait for the chief's write), or the one whose scope is
    open (the default one when none is)."""
    found = None
    for _, v in items:
        strategy = getattr(v, "distribute_strategy", None)
        if strategy is not None and getattr(strategy.extended, "_between_workers", False):
            return strategy
        found = strategy if found is None else found
    return context.get_strategy() if found is None else found


def _worker_ranks() -> List[int]:
    """This process's rank in each multi-worker strategy it has (of several workers)."""
    module = sys.modules.get(__package__ + ".multi_worker")
    return [] if module is None else module.live_worker_ranks()


def _chief_process() -> bool:
    return all(rank == 0 for rank in _worker_ranks())


def _check_key(key: str) -> None:
    """A key must name one member of the archive: a NUL would cut the name short (two
    keys could then name one member), and the name must fit the zip format."""
    if "\0" in key:
        raise ValueError(f"save_variables: the key {key!r} holds a NUL character")
    try:
        size = len((key + ".npy").encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"save_variables: the key {key!r} cannot be written as UTF-8: {e.reason}") from None
    if size > 0xFFFF:
        raise ValueError(f"save_variables: the key {key[:40]!r}... is {size} bytes long; keys take at most 65531")


def _write_npz(path: str, arrays: Dict[str, np.ndarray]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        # mkstemp makes the file readable by its owner only; a checkpoint gets the mode
        # any new file gets (np.savez's), so that workers running as other users read it.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            # What np.savez writes; np.savez(f, **arrays) would take a variable named
            # "file" or "allow_pickle" for its own argument of that name.
            with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                for key, a in arrays.items():
                    info = zipfile.ZipInfo(key + ".npy", date_time=time.localtime()[:6])
                    info.compress_type = zipfile.ZIP_STORED
                    a = np.asanyarray(a)
                    if a.dtype.isbuiltin == 2:
                        # Stored as its raw bytes, its name in the member's comment.
                        info.comment = _DTYPE_TAG + a.dtype.name.encode()
                        a = a.view(np.dtype(f"V{a.dtype.itemsize}"))
                    with archive.open(info, "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, a)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process's file mode creation mask."""
    try:
        # Linux says it without changing it (os.umask can only read it by setting it,
        # and another thread could create a file in between).
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The .npy format cannot name dtypes that numpy does not define (ml_dtypes' bfloat16
# and float8 kinds): they are stored as raw bytes ("|V2"), and the member's comment
# keeps the name, so that a bfloat16 value loads back as bfloat16, never as another
# type of the same size.
_DTYPE_TAG = b"distvals-dtype:"


def _stored_dtypes(path: str) -> Dict[str, np.dtype]:
    """The dtypes a checkpoint names in its members' comments, by key."""
    out: Dict[str, np.dtype] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.endswith(".npy") and info.comment.startswith(_DTYPE_TAG):
                name = info.comment[len(_DTYPE_TAG) :].decode("ascii", "replace")
                try:
                    import ml_dtypes

                    out[info.filename[:-4]] = np.dtype(getattr(ml_dtypes, name))
                except (ImportError, AttributeError, TypeError):
                    raise TypeError(
                        f"load_variables: '{info.filename[:-4]}' is stored as {name}, which needs the ml_dtypes "
                        "package (pip install ml_dtypes)"
                    ) from None
    return out


def load_variables(path: Union[str, os.PathLike[str]], variables: Variables) -> None:
    """Assigns the values stored in ``path`` to the variables (matched by key). Every
    key, shape and dtype is checked before any variable changes."""
    items = _named(variables, "load_variables")
    _require_cross_replica("load_variables", items)
    named = _stored_dtypes(os.fspath(path))
    with np.load(os.fspath(path), allow_pickle=False) as data:
        # Key k is the member "k.npy", read by that exact name: numpy's lookup by key
        # would take the member "a.npy" (key "a") for a key "a.npy".
        members = set(data.zip.namelist())
        stored = {}
        for key, v in items:
            if key + ".npy" not in members:
                keys = sorted(m[:-4] for m in members if m.endswith(".npy"))
                raise KeyError(
                    f"load_variables: {os.fspath(path)} has no value for '{key}' (it holds: "
                    f"{', '.join(keys) or 'nothing'})"
                )
            a = data[key + ".npy"]
            if key in named and a.dtype.kind == "V" and a.dtype.itemsize == named[key].itemsize:
                a = a.view(named[key])
            if not shape_allowed(v, a.shape):
                raise ValueError(
                    f"load_variables: '{key}' is stored with shape {a.shape}, the variable has {shape_text(v)}"
                )
            if a.dtype != v.dtype:
                raise TypeError(f"load_variables: '{key}' is stored as {a.dtype}, the variable is {v.dtype}")
            stored[key] = a
    for key, v in items:
        v.assign(stored[key], read_value=False)
