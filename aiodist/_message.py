"""What a point-to-point message is, below both the transport and the collective algorithms:
the channel an op's messages go through (``P2P``), its bytes (``byte_view``), its tag range
(``TAG_LIMIT``, ``CHANNEL_TAG_LIMIT``) and the channel seq of user p2p (``P2P_SEQ``). Imports
nothing from aiodist, so every layer may import it."""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["P2P", "byte_view", "TAG_LIMIT", "CHANNEL_TAG_LIMIT", "GO_TAG", "P2P_SEQ", "LINE_STEP"]

#: An algorithm's tags are below this (and a user's p2p tags: torch's int).
TAG_LIMIT = 1 << 31
#: What a P2P takes: the bits from 31 up number the sub-ops of one op (``SubP2P``); the
#: transport's striping keeps the bits from 40 up for itself.
CHANNEL_TAG_LIMIT = 1 << 36
#: the last block of sub-op tags is kept for one message: a group's leader's "go" to the ranks
#: that idle until it issues the op (``aiodist.c10d.idle_until_leader``)
GO_TAG = CHANNEL_TAG_LIMIT - TAG_LIMIT
#: the channel seq of every point-to-point message (collective seqs stay below 2**63)
P2P_SEQ = 1 << 63
#: an op's number in its group's shared-memory line (``line_seq``: the latency lane's flags) is
#: its seq times this: room for the lane ops of one op (a pair's pieces, aiodist.shm._lane),
#: each with a number of its own, below the next op's
LINE_STEP = 32


@runtime_checkable
class P2P(Protocol):
    """Send and receive raw bytes between the ranks of one op (aiodist.algorithms.p2p's module
    docstring: peers are the op's ranks 0..size-1, tags below ``CHANNEL_TAG_LIMIT``)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None: ...

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None: ...

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        """Send without waiting where possible: True, or a future to await before changing
        ``buf``; False where this P2P cannot (nothing was sent: use ``send``)."""
        ...


def byte_view(buf: np.ndarray, *, writable: bool = False) -> np.ndarray:
    """``buf``'s memory as a flat uint8 array (no copy); ValueError/TypeError for anything that
    is not a C-contiguous numpy array (or not writeable, when ``writable``)."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError("message buffers must be C-contiguous")
    if writable and not buf.flags.writeable:
        raise ValueError("the receive buffer is read-only")
    if buf.dtype.hasobject:
        raise TypeError("object arrays cannot be sent")
    return buf.reshape(-1).view(np.uint8)
