"""The layouts of the ops NCCL has no single call for, as plain data: which byte ranges go to
and come from which peer in one grouped send/recv. Pure: no CuPy (tested on the CPU).

All offsets and counts are in *elements of the array* (the caller scales to NCCL elements and bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiodist.c10d._args import split_sizes

__all__ = ["Part", "split_bounds", "exchange_plan"]


@dataclass(frozen=True, slots=True)
class Part:
    """``count`` elements at ``offset`` of a buffer, to or from ``peer`` (a group rank)."""

    peer: int
    offset: int
    count: int


def split_bounds(rows: int, row_elems: int, sizes: Sequence[int] | None, n: int, what: str) -> list[tuple[int, int]]:
    """``(offset, count)`` in elements of each of ``n`` consecutive row blocks of an array of
    ``rows`` rows of ``row_elems`` elements: ``sizes`` rows each, or equal blocks (None or empty);
    checked by the CPU backend's own rule (``aiodist.c10d._args.split_sizes``)."""
    sizes = split_sizes(rows, sizes, n, what)
    out, at = [], 0
    for s in sizes:
        out.append((at * row_elems, s * row_elems))
        at += s
    return out


def exchange_plan(
    me: int, sends: Sequence[tuple[int, int]], recvs: Sequence[tuple[int, int]]
) -> tuple[list[Part], list[Part], tuple[int, int, int] | None]:
    """An all-to-all as one grouped call: ``sends[j]`` / ``recvs[j]`` are ``(offset, count)`` for
    peer j. Returns the sends and receives to other ranks (empty ones skipped: NCCL needs no call
    for them, and both sides skip alike because the counts agree) and this rank's own part as a
    local copy ``(src_offset, dst_offset, count)``, or None when it is empty."""
    if len(sends) != len(recvs):
        raise ValueError(f"exchange_plan: {len(sends)} send blocks but {len(recvs)} receive blocks")
    out = [Part(j, off, cnt) for j, (off, cnt) in enumerate(sends) if j != me and cnt]
    inc = [Part(j, off, cnt) for j, (off, cnt) in enumerate(recvs) if j != me and cnt]
    own = None
    if sends[me][1] != recvs[me][1]:
        raise ValueError(f"rank {me} sends itself {sends[me][1]} elements but expects {recvs[me][1]}")
    if sends[me][1]:
        own = (sends[me][0], recvs[me][0], sends[me][1])
    return out, inc, own
