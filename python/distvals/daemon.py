"""``start_daemon``: a daemon thread started by one C call, so that Ctrl-C cannot break it.

``threading.Thread.start`` waits for the new thread on an Event, in Python code. A
KeyboardInterrupt raised by a signal handler inside that wait can leave the Event's lock
released twice (``RuntimeError: release unlocked lock`` instead of the interrupt) and,
landing a moment earlier, a Thread object that never started, which a lazily started
service would then take for its running thread. ``_thread.start_new_thread`` is a
single C call: an interrupt lands before it (no thread) or after it (a running thread).
"""

from __future__ import annotations

import _thread
import threading
from typing import Callable

__all__ = ["start_daemon"]


def start_daemon(target: Callable[[], None], name: str) -> None:
    """Runs ``target()`` on a new daemon thread called ``name``; returns at once.

    Like every thread the ``_thread`` module starts, it does not hold up the
    interpreter's exit."""

    def main() -> None:
        # Named for debuggers and thread dumps (threading registers it on first use).
        threading.current_thread().name = name
        target()

    _thread.start_new_thread(main, ())
