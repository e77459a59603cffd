"""The benchmark: small sizes, table fields, result checking, JSON schema, peers.

Nothing here is timed: these tests check that ``python -m distvals.bench`` measures
what it says, detects wrong results, and reports every peer, present or not.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import distvals
from distvals.bench import cli, compare, core, memory
from distvals.bench.peers import PEERS, runner_path
from distvals.bench.peers import bench_data as bd
from distvals.bench.progress import Progress
from distvals.bench.results import SCHEMA, PeerStatus, Report, Row, bus_factor
from distvals.bench.table import format_report, format_size, over_bound

ENGINE_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
DTYPE_OPS = [(d, op) for d in ENGINE_DTYPES for op in bd.OPS if op != "mean" or d.startswith("float")]

# Modules each peer needs in the interpreter that runs it.
PEER_MODULES = {"numpy": "numpy", "tensorflow": "tensorflow", "torch-gloo": "torch", "mpi4py": "mpi4py"}


def numpy_reference(arrays, op):
    stack = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    return {
        "sum": stack.sum(0),
        "mean": stack.mean(0),
        "prod": stack.prod(0),
        "min": stack.min(0),
        "max": stack.max(0),
    }[op]


def run_cli(capsys, *args):
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- inputs, references and wrong-element counting -------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reference_matches_numpy_and_correct_results_count_zero(n, dtype, op):
    count = 1031
    inputs = [bd.make_input(n, r, count, dtype, op) for r in range(n)]
    want = numpy_reference(inputs, op)
    np.testing.assert_array_equal(bd.reference(n, count, dtype, op), want)
    # A correct all-reduce: every replica holds the reference, rounded to the dtype.
    results = [want.astype(inputs[0].dtype) for _ in range(n)]
    assert bd.count_wrong(results, n, dtype, op) == 0


@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_inputs_are_distinct_per_replica_and_exact(dtype, op):
    n, count = 4, 4096
    inputs = [bd.make_input(n, r, count, dtype, op) for r in range(n)]
    for r in range(1, n):
        assert np.count_nonzero(inputs[r] != inputs[0]) > count // 4, f"replica {r} too close to replica 0"
    assert len(np.unique(inputs[0])) > 1
    ref = numpy_reference(inputs, op)
    if op != "mean":  # the reference is representable exactly in the dtype
        np.testing.assert_array_equal(ref.astype(inputs[0].dtype).astype(np.float64), ref)


@pytest.mark.parametrize(
    "dtype,op", [("float32", "sum"), ("float16", "mean"), ("int8", "max"), ("float64", "prod"), ("int32", "sum")]
)
def test_count_wrong_counts_each_corrupted_element(dtype, op):
    n, count = 3, bd.PERIOD + 17  # crosses a period boundary
    want = bd.reference(n, count, dtype, op)
    dt = bd.resolve_dtype(dtype)
    results = [want.astype(dt) for _ in range(n)]
    rng = np.random.default_rng(5)
    bad0 = rng.choice(count, size=7, replace=False)
    results[0][bad0] += 1
    results[2][count - 1] -= 1  # the tail past the first period
    assert bd.count_wrong(results, n, dtype, op) == 8
    if dt.kind == "f":
        results[1][3] = np.nan
        results[1][4] = np.inf
        assert bd.count_wrong(results, n, dtype, op) == 10


@pytest.mark.parametrize("n", [8, 12])
def test_uint8_products_over_many_replicas_still_catch_a_lost_replica(n):
    # 2**n no longer fits in uint8: the inputs were all ones, so any result passed.
    count = 4096
    inputs = [bd.make_input(n, r, count, "uint8", "prod") for r in range(n)]
    assert len({a.tobytes() for a in inputs}) == n  # distinct per replica
    want = numpy_reference(inputs, "prod")
    assert want.max() <= 255 and want.max() > 1
    assert bd.count_wrong([want.astype(np.uint8)] * n, n, "uint8", "prod") == 0
    assert bd.count_wrong([inputs[0].copy() for _ in range(n)], n, "uint8", "prod") > count // 4
    dropped = numpy_reference(inputs[1:], "prod").astype(np.uint8)
    assert bd.count_wrong([dropped] * n, n, "uint8", "prod") > count // 8


def test_rows_that_move_no_data_have_no_bandwidth_or_bound():
    # A step without a collective, and one replica's in-place all-reduce (nothing to do).
    common = dict(
        impl="distvals", algorithm="auto", dtype="float32", op="sum", bytes=1 << 22, count=1 << 20, iters=5, wrong=0
    )
    common["checked"] = 0
    trivial = Row(level="strategy-trivial", replicas=2, time_us=5.0, **common).finish(100.0)
    alone = Row(level="group", replicas=1, time_us=0.2, **common).finish(100.0)
    alone_out = Row(level="group", replicas=1, time_us=200.0, out_of_place=True, **common).finish(100.0)
    for row in (trivial, alone):
        assert row.algbw_gbps == 0.0 and row.busbw_gbps == 0.0 and row.bound_pct is None
        assert not over_bound(row, None)
    assert alone_out.algbw_gbps > 0 and alone_out.bound_pct == pytest.approx(50.0)


def test_count_wrong_flags_a_replica_left_unreduced():
    n, count, dtype, op = 2, 5000, "float32", "sum"
    inputs = [bd.make_input(n, r, count, dtype, op) for r in range(n)]
    want = numpy_reference(inputs, op).astype(np.float32)
    # Replica 1 kept its own input: every element where that differs from the sum is wrong.
    expected = int(np.count_nonzero(inputs[1] != want))
    assert expected > count // 2
    assert bd.count_wrong([want, inputs[1]], n, dtype, op) == expected


def test_count_wrong_with_count_flags_short_empty_and_missing_results():
    n, count, dtype, op = 3, 65_536, "float32", "sum"
    want = bd.reference(n, count, dtype, op).astype(np.float32)
    full = [want.copy() for _ in range(n)]
    assert bd.count_wrong(full, n, dtype, op, count=count, copies=n) == 0
    # A result cut short matches the reference as far as it goes: without count it passes.
    short = [want.copy(), want[:10].copy(), want.copy()]
    assert bd.count_wrong(short, n, dtype, op) == 0
    assert bd.count_wrong(short, n, dtype, op, count=count, copies=n) == count
    assert bd.count_wrong([want, np.empty(0, np.float32), want], n, dtype, op, count=count, copies=n) == count
    assert bd.count_wrong(full[:1], n, dtype, op, count=count, copies=n) == 2 * count
    assert bd.count_wrong([], n, dtype, op, count=count, copies=n) == n * count


def test_mean_with_rounding_uses_a_tolerance():
    n, count = 3, 999
    want = bd.reference(n, count, "float32", "mean")
    got = want.astype(np.float32)  # rounded: not exact for N=3
    assert bd.count_wrong([got] * n, n, "float32", "mean") == 0
    got[10] += 1e-3
    assert bd.count_wrong([got] * n, n, "float32", "mean") == n


def test_resolve_dtype_and_ops_reject_bad_names():
    with pytest.raises(ValueError, match="unknown dtype"):
        bd.resolve_dtype("complex64")
    with pytest.raises(ValueError, match="unknown op"):
        bd.canonical_op("xor")
    with pytest.raises(ValueError, match="mean needs a floating dtype"):
        bd.check_op_dtype("mean", "int32")
    assert bd.canonical_op("PRODUCT") == "prod"


# --- sizes and iteration plan -----------------------------------------------------------


def test_default_sweep_holds_the_headline_sizes():
    sizes = cli.sweep_sizes(8, 256 << 20)
    assert sizes[0] == 8 and sizes[-1] == 256 << 20
    for s in (1 << 10, 1 << 20, 16 << 20, 256 << 20):
        assert s in sizes
    assert all(b == 4 * a for a, b in itertools.pairwise(sizes[1:]))
    plan = cli.build_plan(sizes, "float32", 1000, 5)
    iters = [i for _, i in plan]
    assert iters[0] == 1000 and iters[-1] == 5
    assert all(a >= b for a, b in itertools.pairwise(iters))


def test_plan_rounds_sizes_to_whole_elements():
    assert cli.build_plan([1, 8, 12, 64], "float64", 10, 1) == [(8, 10), (64, 10)]
    # A size given twice, apart, is measured once (its rows would merge in the table).
    assert cli.build_plan([1024, 2048, 1024], "float32", 10, 1) == [(1024, 10), (2048, 10)]
    assert cli.parse_size("16M") == 16 << 20 and cli.parse_size("1KiB") == 1024 and cli.parse_size("8") == 8
    assert format_size(16 << 20) == "16 MiB" and format_size(1000) == "1000 B"


# --- distvals measurements --------------------------------------------------------------


def test_measure_group_row_fields_and_verification():
    n, count = 3, 10_000
    with distvals.ReplicaGroup(n) as g:
        bufs = [np.empty(count, np.float32) for _ in range(n)]
        row = core.measure_group(g, bufs, "float32", "sum", "ring", iters=5)
    assert row.wrong == 0 and row.checked == 2 * n * count
    assert row.bytes == 4 * count and row.count == count and row.replicas == n
    assert row.time_us > 0 and row.py_time_us > 0 and row.timing == "engine"
    row.finish(bound_us=row.time_us / 2)
    assert math.isclose(row.algbw_gbps, row.bytes / (row.time_us * 1e-6) / 1e9)
    assert math.isclose(row.busbw_gbps, row.algbw_gbps * 2 * (n - 1) / n)
    assert math.isclose(row.bound_pct, 50.0)


class _BrokenGroup:
    """A stand-in group whose all-reduce forgets the last replica's contribution."""

    def __init__(self, n):
        self.num_replicas = n
        self.engine = self

    def all_reduce(self, bufs, op="sum", algorithm="auto", out=None):
        total = np.sum([b.astype(np.float64) for b in bufs[:-1]], axis=0)
        for b in bufs:
            b[...] = total


def test_measure_group_counts_wrong_results(monkeypatch):
    n, count = 2, 3000
    group = _BrokenGroup(n)

    def broken_time_all_reduce(engine, bufs, op, algo, iters, warmup):
        engine.all_reduce(bufs)
        return np.full(iters, 1e-6)

    monkeypatch.setattr(core._core, "time_all_reduce", broken_time_all_reduce)
    monkeypatch.setattr(core._core, "choose_algorithm", lambda n, b: "direct")
    bufs = [np.empty(count, np.float32) for _ in range(n)]
    row = core.measure_group(group, bufs, "float32", "sum", "auto", iters=3)
    inputs = [bd.make_input(n, r, count, "float32", "sum") for r in range(n)]
    # Wrong wherever replica 1's value was not zero, on both replicas, through both entry points.
    expected = 2 * n * int(np.count_nonzero(inputs[1]))
    assert row.wrong == expected > 0


def test_cli_exit_code_reports_wrong_results(monkeypatch, capsys):
    real = core._core.time_all_reduce

    def off_by_one(engine, bufs, op, algo, iters, warmup):
        t = real(engine, bufs, op, algo, iters, warmup)
        bufs[0][0] += 1
        return t

    monkeypatch.setattr(core._core, "time_all_reduce", off_by_one)
    rc, out, err = run_cli(capsys, "--sizes", "64", "--iters", "3", "--algo", "ring", "--no-progress")
    assert rc == 1 and "wrong result elements" in err
    line = next(ln for ln in out.splitlines() if "distvals ring" in ln)
    assert line.split()[-1] == "1"


# --- the command line, table and JSON ---------------------------------------------------


def _table_rows(out):
    return [ln.split() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]


def test_cli_table_has_every_size_algorithm_and_replica_count(capsys, tmp_path):
    path = tmp_path / "r.json"
    rc, out, _ = run_cli(
        capsys, "--replicas", "2", "3", "--sizes", "8,1K,64K", "--iters", "20", "--json", str(path), "--no-progress"
    )
    assert rc == 0
    assert "busbw" in out and "%bound" in out and "#wrong" in out
    rows = _table_rows(out)
    for n in (2, 3):
        assert f"{n} replicas" in out
    measured = [r for r in rows if r[5] == "distvals"]
    assert len(measured) == 2 * 3 * 4  # N x sizes x algorithms
    for r in measured:
        assert r[2] == "float32" and r[3] == "sum" and r[-1] == "0"
        assert r[4] in ("L1", "L2", "L3", "L4", "DRAM")
        assert float(r[7]) > 0 and float(r[10]) >= 0
    bounds = [r for r in rows if "(memory" in r]
    assert len(bounds) == 2 * 3
    for r in bounds:
        assert r[-1].startswith("±") and float(r[-1][1:]) >= 0  # the size's noise
    assert "# caches (" in out and "noise, N=2" in out and "noise, N=3" in out
    doc = json.loads(path.read_text())
    check_schema(doc)
    assert {r["replicas"] for r in doc["results"]} == {2, 3}
    assert {r["bytes"] for r in doc["results"]} == {8, 1024, 65536}
    assert {r["algorithm"] for r in doc["results"]} == {"ring", "tree", "direct", "auto"}
    assert doc["command"].startswith("python -m distvals.bench --replicas 2 3")


def check_schema(doc):
    assert doc["schema"] == SCHEMA
    for key in ("command", "settings", "machine", "memory_bound", "results", "peers", "speedups", "notes"):
        assert key in doc, key
    for b in doc["memory_bound"]:
        assert b["bound_us"] == min(min(v) for v in b["variants"].values()) > 0
        assert math.isclose(b["gbps"], 2 * b["replicas"] * b["bytes"] / b["bound_us"] / 1e3)
        assert b["level"] in ("L1", "L2", "L3", "L4", "DRAM") and b["threads"] >= 1
        assert b["samples"] >= core.MIN_BOUND_SAMPLES and b["noise_pct"] >= 0
        assert all(len(v) == b["samples"] for v in b["variants"].values())
    assert doc["machine"]["caches"] and doc["machine"]["caches_source"] in ("sysfs", "sysconf", "assumed")
    for r in doc["results"]:
        assert isinstance(r["impl"], str) and isinstance(r["wrong"], int) and r["checked"] >= r["count"]
        assert r["count"] * np.dtype(r["dtype"]).itemsize == r["bytes"]
        assert math.isclose(r["algbw_gbps"], r["bytes"] / r["time_us"] / 1e3)
        assert math.isclose(r["busbw_gbps"], r["algbw_gbps"] * bus_factor(r["replicas"]))
        bound = [b for b in doc["memory_bound"] if (b["replicas"], b["bytes"]) == (r["replicas"], r["bytes"])]
        assert len(bound) == 1
        assert math.isclose(r["bound_pct"], 100 * bound[0]["bound_us"] / r["time_us"])
        if r["impl"] == "distvals" and r["level"] == "group":
            assert r["timing"] == "engine" and r["py_time_us"] > 0
    Report.from_json(doc)  # round trip


def test_cli_json_to_stdout_is_only_json(capsys):
    rc, out, _ = run_cli(
        capsys,
        "--sizes",
        "1K",
        "--iters",
        "5",
        "--algo",
        "auto",
        "--dtype",
        "int32",
        "--op",
        "max",
        "--json",
        "--no-progress",
    )
    assert rc == 0
    doc = json.loads(out)
    check_schema(doc)
    (row,) = doc["results"]
    assert (row["dtype"], row["op"], row["algorithm"], row["wrong"]) == ("int32", "max", "auto", 0)
    assert row["chosen"] in ("ring", "tree", "direct")


def test_cli_load_prints_the_same_report(capsys, tmp_path):
    path = tmp_path / "r.json"
    run_cli(capsys, "--sizes", "256", "--iters", "5", "--json", str(path), "--no-progress")
    doc = json.loads(path.read_text())
    rc, out, _ = run_cli(capsys, "--load", str(path))
    assert rc == 0
    assert out == format_report(Report.from_json(doc))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtype", "int32", "--op", "mean"], "mean needs a floating dtype"),
        (["--min-bytes", "1M", "--max-bytes", "1K"], "larger than --max-bytes"),
        (["--compare", "--peers", "jax"], "unknown peer"),
        (["--sizes", "0"], "at least 1 byte"),
        (["--replicas", "0"], "at least 1"),
        (["--iters", "0"], "--iters and --min-iters must be at least 1"),
        (["--min-iters", "0"], "--iters and --min-iters must be at least 1"),
    ],
)
def test_cli_rejects_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_without_tqdm_writes_a_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    stream = io.StringIO()
    with Progress(3, enabled=True, stream=stream) as p:
        p.tick("N=2 1024 B distvals ring")
        p.tick("N=2 1024 B distvals tree")
    text = stream.getvalue()
    assert "[   1/3]" in text and "[   2/3]" in text and "distvals tree" in text
    silent = io.StringIO()
    with Progress(3, enabled=False, stream=silent) as p:
        p.tick("x")
    assert silent.getvalue() == ""


# --- the memory bound -------------------------------------------------------------------


def _fake_cache(root, index, level, kind, size, shared):
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_cache_levels_from_sysfs_skip_instruction_caches(tmp_path):
    _fake_cache(tmp_path, 0, 1, "Data", "32K", "0")
    _fake_cache(tmp_path, 1, 1, "Instruction", "64K", "0")
    _fake_cache(tmp_path, 2, 2, "Unified", "512K", "0")
    _fake_cache(tmp_path, 3, 3, "Unified", "32768K", "0-3,8,10-11")
    caches, source = memory.cache_levels(str(tmp_path))
    assert source == "sysfs"
    assert caches == [memory.Cache(1, 32 << 10, 1), memory.Cache(2, 512 << 10, 1), memory.Cache(3, 32 << 20, 7)]
    assert caches[2].describe() == "L3 32 MiB shared by 7 CPUs" and caches[0].describe() == "L1 32 KiB per core"


def test_cache_levels_fall_back_without_sysfs(tmp_path, monkeypatch):
    caches, source = memory.cache_levels(str(tmp_path / "absent"))
    assert source in ("sysconf", "assumed") and caches
    monkeypatch.setattr(memory, "_from_sysconf", list)
    caches, source = memory.cache_levels(str(tmp_path / "absent"))
    assert source == "assumed" and [c.name for c in caches] == ["L1", "L2", "L3"]


def test_level_of_counts_private_caches_per_thread():
    caches = [memory.Cache(1, 32 << 10, 1), memory.Cache(2, 512 << 10, 1), memory.Cache(3, 32 << 20, 2)]
    assert memory.level_of(2, 8 << 10, 1, caches) == "L1"  # 16 KiB on one core
    assert memory.level_of(2, 16 << 10, 2, caches) == "L1"  # 32 KiB over two cores' L1
    assert memory.level_of(2, 64 << 10, 2, caches) == "L2"
    assert memory.level_of(2, 512 << 10, 2, caches) == "L2"  # 1 MiB over two L2s
    assert memory.level_of(2, 512 << 10, 1, caches) == "L3"
    assert memory.level_of(2, 16 << 20, 2, caches) == "L3"  # 32 MiB: the shared L3 exactly
    assert memory.level_of(2, 64 << 20, 2, caches) == "DRAM"
    assert memory.level_of(4, 16 << 20, 4, caches) == "L3"  # 64 MiB over two L3 instances
    assert memory.level_of(4, 32 << 20, 4, caches) == "DRAM"
    assert memory.level_of(4, 8 << 20, 4, caches) == "L3"


def test_bound_variants_by_size():
    caches = [memory.Cache(1, 32 << 10, 1), memory.Cache(2, 512 << 10, 1), memory.Cache(3, 32 << 20, 2)]
    assert memory.bound_variants(2, 1024, 2, caches, streaming=True) == [(2, False), (1, False)]
    assert memory.bound_variants(2, 4 << 20, 2, caches, streaming=True) == [(2, False), (2, True)]
    assert memory.bound_variants(2, 64 << 20, 2, caches, streaming=False) == [(2, False)]
    assert memory.bound_variants(2, 1024, 1, caches, streaming=True) == [(1, False)]
    assert memory.parse_cpu_list("0-1") == 2 and memory.parse_cpu_list("3") == 1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streaming", [False, True])
def test_time_memory_bound_keeps_every_byte(threads, streaming):
    rng = np.random.default_rng(threads)
    # Odd sizes and offsets: unaligned heads and tails on every buffer.
    for count, offset in ((1, 0), (37, 1), (4099, 3), (100_003, 5)):
        raw = [rng.integers(0, 256, count + 8, dtype=np.uint8) for _ in range(3)]
        bufs = [r[offset : offset + count] for r in raw]
        before = [r.copy() for r in raw]
        t = distvals._core.time_memory_bound(bufs, threads, streaming, 4, 1)
        assert t.shape == (4,) and (t > 0).all()
        for r, b in zip(raw, before):
            np.testing.assert_array_equal(r, b)
    wide = [np.arange(1000, dtype=np.float64) for _ in range(2)]
    distvals._core.time_memory_bound(wide, threads, streaming, 2, 0)
    np.testing.assert_array_equal(wide[1], np.arange(1000, dtype=np.float64))


@pytest.mark.parametrize("threads", [2, 6])
def test_time_memory_bound_finishes_with_late_workers(threads):
    """Many short rounds, where a worker often wakes after the caller took its share:
    every measurement ends (a late worker once claimed an old round's share back and the
    caller waited forever). Run in a child process with a deadline, so a hang fails."""
    code = textwrap.dedent(
        f"""
        import numpy as np
        from distvals import _core
        bufs = [np.zeros(64, np.float32) for _ in range({threads})]
        for _ in range(25):
            t = _core.time_memory_bound(bufs, {threads}, False, 20000, 0)
            assert t.shape == (20000,) and (t > 0).all()
        print("ok")
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("time_memory_bound did not finish within 240 s")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streaming", [False, True])
def test_time_memory_bound_into_outputs_copies_every_byte(threads, streaming):
    """The out-of-place bound writes each buffer into its output (every byte, unaligned
    heads and tails too, an output offset differently from its buffer) and keeps the
    buffers as they were."""
    rng = np.random.default_rng(10 + threads)
    for count, offset, out_offset in ((1, 0, 0), (37, 1, 2), (4099, 3, 0), (100_003, 5, 7)):
        raw = [rng.integers(0, 256, count + 8, dtype=np.uint8) for _ in range(3)]
        bufs = [r[offset : offset + count] for r in raw]
        before = [r.copy() for r in raw]
        out_raw = [np.full(count + 8, 0xAB, np.uint8) for _ in range(3)]
        outs = [o[out_offset : out_offset + count] for o in out_raw]
        t = distvals._core.time_memory_bound(bufs, threads, streaming, 3, 1, out=outs)
        assert t.shape == (3,) and (t > 0).all()
        for r, b in zip(raw, before):
            np.testing.assert_array_equal(r, b)
        for o, out, b in zip(out_raw, outs, bufs):
            np.testing.assert_array_equal(out, b)
            # Nothing outside the output's bytes is written.
            assert (o[:out_offset] == 0xAB).all() and (o[out_offset + count :] == 0xAB).all()


def test_time_memory_bound_rejects_outputs_that_do_not_fit():
    a, b = np.zeros(10, np.float32), np.ones(10, np.float32)
    o = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="1 outputs for 2 buffers"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[o])
    with pytest.raises(ValueError, match="output 1 needs the buffers' count and dtype"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[o, np.zeros(9, np.float32)])
    with pytest.raises(ValueError, match="output 1 needs"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[o, np.zeros(10, np.float64)])
    # The collectives' own overlap check (which names the two arrays in address order).
    with pytest.raises(ValueError, match="replica (0's output|1's input) overlaps replica (1's input|0's output)"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[b, o])
    with pytest.raises(ValueError, match="output 1 is its buffer"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[o, b])
    big = np.zeros(30, np.float32)
    with pytest.raises(ValueError, match="replica [01]'s output overlaps replica [01]'s output"):
        distvals._core.time_memory_bound([a, b], 1, False, 1, 0, out=[big[:10], big[5:15]])
    # Refused before any byte is written.
    assert (o == 0).all() and (b == 1).all() and (big == 0).all()


def test_time_memory_bound_rejects_bad_arguments():
    a, b = np.zeros(10, np.float32), np.zeros(11, np.float32)
    with pytest.raises(ValueError):
        distvals._core.time_memory_bound([a, b], 2, False, 3, 1)
    with pytest.raises(ValueError):
        distvals._core.time_memory_bound([a, a.copy()], 0, False, 3, 1)
    with pytest.raises(ValueError):
        distvals._core.time_memory_bound([], 1, False, 3, 1)
    with pytest.raises(ValueError):
        distvals._core.time_memory_bound([a.copy()], 1, False, 0, 1)


def test_bound_meter_takes_the_fastest_median_and_states_the_noise(monkeypatch):
    medians = iter([5.0, 4.0, 6.0, 3.0, 5.5, 4.5])  # (2 thr, 1 thr) per sample

    def fake(bufs, threads, streaming, iters, warmup, out=None):
        assert out is None
        return np.full(iters, next(medians) * 1e-6)

    monkeypatch.setattr(memory._core, "time_memory_bound", fake)
    caches = [memory.Cache(1, 32 << 10, 1), memory.Cache(2, 512 << 10, 1), memory.Cache(3, 32 << 20, 2)]
    bufs = [np.zeros(256, np.float32) for _ in range(2)]
    meter = memory.BoundMeter(bufs, 2, 2, caches, 5, 1)
    assert meter.variants == [(2, False), (1, False)]
    for _ in range(3):
        meter.sample()
    b = meter.result()
    assert b["bound_us"] == 3.0 and (b["threads"], b["streaming"]) == (1, False)
    assert math.isclose(b["noise_pct"], 100 * (4.5 / 3.0 - 1))
    assert b["variants"] == {"2 thr": [5.0, 6.0, 5.5], "1 thr": [4.0, 3.0, 4.5]}
    assert b["level"] == "L1" and b["samples"] == 3 and b["bytes"] == 1024
    assert math.isclose(b["gbps"], 2 * 2 * 1024 / 3.0 / 1e3)
    assert b["out_of_place"] is False


def test_bound_meter_into_outputs_counts_twice_the_working_set(monkeypatch):
    """Out of place, the bound is measured into the outputs, and the working set (which
    names the level and the ways to measure it) spans buffers and outputs."""
    seen = []

    def fake(bufs, threads, streaming, iters, warmup, out=None):
        seen.append(out)
        return np.full(iters, 2e-6 / threads)  # the group's two threads win

    monkeypatch.setattr(memory._core, "time_memory_bound", fake)
    caches = [memory.Cache(1, 32 << 10, 1), memory.Cache(2, 512 << 10, 1), memory.Cache(3, 32 << 20, 2)]
    # 2 replicas x 384 KiB on 2 threads: 768 KiB in place fits the two cores' L2 (2 x 512
    # KiB); with the outputs, 1.5 MiB does not.
    bufs = [np.zeros(96 << 10, np.float32) for _ in range(2)]
    outs = [np.zeros_like(b) for b in bufs]
    inplace = memory.BoundMeter(bufs, 2, 2, caches, 3, 0)
    meter = memory.BoundMeter(bufs, 2, 2, caches, 3, 0, outs=outs)
    meter.sample()
    assert seen and all(o is not None and o[0] is outs[0] and o[1] is outs[1] for o in seen)
    b = meter.result()
    assert b["out_of_place"] is True and b["bytes"] == 384 << 10
    inplace.sample()
    assert inplace.result()["level"] == "L2" and b["level"] == "L3"
    # Streaming stores are tried once the working set leaves the private caches.
    assert (2, True) not in inplace.variants and (2, True) in meter.variants


def test_rows_beating_the_bound_beyond_the_noise_are_flagged():
    def row(t):
        return Row("distvals", "group", "auto", 2, 1024, 256, "float32", "sum", t, 10, 0, 512).finish(1.0)

    bound = {
        "replicas": 2,
        "bytes": 1024,
        "bound_us": 1.0,
        "level": "L1",
        "threads": 1,
        "streaming": False,
        "noise_pct": 10.0,
        "samples": 3,
        "variants": {"1 thr": [1.0, 1.05, 1.1]},
        "gbps": 2.0,
    }
    within, beyond = row(0.95), row(0.8)  # 105% and 125%
    assert not over_bound(within, bound) and over_bound(beyond, bound)
    text = format_report(Report("cmd", {"dtype": "float32", "op": "sum"}, {}, rows=[within], bounds=[bound]))
    assert "105.3 " in text and "rows above 100% of the bound by more than the noise: none" in text
    text = format_report(Report("cmd", {"dtype": "float32", "op": "sum"}, {}, rows=[beyond], bounds=[bound]))
    assert "125.0!" in text and "distvals auto at 1 KiB: 125.0% (noise ±10.0%)" in text


def test_a_version_1_report_still_loads(capsys, tmp_path):
    doc = {
        "schema": "distvals.bench/1",
        "command": "python -m distvals.bench",
        "settings": {"dtype": "float32", "op": "sum"},
        "machine": {},
        "peers": [],
        "notes": [],
        "memory_bound": [
            {"replicas": 2, "bytes": 1024, "bound_us": 2.0, "copy_samples_us": [2.0, 3.0], "copy_gbps": 1.0}
        ],
        "results": [
            Row("distvals", "group", "auto", 2, 1024, 256, "float32", "sum", 1.0, 10, 0, 512).finish(2.0).to_json()
        ],
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run_cli(capsys, "--load", str(path))
    assert rc == 0 and "(memory bound, copy)" in out and "not a true bound" in out


# --- out of place and streaming stores --------------------------------------------------


def test_out_of_place_rows_are_checked_and_compared(capsys, tmp_path):
    path = tmp_path / "o.json"
    before = distvals._core.streaming_store_min_bytes()
    rc, out, _ = run_cli(
        capsys,
        "--sizes",
        "1K,64K",
        "--iters",
        "5",
        "--algo",
        "auto",
        "--out-of-place",
        "--streaming-min-bytes",
        "0",
        "--json",
        str(path),
        "--no-progress",
    )
    assert rc == 0
    assert distvals._core.streaming_store_min_bytes() == before  # restored after the run
    doc = json.loads(path.read_text())
    assert doc["settings"]["out_of_place"] is True and doc["settings"]["streaming_min_bytes"] == 0
    oop = [r for r in doc["results"] if r["out_of_place"]]
    assert sorted(r["bytes"] for r in oop) == [1024, 65536]
    assert all(r["wrong"] == 0 and r["checked"] == 2 * 2 * r["count"] for r in oop)
    assert "distvals auto/direct out" in out and "# out of place / in place, N=2" in out
    assert "never" and cli.parse_args(["--streaming-min-bytes", "never"]).streaming_min_bytes == 2**64 - 1
    assert cli.parse_args(["--streaming-min-bytes", "4M"]).streaming_min_bytes == 4 << 20


def test_measure_group_out_of_place_counts_wrong_results_in_the_outputs():
    n, count = 2, 5000
    with distvals.ReplicaGroup(n) as g:
        bufs = [np.empty(count, np.float32) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        row = core.measure_group(g, bufs, "float32", "sum", "auto", iters=3, out=outs)
        assert row.wrong == 0 and row.out_of_place and row.label.endswith(" out")
        np.testing.assert_array_equal(outs[0], bd.reference(n, count, "float32", "sum").astype(np.float32))
        # The inputs are untouched by out-of-place calls.
        np.testing.assert_array_equal(bufs[1], bd.make_input(n, 1, count, "float32", "sum"))


# --- the strategy level -----------------------------------------------------------------


def test_strategy_level_rows_or_a_note(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "--sizes", "8,4K", "--iters", "5", "--api", "strategy", "--json", "--no-progress")
    assert rc == 0
    doc = json.loads(out)
    if not core.has_strategy():
        assert any("no MirroredStrategy" in n for n in doc["notes"])
        assert doc["results"] == []
        return
    modes = [core.mode_label(m) for m in core.strategy_modes()]
    assert doc["settings"]["execution_modes"] == modes
    for level in ("strategy", "strategy-trivial", "strategy-structure"):
        rows = [r for r in doc["results"] if r["level"] == level]
        assert sorted((r["mode"], r["bytes"]) for r in rows) == sorted((m, b) for m in modes for b in (8, 4096))
    for r in doc["results"]:
        if r["level"] in ("strategy", "strategy-structure"):
            assert r["wrong"] == 0 and r["checked"] == 2 * r["count"] and r["time_us"] > 0
            assert r["group_py_us"] > 0 and r["group_out_py_us"] > 0
            # The ratios are this row's time over the baselines measured beside it.
            row = Row.from_json(r)
            assert row.ratio_to_group == pytest.approx(r["time_us"] / r["group_py_us"])
            assert row.ratio_to_group_out == pytest.approx(r["time_us"] / r["group_out_py_us"])
            assert r["out_bound_us"] > 0
            assert row.ratio_to_out_bound == pytest.approx(r["time_us"] / r["out_bound_us"])
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run_cli(capsys, "--load", str(path))
    assert rc == 0 and "# strategy.run, N=2" in out and "structure" in out and "out ratio" in out
    for m in modes:
        assert f"{m}: group" in out and "trivial" in out
    # Each mode's ratio is printed beside the group time it is a ratio to.
    from distvals.bench.table import _num

    for r in doc["results"]:
        if r["level"] == "strategy":
            table = out.split("# strategy.run, N=2")[1].split("\n\n")[0]
            line = next(x for x in table.splitlines() if x.split() and x.split()[0] == str(r["bytes"]))
            assert f"{_num(r['group_py_us'])} {_num(r['group_out_py_us']):>10}" in line
            b_ratio = f"{r['time_us'] / r['out_bound_us']:.2f}x"
            assert f"{_num(r['out_bound_us']):>13} {b_ratio:>11}" in line


class _ModalStrategy(distvals.MirroredStrategy):
    """A MirroredStrategy that takes ``execution=`` (as later versions do); modes are recorded."""

    created = []

    def __init__(self, devices=None, cross_device_ops=None, communication_options=None, execution="auto"):
        if execution not in ("auto", "inline", "threads"):
            raise ValueError(f"unknown execution {execution!r}")
        super().__init__(devices, cross_device_ops, communication_options)
        _ModalStrategy.created.append(execution)


def test_strategy_modes_side_by_side_when_the_strategy_takes_execution(capsys, monkeypatch, tmp_path):
    if not core.has_strategy():
        pytest.skip("this distvals has no MirroredStrategy")
    assert core.strategy_modes() in ([None], ["inline", "threads"])
    monkeypatch.setattr(distvals, "MirroredStrategy", _ModalStrategy)
    _ModalStrategy.created.clear()
    assert core.strategy_modes() == ["inline", "threads"]
    path = tmp_path / "m.json"
    rc, out, _ = run_cli(
        capsys,
        "--sizes",
        "8,1K",
        "--iters",
        "5",
        "--api",
        "all",
        "--algo",
        "auto",
        "--json",
        str(path),
        "--no-progress",
    )
    assert rc == 0
    assert _ModalStrategy.created == ["inline", "threads"]
    doc = json.loads(path.read_text())
    assert doc["settings"]["execution_modes"] == ["inline", "threads"]
    strat = [r for r in doc["results"] if r["level"] in ("strategy", "strategy-trivial")]
    assert sorted({(r["mode"], r["level"]) for r in strat}) == [
        ("inline", "strategy"),
        ("inline", "strategy-trivial"),
        ("threads", "strategy"),
        ("threads", "strategy-trivial"),
    ]
    assert "inline: group" in out and "threads: group" in out
    assert "distvals strategy inline" in out and "distvals strategy threads" in out
    # A peer is compared with each mode.
    report = Report.from_json(doc)
    report.rows.append(Row("tensorflow", "peer", "", 2, 1024, 256, "float32", "sum", 500.0, 10, 0, 512))
    levels = {s["distvals"] for s in compare.speedups(report)}
    assert levels == {"group", "strategy inline", "strategy threads"}
    text = format_report(report)
    assert "execution inline" in text and "execution threads" in text and "tensorflow" in text


# --- peers ------------------------------------------------------------------------------


def test_missing_interpreter_lists_every_peer_as_missing(capsys, tmp_path):
    rc, out, _ = run_cli(
        capsys,
        "--compare",
        "--replicas",
        "2",
        "--sizes",
        "64",
        "--iters",
        "3",
        "--api",
        "group",
        "--algo",
        "auto",
        "--peer-python",
        str(tmp_path / "no-python"),
        "--json",
        "--no-progress",
    )
    assert rc == 0
    doc = json.loads(out)
    status = {p["name"]: p for p in doc["peers"]}
    assert set(status) == set(PEERS)
    for p in status.values():
        assert p["status"] == "missing" and "no-python" in p["reason"]
    text = format_report(Report.from_json(doc))
    for name in PEERS:
        assert f"{name}: MISSING" in text


def test_compare_runs_numpy_and_lists_absent_peers(capsys):
    absent = [name for name, mod in PEER_MODULES.items() if importlib.util.find_spec(mod) is None]
    peers = ["numpy"] + absent
    rc, out, _ = run_cli(
        capsys,
        "--compare",
        "--replicas",
        "2",
        "--sizes",
        "8,1K,64K",
        "--iters",
        "10",
        "--api",
        "group",
        "--algo",
        "auto",
        "--peers",
        ",".join(peers),
        "--json",
        "--no-progress",
    )
    assert rc == 0
    doc = json.loads(out)
    check_schema(doc)
    status = {p["name"]: p for p in doc["peers"]}
    assert status["numpy"]["status"] == "ok" and status["numpy"]["version"] == np.__version__
    for name in absent:
        assert status[name]["status"] == "missing", status[name]
        assert status[name]["reason"]
    rows = [r for r in doc["results"] if r["impl"] == "numpy"]
    assert [r["bytes"] for r in rows] == [8, 1024, 65536]
    assert all(r["wrong"] == 0 and r["checked"] == 2 * r["count"] for r in rows)
    ratios = [s for s in doc["speedups"] if s["peer"] == "numpy" and s["distvals"] == "group"]
    assert len(ratios) == 3
    for s in ratios:
        assert math.isclose(s["speedup"], s["peer_us"] / s["distvals_us"])


def test_numpy_runner_checks_its_result():
    res = subprocess.run(
        [
            sys.executable,
            runner_path("numpy"),
            "--replicas",
            "3",
            "--op",
            "min",
            "--dtype",
            "int8",
            "--plan",
            "3:4,1000:4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    events = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert [e["event"] for e in events] == ["start", "result", "result", "done"]
    assert [(e["count"], e["wrong"], e["checked"]) for e in events[1:3]] == [(3, 0, 9), (1000, 0, 3000)]


def test_numpy_runner_all_reduce_is_right():
    spec = importlib.util.spec_from_file_location("numpy_peer_under_test", runner_path("numpy"))
    sys.path.insert(0, os.path.dirname(runner_path("numpy")))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    for op in bd.OPS:
        arrays = [bd.make_input(4, r, 777, "float64", op) for r in range(4)]
        want = numpy_reference(arrays, op)
        mod.all_reduce(arrays, op)
        for a in arrays:
            np.testing.assert_allclose(a, want, rtol=1e-12)


def _fake_runner(tmp_path, monkeypatch, body):
    script = tmp_path / "fake_peer.py"
    script.write_text(textwrap.dedent(body))
    monkeypatch.setattr(compare, "runner_path", lambda name: str(script))


def test_failing_peer_is_reported_with_partial_results(tmp_path, monkeypatch):
    _fake_runner(
        tmp_path,
        monkeypatch,
        """
        import json, sys
        print(json.dumps({"event": "start", "version": "9.9", "detail": "fake"}), flush=True)
        print("some library chatter on stdout", flush=True)
        print(json.dumps({"event": "result", "bytes": 8, "count": 2, "iters": 3, "time_us": 5.0,
                          "wrong": 0, "checked": 4}), flush=True)
        sys.stderr.write("Traceback: boom in the second size\\n")
        sys.exit(3)
    """,
    )
    status, rows = compare.run_peer("numpy", 2, [(8, 3), (64, 3)], "float32", "sum", sys.executable, 60)
    assert status.status == "failed" and status.version == "9.9"
    assert "exit code 3" in status.reason and "1 of 2 sizes" in status.reason and "boom" in status.reason
    assert [(r.bytes, r.time_us) for r in rows] == [(8, 5.0)]


def test_hanging_peer_is_killed_at_its_timeout(tmp_path, monkeypatch):
    _fake_runner(
        tmp_path,
        monkeypatch,
        """
        import json, time
        print(json.dumps({"event": "start", "version": "1"}), flush=True)
        time.sleep(120)
    """,
    )
    t0 = time.monotonic()
    status, rows = compare.run_peer("numpy", 2, [(8, 3)], "float32", "sum", sys.executable, 2.0)
    assert time.monotonic() - t0 < 30
    assert status.status == "failed" and "timed out" in status.reason and rows == []


def test_peer_reporting_missing_or_unsupported(tmp_path, monkeypatch):
    _fake_runner(
        tmp_path,
        monkeypatch,
        """
        import json
        print(json.dumps({"event": "unsupported", "reason": "no such op here"}), flush=True)
    """,
    )
    status, rows = compare.run_peer("tensorflow", 4, [(8, 3)], "float32", "prod", sys.executable, 60)
    assert (status.status, status.reason, status.replicas) == ("unsupported", "no such op here", 4)


def test_speedups_divide_peer_time_by_distvals_python_time():
    def row(impl, level, algo, t, py=None):
        return Row(impl, level, algo, 2, 1024, 256, "float32", "sum", t, 10, 0, 512, py_time_us=py)

    report = Report(
        "cmd",
        {},
        {},
        rows=[
            row("distvals", "group", "auto", 0.5, py=2.0),
            row("distvals", "group", "ring", 0.1, py=1.0),
            row("distvals", "strategy", "auto", 20.0),
            row("tensorflow", "peer", "", 800.0),
        ],
        peers=[PeerStatus("tensorflow", 2, "ok")],
    )
    sp = {s["distvals"]: s["speedup"] for s in compare.speedups(report)}
    assert sp == {"group": 400.0, "strategy": 40.0}
    text = format_report(report)
    assert "400.00x" in text and "40.00x" in text


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    data = tmp_path / "r.json"
    run_cli(capsys, "--sizes", "8,1K,64K", "--iters", "5", "--algo", "auto", "--json", str(data), "--no-progress")
    png = tmp_path / "r.png"
    rc, _, err = run_cli(capsys, "--load", str(data), "--plot", str(png))
    assert rc == 0 and "plot written" in err
    head = png.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_module_entry_point_runs():
    res = subprocess.run(
        [sys.executable, "-m", "distvals.bench", "--sizes", "1K", "--iters", "3", "--algo", "direct", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    rows = _table_rows(res.stdout)
    assert rows[0][:7] == ["1024", "256", "float32", "sum", "L1", "distvals", "direct"] and rows[0][-1] == "0"


def test_streaming_comparison_runs_and_checks(capsys):
    from distvals.bench import streaming

    before = distvals._core.streaming_store_min_bytes()
    assert streaming.main(["--replicas", "2", "--sizes", "64K", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "out, plain" in out and "# wrong elements: 0" in out
    assert distvals._core.streaming_store_min_bytes() == before
    r = streaming.measure(3, 4096, 1)
    assert r["wrong"] == 0 and set(r["us"]) == {"in_place", "plain", "streaming"}


# ---- the GPU bench's check, on the simulated CUDA backend -----------------------------------


def _gpu_bench_rows(monkeypatch, corrupt):
    """``distvals.bench.gpu.run`` over the simulated backend (tests/simulated_cuda.py),
    its checked collective followed by ``corrupt(views, inputs)`` (None: kept)."""
    from simulated_cuda import SimulatedCuda, install

    from distvals import config, cuda_group
    from distvals.bench import gpu

    sim = SimulatedCuda(1)
    sim.device_name = lambda g: "simulated GPU"
    sim.time_copy = lambda g, nbytes, iters, warmup: np.full(iters, 1e-3)
    sim.time_all_reduce = lambda engine, raw, dtype, op, algorithm, iters, warmup: np.full(iters, 1e-4)
    install(sim, monkeypatch.setattr, modules=(gpu,))

    class Group(cuda_group.CudaReplicaGroup):
        def all_reduce(self, views, op="sum", algorithm="auto", **kw):
            inputs = [v.numpy().copy() for v in views]
            super().all_reduce(views, op=op, algorithm=algorithm, **kw)
            if corrupt is not None:
                corrupt(views, inputs)

    monkeypatch.setattr(gpu, "CudaReplicaGroup", Group)
    before = config.get_logical_gpus()
    try:
        return gpu.run([3], [4096], "float32", "sum", out=io.StringIO())
    finally:
        config.set_logical_gpus(before)


def test_the_gpu_bench_counts_a_result_read_from_one_replica_twice(monkeypatch):
    ok = _gpu_bench_rows(monkeypatch, None)
    assert [r["wrong"] for r in ok] == [0, 0]
    assert ok[0]["run_us"] > 0  # strategy.run timed, its result checked right
    # And the row of a structure of 50 arrays of 4 KiB, checked too.
    assert ok[1]["leaves"] == 50 and ok[1]["bytes"] == 50 * 4096 and ok[1]["run_us"] > 0

    def sum_of_replica_one_three_times(views, inputs):
        # A sum that reads replica 1 three times: with inputs of the form base + r it has
        # the right total, so the bench's inputs must tell 3 * x1 from x0 + x1 + x2.
        for v in views:
            v.copy_from((3 * inputs[1]).astype(np.float32))

    bad = _gpu_bench_rows(monkeypatch, sum_of_replica_one_three_times)
    assert bad[0]["wrong"] > 0


def test_the_gpu_bench_checks_what_strategy_run_returns(monkeypatch):
    # The run(us) column's result is checked like the engine's: a strategy.run whose
    # replica 0 got replica 1's input back counts as wrong, the engine call being right.
    from distvals.bench import gpu

    real = gpu._strategy_run_us

    def off(strategy, views, op, iters):
        us, results = real(strategy, views, op, iters)
        return us, [views[1].numpy()] + results[1:]

    monkeypatch.setattr(gpu, "_strategy_run_us", off)
    rows = _gpu_bench_rows(monkeypatch, None)
    assert rows[0]["wrong"] > 0


def test_the_gpu_bench_checks_every_leaf_of_a_structures_result(monkeypatch):
    # A structure's all-reduce that gives replica 0 leaf 1's result as its leaf 0 (right
    # values, wrong place) counts as wrong: each leaf holds its own part of the inputs.
    from distvals.local_extended import LocalExtended

    real = LocalExtended._resolve_quick_gpu_tree

    def swapped(self, requests):
        out = real(self, requests)
        out[0][0] = out[0][1]
        return out

    monkeypatch.setattr(LocalExtended, "_resolve_quick_gpu_tree", swapped)
    rows = _gpu_bench_rows(monkeypatch, None)
    assert rows[0]["wrong"] == 0 and rows[1]["leaves"] == 50
    # (Not all 1024 of its elements: small integers, some equal in both leaves.)
    assert 0 < rows[1]["wrong"] <= 1024


def test_out_of_place_rows_count_a_call_that_writes_nothing_into_its_outputs(monkeypatch):
    # The timed loop of one algorithm leaves right answers in the outputs; the next
    # algorithm's check must not read those as its own.
    real = core._core.time_all_reduce

    def lazy(engine, bufs, op, algorithm, iters, warmup, **kw):
        if "out" in kw and algorithm != "ring":
            return np.full(iters, 1e-6)  # writes nothing
        return real(engine, bufs, op, algorithm, iters, warmup, **kw)

    monkeypatch.setattr(core._core, "time_all_reduce", lazy)
    rows, _ = core.sweep_distvals(
        2, [(4096, 5)], "float32", "sum", ["ring", "tree", "direct"], False, out_of_place=True
    )
    wrong = {r.algorithm: r.wrong for r in rows if r.out_of_place}
    assert wrong["ring"] == 0 and wrong["tree"] > 0 and wrong["direct"] > 0, wrong


def test_out_of_place_rows_count_a_call_that_changes_its_inputs(monkeypatch):
    # An engine that reduced into its inputs and then copied them to the outputs gets
    # right outputs; the inputs it changed are counted as wrong.
    real = core._core.time_all_reduce

    def in_place_then_copy(engine, bufs, op, algorithm, iters, warmup, **kw):
        out = kw.pop("out", None)
        times = real(engine, bufs, op, algorithm, iters, warmup)
        if out is not None:
            for o, b in zip(out, bufs):
                np.copyto(o, b)
        return times

    monkeypatch.setattr(core._core, "time_all_reduce", in_place_then_copy)
    with distvals.ReplicaGroup(2) as g:
        bufs = [np.empty(4096, np.float32) for _ in range(2)]
        outs = [np.zeros(4096, np.float32) for _ in range(2)]
        row = core.measure_group(g, bufs, "float32", "sum", "direct", iters=3, python_loop=False, out=outs)
    ref = bd.reference(2, 4096, "float32", "sum")
    changed = sum(int(np.count_nonzero(bd.make_input(2, r, 4096, "float32", "sum") != ref)) for r in range(2))
    assert changed > 4096 and row.wrong == changed  # each input element the sum changed
