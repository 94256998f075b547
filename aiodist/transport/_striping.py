"""Striping's arithmetic, shared by the send lines and the inbox (a leaf: both import it, it
imports neither): a striped message's parts and their tags, running the parts at once, and the
check that a peer is a rank of the world."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiodist.transport._mailbox import _PART_SHIFT

__all__ = ["STRIPE_TAG", "stripe_parts", "run_parts", "check_rank", "retrieve"]

STRIPE_TAG = 1 << _PART_SHIFT  # part j of a striped message travels under tag + (j + 1) * STRIPE_TAG (tags stay below 2**31)
_STRIPE_ALIGN = 64


def stripe_parts(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """The byte ranges of a striped message's parts, one per lane: equal, 64-byte aligned, the
    last one taking the rest. Sender and receiver compute the same parts from the size."""
    step = (nbytes // lanes) // _STRIPE_ALIGN * _STRIPE_ALIGN
    cuts = [j * step for j in range(lanes)] + [nbytes]
    return [(cuts[j], cuts[j + 1]) for j in range(lanes)]


def retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a send_nowait write whose caller's receive failed first: seen, not logged


async def run_parts(coros: list[Coroutine[Any, Any, Any]]) -> None:
    """Run a striped message's parts at once. Part 0 runs in the caller's task, so its first
    step (where a send is written, or a receive posted) happens in the caller's step: sends to
    one peer still start in call order. The first failure cancels the other parts."""
    rest = [asyncio.ensure_future(c) for c in coros[1:]]
    for t in rest:
        t.add_done_callback(retrieve)
    try:
        await coros[0]
        await asyncio.gather(*rest)
    except BaseException:
        for t in rest:
            t.cancel()
        raise


def check_rank(rank: int, peer: int, world_size: int) -> None:
    """``peer`` must be a rank of the world (``rank``'s, for the message)."""
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world_size:
        raise ValueError(f"rank {rank}: peer {peer!r} is not a rank of a world of {world_size}")
