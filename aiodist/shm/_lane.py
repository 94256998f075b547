"""The latency lane: small all_reduce, reduce, reduce_scatter, all_gather, gather, scatter,
broadcast and barrier through the first bytes of every member's segment, with no message on any socket when the group's ranks arrive
together; and the phase words that are the big ops' doorbells (``phase``).

Why: between processes on one host, what a small op costs is not the bytes but the wake-ups: a
rank asleep in epoll that a peer's message wakes (on a VM, tens to hundreds of microseconds
each). The lane has a rank write its input where its peers read it and watch their flags,
spinning a little while (``GroupShm.spin_s``) before it sleeps on its doorbell.

Layout (``aiodist.shm._manager``: ``lane_bytes(ranks)`` at the start of every member's segment), int64
words: ``sleeping`` (the value this rank is asleep waiting for), ``phase`` (a big op's step),
``current`` (the op this rank is in: digest, its number in the line + 1, written as a seqlock), two ``checks`` sets
(digest and size of the group's big ops, by their count's parity); then two slots, each a
64-byte head (flag, digest, nbytes) and the group's payload bytes (``_manager.lane_max``: 4 MiB in
a group of 2 ranks, 1 MiB in a wider one).

Rules this module keeps:
- A group's k-th lane op uses slot k % 2 of every member. A rank writes its slot for op k only
  after it saw every peer's flag of op k - 1, which each peer wrote only after it had read every
  slot of op k - 2 (the same slot): two slots need no "done reading" flag. Lane ops run in the
  group's shared-memory line (tickets), one at a time, in issue order.
- A rank writes the payload, then the digest and size, then the flag (the op's number in the
  line + 1, so flags only grow). x86-TSO keeps stores in program order and loads in program order,
  so a reader that sees the flag sees the payload (the lane is used only on x86-64:
  ``_manager._TSO``).
- A waiter that stops spinning publishes ``sleeping = flag``, fences, and checks the flags again
  before it sleeps; a writer fences after its flag and rings every peer whose ``sleeping`` is
  that flag. The fences (a lock's acquire and release: locked instructions on x86) make it
  Dekker's protocol: at least one of the two sees the other's store, so a wait is never lost.
  A ring nobody needed is a spurious wake-up: the waiter checks its flags and sleeps again.
- A sleeping rank wakes at least every ``_RECHECK_S`` and asks the transport whether a peer it
  waits for died or left, or the group was aborted (a peer's desync, a failed op elsewhere):
  then it raises that error. The op's timeout and ``break_group`` cancel it as any op. The
  op's tracker counts the sleeping wait as a receive's, so a timeout names the peers waited on.
  Both go through the op's ``OpLink`` (aiodist.shm._link), as does a desync's abort.
- Every rank checks each peer's digest and size against its own (the always-on desync check of
  aiodist._digest, which no frame carries here) and reduces every slot in rank order: the
  same bits on every rank. A big op checks them at its first phase, from the check set of its
  parity (a peer writes that set again only after this rank's first phase of the next big op);
  a sleeping wait reads its peers' ``current`` words, so a peer in another kind of op at the
  same seq (which writes other words) is a desync, not a wait until the timeout.
- Flags and phase words only grow (the op's number in the line + 1: ``OpLink.line_seq``, its
  seq but for a hierarchical op's in-host phases, which each have their own; and the group's
  count of big ops ``<< 26`` plus the step), so a wait is for a value at least its target.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from aiodist._message import LINE_STEP, byte_view
from aiodist.algorithms.schedule import chunk_bounds
from aiodist.errors import DistBackendError
from aiodist.shm._link import OpLink
from aiodist.shm._manager import GroupShm

__all__ = [
    "SLICED_TOTAL",
    "sliced",
    "slice_sizes",
    "all_reduce_gather",
    "gather_slices",
    "post",
    "collect",
    "parts",
    "settle",
    "now",
    "exchange",
    "phase",
    "announce",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "broadcast",
    "all_gather",
    "gather",
    "gather_posts",
    "gather_finish",
    "size_mismatch",
    "gather_even",
    "scatter",
    "scatter_posts",
    "scatter_finish",
    "scatter_even",
    "fits",
    "piece_bounds",
    "broadcast_pieces",
    "reduce_scatter_pieces",
    "all_reduce_pieces",
    "same_bytes",
]

Combine = Callable[[np.ndarray, np.ndarray], None]

log = logging.getLogger("aiodist.shm")

_RECHECK_S = 0.01  # a sleeping lane wait looks at the transport (dead peer, abort) this often
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (see the module docstring): a lock's acquire and release each
    execute a locked instruction."""
    _FENCE.acquire()
    _FENCE.release()


def fits(g: GroupShm, nbytes: int) -> bool:
    """Whether a rank's ``nbytes`` fit the group's lane (the same answer on every rank)."""
    return g.fits_lane(nbytes)


#: index into ``GroupShm.words[q]`` (int64 words of member q's lane) of its ``current`` words
#: (digest, the op's number in the line + 1); each slot's head (flag, then digest and nbytes after it) is at ``g.head[s]``
_CUR = 2
#: ``collect``'s answer where every peer is there but one wrote another digest or size: the
#: full check (``settle``, with the op's link) names it
ODD: list[np.ndarray] = []


def post(g: GroupShm, seq: int, digest: int, mine: np.ndarray | Sequence[np.ndarray] | None, written: int = 0) -> int:
    """A lane op's first step, which never waits: say which op this rank is in, write ``mine``
    (bytes, pieces of bytes written one after the other, or nothing: then ``written`` bytes the
    caller wrote in the slot, ``g.lane_ops & 1``) and its head (digest, size, then the flag),
    and ring every peer asleep on this op. The slot used (``collect``'s ``s``)."""
    me = g.me
    s = g.lane_ops & 1
    g.lane_ops += 1
    w = g.words[me]
    w[_CUR + 1] = 0  # announce (a seqlock: see ``announce``)
    w[_CUR] = digest
    w[_CUR + 1] = seq + 1
    n = written
    if isinstance(mine, np.ndarray):
        n = mine.nbytes
        if n:
            g.bodies[me][s][:n] = mine
    elif mine is not None:
        body = g.bodies[me][s]
        for piece in mine:
            body[n : n + piece.nbytes] = piece
            n += piece.nbytes
    h = g.head[s]
    w[h + 1] = digest
    w[h + 2] = n
    w[h] = seq + 1
    _FENCE.acquire()  # a full barrier (``_fence``), written out: this is every lane op's path
    _FENCE.release()
    words = g.words
    for q in g.others:
        if words[q][0] == seq + 1:  # asleep waiting for this flag
            os.eventfd_write(g.bells[q], 1)
    return s


def collect(g: GroupShm, s: int, seq: int, digest: int, sizes: Sequence[int]) -> bool | list[np.ndarray]:
    """Whether every peer posted op ``seq`` in slot ``s`` (False: not yet; nothing changes), and
    with this rank's digest and ``sizes[peer]`` bytes (a negative size: any): True; ``ODD``
    where one did not (``settle`` names it). Never waits."""
    h = g.head[s]
    target = seq + 1
    words = g.words
    odd = False
    for q in g.others:
        w = words[q]
        if w[h] < target:
            return False
        if (w[h + 1] != digest and digest and w[h + 1]) or (w[h + 2] != sizes[q] and sizes[q] >= 0):
            odd = True
    return ODD if odd else True


def parts(g: GroupShm, s: int, sizes: Sequence[int]) -> list[np.ndarray]:
    """Every member's bytes of slot ``s`` (views, valid until this rank's next lane op of the
    group), as ``sizes`` says (a negative size: what that member wrote)."""
    h = g.head[s]
    return [g.bodies[q][s][: n if n >= 0 else g.words[q][h + 2]] for q, n in enumerate(sizes)]


async def settle(p2p: OpLink, g: GroupShm, s: int, sizes: Sequence[int], op: str, spin: bool = True, sub: int = 0) -> list[np.ndarray]:
    """The rest of a lane op that ``post`` began: wait for every peer's flag (``_wait``: a
    spin unless ``spin`` is false, then the doorbell), check each peer's digest and size (a
    desync, a size error: raised), and every member's bytes (``parts``)."""
    me = p2p.rank
    seq, digest = p2p.seq, p2p.digest
    target = p2p.line_seq + sub + 1
    heads = [h[s] for h in g.heads]
    missing = [q for q in g.others if heads[q][0] < target]
    if missing:
        await _wait(p2p, g, heads, missing, target, spin)
    for q in g.others:
        h = heads[q]
        if digest and h[1] and h[1] != digest:
            _desync(p2p, q, int(h[1]), int(h[2]))
        if h[2] != sizes[q] and sizes[q] >= 0:
            ranks = p2p.ranks
            raise DistBackendError(
                f"{op} of group {p2p.group_id}, seq {seq}: rank {ranks[q]} passed {int(h[2])} bytes, "
                f"rank {ranks[me]} expected {sizes[q]} (every rank must pass the same shapes and dtype)"
            )
    return parts(g, s, sizes)


async def exchange(
    p2p: OpLink, g: GroupShm, mine: np.ndarray | Sequence[np.ndarray] | None, sizes: Sequence[int], op: str, sub: int = 0
) -> list[np.ndarray]:
    """One lane op: write ``mine`` (bytes, pieces of bytes written one after the other, or
    nothing), wait for every peer's, check each peer's digest and that it wrote ``sizes[peer]``
    bytes (a negative size: any); every member's bytes (views of the slots, valid until this
    rank's next lane op of the group). ``post``, then ``collect``, then ``settle`` where a peer
    is not there yet or did not agree: the in-call path's steps, in one coroutine. ``sub``: the
    lane op's number within the op (a pair's pieces: ``OpLink.line_seq + sub``)."""
    seq, digest = p2p.line_seq + sub, p2p.digest
    s = post(g, seq, digest, mine)
    if collect(g, s, seq, digest, sizes) is True:
        return parts(g, s, sizes)
    return await settle(p2p, g, s, sizes, op, sub=sub)


#: an all_reduce whose slots hold at least this many bytes in all (its size times the group's)
#: folds by slices: a first lane op posts every rank's input, each rank folds its own slice of
#: every slot (``sliced``: ``chunk_bounds``), a second posts the folded slices and each rank
#: copies the others' (a rank's memory traffic about 2.5 bytes a byte at 2 ranks, 2.75 at 4,
#: against 3 and 5 where every rank folds every slot). Below it one lane op, every rank folding
#: every slot. Measured back to back here, sliced against one lane op: 2 ranks 128 KiB 34 us
#: against 28, 256 KiB 50 against 45, 512 KiB 62 against 80, 1 MiB 90 against 137; 4 ranks on
#: 2 cores 128 KiB 256 against 195, 256 KiB 356 against 506, 1 MiB 1131 against 1397.
SLICED_TOTAL = 1 << 20
#: ... in a pair: from this many bytes in all (a pair folds its own part from its input, not
#: from its slot, so one lane op reads a byte of the peer's slot and one of its own input; measured
#: back to back, one lane op against slices: 1 MiB 61 us against 76, 2 MiB 121 against 136,
#: 3 MiB 203 against 196, 4 MiB 321 against 259)
PAIR_SLICED_TOTAL = 6 << 20


def sliced(n: int, items: int, p: int) -> list[int] | None:
    """The slice bounds (items, ``chunk_bounds``) of an all_reduce of ``n`` bytes (``items``
    elements) in a group of ``p``, where it folds by slices; None where it folds every slot."""
    return None if p < 2 or n * p < (PAIR_SLICED_TOTAL if p == 2 else SLICED_TOTAL) else chunk_bounds(items, p)


def slice_sizes(b: Sequence[int], itemsize: int) -> list[int]:
    """What each rank posts in a sliced all_reduce's second lane op: its slice, in bytes."""
    return [(b[q + 1] - b[q]) * itemsize for q in range(len(b) - 1)]


async def all_reduce(p2p: OpLink, g: GroupShm, flat: np.ndarray, combine: Combine) -> None:
    """``flat`` reduced across the group in place, in rank order (the same bits everywhere);
    by slices (two lane ops, ``sliced``) from ``SLICED_TOTAL`` bytes in all slots
    (``PAIR_SLICED_TOTAL`` in a pair)."""
    n = flat.nbytes
    mine = byte_view(flat)
    p = p2p.size
    parts = await exchange(p2p, g, mine, [n] * p, "all_reduce")
    b = sliced(n, flat.size, p)
    dt = flat.dtype
    if b is None:
        if p == 2 and p2p.rank == 0:  # a pair's rank 0: its own part is ``flat`` itself, first in rank order
            combine(flat, parts[1].view(dt))
            return
        np.copyto(mine, parts[0])
        for part in parts[1:]:
            combine(flat, part.view(dt))
        return
    me, k = p2p.rank, dt.itemsize
    lo, hi = b[me], b[me + 1]
    out = flat[lo:hi]
    np.copyto(out, parts[0][lo * k : hi * k].view(dt))
    for part in parts[1:]:
        combine(out, part[lo * k : hi * k].view(dt))
    await all_reduce_gather(p2p, g, flat, b)


async def all_reduce_gather(p2p: OpLink, g: GroupShm, flat: np.ndarray, b: Sequence[int]) -> None:
    """A sliced all_reduce's second lane op: post this rank's folded slice of ``flat``, copy
    every other rank's into ``flat``."""
    me, k = p2p.rank, flat.itemsize
    parts = await exchange(p2p, g, byte_view(flat[b[me] : b[me + 1]]), slice_sizes(b, k), "all_reduce")
    gather_slices(flat, parts, b, me)


def gather_slices(flat: np.ndarray, parts: Sequence[np.ndarray], b: Sequence[int], me: int) -> None:
    """Every other rank's folded slice (``parts[q]``, bytes) into its place in ``flat``."""
    dt = flat.dtype
    for q, part in enumerate(parts):
        if q != me:
            flat[b[q] : b[q + 1]] = part.view(dt)


async def reduce(p2p: OpLink, g: GroupShm, flat: np.ndarray, root: int, combine: Combine) -> None:
    """Every rank's ``flat`` reduced into the root's, in rank order (the lane all_reduce's
    bits); the other ranks' ``flat`` are only read."""
    parts = await exchange(p2p, g, byte_view(flat), [flat.nbytes] * p2p.size, "reduce")
    if p2p.rank == root:
        np.copyto(byte_view(flat, writable=True), parts[0])
        dt = flat.dtype
        for part in parts[1:]:
            combine(flat, part.view(dt))


async def broadcast(p2p: OpLink, g: GroupShm, flat: np.ndarray, root: int) -> None:
    """``flat`` of ``root`` into ``flat`` of every rank (every rank still waits for every flag:
    the slots' reuse rule needs each lane op to be seen by all)."""
    n = flat.nbytes
    me = p2p.rank
    sizes = [n if q == root else 0 for q in range(p2p.size)]
    parts = await exchange(p2p, g, byte_view(flat) if me == root else None, sizes, "broadcast")
    if me != root:
        np.copyto(byte_view(flat, writable=True), parts[root])


async def all_gather(p2p: OpLink, g: GroupShm, outs: Sequence[np.ndarray], mine: np.ndarray) -> None:
    """Every rank's ``mine`` into every rank's ``outs[that rank]`` (sizes may differ per rank)."""
    me = p2p.rank
    dsts = [byte_view(o, writable=True) for o in outs]
    src = byte_view(mine)
    own = dsts[me]
    in_place = same_bytes(own, src)
    pair = p2p.size == 2
    aside = not pair or (not in_place and any(np.may_share_memory(src, d) for d in dsts))
    parts = await exchange(p2p, g, src, [d.nbytes for d in dsts], "all_gather")
    for q, d in enumerate(dsts):  # a pair: the other's part first, while its slot is fresh (Quick.all_gather)
        if q != me:
            np.copyto(d, parts[q])
    if not in_place:  # from the slot where the input overlaps the output (the copies above may have overwritten it)
        np.copyto(own, parts[me] if aside else src)


async def reduce_scatter(p2p: OpLink, g: GroupShm, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine) -> None:
    """Every rank's ``parts`` (rank q's part of the result at q, all of one size) folded into
    ``out`` part by part: each rank posts its whole input, and reduces its own part of every
    slot in rank order (the same bits wherever that part is computed)."""
    me, n = p2p.rank, p2p.size
    pieces = [byte_view(p) for p in parts]
    total = sum(x.nbytes for x in pieces)
    slots = await exchange(p2p, g, pieces, [total] * n, "reduce_scatter")
    start = sum(x.nbytes for x in pieces[:me])
    stop = start + pieces[me].nbytes
    dt = out.dtype
    np.copyto(byte_view(out, writable=True), slots[0][start:stop])
    for slot in slots[1:]:
        combine(out, slot[start:stop].view(dt))


# -- a pair's ops past its slot: in pieces, each a lane op with a number of its own ----------------


def piece_bounds(n: int, itemsize: int, piece: int, slot: int) -> list[int] | None:
    """Bounds (items) of ``n`` items of ``itemsize`` bytes cut in pieces of ``piece`` bytes, or
    larger ones where that would take more than ``LINE_STEP`` pieces (an op's lane ops each
    have a number of their own: ``OpLink.line_seq`` + the piece's index); None where a piece
    would not fit ``slot`` bytes."""
    per = max(piece // itemsize, -(-n // LINE_STEP), 1)
    if per * itemsize > slot:
        return None
    return [*range(0, n, per), n]


def _items(pieces: Sequence[np.ndarray], piece: int, slot: int) -> tuple[list[int], int] | None:
    """The piece bounds (items) of parts of one size and dtype, with their item size."""
    k = pieces[0].dtype.itemsize
    b = piece_bounds(pieces[0].size, k, piece, slot)
    return None if b is None else (b, k)


async def broadcast_pieces(p2p: OpLink, g: GroupShm, flat: np.ndarray, root: int, piece: int) -> bool:
    """A broadcast in pieces of ``piece`` bytes (``piece_bounds``), one lane op each: the root
    writes piece i + 1 while the other rank copies piece i out (two slots: the lane's reuse rule
    keeps the root at most one piece ahead). False (nothing done) where a piece would not fit."""
    src = byte_view(flat, writable=True)
    b = piece_bounds(src.size, 1, piece, g.bodies[0][0].size)
    if b is None:
        return False
    me, p = p2p.rank, p2p.size
    for i in range(len(b) - 1):
        lo, hi = b[i], b[i + 1]
        sizes = [hi - lo if q == root else 0 for q in range(p)]
        got = await exchange(p2p, g, src[lo:hi] if me == root else None, sizes, "broadcast", i)
        if me != root:
            np.copyto(src[lo:hi], got[root])
    return True


async def reduce_scatter_pieces(
    p2p: OpLink, g: GroupShm, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine, piece: int
) -> bool:
    """A pair's reduce_scatter in pieces of its parts (one lane op each): each rank posts piece
    i of the other rank's part only, and folds its own: the other's piece, then its own, in
    rank order (where ``out`` is its own part, in place, rank 1 adds rank 0's to its own:
    the same bits but for which NaN's payload a sum keeps). An output that overlaps another
    part is written from a copy of the input. False (nothing done) where a piece would not fit."""
    me = p2p.rank
    if p2p.size != 2:
        return False
    got_b = _items(parts, piece, g.bodies[0][0].size)
    if got_b is None:
        return False
    b, k = got_b
    other = 1 - me
    ours = parts[me]
    o = out.reshape(-1)
    in_place = same_bytes(byte_view(ours), byte_view(out))
    if not in_place and any(np.may_share_memory(o, x) for x in parts):
        parts = [x.copy() for x in parts]
        ours = parts[me]
    theirs = byte_view(parts[other])
    dt = out.dtype
    for i in range(len(b) - 1):
        lo, hi = b[i], b[i + 1]
        got = await exchange(p2p, g, theirs[lo * k : hi * k], [(hi - lo) * k] * 2, "reduce_scatter", i)
        peer = got[other].view(dt)
        dst = o[lo:hi]
        if in_place and me == 1:
            combine(dst, peer)
        elif me == 0:
            if not in_place:
                np.copyto(dst, ours[lo:hi])
            combine(dst, peer)
        else:
            np.copyto(dst, peer)
            combine(dst, ours[lo:hi])
    return True


async def all_reduce_pieces(p2p: OpLink, g: GroupShm, flat: np.ndarray, combine: Combine, piece: int) -> bool:
    """A pair's all_reduce in pieces (two lane ops each): each rank posts the other's half of
    piece i (``chunk_bounds``), adds it to its own half (its own first, then the other's: the
    bits of the single-copy all_reduce), posts its reduced half and copies the other's. False
    (nothing done) where a piece would not fit."""
    me = p2p.rank
    if p2p.size != 2:
        return False
    got_b = _items([flat], 2 * piece, g.bodies[0][0].size)
    if got_b is None:
        return False
    b, k = got_b
    f = flat.reshape(-1)
    raw = byte_view(flat, writable=True)
    for i in range(len(b) - 1):
        lo, hi = b[i], b[i + 1]
        h = chunk_bounds(hi - lo, 2)
        cut = [lo + h[0], lo + h[1], lo + h[2]]
        mine_lo, mine_hi = cut[me], cut[me + 1]
        their_lo, their_hi = cut[1 - me], cut[2 - me]
        sizes = [(cut[q + 1] - cut[q]) * k for q in (1, 0)]  # what each rank posts: the other's half
        got = await exchange(p2p, g, raw[their_lo * k : their_hi * k], sizes, "all_reduce", i)
        mine = f[mine_lo:mine_hi]
        combine(mine, got[1 - me].view(flat.dtype))
        sizes = [(cut[q + 1] - cut[q]) * k for q in (0, 1)]  # each rank's reduced half
        got = await exchange(p2p, g, raw[mine_lo * k : mine_hi * k], sizes, "all_reduce", i)
        np.copyto(raw[their_lo * k : their_hi * k], got[1 - me])
    return True


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are the same bytes of memory (1-D byte views)."""
    return a.nbytes == b.nbytes and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


# -- gather and scatter: sizes may differ per rank (the object collectives' payloads); the root's
# -- table of sizes (int64, one per rank) travels with its post, so every rank checks its own

#: what a rank other than the root posts in a scatter: the bytes it expects (one int64)
_EXPECT = 8


def gather_posts(me: int, root: int, outs: Sequence[np.ndarray] | None, mine: np.ndarray) -> np.ndarray | list[np.ndarray]:
    """What a rank posts in a lane gather: the root its table (the bytes it expects of each
    rank, ``outs``' sizes), the others their bytes (``mine``)."""
    if me == root:
        assert outs is not None
        return np.array([o.nbytes for o in outs], np.int64).view(np.uint8)
    return byte_view(mine)


def _gather_odd(
    g: GroupShm, s: int, me: int, root: int, outs: Sequence[np.ndarray] | None, mine: np.ndarray
) -> tuple[int, int, int] | None:
    """(sender, bytes sent, bytes expected) of the first rank whose size is not what the root's
    table says, as this rank sees it; None where all agree."""
    h = g.head[s]
    if me == root:
        assert outs is not None
        for q, o in enumerate(outs):
            if q != me:
                sent = int(g.words[q][h + 2])
                if sent != o.nbytes:
                    return q, sent, o.nbytes
        return None
    want = int(g.bodies[root][s][8 * me : 8 * me + 8].view(np.int64)[0])
    return None if want == mine.nbytes else (me, mine.nbytes, want)


def size_mismatch(p2p: OpLink, op: str, sender: int, n: int, reader: int, want: int) -> DistBackendError:
    """The error of an op whose group rank ``sender`` sends ``n`` bytes to group rank
    ``reader``, which expects ``want``: the op, group, seq and both ranks (global)."""
    ranks = p2p.ranks
    return DistBackendError(
        f"{op} on group {p2p.group_id}, seq {p2p.seq}: rank {ranks[sender]} sends {n} bytes to rank {ranks[reader]}, "
        f"which expects {want} from it (the sizes must match)"
    )


def gather_finish(link: OpLink, g: GroupShm, s: int, root: int, outs: Sequence[np.ndarray] | None, mine: np.ndarray) -> None:
    """A lane gather once every rank posted in slot ``s``: every rank checks the sizes it can
    see (the root each rank's against its list, the others their own against the root's table:
    a mistake fails both sides, naming the ranks and sizes), and the root copies the parts."""
    me = link.rank
    odd = _gather_odd(g, s, me, root, outs, mine)
    if odd is not None:
        q, sent, want = odd
        raise size_mismatch(link, "gather", q, sent, root, want)
    _gather_copy(g, s, me, root, outs, mine)


def _gather_copy(g: GroupShm, s: int, me: int, root: int, outs: Sequence[np.ndarray] | None, mine: np.ndarray) -> None:
    """A lane gather's copies once its sizes agree: the root's, every part into its list."""
    if me == root:
        assert outs is not None
        for q, o in enumerate(outs):
            o.reshape(-1).view(np.uint8)[...] = byte_view(mine) if q == me else g.bodies[q][s][: o.nbytes]


def scatter_posts(me: int, root: int, ins: Sequence[np.ndarray] | None, out: np.ndarray) -> list[np.ndarray]:
    """What a rank posts in a lane scatter: the root its table (each rank's part's bytes) and
    every part after it, in rank order; the others the bytes they expect (one int64)."""
    if me == root:
        assert ins is not None
        return [np.array([x.nbytes for x in ins], np.int64).view(np.uint8), *(byte_view(x) for x in ins)]
    return [np.array([out.nbytes], np.int64).view(np.uint8)]


def _scatter_odd(g: GroupShm, s: int, me: int, root: int, n: int, out: np.ndarray) -> tuple[int, int, int] | None:
    """(receiver, bytes the root sends it, bytes it expects) of the first rank whose size is
    not the root's table's, as this rank sees it; None where all agree."""
    table = g.bodies[root][s][: 8 * n].view(np.int64)
    if me == root:
        for q in range(n):
            if q != me:
                want = int(g.bodies[q][s][:_EXPECT].view(np.int64)[0])
                if want != int(table[q]):
                    return q, int(table[q]), want
        return None
    sent = int(table[me])
    return None if sent == out.nbytes else (me, sent, out.nbytes)


def scatter_finish(link: OpLink, g: GroupShm, s: int, root: int, out: np.ndarray) -> None:
    """A lane scatter once every rank posted in slot ``s``: every rank checks the sizes it can
    see (the root each rank's expectation against its table, the others their own part's
    size: a mistake fails both sides), and each copies its part out of the root's slot."""
    me, n = link.rank, link.size
    odd = _scatter_odd(g, s, me, root, n, out)
    if odd is not None:
        q, sent, want = odd
        raise size_mismatch(link, "scatter", root, sent, q, want)
    _scatter_copy(g, s, me, root, n, out)


def _scatter_copy(g: GroupShm, s: int, me: int, root: int, n: int, out: np.ndarray) -> None:
    """A lane scatter's copy once its sizes agree: this rank's part, out of the root's slot."""
    table = g.bodies[root][s][: 8 * n].view(np.int64)
    start = 8 * n + int(table[:me].sum())
    out.reshape(-1).view(np.uint8)[...] = g.bodies[root][s][start : start + out.nbytes]


def gather_even(g: GroupShm, s: int, me: int, root: int, outs: Sequence[np.ndarray] | None, mine: np.ndarray) -> bool:
    """A gather of one size everywhere (``mine``'s) posted in slot ``s`` in its issuing call:
    where every size is that one, the root's copies, and True; else False, nothing done (the
    op's rest, ``gather_finish``, names what differs)."""
    part = mine.nbytes
    bodies = g.bodies
    if me != root:
        return bool(bodies[root][s][8 * me : 8 * me + 8].view(np.int64)[0] == part)
    assert outs is not None
    h = g.head[s] + 2
    words = g.words
    for q in g.others:
        if words[q][h] != part:
            return False
    _gather_copy(g, s, me, root, outs, mine)
    return True


def scatter_even(g: GroupShm, s: int, me: int, root: int, out: np.ndarray) -> bool:
    """A scatter of one size everywhere (``out``'s) posted in slot ``s`` in its issuing call:
    where every size is that one, this rank's copy out of the root's slot, and True; else
    False, nothing done (the op's rest, ``scatter_finish``, names what differs)."""
    part = out.nbytes
    bodies = g.bodies
    if me == root:
        for q in g.others:
            if bodies[q][s][:_EXPECT].view(np.int64)[0] != part:
                return False
    elif bodies[root][s][8 * me : 8 * me + 8].view(np.int64)[0] != part:
        return False
    at = 8 * len(bodies) + me * part
    out.reshape(-1).view(np.uint8)[...] = bodies[root][s][at : at + part]
    return True


async def gather(p2p: OpLink, g: GroupShm, outs: Sequence[np.ndarray] | None, mine: np.ndarray, root: int) -> None:
    """Every rank's ``mine`` into ``outs[that rank]`` of the root (sizes may differ per rank,
    as the root's list says)."""
    me = p2p.rank
    seq, digest = p2p.line_seq, p2p.digest
    sizes = [-1] * p2p.size
    s = post(g, seq, digest, gather_posts(me, root, outs, mine))
    if collect(g, s, seq, digest, sizes) is not True:
        await settle(p2p, g, s, sizes, "gather")
    gather_finish(p2p, g, s, root, outs, mine)


async def scatter(p2p: OpLink, g: GroupShm, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int) -> None:
    """``ins[q]`` of the root into ``out`` of rank q (sizes may differ per rank, as the root's
    list says); the root's table and parts must fit its slot."""
    me, n = p2p.rank, p2p.size
    seq, digest = p2p.line_seq, p2p.digest
    pieces = scatter_posts(me, root, ins, out)
    total = sum(x.nbytes for x in pieces)
    if not g.fits_lane(total):  # (only where sizes differ per rank: a rank judges by its own part)
        ranks = p2p.ranks
        raise DistBackendError(
            f"scatter of group {p2p.group_id}, seq {p2p.seq}: rank {ranks[me]}'s parts take {total} bytes in all, more than the "
            f"lane holds; the other ranks judged by their own parts and take the lane (pass parts of one size, as torch requires)"
        )
    sizes = [-1] * n
    s = post(g, seq, digest, pieces)
    if collect(g, s, seq, digest, sizes) is not True:
        await settle(p2p, g, s, sizes, "scatter")
    scatter_finish(p2p, g, s, root, out)


async def _wait(p2p: OpLink, g: GroupShm, words: list[np.ndarray], missing: list[int], target: int, spin: bool = True) -> None:
    """Until ``words[q][0] >= target`` for every peer q in ``missing`` (a lane slot's flag, a
    phase word: both only grow): spin (unless ``spin`` is false: the caller spun already),
    then sleep on the doorbell."""
    end = time.perf_counter() + (g.spin_s if spin else 0.0)
    while True:
        missing = [q for q in missing if words[q][0] < target]
        if not missing or time.perf_counter() >= end:
            break
        os.sched_yield()  # a peer that shares this core runs now, not at the end of a time slice
    if not missing:
        return
    counted = list(missing)
    p2p.wait_on(counted)  # the op's tracker: a timeout names whom it waited on
    own = g.sleeping[p2p.rank]
    g.lane_sleeps += 1
    rung = True
    while True:
        own[0] = target
        _fence()
        missing = [q for q in missing if words[q][0] < target]
        if not missing:
            if not rung:  # every flag was there, and no ring came for the last of them
                g.lane_lost += 1
            break
        for q in missing:
            p2p.check_peer(q)  # a dead or departed peer, an aborted group: its error
            _check_current(p2p, g, q)  # a peer in another shared-memory op at this seq
        rung = await g.owner.doorbell(_RECHECK_S)
    p2p.waited_on(counted, heard=True)


#: marks the digest that a rank announces when it takes the socket for an op (``announce``'s
#: ``socket``): a peer waiting in the lane or a phase at that seq is on the other path (sizes
#: that differ across a threshold), a desync even where the digests agree (gather's and
#: scatter's leave sizes out, as torch's take one size everywhere)
SOCKET_MARK = 0x5A17_0000_0000_0001


def announce(link: OpLink, g: GroupShm, me: int, socket: bool = False) -> None:
    """Say which op this rank is in, for a peer that waits on it: a seqlock (seq 0, the digest,
    then the op's number in the line + 1), so a reader never takes one op's digest for another's. ``socket``: this
    rank takes the socket for it (the digest is marked: see ``SOCKET_MARK``)."""
    digest = link.digest
    cur = g.current[me]
    cur[1] = 0
    cur[0] = digest ^ SOCKET_MARK if socket and digest else digest
    cur[1] = link.line_seq + 1


def _check_current(link: OpLink, g: GroupShm, q: int) -> None:
    """A sleeping wait's look at peer ``q``'s current op: at this seq with another digest (say
    a big all_reduce against a lane op, which write different words), a desync."""
    cur = g.current[q]
    seq, digest, again = int(cur[1]), int(cur[0]), int(cur[1])  # x86-TSO: loads in this order
    mine = link.digest
    if seq == again == link.line_seq + 1 and mine and digest and digest != mine:
        if digest == mine ^ SOCKET_MARK:  # the same call, on the other path: sizes across a threshold
            name = link.op_name
            what = "this op" if name is None else name
            ranks = link.ranks
            reason = (
                f"desync detected: seq {link.seq} on group {link.group_id}: rank {ranks[q]} took the socket for {what} "
                f"while rank {ranks[link.rank]} is in shared memory, which the op's size decides: the ranks passed sizes "
                f"that differ across a threshold (every rank must pass the same sizes)"
            )
            log.debug("rank %d: %s", ranks[link.rank], reason)  # the ops' errors carry it
            raise link.abort_group(reason)
        _desync(link, q, digest)


async def phase(p2p: OpLink, g: GroupShm, step: int, nbytes: int = -1) -> None:
    """A big op's step ``step`` (0, 1, ... within the op): write this rank's phase word and wait
    until every peer's has reached it (the halves' doorbell, without a socket message). At step
    0 each peer's digest and size (``nbytes``) are checked against this rank's."""
    me, p = p2p.rank, p2p.size
    seq, digest = p2p.seq, p2p.digest
    if step == 0:
        announce(p2p, g, me)
        # digest and size of the group's k-th big op go in set k % 2: a peer writes that set
        # again only after this rank's step 0 of the next big op (as the lane's slots)
        k = g.big_ops & 1
        g.big_ops += 1
        mine = g.checks[me][k]
        mine[0] = digest
        mine[1] = nbytes
    # the group's count of big ops, not the seq: a hierarchical op runs two big ops of one seq
    # in its host's line (aiodist.algorithms.hier), whose step 0 must not find the first's words
    target = (g.big_ops << 26) + 1 + step
    g.phases[me][0] = target
    _fence()
    sleeping = g.sleeping
    for q in range(p):
        if q != me and sleeping[q][0] == target:
            os.eventfd_write(g.bells[q], 1)
    words = g.phases
    missing = [q for q in range(p) if q != me and words[q][0] < target]
    if missing:
        await _wait(p2p, g, words, missing, target)
    if step == 0:
        for q in range(p):
            if q != me:
                theirs = g.checks[q][k]
                if digest and theirs[0] and theirs[0] != digest:
                    _desync(p2p, q, int(theirs[0]), int(theirs[1]))
                if theirs[1] != nbytes:
                    ranks = p2p.ranks
                    raise DistBackendError(
                        f"shared-memory op of group {p2p.group_id}, seq {seq}: rank {ranks[q]} passed {int(theirs[1])} bytes, "
                        f"rank {ranks[me]} {nbytes} (every rank must pass the same shapes and dtype)"
                    )


def _desync(link: OpLink, q: int, theirs: int, nbytes: int = -1) -> None:
    """A peer's digest differs: the transport's desync (``OpLink.desync``: it aborts the group on
    every rank, with aiodist._digest's sentence, which reads the peer's arguments from
    ``nbytes``, the size it wrote, where it can), then that abort's error here."""
    err = link.desync(q, theirs, nbytes)
    if err is not None:
        raise err
    ranks = link.ranks
    raise DistBackendError(
        f"shared-memory op of group {link.group_id}, seq {link.seq}: rank {ranks[q]} called another op or other arguments "
        f"(digest {theirs:#x}, rank {ranks[link.rank]}'s {link.digest:#x})"
    )


def now(g: GroupShm, seq: int, digest: int, mine: np.ndarray | Sequence[np.ndarray] | None, sizes: Sequence[int], written: int = 0) -> int:
    """A lane op in the issuing call: ``post`` (``mine``, or ``written``), then ``collect``, spinning at most ``g.spin_s``
    (yielding the core at every turn, never the loop). The slot (0 or 1) where every peer is
    there and agrees (its bytes: ``parts``); the slot - 2 (-2 or -1) where the op is posted and
    waits, for ``settle`` in a task. ``seq`` is the op's seq (its number in the line:
    times ``LINE_STEP``, as ``OpLink.line_seq``)."""
    seq *= LINE_STEP
    s = post(g, seq, digest, mine, written)
    got = collect(g, s, seq, digest, sizes)
    if got is False and g.spin_s:
        # wait on one missing flag at a time (a word's read and the yield per turn), then
        # collect once more
        end = time.perf_counter() + g.spin_s
        h = g.head[s]
        target = seq + 1
        words = g.words
        for q in g.others:
            w = words[q]
            while w[h] < target:
                os.sched_yield()  # a peer that shares this core runs now
                if time.perf_counter() >= end:
                    return s - 2
        got = collect(g, s, seq, digest, sizes)
    return s if got is True else s - 2
