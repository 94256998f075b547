"""Which path a collective takes between ranks: one pure decision.

``plan(op, nbytes, ranks, rules, part=...) -> Plan``. Its inputs are only what every rank of the
group shares, so every rank plans alike: the op, its size in bytes as every rank knows it (an
all_gather's or reduce_scatter's total, not one rank's part; ``part`` is the largest part where a
rule needs it), the group's size, and the group's :class:`~aiodist.algorithms.thresholds.Thresholds`
(the rules' byte limits, the same on every rank). all_to_all is the exception its own rule names:
a rank knows only its own sizes there, so its path does not depend on a size.

A :class:`Plan` says what the op tries first (``path``), whether it takes a place in the group's
shared-memory line (``shm``: the backend decides whether it has shared memory and whether the
group agreed on it, and falls back to the socket where not). The socket's own schedule (tree or chain,
recursive doubling or ring, ...) is chosen by ``aiodist.algorithms.collectives`` from the same
Thresholds.

The paths:

- ``socket``: messages through the transport (``aiodist.algorithms.collectives``).
- ``lane``: shared memory's latency lane (``aiodist.shm._lane``): one slot per rank, no message
  when the ranks arrive together; small ops, where the group has a lane.
- ``pieces``: a pair's latency lane in pieces (``aiodist.shm._lane``: one lane op a piece, each
  with its own number in the line), past the pair's 4 MiB slot, where ``th.pair_pieces_max``
  turns it on (0 by default); where the group has no lane,
  single copy (or the halves, or the socket, where the group cannot read its peers).
- ``halves``: shared memory's two segment halves, pipelined (``aiodist.shm._algorithms``).
- ``single_copy``: single-copy reads of the peers' buffers (``aiodist.shm._cma``), where the
  group can read its peers' memory.
- ``hier``: the hierarchy of a group spread over hosts (``aiodist.algorithms.hier``): within each
  host, across once per byte, within; messages through the transport.

An op on the socket path that still takes a place in line (``shm`` with path ``socket``) says
there which op it is in, so a peer that took another path for a size that differs (a mistake)
finds the desync at once instead of a timeout.

The rules per op, in order (the first that applies decides; ``th`` is the Thresholds):

broadcast
  0. ``spread`` and ``th.hier(nbytes)``: ``hier`` (the root to one leader on each other host,
     then within each host), out of the group's line.
  1. ``0 < nbytes <= th.broadcast_lane_max`` and the lane on: ``lane`` (before single copy,
     where thresholds would allow both), in a group of any size: every lane op waits for every
     rank, yet done in its call it beat the socket's tree, where a rank waits only for its
     parent (4 ranks on 2 cores, 4-256 KiB: 37-85 us against 86-534); in a group of 2 up to
     ``th.pair_lane_max`` too (``th.pair_lane``: the pair's lane slots hold 4 MiB).
  1b. ``th.pair_pieces(nbytes, ranks)`` (a group of 2, past ``th.pair_lane_max`` up to
     ``th.pair_pieces_max``): ``pieces`` (in cache, two copies a byte beat a single-copy read).
  2. past ``th.broadcast_lane_max`` and ``th.broadcast_shm(nbytes, ranks)``: ``single_copy``.
  3. past ``th.broadcast_lane_max``, single copy allowed (``broadcast_shm_min >= 0``) and the
     lane on: ``socket`` in line.
  4. otherwise ``socket``.
all_reduce
  1. ``spread`` (the group's ranks are on several hosts, more than one on some:
     ``aiodist.algorithms.hier.layout_of``) and ``th.hier(nbytes)``: ``hier``, out of the
     group's shared-memory line (a group across hosts has no shared memory as a whole; its
     in-host phases take places in the line of its ranks on this host).
  2. ``th.pair_lane(nbytes, ranks)`` (a group of 2, up to ``th.pair_lane_max``): ``lane``;
     ``th.pair_pieces(nbytes, ranks)`` (past it, up to ``th.pair_pieces_max``): ``pieces``.
  3. ``th.all_reduce_shm(nbytes)``: ``single_copy`` if ``th.all_reduce_cma(nbytes)``, else ``halves``.
  4. ``th.all_reduce_lane(nbytes)``: ``lane``.
  5. otherwise ``socket``.
reduce
  0. ``spread`` and ``th.hier(nbytes)``: ``hier`` (within each host to a leader, then among the
     leaders to the root), out of line.
  1. ``nbytes > 0`` and ``th.lane(nbytes)``: ``lane`` (in a group of any size, as broadcast).
  2. ``th.reduce_cma(nbytes, ranks)``: ``single_copy``.
  3. past the lane's sizes (``th.lane_max``; lane on) with single copy allowed: ``socket`` in line.
  4. otherwise ``socket``.
all_gather, all_gather_into_tensor (``nbytes``: the output's total; ``part``: the largest part)
  0. ``spread`` and ``th.hier(nbytes)``: ``hier`` (the hierarchy where every host has as many
     ranks; the flat schedules otherwise), out of line.
  0b. ``th.pair_lane(nbytes, ranks)`` (a group of 2, up to ``th.pair_lane_max`` of output:
     parts of up to 2 MiB in the pair's 4 MiB slots): ``lane`` (measured back to back, 2 MiB
     parts 224 us against 336 by single copy; 4 MiB parts were slower, 760 against 536: out of
     cache, three copies a byte lose to a read and a copy).
  1. ``th.all_gather_shm(nbytes)``: ``single_copy`` in a group of 2, or from ``th.cma_wide_min``
     in a wider one (below it the reads of several peers cost more than the copies they save);
     else ``halves``. Where the group cannot read its peers, single copy is the halves.
  2. ``th.lane(part)``: ``lane`` (by default below 4 MiB of output with every part within the
     lane's 1 MiB: done in its call, it beat the halves and single copy there).
  3. a part past the lane's sizes (the lane on) and shared memory allowed
     (``allgather_shm_min >= 0``): as 1.
  4. otherwise ``socket``.
gather, scatter (``nbytes``: a rank's own part, the same on every rank as torch requires;
``part``: 1 where the call's sizes may differ per rank on purpose, the object collectives'
payloads, which every rank must take by one path whatever its own size)
  1. ``part == 0``, ``0 < nbytes <= th.gather_lane_max`` (``scatter_lane_max``) and the lane
     holds the root's post (gather: its table of sizes, 8 bytes a rank, or a part; scatter: the
     table and every part): ``lane``, in a group of any size.
  2. a group of other than 2 ranks, or single copy off for it: ``socket``. At 4 ranks on 2
     cores single copy was 2x slower up to 64 KiB and faster only from 4 MiB.
  3. ``nbytes >= th.gather_cma_min`` (``scatter_cma_min``): ``single_copy``.
  4. otherwise ``socket`` in line.
reduce_scatter (``nbytes``: the input's total)
  0. ``spread`` and ``th.hier(nbytes)``: ``hier``, as all_gather.
  1. ``th.reduce_scatter_lane(nbytes)`` or ``th.pair_lane(nbytes, ranks)``: ``lane`` (every
     rank posts its input and folds its own part of every slot); ``th.pair_pieces(nbytes,
     ranks)``: ``pieces`` (each rank posts the other's part, piece by piece).
  2. ``th.reduce_scatter_cma(nbytes)``: ``single_copy``.
  3. past its lane's sizes (``th.reduce_scatter_lane_max``; lane on) with single copy allowed:
     ``socket`` in line.
  4. otherwise ``socket``.
all_to_all (``nbytes``: what this rank sends in all; ``part``: the number of parts)
  1. ``th.alltoall_cma >= 0``: ``single_copy`` for every all_to_all (a rank's parts that fit
     the lane slot go inline there).
  2. otherwise ``socket``.
barrier
  0. ``spread`` and the hierarchy on (``th.hier_min >= 0``): ``hier`` (within each host, among
     the hosts' first ranks, within again), out of the group's line.
  1. ``th.lane(0)``: ``lane``.
  2. otherwise ``socket``.

``plan`` is called once per op (all_reduce keeps its plan with the call's other checks for
the next call like it); it does a few comparisons and allocates nothing but the Plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiodist.algorithms.thresholds import Thresholds

__all__ = ["OPS", "Path", "Plan", "plan"]

Path = Literal["socket", "lane", "pieces", "halves", "single_copy", "hier"]

OPS = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one op does: see the module docstring."""

    path: Path
    #: takes a place in the group's shared-memory line (where the backend has shared memory)
    shm: bool

    @property
    def lane(self) -> bool:
        return self.path == "lane"

    @property
    def single_copy(self) -> bool:
        return self.path == "single_copy"


_SOCKET = Plan("socket", False)
_SOCKET_IN_LINE = Plan("socket", True)
_HIER = Plan("hier", False)
_PIECES = Plan("pieces", True)


def plan(op: str, nbytes: int, ranks: int, th: Thresholds, *, part: int = 0, spread: bool = False) -> Plan:
    """The path of ``op`` (one of :data:`OPS`) for ``nbytes`` in a group of ``ranks``, by the
    rules in the module docstring (``spread``: the group is on several hosts, more than one
    rank on some). An unknown op is a ValueError."""
    if op == "all_reduce":
        if spread and th.hier(nbytes):
            return _HIER
        if th.pair_lane(nbytes, ranks):
            return Plan("lane", True)
        if th.pair_pieces(nbytes, ranks):
            return _PIECES
        if th.all_reduce_shm(nbytes):
            return Plan("single_copy" if th.all_reduce_cma(nbytes) else "halves", True)
        if th.all_reduce_lane(nbytes):
            return Plan("lane", True)
        return _SOCKET
    if op == "broadcast":
        if spread and th.hier(nbytes):
            return _HIER
        if (0 < nbytes <= th.broadcast_lane_max and th.lane(nbytes)) or th.pair_lane(nbytes, ranks):
            return Plan("lane", True)
        if th.pair_pieces(nbytes, ranks):
            return _PIECES
        if nbytes > th.broadcast_lane_max and th.broadcast_shm_min >= 0:
            if th.broadcast_shm(nbytes, ranks):
                return Plan("single_copy", True)
            if th.lane_max > 0:
                return _SOCKET_IN_LINE
        return _SOCKET
    if op == "reduce":
        if spread and th.hier(nbytes):
            return _HIER
        if nbytes > 0 and th.lane(nbytes):
            return Plan("lane", True)
        if th.reduce_cma(nbytes, ranks):
            return Plan("single_copy", True)
        return _SOCKET_IN_LINE if _past_lane(th, nbytes, th.lane_max, th.reduce_cma_min) else _SOCKET
    if op == "all_gather":
        if spread and th.hier(nbytes):
            return _HIER
        if th.pair_lane(nbytes, ranks):
            return Plan("lane", True)
        if th.all_gather_shm(nbytes):
            return Plan("single_copy" if th.cma_wide(nbytes, ranks) else "halves", True)
        if th.lane(part):
            return Plan("lane", True)
        if 0 < th.lane_max < part and th.allgather_shm_min >= 0:
            return Plan("single_copy" if th.cma_wide(nbytes, ranks) else "halves", True)
        return _SOCKET
    if op in ("gather", "scatter"):
        gather = op == "gather"
        if part == 0 and 0 < nbytes <= (th.gather_lane_max if gather else th.scatter_lane_max):
            if th.lane(max(nbytes, 8 * ranks) if gather else ranks * (nbytes + 8)):
                return Plan("lane", True)
        threshold = th.gather_cma_min if gather else th.scatter_cma_min
        if ranks != 2 or threshold < 0:
            return _SOCKET
        if threshold <= nbytes:
            return Plan("single_copy", True)
        return _SOCKET_IN_LINE
    if op == "reduce_scatter":
        if spread and th.hier(nbytes):
            return _HIER
        if th.reduce_scatter_lane(nbytes) or th.pair_lane(nbytes, ranks):
            return Plan("lane", True)
        if th.pair_pieces(nbytes, ranks):
            return _PIECES
        if th.reduce_scatter_cma(nbytes):
            return Plan("single_copy", True)
        return _SOCKET_IN_LINE if _past_lane(th, nbytes, th.reduce_scatter_lane_max, th.reduce_scatter_cma_min) else _SOCKET
    if op == "all_to_all":
        if th.alltoall_cma >= 0:
            return Plan("single_copy", True)
        return _SOCKET
    if op == "barrier":
        if spread and th.hier_min >= 0:
            return _HIER
        return Plan("lane", True) if th.lane(0) else _SOCKET
    raise ValueError(f"plan: unknown op {op!r}; the ops are {', '.join(OPS)}")


def _past_lane(th: Thresholds, nbytes: int, lane_limit: int, threshold: int) -> bool:
    """An op that may go by single copy, past its own lane's sizes (``lane_limit``) where the
    group has a lane, and with single copy allowed for it: it takes a place in line on the
    socket path too."""
    return nbytes > lane_limit and th.lane_max > 0 and threshold >= 0
