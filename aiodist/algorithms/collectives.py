"""The collectives, each an ``async def`` carrying out a schedule from ``schedule.py`` over a ``P2P``.

Rules every function here keeps:
- Arrays are flat (1-D), C-contiguous numpy views; the caller flattens and keeps dtypes
  straight. Results are written in place; inputs that are not outputs are never written.
- The reduction is the caller's ``combine(dst, src)``, which folds ``src`` into ``dst`` in
  place (``lambda d, s: np.add(d, s, out=d)``). It must be associative and commutative up to
  rounding; AVG, PREMUL_SUM and the like are the caller's pre- and post-processing.
- ``all_reduce`` leaves the same bits on every rank: every output element is either reduced by
  one rank and copied to the rest (ring, halving/doubling) or computed by every rank as the
  same expression, lower rank's operand first (recursive doubling), so neither the order of
  arrival nor a combine that is not bitwise commutative (``minimum(0.0, -0.0)``, NaN
  payloads) can make ranks differ.
- The schedule is chosen by size from ``thresholds.Thresholds`` (the ``thresholds`` argument;
  a backend passes its group's table, read once; None reads ``thresholds.current()``), from
  sizes every rank knows, so all ranks choose alike.
- Within a step, sends run concurrently with receives (a send may wait for its receive to be
  posted); pipelined schedules run a sender and a receiver side by side, so a piece's
  reduction overlaps the transfer of the next (the socket keeps filling while numpy works).
- Size 1 sends nothing; messages both ends know to be empty are not sent.
- Failure: the first error of any concurrent send/receive cancels the rest of the op and is
  raised as is (not wrapped in an ExceptionGroup); the op's P2P is then spent.
- The loop never waits long on this module: a reduction or copy of more than ``_STEP_BYTES``
  runs in pieces of that size with a yield to the loop between them (``_reduce``, ``_copy``), so
  no step holds the loop for more than about a millisecond (elementwise work: the same bits
  whatever the pieces).
- No full-size allocation per call: scratch comes from a bounded per-process pool
  (``_POOL``), taken for the op and given back when it ends, so concurrent ops never share one.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from aiodist.algorithms import schedule as sch
from aiodist.algorithms.p2p import P2P
from aiodist.algorithms.thresholds import Thresholds, current

__all__ = [
    "Combine",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "together",
    "retrieve",
]

Combine = Callable[[np.ndarray, np.ndarray], None]

# A message's tag is phase * _PHASE + index: the index counts messages on one (peer, direction)
# within a phase, so tags stay unique per (peer, direction) across the phases of one op.
_PHASE = 1 << 24


def _tag(phase: int, index: int) -> int:
    if index >= _PHASE:
        raise ValueError(f"more than {_PHASE} messages on one channel in one phase: the pipeline piece is too small for this buffer")
    return phase * _PHASE + index


# -- argument checks (cheap, local; sizes across ranks are the P2P's to check) ------------------


def _vec(a: object, what: str, *, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a flat (1-D) C-contiguous array; the caller flattens, got shape {a.shape}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return a


def _vecs(xs: Sequence[np.ndarray], what: str, size: int, dtype: np.dtype, *, writable: bool = False) -> list[np.ndarray]:
    if len(xs) != size:
        raise ValueError(f"{what} has {len(xs)} arrays, the group has {size} ranks")
    out = [_vec(x, f"{what}[{i}]", writable=writable) for i, x in enumerate(xs)]
    for i, x in enumerate(out):
        if x.dtype != dtype:
            raise TypeError(f"{what}[{i}] is {x.dtype}, expected {dtype}")
    return out


def _root(root: int, size: int) -> int:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root {root!r} is not a rank of a group of {size}")
    return root


def _same_size(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.size != b.size:
        raise ValueError(f"{what}: {a.size} elements where {b.size} are expected")


# -- work on the loop in small steps, scratch from a pool -----------------------------------------

#: the most bytes one reduction or copy step handles before yielding to the loop: np.add over
#: 1 MiB takes ~0.1-0.3 ms here, a copy less, so a step stays well under the 2 ms the loop may
#: be held (measured: 4 MiB pieces in one call held it 2-6 ms on a loaded 2-core machine).
_STEP_BYTES = 1 << 20


async def _reduce(combine: Combine, dst: np.ndarray, src: np.ndarray) -> None:
    """``combine(dst, src)`` in steps of at most ``_STEP_BYTES``, yielding between them."""
    step = max(1, _STEP_BYTES // max(1, dst.itemsize))
    if dst.size <= step:
        combine(dst, src)
        return
    for a in range(0, dst.size, step):
        if a:
            await asyncio.sleep(0)
        combine(dst[a : a + step], src[a : a + step])


async def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` in steps of at most ``_STEP_BYTES``, yielding between them."""
    step = max(1, _STEP_BYTES // max(1, dst.itemsize))
    if dst.size <= step:
        np.copyto(dst, src)
        return
    for a in range(0, dst.size, step):
        if a:
            await asyncio.sleep(0)
        np.copyto(dst[a : a + step], src[a : a + step])


class _ScratchPool:
    """Free scratch arrays kept for the next op of the same (dtype, size), at most
    ``max_bytes`` in all (least recently given back goes first; bigger arrays are not kept).
    An array is out of the pool while an op holds it, so two ops in flight never share one."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: OrderedDict[tuple[str, int], list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # ranks may run on loops in several threads

    def take(self, dtype: np.dtype, n: int) -> np.ndarray:
        key = (np.dtype(dtype).str, n)
        with self._lock:
            got = self._free.get(key)
            if got:
                a = got.pop()
                if not got:
                    del self._free[key]
                self._bytes -= a.nbytes
                return a
        return np.empty(n, dtype=dtype)

    def give(self, a: np.ndarray) -> None:
        if a.nbytes > self.max_bytes or a.nbytes == 0:
            return
        key = (a.dtype.str, a.size)
        with self._lock:
            self._free.setdefault(key, []).append(a)
            self._free.move_to_end(key)
            self._bytes += a.nbytes
            while self._bytes > self.max_bytes:
                old, arrays = next(iter(self._free.items()))
                self._bytes -= arrays.pop(0).nbytes
                if not arrays:
                    del self._free[old]

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


_POOL = _ScratchPool()


@contextmanager
def _borrowed(dtype: np.dtype, n: int) -> Iterator[np.ndarray]:
    """A scratch array of ``n`` elements for the duration of the block, back to the pool after
    it (not after a failure: a cancelled receive may still be landing in it)."""
    a = _POOL.take(dtype, n)
    yield a
    _POOL.give(a)


# -- running things concurrently -----------------------------------------------------------------


async def _all(*aws: Coroutine[Any, Any, None]) -> None:
    """Await all concurrently (the last one in this task, the rest in tasks). The first failure
    cancels the others and is raised as itself, not inside an ExceptionGroup."""
    if not aws:
        return
    if len(aws) == 1:
        await aws[0]
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for aw in aws[:-1]:
                tg.create_task(aw)
            await aws[-1]
    except BaseExceptionGroup as eg:
        first = eg.exceptions[0]
        raise first from (eg if len(eg.exceptions) > 1 else None)


#: ``await together(*coroutines)``: ``_all`` under its public name (c10d hands it to DETAIL's
#: fingerprint exchange, in a layer below the schedules)
together = _all


def _exchange(p2p: P2P, to: int, out: np.ndarray, into: np.ndarray, tag: int, frm: int | None = None) -> Awaitable[None]:
    """Send ``out`` to ``to`` and receive ``into`` from ``frm`` (default: ``to``), concurrently:
    ``await _exchange(...)``. Where the P2P can send at once (``P2P.send_nowait``: the socket
    transport's channel, when the bytes go straight into the kernel), what is awaited is the
    receive itself, with no coroutine of this function's around it (the latency-bound
    schedules' common case)."""
    src = to if frm is None else frm
    sent = p2p.send_nowait(to, out, tag)
    if sent is False:
        return _all(p2p.send(to, out, tag), p2p.recv(src, into, tag))
    if sent is True:
        return p2p.recv(src, into, tag)
    return _recv_then_drain(p2p.recv(src, into, tag), sent)


async def _recv_then_drain(recv: Awaitable[None], sent: Awaitable[None]) -> None:
    await recv
    await sent  # written, still draining: the caller may change ``out`` only after this


class _Send(NamedTuple):
    peer: int
    buf: np.ndarray
    tag: int
    after: int  # how many receives (in order) must be complete before this send starts


class _Recv(NamedTuple):
    peer: int
    buf: np.ndarray
    tag: int
    reduce: bool  # receive into scratch and combine into buf, or receive straight into buf


async def _flow(
    p2p: P2P, sends: Sequence[_Send], recvs: Sequence[_Recv], combine: Combine | None = None, scratch: np.ndarray | None = None
) -> None:
    """Run a pipelined schedule: receives complete in order (each combined into its buffer when
    it reduces); each send starts once the first ``after`` receives are complete and sends go
    out in order, so every (peer, direction) sees its messages in the order both ends list them.

    When a receive is ``_AHEAD_MIN_BYTES`` or bigger, up to ``_WINDOW`` receives are posted at
    once (in list order, from the one being waited for), so a payload that comes early lands in
    its array instead of being staged and copied; a reducing one needs a free slot of
    ``scratch`` (which holds ``scratch.size // longest reducing receive`` of them; ``_scratch``
    sizes it). Posting a plain receive early is safe because a schedule's peer sends into a
    region only after it has (causally) seen this rank's last use of that region: its data, or
    a message sent after it. Smaller pieces are received one at a time (a task per receive
    costs more than copying a small staged payload).
    """
    done = 0
    moved = asyncio.Event()

    async def receive_one_by_one() -> None:
        nonlocal done
        for peer, dst, tag, reduce in recvs:
            if dst.size:
                if reduce:
                    assert combine is not None and scratch is not None
                    tmp = scratch[: dst.size]
                    await p2p.recv(peer, tmp, tag)
                    await _reduce(combine, dst, tmp)
                else:
                    await p2p.recv(peer, dst, tag)
            done += 1
            moved.set()

    async def receive() -> None:
        nonlocal done
        if len(recvs) < 2 or max(r.buf.nbytes for r in recvs) < _AHEAD_MIN_BYTES:
            await receive_one_by_one()
            return
        n = len(recvs)
        slots: list[np.ndarray] = []
        if scratch is not None:
            longest = max((r.buf.size for r in recvs if r.reduce), default=0)
            if longest:
                slots = [scratch[i * longest : (i + 1) * longest] for i in range(max(1, scratch.size // longest))]
        free = list(range(len(slots)))
        slot_of: dict[int, int] = {}
        posted: list[asyncio.Task[None] | None] = []

        def post(head: int) -> None:
            while len(posted) < n and len(posted) - head < _WINDOW:
                i = len(posted)
                peer, dst, tag, reduce = recvs[i]
                if not dst.size:
                    posted.append(None)
                    continue
                if reduce:
                    if not free:
                        return
                    slot_of[i] = k = free.pop()
                    dst = slots[k][: dst.size]
                posted.append(asyncio.ensure_future(p2p.recv(peer, dst, tag)))

        try:
            post(0)
            for i, (_, dst, _, reduce) in enumerate(recvs):
                task = posted[i]
                if task is not None:
                    await task
                    posted[i] = None
                    if reduce:
                        assert combine is not None
                        k = slot_of.pop(i)
                        await _reduce(combine, dst, slots[k][: dst.size])
                        free.append(k)
                done += 1
                moved.set()
                post(i + 1)
        finally:
            for t in posted:
                if t is not None and not t.done():
                    t.cancel()
                    t.add_done_callback(retrieve)

    async def send() -> None:
        for peer, src, tag, after in sends:
            while done < after:
                moved.clear()
                await moved.wait()
            if src.size:
                await p2p.send(peer, src, tag)

    assert all(s.after <= len(recvs) for s in sends), "a send waits for a receive that is not in the schedule"
    assert scratch is not None or not any(r.reduce and r.buf.size for r in recvs), "reducing receives need scratch"
    if not recvs:
        await send()
    elif not sends:
        await receive()
    else:
        await _all(send(), receive())


def retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a cancelled task's outcome as seen (its error, if any, is the op's already): a
    receive here, an exchange across of aiodist.algorithms.hier."""
    if not task.cancelled():
        task.exception()


#: receives a pipelined schedule keeps posted at once (a reducing one has its own scratch slot) ...
_WINDOW = 4
#: ... when its pieces are this big; smaller ones are received one at a time
_AHEAD_MIN_BYTES = 64 << 10


def _scratch(dtype: np.dtype, longest: int, total: int | None = None) -> Any:
    """Scratch for ``_flow`` (a context manager giving the array): up to ``_WINDOW`` slots of
    ``longest`` elements, no more than the ``total`` elements its reducing receives take together."""
    slots = _WINDOW if total is None else max(1, min(_WINDOW, -(-total // max(1, longest))))
    return _borrowed(dtype, longest * slots)


# -- ring ------------------------------------------------------------------------------------------


async def _ring(
    p2p: P2P,
    chunks: Sequence[np.ndarray],
    steps: Sequence[sch.RingStep],
    reduce_steps: int,
    combine: Combine | None,
    piece: int,
    phase: int,
) -> None:
    """Ring steps over ``chunks``, in pieces: the first ``reduce_steps`` combine what they
    receive, the rest overwrite; each step's send forwards (piece by piece, as soon as each is
    in) what the step before received."""
    left, right = sch.ring_neighbors(p2p.rank, p2p.size)
    sends: list[_Send] = []
    recvs: list[_Recv] = []
    prev_start = 0
    for s, (sc, rc) in enumerate(steps):
        if s and sc != steps[s - 1].recv:
            raise RuntimeError(f"ring schedule does not forward at step {s}")
        start = len(recvs)
        for j, (a, b) in enumerate(sch.pieces(0, chunks[sc].size, piece)):
            sends.append(_Send(right, chunks[sc][a:b], _tag(phase, len(sends)), prev_start + j + 1 if s else 0))
        for a, b in sch.pieces(0, chunks[rc].size, piece):
            recvs.append(_Recv(left, chunks[rc][a:b], _tag(phase, len(recvs)), s < reduce_steps))
        prev_start = start
    if reduce_steps and recvs:
        red = [r.buf.size for r in recvs if r.reduce]
        with _scratch(chunks[0].dtype, max(red, default=1), sum(red)) as scratch:
            await _flow(p2p, sends, recvs, combine, scratch)
    else:
        await _flow(p2p, sends, recvs, combine)


# -- broadcast / reduce ----------------------------------------------------------------------------


async def broadcast(p2p: P2P, buf: np.ndarray, root: int, *, thresholds: Thresholds | None = None) -> None:
    """Copy root's ``buf`` into every rank's ``buf``.

    Binomial tree (``ceil(log2 p)`` rounds, latency-bound) up to ``broadcast_tree_max`` bytes; a
    pipelined chain root -> root+1 -> ... above it, each rank forwarding a piece as soon as it has
    it, so every link carries the buffer once and the time is about (p - 2 + pieces) pieces.
    """
    p, rank = p2p.size, p2p.rank
    _root(root, p)
    _vec(buf, "buf", writable=rank != root)
    if p == 1 or buf.size == 0:
        return
    th = thresholds or current()
    ps = sch.pieces(0, buf.size, th.piece_elems(buf.itemsize))
    if th.broadcast(buf.nbytes) == "tree":
        parent, children = sch.binomial_tree(rank, p, root)
        dests = children[::-1]  # the largest subtree first: it has the longest way to go
    else:
        parent, nxt = sch.chain(rank, p, root)
        dests = [] if nxt is None else [nxt]
    recvs = [] if parent is None else [_Recv(parent, buf[a:b], _tag(0, j), False) for j, (a, b) in enumerate(ps)]
    sends = [_Send(d, buf[a:b], _tag(0, j), j + 1 if recvs else 0) for j, (a, b) in enumerate(ps) for d in dests]
    await _flow(p2p, sends, recvs)


async def reduce(p2p: P2P, buf: np.ndarray, root: int, combine: Combine, *, thresholds: Thresholds | None = None) -> None:
    """Reduce every rank's ``buf`` into root's ``buf``; other ranks' ``buf`` are left as they were.

    Binomial tree, pipelined in pieces: a rank folds each child's subtree into its own value in
    a fixed order (smallest subtree first, own value first) and passes each piece up as soon as
    it is complete. Inner ranks other than the root reduce into a copy of their ``buf``.
    """
    p, rank = p2p.size, p2p.rank
    _root(root, p)
    _vec(buf, "buf", writable=rank == root)
    if p == 1 or buf.size == 0:
        return
    th = thresholds or current()
    parent, children = sch.binomial_tree(rank, p, root)
    ps = sch.pieces(0, buf.size, th.piece_elems(buf.itemsize))
    if not children:  # a leaf: send its buf up
        assert parent is not None
        await _flow(p2p, [_Send(parent, buf[a:b], _tag(0, j), 0) for j, (a, b) in enumerate(ps)], [])
        return
    with _borrowed(buf.dtype, 0 if parent is None else buf.size) as copy:
        acc = buf
        if parent is not None:  # an inner rank: reduce into a copy, its buf stays as it was
            acc = copy
            await _copy(acc, buf)
        recvs = [_Recv(c, acc[a:b], _tag(0, j), True) for j, (a, b) in enumerate(ps) for c in children]
        sends = [] if parent is None else [_Send(parent, acc[a:b], _tag(0, j), (j + 1) * len(children)) for j, (a, b) in enumerate(ps)]
        with _scratch(buf.dtype, max(b - a for a, b in ps), buf.size * len(children)) as scratch:
            await _flow(p2p, sends, recvs, combine, scratch)


# -- all_reduce ------------------------------------------------------------------------------------

_PH_FOLD, _PH_UNFOLD, _PH_STEPS = 0, 1, 2


async def all_reduce(p2p: P2P, buf: np.ndarray, combine: Combine, *, thresholds: Thresholds | None = None) -> None:
    """Reduce every rank's ``buf`` into every rank's ``buf``, the same bits everywhere.

    - up to ``allreduce_rd_max`` bytes: recursive doubling, ``log2 p`` full exchanges, each pair
      combining lower rank's value first;
    - from ``allreduce_ring_min`` bytes: ring reduce-scatter then ring all-gather, pipelined in
      pieces, each element reduced by one rank (bandwidth 2(p-1)/p of the buffer per rank);
    - between: recursive halving reduce-scatter then recursive doubling all-gather (the same
      bandwidth as the ring in ``2 log2 p`` steps instead of ``2(p-1)``).
    A size that is not a power of two first folds its extra ranks into partners (each odd rank
    of the first pairs hands its data to the even one) and hands them the result at the end.
    """
    if type(buf) is not np.ndarray or buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        _vec(buf, "buf", writable=True)
    p = p2p.size
    if p == 1 or buf.size == 0:
        return
    th = thresholds or current()
    algo = th.all_reduce(buf.nbytes)
    if algo == "recursive_doubling":
        plan = _RD_PLANS.get((p2p.rank, p))
        if plan is None:
            plan = _rd_plan(p2p.rank, p)
        if plan is not _FOLDED:  # no rank of this size folds: the exchanges alone (the latency-bound path)
            await _recursive_doubling(p2p, buf, combine, plan)
            return
    piece = th.piece_elems(buf.itemsize)
    if algo == "ring":
        n = buf.size
        b = sch.chunk_bounds(n, p)
        chunks = [buf[b[i] : b[i + 1]] for i in range(p)]
        steps = sch.ring_reduce_scatter(p2p.rank, p) + sch.ring_all_gather(p2p.rank, p)
        await _ring(p2p, chunks, steps, p - 1, combine, piece, 0)
        return
    f = sch.fold(p2p.rank, p)
    ps = sch.pieces(0, buf.size, piece)
    if f.vrank is None:  # an extra rank: hand the data over, wait for the result
        assert f.partner is not None
        await _flow(p2p, [_Send(f.partner, buf[a:b], _tag(_PH_FOLD, j), 0) for j, (a, b) in enumerate(ps)], [])
        await _flow(p2p, [], [_Recv(f.partner, buf[a:b], _tag(_PH_UNFOLD, j), False) for j, (a, b) in enumerate(ps)])
        return
    if f.partner is not None:  # a keeper: absorb the extra rank (it is the higher one)
        with _scratch(buf.dtype, max(b - a for a, b in ps), buf.size) as scratch:
            await _flow(p2p, [], [_Recv(f.partner, buf[a:b], _tag(_PH_FOLD, j), True) for j, (a, b) in enumerate(ps)], combine, scratch)
    if algo == "recursive_doubling":
        await _recursive_doubling(p2p, buf, combine, _rd_steps(f, p))
    else:
        await _halving_doubling(p2p, buf, combine, f, piece)
    if f.partner is not None:
        await _flow(p2p, [_Send(f.partner, buf[a:b], _tag(_PH_UNFOLD, j), 0) for j, (a, b) in enumerate(ps)], [])


#: (rank, size) -> the recursive-doubling exchanges of a size that is a power of two, as
#: ``(peer, tag, lower)`` (``lower``: this rank's value goes first), or ``_FOLDED`` for a size
#: that folds extra ranks first (the general path)
_RD_PLANS: dict[tuple[int, int], Any] = {}
_FOLDED = object()


def _rd_plan(rank: int, size: int) -> Any:
    f = sch.fold(rank, size)
    plan: Any = _FOLDED if f.pof2 != size else _rd_steps(f, size)
    if len(_RD_PLANS) < 4096:
        _RD_PLANS[(rank, size)] = plan
    return plan


def _rd_steps(f: sch.Fold, size: int) -> tuple[tuple[int, int, bool], ...]:
    """The recursive-doubling exchanges of a rank that takes part (``f.vrank`` set), as
    ``(peer, tag, lower)``: ``lower``, this rank's value goes first."""
    assert f.vrank is not None
    return tuple(
        (sch.real_rank(vpeer, size), _tag(_PH_STEPS + k, 0), f.vrank < vpeer) for k, vpeer in enumerate(sch.rd_partners(f.vrank, f.pof2))
    )


async def _recursive_doubling(p2p: P2P, buf: np.ndarray, combine: Combine, steps: tuple[tuple[int, int, bool], ...]) -> None:
    """``log2 p`` full exchanges, in ``steps`` (``_rd_steps``); each pair combines the lower
    rank's value first, so every rank computes the same bits."""
    cur, other = buf, np.empty(buf.size, buf.dtype)
    for peer, tag, lower in steps:
        await _exchange(p2p, peer, cur, other, tag)
        if lower:
            combine(cur, other)
        else:  # the partner's value goes first: combine into the received copy and keep that
            combine(other, cur)
            cur, other = other, cur
    if cur is not buf:
        np.copyto(buf, cur)


async def _halving_doubling(p2p: P2P, buf: np.ndarray, combine: Combine, f: sch.Fold, piece: int) -> None:
    assert f.vrank is not None
    v, q = f.vrank, f.pof2
    b = sch.chunk_bounds(buf.size, q)
    halving = sch.halving_steps(v, q)
    phase = _PH_STEPS
    with _scratch(buf.dtype, min(piece, max(1, b[q // 2])), b[q // 2]) as scratch:  # the first kept half is the largest receive
        for st in halving:
            peer = sch.real_rank(st.partner, p2p.size)
            sends = [_Send(peer, buf[x:y], _tag(phase, j), 0) for j, (x, y) in enumerate(sch.pieces(b[st.send[0]], b[st.send[1]], piece))]
            recvs = [
                _Recv(peer, buf[x:y], _tag(phase, j), True) for j, (x, y) in enumerate(sch.pieces(b[st.keep[0]], b[st.keep[1]], piece))
            ]
            # no operand-order care needed here: each element is reduced by one rank, then copied
            await _flow(p2p, sends, recvs, combine, scratch)
            phase += 1
    for dst in sch.doubling_steps(v, q):
        peer = sch.real_rank(dst.partner, p2p.size)
        sends = [_Send(peer, buf[x:y], _tag(phase, j), 0) for j, (x, y) in enumerate(sch.pieces(b[dst.mine[0]], b[dst.mine[1]], piece))]
        recvs = [
            _Recv(peer, buf[x:y], _tag(phase, j), False) for j, (x, y) in enumerate(sch.pieces(b[dst.theirs[0]], b[dst.theirs[1]], piece))
        ]
        await _flow(p2p, sends, recvs)
        phase += 1


# -- all_gather / gather / scatter -----------------------------------------------------------------


async def all_gather(p2p: P2P, out_chunks: Sequence[np.ndarray], mine: np.ndarray, *, thresholds: Thresholds | None = None) -> None:
    """Every rank's ``mine`` into every rank's ``out_chunks[that rank]``. Sizes may differ per
    rank; every rank passes chunks of the same sizes (``out_chunks[rank]`` the size of ``mine``).
    The chunks may be views of one buffer (all_gather_into_tensor) or separate arrays.

    Bruck (``ceil(log2 p)`` steps through one staging buffer) up to ``allgather_bruck_max`` bytes
    in all; above it a pipelined ring that receives straight into the chunks.
    """
    p, rank = p2p.size, p2p.rank
    _vec(mine, "mine")
    outs = _vecs(out_chunks, "out_chunks", p, mine.dtype, writable=True)
    _same_size(outs[rank], mine, f"out_chunks[{rank}] (this rank's own chunk)")
    if outs[rank] is not mine:
        await _copy(outs[rank], mine)
    if p == 1:
        return
    th = thresholds or current()
    if th.all_gather(sum(c.nbytes for c in outs)) == "bruck":
        await _bruck(p2p, outs)
    else:
        await _ring(p2p, outs, sch.ring_all_gather(rank, p), 0, None, th.piece_elems(mine.itemsize), 0)


async def _bruck(p2p: P2P, outs: list[np.ndarray]) -> None:
    p, rank = p2p.size, p2p.rank
    order = [(rank + i) % p for i in range(p)]  # the working buffer holds blocks in this order
    offs = [0]
    for r in order:
        offs.append(offs[-1] + outs[r].size)
    work = np.empty(offs[-1], dtype=outs[0].dtype)
    work[: offs[1]] = outs[rank]
    for k, st in enumerate(sch.bruck_steps(rank, p)):
        tag = _tag(0, k)
        ops = []
        if offs[st.blocks]:
            ops.append(p2p.send(st.send_to, work[: offs[st.blocks]], tag))
        if offs[st.have + st.blocks] > offs[st.have]:
            ops.append(p2p.recv(st.recv_from, work[offs[st.have] : offs[st.have + st.blocks]], tag))
        await _all(*ops)
    for i in range(1, p):
        np.copyto(outs[order[i]], work[offs[i] : offs[i + 1]])


async def gather(p2p: P2P, out_chunks: Sequence[np.ndarray] | None, mine: np.ndarray, root: int) -> None:
    """Every rank's ``mine`` into root's ``out_chunks[that rank]`` (sizes may differ; only the
    root passes ``out_chunks``). Direct: the root receives from all ranks at once, straight
    into the chunks."""
    p, rank = p2p.size, p2p.rank
    _root(root, p)
    _vec(mine, "mine")
    if rank != root:
        if mine.size:
            await p2p.send(root, mine, 0)
        return
    if out_chunks is None:
        raise ValueError("the root of a gather needs out_chunks")
    outs = _vecs(out_chunks, "out_chunks", p, mine.dtype, writable=True)
    _same_size(outs[root], mine, f"out_chunks[{root}] (the root's own chunk)")
    if outs[root] is not mine:
        np.copyto(outs[root], mine)
    ops = [p2p.recv(i, outs[i], 0) for i in range(p) if i != root and outs[i].size]
    await _all(*ops)


async def scatter(p2p: P2P, out: np.ndarray, in_chunks: Sequence[np.ndarray] | None, root: int) -> None:
    """Root's ``in_chunks[i]`` into rank i's ``out`` (sizes may differ; only the root passes
    ``in_chunks``). Direct: the root sends to all ranks at once."""
    p, rank = p2p.size, p2p.rank
    _root(root, p)
    _vec(out, "out", writable=True)
    if rank != root:
        if out.size:
            await p2p.recv(root, out, 0)
        return
    if in_chunks is None:
        raise ValueError("the root of a scatter needs in_chunks")
    ins = _vecs(in_chunks, "in_chunks", p, out.dtype)
    _same_size(out, ins[root], "out (the root's own chunk)")
    if ins[root] is not out:
        np.copyto(out, ins[root])
    ops = [p2p.send(i, ins[i], 0) for i in range(p) if i != root and ins[i].size]
    await _all(*ops)


# -- reduce_scatter / all_to_all / barrier ---------------------------------------------------------


async def reduce_scatter(
    p2p: P2P, out: np.ndarray, inputs_per_rank: Sequence[np.ndarray], combine: Combine, *, thresholds: Thresholds | None = None
) -> None:
    """``out`` on rank r = the reduction over every rank of its ``inputs_per_rank[r]``. Sizes may
    differ per r; every rank passes inputs of the same sizes. Inputs are not written.

    Direct (every part straight to its owner in one round; the owner combines in rank order)
    up to ``reduce_scatter_direct_max`` bytes in all; above it a pipelined ring over a working
    copy of the inputs.
    """
    p, rank = p2p.size, p2p.rank
    _vec(out, "out", writable=True)
    ins = _vecs(inputs_per_rank, "inputs_per_rank", p, out.dtype)
    _same_size(out, ins[rank], f"out (inputs_per_rank[{rank}] is this rank's part)")
    if p == 1:
        np.copyto(out, ins[0])
        return
    th = thresholds or current()
    if th.reduce_scatter(sum(x.nbytes for x in ins)) == "direct":
        n = out.size
        parts = [ins[rank] if i == rank else np.empty(n, out.dtype) for i in range(p)]
        ops = [p2p.send(i, ins[i], 0) for i in range(p) if i != rank and ins[i].size]
        ops += [p2p.recv(i, parts[i], 0) for i in range(p) if i != rank and n]
        await _all(*ops)
        acc = parts[0].copy()  # out may share memory with an input: reduce aside, then copy
        for x in parts[1:]:
            combine(acc, x)
        np.copyto(out, acc)
        return
    steps = sch.ring_reduce_scatter(rank, p)
    piece = th.piece_elems(out.itemsize)
    if _overlaps(out, ins, rank):  # work aside: writing ``out`` in place would change inputs still to be read
        with _borrowed(out.dtype, sum(x.size for x in ins)) as work:
            b = [0]
            for x in ins:
                b.append(b[-1] + x.size)
            chunks = [work[b[i] : b[i + 1]] for i in range(p)]
            for c, x in zip(chunks, ins):
                await _copy(c, x)
            await _ring(p2p, chunks, steps, p - 1, combine, piece, 0)
            await _copy(out, chunks[rank])
        return
    # Only the chunks this rank receives into are written: its own (the last step's, reduced
    # straight into ``out``) and, beyond 2 ranks, the ones it forwards; the chunk its first step
    # sends is read from the input as it is.
    written = [st.recv for st in steps if st.recv != rank]
    with _borrowed(out.dtype, sum(ins[i].size for i in written)) as work:
        chunks = list(ins)
        at = 0
        for i in written:
            chunks[i] = work[at : at + ins[i].size]
            at += ins[i].size
            await _copy(chunks[i], ins[i])
        if out is not ins[rank]:
            await _copy(out, ins[rank])
        chunks[rank] = out
        await _ring(p2p, chunks, steps, p - 1, combine, piece, 0)


def _overlaps(out: np.ndarray, ins: Sequence[np.ndarray], rank: int) -> bool:
    """Whether ``out`` may share memory with an input other than as ``ins[rank]`` itself (the
    same elements, the in-place form): with another rank's part, or with its own at an offset,
    where a piecewise forward copy of ``ins[rank]`` into ``out`` overwrites what it has yet to
    read. ``np.may_share_memory`` (bounds only: never misses an overlap, may see one that an
    exact test would not, which only costs the copy)."""
    own = ins[rank]
    if np.may_share_memory(out, own) and not (
        out.__array_interface__["data"][0] == own.__array_interface__["data"][0] and out.size == own.size
    ):
        return True
    return any(np.may_share_memory(out, x) for i, x in enumerate(ins) if i != rank)


async def all_to_all(p2p: P2P, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], *, thresholds: Thresholds | None = None) -> None:
    """``ins[j]`` of rank i into ``outs[i]`` of rank j (sizes may differ: ``outs[i]`` must be the
    size of rank i's ``ins[rank]``).

    Pairwise exchange: in step k a rank sends to rank+k and receives from rank-k, concurrently.
    Up to ``alltoall_burst_max`` bytes sent, all steps are in flight at once; above, one step at
    a time, so a peer never holds more than one unposted message of this op. The choice is
    local (it may differ between ranks): both ways send the same messages with the same tags.
    """
    p, rank = p2p.size, p2p.rank
    if len(ins) != p:
        raise ValueError(f"ins has {len(ins)} arrays, the group has {p} ranks")
    dtype = _vec(ins[0], "ins[0]").dtype
    ins_ = _vecs(ins, "ins", p, dtype)
    outs_ = _vecs(outs, "outs", p, dtype, writable=True)
    _same_size(outs_[rank], ins_[rank], f"outs[{rank}] (this rank's own part)")
    if outs_[rank] is not ins_[rank]:
        np.copyto(outs_[rank], ins_[rank])
    if p == 1:
        return

    def step(k: int, to: int, frm: int) -> list[Coroutine[Any, Any, None]]:
        ops: list[Coroutine[Any, Any, None]] = []
        if ins_[to].size:
            ops.append(p2p.send(to, ins_[to], k))
        if outs_[frm].size:
            ops.append(p2p.recv(frm, outs_[frm], k))
        return ops

    steps = sch.pairwise_steps(rank, p)
    th = thresholds or current()
    if th.all_to_all(sum(x.nbytes for x in ins_)) == "burst":
        ops = [op for k, (to, frm) in enumerate(steps, 1) for op in step(k, to, frm)]
        await _all(*ops)
        return
    for k, (to, frm) in enumerate(steps, 1):
        ops = step(k, to, frm)
        await _all(*ops)


async def barrier(p2p: P2P) -> None:
    """Return once every rank has entered: a dissemination barrier, ``ceil(log2 p)`` rounds of
    empty messages (round k: to rank + 2**k, from rank - 2**k), for any size."""
    token, sink = np.empty(0, np.uint8), np.empty(0, np.uint8)
    for k, (to, frm) in enumerate(sch.dissemination_rounds(p2p.rank, p2p.size)):
        await _exchange(p2p, to, token, sink, k, frm)
