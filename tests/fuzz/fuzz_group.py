"""Fuzz target over the input checks of ReplicaGroup's collectives.

Random replica counts, methods, dtypes (supported or not), shapes, strides, flags,
buffer counts, aliasing, ops, algorithms, roots and timeouts go into the single-call and
per-replica methods. Each call must either

* succeed, when an independent model of the rules says the arguments are valid, with
  every replica's result equal to numpy's, or
* raise ValueError or TypeError, when the model says they are invalid, on every replica,
  with every input byte-for-byte unchanged.

Anything else (a crash, another exception, a hang, a result that differs, a touched
input, a valid call refused or an invalid one accepted) is a failure.

Run under atheris (``python tests/fuzz/fuzz_group.py -max_total_time=60``) or, without
it, over pseudo-random inputs (``python tests/fuzz/fuzz_group.py --random 2000
[--seconds 60] [--seed 0]``).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, List, Optional, Sequence

import numpy as np

__all__ = ["Provider", "main", "one_input"]

if __name__ == "__main__" and "--random" not in sys.argv:
    import atheris

    with atheris.instrument_imports():
        import distvals as dv
        from distvals import _core
else:
    import distvals as dv
    from distvals import _core

SUPPORTED = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
UNSUPPORTED = [
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
    "object",
    "U2",
    "S2",
    ">f4",
    ">i4",
    "longdouble",
    "datetime64[s]",
]
OPS = ["sum", "SUM", "mean", "avg", "min", "max", "prod", "product", "Max", "average", "", "sum "]
ALGOS = ["auto", "ring", "tree", "direct", "Ring", "bus"]
SINGLE = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"]
PER_REPLICA = [
    "replica_all_reduce",
    "replica_reduce",
    "replica_broadcast",
    "replica_all_gather",
    "replica_reduce_scatter",
]
TIMEOUT = 5.0  # seconds; every call here completes in milliseconds


class Provider:
    """Draws typed values from fuzzer bytes (zeros once they run out)."""

    def __init__(self, data: bytes):
        self._data = data
        self._pos = 0

    def _byte(self) -> int:
        if self._pos >= len(self._data):
            return 0
        b = self._data[self._pos]
        self._pos += 1
        return b

    def int_in(self, lo: int, hi: int) -> int:
        span = hi - lo + 1
        v = 0
        for _ in range(max(1, (span.bit_length() + 7) // 8)):
            v = (v << 8) | self._byte()
        return lo + v % span

    def boolean(self) -> bool:
        return self._byte() & 1 == 1

    def rare(self, one_in: int) -> bool:
        """True about once in `one_in` draws (never once the bytes run out)."""
        return self.int_in(0, one_in - 1) == one_in - 1

    def pick(self, items: Sequence[Any]) -> Any:
        return items[self.int_in(0, len(items) - 1)]


# ---- building arguments --------------------------------------------------------------


def _array(p: Provider, dtype: str, shape: tuple, replica: int) -> np.ndarray:
    dt = np.dtype(dtype)
    size = int(np.prod(shape)) if shape else 1
    base = (np.arange(size) * (replica + 2) + p.int_in(0, 5)) % 7 - (3 if dt.kind not in "uSU" else 0)
    if dt.kind == "O":
        return np.array(base.tolist(), dtype=object).reshape(shape)
    if dt.kind in "SU":
        return np.array([str(v) for v in base.ravel()], dtype=dt).reshape(shape)
    if dt.kind == "M":
        return base.astype("datetime64[s]").reshape(shape)
    with np.errstate(all="ignore"):
        return base.astype(dt).reshape(shape)


def _layout(p: Provider, a: np.ndarray) -> Any:
    """The array as passed: plain, or one of the shapes input can take."""
    kind = p.int_in(0, 39) if p.rare(3) else 39  # mostly the plain array
    if kind == 0 and a.ndim >= 1 and a.shape[-1] >= 2:
        wide = np.repeat(a, 2, axis=-1)  # a strided view with a's values
        return wide[..., ::2]
    if kind == 1 and a.ndim >= 2:
        return np.asfortranarray(a)
    if kind == 2 and a.ndim >= 1 and a.shape[0] >= 2:
        return np.ascontiguousarray(a[::-1])[::-1]
    if kind == 3:
        b = a.copy()
        b.setflags(write=False)
        return b
    if kind == 4:
        return a.tolist()
    if kind == 5 and a.dtype.kind in "iuf":
        return memoryview(a)
    if kind == 6 and a.dtype == np.uint8:
        return bytearray(a.tobytes())
    if kind == 7 and a.dtype == np.uint8:
        return bytes(a.tobytes())
    if kind == 8:
        return p.pick([None, 3, "abc", 1.5])
    return a


def _snapshot(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return ("nd", x.dtype.str, x.shape, x.tobytes() if x.dtype.kind != "O" else repr(x.tolist()))
    if isinstance(x, (bytes, bytearray)):
        return ("b", bytes(x))
    if isinstance(x, memoryview):
        return ("mv", x.tobytes())
    if isinstance(x, list):
        return ("l", repr(x))
    return ("o", repr(x))


# ---- the model of what is valid --------------------------------------------------------


def _as_engine_array(x: Any) -> Optional[np.ndarray]:
    """What the engine would see, or None when it must refuse the object."""
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, (bytes, bytearray, memoryview)):
        a = np.asarray(memoryview(x))
    else:
        return None
    if a.dtype.str.lstrip("<|=") not in {"f2", "f4", "f8", "i1", "u1", "i4", "i8"}:
        return None
    if a.dtype.byteorder == ">":
        return None
    if not a.flags.c_contiguous:
        return None
    return a


def _reducing(method: str) -> bool:
    return method.replace("replica_", "") in ("all_reduce", "reduce", "reduce_scatter")


def _op_valid(op: str, dtype: np.dtype, method: str) -> bool:
    if not _reducing(method):
        return True
    name = op.lower()
    if name not in ("sum", "mean", "avg", "min", "max", "prod", "product"):
        return False
    return name not in ("mean", "avg") or dtype.kind == "f"


def _writes(method: str, r: int, root: int, has_out: bool) -> bool:
    m = method.replace("replica_", "")
    if m == "all_reduce":
        return not has_out
    if m == "broadcast":
        return True
    if m == "reduce":
        return r == root
    return False


def _reads(method: str, r: int, root: int) -> bool:
    m = method.replace("replica_", "")
    return r == root if m == "broadcast" else True


def _single_valid(g, method, bufs, op, algo, root, out) -> bool:
    n = g.num_replicas
    if len(bufs) != n:
        return False
    arrays = [_as_engine_array(b) for b in bufs]
    if any(a is None for a in arrays):
        return False
    a0 = arrays[0]
    if any(a.dtype != a0.dtype or a.shape != a0.shape for a in arrays):
        return False
    if method in ("reduce", "broadcast") and not 0 <= root < n:
        return False
    if method == "all_reduce" and algo.lower() not in ("auto", "ring", "tree", "direct"):
        return False
    if not _op_valid(op, a0.dtype, method):
        return False
    has_out = out is not None
    for r, a in enumerate(arrays):
        if _writes(method, r, root, has_out) and not a.flags.writeable:
            return False
    if method == "reduce_scatter" and (a0.ndim == 0 or a0.shape[0] % n != 0):
        return False
    if has_out:
        if len(out) != n:
            return False
        outs = [_as_engine_array(o) for o in out]
        if any(o is None or o.dtype != a0.dtype or o.shape != a0.shape or not o.flags.writeable for o in outs):
            return False
    # The same memory passed for two replicas: refused when either of them writes it.
    for r in range(n):
        for j in range(n):
            if r != j and arrays[r].nbytes and np.shares_memory(arrays[r], arrays[j]):
                if _writes(method, r, root, has_out) or (_writes(method, j, root, has_out) and _reads(method, r, root)):
                    return False
    return True


def _replica_valid(g, method, replica, x, op, algo, root) -> Optional[tuple]:
    """The call `replica` would post, or None when its own arguments are bad."""
    n = g.num_replicas
    a = _as_engine_array(x)
    if a is None:
        return None
    m = method.replace("replica_", "")
    if m in ("reduce", "broadcast") and not 0 <= root < n:
        return None
    writes = m in ("all_reduce", "broadcast") or (m == "reduce" and replica == root)
    if writes and not a.flags.writeable:
        return None
    if m == "all_reduce" and algo.lower() not in ("auto", "ring", "tree", "direct"):
        return None
    if not _op_valid(op, a.dtype, method):
        return None
    if m == "reduce_scatter" and (a.ndim == 0 or a.shape[0] % n != 0):
        return None
    if m == "all_reduce":
        resolved = algo.lower()
        if resolved == "auto":
            resolved = _core.choose_algorithm(n, a.nbytes)
    else:
        resolved = "direct"
    name = _OP_NAMES[op.lower()] if _reducing(method) else "sum"
    return (m, a.dtype.str, a.shape, name, resolved, root if m in ("reduce", "broadcast") else 0)


_OP_NAMES = {"sum": "sum", "mean": "mean", "avg": "mean", "min": "min", "max": "max", "prod": "prod", "product": "prod"}


# ---- the reference ------------------------------------------------------------------------


def _reduce(stack: np.ndarray, op: str) -> np.ndarray:
    op = op.lower()
    dt = stack.dtype
    if dt.kind in "iu":
        ufunc = {"sum": np.add, "prod": np.multiply, "product": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        return ufunc.reduce(stack, axis=0, dtype=dt)
    s = stack.astype(np.float64)
    if op in ("mean", "avg"):
        out = s.sum(axis=0) / stack.shape[0]
    elif op == "sum":
        out = s.sum(axis=0)
    elif op in ("prod", "product"):
        out = s.prod(axis=0)
    elif op == "min":
        out = s.min(axis=0)
    else:
        out = s.max(axis=0)
    return out.astype(dt)


def _equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.size == want.size, f"{what}: size {got.size} != {want.size}"
    if want.dtype == np.float16:
        np.testing.assert_allclose(
            got.astype(np.float64).ravel(), want.astype(np.float64).ravel(), rtol=1e-3, atol=1e-3, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got.ravel(), want.ravel(), err_msg=what)


# ---- one fuzz input ---------------------------------------------------------------------

_groups: dict = {}


def _group(n: int, chunk: int):
    key = (n, chunk)
    g = _groups.get(key)
    if g is None:
        g = _groups[key] = dv.ReplicaGroup(n, timeout_seconds=TIMEOUT, chunk_bytes=chunk)
    if g.aborted:
        g.reset()
    return g


def one_input(data: bytes) -> None:
    p = Provider(data)
    n = p.int_in(1, 4)
    g = _group(n, p.pick([0, 64, 4096]))
    per_replica = p.boolean()
    method = p.pick(PER_REPLICA if per_replica else SINGLE)
    ndim = p.int_in(0, 3)
    shape = tuple(p.int_in(0, 5) for _ in range(ndim))
    dtype = p.pick(UNSUPPORTED) if p.rare(6) else p.pick(SUPPORTED)
    op = p.pick(OPS) if p.rare(4) else p.pick(["sum", "max", "min", "prod", "mean"])
    algo = p.pick(ALGOS) if p.rare(4) else "auto"
    root = p.int_in(-1, n) if p.rare(6) else p.int_in(0, n - 1)
    nbufs = n + (p.pick([-1, 1]) if p.rare(12) else 0)
    bufs: List[Any] = []
    raw: List[np.ndarray] = []
    for r in range(max(0, nbufs)):
        # Mostly the same dtype and shape on every replica, sometimes not.
        d = p.pick(SUPPORTED + UNSUPPORTED) if p.rare(24) else dtype
        s = tuple(p.int_in(0, 5) for _ in range(p.int_in(0, 2))) if p.rare(24) else shape
        a = _array(p, d, s, r)
        raw.append(a)
        bufs.append(_layout(p, a))
    if len(bufs) >= 2 and p.rare(16):
        bufs[1] = bufs[0]  # the same memory for two replicas
    out = None
    if method == "all_reduce" and p.rare(4):
        out = [_layout(p, raw[r].copy()) if p.rare(8) else np.empty_like(np.asarray(raw[r])) for r in range(len(raw))]
    before = [_snapshot(b) for b in bufs]
    if per_replica:
        _run_per_replica(g, method, bufs, before, op, algo, root, p)
    else:
        _run_single(g, method, bufs, before, op, algo, root, out)


def _inputs_unchanged(bufs, before, what: str) -> None:
    for r, (b, s) in enumerate(zip(bufs, before)):
        assert _snapshot(b) == s, f"{what}: replica {r}'s input changed although the call was refused"


def _run_single(g, method, bufs, before, op, algo, root, out) -> None:
    n = g.num_replicas
    kwargs = {}
    if method in ("all_reduce", "reduce", "reduce_scatter"):
        kwargs["op"] = op
    if method == "all_reduce":
        kwargs["algorithm"] = algo
        if out is not None:
            kwargs["out"] = out
    if method in ("reduce", "broadcast"):
        kwargs["root"] = root
    valid = _single_valid(g, method, bufs, op, algo, root, out)
    inputs = [np.array(_as_engine_array(b), copy=True) if _as_engine_array(b) is not None else None for b in bufs]
    try:
        res = getattr(g, method)(bufs, **kwargs)
    except (ValueError, TypeError) as e:
        assert not valid, f"{method}{kwargs}: valid arguments refused: {e!r}"
        _inputs_unchanged(bufs, before, method)
        return
    assert valid, f"{method}{kwargs}: invalid arguments accepted"
    stack = np.stack(inputs)
    if method == "all_reduce":
        want = _reduce(stack, op)
        for r in range(n):
            _equal(out[r] if out is not None else _as_engine_array(bufs[r]), want, f"all_reduce replica {r}")
    elif method == "reduce":
        _equal(_as_engine_array(bufs[root]), _reduce(stack, op), "reduce root")
        for r in range(n):
            if r != root and bufs[r] is not bufs[root]:
                _equal(_as_engine_array(bufs[r]), inputs[r], f"reduce replica {r} (not the root)")
    elif method == "broadcast":
        for r in range(n):
            _equal(_as_engine_array(bufs[r]), inputs[root], f"broadcast replica {r}")
    elif method == "all_gather":
        want = np.concatenate([i.reshape(-1) for i in inputs])
        for r in range(n):
            _equal(res[r], want, f"all_gather replica {r}")
    else:
        full = _reduce(stack, op)
        m = full.shape[0] // n
        for r in range(n):
            _equal(res[r], full[r * m : (r + 1) * m], f"reduce_scatter replica {r}")


def _run_per_replica(g, method, bufs, before, op, algo, root, p: Provider) -> None:
    n = g.num_replicas
    if len(bufs) != n:
        return  # one argument per thread: a count mismatch cannot be expressed here
    # Per replica, the op and algorithm may differ too (a mismatch every replica reports).
    ops = [p.pick(OPS) if p.rare(24) else op for _ in range(n)]
    algos = [p.pick(ALGOS) if p.rare(24) else algo for _ in range(n)]
    roots = [p.int_in(-1, n) if p.rare(24) else root for _ in range(n)]
    posted = [_replica_valid(g, method, r, bufs[r], ops[r], algos[r], roots[r]) for r in range(n)]
    m = method.replace("replica_", "")
    # Every replica must post the same call, shapes included.
    valid = all(c is not None for c in posted) and all(c == posted[0] for c in posted)
    if valid:
        # Memory that one replica writes and another reads or writes is refused on every
        # replica (all_gather and reduce_scatter only read their arrays; reduce writes
        # only the root's).
        arrays = [_as_engine_array(b) for b in bufs]

        def writes(r: int) -> bool:
            return m in ("all_reduce", "broadcast") or (m == "reduce" and r == roots[0])

        for r in range(n):
            for j in range(r + 1, n):
                if (writes(r) or writes(j)) and arrays[r].nbytes and np.shares_memory(arrays[r], arrays[j]):
                    valid = False
    inputs = [np.array(_as_engine_array(b), copy=True) if _as_engine_array(b) is not None else None for b in bufs]
    results: List[Any] = [None] * n
    errors: List[Optional[BaseException]] = [None] * n

    def replica(r: int) -> None:
        kwargs = {"timeout_seconds": TIMEOUT}
        if m in ("all_reduce", "reduce", "reduce_scatter"):
            kwargs["op"] = ops[r]
        if m == "all_reduce":
            kwargs["algorithm"] = algos[r]
        if m in ("reduce", "broadcast"):
            kwargs["root"] = roots[r]
        try:
            results[r] = getattr(g, method)(r, bufs[r], **kwargs)
        except BaseException as e:  # judged below
            errors[r] = e

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(3 * TIMEOUT)
    assert not any(t.is_alive() for t in ts), f"{method}: a replica hangs"
    if not valid:
        for r, e in enumerate(errors):
            assert isinstance(e, (ValueError, TypeError)), f"{method}: replica {r} got {e!r}, not ValueError/TypeError"
        _inputs_unchanged(bufs, before, method)
        return
    for r, e in enumerate(errors):
        assert e is None, f"{method}: valid arguments refused on replica {r}: {e!r}"
    stack = np.stack([i.reshape(-1) for i in inputs])
    rt = roots[0]
    if m == "all_reduce":
        want = _reduce(stack, ops[0])
        for r in range(n):
            _equal(_as_engine_array(bufs[r]), want, f"all_reduce replica {r}")
    elif m == "reduce":
        _equal(_as_engine_array(bufs[rt]), _reduce(stack, ops[0]), "reduce root")
        for r in range(n):
            if r != rt:
                _equal(_as_engine_array(bufs[r]), inputs[r], f"reduce replica {r} (not the root)")
    elif m == "broadcast":
        for r in range(n):
            _equal(_as_engine_array(bufs[r]), inputs[rt], f"broadcast replica {r}")
    elif m == "all_gather":
        for r in range(n):
            _equal(results[r], stack.reshape(-1), f"all_gather replica {r}")
    else:
        full = _reduce(stack, ops[0]).reshape(-1)  # block r of the flattened inputs
        k = full.shape[0] // n
        for r in range(n):
            _equal(results[r], full[r * k : (r + 1) * k], f"reduce_scatter replica {r}")


def main(argv: List[str]) -> None:
    if "--random" in argv:
        import time

        count = int(argv[argv.index("--random") + 1])
        seconds = float(argv[argv.index("--seconds") + 1]) if "--seconds" in argv else float("inf")
        rng = np.random.default_rng(int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0)
        end = time.monotonic() + seconds
        done = 0
        while done < count and time.monotonic() < end:
            one_input(rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8).tobytes())
            done += 1
        print(f"{done} random inputs passed")
        return
    import atheris

    # Coverage of this file's model (which rule decided) and of distvals' Python code
    # guides the fuzzer; the C++ extension itself is not instrumented.
    for fn in (
        one_input,
        _layout,
        _array,
        _single_valid,
        _replica_valid,
        _run_single,
        _run_per_replica,
        _as_engine_array,
        _op_valid,
        _writes,
        _reads,
    ):
        atheris.instrument_func(fn)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
