"""Hierarchical collectives: a group whose ranks sit on several hosts, some with more than one.

A flat ring in rank order crosses every host link twice per lap, each crossing carrying
``2(n-1)/n`` of the bytes, so a host sends more the more ranks it has (1.5 S at 2 ranks per host
of 2 hosts, 1.75 S at 4). The schedules here cross each link with each byte once, as the
minimum for 2 hosts is: ``S``. Pure functions of a ``P2P`` and a ``Layout``, as every schedule in
``aiodist.algorithms`` is; ``aiodist.algorithms.plan`` says when (``hier``).

``Layout``: the group's ranks by host, each host's ranks in group-rank order, hosts in the order
of their lowest rank: the same on every rank (it is derived from what every rank published, its
host identity). ``layout_of(host_ids)`` makes it.

all_reduce, by rules in order:

1. every host has the same number ``k > 1`` of ranks and the buffer has at least ``k`` elements:
   **reduce-scatter within each host** (local rank ``i`` gets the host's sum of slice ``i``),
   **all_reduce of slice i among the hosts' local ranks i** (``k`` exchanges across in parallel,
   each of ``S/k``), **all-gather within each host**. Each host sends ``2(h-1)/h * S`` across.
   In ``pieces`` (``th.hier_piece`` each, at most ``MAX_PIECES``), pipelined: a piece's exchange
   across runs while the next piece's reduce-scatter and the earlier pieces' all-gathers run
   within the host (``_all_reduce_pieces``).
2. otherwise (uneven hosts: 3 + 1; or a buffer smaller than ``k``): **reduce to each host's first
   rank, all_reduce among those leaders, broadcast within each host**. The same bytes across
   (the leaders' ring), one rank per host doing it.

Every rank ends with the same bits: each slice is reduced once (within the host, in local rank
order, then across by the leaders' or the slice's ring) and copied everywhere after.

barrier: within each host, among the hosts' first ranks, within each host again.

broadcast and reduce: each host has a leader (the root on its host, its first rank elsewhere);
broadcast goes from the root to the leaders (each remote host's link crossed once), then within
each host from its leader; reduce is its mirror (within each host to its leader, then among the
leaders to the root).

The in-host phases go through a ``Within`` where the backend gives one (its shared memory for
the group's ranks on this host), else by messages on the host's ranks.

all_gather and reduce_scatter, where every host has the same ``k > 1`` ranks (otherwise the flat
schedules): all_gather exchanges each local rank's part among its counterparts on the other hosts
first (each part crosses to each other host once: ``(h-1)/h`` of the output per host, the
minimum), then gathers within the host, each local rank's ``h`` parts packed into one message;
reduce_scatter is its mirror: within the host first (local rank ``i`` gets the host's sums of the
parts of every host's local rank ``i``, packed), then across among counterparts.

Each phase runs on its own tag block (``SubP2P``) over ``Subset``, a view of the op's P2P on some
of its ranks, so the phases' messages never meet, and the transport still matches them by op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from aiodist.algorithms import collectives as alg
from aiodist.algorithms.p2p import P2P, SubP2P
from aiodist.algorithms.thresholds import Thresholds

__all__ = [
    "Layout",
    "layout_of",
    "Subset",
    "Within",
    "within_phases",
    "pieces",
    "MAX_PIECES",
    "all_reduce",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather",
    "reduce_scatter",
    "crossing_bytes",
    "steps",
    "even",
]

#: the group's ranks by host (group ranks), hosts ordered by their lowest rank
Layout = tuple[tuple[int, ...], ...]
Combine = Callable[[np.ndarray, np.ndarray], None]

# the phases' tag blocks (SubP2P indices; the last ones are the shm agreement's and GO_TAG's);
# rule 1's pieces take blocks 0 to 3 * MAX_PIECES - 1 (``_all_reduce_pieces``)
_WITHIN_IN, _ACROSS, _WITHIN_OUT = 25, 26, 27
#: the most pieces rule 1 pipelines an all_reduce in (their tag blocks must stay below _WITHIN_IN)
MAX_PIECES = 8


def layout_of(host_ids: Sequence[str]) -> Layout | None:
    """The layout of a group whose rank ``r`` is on host ``host_ids[r]``; None where a hierarchy
    has nothing to save: one host, or one rank on every host."""
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(host_ids):
        hosts.setdefault(h, []).append(r)
    if len(hosts) < 2 or all(len(rs) == 1 for rs in hosts.values()):
        return None
    return tuple(tuple(rs) for rs in sorted(hosts.values(), key=lambda rs: rs[0]))


def even(layout: Layout) -> int:
    """The number of ranks on every host where all hosts have the same, else 0."""
    k = len(layout[0])
    return k if all(len(h) == k for h in layout) else 0


class Subset:
    """The op's P2P seen by some of its ranks: rank ``i`` here is ``members[i]`` there."""

    __slots__ = ("_p2p", "_members", "rank", "size")

    def __init__(self, p2p: P2P, members: Sequence[int]) -> None:
        self._p2p = p2p
        self._members = tuple(members)
        self.rank = self._members.index(p2p.rank)
        self.size = len(self._members)

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._p2p.send(self._members[peer], buf, tag)

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._p2p.recv(self._members[peer], buf, tag)

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        return self._p2p.send_nowait(self._members[peer], buf, tag)


class Within(Protocol):
    """A faster way among the ranks of one host than the op's messages (the backend's shared
    memory for the host's part of the group), for the in-host phases. Each call runs one phase of
    the op ``p2p`` among its group ranks ``host`` on the phase's tag block ``phase`` (every rank
    of the host calls the same phases in the same order: ``within_phases``) and answers
    True, or False where it cannot (nothing done: the phase goes by messages). The contracts are
    ``aiodist.algorithms.collectives``' on the host's ranks."""

    async def reduce_scatter(
        self, p2p: P2P, host: Sequence[int], phase: int, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine
    ) -> bool: ...

    async def all_gather(self, p2p: P2P, host: Sequence[int], phase: int, outs: Sequence[np.ndarray], mine: np.ndarray) -> bool: ...

    async def reduce(self, p2p: P2P, host: Sequence[int], phase: int, buf: np.ndarray, root: int, combine: Combine) -> bool: ...

    async def broadcast(self, p2p: P2P, host: Sequence[int], phase: int, buf: np.ndarray, root: int) -> bool: ...

    async def barrier(self, p2p: P2P, host: Sequence[int], phase: int) -> bool: ...


def within_phases(op: str, layout: Layout, rank: int, nbytes: int = 0, th: Thresholds | None = None) -> int:
    """How many in-host phases ``op`` of ``nbytes`` runs on group rank ``rank``'s host (what a
    ``Within`` for it takes places in line for, at issue): none on a host of one rank;
    all_reduce's two per piece (in and out: ``pieces``; rule 2 has one piece); broadcast's one
    (out) and reduce's one (in); barrier's two; all_gather's one (out) and reduce_scatter's one (in) where the
    layout is even (else they are the flat schedules: none)."""
    if len(_host_of(layout, rank)) < 2:
        return 0
    if op == "all_reduce":
        return 2 * pieces(nbytes, th) if even(layout) > 1 else 2
    if op in ("broadcast", "reduce"):
        return 1
    if op == "barrier":
        return 2
    return 1 if op in ("all_gather", "reduce_scatter") and even(layout) > 1 else 0


def _host_of(layout: Layout, rank: int) -> tuple[int, ...]:
    return next(h for h in layout if rank in h)


def pieces(nbytes: int, th: Thresholds | None) -> int:
    """How many pieces an all_reduce of ``nbytes`` goes in by rule 1 (``th.hier_piece`` each, at
    most ``MAX_PIECES``; one where the rules give no piece size): the same on every rank."""
    piece = th.hier_piece if th is not None else 0
    return max(1, min(MAX_PIECES, nbytes // piece)) if piece > 0 else 1


async def all_reduce(
    p2p: P2P, buf: np.ndarray, combine: Combine, layout: Layout, *, thresholds: Thresholds | None = None, within: Within | None = None
) -> None:
    """``buf`` reduced over every rank of the group, in place, by the module's rules; the
    in-host phases through ``within`` where it can."""
    host = _host_of(layout, p2p.rank)
    k = even(layout)
    n = buf.size
    if k > 1 and n >= k:
        await _all_reduce_pieces(p2p, buf, combine, layout, host, pieces(buf.nbytes, thresholds), thresholds, within)
        return
    alone = len(host) == 1
    if not alone and (within is None or not await within.reduce(p2p, host, _WITHIN_IN, buf, 0, combine)):
        await alg.reduce(Subset(SubP2P(p2p, _WITHIN_IN), host), buf, 0, combine, thresholds=thresholds)
    if p2p.rank == host[0]:
        await alg.all_reduce(Subset(SubP2P(p2p, _ACROSS), [h[0] for h in layout]), buf, combine, thresholds=thresholds)
    if not alone and (within is None or not await within.broadcast(p2p, host, _WITHIN_OUT, buf, 0)):
        await alg.broadcast(Subset(SubP2P(p2p, _WITHIN_OUT), host), buf, 0, thresholds=thresholds)


async def _all_reduce_pieces(
    p2p: P2P,
    buf: np.ndarray,
    combine: Combine,
    layout: Layout,
    host: tuple[int, ...],
    count: int,
    thresholds: Thresholds | None,
    within: Within | None,
) -> None:
    """Rule 1 in ``count`` pieces, pipelined: each piece's reduce-scatter within the host, then
    its exchange across starts (a task) while the next piece's reduce-scatter runs; then each
    piece's all-gather within once its exchange is done, while the later pieces' still cross.
    The in-host phases run one after another in the host's line (every piece's reduce-scatter,
    then every piece's all-gather: the same order on every rank); piece ``c``'s phases use tag
    blocks ``c`` (across), ``MAX_PIECES + c`` (in) and ``2 * MAX_PIECES + c`` (out)."""
    k = len(host)
    i = host.index(p2p.rank)
    peers = [h[i] for h in layout]
    bounds = np.linspace(0, buf.size, count + 1).astype(np.int64)  # the same on every rank
    sliced = []
    for c in range(count):
        piece = buf[bounds[c] : bounds[c + 1]]
        cuts = np.linspace(0, piece.size, k + 1).astype(np.int64)
        sliced.append([piece[cuts[j] : cuts[j + 1]] for j in range(k)])
    across: list[asyncio.Future[None]] = []
    try:
        for c, slices in enumerate(sliced):
            mine = np.empty(slices[i].size, buf.dtype)
            block = MAX_PIECES + c
            if within is None or not await within.reduce_scatter(p2p, host, block, mine, slices, combine):
                await alg.reduce_scatter(Subset(SubP2P(p2p, block), host), mine, slices, combine, thresholds=thresholds)
            np.copyto(slices[i], mine)
            across.append(asyncio.ensure_future(alg.all_reduce(Subset(SubP2P(p2p, c), peers), slices[i], combine, thresholds=thresholds)))
        for c, slices in enumerate(sliced):
            await across[c]
            block = 2 * MAX_PIECES + c
            if within is None or not await within.all_gather(p2p, host, block, slices, slices[i]):
                await alg.all_gather(Subset(SubP2P(p2p, block), host), slices, slices[i], thresholds=thresholds)
    finally:
        for f in across:
            if not f.done():
                f.cancel()
            f.add_done_callback(alg.retrieve)


def _leaders(layout: Layout, root: int) -> list[int]:
    """Each host's leader for a rooted op: the root on its host, the first rank elsewhere."""
    return [root if root in h else h[0] for h in layout]


async def broadcast(
    p2p: P2P, buf: np.ndarray, root: int, layout: Layout, *, thresholds: Thresholds | None = None, within: Within | None = None
) -> None:
    """``alg.broadcast``'s contract: from the root to one leader on every other host (one
    crossing per remote host: ``_leaders``), then within each host from its leader."""
    host = _host_of(layout, p2p.rank)
    leaders = _leaders(layout, root)
    lead = leaders[layout.index(host)]
    if p2p.rank == lead:
        await alg.broadcast(Subset(SubP2P(p2p, _ACROSS), leaders), buf, leaders.index(root), thresholds=thresholds)
    if len(host) > 1 and (within is None or not await within.broadcast(p2p, host, _WITHIN_OUT, buf, host.index(lead))):
        await alg.broadcast(Subset(SubP2P(p2p, _WITHIN_OUT), host), buf, host.index(lead), thresholds=thresholds)


async def barrier(p2p: P2P, layout: Layout, *, within: Within | None = None) -> None:
    """``alg.barrier``'s contract (no rank leaves before every rank entered): a barrier within
    each host, one among the hosts' first ranks (the only messages across), a barrier within
    each host again (its ranks wait for their leader's)."""
    host = _host_of(layout, p2p.rank)
    alone = len(host) == 1
    if not alone and (within is None or not await within.barrier(p2p, host, _WITHIN_IN)):
        await alg.barrier(Subset(SubP2P(p2p, _WITHIN_IN), host))
    if p2p.rank == host[0]:
        await alg.barrier(Subset(SubP2P(p2p, _ACROSS), [h[0] for h in layout]))
    if not alone and (within is None or not await within.barrier(p2p, host, _WITHIN_OUT)):
        await alg.barrier(Subset(SubP2P(p2p, _WITHIN_OUT), host))


async def reduce(
    p2p: P2P,
    buf: np.ndarray,
    root: int,
    combine: Combine,
    layout: Layout,
    *,
    thresholds: Thresholds | None = None,
    within: Within | None = None,
) -> None:
    """``alg.reduce``'s contract (the result on the root): within each host to its leader
    (``_leaders``: the root on its host), then among the leaders to the root (one crossing per
    remote host)."""
    host = _host_of(layout, p2p.rank)
    leaders = _leaders(layout, root)
    lead = leaders[layout.index(host)]
    if len(host) > 1 and (within is None or not await within.reduce(p2p, host, _WITHIN_IN, buf, host.index(lead), combine)):
        await alg.reduce(Subset(SubP2P(p2p, _WITHIN_IN), host), buf, host.index(lead), combine, thresholds=thresholds)
    if p2p.rank == lead:
        await alg.reduce(Subset(SubP2P(p2p, _ACROSS), leaders), buf, leaders.index(root), combine, thresholds=thresholds)


async def all_gather(
    p2p: P2P,
    outs: Sequence[np.ndarray],
    mine: np.ndarray,
    layout: Layout,
    *,
    thresholds: Thresholds | None = None,
    within: Within | None = None,
) -> None:
    """``alg.all_gather``'s contract (``outs[r]`` gets rank ``r``'s ``mine``), by the hierarchy
    where the layout is even (the module docstring), else the flat schedule."""
    k = even(layout)
    if k < 2:
        await alg.all_gather(p2p, outs, mine, thresholds=thresholds)
        return
    host = _host_of(layout, p2p.rank)
    i = host.index(p2p.rank)
    mine_out = outs[p2p.rank]
    if mine_out is not mine:
        np.copyto(mine_out.reshape(-1), mine.reshape(-1))
    column = [h[i] for h in layout]  # this rank's counterparts, one per host (itself included)
    await alg.all_gather(Subset(SubP2P(p2p, _ACROSS), column), [outs[r] for r in column], mine_out, thresholds=thresholds)
    # within the host: local rank i's h parts (column i of the layout) packed into one message
    packs = [np.empty(sum(outs[h[j]].size for h in layout), mine.dtype) for j in range(k)]
    at = 0
    for r in column:
        n = outs[r].size
        packs[i][at : at + n] = outs[r].reshape(-1)
        at += n
    if within is None or not await within.all_gather(p2p, host, _WITHIN_OUT, packs, packs[i]):
        await alg.all_gather(Subset(SubP2P(p2p, _WITHIN_OUT), host), packs, packs[i], thresholds=thresholds)
    for j in range(k):
        if j == i:
            continue
        at = 0
        for h in layout:
            n = outs[h[j]].size
            outs[h[j]].reshape(-1)[...] = packs[j][at : at + n]
            at += n


async def reduce_scatter(
    p2p: P2P,
    out: np.ndarray,
    parts: Sequence[np.ndarray],
    combine: Combine,
    layout: Layout,
    *,
    thresholds: Thresholds | None = None,
    within: Within | None = None,
) -> None:
    """``alg.reduce_scatter``'s contract (``out`` on rank ``r`` = the reduction of every rank's
    ``parts[r]``), by the hierarchy where the layout is even (the module docstring), else the
    flat schedule."""
    k = even(layout)
    if k < 2:
        await alg.reduce_scatter(p2p, out, parts, combine, thresholds=thresholds)
        return
    host = _host_of(layout, p2p.rank)
    i = host.index(p2p.rank)
    # within the host: local rank j's share is every host's local-rank-j part, packed in host order
    packed = []
    for j in range(k):
        column = [h[j] for h in layout]
        packed.append(np.concatenate([parts[r].reshape(-1) for r in column]) if column else np.empty(0, out.dtype))
    mine = np.empty(packed[i].size, out.dtype)
    if within is None or not await within.reduce_scatter(p2p, host, _WITHIN_IN, mine, packed, combine):
        await alg.reduce_scatter(Subset(SubP2P(p2p, _WITHIN_IN), host), mine, packed, combine, thresholds=thresholds)
    # across: the counterparts reduce-scatter what they hold, host j's piece to host j's rank i
    sizes = [parts[h[i]].size for h in layout]
    cuts = np.cumsum([0, *sizes])
    pieces = [mine[cuts[j] : cuts[j + 1]] for j in range(len(layout))]
    column = [h[i] for h in layout]
    await alg.reduce_scatter(Subset(SubP2P(p2p, _ACROSS), column), out.reshape(-1), pieces, combine, thresholds=thresholds)


def crossing_bytes(hosts: int, per_host: int, nbytes: int, *, flat: bool) -> float:
    """What each host sends over its link for one all_reduce of ``nbytes`` (closed forms, for a
    ring all_reduce): the flat ring in rank order (hosts' ranks contiguous) crosses out of each
    host once per lap of each phase with ``(n-1)/n * S`` per lap, twice for all_reduce; the
    hierarchy's rings among the hosts carry ``2(h-1)/h * S`` per host in all."""
    if hosts < 2:
        return 0.0
    if flat:
        n = hosts * per_host
        return 2 * (n - 1) / n * nbytes
    return 2 * (hosts - 1) / hosts * nbytes


def steps(hosts: int, per_host: int, *, flat: bool) -> int:
    """The messages each rank sends one after another in one all_reduce (ring schedules, one
    piece each): the flat ring's ``2(n-1)``; the hierarchy's ``(k-1)`` within, ``2(h-1)`` across,
    ``(k-1)`` within, where every host has ``k`` ranks. The steps that wait on the link are the
    ``2(h-1)`` across: with many ranks per host the flat ring waits on it ``k`` times as often."""
    n = hosts * per_host
    if flat:
        return 2 * (n - 1)
    return 2 * (per_host - 1) + 2 * (hosts - 1)
