"""all_reduce and all_gather through a group's shared segments. A "doorbell" below (every rank
has reached a step) is the latency lane's phase word where the group has a lane
(``aiodist.shm._lane.phase``: a flag, a yielding spin, then an eventfd; the op's timeout, a dead
peer, an abort and the digest are checked there), else zero-length messages on the op's own
channel (the frame digests and the transport's faults apply as on the socket path).

Rules these keep:
- A payload goes in rounds of one slot (half a segment); round c uses half c % 2 of every
  member's segment. A rank writes its slot of round c only after every peer's "in" doorbell of
  round c - 1, which each peer rings after it is done with round c - 2: so two halves need no
  "done reading" doorbell, within an op or across the group's ops.
- all_reduce, per round: each rank copies its input into its slot, but for its own slice
  (``chunk_bounds``), and rings "in"; once all have, rank r folds every peer's slice r, in rank
  order, into its own buffer's slice r (its own input: no copy of it), copies the result into
  its slot and rings "out"; then every rank copies the other slices from their owners' slots.
  Each element is reduced by one rank and copied to the others: the same bits everywhere.
- all_gather, per round: each rank copies its part into its slot and, piece by piece in the same
  pass (the piece is in cache for the second copy), into its own output slice; rings "in"; and
  copies every peer's part out. A rank whose input is its own output slice (in place) copies it
  into its slot only; an input overlapping the output otherwise is read from a copy of it.
- all_gather with single copy (``GroupShm.cma``, aiodist.shm._cma; where the plan says so): each rank publishes where its
  input is (address, size) and rings "in"; reads every peer's part straight from that peer's
  input into its output (``process_vm_readv``, a piece at a time); copies its own part into its
  output slice; and rings "out". A rank returns (and its caller may
  reuse the input) only after every peer's "out": nobody reads it any more.
- all_reduce with single copy (``GroupShm.cma``, from ``allreduce_cma_min``): each rank
  publishes where its buffer is and rings "in"; rank r reads every peer's slice r, a piece at a
  time, into a piece-sized buffer and folds it into its own buffer's slice r, in rank order (the
  order above: the same bits); rings "reduced"; reads every peer's reduced slice straight into
  its own buffer; and rings "out". A rank returns only after every peer's "out". Given an
  ``Into`` (the op's result goes to other arrays, DDP's gradients), the last reads go straight
  into those arrays, and the own reduced slice is copied there: one pass fewer over the data
  than reducing in place and copying the whole buffer out after.
- reduce with single copy (from ``reduce_cma_min``): each rank publishes where its buffer is
  and where its slice of the result will be (the root's own buffer; another rank's a scratch
  slice, its buffer stays as it was) and rings "in"; rank r folds every peer's slice r into
  its own slice r, own first then the others in rank order (the bits of the single-copy
  all_reduce), and rings "reduced"; the root reads every other rank's reduced slice straight
  into its buffer and rings "out". A rank returns only after the root's "out".
- reduce_scatter with single copy (from ``reduce_scatter_cma_min``): each rank publishes where
  its input (every part, one after the other; parts that are not laid out so are first copied
  into scratch, and so is an input that the output overlaps) is and rings "in"; rank r reads
  part r of every rank and folds them, in rank order (the bits of the socket's direct
  schedule), into its output; and rings "out". A rank returns only after every peer's "out".
- all_to_all with single copy: each rank writes where each of its parts is (address and size,
  per destination rank, and the size it expects of that rank: sender and reader both check)
  through the latency lane (one lane op: the table is 24 bytes a rank, too big for the
  single-copy words); reads its part of every peer's input straight into its
  output; copies its own part; and takes a second lane op (nothing written) so that it returns
  only after every peer has read its input. An input that any output overlaps is first copied
  into one block of scratch. A rank whose parts fit the lane slot after its table writes them
  there instead (inline; its table then says where in the slot), and its peers copy theirs
  out; where every rank's parts were inline, the second lane op is left out (every rank sees
  every post, so all decide alike; the slot's reuse rule covers the reads).
- gather with single copy: each rank publishes where its input is (address, size) and rings
  "in"; the root copies its own part, reads every peer's input straight into its slot of the
  list, and rings "out"; every rank returns after the root's "out".
- scatter with single copy: the root writes where each part is (address and size, per rank)
  through the latency lane (one lane op, as all_to_all); every other rank reads its part
  straight into its tensor; a second lane op; then the root copies its own part (after the
  peers' reads: its tensor may overlap another rank's part). Where the other ranks' parts fit
  the lane slot, the root writes them into it instead (one lane op; the others copy theirs out).
- broadcast with single copy: the root publishes where its tensor is and rings "in"; every other
  rank reads it straight into its own tensor and rings "out"; the root returns after every "out".
- No synchronous step is longer than one piece (``PIECE`` bytes) of a copy or a reduction, or
  one ``READ_PIECE`` of a single-copy read of a peer's memory: the
  loop runs other tasks between pieces (once a millisecond has passed since it last did).
- The op's group, seq and ranks (for messages) and the transport's word on a peer come from
  its ``OpLink`` (aiodist.shm._link), and from nothing else.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import numpy as np

from aiodist.algorithms import schedule as sch
from aiodist.algorithms.collectives import _borrowed  # the bounded scratch pool (no full-size allocation per call)
from aiodist.algorithms.p2p import P2P, byte_view
from aiodist.errors import DistBackendError
from aiodist.shm import _cma, _lane
from aiodist.shm._lane import same_bytes as _same_bytes
from aiodist.shm._link import OpLink
from aiodist.shm._manager import GroupShm, retrieve

__all__ = [
    "Into",
    "all_reduce",
    "all_gather",
    "broadcast_single_copy",
    "reduce_single_copy",
    "reduce_scatter_single_copy",
    "all_to_all_single_copy",
    "gather_single_copy",
    "scatter_single_copy",
    "PIECE",
]

Combine = Callable[[np.ndarray, np.ndarray], None]

#: bytes one synchronous numpy step may touch (a copy of 1 MiB is ~0.1-0.5 ms on this machine)
PIECE = 1 << 20
_YIELD_S = 0.001  # and yields to the loop once this long has passed since the last yield
_PHASE = 1 << 24
_IN, _OUT = 0, 1
_GONE_WAIT_S = 1.0  # how long a read of a peer whose process is gone waits for the transport's word on why
_EMPTY = np.empty(0, np.uint8)
#: an all_reduce's single-copy reads of the peers' slices go through a buffer of this many
#: bytes: it and the own piece stay in cache (1 MiB pieces were 10-20 % slower here)
_CMA_PIECE = 256 * 1024
#: a single-copy read straight into its destination (all_gather, broadcast, gather, scatter)
#: goes a piece of this many bytes at a time: the kernel's fixed cost per call is a page walk
#: and pinning, so larger pieces read faster (8 MiB, one process, median of 30: 1 MiB pieces
#: 626 us, 2 MiB 478, 4 MiB 432, 8 MiB 428), and a 4 MiB read holds the loop 0.3-0.5 ms here
READ_PIECE = 4 << 20


class Into:
    """Where an all_reduce's result goes instead of back into its buffer: ``outs``, arrays whose
    bytes, one after the other, are the buffer's (DDP's gradients for its bucket). ``written``
    is set by a path that wrote them; any other path leaves the result in the buffer, and the
    caller copies it (``copy_from``)."""

    __slots__ = ("outs", "ends", "written")

    def __init__(self, outs: Sequence[np.ndarray]) -> None:
        self.outs = [byte_view(o, writable=True) for o in outs]
        ends, end = [], 0
        for o in self.outs:
            end += o.nbytes
            ends.append(end)
        self.ends = ends
        self.written = False

    @property
    def nbytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def pieces(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, int]]:
        """The parts of ``outs`` that hold the buffer's bytes ``start`` to ``stop``: (a byte
        view of that part, its offset in the buffer), in order."""
        begin = 0
        for o, end in zip(self.outs, self.ends):
            if end > start and begin < stop:
                a, z = max(start, begin), min(stop, end)
                yield o[a - begin : z - begin], a
            if end >= stop:
                return
            begin = end

    def copy_from(self, flat: np.ndarray) -> None:
        """The whole result, from the buffer (a path that reduced in place)."""
        raw = byte_view(flat)
        for dst, at in self.pieces(0, self.nbytes):
            np.copyto(dst, raw[at : at + dst.nbytes])
        self.written = True


async def _doorbell(p2p: P2P, tag: int) -> None:
    """Ring every peer and wait until every peer has rung (zero-length messages under ``tag``)."""
    me, p = p2p.rank, p2p.size
    pending: list[asyncio.Future[None]] = []
    try:
        for q in range(p):
            if q == me:
                continue
            sent = p2p.send_nowait(q, _EMPTY, tag)
            if sent is False:
                pending.append(asyncio.ensure_future(p2p.send(q, _EMPTY, tag)))
            elif sent is not True:
                pending.append(sent)
        for q in range(p):
            if q != me:
                await p2p.recv(q, np.empty(0, np.uint8), tag)
        for f in pending:
            await f
    except BaseException:
        for f in pending:
            if not f.done():
                f.cancel()
            f.add_done_callback(retrieve)
        raise


class _Pacer:
    """Yields to the loop between pieces once ``_YIELD_S`` has passed since the last yield (a
    yield per piece would cost more than the copies it splits, on a quiet loop)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.perf_counter()

    async def tick(self) -> None:
        now = time.perf_counter()
        if now - self.last >= _YIELD_S:
            await asyncio.sleep(0)
            self.last = time.perf_counter()


async def _copy(dst: np.ndarray, src: np.ndarray, pace: _Pacer) -> None:
    """``dst[:] = src`` one piece at a time, letting the loop run between pieces."""
    n = max(1, PIECE // max(1, dst.itemsize))
    for a in range(0, dst.size, n):
        np.copyto(dst[a : a + n], src[a : a + n])
        await pace.tick()


async def _sync(p2p: OpLink, g: GroupShm, step: int, tag: int, nbytes: int) -> None:
    """Every rank has reached this step of the op: the lane's phase words where the group has a
    lane (no socket message: aiodist.shm._lane.phase, which checks digest and size at step 0),
    else zero-length doorbells under ``tag``."""
    if g.lane:
        await _lane.phase(p2p, g, step, nbytes)
    else:
        await _doorbell(p2p, tag)


async def all_reduce(
    p2p: OpLink, g: GroupShm, flat: np.ndarray, combine: Combine, single_copy: bool = False, into: Into | None = None
) -> None:
    """``flat`` reduced across the group, in place (see the module docstring); by single-copy
    reads where ``single_copy`` (the size is over ``allreduce_cma_min``) and the group can, and
    then into ``into``'s arrays where given (``into.written``)."""
    p, me = p2p.size, p2p.rank
    if single_copy and g.cma and flat.flags.c_contiguous:
        await _all_reduce_single_copy(p2p, g, flat, combine, into)
        return
    per = max(1, g.half // flat.itemsize)
    step = max(1, PIECE // flat.itemsize)
    pace = _Pacer()
    for k, start in enumerate(range(0, flat.size, per)):
        chunk = flat[start : start + per]
        nbytes = chunk.nbytes
        slots = [s[:nbytes].view(flat.dtype) for s in g.slots()]
        b = sch.chunk_bounds(chunk.size, p)
        lo, hi = b[me], b[me + 1]
        # the peers' slices only: this rank reduces its own slice from its own buffer
        await _copy(slots[me][:lo], chunk[:lo], pace)
        await _copy(slots[me][hi:], chunk[hi:], pace)
        await _sync(p2p, g, 2 * k, _IN * _PHASE + k, flat.nbytes)
        for a in range(lo, hi, step):
            z = min(a + step, hi)
            out = chunk[a:z]
            for r in range(p):
                if r != me:
                    combine(out, slots[r][a:z])
            np.copyto(slots[me][a:z], out)
            await pace.tick()
        await _sync(p2p, g, 2 * k + 1, _OUT * _PHASE + k, flat.nbytes)
        for q in range(p):
            if q != me:
                await _copy(chunk[b[q] : b[q + 1]], slots[q][b[q] : b[q + 1]], pace)


async def _all_reduce_single_copy(p2p: OpLink, g: GroupShm, flat: np.ndarray, combine: Combine, into: Into | None = None) -> None:
    """all_reduce by single-copy reads (see the module docstring): each rank reduces its slice
    reading every peer's slice straight from that peer's buffer, a piece at a time through a
    piece-sized buffer (in cache), then reads every peer's reduced slice straight into its own
    buffer. Per rank that moves about half the bytes of the segment path."""
    p, me = p2p.size, p2p.rank
    g.cma_ops += 1
    words = g.cma_words[me]
    words[0] = flat.ctypes.data
    words[1] = flat.nbytes
    await _lane.phase(p2p, g, 0, flat.nbytes)  # (step 0 checks every rank's size and digest)
    peers = [q for q in range(p) if q != me]
    addrs = [int(g.cma_words[q][0]) for q in range(p)]
    isz = flat.itemsize
    b = sch.chunk_bounds(flat.size, p)
    lo, hi = b[me], b[me + 1]
    pace = _Pacer()
    await _fold(p2p, g, flat[lo:hi], None, lo, addrs, combine, pace, "all_reduce")
    await _lane.phase(p2p, g, 1, flat.nbytes)  # every slice is reduced
    mine = byte_view(flat, writable=True)
    if into is not None and into.nbytes == flat.nbytes:
        for q in range(p):
            for dst, at in into.pieces(b[q] * isz, b[q + 1] * isz):
                if q == me:
                    np.copyto(dst, mine[at : at + dst.nbytes])
                else:
                    await _read(p2p, g, q, dst, addrs[q] + at, pace, "all_reduce")
        into.written = True
    else:
        for q in peers:
            await _read(p2p, g, q, mine[b[q] * isz : b[q + 1] * isz], addrs[q] + b[q] * isz, pace, "all_reduce")
    await _lane.phase(p2p, g, 2, flat.nbytes)  # every peer has read this rank's slice: the buffer is the caller's again


async def _fold(
    p2p: OpLink, g: GroupShm, acc: np.ndarray, own: np.ndarray | None, lo: int, addrs: list[int], combine: Combine, pace: _Pacer, op: str
) -> None:
    """Elements ``lo`` to ``lo + acc.size`` of every rank's buffer (rank q's at ``addrs[q]``),
    reduced into ``acc``: this rank's own first (``own``, copied in; None: ``acc`` holds it
    already), then every peer's in rank order, read a piece at a time into a piece-sized
    buffer (it and the piece of ``acc`` stay in cache)."""
    me, isz = p2p.rank, acc.itemsize
    step = max(1, _CMA_PIECE // isz)
    tmp = np.empty(min(step, acc.size), acc.dtype)
    raw = tmp.view(np.uint8)
    for a in range(0, acc.size, step):
        z = min(a + step, acc.size)
        out = acc[a:z]
        if own is not None:
            np.copyto(out, own[a:z])
        for q in range(p2p.size):
            if q != me:
                try:
                    _cma.read(g.pids[q], raw[: (z - a) * isz], addrs[q] + (lo + a) * isz)
                except OSError as exc:
                    await _read_failed(p2p, q, g.pids[q], exc, op)
                combine(out, tmp[: z - a])
        await pace.tick()


@contextmanager
def _held(g: GroupShm, dtype: np.dtype, n: int) -> Iterator[np.ndarray]:
    """Scratch from the pool that peers read by address: back to the pool once the op is done;
    where the op fails, kept (``GroupShm.parked``) until the group goes, as a peer may still be
    reading it (a rank's last ring says it has read its peers, not that they have read it)."""
    with _borrowed(dtype, n) as a:
        try:
            yield a
        except BaseException:
            if a.size:
                g.parked.append(a)
            raise


async def reduce_single_copy(p2p: OpLink, g: GroupShm, flat: np.ndarray, root: int, combine: Combine) -> None:
    """Every rank's ``flat`` reduced into the root's, by single-copy reads (see the module
    docstring): rank r reduces slice r of every rank's buffer, the root then reads the reduced
    slices. The other ranks' ``flat`` are only read; their slice of the result is scratch from
    the algorithms' pool (not a full-size allocation per call)."""
    p, me = p2p.size, p2p.rank
    g.cma_ops += 1
    isz = flat.itemsize
    b = sch.chunk_bounds(flat.size, p)
    lo, hi = b[me], b[me + 1]
    with _held(g, flat.dtype, 0 if me == root else hi - lo) as scratch:
        acc = flat[lo:hi] if me == root else scratch
        words = g.cma_words[me]
        words[0] = flat.ctypes.data
        words[1] = flat.nbytes
        words[2] = acc.ctypes.data
        await _lane.phase(p2p, g, 0, flat.nbytes)  # (step 0 checks every rank's size and digest)
        peers = [q for q in range(p) if q != me]
        addrs = [int(g.cma_words[q][0]) for q in range(p)]
        pace = _Pacer()
        await _fold(p2p, g, acc, None if me == root else flat[lo:hi], lo, addrs, combine, pace, "reduce")
        await _lane.phase(p2p, g, 1, flat.nbytes)  # every slice is reduced
        if me == root:
            mine = byte_view(flat, writable=True)
            for q in peers:
                if b[q + 1] > b[q]:
                    await _read(p2p, g, q, mine[b[q] * isz : b[q + 1] * isz], int(g.cma_words[q][2]), pace, "reduce")
        await _lane.phase(p2p, g, 2, flat.nbytes)  # the root has read every reduced slice


def _block(parts: Sequence[np.ndarray], offs: list[int]) -> int | None:
    """Where the parts start, if they lie one after the other in memory (part q ``offs[q]``
    elements from the start; empty parts lie anywhere); None if they do not."""
    live = [(x, o) for x, o in zip(parts, offs) if x.size]
    if not live or not all(x.flags.c_contiguous for x, _ in live):
        return None
    isz = live[0][0].itemsize
    base = live[0][0].ctypes.data - live[0][1] * isz
    return base if all(x.ctypes.data == base + o * isz for x, o in live) else None


async def reduce_scatter_single_copy(p2p: OpLink, g: GroupShm, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine) -> None:
    """``out`` of rank r = part r of every rank's input, reduced in rank order, by single-copy
    reads (see the module docstring). Part sizes may differ per r (every rank passes the same)."""
    p, me = p2p.size, p2p.rank
    g.cma_ops += 1
    isz = out.itemsize
    offs = [0]
    for x in parts:
        offs.append(offs[-1] + x.size)
    pace = _Pacer()
    block = _block(parts, offs)
    aside = block is None or any(np.may_share_memory(out, x) for x in parts)
    with _held(g, out.dtype, offs[-1] if aside else 0) as scratch:
        if aside:  # one block that nobody writes while the peers read it
            for q in range(p):
                await _copy(scratch[offs[q] : offs[q + 1]], parts[q], pace)
            base = scratch.ctypes.data if scratch.size else 0
            own = scratch[offs[me] : offs[me + 1]]
        else:
            assert block is not None
            base = block
            own = parts[me]
        words = g.cma_words[me]
        words[0] = base
        words[1] = offs[-1] * isz
        await _lane.phase(p2p, g, 0, offs[-1] * isz)  # (step 0 checks every rank's size and digest)
        addrs = [int(g.cma_words[q][0]) for q in range(p)]
        step = max(1, _CMA_PIECE // isz)
        m = out.size
        tmp = np.empty(min(step, m), out.dtype)
        raw = tmp.view(np.uint8)
        at = offs[me] * isz  # where part ``me`` is in every rank's input
        for a in range(0, m, step):
            z = min(a + step, m)
            o = out[a:z]
            for q in range(p):  # rank order, as the direct schedule
                if q == me:
                    src = own[a:z]
                else:
                    dst = byte_view(o, writable=True) if q == 0 else raw[: (z - a) * isz]
                    try:
                        _cma.read(g.pids[q], dst, addrs[q] + at + a * isz)
                    except OSError as exc:
                        await _read_failed(p2p, q, g.pids[q], exc, "reduce_scatter")
                    src = tmp[: z - a]
                if q == 0:
                    if me == 0:
                        np.copyto(o, src)
                else:
                    combine(o, src)
            await pace.tick()
        await _lane.phase(p2p, g, 1, offs[-1] * isz)  # every peer has read this rank's input


#: an all_to_all post's first word: its parts follow its table in the lane slot (``INLINE``), or
#: the table holds where they are in the poster's memory (``READ``)
_READ, _INLINE = 0, 1


async def all_to_all_single_copy(p2p: OpLink, g: GroupShm, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
    """``ins[j]`` of rank i into ``outs[i]`` of rank j by single-copy reads (see the module
    docstring), or through the lane slot where a rank's parts fit it (inline); sizes may
    differ, but ``outs[i]`` must be the size of rank i's ``ins[rank]``."""
    p = p2p.size
    g.cma_ops += 1
    srcs = [byte_view(x) for x in ins]
    dsts = [byte_view(o, writable=True) for o in outs]
    total = sum(x.nbytes for x in srcs)
    head = table_bytes(p)
    table = np.zeros(1 + 3 * p, np.int64)
    table[3::3] = [d.nbytes for d in dsts]  # what this rank expects of each (both sides check)
    if _lane.fits(g, head + total):  # inline: the parts go in the slot, after the table
        table[0] = _INLINE
        at = head
        for q, x in enumerate(srcs):
            table[1 + 3 * q] = at
            table[2 + 3 * q] = x.nbytes
            at += x.nbytes
        got = await _lane.exchange(p2p, g, [table.view(np.uint8), *srcs], [-1] * p, "all_to_all")
        await _all_to_all_reads(p2p, g, got, dsts, srcs, _Pacer())
        return
    aside = any(d.nbytes and x.nbytes and np.may_share_memory(d, x) for d in dsts for x in srcs)
    pace = _Pacer()
    with _held(g, np.dtype(np.uint8), total if aside else 0) as scratch:
        if aside:  # one block that nobody writes while the peers read it
            at = 0
            for q, x in enumerate(srcs):
                srcs[q] = scratch[at : at + x.nbytes]
                await _copy(srcs[q], x, pace)
                at += x.nbytes
        table[0] = _READ
        for q, x in enumerate(srcs):
            if x.nbytes:
                table[1 + 3 * q] = x.ctypes.data
                table[2 + 3 * q] = x.nbytes
        got = await _lane.exchange(p2p, g, table.view(np.uint8), [-1] * p, "all_to_all")
        await _all_to_all_reads(p2p, g, got, dsts, srcs, pace)


def table_bytes(p: int) -> int:
    """An all_to_all post's table in a group of ``p``: its first word, then per rank where the
    part for it is, its size, and what this rank expects of it."""
    return 8 + 24 * p


async def _all_to_all_reads(
    p2p: OpLink, g: GroupShm, got: list[np.ndarray], dsts: list[np.ndarray], srcs: list[np.ndarray], pace: _Pacer
) -> None:
    """An all_to_all's reads once every rank posted (``got``: every rank's post): first the
    sizes, on both sides of every pair with this rank (a mistake fails sender and reader alike);
    a part inline is copied out of its sender's slot (this rank's own too: its input may overlap
    its output), one elsewhere read from its sender's memory; then, where any rank's parts were
    read from its memory, a second lane op, so that it returns only after every peer has read
    them (every rank sees every post: they all decide alike)."""
    p, me = p2p.size, p2p.rank
    posts = [v[: table_bytes(p)].view(np.int64) for v in got]  # (views of the slots: read now)
    mine = posts[me]
    for q in range(p):
        theirs = posts[q]
        n = int(theirs[2 + 3 * me])
        if n != dsts[q].nbytes:
            raise _lane.size_mismatch(p2p, "all_to_all", q, n, me, dsts[q].nbytes)
        sent, want = int(mine[2 + 3 * q]), int(theirs[3 + 3 * me])
        if sent != want:
            raise _lane.size_mismatch(p2p, "all_to_all", me, sent, q, want)
    read = False
    for q in range(p):
        post = posts[q]
        inline = int(post[0]) == _INLINE
        read = read or not inline
        where, n = int(post[1 + 3 * me]), int(post[2 + 3 * me])
        if inline:
            if n:
                await _copy(dsts[q], got[q][where : where + n], pace)
        elif q == me:
            if not _same_bytes(dsts[me], srcs[me]):
                await _copy(dsts[me], srcs[me], pace)
        else:
            await _read(p2p, g, q, dsts[q], where, pace, "all_to_all")
    if read:
        await _lane.exchange(p2p, g, None, [0] * p, "all_to_all")  # every peer has read this rank's input


# -- an all_to_all of one size everywhere, posted inline in its issuing call
# -- (aiodist.backends.routes.Quick): the same posts as all_to_all_single_copy's inline ones


def all_to_all_table(p: int, part: int) -> np.ndarray:
    """The table of an inline post of ``p`` parts of ``part`` bytes each (this rank sends and
    expects ``part`` bytes of every rank), as bytes."""
    table = np.zeros(1 + 3 * p, np.int64)
    table[0] = _INLINE
    head = table_bytes(p)
    table[1::3] = head + part * np.arange(p)
    table[2::3] = part
    table[3::3] = part
    return table.view(np.uint8)


def all_to_all_inline_agree(g: GroupShm, s: int, me: int, p: int, part: int) -> bool:
    """Whether every rank's post in slot ``s`` is inline and sends this rank, and expects of it,
    ``part`` bytes: then ``all_to_all_copy`` finishes the op; otherwise its rest
    (``all_to_all_rest``) reads, checks and names what does not agree."""
    h = table_bytes(p)
    for q in range(p):
        post = g.bodies[q][s][:h].view(np.int64)
        if post[0] != _INLINE or post[2 + 3 * me] != part or post[3 + 3 * me] != part:
            return False
    return True


def all_to_all_copy(g: GroupShm, s: int, me: int, p: int, out: np.ndarray, part: int) -> None:
    """Every rank's part for this one out of its slot into ``out`` (bytes, ``p`` parts)."""
    at = table_bytes(p) + me * part
    for q in range(p):
        out[q * part : (q + 1) * part] = g.bodies[q][s][at : at + part]


async def all_to_all_rest(p2p: OpLink, g: GroupShm, s: int, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
    """The rest of an all_to_all posted in its issuing call, in slot ``s``, whose posts did not
    all agree with it (a peer's parts read from its memory, or sizes that differ): the reads
    and checks of ``all_to_all_single_copy``."""
    got = _lane.parts(g, s, [-1] * p2p.size)
    await _all_to_all_reads(p2p, g, got, [byte_view(o, writable=True) for o in outs], [byte_view(x) for x in ins], _Pacer())


async def gather_single_copy(p2p: OpLink, g: GroupShm, outs: Sequence[np.ndarray] | None, mine: np.ndarray, root: int) -> None:
    """Every rank's ``mine`` into the root's ``outs[that rank]`` by single-copy reads (see the
    module docstring); only the root passes ``outs``."""
    p, me = p2p.size, p2p.rank
    g.cma_ops += 1
    src = byte_view(mine)
    words = g.cma_words[me]
    words[0] = src.ctypes.data if src.nbytes else 0
    words[1] = src.nbytes
    await _lane.phase(p2p, g, 0, 0)  # (sizes may differ per rank: the root checks each below)
    if me == root:
        assert outs is not None
        dsts = [byte_view(o, writable=True) for o in outs]
        pace = _Pacer()
        if not _same_bytes(dsts[me], src):
            await _copy(dsts[me], src, pace)  # first: the root's input may overlap a peer's slot
        for q in range(p):
            if q != me:
                addr, n = int(g.cma_words[q][0]), int(g.cma_words[q][1])
                if n != dsts[q].nbytes:
                    raise _lane.size_mismatch(p2p, "gather", q, n, me, dsts[q].nbytes)
                await _read(p2p, g, q, dsts[q], addr, pace, "gather")
    await _lane.phase(p2p, g, 1, 0)  # the root has read every input


async def scatter_single_copy(p2p: OpLink, g: GroupShm, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int) -> None:
    """The root's ``ins[i]`` into rank i's ``out`` by single-copy reads (see the module
    docstring); only the root passes ``ins``."""
    p, me = p2p.size, p2p.rank
    g.cma_ops += 1
    dst = byte_view(out, writable=True)
    msg: np.ndarray | list[np.ndarray] | None = None
    if me == root:
        assert ins is not None
        srcs = [byte_view(x) for x in ins]
        # the table: a mode word, then (address or offset, size) per rank. Where every other
        # rank's part fits the lane slot after the table, the parts go in it (inline: one lane
        # op, the root waits for nobody to read); else their addresses (two lane ops)
        head = 8 * (1 + 2 * p)
        inline = head + sum(x.nbytes for q, x in enumerate(srcs) if q != me) <= g.bodies[me][0].size
        table = np.zeros(1 + 2 * p, np.int64)
        table[0] = inline
        at = head
        for q, x in enumerate(srcs):
            if q != me and x.nbytes:
                table[1 + 2 * q] = at if inline else x.ctypes.data
                table[2 + 2 * q] = x.nbytes
                at += x.nbytes
        # (inline: the table, then the parts in rank order, each copied once, into the slot)
        msg = [table.view(np.uint8), *(x for q, x in enumerate(srcs) if q != me and x.nbytes)] if inline else table.view(np.uint8)
    sizes = [-1 if q == root else 0 for q in range(p)]
    got = await _lane.exchange(p2p, g, msg, sizes, "scatter")
    body = got[root]
    t = body[: 8 * (1 + 2 * p)].view(np.int64)  # (views of the root's slot: read now)
    inline = bool(t[0])
    if me != root:
        where, n = int(t[1 + 2 * me]), int(t[2 + 2 * me])
        if n != dst.nbytes:
            raise _lane.size_mismatch(p2p, "scatter", root, n, me, dst.nbytes)
        if inline:
            np.copyto(dst, body[where : where + n])
        else:
            await _read(p2p, g, root, dst, where, _Pacer(), "scatter")
    if not inline:
        await _lane.exchange(p2p, g, None, [0] * p, "scatter")  # every rank has read its part
    if me == root and not _same_bytes(dst, srcs[me]):
        await _copy(dst, srcs[me], _Pacer())


async def all_gather(p2p: OpLink, g: GroupShm, outs: Sequence[np.ndarray], mine: np.ndarray, single_copy: bool = False) -> None:
    """Every rank's ``mine`` into every rank's ``outs[that rank]`` (sizes may differ per rank;
    every rank passes the same sizes); by single-copy reads where ``single_copy`` (the plan's)
    and the group can."""
    p, me = p2p.size, p2p.rank
    src = byte_view(mine)
    dsts = [byte_view(o, writable=True) for o in outs]
    own = dsts[me]
    in_place = _same_bytes(own, src)
    if not in_place and any(np.may_share_memory(src, d) for d in dsts):
        src = src.copy()  # a later round's output would overwrite input it has yet to send
    if g.cma and single_copy:
        await _all_gather_single_copy(p2p, g, dsts, src, in_place)
        return
    longest = max(d.nbytes for d in dsts)
    per = g.half
    step = max(1, PIECE // 2)  # a step writes a piece twice: into the slot and the own slice
    pace = _Pacer()
    for k, lo in enumerate(range(0, longest, per)):
        slots = g.slots()
        part = src[lo : lo + per]
        slot = slots[me][: part.size]
        if in_place:
            await _copy(slot, part, pace)
        else:
            mine_out = own[lo : lo + per]
            for a in range(0, part.size, step):
                piece = part[a : a + step]
                np.copyto(slot[a : a + step], piece)
                np.copyto(mine_out[a : a + step], piece)  # from cache: the step above just read it
                await pace.tick()
        await _sync(p2p, g, k, _IN * _PHASE + k, sum(d.nbytes for d in dsts))
        for q in range(p):
            if q != me:
                d = dsts[q][lo : lo + per]
                await _copy(d, slots[q][: d.size], pace)


async def _all_gather_single_copy(p2p: OpLink, g: GroupShm, dsts: list[np.ndarray], src: np.ndarray, in_place: bool) -> None:
    """all_gather by single-copy reads (see the module docstring): every peer's input straight
    into this rank's output, no segment in between."""
    p, me = p2p.size, p2p.rank
    total = sum(d.nbytes for d in dsts)
    g.cma_ops += 1
    words = g.cma_words[me]
    words[0] = src.ctypes.data if src.nbytes else 0
    words[1] = src.nbytes
    await _lane.phase(p2p, g, 0, total)  # the words are written before the phase word (x86-TSO)
    pace = _Pacer()
    for q in range(p):
        if q != me:
            addr, n = int(g.cma_words[q][0]), int(g.cma_words[q][1])
            d = dsts[q]
            if n != d.nbytes:  # (step 0 checked the total and the digest: a part's size too, unless the digest is off)
                ranks = p2p.ranks
                raise DistBackendError(
                    f"all_gather on group {p2p.group_id}, seq {p2p.seq}: rank {ranks[q]} passed {n} bytes, this rank "
                    f"(rank {ranks[me]}) expected {d.nbytes} from it (every rank must pass the same sizes)"
                )
            await _read(p2p, g, q, d, addr, pace)
    if not in_place:  # after the reads: 20-30% faster at 2 ranks here than before them
        await _copy(dsts[me], src, pace)
    await _lane.phase(p2p, g, 1, total)  # every peer has read this rank's input


async def broadcast_single_copy(p2p: OpLink, g: GroupShm, flat: np.ndarray, root: int) -> None:
    """``flat`` of ``root`` into ``flat`` of every rank, each reading the root's straight into
    its own (see the module docstring)."""
    me = p2p.rank
    g.cma_ops += 1
    if me == root:
        src = byte_view(flat)
        words = g.cma_words[me]
        words[0] = src.ctypes.data
        words[1] = src.nbytes
    await _lane.phase(p2p, g, 0, flat.nbytes)  # (every rank's size is checked here)
    if me != root:
        await _read(p2p, g, root, byte_view(flat, writable=True), int(g.cma_words[root][0]), _Pacer(), "broadcast")
    await _lane.phase(p2p, g, 1, flat.nbytes)  # every rank has read the root's tensor


async def _read(p2p: OpLink, g: GroupShm, q: int, dst: np.ndarray, addr: int, pace: _Pacer, op: str = "all_gather") -> None:
    """Read ``dst.nbytes`` at ``addr`` of group rank ``q``'s process into ``dst``, a piece at a time."""
    pid = g.pids[q]
    for a in range(0, dst.nbytes, READ_PIECE):
        try:
            _cma.read(pid, dst[a : a + READ_PIECE], addr + a)
        except OSError as exc:
            await _read_failed(p2p, q, pid, exc, op)
        await pace.tick()


async def _read_failed(p2p: OpLink, q: int, pid: int, exc: OSError, op: str) -> NoReturn:
    """A single-copy read of group rank ``q`` failed: the transport's error where a peer died or
    left or the group was aborted, else one that names the op's group, seq, the rank and why.
    A peer whose process is gone (ESRCH) has most often left because the op failed elsewhere
    (another rank died, and that peer raised and exited): the transport hears of it within
    moments, so for up to ``_GONE_WAIT_S`` this waits for that error, which names the cause."""
    deadline = time.monotonic() + (_GONE_WAIT_S if exc.errno == errno.ESRCH else 0.0)
    while True:
        for r in range(p2p.size):
            if r != p2p.rank:
                p2p.check_peer(r)
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.01)
    ranks = p2p.ranks
    gone = exc.errno == errno.ESRCH  # its process ended: whatever else failed, it is not a survivor
    raise DistBackendError(
        f"{op} on group {p2p.group_id}, seq {p2p.seq}: reading rank {ranks[q]}'s {'tensor' if op == 'broadcast' else 'input'} "
        f"(process {pid}) failed on rank {ranks[p2p.rank]}: {os.strerror(exc.errno or 0)}",
        culprits={ranks[q]: f"its process ended (process {pid}: no such process)"} if gone else None,
    ) from exc
