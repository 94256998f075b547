"""The seam between c10d and the paths: ``Route``, how the backend carries out one op.

c10d checks an op's arguments, takes its sequence number and hands the op to the backend
(as torch's c10d calls ``group.allreduce(...)``). It asks ``route(group, op, nbytes)`` for the
op's route and runs the route's method for the op (``route.all_reduce(p2p, flat, combine)``,
...) as its body; c10d itself holds no path policy (``tests/test_layers.py`` checks that
``aiodist/c10d`` neither plans nor reaches the shared-memory paths).

A route is made when the op is issued, in call order, and holds:

- the path rules' ``Plan`` for the op (``aiodist.algorithms.plan``: a pure decision on what every
  rank of the group shares, the op, its size and the group's thresholds), and
- where the plan uses shared memory and the backend has it, the op's place in the group's
  shared-memory line (``Ticket``), which passes on when the op's Work completes. It is taken
  wherever the backend has shared memory, not only where this rank can read its peers: a rank
  that cannot must still vote in the group's agreement.

Its methods try the planned shared-memory path (``aiodist.shm``: the lane, the segment halves,
single copy), which answers False where the group has no shared memory or did not agree on it,
and then the socket's schedules (``aiodist.algorithms.collectives``). The route's methods run
in the op's task; a kept call's in-call path (``Quick``, below) runs in the call itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from aiodist.algorithms import collectives as alg
from aiodist.algorithms import hier
from aiodist.algorithms.p2p import P2P
from aiodist.algorithms.plan import Plan, plan
from aiodist.backends.base import ProcessGroupLike
from aiodist.shm import (
    HOST_PART,
    GroupShm,
    HostLink,
    Into,
    Ticket,
    all_to_all_copy,
    all_to_all_inline_agree,
    all_to_all_rest,
    all_to_all_table,
    all_to_all_table_bytes,
    gather_even,
    gather_finish,
    gather_posts,
    lane_all_reduce_gather,
    lane_gather_slices,
    lane_now,
    lane_parts,
    lane_slice_sizes,
    lane_sliced,
    op_link,
    run_all_gather,
    run_all_reduce,
    run_all_to_all,
    run_barrier,
    run_broadcast,
    run_gather,
    run_reduce,
    run_reduce_scatter,
    run_scatter,
    same_bytes,
    scatter_even,
    scatter_finish,
    scatter_posts,
    settle,
)
from aiodist.types import Fold

__all__ = ["Into", "Route", "route", "HostShm", "Quick", "Rest", "quick"]

Combine = Callable[[np.ndarray, np.ndarray], None]
W = TypeVar("W", covariant=True)


class Issuer(Protocol[W]):
    """What a route issues its op on: c10d's ProcessGroup, whose ``issue`` gives the op's Work."""

    def issue(self, *args: Any, **kwargs: Any) -> W: ...


def route(pg: ProcessGroupLike, op: str, nbytes: int, *, part: int = 0, planned: Plan | None = None) -> Route:
    """The route of ``op`` of ``nbytes`` (an all_gather's or reduce_scatter's total; ``part``
    its largest part) in group ``pg``: its plan (``planned`` where the caller kept it from an
    earlier call of the same shape) and, where that plan uses shared memory and the backend has
    it, the op's place in the group's shared-memory line, taken now."""
    th = pg.thresholds
    layout = pg.backend.layout(pg.ranks)
    pl = plan(op, nbytes, len(pg.ranks), th, part=part, spread=layout is not None) if planned is None else planned
    if pl.path == "hier":
        assert layout is not None
        return Route(pl, th, None, layout, HostShm.take(pg, op, layout, nbytes))
    shm = getattr(pg.backend, "shm", None) if pl.shm else None
    return Route(pl, th, None if shm is None else shm.ticket(pg.group_id, pg.ranks), layout)


class HostShm:
    """``hier.Within`` by shared memory: a hierarchical op's in-host phases through the shared
    memory of its group's ranks on this host (a line and segments of their own: the group's id
    with ``HOST_PART`` set, agreed among those ranks as any group's is), each phase by the path
    the rules give an op of its size in a group of the host's ranks (``plan``: the lane, single
    copy, the halves), over a ``HostLink`` of the op. Its places in that line are taken at issue
    (one per phase, ``hier.within_phases``) and used in order; each passes on when its phase
    ends or, at the latest, when the op's Work completes (``release``)."""

    __slots__ = ("_tickets", "_used", "_th")

    def __init__(self, tickets: list[Ticket], th: Any) -> None:
        self._tickets = tickets
        self._used = 0
        self._th = th

    @classmethod
    def take(cls, pg: ProcessGroupLike, op: str, layout: hier.Layout, nbytes: int) -> HostShm | None:
        """The op's places in line (taken now, in its issuing step), or None where this rank's
        host has one rank of the group, the op has no in-host phase, the backend has no shared
        memory or the host's ranks agreed on messages."""
        shm = getattr(pg.backend, "shm", None)
        if shm is None:
            return None
        me = pg.rank()
        n = hier.within_phases(op, layout, me, nbytes, pg.thresholds)
        if not n:
            return None
        host = next(h for h in layout if me in h)
        ranks = tuple(pg.ranks[r] for r in host)
        first = shm.ticket(pg.group_id | HOST_PART, ranks)
        if first is None:
            return None
        return cls([first, *(shm.ticket(pg.group_id | HOST_PART, ranks) for _ in range(n - 1))], pg.thresholds)

    def release(self, *_: Any) -> None:
        """Pass every place on (the Work's done callback; idempotent)."""
        for t in self._tickets:
            t.release()

    def _next(self) -> Ticket | None:
        i = self._used
        self._used = i + 1
        return self._tickets[i] if i < len(self._tickets) else None

    def _plan(self, op: str, nbytes: int, host: Sequence[int], part: int = 0) -> tuple[Ticket | None, Plan]:
        """The phase's place in line and its plan in a group of the host's ranks; the place is
        passed on at once where the plan takes no shared memory."""
        t = self._next()
        pl = plan(op, nbytes, len(host), self._th, part=part)
        if t is not None and not pl.shm:
            t.release()
            t = None
        return t, pl

    async def reduce_scatter(
        self, p2p: P2P, host: Sequence[int], phase: int, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine
    ) -> bool:
        t, pl = self._plan("reduce_scatter", sum(p.nbytes for p in parts), host)
        if t is None:
            return False
        link = HostLink(op_link(p2p), host, phase)
        return await run_reduce_scatter(t, link, out, parts, combine, pl.single_copy, pl.lane, _piece(pl, self._th))

    async def all_gather(self, p2p: P2P, host: Sequence[int], phase: int, outs: Sequence[np.ndarray], mine: np.ndarray) -> bool:
        t, pl = self._plan("all_gather", sum(o.nbytes for o in outs), host, max(o.nbytes for o in outs))
        if t is None:
            return False
        return await run_all_gather(t, HostLink(op_link(p2p), host, phase), outs, mine, pl.lane, pl.single_copy)

    async def reduce(self, p2p: P2P, host: Sequence[int], phase: int, buf: np.ndarray, root: int, combine: Combine) -> bool:
        t, pl = self._plan("reduce", buf.nbytes, host)
        if t is None:
            return False
        return await run_reduce(t, HostLink(op_link(p2p), host, phase), buf, root, combine, pl.single_copy, pl.lane)

    async def barrier(self, p2p: P2P, host: Sequence[int], phase: int) -> bool:
        t, _ = self._plan("barrier", 0, host)
        if t is None:
            return False
        return await run_barrier(t, HostLink(op_link(p2p), host, phase))

    async def broadcast(self, p2p: P2P, host: Sequence[int], phase: int, buf: np.ndarray, root: int) -> bool:
        t, pl = self._plan("broadcast", buf.nbytes, host)
        if t is None:
            return False
        return await run_broadcast(t, HostLink(op_link(p2p), host, phase), buf, root, pl.single_copy, pl.lane, _piece(pl, self._th))


def _piece(pl: Plan, th: Any) -> int:
    """A pair's pieces' size where the plan says ``pieces`` (``Thresholds.pair_piece``), else 0."""
    return int(th.pair_piece) if pl.path == "pieces" else 0


class Route:
    """One op's way through the backend (the module docstring)."""

    __slots__ = ("plan", "th", "ticket", "layout", "within")

    def __init__(self, pl: Plan, th: Any, ticket: Ticket | None, layout: hier.Layout | None = None, within: HostShm | None = None) -> None:
        self.plan = pl
        self.th = th
        self.ticket = ticket
        self.layout = layout  # the group's ranks by host, where it is spread over hosts (``hier``)
        self.within = within  # a hierarchical op's in-host phases by shared memory, where it has them

    def issue(self, pg: Issuer[W], *args: Any, **kwargs: Any) -> W:
        """``pg.issue(...)`` for the op: its place in line passes on when the Work completes,
        even where the body never ran."""
        ticket = self.ticket
        within = self.within
        try:
            work = pg.issue(*args, **kwargs)
        except BaseException:
            if ticket is not None:
                ticket.release()
            if within is not None:
                within.release()
            raise
        if ticket is not None:
            work.add_done_callback(ticket.release)  # type: ignore[attr-defined]  # (a Work: an asyncio.Future)
        if within is not None:
            work.add_done_callback(within.release)  # type: ignore[attr-defined]
        return work

    # -- the ops -------------------------------------------------------------------------------

    async def broadcast(self, p2p: P2P, flat: np.ndarray, root: int) -> None:
        pl, ticket = self.plan, self.ticket
        if pl.path == "hier" and self.layout is not None:
            await hier.broadcast(p2p, flat, root, self.layout, thresholds=self.th, within=self.within)
        elif ticket is None or not await run_broadcast(ticket, p2p, flat, root, pl.single_copy, pl.lane, _piece(pl, self.th)):
            await alg.broadcast(p2p, flat, root, thresholds=self.th)

    async def all_reduce(self, p2p: P2P, flat: np.ndarray, combine: Combine, into: Into | None = None) -> None:
        """``flat`` reduced in place; with ``into``, the result is also in its arrays: read
        straight into them where the path can (``into.written``), else copied from ``flat``."""
        pl, ticket = self.plan, self.ticket
        if pl.path == "hier":
            assert self.layout is not None
            await hier.all_reduce(p2p, flat, combine, self.layout, thresholds=self.th, within=self.within)
        elif ticket is None or not await run_all_reduce(ticket, p2p, flat, combine, pl.lane, pl.single_copy, into, _piece(pl, self.th)):
            await alg.all_reduce(p2p, flat, combine, thresholds=self.th)
        if into is not None and not into.written:
            into.copy_from(flat)

    def all_reduce_body(self, flat: np.ndarray, combine: Combine) -> Callable[[P2P], Any]:
        """The op's body for an all_reduce with nothing to do before or after the exchanges: on
        the socket path the schedule itself (one coroutine fewer per op)."""
        if self.plan.path == "hier" and self.layout is not None:
            return functools.partial(hier.all_reduce, buf=flat, combine=combine, layout=self.layout, thresholds=self.th, within=self.within)
        if self.ticket is None:
            return functools.partial(alg.all_reduce, buf=flat, combine=combine, thresholds=self.th)
        return functools.partial(self.all_reduce, flat=flat, combine=combine)

    async def reduce(self, p2p: P2P, mine: np.ndarray, root: int, combine: Combine) -> None:
        pl, ticket = self.plan, self.ticket
        if pl.path == "hier" and self.layout is not None:
            await hier.reduce(p2p, mine, root, combine, self.layout, thresholds=self.th, within=self.within)
        elif ticket is None or not await run_reduce(ticket, p2p, mine, root, combine, pl.single_copy, pl.lane):
            await alg.reduce(p2p, mine, root, combine, thresholds=self.th)

    async def all_gather(self, p2p: P2P, outs: Sequence[np.ndarray], mine: np.ndarray) -> None:
        ticket = self.ticket
        pl = self.plan
        if pl.path == "hier" and self.layout is not None:
            await hier.all_gather(p2p, outs, mine, self.layout, thresholds=self.th, within=self.within)
        elif ticket is None or not await run_all_gather(ticket, p2p, outs, mine, pl.lane, pl.single_copy):
            await alg.all_gather(p2p, outs, mine, thresholds=self.th)

    async def gather(self, p2p: P2P, outs: Sequence[np.ndarray] | None, mine: np.ndarray, root: int) -> None:
        ticket, pl = self.ticket, self.plan
        if ticket is None or not await run_gather(ticket, p2p, outs, mine, root, pl.single_copy, pl.lane):
            await alg.gather(p2p, outs, mine, root)

    async def scatter(self, p2p: P2P, mine: np.ndarray, ins: Sequence[np.ndarray] | None, root: int) -> None:
        ticket, pl = self.ticket, self.plan
        if ticket is None or not await run_scatter(ticket, p2p, mine, ins, root, pl.single_copy, pl.lane):
            await alg.scatter(p2p, mine, ins, root)

    async def reduce_scatter(self, p2p: P2P, out: np.ndarray, parts: Sequence[np.ndarray], combine: Combine) -> None:
        ticket = self.ticket
        pl = self.plan
        if pl.path == "hier" and self.layout is not None:
            await hier.reduce_scatter(p2p, out, parts, combine, self.layout, thresholds=self.th, within=self.within)
        elif ticket is None or not await run_reduce_scatter(ticket, p2p, out, parts, combine, pl.single_copy, pl.lane, _piece(pl, self.th)):
            await alg.reduce_scatter(p2p, out, parts, combine, thresholds=self.th)

    async def all_to_all(self, p2p: P2P, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
        ticket = self.ticket
        if ticket is None or not await run_all_to_all(ticket, p2p, outs, ins):
            await alg.all_to_all(p2p, outs, ins, thresholds=self.th)

    async def barrier(self, p2p: P2P) -> None:
        ticket = self.ticket
        if self.plan.path == "hier" and self.layout is not None:
            await hier.barrier(p2p, self.layout, within=self.within)
        elif ticket is None or not await run_barrier(ticket, p2p):
            await alg.barrier(p2p)


# -- the in-call path: post, collect, or park ------------------------------------------------------


def quick(pg: ProcessGroupLike, pl: Plan, nbytes: int, op: str = "") -> Quick | None:
    """The in-call path of a call kept by c10d (its plan ``pl``, ``nbytes`` per rank: what it
    posts), where the plan takes the latency lane (or, for an all_to_all, single copy, whose
    small posts go inline through the lane) and the backend has shared memory; None otherwise
    (every op of the call then takes its route)."""
    if pl.path != "lane" and not (op == "all_to_all" and pl.single_copy):
        return None
    if op == "all_to_all":
        nbytes += all_to_all_table_bytes(len(pg.ranks))  # (its post: the table, then the parts)
    shm = getattr(pg.backend, "shm", None)
    return None if shm is None else Quick(shm, pg.group_id, pg.ranks, nbytes)


class Rest:
    """The rest of an op that its issuing call posted and could not finish (a peer not there
    yet, or one that did not agree): ``body`` runs it under the op's runner; ``release`` (the
    Work's done callback) passes its place in line on, whatever became of it."""

    __slots__ = ("body", "release")

    def __init__(self, body: Callable[[P2P], Any], release: Callable[..., None]) -> None:
        self.body = body
        self.release = release


class Quick:
    """A kept call's in-call path (trio's ``send_nowait`` as the first step of ``send``): where
    the group's shared-memory line is empty and the group agreed on a lane the payload fits,
    the op posts its part and collects its peers' in the call (``aiodist.shm._lane``); where
    they are all there it completes with no coroutine, task, timer or callback, and where one
    is not, it parks: the op takes its place in line (a ``Ticket``, whose turn it is) and its
    ``Rest`` waits in a task. Elsewhere (an op ahead in line, no agreement yet, the socket
    path) it answers None having done nothing, and the op takes its route."""

    __slots__ = ("shm", "group_id", "ranks", "me", "nbytes", "line", "g", "sizes", "any_sizes", "_by_root", "_tmp", "_sliced")

    def __init__(self, shm: Any, group_id: int, ranks: Sequence[int], nbytes: int) -> None:
        self.shm = shm
        self.group_id = group_id
        self.ranks = ranks
        self.nbytes = nbytes
        self.line: Any = None  # the group's line (aiodist.shm._manager._Turns), once it has one
        self.g: GroupShm | None = None  # the group's shared memory, once known to fit the lane
        self.sizes = [nbytes] * len(ranks)
        self.any_sizes = [-1] * len(ranks)  # (gather's and scatter's: their finish checks the sizes)
        self.me = list(ranks).index(shm.rank)
        self._by_root: dict[int, list[int]] = {}  # a broadcast's sizes, by its root
        self._tmp: np.ndarray | None = None  # a fold's second array (``aiodist.types.folder``)
        self._sliced = lane_sliced(nbytes, 1, len(ranks)) is not None  # an all_reduce of this size folds by slices

    def _lane(self) -> GroupShm | None:
        """The group's lane where this op may take it now (its line empty), else None."""
        t = self.line
        g = self.g
        if t is not None and g is not None and t.serving == t.issued and t.state is g:
            return g  # (every call but the first few)
        if t is None:
            t = self.line = self.shm.line(self.group_id, self.ranks)
            if t is None:
                return None
        if t.serving != t.issued:
            return None
        g = t.state
        if g is not self.g:
            if g is None or not g.fits_lane(self.nbytes):
                return None
            self.g = g
        return g

    def _scratch(self, like: np.ndarray) -> np.ndarray | None:
        """A fold's second array, like ``like`` (the call's: one dtype and size), in a group of
        more than 2 (where a fold has more than one step), for a small array (up to 4 KiB: where
        numpy's in-place step costs more than its elements; a bigger fold stays in place, in
        one array's cache lines)."""
        tmp = self._tmp
        if tmp is None and len(self.ranks) > 2 and like.nbytes <= 4096:
            tmp = self._tmp = np.empty(like.size, like.dtype)
        return tmp

    def _park(self, g: GroupShm, s: int, sizes: Sequence[int], op: str, finish: Callable[[Any, GroupShm, int], Any]) -> Rest:
        """The rest of an op posted in slot ``s`` whose peers were not all there, or did not all
        agree: it takes its place in line (the line was empty: its turn is now), waits for every
        peer's flag and checks digests and ``sizes`` (``settle``), then ``finish(link, g, s)``,
        the op's last step (which may check what it reads and raise, naming it, under the op's
        runner; a coroutine where it still waits: all_to_all's reads)."""
        ticket = self.shm.ticket(self.group_id, self.ranks)

        async def rest(p2p: P2P) -> None:
            try:
                link = op_link(p2p)
                await settle(link, g, s, sizes, op, spin=False)
                more = finish(link, g, s)
                if more is not None:
                    await more
            finally:
                ticket.release()

        return Rest(rest, ticket.release)

    def _go(
        self,
        seq: int,
        digest: int,
        mine: np.ndarray | Sequence[np.ndarray] | None,
        sizes: Sequence[int],
        finish: Callable[[GroupShm, int], None],
        op: str,
    ) -> bool | Rest | None:
        g = self._lane()
        if g is None:
            return None
        s = lane_now(g, seq, digest, mine, sizes)
        if s >= 0:
            finish(g, s)
            return True
        return self._park(g, s + 2, sizes, op, lambda link, g, s: finish(g, s))

    # -- the ops: each True when done in the call, its Rest when parked, None when it is not for
    # -- the lane now (nothing done)

    def all_reduce(self, seq: int, digest: int, flat: np.ndarray, fold: Fold) -> bool | Rest | None:
        """All-reduce ``flat`` (op ``seq``, ``digest``; ``fold``: ``aiodist.types.folder``'s for
        the op's reduction and dtype): written into this rank's slot as it is, the slots folded
        into it in rank order."""
        g = self._lane()
        if g is None:
            return None
        views = g.typed_slots(g.lane_ops & 1, flat.dtype, flat.size)  # (the slot post takes)
        if self._sliced:
            b = lane_sliced(flat.nbytes, flat.size, len(self.ranks))
            assert b is not None
            return self._fold_sliced(g, seq, digest, flat, fold, views, b)
        views[g.me][...] = flat
        tmp = self._scratch(flat)
        if len(views) == 2:  # a pair folds its own part from ``flat``, not from the slot it just wrote
            views = [flat, views[1]] if g.me == 0 else [views[0], flat]
        s = lane_now(g, seq, digest, None, self.sizes, flat.nbytes)
        if s >= 0:
            fold(flat, views, tmp)
            return True
        return self._park(g, s + 2, self.sizes, "all_reduce", lambda link, g, s: fold(flat, views, tmp))

    def _fold_sliced(
        self, g: GroupShm, seq: int, digest: int, flat: np.ndarray, fold: Fold, views: list[np.ndarray], b: list[int]
    ) -> bool | Rest:
        """An all_reduce folded by slices (``aiodist.shm._lane.sliced``): its input into this
        rank's slot (in a pair, only the other rank's slice: its own is folded from ``flat``,
        ``out`` itself as its part of the fold, which ``folder`` allows as a pair's second
        part), the first lane op, this rank's slice folded, the second lane op with it, the
        others' slices copied; parked at whichever lane op a peer is not there for."""
        me = self.me
        lo, hi = b[me], b[me + 1]
        out = flat[lo:hi]
        mine = views[me]
        if len(views) == 2:
            mine[:lo] = flat[:lo]
            mine[hi:] = flat[hi:]
            parts = [out, views[1][lo:hi]] if me == 0 else [views[0][lo:hi], out]
        else:
            mine[...] = flat
            parts = [v[lo:hi] for v in views]
        s = lane_now(g, seq, digest, None, self.sizes, flat.nbytes)
        if s < 0:

            def rest(link: Any, g: GroupShm, s: int) -> Any:
                fold(out, parts, None)
                return lane_all_reduce_gather(link, g, flat, b)

            return self._park(g, s + 2, self.sizes, "all_reduce", rest)
        fold(out, parts, None)
        sizes = lane_slice_sizes(b, flat.itemsize)
        s = lane_now(g, seq, digest, out.view(np.uint8), sizes)
        if s >= 0:
            lane_gather_slices(flat, lane_parts(g, s, sizes), b, me)
            return True
        return self._park(g, s + 2, sizes, "all_reduce", lambda link, g, s: lane_gather_slices(flat, lane_parts(g, s, sizes), b, me))

    def broadcast(self, seq: int, digest: int, flat: np.ndarray, root: int) -> bool | Rest | None:
        """Broadcast ``flat`` from group rank ``root``."""
        sizes = self._by_root.get(root)
        if sizes is None:
            sizes = self._by_root[root] = [self.nbytes if q == root else 0 for q in range(len(self.ranks))]
        if self.me == root:
            return self._go(seq, digest, flat.view(np.uint8), sizes, _nothing, "broadcast")

        def finish(g: GroupShm, s: int) -> None:
            flat[...] = g.typed_slots(s, flat.dtype, flat.size)[root]

        return self._go(seq, digest, None, sizes, finish, "broadcast")

    def reduce(self, seq: int, digest: int, flat: np.ndarray, kept: Any) -> bool | Rest | None:
        """Every rank's ``flat`` folded in rank order into the root's (``kept``: the call's kept
        checks, whose ``root`` and ``fold`` it reads); the others' are only read."""
        root, fold = kept.root, kept.fold
        if self.me != root:
            return self._go(seq, digest, flat.view(np.uint8), self.sizes, _nothing, "reduce")

        tmp = self._scratch(flat)

        def finish(g: GroupShm, s: int) -> None:
            fold(flat, g.typed_slots(s, flat.dtype, flat.size), tmp)

        return self._go(seq, digest, flat.view(np.uint8), self.sizes, finish, "reduce")

    def all_gather(self, seq: int, digest: int, out: np.ndarray, mine: np.ndarray) -> bool | Rest | None:
        """Every rank's ``mine`` into its part of ``out`` (flat, the group's size times ``mine``'s)."""
        m = mine.size

        if len(self.ranks) != 2:

            def finish_wide(g: GroupShm, s: int) -> None:
                for q, v in enumerate(g.typed_slots(s, out.dtype, m)):
                    out[q * m : (q + 1) * m] = v  # this rank's own from its slot too: ``mine`` may overlap ``out``

            return self._go(seq, digest, mine.view(np.uint8), self.sizes, finish_wide, "all_gather")
        me = self.me
        own = out[me * m : (me + 1) * m]
        # a pair: the own part after the other's (its slot is fresh: the own part's copy first,
        # from the slot it had just written, made a 512 KiB part's op 91 us against 53; in wider
        # groups, 4 ranks on 2 cores, the order did not pay), from ``mine``, or from this rank's
        # slot where ``mine`` lies in ``out`` elsewhere (the copy before may have overwritten
        # it); nothing where it is the own part (in place)
        overlap = np.may_share_memory(out, mine)

        def finish(g: GroupShm, s: int) -> None:
            slots = g.typed_slots(s, out.dtype, m)
            for q, v in enumerate(slots):
                if q != me:
                    out[q * m : (q + 1) * m] = v
            if not overlap:
                own[...] = mine
            elif not same_bytes(own.view(np.uint8), mine.view(np.uint8)):
                own[...] = slots[me]

        return self._go(seq, digest, mine.view(np.uint8), self.sizes, finish, "all_gather")

    def all_gather_list(self, seq: int, digest: int, outs: Sequence[np.ndarray], mine: np.ndarray) -> bool | Rest | None:
        """Every rank's ``mine`` into ``outs[that rank]`` (every one of ``mine``'s dtype and shape)."""
        m = mine.size
        shape = mine.shape

        if len(self.ranks) != 2:

            def finish_wide(g: GroupShm, s: int) -> None:
                # this rank's own from its slot too: ``mine`` may be one of ``outs``
                for o, v in zip(outs, g.typed_slots(s, mine.dtype, m), strict=True):
                    o[...] = v if len(shape) == 1 else v.reshape(shape)

            return self._go(seq, digest, mine.reshape(-1).view(np.uint8), self.sizes, finish_wide, "all_gather")
        me = self.me
        own = outs[me]
        overlap = any(np.may_share_memory(o, mine) for o in outs)  # as all_gather's own part (a pair)

        def finish(g: GroupShm, s: int) -> None:
            slots = g.typed_slots(s, mine.dtype, m)
            for q, (o, v) in enumerate(zip(outs, slots, strict=True)):
                if q != me:
                    o[...] = v if len(shape) == 1 else v.reshape(shape)
            if not overlap:
                own[...] = mine
            elif own is not mine and not same_bytes(own.reshape(-1).view(np.uint8), mine.reshape(-1).view(np.uint8)):
                v = slots[me]
                own[...] = v if len(shape) == 1 else v.reshape(shape)

        return self._go(seq, digest, mine.reshape(-1).view(np.uint8), self.sizes, finish, "all_gather")

    def reduce_scatter(self, seq: int, digest: int, out: np.ndarray, inp_fold: tuple[np.ndarray, Fold]) -> bool | Rest | None:
        """``out`` = this rank's part of every rank's input (``inp_fold``: the input, flat, the
        group's size times ``out``'s, and the reduction's fold), folded in rank order. In a
        pair whose output is apart from its input, a rank posts only the other's part and folds
        its own straight from its input."""
        inp, fold = inp_fold
        m = out.size
        lo = self.me * m
        if len(self.ranks) == 2 and not np.may_share_memory(out, inp):
            return self._reduce_scatter_pair(seq, digest, out, inp, fold)

        tmp = self._scratch(out)

        def finish(g: GroupShm, s: int) -> None:
            fold(out, [v[lo : lo + m] for v in g.typed_slots(s, inp.dtype, inp.size)], tmp)

        return self._go(seq, digest, inp.view(np.uint8), self.sizes, finish, "reduce_scatter")

    def _reduce_scatter_pair(self, seq: int, digest: int, out: np.ndarray, inp: np.ndarray, fold: Fold) -> bool | Rest | None:
        g = self._lane()
        if g is None:
            return None
        me, m = self.me, out.size
        views = g.typed_slots(g.lane_ops & 1, inp.dtype, inp.size)  # (the slot post takes)
        theirs = (1 - me) * m
        views[me][theirs : theirs + m] = inp[theirs : theirs + m]
        own = inp[me * m : (me + 1) * m]

        def finish(g: GroupShm, s: int) -> None:
            other = g.typed_slots(s, inp.dtype, inp.size)[1 - me][me * m : (me + 1) * m]
            fold(out, [own, other] if me == 0 else [other, own], None)

        s = lane_now(g, seq, digest, None, self.sizes, inp.nbytes)
        if s >= 0:
            finish(g, s)
            return True
        return self._park(g, s + 2, self.sizes, "reduce_scatter", lambda link, g, s: finish(g, s))

    def gather(self, seq: int, digest: int, mine: np.ndarray, outs_root: tuple[Sequence[np.ndarray] | None, int]) -> bool | Rest | None:
        """Every rank's ``mine`` into ``outs[that rank]`` of the root (``outs_root``: the
        root's list, None elsewhere, and the root's group rank; one size everywhere, as the
        kept call's), in the call: ``aiodist.shm._lane.gather``'s posts (the root's table of
        sizes, kept; the others' bytes), checks and copies. Sizes that do not agree park the
        op, whose rest names them."""
        g = self._lane()
        if g is None:
            return None
        outs, root = outs_root
        me = self.me
        if me == root:
            posted = self._tmp
            if posted is None:
                posted = self._tmp = gather_posts(me, root, outs, mine)  # type: ignore[assignment]
        else:
            posted = mine.reshape(-1).view(np.uint8)
        s = lane_now(g, seq, digest, posted, self.any_sizes)
        if s >= 0 and gather_even(g, s, me, root, outs, mine):
            return True

        def finish(link: Any, g: GroupShm, s: int) -> None:
            gather_finish(link, g, s, root, outs, mine)

        return self._park(g, s if s >= 0 else s + 2, self.any_sizes, "gather", finish)

    def scatter(self, seq: int, digest: int, out: np.ndarray, ins_root: tuple[Sequence[np.ndarray] | None, int]) -> bool | Rest | None:
        """``ins[q]`` of the root into ``out`` of rank q (``ins_root``: the root's list, None
        elsewhere, and the root's group rank; one size everywhere, as the kept call's), in the
        call: ``aiodist.shm._lane.scatter``'s posts (the root's table, kept, and its parts; the
        others' expected size, kept), checks and copies."""
        g = self._lane()
        if g is None:
            return None
        ins, root = ins_root
        me = self.me
        head = self._tmp
        if head is None:
            head = self._tmp = scatter_posts(me, root, ins, out)[0]
        pieces = [head]
        if ins is not None:
            for x in ins:
                pieces.append(x.reshape(-1).view(np.uint8))
        s = lane_now(g, seq, digest, pieces, self.any_sizes)
        if s >= 0 and scatter_even(g, s, me, root, out):
            return True

        def finish(link: Any, g: GroupShm, s: int) -> None:
            scatter_finish(link, g, s, root, out)

        return self._park(g, s if s >= 0 else s + 2, self.any_sizes, "scatter", finish)

    def all_to_all(self, seq: int, digest: int, out: np.ndarray, inp: np.ndarray) -> bool | Rest | None:
        """Part q of ``inp`` to rank q, part q of ``out`` from rank q (flat, the group's size
        times one part each): posted inline (``aiodist.shm._algorithms.all_to_all_table``:
        the single-copy path's inline post); done in the call where every rank's post is inline
        and agrees, else parked (the rest reads and checks as the route's). Not in a group that
        cannot read its peers' memory: its all_to_all takes the socket."""
        g = self._lane()
        if g is None or not g.cma:
            return None
        n = len(self.ranks)
        part = inp.nbytes // n
        table = self._tmp
        if table is None:
            table = self._tmp = all_to_all_table(n, part)
        me = self.me
        src = inp.view(np.uint8)
        g.cma_ops += 1
        s = lane_now(g, seq, digest, [table, src], self.any_sizes)
        if s >= 0 and all_to_all_inline_agree(g, s, me, n, part):
            all_to_all_copy(g, s, me, n, out.view(np.uint8), part)
            return True
        outs, ins = _chunks_of(out, n), _chunks_of(inp, n)
        return self._park(
            g, s if s >= 0 else s + 2, self.any_sizes, "all_to_all", lambda link, g, s: all_to_all_rest(link, g, s, outs, ins)
        )

    def barrier(self, seq: int, digest: int, _a: Any = None, _b: Any = None) -> bool | Rest | None:
        """Every rank of the group has entered."""
        return self._go(seq, digest, None, self.sizes, _nothing, "barrier")


def _chunks_of(flat: np.ndarray, n: int) -> list[np.ndarray]:
    m = flat.size // n
    return [flat[i * m : (i + 1) * m] for i in range(n)]


def _nothing(g: GroupShm, s: int) -> None:
    """An op with nothing to do once every peer's part is there (a barrier, a broadcast's root)."""
