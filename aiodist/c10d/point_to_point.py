"""send, recv, isend, irecv.

Matching, as torch's: the n-th send from rank a to rank b with tag t meets the n-th receive on b
from a with tag t. Each such message is its own one-message channel:
``channel(group_id, p2p_seq(a, b, t, n), [global a, global b])``, sent from index 0 to index 1
with P2P tag 0, where ``p2p_seq`` packs bit 63 (p2p, never a collective's seq), bit 62 (the
direction: a < b), the tag (31 bits) and n mod 2**31. Both ends count the stream (a, b, t) in
their issue order, in the call's first step, so "issued in the same order on both ends" is all
a user keeps. Tags are ints in [0, 2**31).

Not done: receiving from any source (``src=None``) and sending to oneself; both are refused
with a ValueError that says so.
"""

from __future__ import annotations

from typing import Any

from aiodist.algorithms.p2p import P2P
from aiodist.c10d._args import buf, group_root
from aiodist.c10d.init import GroupArg, resolve_group
from aiodist.c10d.work import Work

__all__ = ["send", "recv", "isend", "irecv", "p2p_seq", "P2P_TAG_LIMIT"]

P2P_TAG_LIMIT = 1 << 31
_P2P_BIT = 1 << 63
_DIR_BIT = 1 << 62
_COUNT_MASK = (1 << 31) - 1


def p2p_seq(src: int, dst: int, tag: int, count: int) -> int:
    """The channel seq of the ``count``-th message from group rank ``src`` to ``dst`` with ``tag``."""
    return _P2P_BIT | (_DIR_BIT if src < dst else 0) | (tag << 31) | (count & _COUNT_MASK)


def _tag(tag: object, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{op}: tag must be an int, not {type(tag).__name__}")
    if not 0 <= tag < P2P_TAG_LIMIT:
        raise ValueError(f"{op}: tag {tag} is outside [0, 2**31)")
    return tag


def _issue(op: str, tensor: Any, peer_global: int | None, group: GroupArg, tag: int, peer_group: int | None, sending: bool) -> Work:
    pg = resolve_group(group, what=op)
    name = "dst" if sending else "src"
    if not sending and peer_global is None and peer_group is None:
        raise ValueError(f"{op}: receiving from any source (src=None) is not supported by aiodist yet; pass src or group_src")
    peer = group_root(pg, op, name, peer_global, peer_group)
    t = _tag(tag, op)
    me = pg.rank()
    if peer == me:
        raise ValueError(f"{op}: {name} is this rank ({pg.ranks[me]}); sending to oneself is not supported by aiodist yet")
    b = buf(tensor, f"{op} tensor", writable=not sending)
    pg.check_usable()
    a, z = (me, peer) if sending else (peer, me)
    stream = (a, z, t)
    count = pg.p2p_counts[stream]
    pg.p2p_counts[stream] = count + 1
    flat = b.flat

    if sending:

        async def body(p2p: P2P) -> None:
            await p2p.send(1, flat, 0)

    else:

        async def body(p2p: P2P) -> None:
            await p2p.recv(0, flat, 0)

    pair = [pg.ranks[a], pg.ranks[z]]
    return pg.issue_p2p(op, p2p_seq(a, z, t, count), pair, body, [tensor], None if sending else pg.ranks[peer])


async def send(tensor: Any, dst: int | None = None, group: GroupArg = None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst`` (global rank) or ``group_dst``; returns once it is delivered to the transport's peer."""
    await _issue("send", tensor, dst, group, tag, group_dst, True)


async def recv(tensor: Any, src: int | None = None, group: GroupArg = None, tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (global rank) or ``group_src``; returns the sender's global rank."""
    work = _issue("recv", tensor, src, group, tag, group_src, False)
    await work
    return work.source_rank()


async def isend(tensor: Any, dst: int | None = None, group: GroupArg = None, tag: int = 0, group_dst: int | None = None) -> Work:
    """Issue a send and return its Work (``tensor`` must not change until it completes)."""
    return _issue("isend", tensor, dst, group, tag, group_dst, True)


async def irecv(tensor: Any, src: int | None = None, group: GroupArg = None, tag: int = 0, group_src: int | None = None) -> Work:
    """Issue a receive and return its Work; ``work.source_rank()`` is the sender."""
    return _issue("irecv", tensor, src, group, tag, group_src, False)
