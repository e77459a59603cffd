"""Inputs, float64 references and result checks shared by the benchmark and its peers.

Every replica starts from its own values; the reference is computed in float64 from the
same values, and every element of every replica's result is compared with it. The values
are small integers chosen per dtype, op and replica count so that the exact result is
representable: a correct implementation gets every element right (up to the rounding of
``mean``), and a wrong one cannot hide behind a tolerance.

This file needs only numpy: the peer runners beside it execute as plain scripts under
another interpreter (one that has TensorFlow, torch or mpi4py) that may lack distvals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import lru_cache
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "DTYPES",
    "OPS",
    "PERIOD",
    "canonical_op",
    "check_op_dtype",
    "count_wrong",
    "emit",
    "fill",
    "input_values",
    "iterations",
    "make_input",
    "median_us",
    "parse_plan",
    "reference",
    "resolve_dtype",
    "runner_parser",
    "warmup_for",
]

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "mean")

# Values repeat with this period (a prime, so no power-of-two chunking of the engines
# lines up with it); inputs are built by tiling one period, which keeps building and
# checking 256 MiB buffers at memory speed.
PERIOD = 65_521
# Elements compared per numpy call when checking (bounds the float64 temporaries).
_CHECK_BLOCK = 1 << 20

# Largest magnitude up to which every integer is exact in the dtype.
_EXACT = {
    "float16": 2048,
    "bfloat16": 256,
    "float32": 2**24,
    "float64": 2**53,
    "int8": 127,
    "uint8": 255,
    "int32": 2**31 - 1,
    "int64": 2**63 - 1,
}
# Relative tolerance for floating results: only ``mean`` rounds (sum then scale).
_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}


def canonical_op(op: str) -> str:
    """Lower-case op name; ``product`` is accepted for ``prod``."""
    o = str(op).lower()
    o = "prod" if o == "product" else o
    if o not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    return o


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype for a benchmark dtype name (bfloat16 needs ml_dtypes)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("dtype bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_op_dtype(op: str, dtype: str) -> None:
    """Reject combinations no implementation defines (mean of integers)."""
    if canonical_op(op) == "mean" and not dtype.startswith(("float", "bfloat")):
        raise ValueError(f"op mean needs a floating dtype, got {dtype}")


def _choices(n: int, dtype: str, op: str) -> np.ndarray:
    """The set of input values for (replica count, dtype, op); results stay exact."""
    limit = _EXACT[dtype]
    unsigned = dtype == "uint8"
    if op == "prod":
        big = 2**n <= limit
        if unsigned:
            # With many replicas a product of 2s would overflow: then only 1s and 2s
            # with a 2 at most on 7 replicas per element (see _pattern_int), so that a
            # lost or doubled replica still changes the result.
            return np.array([1, 2], dtype=np.int64)
        return np.array([-2, -1, 1, 2] if big else [-1, 1], dtype=np.int64)
    if op in ("min", "max"):
        k = 8
    else:
        k = max(1, min(8, limit // max(1, n)))
    if unsigned:
        return np.arange(0, k + 1, dtype=np.int64)
    return np.arange(-k, k + 1, dtype=np.int64)


@lru_cache(maxsize=64)
def _pattern_int(n: int, replica: int, dtype: str, op: str) -> np.ndarray:
    """One period of replica ``replica``'s values, as int64 (distinct per replica)."""
    choices = _choices(n, dtype, op)
    idx = np.arange(PERIOD, dtype=np.uint64)
    # A multiplicative hash of (index, replica): neighbouring elements and replicas differ.
    h = idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64((replica + 1) * 0xBF58476D1CE4E5B9 % 2**64)
    h ^= h >> np.uint64(29)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(32)
    if op == "prod" and dtype == "uint8" and 2**n > _EXACT[dtype]:
        # Element i has its 2 (at most one per replica) on replicas i, i+1, .. i+6 (mod
        # n) only where the hash says so: a product of at most 2**7.
        lit = ((idx.astype(np.int64) - replica) % n) < 7
        return np.where(lit & ((h & np.uint64(1)) == 1), 2, 1).astype(np.int64)
    return choices[(h % np.uint64(len(choices))).astype(np.int64)]


@lru_cache(maxsize=64)
def _pattern(n: int, replica: int, dtype: str, op: str) -> np.ndarray:
    p = _pattern_int(n, replica, dtype, op).astype(resolve_dtype(dtype))
    p.setflags(write=False)
    return p


@lru_cache(maxsize=16)
def _reference(n: int, dtype: str, op: str) -> Tuple[np.ndarray, np.ndarray]:
    """One period of the float64 reference and of the allowed absolute error."""
    stack = np.stack([_pattern_int(n, r, dtype, op).astype(np.float64) for r in range(n)])
    if op == "sum":
        ref = stack.sum(axis=0)
    elif op == "mean":
        ref = stack.sum(axis=0) / n
    elif op == "prod":
        ref = stack.prod(axis=0)
    elif op == "min":
        ref = stack.min(axis=0)
    else:
        ref = stack.max(axis=0)
    rtol = _RTOL.get(dtype, 0.0)
    tol = rtol * (1.0 + np.abs(ref))
    ref.setflags(write=False)
    tol.setflags(write=False)
    return ref, tol


def _periods(flat: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``flat`` as (whole periods as a 2-D view, the remaining tail)."""
    whole = flat.size // PERIOD * PERIOD
    return flat[:whole].reshape(-1, PERIOD), flat[whole:]


def fill(arr: np.ndarray, n: int, replica: int, dtype: str, op: str) -> np.ndarray:
    """Write replica ``replica``'s starting values into ``arr`` (any shape, C-contiguous)."""
    op = canonical_op(op)
    pat = _pattern(n, replica, dtype, op)
    rows, tail = _periods(arr.reshape(-1))
    rows[...] = pat
    tail[...] = pat[: tail.size]
    return arr


def make_input(n: int, replica: int, count: int, dtype: str, op: str) -> np.ndarray:
    """A new 1-D array of ``count`` elements holding replica ``replica``'s values."""
    return fill(np.empty(count, dtype=resolve_dtype(dtype)), n, replica, dtype, op)


def input_values(n: int, replica: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Replica ``replica``'s values as int64 (for frameworks whose dtypes numpy lacks)."""
    return np.resize(_pattern_int(n, replica, dtype, canonical_op(op)), count)


def reference(n: int, count: int, dtype: str, op: str) -> np.ndarray:
    """The float64 reference result of ``count`` elements (for small checks and tests)."""
    ref, _ = _reference(n, dtype, canonical_op(op))
    return np.resize(ref, count)


def count_wrong(
    results: Sequence[np.ndarray],
    n: int,
    dtype: str,
    op: str,
    *,
    count: Optional[int] = None,
    copies: Optional[int] = None,
) -> int:
    """Number of elements, over all replicas' results, that differ from the reference.

    ``results`` holds one array per replica (or per local replica of a process), of the
    benchmark's dtype or of any dtype that holds the exact values (float32 or float64
    for bfloat16). NaN and infinities count as wrong: every exact result here is finite.
    With ``count`` (the elements each result must have), a result of another size counts
    all ``count`` of its elements wrong; with ``copies`` (the results there must be), each
    missing result counts ``count`` wrong too. Results an implementation returns (not the
    benchmark's own buffers) are checked with both, so that a short, empty or missing
    result cannot pass.
    """
    op = canonical_op(op)
    ref, tol = _reference(n, dtype, op)
    exact = _exact_reference(n, dtype, op)
    step = max(1, _CHECK_BLOCK // PERIOD)
    wrong = 0
    if copies is not None and len(results) != copies:
        if count is None:
            raise ValueError("count_wrong: copies needs count")
        wrong += abs(copies - len(results)) * count
    for res in results:
        flat = np.asarray(res).reshape(-1)
        if count is not None and flat.size != count:
            wrong += count
            continue
        ex = exact.get(flat.dtype)
        rows, tail = _periods(flat)
        blocks = [rows[i : i + step] for i in range(0, rows.shape[0], step)] + [tail]
        for seg in blocks:
            m = seg.shape[-1]
            if ex is not None:
                # Exact results: one comparison in the native dtype (NaN != x counts).
                wrong += int(np.count_nonzero(seg != ex[:m]))
            else:
                err = np.abs(seg.astype(np.float64) - ref[:m])
                # ``not (err <= tol)`` so that NaN counts as wrong.
                wrong += int(np.count_nonzero(~(err <= tol[:m])))
    return wrong


@lru_cache(maxsize=16)
def _exact_reference(n: int, dtype: str, op: str) -> Dict[np.dtype, np.ndarray]:
    """The reference in the result's own dtype, when every element is exact there.

    Sum, min, max and prod of these inputs are exact in every dtype; mean is exact only
    when N is a power of two (a division by N is then a shift of the exponent).
    """
    if op == "mean" and n & (n - 1):
        return {}
    ref, _ = _reference(n, dtype, op)
    out = {}
    for name in (dtype, "float32", "float64"):
        try:
            dt = resolve_dtype(name)
        except ValueError:  # bfloat16 without ml_dtypes: float32/float64 results still work
            continue
        r = ref.astype(dt)
        if np.array_equal(r.astype(np.float64), ref):
            r.setflags(write=False)
            out[dt] = r
    return out


def iterations(nbytes: int, max_iters: int, min_iters: int, budget_bytes: int = 2**29) -> int:
    """Timed iterations for one size: about ``budget_bytes`` of data, within the bounds."""
    return int(max(min_iters, min(max_iters, budget_bytes // max(1, nbytes))))


def warmup_for(iters: int) -> int:
    """Untimed calls before a timed loop: first touch of pages, caches, lazy setup."""
    return int(max(2, min(20, iters // 20)))


def median_us(times_s: Iterable[float]) -> float:
    return statistics.median(list(times_s)) * 1e6


def parse_plan(text: str) -> List[Tuple[int, int]]:
    """``"8:1000,1024:500"`` -> [(8, 1000), (1024, 500)]: bytes and iterations per size."""
    plan = []
    for part in text.split(","):
        b, _, it = part.partition(":")
        plan.append((int(b), int(it)))
    return plan


def emit(event: str, **fields: object) -> None:
    """One JSON line on stdout, flushed at once so the benchmark sees progress."""
    rec: Dict[str, object] = {"event": event}
    rec.update(fields)
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def runner_parser(description: str) -> argparse.ArgumentParser:
    """The command line every peer runner takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--op", default="sum")
    p.add_argument("--plan", required=True, help="bytes:iterations,... one entry per size")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one collective may wait")
    p.add_argument("--probe", action="store_true", help="only report whether the peer is installed")
    return p
