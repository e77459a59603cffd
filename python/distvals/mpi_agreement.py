"""Agreement between workers: every worker's collective calls must match before data
crosses MPI, at the cost of no extra round trip in a training loop.

Agreement without a second round trip
-------------------------------------
Workers that pass different things (another collective, dtype, shape, op, nesting) must
each get a ``MismatchError`` naming the first difference, never a wrong result or a hang.
An MPI collective whose sizes differ between processes is undefined (it may hang), so
the workers must agree before the data moves. Exchanging a header before every
collective costs a round trip; here it is paid only when the workers' call sequence
changes:

- Every call has a *signature*: a 64-bit hash of its description (kind, op, and every
  leaf's path, dtype and shape).
- Every worker remembers, for the signature of the last agreed call, the signature (and
  the MPI size, dtype and op) of the call that followed it: its *expected* next call.
  The memory is the same on every worker, since it changes only after an agreed call.
- When an expected call exists for a small collective, every worker sends the data at
  the expected size in ONE MPI call, with one extra element: a flag saying "my call is
  the expected one", encoded so that the reduction itself tells whether every worker
  agreed (sum of zeros, max of zeros, min or product of ones). A worker whose call
  differs still sends a buffer of the expected size (with zeros), so the MPI call is
  well-formed on every worker.
- A large collective that crosses in one piece by point-to-point exchanges (two
  workers swapping, or a ring: ``distvals.mpi_exchanges``) carries the flag the same
  way, as a one-element message beside its first exchanges: every worker knows every
  flag before any worker writes a finished piece, and a flag that says "not my call"
  stops every worker there. A worker whose call differs makes the expected exchanges
  with zeros (its stand-in), as for small ones.
- When no call is expected, when a flag shows that some worker's call is not the
  expected one, and for other large collectives (whose 16-byte exchange travels while
  the worker's local reduce runs), the workers first exchange their signatures; equal
  signatures go on to the data call, different ones exchange their descriptions and
  raise ``MismatchError`` naming the first difference, on every worker.

So a training loop that repeats the same collectives pays one MPI call per collective
after its first step; a changed call costs one extra exchange (and, for a small
collective, the flagged call), and a real mismatch an error on every worker.

A collective cut short
----------------------
MPI cannot cancel a call, so a worker whose collective an exception (Ctrl-C) ends
between two of its MPI calls is out of step: the others wait in the rest of it, and its
next MPI calls would pair with theirs. Its next collective therefore ends the job with a
message naming the one that was cut short (``one_collective``), as a timeout does, before
any MPI call. The steady state's one flagged call is the exception: when Ctrl-C ends its
wait, the call is already the collective's last; the next collective first waits for it
(``_settle``) and goes on, unless its flag shows that some worker's call differed (the
others then went on to exchange signatures: out of step).

``WorkerAgreement`` keeps the memory and makes the exchanges; ``HierarchicalCollectives``
(``distvals.mpi_collectives``), its subclass, carries the flag inside its data calls.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast

import numpy as np

from . import nest
from ._core import AbortedError, CollectiveTimeoutError, MismatchError
from .collectives import Collectives
from .mpi_exchanges import wire_dtype
from .mpi_runtime import poll
from .reduce_op import ReduceOp

__all__ = [
    "AGREE",
    "DISAGREE",
    "Expected",
    "WorkerAgreement",
    "describe_call",
    "describe_structure",
    "dtype_text",
    "one_collective",
    "signature",
]

_monotonic = time.monotonic
# The dtype an Expected call without data of its own (a gather's agreement) names.
_NO_DTYPE = np.dtype(np.int64)

# The agreement flag: the value meaning "my call is the expected one", per op, chosen so
# that the reduction of every worker's flag equals it only when every worker agrees.
AGREE = {ReduceOp.SUM: 0, ReduceOp.MAX: 0, ReduceOp.MIN: 1, ReduceOp.PRODUCT: 1}
DISAGREE = {ReduceOp.SUM: 1, ReduceOp.MAX: 1, ReduceOp.MIN: 0, ReduceOp.PRODUCT: 0}


_SINGLE_DESCRIPTIONS: Dict[Tuple[str, str, Any, Tuple[int, ...]], str] = {}


def describe_call(kind: str, op: Any, value: Any, leaves: Sequence[Any]) -> str:
    """A call's description: kind, op, then every leaf's path, dtype and shape."""
    if not nest.is_nested(value):
        a = leaves[0]
        # A loop asks for the same few descriptions again and again: remembered by
        # (kind, op, dtype, shape), whose parts are cheap to get (a dtype's name is not).
        key = (kind, _op_name(op), a.dtype, tuple(a.shape))
        text = _SINGLE_DESCRIPTIONS.get(key)
        if text is None:
            if len(_SINGLE_DESCRIPTIONS) > 4096:
                _SINGLE_DESCRIPTIONS.clear()
            text = _SINGLE_DESCRIPTIONS[key] = f"{kind}({key[1]}) of dtype {dtype_text(a.dtype)} shape {key[3]}"
        return text
    # A plain list or tuple of leaves (batch_reduce_to's), or a dict of leaves (a model's
    # gradients): remembered by their kind, keys, and each leaf's dtype and shape.
    # (Only flat containers: the key says nothing of what a nested element holds.)
    nkey: Any = None
    t = type(value)
    if (t is list or t is tuple) and not any(nest.is_nested(v) for v in value):
        nkey = (t, len(value))
    elif t is dict and not any(nest.is_nested(v) for v in value.values()):
        nkey = (t, tuple(value))
    if nkey is not None:
        key = (kind, _op_name(op), nkey, tuple((a.dtype, a.shape) for a in leaves))
        text = _NESTED_DESCRIPTIONS.get(key)
        if text is None:
            if len(_NESTED_DESCRIPTIONS) > 4096:
                _NESTED_DESCRIPTIONS.clear()
            text = _NESTED_DESCRIPTIONS[key] = _describe_nested(kind, op, value, leaves)
        return text
    return _describe_nested(kind, op, value, leaves)


_NESTED_DESCRIPTIONS: Dict[Tuple[Any, ...], str] = {}


def _describe_nested(kind: str, op: Any, value: Any, leaves: Sequence[Any]) -> str:
    paths = nest.paths(value)
    parts = ", ".join(f"{p} {dtype_text(a.dtype)}{tuple(a.shape)}" for p, a in zip(paths, leaves))
    return f"{kind}({_op_name(op)}) of {describe_structure(value)}: {parts or 'no leaves'}"


def describe_structure(value: Any) -> str:
    """A structure's nesting as descriptions give it: its kind and size when it is flat
    (the leaves' paths then say the rest), else its whole layout (the paths alone would
    not tell a list inside it from a tuple)."""
    inner = value.values() if nest.is_mapping(value) else value
    if any(nest.is_nested(v) for v in inner):
        return nest.layout(value)
    return nest.describe(value)


def _op_name(op: Any) -> str:
    name = getattr(op, "_name_", None)  # a ReduceOp (its .name property is slow)
    return name if isinstance(name, str) else str(op)


def dtype_text(dt: np.dtype) -> str:
    """A dtype as descriptions name it: its name and byte order, or every field of a
    structured one (two structured dtypes of one size share a name)."""
    if dt.names is not None or dt.subdtype is not None:
        return str(dt.descr)
    return str(dt.name) + (" big-endian" if dt.byteorder == ">" else "")


def signature(description: str) -> int:
    """A description's 64-bit signature."""
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little", signed=True)


class Expected:
    """The call that followed a given call last time, as the MPI layer saw it: its
    signature and the size (flag included), dtype and op of its MPI buffer; ``flagged``:
    the flag is the buffer's last element; ``carried``: the flag rides the exchanges.

    ``request``: a persistent MPI all-reduce of ``buf`` (a buffer of the call's size and
    dtype) that every worker's call of this kind starts, when the MPI layer made one (see
    ``HierarchicalCollectives._flat_expected``); ``address``: where its MPI handle lives,
    for native code that starts it; ``plan``: the native call that makes the whole call
    on that request (``HierarchicalCollectives._plan_of``), None until it is asked for,
    False where there is none; ``label``: what the call says it is for, with the plan."""

    __slots__ = (
        "address",
        "buf",
        "carried",
        "count",
        "dtype",
        "flagged",
        "label",
        "op",
        "plan",
        "request",
        "signature",
        "wire",
    )

    def __init__(
        self, signature: int, count: int, dtype: np.dtype, op: ReduceOp, flagged: bool, carried: bool = False
    ) -> None:
        self.signature = signature
        self.count = count
        self.dtype = dtype
        self.op = op
        self.flagged = flagged
        self.carried = carried
        # Whether the buffer crosses MPI in its own dtype.
        self.wire = wire_dtype(dtype) == dtype
        self.request: Any = None
        self.address = 0
        self.buf: Optional[np.ndarray] = None
        self.plan: Any = None
        self.label = ""


_F = TypeVar("_F", bound=Callable[..., Any])


def one_collective(method: _F) -> _F:
    """Marks a public collective of the MPI layer, so that a worker never goes on out
    of step with the others. Each collective is a sequence of MPI calls that every
    worker makes in the same order; an exception (Ctrl-C) that ends one on this worker
    between two of them leaves the other workers waiting in the rest of it, and MPI
    cannot cancel their calls. This worker's next MPI calls would pair with those (its
    new data reduced with their old, or sizes that differ: a wrong result or a hang).
    So the collective is named in ``_open`` while it runs; if it is still named when
    the next one begins, that one ends the job (``_out_of_step``) before any MPI call.

    Between collectives again: after a normal return, after a ``MismatchError`` (every
    worker raises it at the same point), after ``fail_together`` (which makes the step
    the others wait in), and while the steady state's one flagged data call waits
    (``_wait_last``: its interrupted call completes in ``_settle``). With one worker
    there is nothing to pair with."""
    return collective_named(method.__name__)(method)


def collective_named(name: str) -> Callable[[_F], _F]:
    """``one_collective`` for a method that does the work of the public collective
    ``name`` (the name an out-of-step error gives)."""

    def mark(method: _F) -> _F:
        @functools.wraps(method)
        def call(self: WorkerAgreement, *args: Any, **kwargs: Any) -> Any:
            if self.num_workers == 1:
                return method(self, *args, **kwargs)
            if self._open is not None:
                self._out_of_step(name, self._open)
            self._open = name
            try:
                result = method(self, *args, **kwargs)
            except MismatchError:
                self._open = None
                raise
            self._open = None
            return result

        return cast(_F, call)

    return mark


class WorkerAgreement(Collectives):
    """What the workers remember of their agreed calls, and the exchanges that agree on
    a call. ``comm``: the workers' communicator; ``timeout``: of every wait, in seconds;
    ``on_fatal(message)``: called before a timeout is raised (the job cannot go on)."""

    def __init__(self, comm: Any, timeout: float, on_fatal: Optional[Callable[[str], None]]) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = comm
        self.rank: int = comm.Get_rank()
        self.num_workers: int = comm.Get_size()
        self.timeout = float(timeout)
        self._on_fatal = on_fatal
        # Agreement memory: signature of the last agreed call -> the call after it.
        self._last = 0
        self._expected: Dict[int, Expected] = {}
        self._signatures: Dict[str, int] = {}
        # Counters for tests and the benchmark: data calls, agreement exchanges, flags, and
        # the data calls that native code started (local steps included).
        self.stats = {"data_calls": 0, "exchanges": 0, "flagged": 0, "native": 0}
        # How many remembered calls hold a persistent request (the same on every worker).
        self._persistent_count = 0
        # The public collective this worker is in (its name), None between collectives.
        # One that an exception (Ctrl-C) ended between its MPI calls stays named here:
        # the other workers went on with it, so this worker's next MPI calls would pair
        # with the rest of theirs (see ``one_collective``).
        self._open: Optional[str] = None
        # The last MPI call of a collective (the flagged data call of the steady state)
        # whose wait an exception ended: (request, buffer, op, the collective's name).
        # MPI cannot cancel it, so it may still be active, writing its buffer; the others'
        # calls pair with it, so the sequence holds once it completes (see _settle).
        self._interrupted: List[Tuple[Any, np.ndarray, ReduceOp, str]] = []
        # Other requests whose waits an exception ended, held with their buffers (mpi4py
        # keeps none for a collective) so that no late write lands in freed memory.
        self._held: List[Tuple[Any, Any]] = []

    if TYPE_CHECKING:  # pragma: no cover - HierarchicalCollectives's data call

        def _mpi_all_reduce(
            self,
            buf: np.ndarray,
            op: ReduceOp,
            what: str,
            timeout: Optional[float],
            send: Optional[np.ndarray] = None,
            last: bool = False,
        ) -> None: ...

        def _carried_all_reduce(
            self,
            buf: np.ndarray,
            op: ReduceOp,
            send: Optional[np.ndarray],
            agree: bool,
            what: str,
            timeout: Optional[float],
        ) -> bool: ...

    # ---- waiting ---------------------------------------------------------------------------
    def _deadline(self, timeout: Optional[float]) -> Tuple[float, float]:
        t = self.timeout if timeout is None else float(timeout)
        return t, _monotonic() + t

    def _wait(self, req: Any, what: str, timeout: Optional[float] = None, keep: Any = None) -> None:
        """Polls ``req`` until it completes; past the timeout the job is aborted. A wait
        that an exception ends (Ctrl-C) leaves ``req`` held with ``keep``, the buffers it
        reads and writes (see ``_held``)."""
        t, deadline = self._deadline(timeout)
        try:
            done = poll(req, deadline)
        except BaseException:
            self._held.append((req, keep))
            raise
        if not done:
            self._timed_out(what, t)

    def _wait_last(self, req: Any, buf: np.ndarray, op: ReduceOp, what: str, timeout: Optional[float]) -> None:
        """The wait for a collective's last MPI call, the all-reduce of ``buf`` whose last
        element is the agreement flag. While it waits, this worker counts as between
        collectives: an exception (Ctrl-C) here leaves the call to ``_settle``, which
        the next collective calls first."""
        t, deadline = self._deadline(timeout)
        pending = self._interrupted
        name = self._open or what
        pending.append((req, buf, op, name))
        self._open = None
        done = poll(req, deadline)
        # Named again before the entry goes: an interrupt between the two stays out of step.
        self._open = name
        pending.pop()
        if not done:
            self._timed_out(what, t)

    def _settle(self, what: str, timeout: Optional[float]) -> None:
        """Waits for the last MPI calls that interrupted waits left (each pairs with the
        other workers' call, which they make or made) before our next call writes a
        buffer one may still write: a buffer kept from call to call (an all-reduce
        kind's, which its persistent request is bound to) would otherwise take that
        call's late result. Every path that writes such a buffer calls this first. A
        flag that says some worker's call was not the expected one means the others went
        on to exchange signatures, which this worker did not: out of step."""
        pending = self._interrupted
        while pending:
            req, buf, op, name = pending[0]
            self._wait(req, what, timeout)
            pending.pop(0)
            if buf[-1] != AGREE[op]:
                self._out_of_step(what, name)

    def _out_of_step(self, what: str, earlier: str) -> None:
        """This worker's ``earlier`` collective ended between its MPI calls (an exception
        such as KeyboardInterrupt cut it short) while the other workers went on with
        it: its remaining MPI calls would pair with this worker's next ones (a wrong
        result, or a hang), and MPI cannot cancel theirs. The job must end."""
        self._open = earlier
        msg = (
            f"worker {self.rank}: {what}: this worker's previous collective ({earlier}) ended between its MPI "
            "calls (an exception such as KeyboardInterrupt cut it short) while the other workers went on with "
            "it; an MPI call cannot be cancelled and theirs would pair with this worker's next ones, so the job "
            "must end"
        )
        if self._on_fatal is not None:
            self._on_fatal(msg)
        raise AbortedError(msg)

    def _timed_out(self, what: str, timeout: float) -> None:
        msg = (
            f"worker {self.rank}: {what} waited {timeout:g} s for the other workers, which did not "
            "all arrive; an MPI collective cannot be cancelled, so the job must end (the timeout is "
            "CommunicationOptions.timeout_seconds)"
        )
        if self._on_fatal is not None:
            self._on_fatal(msg)
        raise CollectiveTimeoutError(msg)

    # ---- the memory ---------------------------------------------------------------------------
    def _remember(self, expected: Expected) -> None:
        """``expected`` becomes the call expected after the last agreed call, and the last
        agreed call; a persistent request of the record it replaces is freed (every worker
        replaces the same record at the same call, so their requests stay paired)."""
        old = self._expected.get(self._last)
        if old is not None:
            self._release(old)
        self._expected[self._last] = expected
        self._last = expected.signature

    def _release(self, expected: Expected) -> None:
        """Frees the persistent request of ``expected``, if it holds one (one that an
        interrupted wait may have left active cannot be freed, and is only dropped)."""
        req = expected.request
        if req is None:
            return
        self._persistent_count -= 1
        if expected.plan:
            expected.plan.close()  # before the request goes: no later call may start it
        expected.plan = False
        if not any(req is e[0] for e in self._interrupted) and not any(req is h[0] for h in self._held):
            req.Free()
        expected.request = expected.buf = None
        expected.address = 0

    def _free_persistent(self) -> None:
        """Frees every persistent request the memory holds (when the collectives close)."""
        for expected in self._expected.values():
            self._release(expected)

    def _start_persistent(self, expected: Expected, what: str, timeout: Optional[float], last: bool = False) -> None:
        """``expected.buf`` all-reduced in place between the workers by the persistent
        request of ``expected``, waited for until the timeout; ``last``: the
        collective's last MPI call (see ``_wait_last``)."""
        self.stats["data_calls"] += 1
        req = expected.request
        req.Start()
        if last:
            assert expected.buf is not None  # set with the request
            self._wait_last(req, expected.buf, expected.op, what, timeout)
        else:
            self._wait(req, what, timeout, expected.buf)

    # ---- agreement ---------------------------------------------------------------------------
    def _sig(self, description: str) -> int:
        s = self._signatures.get(description)
        if s is None:
            if len(self._signatures) > 4096:
                self._signatures.clear()
            s = self._signatures[description] = signature(description)
        return s

    def _exchange(self, sig: int, description: str, what: str, timeout: Optional[float]) -> None:
        """Every worker's signature; on a difference, every worker's description, and a
        MismatchError naming the first difference on every worker."""
        self._exchange_start(sig, description, what, timeout)()

    def _exchange_start(self, sig: int, description: str, what: str, timeout: Optional[float]) -> Callable[[], None]:
        """``_exchange`` in two halves: this one sends our signature; the function it
        returns waits for every worker's and raises on a difference (so that local work
        can run while the signatures travel)."""
        self.stats["exchanges"] += 1
        mine = np.array([sig, len(description.encode())], dtype=np.int64)
        table = np.empty((self.num_workers, 2), dtype=np.int64)
        req = self._comm.Iallgather(mine, table)

        def finish() -> None:
            self._wait(req, what, timeout, (mine, table))
            if np.all(table[:, 0] == sig):
                return
            self._disagree(table, description, what, timeout)

        return finish

    def _disagree(self, table: np.ndarray, description: str, what: str, timeout: Optional[float]) -> None:
        """The workers' signatures differ: learn what each passed, to say so precisely."""
        lengths = [int(x) for x in table[:, 1]]
        data = np.frombuffer(description.encode(), dtype=np.uint8)
        out = np.empty(sum(lengths), dtype=np.uint8)
        displs = [int(x) for x in np.concatenate([[0], np.cumsum(lengths)[:-1]])]
        self._wait(
            self._comm.Iallgatherv([data, self._MPI.BYTE], [out, lengths, displs, self._MPI.BYTE]),
            what,
            timeout,
            (data, out),
        )
        texts = [bytes(out[d : d + n]).decode(errors="replace") for d, n in zip(displs, lengths)]
        w = next(k for k in range(1, self.num_workers) if texts[k] != texts[0])
        raise MismatchError(
            f"{what}: worker {self.rank}: the workers disagree: worker 0 calls {texts[0]}, worker {w} calls "
            f"{texts[w]}; every worker must make the same collective calls, in the same order, with values "
            "of the same structure, dtypes and shapes"
        )

    def _stand_in(self, what: str, timeout: Optional[float]) -> None:
        """When the memory expects a call that carries a flag next (the same on every
        worker), makes that call's MPI calls flagged as "not my call", with zeros for
        data: a worker whose call is the expected one makes the same MPI calls with its
        data, so every worker's calls are well-formed, and the flag sends every worker on
        to the signature exchange."""
        expected = self._expected.get(self._last)
        if expected is None or not (expected.flagged or expected.carried):
            return
        self._settle(what, timeout)
        if expected.request is not None:
            # The persistent request every worker's expected call starts, on its own buffer.
            buf = expected.buf
            assert buf is not None  # set with the request
            buf.fill(0)
            buf[-1] = DISAGREE[expected.op]
            self._start_persistent(expected, what, timeout)
        elif expected.carried:
            self._carried_all_reduce(
                np.zeros(expected.count, dtype=expected.dtype), expected.op, None, False, what, timeout
            )
        else:
            stand_in = np.zeros(expected.count, dtype=expected.dtype)
            stand_in[-1] = DISAGREE[expected.op]
            self._mpi_all_reduce(stand_in, expected.op, what, timeout)
        self.stats["flagged"] += 1

    def _sync_point(self, description: str, what: str, timeout: Optional[float]) -> None:
        """An agreement exchange for a collective that carries no flag (gathers,
        broadcasts); it also becomes the last agreed call, and the call expected after
        the one before it (so that a loop repeating it makes no stand-in call)."""
        sig = self._sig(description)
        self._stand_in(what, timeout)
        self._exchange(sig, description, what, timeout)
        self._remember(Expected(sig, 0, _NO_DTYPE, ReduceOp.SUM, False))

    def _agree_large(
        self,
        description: str,
        sig: int,
        total: int,
        work: np.dtype,
        op: ReduceOp,
        what: str,
        timeout: Optional[float],
        *,
        carried: bool = False,
        stand_in: bool = True,
    ) -> Callable[[], None]:
        """The agreement of a large all-reduce: one signature exchange before the data.
        Returns the function that completes it: call it before any data crosses MPI.
        ``carried``: the call can carry its flag (remembered so, the next such call does);
        ``stand_in``: False when this worker already made the expected call's MPI calls.
        ``sig``: the description's signature."""
        if stand_in:
            self._stand_in(what, timeout)
        finish = self._exchange_start(sig, description, what, timeout)

        def agreed() -> None:
            finish()
            self._remember(Expected(sig, total, work, op, False, carried))

        return agreed
