"""Locks that a forked child gets anew.

A thread of the parent that holds a lock when the process forks does not exist in the
child, so the child's copy of that lock stays held: the first update of a variable (or
``next`` of an iterator) that a parent's thread was making at the fork would wait on it
forever. Objects register the attribute that keeps their lock (``_lock``, or another
name for a second lock); in a forked child each gets a new lock of the same kind before
anything else runs.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

__all__ = ["renewed_after_fork", "shared_after_fork"]

# (id(owner), the attribute of its lock) -> (a weak reference to it, what makes its
# lock, weak references to the objects that share its lock). Keyed by id: variables
# cannot be hashed. An entry goes when its owner does (before its id can be reused).
_OWNERS: Dict[
    Tuple[int, str], Tuple[weakref.ReferenceType[Any], Callable[[], Any], List[weakref.ReferenceType[Any]]]
] = {}


def renewed_after_fork(owner: Any, make: Callable[[], Any] = threading.Lock, attr: str = "_lock") -> Any:
    """A new lock from ``make``, for ``owner.<attr>``; in a forked child ``owner.<attr>``
    is replaced by a new one from ``make``."""
    key = (id(owner), attr)

    def gone(_: Any, key: Tuple[int, str] = key) -> None:
        _OWNERS.pop(key, None)

    _OWNERS[key] = (weakref.ref(owner, gone), make, [])
    return make()


def shared_after_fork(owners: Sequence[Any]) -> Any:
    """One new lock, set as ``_lock`` of every one of ``owners`` (in place of the lock
    each had), so that whatever holds it excludes every update of all of them (the
    copies of a distributed variable, changed one by one or all as one change); in a
    forked child they share a new one."""
    first = owners[0]
    for o in owners:
        _OWNERS.pop((id(o), "_lock"), None)
    renewed_after_fork(first)
    _OWNERS[(id(first), "_lock")][2].extend(weakref.ref(o) for o in owners[1:])
    lock = threading.Lock()
    for o in owners:
        o._lock = lock
    return lock


def _after_fork_in_child() -> None:
    for (_, attr), (ref, make, sharing) in list(_OWNERS.items()):
        owner = ref()
        if owner is not None:
            lock = make()
            setattr(owner, attr, lock)
            for other in sharing:
                o = other()
                if o is not None:
                    setattr(o, attr, lock)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
