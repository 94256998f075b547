"""Shared memory between the ranks of a group on one host (docs/transport.md, "Shared memory").

The CPU socket backend owns a ``SharedMemory``; the collectives take a ``Ticket`` in their
issuing step (``SharedMemory.ticket``) and, in their body, ``run_all_reduce`` /
``run_all_gather``, which return False where the group uses the socket path instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aiodist.algorithms.p2p import P2P
from aiodist.shm import _algorithms, _lane
from aiodist.shm._manager import DEFAULT_BYTES, ENV_BYTES, GroupShm, SharedMemory, Ticket, segment_bytes

__all__ = [
    "SharedMemory",
    "Ticket",
    "GroupShm",
    "ENV_BYTES",
    "DEFAULT_BYTES",
    "segment_bytes",
    "run_all_reduce",
    "run_all_gather",
    "run_barrier",
]


async def run_all_reduce(ticket: Ticket, p2p: P2P, flat: np.ndarray, combine: _algorithms.Combine, lane: bool = False) -> bool:
    """all_reduce ``flat`` through shared memory in this op's turn; False (nothing done) where
    the group uses the socket path. ``lane``: a small op, for the latency lane (aiodist.shm._lane),
    or the socket path where the group has no lane."""
    try:
        g = await ticket.acquire(p2p)
        if g is None:
            return False
        if lane:
            if not _lane.fits(g, flat.nbytes):
                return False
            await _lane.all_reduce(ticket.shm, p2p, g, flat, combine)
        elif flat.size:
            await _algorithms.all_reduce(p2p, g, flat, combine)
        return True
    finally:
        ticket.release()


def _arrive(dst: np.ndarray, src: np.ndarray) -> None:
    """A barrier's "reduction": arriving is all it needs."""


async def run_barrier(ticket: Ticket, p2p: P2P) -> bool:
    """A barrier through the latency lane in this op's turn (a one-byte lane op whose result
    nobody reads); False (nothing done) where the group has no lane."""
    try:
        g = await ticket.acquire(p2p)
        if g is None or not _lane.fits(g, 1):
            return False
        await _lane.all_reduce(ticket.shm, p2p, g, np.zeros(1, np.uint8), _arrive)
        return True
    finally:
        ticket.release()


async def run_all_gather(ticket: Ticket, p2p: P2P, outs: Sequence[np.ndarray], mine: np.ndarray) -> bool:
    """all_gather through shared memory in this op's turn; False (nothing done) where the group
    uses the socket path."""
    try:
        g = await ticket.acquire(p2p)
        if g is None:
            return False
        await _algorithms.all_gather(p2p, g, outs, mine)
        return True
    finally:
        ticket.release()
