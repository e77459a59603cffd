"""ReplicaGroup's life: many groups created, used and closed (or only dropped), and what
they leave behind: worker threads and memory."""

from __future__ import annotations

import gc

import numpy as np
from _group_helpers import check_all
from conftest import distinct_values, reference
from process_stats import needs_plain_malloc, os_threads, rss_bytes, settle_threads

import distvals as dv


def test_many_groups_and_64_replicas():
    groups = [dv.ReplicaGroup(3) for _ in range(20)]
    for i, g in enumerate(groups):
        bufs = [np.full(8, i + r, np.float64) for r in range(3)]
        g.all_reduce(bufs)
        for b in bufs:
            np.testing.assert_array_equal(b, np.full(8, 3 * i + 3))
        g.close()
    with dv.ReplicaGroup(64) as g:
        bufs = distinct_values(64, (4099,), np.float32)
        want = reference(bufs, "sum")
        for algo in ["ring", "tree", "direct"]:
            cur = [b.copy() for b in bufs]
            g.all_reduce(cur, algorithm=algo)
            check_all(cur, want, np.float32)


def test_many_groups_alive_together_release_their_threads():
    base = settle_threads(os_threads())
    groups = [dv.ReplicaGroup(2 + i % 3) for i in range(40)]
    assert os_threads() > base  # the groups' workers are running
    for it in range(3):
        for i, g in enumerate(groups):
            n = g.num_replicas
            bufs = [np.full(5000, i + r + it, np.float32) for r in range(n)]  # workers take part
            g.all_reduce(bufs)
            want = np.float32(sum(i + r + it for r in range(n)))
            for b in bufs:
                np.testing.assert_array_equal(b, np.full(5000, want))
    for g in groups:
        g.close()
    assert settle_threads(base) <= base


def test_groups_collected_without_close_release_their_threads():
    base = settle_threads(os_threads())
    for _ in range(20):
        g = dv.ReplicaGroup(4, threads=4)
        g.all_reduce([np.ones(50000, np.float32) for _ in range(4)])
        del g
    gc.collect()
    assert settle_threads(base) <= base


@needs_plain_malloc
def test_memory_is_stable_over_many_groups_and_calls():
    def cycle(k):
        with dv.ReplicaGroup(3) as g:
            bufs = [np.full(300, k + r, np.float64) for r in range(3)]
            g.all_reduce(bufs)
            g.all_gather(bufs)
            g.reduce_scatter([np.ones(6, np.float32) for _ in range(3)])
            assert bufs[2][0] == 3 * k + 3

    for k in range(300):
        cycle(k)
    gc.collect()
    before = rss_bytes()
    for k in range(3000):
        cycle(k)
    gc.collect()
    grown = rss_bytes() - before
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 3000 groups"


def test_pickling_a_group_or_what_holds_one_is_a_type_error_at_every_protocol():
    # Protocols 0 and 1 reached the native constructor through copyreg, which aborted the
    # process; in a child, so that a regression fails this test instead of killing the run.
    import subprocess
    import sys

    program = """
import copy, pickle, numpy as np, distvals as dv
s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
with s.scope():
    v = dv.Variable(np.ones(2))
for what in (dv.ReplicaGroup(2)._group, dv.ReplicaGroup(2), v, s):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        try:
            pickle.dumps(what, protocol)
        except TypeError as e:
            assert "cannot pickle" in str(e), e
        else:
            raise AssertionError(f"{type(what).__name__} pickled at protocol {protocol}")
try:
    copy.copy(dv.ReplicaGroup(2)._group)
except TypeError:
    pass
else:
    raise AssertionError("a native group was copied")
print("refused")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stdout + done.stderr
