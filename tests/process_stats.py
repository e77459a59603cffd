"""What the kernel says about this test process: OS threads (C++ workers included) and
resident memory, for the resource-hygiene tests."""

from __future__ import annotations

import os
import time

import pytest


def os_threads() -> int:
    """Threads of this process as the kernel counts them (engine workers included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads line in /proc/self/status")


def _under_asan() -> bool:
    """AddressSanitizer keeps freed memory in quarantine: RSS says nothing then."""
    with open("/proc/self/maps") as f:
        return "libasan" in f.read()


needs_plain_malloc = pytest.mark.skipif(_under_asan(), reason="RSS is meaningless under AddressSanitizer")
# GCC 12's libasan neither intercepts fork() nor registers fork handlers: a child forked
# while another thread holds the sanitizer allocator's lock (numpy allocating, say)
# deadlocks at its first allocation. glibc's malloc takes its locks around fork(). Any
# fork in a test process is exposed: earlier tests leave engine worker threads and the
# inline watchdog (which wakes on its own schedule) in the process (once in about ten
# runs of the sanitizer job, a child forked with no thread of its own test busy hung).
forks_while_threads_allocate = pytest.mark.skipif(
    _under_asan(), reason="AddressSanitizer's allocator (GCC 12) can deadlock a child forked while threads allocate"
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle_threads(limit: int, timeout: float = 10.0) -> int:
    """The OS thread count once it drops to `limit` (exited threads take a moment)."""
    end = time.monotonic() + timeout
    n = os_threads()
    while n > limit and time.monotonic() < end:
        time.sleep(0.01)
        n = os_threads()
    return n
