"""A progress bar on stderr while the sweep runs: tqdm if installed, else one plain line."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """Counts finished measurements out of ``total``; silent when ``enabled`` is false."""

    def __init__(self, total: int, enabled: bool, stream: Optional[TextIO] = None):
        self.total = max(1, int(total))
        self.done = 0
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._start = time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, file=self._stream, unit="meas", dynamic_ncols=True, leave=False)

    def tick(self, what: str) -> None:
        """One more measurement started: show what it is."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(what[:48], refresh=False)
            self._bar.update(1)
        else:
            self.done = min(self.total, self.done + 1)
            elapsed = time.monotonic() - self._start
            self._stream.write(f"\r[{self.done:4d}/{self.total}] {elapsed:6.1f} s  {what[:60]:<60}")
            self._stream.flush()
        if self._bar is not None:
            self.done = self._bar.n

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._stream.write("\r" + " " * 80 + "\r")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Progress(done={self.done}, total={self.total}, enabled={self.enabled})"
