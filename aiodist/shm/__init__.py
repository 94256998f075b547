"""Shared memory between the ranks of a group on one host (docs/transport.md, "Shared memory").

The CPU socket backend owns a ``SharedMemory``; the collectives take a ``Ticket`` in their
issuing step (``SharedMemory.ticket``) and, in their body, one of the ``run_*`` functions
below (one per collective, and ``run_barrier``), which return False where the group uses the
socket path instead. Each takes the op's ``P2P`` and runs over its ``OpLink``
(aiodist.shm._link: ``op_link``), the only way these modules reach the transport and the op's
tracker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from aiodist.algorithms.p2p import P2P
from aiodist.shm import _algorithms, _lane
from aiodist.shm._algorithms import Into, all_to_all_copy, all_to_all_inline_agree, all_to_all_rest, all_to_all_table
from aiodist.shm._algorithms import table_bytes as all_to_all_table_bytes
from aiodist.shm._lane import all_reduce_gather as lane_all_reduce_gather
from aiodist.shm._lane import (
    gather_even,
    gather_finish,
    gather_posts,
    same_bytes,
    scatter_even,
    scatter_finish,
    scatter_posts,
    settle,
)
from aiodist.shm._lane import gather_slices as lane_gather_slices
from aiodist.shm._lane import now as lane_now
from aiodist.shm._lane import parts as lane_parts
from aiodist.shm._lane import slice_sizes as lane_slice_sizes
from aiodist.shm._lane import sliced as lane_sliced
from aiodist.shm._link import HostLink, OpLink, op_link
from aiodist.shm._manager import DEFAULT_BYTES, ENV_BYTES, HOST_PART, GroupShm, SharedMemory, Ticket, segment_bytes

__all__ = [
    "Into",
    "SharedMemory",
    "OpLink",
    "HostLink",
    "HOST_PART",
    "Ticket",
    "GroupShm",
    "ENV_BYTES",
    "DEFAULT_BYTES",
    "segment_bytes",
    "run_all_reduce",
    "run_all_gather",
    "run_barrier",
    "run_broadcast",
    "run_reduce",
    "run_reduce_scatter",
    "run_all_to_all",
    "run_gather",
    "run_scatter",
    "lane_now",
    "lane_parts",
    "lane_sliced",
    "same_bytes",
    "lane_slice_sizes",
    "lane_all_reduce_gather",
    "lane_gather_slices",
    "all_to_all_copy",
    "all_to_all_inline_agree",
    "all_to_all_rest",
    "all_to_all_table",
    "all_to_all_table_bytes",
    "gather_even",
    "gather_finish",
    "gather_posts",
    "scatter_even",
    "scatter_finish",
    "scatter_posts",
    "settle",
    "op_link",
]


async def run_all_reduce(
    ticket: Ticket,
    p2p: P2P,
    flat: np.ndarray,
    combine: _algorithms.Combine,
    lane: bool = False,
    single_copy: bool = False,
    into: _algorithms.Into | None = None,
    piece: int = 0,
) -> bool:
    """all_reduce ``flat`` through shared memory in this op's turn; False (nothing done) where
    the group uses the socket path. ``lane``: a small op, for the latency lane (aiodist.shm._lane),
    or the socket path where the group has no lane. ``single_copy``: a big one, by single-copy
    reads where the group can; ``into``: the result's arrays, written by that path
    (``into.written``). ``piece``: a pair's, through its lane in pieces of that many bytes
    (``_lane.all_reduce_pieces``), else as a big one."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if piece and g.lane and flat.size and await _lane.all_reduce_pieces(link, g, flat, combine, piece):
            return True
        if lane:
            if not _lane.fits(g, flat.nbytes):
                return False
            await _lane.all_reduce(link, g, flat, combine)
        elif flat.size:
            await _algorithms.all_reduce(link, g, flat, combine, single_copy or piece > 0, into)
        return True
    finally:
        ticket.release()


async def run_barrier(ticket: Ticket, p2p: P2P) -> bool:
    """A barrier through the latency lane in this op's turn (a lane op that writes nothing);
    False (nothing done) where the group has no lane."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None or not g.lane:
            return False
        await _lane.exchange(link, g, None, [0] * p2p.size, "barrier")
        return True
    finally:
        ticket.release()


async def run_broadcast(
    ticket: Ticket, p2p: P2P, flat: np.ndarray, root: int, big: bool = False, lane: bool = True, piece: int = 0
) -> bool:
    """A small broadcast (``lane``) through the latency lane in this op's turn, or a ``big`` one
    by single-copy reads of the root's tensor; False (nothing done) where the group has no lane
    (or the payload does not fit it), for a big one no single copy, and for one that is neither:
    then, where the group has a lane, this rank says which op it is in (``_lane.announce``), so a
    peer waiting in the lane for another op at this seq (a size that differs) sees the desync.
    ``piece``: a pair's, through its lane in pieces of that many bytes
    (``_lane.broadcast_pieces``), else as a big one."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if piece and g.lane and await _lane.broadcast_pieces(link, g, flat, root, piece):
            return True
        if (big or piece) and g.cma:
            await _algorithms.broadcast_single_copy(link, g, flat, root)
            return True
        if not lane or not _lane.fits(g, flat.nbytes):
            return _to_socket(link, g)
        await _lane.broadcast(link, g, flat, root)
        return True
    finally:
        ticket.release()


def _to_socket(link: OpLink, g: GroupShm) -> bool:
    """False (the op takes the socket), after saying which op this rank is in where the group
    has a lane: a peer waiting in the lane for another op at this seq sees the desync."""
    if g.lane:
        _lane.announce(link, g, link.rank, socket=True)
    return False


async def run_reduce(
    ticket: Ticket, p2p: P2P, flat: np.ndarray, root: int, combine: _algorithms.Combine, big: bool, lane: bool = False
) -> bool:
    """A small reduce (``lane``) through the latency lane, or a ``big`` one by single-copy
    reads, in this op's turn; False (nothing done) where the group can do neither for it: then,
    where the group has a lane, this rank says which op it is in (``_lane.announce``), so a
    peer waiting in the lane for another op at this seq (a size that differs) sees the desync."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if big and g.cma:
            await _algorithms.reduce_single_copy(link, g, flat, root, combine)
            return True
        if lane and _lane.fits(g, flat.nbytes):
            await _lane.reduce(link, g, flat, root, combine)
            return True
        return _to_socket(link, g)
    finally:
        ticket.release()


async def _single_copy(
    ticket: Ticket,
    p2p: P2P,
    big: bool,
    run: Callable[[OpLink, GroupShm], Awaitable[None]],
    table: int = 0,
    first: Callable[[OpLink, GroupShm], Awaitable[bool]] | None = None,
) -> bool:
    """A ``big`` op by single-copy reads (``run``) in this op's turn, where the group can read
    its peers (and, for an op that sends a table of ``table`` bytes through the lane, that
    fits it); False (nothing done) otherwise, after ``_to_socket``. ``first``: a way tried
    before (a pair's pieces), done where it answers True."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if first is not None and await first(link, g):
            return True
        if big and g.cma and (not table or _lane.fits(g, table)):
            await run(link, g)
            return True
        return _to_socket(link, g)
    finally:
        ticket.release()


async def run_reduce_scatter(
    ticket: Ticket,
    p2p: P2P,
    out: np.ndarray,
    parts: Sequence[np.ndarray],
    combine: _algorithms.Combine,
    big: bool,
    lane: bool = False,
    piece: int = 0,
) -> bool:
    """A small reduce_scatter (``lane``) through the latency lane, or a ``big`` one by single-copy
    reads, in this op's turn; False (nothing done) where the group can do neither for it (then
    ``_to_socket``). ``piece``: a pair's, through its lane in pieces of that many bytes
    (``_lane.reduce_scatter_pieces``), else as a big one."""
    if piece:

        async def pieces(link: OpLink, g: GroupShm) -> bool:
            return g.lane and await _lane.reduce_scatter_pieces(link, g, out, parts, combine, piece)

        return await _single_copy(
            ticket, p2p, True, lambda link, g: _algorithms.reduce_scatter_single_copy(link, g, out, parts, combine), first=pieces
        )
    if not lane:
        return await _single_copy(ticket, p2p, big, lambda link, g: _algorithms.reduce_scatter_single_copy(link, g, out, parts, combine))
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if not _lane.fits(g, sum(p.nbytes for p in parts)):
            return _to_socket(link, g)
        await _lane.reduce_scatter(link, g, out, parts, combine)
        return True
    finally:
        ticket.release()


async def run_all_to_all(ticket: Ticket, p2p: P2P, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> bool:
    """An all_to_all by single-copy reads in this op's turn (every one: the group agreed on
    whether it can); its split tables go through the lane."""
    return await _single_copy(
        ticket, p2p, True, lambda link, g: _algorithms.all_to_all_single_copy(link, g, outs, ins), _algorithms.table_bytes(p2p.size)
    )


async def run_gather(
    ticket: Ticket, p2p: P2P, outs: Sequence[np.ndarray] | None, mine: np.ndarray, root: int, big: bool = True, lane: bool = False
) -> bool:
    """A small gather (``lane``) through the latency lane, or a ``big`` one by single-copy
    reads, in this op's turn (``_single_copy``); False (nothing done) where the group can do
    neither (every rank alike: the group agreed on its lane)."""
    if lane:
        return await _in_lane(ticket, p2p, lambda link, g: _lane.gather(link, g, outs, mine, root))
    return await _single_copy(ticket, p2p, big, lambda link, g: _algorithms.gather_single_copy(link, g, outs, mine, root))


async def run_scatter(
    ticket: Ticket, p2p: P2P, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int, big: bool = True, lane: bool = False
) -> bool:
    """A small scatter (``lane``) through the latency lane, or a ``big`` one by single-copy
    reads (its table of parts through the lane), in this op's turn (``_single_copy``)."""
    if lane:
        return await _in_lane(ticket, p2p, lambda link, g: _lane.scatter(link, g, out, ins, root))
    return await _single_copy(ticket, p2p, big, lambda link, g: _algorithms.scatter_single_copy(link, g, out, ins, root), 16 * p2p.size)


async def _in_lane(ticket: Ticket, p2p: P2P, run: Callable[[OpLink, GroupShm], Awaitable[None]]) -> bool:
    """A lane op (``run``) in this op's turn; False (nothing done) where the group has no lane."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None or not g.lane:
            return False
        await run(link, g)
        return True
    finally:
        ticket.release()


async def run_all_gather(
    ticket: Ticket, p2p: P2P, outs: Sequence[np.ndarray], mine: np.ndarray, lane: bool = False, single_copy: bool = False
) -> bool:
    """all_gather through shared memory in this op's turn; False (nothing done) where the group
    uses the socket path. ``lane``: small parts, for the latency lane, or the socket path where
    the group has no lane (or the largest part does not fit it). ``single_copy``: by single-copy
    reads where the group can, else the segment halves."""
    try:
        link = op_link(p2p)
        g = await ticket.acquire(link)
        if g is None:
            return False
        if lane:
            if not _lane.fits(g, max(o.nbytes for o in outs)):
                return False
            await _lane.all_gather(link, g, outs, mine)
        else:
            await _algorithms.all_gather(link, g, outs, mine, single_copy)
        return True
    finally:
        ticket.release()
