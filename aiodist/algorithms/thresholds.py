"""The one table of size thresholds that picks a collective's schedule, and the only reader of
the ``AIODIST_ALGO_*`` environment variables.

Rules this module keeps:
- Every threshold is in bytes of payload (what the choice function names), never elements,
  so one table serves every dtype.
- Every rank of a group must choose the same schedule for the same op, so every rank must
  see the same values: set the variables in the launcher's environment, not per rank. The
  choice depends only on sizes all ranks know (an all_gather's total, not a rank's own part);
  all_to_all alone chooses by a rank's own bytes, as its two ways send the same messages.
- Where the values come from, later ones winning: the defaults; a rules file named by
  ``AIODIST_ALGO_RULES`` (a JSON object of field names to values); each
  ``AIODIST_ALGO_<FIELD>`` variable (for example ``AIODIST_ALGO_ALLREDUCE_RD_MAX=32K``); and, for
  one group, ``pg_options`` given to ``init_process_group``/``new_group``/``split_group`` (a
  ``Thresholds``, used as it is, or a mapping of field names to values, applied over the
  process's table: ``rules_from``). Values are integers with an optional binary suffix K, M or
  G (a JSON number or string). A malformed value or an unknown field is a ValueError naming the
  variable, file or option, raised when the table is read (when the group is made).
- The defaults are starting points, to be tuned with ``python -m aiodist.bench``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from aiodist.knobs import parse_size

__all__ = ["ENV_PREFIX", "ENV_RULES", "Thresholds", "current", "from_env", "rules_from"]

ENV_PREFIX = "AIODIST_ALGO_"
#: a JSON file of field names to values, applied before the per-field variables
ENV_RULES = ENV_PREFIX + "RULES"

KiB = 1 << 10
MiB = 1 << 20

AllReduceAlgo = Literal["recursive_doubling", "halving_doubling", "ring"]


@dataclass(frozen=True)
class Thresholds:
    """Byte thresholds between latency-bound and bandwidth-bound schedules.

    A negative value disables the small-message schedule it bounds (``..._max = -1``) and a
    zero ``allreduce_ring_min`` sends every all_reduce round the ring, which is how tests force
    a path."""

    #: broadcast: binomial tree up to this many bytes, a pipelined chain above.
    broadcast_tree_max: int = 256 * KiB
    #: all_reduce: recursive doubling (log2 p full exchanges) up to this many bytes ...
    allreduce_rd_max: int = 64 * KiB
    #: ... ring reduce-scatter + all-gather from this many bytes; recursive halving/doubling between.
    allreduce_ring_min: int = 4 * MiB
    #: all_gather: Bruck (log2 p steps, one staging copy) up to this many bytes in total, ring above.
    allgather_bruck_max: int = 64 * KiB
    #: reduce_scatter: direct (every part straight to its owner, one round) up to this many bytes
    #: in total, ring above.
    reduce_scatter_direct_max: int = 64 * KiB
    #: all_to_all: every exchange in flight at once up to this many bytes sent in total, one
    #: pairwise step at a time above (bounds what a peer must hold unposted).
    alltoall_burst_max: int = 256 * KiB
    #: pipelined schedules (ring, chain, tree reduce) move data in pieces of at most this many
    #: bytes, so one piece's reduction overlaps the next piece's transfer. Every piece costs a
    #: few tens of us of Python (a message, a task, a wake-up) on each side; between ranks of one
    #: host the kernel's copies run on the ranks' own cores, so overlap buys little and the
    #: per-piece cost dominates: measured with ``python -m aiodist.bench collectives`` on 2 cores,
    #: 16 MiB all_reduce took ~10 ms with 256 KiB pieces and ~7 ms with 4 MiB (2 ranks; 33 ms
    #: against 25 ms with 4). Across hosts, where the NIC moves the bytes, smaller pieces may pay:
    #: tune with AIODIST_ALGO_PIPELINE_PIECE.
    pipeline_piece: int = 4 * MiB
    #: all_reduce through shared memory's halves or single copy (aiodist.shm: every rank of the
    #: group on one host) from this many bytes; negative: never. Below it, the latency lane
    #: (done in the call where the ranks arrive together; from 1 MiB in all slots it folds by
    #: slices, aiodist.shm._lane.sliced): by default past the lane's 1 MiB slot. Measured back to
    #: back here, the lane against the halves: 2 ranks 256 KiB 45 us against 68, 512 KiB 62
    #: against 82, 1 MiB 90 against 113-123; 4 ranks on 2 cores 256 KiB 356 against 506 (one
    #: lane op) and 286-443 (halves), 512 KiB 588 against 644-751, 1 MiB 1131 against 1056.
    allreduce_shm_min: int = 1 * MiB + 1
    #: all_gather through shared memory's halves or single copy from this many bytes in total
    #: (the output), or where a rank's part does not fit the lane; negative: never. Below it the
    #: lane. Measured back to back here (per rank's part; the lane against the halves or single
    #: copy): 2 ranks 128 KiB 30 us against 93, 256 KiB 49 against 113, 1 MiB 154 against 205;
    #: 4 ranks on 2 cores 64 KiB 64 against 302, 256 KiB 409 against 675, 512 KiB 751 against
    #: 793, 1 MiB 1497 against 1387.
    allgather_shm_min: int = 4 * MiB
    #: all_reduce, reduce and all_gather through shared memory's latency lane (aiodist.shm._lane:
    #: no socket message when the ranks arrive together, done in the issuing call) up to this
    #: many bytes per rank (at most the lane's 1 MiB slots; all_reduce and all_gather from their
    #: ``_shm_min`` up take the halves or single copy); 0: never (barrier too). Measured back to
    #: back here, reduce through the lane against single copy: 4 ranks on 2 cores 512 KiB 162 us
    #: against 916, 1 MiB 294 against 942; 2 ranks 512 KiB 191 against 252, 1 MiB alike.
    lane_max: int = 1 * MiB
    #: ... broadcast up to this many bytes, in a group of any size (a lane op waits for every
    #: rank's flag, where the socket's root only sends: it paid while a lane op cost tens of
    #: microseconds of Python; done in its call, it does not). Measured here, back to back, the
    #: lane against the socket (and single copy from 256 KiB): 2 ranks 64 KiB 13 us against 154,
    #: 256 KiB 24 against 175, 1 MiB 32 against 140 (single copy); 4 ranks on 2 cores 4 KiB 55
    #: against 86, 64 KiB 37 against 396, 256 KiB 85 against 534, 1 MiB 178 against 771.
    broadcast_lane_max: int = 1 * MiB
    #: broadcast by single-copy reads of the root's tensor (aiodist.shm._cma: every rank of the
    #: group on one host, and allowed to read the others' memory) from this many bytes; negative:
    #: never. At 2 ranks here the socket's broadcast took 2.4-4.6x Open MPI's time from 1 MiB up.
    broadcast_shm_min: int = 256 * KiB
    #: all_reduce by single-copy reads of the peers' buffers (aiodist.shm._cma) from this many
    #: bytes, where the group can (below it, the halves); negative: never. Measured here, 16 MiB:
    #: 2 ranks 2.0 ms against 2.7-2.8 through the halves, 4 ranks 6.8-7.7 against 12.0; 4 MiB
    #: 0.65 against 0.72 ms (2 ranks), 2.0-2.3 against 2.6 (4); 1 MiB was slower (0.30 against 0.20).
    allreduce_cma_min: int = 4 * MiB
    #: reduce by single-copy reads (aiodist.shm._cma) from this many bytes, where the group can
    #: (below it, the lane in groups of 2 up to ``lane_max``, else the socket's tree); negative:
    #: never. Measured at 2 ranks: 16 MiB 2.5 ms against 4.9 on the socket, 4 MiB 0.77 against
    #: 1.16, 1 MiB 0.26 against 0.38; 256 KiB 0.12 ms, where the lane took 0.08 (the lane comes
    #: first). Groups of more ranks: ``cma_wide_min`` too.
    reduce_cma_min: int = 256 * KiB
    #: ... but in groups of more than 2 ranks, broadcast and reduce go by single copy only from
    #: this many bytes too (every reader pulls the whole tensor at once there). Measured at 4
    #: ranks on 2 cores (two runs each, single copy against the socket's tree): broadcast 1 MiB
    #: 0.61-0.67 ms against 0.61-0.74, 2 MiB 0.76-0.88 against 2.3-2.4; reduce 1 MiB 0.89-1.00
    #: against 0.78-0.93, 2 MiB 1.22-1.27 against 3.8-4.0; 256 KiB broadcast was slower (0.25
    #: against 0.17-0.21).
    cma_wide_min: int = 2 * MiB
    #: reduce_scatter by single-copy reads (aiodist.shm._cma) from this many bytes of input
    #: (every part: the same on every rank), where the group can; negative: never. Measured
    #: here against the socket's schedules, it was faster at every size: 2 ranks 64 B 81 us
    #: against 223, 16 MiB 1.7 ms against 3.6; 4 ranks (on 2 cores) 1 KiB 0.38 ms against 1.29,
    #: 16 MiB 4.6 against 20.7.
    reduce_scatter_cma_min: int = 0
    #: all_to_all by single-copy reads (aiodist.shm._cma) where the group can: 0, every one;
    #: negative, never. Not a size: a rank knows only its own sizes, and every rank of a group
    #: must take the same path, so no other value is allowed.
    alltoall_cma: int = 0
    #: gather and scatter by single-copy reads where the group can, in groups of 2 (wider
    #: groups keep the socket), from this many bytes per rank (torch's gather and scatter take
    #: the same size on every rank; a rank judges by its own); negative: never. Measured at 2
    #: ranks against the socket: gather 64 B-64 KiB 61-64 us against 76-83, so every size;
    #: scatter 256 KiB 78 against 93, 1 MiB 110 against 181. Small scatters go through the
    #: lane slot (the parts in it: one lane op) and are as fast as the socket's; uneven sizes
    #: (scatter_object_list's) must take one path on every rank, so 0 is the default.
    gather_cma_min: int = 0
    scatter_cma_min: int = 0
    #: reduce_scatter through the latency lane up to this many bytes of input (the whole input,
    #: the same on every rank), where the group has a lane: every rank posts its input, and
    #: folds its own part of every slot in rank order, done in its call when the ranks are
    #: there; 0: never. Measured here back to back, the lane against single copy (a task, the
    #: lane's table, the reads): 2 ranks 16 B-64 KiB 8 us against 113-165, 256 KiB 27 against
    #: 118, 1 MiB 56 against 192; 4 ranks on 2 cores 256 KiB 189 against 465, 512 KiB 327
    #: against 523, 1 MiB 655 against 642.
    reduce_scatter_lane_max: int = 1 * MiB
    #: in a group of 2 ranks, all_reduce, broadcast, reduce_scatter and all_gather (its output:
    #: parts of up to half of it) go through the latency lane up to this many bytes (its slots
    #: hold 4 MiB there: aiodist.shm._manager.lane_max), ahead of their other rules, where
    #: ``lane_max`` is on; 0: as in wider groups (no pieces either). Measured back to back at 2 ranks (best of three), the lane against single
    #: copy: broadcast 2 MiB 58 us
    #: against 244, 4 MiB 126 against 353; reduce_scatter 2 MiB 109 against 309, 4 MiB 340
    #: against 423; all_reduce 4 MiB 407 against 519 (2 MiB 174 against 184, the halves);
    #: all_gather 4 MiB of output 224 against 336 (8 MiB was slower: 760 against 536). Wider
    #: groups keep 1 MiB: with more ranks than cores a lane op waits for ranks not running (4
    #: ranks on 2 cores, 4 MiB slots: broadcast 4 MiB 2.1 ms against 1.2).
    pair_lane_max: int = 4 * MiB
    #: ... and past it, up to this many bytes, through the pair's lane in pieces
    #: (aiodist.shm._lane: one lane op each, an all_reduce's two; the next piece is written
    #: while the last is copied out) where the group has a lane; 0 (the default): never (single
    #: copy). Off by default: measured back to back at 2 ranks, pieces against single copy were
    #: faster in most runs (all_reduce 8 MiB 719 us against 1061; broadcast 16 MiB 0.80-1.01 ms
    #: against 1.17-1.86; reduce_scatter 16 MiB 1.03-1.34 against 1.41-1.78), but this VM has
    #: spells in which the two ranks' cross-core copies slow down several times, and there a
    #: run of pieces, which meet at every piece, took 7-8 ms where single copy, which meets
    #: twice, took 1-4 (16 MiB broadcast 7.2 against 0.9-1.5; all_reduce 8.1-8.6 against
    #: 2.2-7.4, in 4 of 8 runs against 2 of 8). all_gather was slower in pieces in any run.
    pair_pieces_max: int = 0
    #: ... in pieces of this many bytes (an all_reduce's: of each rank's half of a piece;
    #: larger where that would take more than 32 pieces, and at most the slot's 4 MiB).
    pair_piece: int = 1 * MiB
    #: gather and scatter through the latency lane up to this many bytes per rank (a rank judges
    #: by its own part: torch's gather and scatter take one size everywhere), in a group of any
    #: size, where the group has a lane: the root posts its table of sizes (and a scatter's
    #: parts), done in the call when the ranks are there; 0: never. Measured here at 2 ranks,
    #: 4 B-64 KiB by single copy: gather 68-102 us, scatter 54-94 (a task, the doorbells).
    gather_lane_max: int = 64 * KiB
    scatter_lane_max: int = 64 * KiB
    #: all_reduce, broadcast, reduce, all_gather and reduce_scatter in a group spread over hosts with more than one
    #: rank on some host go by the hierarchy (aiodist.algorithms.hier: within each host, across
    #: once per byte, within) from this many bytes (the op's total); negative: never (the flat
    #: schedules). Measured on 2 netns hosts joined by
    #: a 1 Gbit link, 2 ranks per host, on 2 cores (docs/multi_host.md), hierarchy against flat:
    #: 16 KiB 1.6 ms against 0.8 (three phases against recursive doubling's two steps), 1 MiB
    #: 9.8 against 17.6, 16 MiB 167 against 211 (1.00 S sent per host against 1.53).
    hier_min: int = 64 * KiB
    #: the hierarchy's all_reduce (where every host has as many ranks) goes in pieces of this
    #: many bytes (at most aiodist.algorithms.hier.MAX_PIECES), pipelined: a piece's exchange
    #: across runs while the next piece's reduce-scatter and the last one's all-gather run within
    #: the host; 0: one piece.
    hier_piece: int = 4 * MiB

    def __post_init__(self) -> None:
        if self.pipeline_piece < 1:
            raise ValueError(f"pipeline_piece must be at least 1 byte, got {self.pipeline_piece}")
        if self.alltoall_cma > 0:
            raise ValueError(
                f"alltoall_cma ({ENV_PREFIX}ALLTOALL_CMA) must be 0 (every all_to_all by single copy) or negative (never), got {self.alltoall_cma}"
            )

    @classmethod
    def latency_bound(cls, pipeline_piece: int = 1 * MiB) -> Thresholds:
        """Every op on its small-message schedule, whatever the size (for tests and benchmarks);
        never shared memory: no lane, no halves, no single copy (``plan`` gives the socket for
        every op and size; tests/test_plan.py checks it)."""
        huge = 1 << 62
        return cls(
            broadcast_tree_max=huge,
            allreduce_rd_max=huge,
            allreduce_ring_min=huge,
            allgather_bruck_max=huge,
            reduce_scatter_direct_max=huge,
            alltoall_burst_max=huge,
            pipeline_piece=pipeline_piece,
            allreduce_shm_min=-1,
            allgather_shm_min=-1,
            lane_max=0,
            broadcast_lane_max=0,
            broadcast_shm_min=-1,
            allreduce_cma_min=-1,
            reduce_cma_min=-1,
            reduce_scatter_cma_min=-1,
            alltoall_cma=-1,
            gather_cma_min=-1,
            scatter_cma_min=-1,
            hier_min=-1,
        )

    @classmethod
    def bandwidth_bound(cls, pipeline_piece: int) -> Thresholds:
        """Every op on its pipelined (ring, chain, pairwise) schedule, in pieces of
        ``pipeline_piece`` bytes, whatever the size."""
        return cls(-1, -1, 0, -1, -1, -1, pipeline_piece, -1, -1, 0, 0)

    @classmethod
    def halving(cls, pipeline_piece: int) -> Thresholds:
        """all_reduce on recursive halving/doubling at every size; the others as by default."""
        return cls(allreduce_rd_max=-1, allreduce_ring_min=1 << 62, pipeline_piece=pipeline_piece, allreduce_shm_min=-1, lane_max=0)

    def piece_elems(self, itemsize: int) -> int:
        """Pipelining piece in elements of ``itemsize`` bytes (at least one)."""
        return max(1, self.pipeline_piece // max(1, itemsize))

    def broadcast(self, nbytes: int) -> Literal["tree", "chain"]:
        return "tree" if nbytes <= self.broadcast_tree_max else "chain"

    def all_reduce(self, nbytes: int) -> AllReduceAlgo:
        if nbytes <= self.allreduce_rd_max:
            return "recursive_doubling"
        if nbytes >= self.allreduce_ring_min:
            return "ring"
        return "halving_doubling"

    def all_reduce_shm(self, nbytes: int) -> bool:
        """all_reduce of ``nbytes`` goes through shared memory where the group can."""
        return 0 <= self.allreduce_shm_min <= nbytes

    def all_reduce_cma(self, nbytes: int) -> bool:
        """all_reduce of ``nbytes`` through shared memory goes by single-copy reads where the group can."""
        return 0 <= self.allreduce_cma_min <= nbytes

    def reduce_cma(self, nbytes: int, ranks: int = 2) -> bool:
        """reduce of ``nbytes`` in a group of ``ranks`` goes by single-copy reads where the group
        can (a group of 2 takes the lane first, up to ``lane_max``)."""
        return 0 <= self.reduce_cma_min <= nbytes and nbytes > 0 and self.cma_wide(nbytes, ranks)

    def cma_wide(self, nbytes: int, ranks: int) -> bool:
        """Single-copy reads of ``nbytes`` suit a group of ``ranks``: any size in a group of 2,
        from ``cma_wide_min`` in wider groups (every rank then reads the whole message)."""
        return ranks <= 2 or self.cma_wide_min <= nbytes

    def reduce_scatter_lane(self, total_nbytes: int) -> bool:
        """reduce_scatter of ``total_nbytes`` of input goes through the latency lane where the group has one."""
        return 0 < total_nbytes <= self.reduce_scatter_lane_max and self.lane(total_nbytes)

    def reduce_scatter_cma(self, total_nbytes: int) -> bool:
        """reduce_scatter of ``total_nbytes`` of input goes by single-copy reads where the group can."""
        return 0 <= self.reduce_scatter_cma_min <= total_nbytes and total_nbytes > 0

    def hier(self, nbytes: int) -> bool:
        """An all_reduce, broadcast, reduce, all_gather or reduce_scatter of ``nbytes`` (the op's
        total) in a group spread over hosts (more than one rank on some host) goes by the hierarchy."""
        return 0 <= self.hier_min <= nbytes

    def all_reduce_lane(self, nbytes: int) -> bool:
        """all_reduce of ``nbytes`` goes through shared memory's latency lane where the group has one."""
        return 0 < nbytes <= self.lane_max and not self.all_reduce_shm(nbytes)

    def pair_lane(self, nbytes: int, ranks: int) -> bool:
        """A pair's all_reduce, broadcast, reduce_scatter or all_gather (``nbytes``: its
        output) of ``nbytes`` goes through the latency lane where the group has one
        (``pair_lane_max``)."""
        return ranks == 2 and 0 < nbytes <= self.pair_lane_max and self.lane_max > 0

    def pair_pieces(self, nbytes: int, ranks: int) -> bool:
        """A pair's all_reduce, broadcast or reduce_scatter of ``nbytes`` (past
        ``pair_lane_max``) goes through its lane in pieces where the group has one."""
        return ranks == 2 and self.lane_max > 0 and self.pair_piece > 0 and 0 < self.pair_lane_max < nbytes <= self.pair_pieces_max

    def lane(self, nbytes: int) -> bool:
        """An op whose largest per-rank payload is ``nbytes`` (0 for barrier) goes through the
        latency lane where the group has one."""
        return 0 <= nbytes <= self.lane_max and self.lane_max > 0

    def broadcast_shm(self, nbytes: int, ranks: int = 2) -> bool:
        """broadcast of ``nbytes`` in a group of ``ranks`` goes by single-copy reads where the group can."""
        return 0 <= self.broadcast_shm_min <= nbytes and nbytes > 0 and self.cma_wide(nbytes, ranks)

    def all_gather_shm(self, total_nbytes: int) -> bool:
        """all_gather of ``total_nbytes`` (every rank's part) goes through shared memory where the group can."""
        return 0 <= self.allgather_shm_min <= total_nbytes

    def all_gather(self, total_nbytes: int) -> Literal["bruck", "ring"]:
        return "bruck" if total_nbytes <= self.allgather_bruck_max else "ring"

    def reduce_scatter(self, total_nbytes: int) -> Literal["direct", "ring"]:
        return "direct" if total_nbytes <= self.reduce_scatter_direct_max else "ring"

    def all_to_all(self, total_nbytes: int) -> Literal["burst", "pairwise"]:
        return "burst" if total_nbytes <= self.alltoall_burst_max else "pairwise"


_FIELDS = tuple(f.name for f in dataclasses.fields(Thresholds))


def _parse(name: str, text: str) -> int:
    try:
        return parse_size(text, signed=True)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a byte count such as 65536, 64K or 4M") from None


_DEFAULT = Thresholds()
_KNOWN = {ENV_PREFIX + f.upper(): f for f in _FIELDS}


def _value(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f'{where}={value!r}: expected a byte count such as 65536, "64K" or "4M"')
    return value if isinstance(value, int) else _parse(where, value)


def _from_mapping(where: str, rules: Mapping[str, object]) -> dict[str, int]:
    """Field name -> value from ``rules`` (a rules file's object, a group's ``pg_options``)."""
    if not isinstance(rules, Mapping):
        raise ValueError(f"{where}: expected an object of threshold names to byte counts, got {type(rules).__name__}")
    changes = {}
    for key, value in rules.items():
        if key not in _FIELDS:
            raise ValueError(f"{where}: unknown threshold {key!r}; the thresholds are {', '.join(_FIELDS)}")
        changes[key] = _value(f"{where}: {key}", value)
    return changes


def _rules_file(path: str) -> dict[str, int]:
    where = f"{ENV_RULES}={path}"
    try:
        with open(path, encoding="utf-8") as f:
            rules = json.load(f)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    return _from_mapping(where, rules)


def from_env(env: Mapping[str, str]) -> Thresholds:
    """The defaults, then the rules file ``AIODIST_ALGO_RULES`` names (if any), then every
    ``AIODIST_ALGO_<FIELD>`` in ``env``. An ``AIODIST_ALGO_`` name that matches no field is a
    ValueError: a misspelt override must not be ignored."""
    changes: dict[str, int] = {}
    if env.get(ENV_RULES, "").strip():
        changes.update(_rules_file(env[ENV_RULES].strip()))
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name != ENV_RULES:
            field = _KNOWN.get(name)
            if field is None:
                raise ValueError(f"unknown {name}: the thresholds are {', '.join(sorted(_KNOWN))} (and {ENV_RULES}, a file)")
            changes[field] = _parse(name, value)
    return Thresholds(**changes) if changes else _DEFAULT


def rules_from(pg_options: object) -> Thresholds | None:
    """A group's own table from its ``pg_options``: a :class:`Thresholds` as it is; a mapping of
    field names to values over the process's table (``current()``); anything else (a backend's
    own options) None, the process's table then. Every rank must give the same."""
    if isinstance(pg_options, Thresholds):
        return pg_options
    if isinstance(pg_options, Mapping):
        return dataclasses.replace(current(), **_from_mapping("pg_options", pg_options))
    return None


def current() -> Thresholds:
    """The table for this process: the defaults with ``os.environ``'s overrides, read afresh on
    each call (nothing is cached at module level). Reading scans the environment for misspelt
    names, some 10-30 us, so a backend reads it once per group, when the group is made, and
    passes it to every op as ``thresholds=``; the collectives call this only when given none."""
    return from_env(os.environ)
