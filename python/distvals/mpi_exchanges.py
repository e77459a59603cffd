"""The all-reduce of one flat host buffer between MPI workers by point-to-point
exchanges, for ``distvals.mpi_collectives``.

Below 64 KiB a chunk crosses in one ``Iallreduce`` (polled against the timeout). From
64 KiB, MPI_Allreduce costs more than it must here: Open MPI's nonblocking one is slow,
the blocking one cannot be waited for against a deadline from the calling thread, and
an all-reduce into a new result needs a copy first (in place) or inside MPI (out of
place). So the workers exchange the data point to point and reduce it on the calling
thread (the engine's kernels, in one pass over every operand; numpy for the dtypes they
lack):

- *Two workers, up to 512 KiB* (128 KiB where every worker reduces several local
  replicas inside the exchanges, agreed when the strategy is made: there the ring's
  halves overlap that local work with the crossing): they swap whole chunks (one
  ``Isend`` and one ``Irecv`` each) and reduce; both reduce worker 0's values with worker
  1's in that order, so that every worker's result is the same bits.
- *Larger, or more workers*: a ring. Each worker's chunk is cut into one piece per
  worker; in W-1 steps every worker sends a partial reduction to its right neighbour
  and adds its own values to the one it receives from its left (reduce-scatter, reading
  the caller's array and writing the result), then W-1 steps pass the finished pieces
  around, received straight into the result (all-gather). Each piece is reduced on one
  path only, so every worker gets the same bits. With more than two workers the ring
  runs when each piece is at least 1 MiB; smaller chunks keep MPI_Allreduce.

Into a result separate from the worker's values, what a worker receives lands in the
result itself and is reduced there; in place (or with several local replicas), through
a receive buffer kept from call to call.

A worker with several local replicas whose engine has a single thread (its share of a
host's cores) hands the exchanges its replicas' arrays and results instead of one
reduced buffer (``all_reduce``'s ``local`` and ``outs``): the local reduce and the
local broadcast then happen inside the exchanges, each input read once and each result
written once. The piece a worker sends first is its replicas' values reduced into the
first result, with plain stores, since MPI reads it at once (sending a buffer that
streaming stores had just written took twice as long); a piece it finishes takes its
replicas' values and the received partial straight into every result; a piece received
finished is copied from the first result to the others. Measured on 2 workers x 2
replicas of one 2-core machine, against a local reduce before the exchanges and a
broadcast after them, alternating three runs each: 16 MiB 7.3-7.8 against 8.3-8.6 ms,
1 MiB 398-414 against 434-446 us.

An exchange can also carry the workers' agreement flags (``all_reduce``'s ``agree``): a
one-element message beside each reduce-scatter piece, holding the AND of the flags the
sender has seen (its own first). After the W-1 steps every worker holds the AND of all
W flags, and only then writes the all-gather's pieces, or stops when some worker's call
was not the one the others make (``distvals.mpi_agreement``).

The route depends only on what every worker agreed on (the chunk's size and dtype, the
number of workers), so every worker makes the same MPI calls. Measured on 2 workers of
one 2-core machine (new result from one array per worker, medians of three runs): 256 KiB
194 us swapping, 203 us in the ring, 258 us copying into the result and Allreduce in
place on the MPI thread; 1 MiB 355 / 334 / 427 us; 4 MiB 2.3 / 2.1 / 3.4 ms. And one
worker's send buffer written just before (a gradient) or starting on a page boundary
(the host pool's blocks) costs the exchange nothing more than MPI's own.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from . import _core
from .collectives import accumulator_dtype
from .reduce_op import ReduceOp

__all__ = [
    "BLOCKING_MIN_BYTES",
    "FLAG_TAG",
    "NUMPY_OPS",
    "PAIR_MAX_BYTES",
    "PAIR_MAX_BYTES_LOCAL",
    "RING_MIN_PIECE_BYTES",
    "TAG",
    "Exchanges",
    "wire_dtype",
]

#: Buffers of at least this many bytes cross MPI by the exchanges of the module doc, or,
#: where those do not apply, by blocking MPI calls
#: on the MPI thread (Open MPI's blocking all-reduce is much faster than its
#: nonblocking one for them).
BLOCKING_MIN_BYTES = 64 << 10
#: Two workers exchange whole buffers up to this size, halves above it (the ring of
#: two). One reduced buffer per worker (new results, alternated in one job on 2 workers
#: of one 2-core machine): 256 KiB 39 us swapping against 53 in the ring, 512 KiB 76 / 82,
#: 1 MiB 177 / 166, 2 MiB 349 / 318.
PAIR_MAX_BYTES = 512 << 10
#: The same where every worker reduces its several local replicas inside the exchanges
#: (``all_reduce``'s ``local``): the ring's two halves let the local reduce of the second
#: overlap the first's crossing, which one whole buffer cannot. 2 workers x 2 replicas,
#: the same way: 128 KiB 61 / 60 us, 256 KiB 113 / 96, 512 KiB 227 / 199, 1 MiB 387 / 363.
PAIR_MAX_BYTES_LOCAL = 128 << 10
#: With more than two workers the ring runs when each worker's piece is at least this.
RING_MIN_PIECE_BYTES = 1 << 20
# The tag of the point-to-point messages of the all-reduce (on the strategy's own
# communicator, where nothing else sends point to point).
TAG = 0x6476
#: Tag of the agreement flags riding an exchange.
FLAG_TAG = TAG + 1


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a buffer crosses MPI in: float16 and bfloat16 as float32."""
    return accumulator_dtype(dtype) or dtype


#: The reductions of the exchanges (MEAN travels as SUM and is divided afterwards).
NUMPY_OPS = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def reduce_into(op: ReduceOp, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], cached: bool = False) -> None:
    """Every array of ``dsts`` set to ``srcs`` reduced with ``op`` (not MEAN), element by
    element in the order given: in one pass of the engine's kernels on this thread where
    the arrays are its kind, else with numpy. A destination may be one of the first two
    sources, or the source of its own index. ``cached``: the results are sent on at once, so they stay in the cache (see
    ``_core.reduce_into``)."""
    if _core.reduce_into(list(srcs), list(dsts), op, cached):
        return
    fn = NUMPY_OPS[op]
    first = dsts[0]
    if len(srcs) == 1:
        np.copyto(first, srcs[0])
    else:
        fn(srcs[0], srcs[1], out=first)
        for x in srcs[2:]:
            fn(first, x, out=first)
    for d in dsts[1:]:
        np.copyto(d, first)


#: ``exchange(out, into, dest, source, flags)``: see ``Exchanges.all_reduce``.
Exchange = Callable[[np.ndarray, np.ndarray, int, int, Optional[np.ndarray]], None]


class Exchanges:
    """Worker ``rank`` of ``size``: how a buffer crosses MPI, and the exchanges that
    all-reduce it (the caller supplies the exchange itself: nonblocking and polled on the
    calling thread, or blocking on the MPI thread)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        #: Two workers swap whole buffers up to this size (PAIR_MAX_BYTES, or
        #: PAIR_MAX_BYTES_LOCAL once every worker has said it reduces its replicas inside
        #: the exchanges: a value every worker must hold alike).
        self.pair_max_bytes = PAIR_MAX_BYTES
        # Receive buffer of the exchanges, kept from call to call.
        self._scratch = np.empty(0, dtype=np.uint8)
        # Agreement flags riding the exchanges: [0] the AND so far (sent), [1] received.
        self._flags = np.zeros(2, dtype=np.int64)

    def route(self, nbytes: int, dtype: np.dtype) -> str:
        """How a buffer of ``nbytes`` bytes of ``dtype`` (its wire dtype) crosses MPI:
        "nonblocking" (Iallreduce, polled), "pair" or "ring" (point-to-point exchanges,
        module doc), or "blocking" (Allreduce on the MPI thread). It depends only on what
        every worker agreed on (size, dtype, number of workers), so that every worker
        makes the same MPI calls."""
        if nbytes < BLOCKING_MIN_BYTES:
            return "nonblocking"
        if dtype.kind in "fiuc":
            if self.size == 2:
                return "pair" if nbytes <= self.pair_max_bytes else "ring"
            if nbytes // self.size >= RING_MIN_PIECE_BYTES:
                return "ring"
        return "blocking"

    def all_reduce(
        self,
        route: str,
        buf: np.ndarray,
        op: ReduceOp,
        send: Optional[np.ndarray],
        exchange: Exchange,
        agree: Optional[bool] = None,
        local: Optional[Sequence[np.ndarray]] = None,
        outs: Optional[Sequence[np.ndarray]] = None,
    ) -> bool:
        """The all-reduce of ``send`` (or ``buf``) into ``buf`` by point-to-point
        ``exchange(out, into, dest, source, flags)`` calls (each sends ``out`` to ``dest``
        while it receives ``into`` from ``source``, and ``flags[0:1]`` beside it into
        ``flags[1:2]`` when ``flags`` is given) and reductions on this thread; see the
        module doc. ``agree``: this worker's agreement flag, carried by the exchanges; the
        result is whether every worker's flag was True (when one was not, ``buf`` holds
        nothing of use; every worker returns the same). Without ``agree``: True. The
        reduce-scatter writes before the flags are known, so results that are the inputs
        (in place) may hold partial reductions when some flag was False: callers whose
        inputs must survive a disagreement pass separate results (the strategies do).

        ``local`` and ``outs``: the arrays of several local replicas (flat, ``buf``'s
        size and dtype) and their results (``buf`` first; ``outs[r]`` may be
        ``local[r]``). The local reduce then happens inside the exchanges, piece by piece,
        and each finished piece is written to every result in the pass that reduces it:
        a piece this worker sends first is its replicas' values reduced into ``buf``; a
        piece it finishes is its replicas' values and the received partial reduced
        straight into every result; a piece received finished is copied from ``buf`` to
        the other results. Each input is read once and each result written once, where
        a local reduce before the exchanges and a broadcast after them take two more
        passes over the buffer."""
        me, size = self.rank, self.size
        mine: Sequence[np.ndarray] = [buf if send is None else send]
        results: Sequence[np.ndarray] = [buf]
        many = local is not None and outs is not None
        if local is not None and outs is not None:
            mine, results = local, outs
        flags = None
        if agree is not None:
            flags = self._flags
            flags[0] = 1 if agree else 0

        # One worker's values into a separate result: what arrives is received straight
        # into the result's piece and reduced there, in place, instead of through a
        # scratch buffer (a working set smaller by that buffer: measured on 2 workers of
        # one 2-core machine, new results with the last one kept, 256 KiB 45 -> 36 us,
        # 1 MiB 200 -> 174 us, 16 MiB 3.9 -> 3.0 ms). Not in place: the piece received
        # would overwrite values still to be sent or reduced.
        apart = not many and send is not None and not np.may_share_memory(send, buf)

        def part(arrays: Sequence[np.ndarray], lo: int, hi: int) -> List[np.ndarray]:
            return [a[lo:hi] for a in arrays]

        if route == "pair":
            # Two workers: swap whole buffers, then reduce. Both reduce worker 0's values
            # with worker 1's in that order, so that their results are the same bits
            # (signed zeros under MIN and MAX, NaN payloads) as one ring would give.
            peer = 1 - me
            if many:
                reduce_into(op, mine, [buf], True)
                out = buf
            else:
                out = mine[0]
            theirs = buf if apart else self._scratch_for(buf.size, buf.dtype, out)
            exchange(out, theirs, peer, peer, flags)
            if flags is not None and not (flags[0] and flags[1]):
                return False
            reduce_into(op, [out, theirs] if me == 0 else [theirs, out], results, not many)
            return True
        # Ring: worker k owns piece k+1 after the reduce-scatter. At step s of the
        # reduce-scatter each worker sends the piece it reduced at step s-1 (its own
        # values at step 0) to the right, receives the left worker's partial sum of the
        # next piece, and adds its own values to it (at the last step, into every
        # result). The all-gather then passes the finished pieces around the ring,
        # received straight into ``buf`` and copied from there to the other results.
        bounds = [buf.size * k // size for k in range(size + 1)]
        right, left = (me + 1) % size, (me - 1) % size
        for step in range(size - 1):
            sc, rc = (me - step) % size, (me - step - 1) % size
            if step > 0:
                out = buf[bounds[sc] : bounds[sc + 1]]
            elif many:
                out = buf[bounds[sc] : bounds[sc + 1]]
                reduce_into(op, part(mine, bounds[sc], bounds[sc + 1]), [out], True)
            else:
                out = mine[0][bounds[sc] : bounds[sc + 1]]
            lo, hi = bounds[rc], bounds[rc + 1]
            theirs = buf[lo:hi] if apart else self._scratch_for(hi - lo, buf.dtype, mine[0][lo:hi])
            exchange(out, theirs, right, left, flags)
            # Into ``buf`` alone, with plain stores, where it is sent on next; a finished
            # piece of several results is written past the cache (measured: keeping both
            # results in the cache cost 1.2x the call at 16 MiB).
            spread = many and step == size - 2
            reduce_into(op, part(mine, lo, hi) + [theirs], part(results if spread else [buf], lo, hi), not spread)
            if flags is not None:
                # The flags of this worker and the s+1 workers to its left, sent on at
                # the next step: after the last, every worker's flag.
                flags[0] &= flags[1]
        if flags is not None and not flags[0]:
            return False
        for step in range(size - 1):
            sc, rc = (me + 1 - step) % size, (me - step) % size
            lo, hi = bounds[rc], bounds[rc + 1]
            exchange(buf[bounds[sc] : bounds[sc + 1]], buf[lo:hi], right, left, None)
            for r in results[1:]:
                np.copyto(r[lo:hi], buf[lo:hi])
        return True

    def _scratch_for(self, count: int, dtype: np.dtype, like: np.ndarray) -> np.ndarray:
        """A receive buffer of ``count`` elements, reused from call to call (one exchange
        runs at a time: on the calling thread, or on the MPI thread while the caller
        waits for it), placed at the same offset within a page as ``like``: the peer
        sends the same piece of a buffer placed as ours, and a copy whose destination is
        a few bytes past its source modulo 4096 stalls on every load (measured: 1 MiB
        from a page-aligned buffer into one 16 bytes past a page took 4.5x as long)."""
        need = count * dtype.itemsize
        if self._scratch.nbytes < need + 4096:
            self._scratch = np.empty(max(need + 4096, 2 * self._scratch.nbytes), dtype=np.uint8)
        start = (like.ctypes.data - self._scratch.ctypes.data) % 4096
        # Never misaligned for the dtype (MPI cannot receive into such a buffer), whatever
        # ``like`` is.
        start -= start % dtype.alignment
        return self._scratch[start : start + need].view(dtype)
