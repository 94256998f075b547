"""``SharedMemory``: one rank's shared segments, which groups may use them, and whose turn it is.

Rules this module keeps:
- Every rank of the CPU socket backend has one, even with shared memory off: the ranks of a
  group agree (a one-byte MIN all_reduce on the op's own channel, at the group's first op big
  enough) whether the group uses it, so a rank that cannot (``AIODIST_SHM_BYTES=0``, no memfd,
  a peer on another host, a failed fd hand-over, any error on the way) sends the whole group
  down the socket path.
  The agreement is made once per group (its id and member list) and kept.
- Each group that uses shared memory has one segment per member rank (``AIODIST_SHM_BYTES``,
  default 32 MiB, in two halves used in turn; pages are allocated as ops touch them). A group
  of its own segments means ops of different groups never share memory, so they never wait on
  each other, whatever order ranks issue them in.
- A rank makes its segment for a group once it has an op of the group in line (a peer's fetch
  that comes first waits for that, at most ``_SETUP_S``), and closes the group's segments, its
  own and the peers', when the group votes for the socket path or is destroyed
  (``release_group``); a group it never reached, or is done with, gets nothing from its server.
- Within a group, shared-memory ops run one at a time in issue order: each takes a ticket at
  issue (its sequence number's step) and waits for its turn; the turn passes when its body ends
  or, at the latest, when its Work completes (a body that never ran still passes it on).
- A group spread over hosts has no shared memory as a whole (its agreement fails: a peer on
  another host); its ranks on each host have a line and segments of their own, under the
  group's id with ``HOST_PART`` set, for the in-host phases of aiodist.algorithms.hier (the
  route takes that line's tickets at issue, as for any group).
- Each rank publishes ``aiodist/shm/<rank>`` in the store (its fd server's socket name and host
  id, or why it is off) before the transport's address exchange, so every record is there by
  the time any op runs.
- A wait on a peer here (its record, its segment) is one on the op's ``OpLink``
  (aiodist.shm._link): counted by the op's tracker and failed by the transport's error for
  that peer, as a receive from it would be.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import platform
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiodist.algorithms import collectives as alg
from aiodist.algorithms.p2p import SubP2P
from aiodist.algorithms.thresholds import Thresholds
from aiodist.knobs import knob
from aiodist.shm import _cma
from aiodist.shm._link import OpLink
from aiodist.shm._segment import FdServer, Segment, fetch
from aiodist.store.base import Store, present

__all__ = ["SharedMemory", "GroupShm", "Ticket", "ENV_BYTES", "DEFAULT_BYTES", "HOST_PART", "segment_bytes"]

log = logging.getLogger("aiodist.shm")

ENV_BYTES = "AIODIST_SHM_BYTES"
DEFAULT_BYTES = knob(ENV_BYTES).whole({})  # the registry's default (aiodist.knobs)
_MIN_BYTES = 4096
_KEY = "aiodist/shm/"
_SETUP_S = 10.0  # fetching the peers' segments; past it this rank votes for the socket path
_AGREE_SUB = 29  # the agreement's sub-op index on the op's channel (SubP2P): the last one (GO_TAG has the block above)
_ALIGN = 64
#: a group spread over hosts keeps the shared memory of its ranks on this host (the in-host phases
#: of aiodist.algorithms.hier) as a line and segments of their own, under the group's id with
#: this bit set (group ids count up from 0; the fd server's requests carry 32 bits)
HOST_PART = 1 << 31
_RELEASED_KEPT = 1024  # destroyed groups whose ids are still refused (release_group)
_LATENCY = Thresholds.latency_bound()
ENV_SPIN = "AIODIST_SHM_SPIN_US"
DEFAULT_SPIN_US = knob(ENV_SPIN).number({})  # the registry's default
#: the lane relies on x86-TSO (stores seen in program order, loads in order) for its flags
_TSO = platform.machine().lower() in ("x86_64", "amd64")


def spin_seconds(env: dict[str, str] | None = None) -> float:
    """How long a lane wait spins, yielding its core at every turn (``os.sched_yield``: a peer
    that shares the core runs at once), before it sleeps on the doorbell:
    ``AIODIST_SHM_SPIN_US``, default 500 us; 0 never spins. Waking a sleeping peer is what a
    small op costs between processes (the waker's eventfd write or socket send took 300-400 us
    on the 2-core VM this was measured on), so a short spin pays where the ranks arrive
    together; a peer later than that costs one spin and then a sleep."""
    return knob(ENV_SPIN).number(env) * 1e-6


def segment_bytes(env: dict[str, str] | None = None) -> int:
    """``AIODIST_SHM_BYTES`` (bytes, with an optional K/M/G suffix; 0 turns shared memory off),
    default 32 MiB. A malformed or too small value is a ValueError naming the variable."""
    value = knob(ENV_BYTES).whole(env)
    if 0 < value < _MIN_BYTES:
        raise ValueError(f"{ENV_BYTES}={value}: at least {_MIN_BYTES} bytes, or 0 to turn shared memory off")
    return value


#: the latency lane (aiodist.shm._lane) at the start of every segment: a rank's "sleeping" word,
#: then two slots of a 64-byte header (flag, digest, nbytes) and ``lane_max(ranks)`` payload
#: bytes: ``LANE_MAX`` in a group of more than 2, ``PAIR_LANE_MAX`` in a pair (its ops reach
#: 4 MiB done in the call: two copies in cache beat single-copy reads there, where with more
#: ranks than cores every lane op waits for ranks the scheduler has not run)
LANE_MAX = 1 << 20
PAIR_LANE_MAX = 4 << 20


def lane_max(ranks: int) -> int:
    """Payload bytes of a lane slot in a group of ``ranks`` (the same on every rank)."""
    return PAIR_LANE_MAX if ranks == 2 else LANE_MAX


def lane_bytes(ranks: int) -> int:
    """Bytes of the lane at the start of a segment of a group of ``ranks``: the sleeping word and
    the big ops' words (64), two slots (64-byte head, payload), then a rank's single-copy words
    (``GroupShm.cma_words``: the address and size of its input in a single-copy op, and a reduce's
    address of its reduced slice), to the next page."""
    return (64 + 2 * (64 + lane_max(ranks)) + 64 + 4095) // 4096 * 4096


@dataclass
class GroupShm:
    """A group's agreed shared memory: every member's segment by group rank, mapped here.
    Where the smallest segment has room (``lane``), each starts with the latency lane
    (``LANE_BYTES``) and the two halves follow it."""

    segments: list[Segment]
    half: int  # bytes of one half of the smallest segment (64-byte aligned): one round's slot
    lane: bool = False
    bells: list[int] = field(default_factory=list)  # every member's doorbell fd (-1: none)
    spin_s: float = 0.0  # how long the lane spins before it waits for a doorbell
    views: list[np.ndarray] = field(default_factory=list)
    rounds: int = 0  # rounds ever run on this group: round c uses half c % 2 of every segment
    lane_ops: int = 0  # lane ops ever run on this group: op k uses lane slot k % 2
    lane_sleeps: int = 0  # lane waits that slept on the doorbell
    lane_lost: int = 0  # ... that the recheck timer woke with every flag already there (a lost ring)
    # the lane's words and payloads of every member: sleeping[q], heads[q][s] (flag, digest,
    # nbytes), bodies[q][s]
    sleeping: list[np.ndarray] = field(default_factory=list)
    heads: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    bodies: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # ... phases[q]: a big op's step word (the halves' doorbell); current[q]: the op rank q is
    # in (digest, its number in the line + 1: a seqlock); checks[q][k % 2]: digest and size of its k-th big op
    phases: list[np.ndarray] = field(default_factory=list)
    current: list[np.ndarray] = field(default_factory=list)
    checks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    big_ops: int = 0  # big ops (phases) ever run on this group
    owner: Any = None  # the SharedMemory whose doorbell this rank sleeps on
    # single-copy reads (aiodist.shm._cma): every rank can read every member's memory (agreed),
    # the members' pids, and cma_words[q]: the address and size of rank q's input of a big op
    # (and, in a reduce, where its reduced slice is)
    cma: bool = False
    pids: list[int] = field(default_factory=list)
    cma_words: list[np.ndarray] = field(default_factory=list)
    cma_ops: int = 0  # ops that took the single-copy path
    # scratch that peers read by address, of single-copy ops that failed: kept until the group
    # goes, as a peer may still be reading it (aiodist.shm._algorithms._held)
    parked: list[np.ndarray] = field(default_factory=list)
    me: int = 0  # this rank's group rank
    # the in-call path (aiodist.shm._lane.post / collect): every member's lane words as a
    # memoryview of int64 (an item read or written is a Python int, several times cheaper than
    # a numpy element), the other members' group ranks, and typed views of the slots' payloads
    words: list[memoryview] = field(default_factory=list)
    others: tuple[int, ...] = ()
    typed: dict[tuple[int, np.dtype[Any], int], list[np.ndarray]] = field(default_factory=dict)
    #: indices into ``words[q]`` of each lane slot's head (flag, then digest and nbytes)
    head: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        slot = 64 + lane_max(len(self.segments))
        self.head = (64 // 8, (64 + slot) // 8)
        base = lane_bytes(len(self.segments)) if self.lane else 0
        whole = [s.view for s in self.segments]
        self.views = [v[base:] for v in whole]  # type: ignore[index]
        if self.lane:
            for v in whole:
                assert v is not None
                self.sleeping.append(v[:8].view(np.int64))
                self.phases.append(v[8:16].view(np.int64))
                self.current.append(v[16:32].view(np.int64))
                self.checks.append((v[32:48].view(np.int64), v[48:64].view(np.int64)))
                at = (64, 64 + slot)
                self.heads.append((v[at[0] : at[0] + 24].view(np.int64), v[at[1] : at[1] + 24].view(np.int64)))
                self.bodies.append((v[at[0] + 64 : at[0] + slot], v[at[1] + 64 : at[1] + slot]))
                cma = 64 + 2 * slot
                self.cma_words.append(v[cma : cma + 24].view(np.int64))
                self.words.append(memoryview(v[: 64 + slot + 64]).cast("q"))  # type: ignore[arg-type]
        self.others = tuple(q for q in range(len(self.segments)) if q != self.me)

    def typed_slots(self, s: int, dtype: np.dtype[Any], count: int) -> list[np.ndarray]:
        """Every member's payload of lane slot ``s`` as ``count`` items of ``dtype`` (made once
        per slot, dtype and count, and kept: a training loop repeats a few shapes)."""
        key = (s, dtype, count)
        got = self.typed.get(key)
        if got is None:
            n = dtype.itemsize * count
            got = [b[s][:n].view(dtype) for b in self.bodies]
            if len(self.typed) < 64:
                self.typed[key] = got
        return got

    def fits_lane(self, nbytes: int) -> bool:
        """Whether a rank's ``nbytes`` fit the group's lane (the same answer on every rank)."""
        return self.lane and 0 <= nbytes <= self.bodies[0][0].size

    def slots(self) -> list[np.ndarray]:
        """The next round's slot (a half) of every member's segment, in group-rank order."""
        h = self.rounds % 2
        self.rounds += 1
        return [v[h * self.half : (h + 1) * self.half] for v in self.views]


class _Turns:
    """Tickets and turns of one group's shared-memory ops (issue order)."""

    __slots__ = ("issued", "serving", "released", "waiters", "state", "known")

    def __init__(self) -> None:
        self.issued = 0
        self.serving = 0  # the ticket whose turn it is
        self.released: set[int] = set()  # tickets passed on before their turn came (their op failed)
        self.waiters: dict[int, asyncio.Future[None]] = {}
        self.state: GroupShm | None = None
        self.known = False  # the agreement was made (state None then means: the socket path)

    def release(self, n: int) -> None:
        self.released.add(n)
        while self.serving in self.released:
            self.released.discard(self.serving)
            self.serving += 1
        w = self.waiters.get(self.serving)
        if w is not None and not w.done():
            w.set_result(None)


class Ticket:
    """One op's place in its group's line for shared memory."""

    __slots__ = ("_shm", "_turns", "_n", "_key", "_done")

    def __init__(self, shm: SharedMemory, turns: _Turns, key: tuple[int, tuple[int, ...]]) -> None:
        self._shm = shm
        self._turns = turns
        self._key = key
        self._n = turns.issued
        turns.issued += 1
        self._done = False

    def release(self, *_: Any) -> None:
        """Pass the turn on (idempotent; also a Work's done callback)."""
        if not self._done:
            self._done = True
            self._turns.release(self._n)

    async def acquire(self, link: OpLink) -> GroupShm | None:
        """Wait for this op's turn; the group's shared memory, or None for the socket path (then
        the turn is already passed on)."""
        t = self._turns
        if t.serving != self._n:
            w = t.waiters[self._n] = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                t.waiters.pop(self._n, None)
        if not t.known:
            t.state = await self._shm.agree(self._key, link)
            t.known = True
        if t.state is None:
            self.release()
        return t.state


class SharedMemory:
    """One rank's shared memory for its same-host peers (see the module docstring)."""

    def __init__(self, store: Store, rank: int, token: bytes, size: int, off: str | None) -> None:
        self.store = store
        self.rank = rank
        self.token = token
        self.size = size
        self.off = off  # why this rank cannot use shared memory, or None
        self.server: FdServer | None = None
        self._own: dict[int, Segment] = {}  # group id -> this rank's segment for it
        self._sizes: dict[int, int] = {}  # group id -> its number of ranks (the lane's size), from its first ticket
        self._mapped: dict[int, list[Segment]] = {}  # group id -> the peers' segments mapped here
        # group id -> done once this rank has an op of it in line (a peer's fetch waits for it)
        self._arrived: dict[int, asyncio.Future[None]] = {}
        self._done_with: set[int] = set()  # groups destroyed or on the socket path: no segment for them
        self._released: collections.deque[int] = collections.deque()  # the destroyed ones among them, oldest first
        self._turns: dict[tuple[int, tuple[int, ...]], _Turns] = {}
        self._records: dict[int, dict[str, Any]] = {}
        self._host_id = ""
        self._closed = False
        self.spin_s = 0.0  # a lane wait's spin (spin_seconds), read once at start
        self.bell = -1  # this rank's doorbell (an eventfd; aiodist.shm._lane), -1 where off
        self.cma: dict[str, Any] | None = None  # this process's single-copy probe (aiodist.shm._cma), None where off
        self._bell_waiters: list[asyncio.Future[bool]] = []

    @classmethod
    async def start(cls, store: Store, rank: int, token: bytes, host_id: str) -> SharedMemory:
        """Start the fd server and publish this rank's record (or why it is off, said at INFO)."""
        size = segment_bytes()
        spin = spin_seconds()  # a malformed value is refused here, as AIODIST_SHM_BYTES is
        cma = _cma.enabled()  # and AIODIST_SHM_CMA
        off = None if size else f"{ENV_BYTES}=0"
        if off is None and not hasattr(os, "memfd_create"):
            off = "os.memfd_create is not available on this platform"
        self = cls(store, rank, token, size, off)
        self.spin_s = spin
        self._host_id = host_id
        if off is None:
            try:
                if _TSO and hasattr(os, "eventfd"):
                    self.bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    asyncio.get_running_loop().add_reader(self.bell, self._rung)
                self.server = FdServer(token, rank, self._segment_for, self.bell)
                self.server.start()
            except OSError as exc:
                self.off = f"no fd server socket ({exc})"
                self._close_bell()
        if self.off is not None:
            log.info("rank %d: shared memory off (%s): same-host peers use the socket", rank, self.off)
            record: dict[str, Any] = {"off": self.off, "host_id": host_id}
        else:
            assert self.server is not None
            record = {"name": self.server.name.encode().hex(), "host_id": host_id, "pid": os.getpid()}
            self.cma = _cma.record() if cma and self.bell >= 0 else None  # (single copy needs the lane's words)
            if self.cma is not None:
                record["cma"] = self.cma
        try:
            await store.set(f"{_KEY}{rank}", json.dumps(record))
        except BaseException:  # nobody else holds it yet: its server must not outlive this call
            await self.close()
            raise
        return self

    def _rung(self) -> None:
        """The doorbell's reader: wake every lane wait (each checks its own flags)."""
        try:
            os.eventfd_read(self.bell)
        except (BlockingIOError, OSError):
            pass
        waiters, self._bell_waiters = self._bell_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(True)

    async def doorbell(self, at_most: float) -> bool:
        """Wait until this rank's doorbell rings (True) or ``at_most`` seconds pass (False)."""
        loop = asyncio.get_running_loop()
        w: asyncio.Future[bool] = loop.create_future()
        self._bell_waiters.append(w)
        h = loop.call_later(at_most, _wake, w, False)
        try:
            return await w
        finally:
            h.cancel()

    def _close_bell(self) -> None:
        if self.bell >= 0:
            try:
                asyncio.get_running_loop().remove_reader(self.bell)
            except RuntimeError:  # no running loop (closed from elsewhere): the fd goes all the same
                pass
            os.close(self.bell)
            self.bell = -1
        for w in self._bell_waiters:
            if not w.done():
                w.set_result(True)
        self._bell_waiters = []

    def ticket(self, group_id: int, ranks: Sequence[int]) -> Ticket | None:
        """A place in line for a shared-memory op of this group, or None where the group is
        known to use the socket path (or has one rank). Call in the op's issuing step."""
        if len(ranks) < 2 or self._closed or group_id in self._done_with:
            return None
        key = (group_id, tuple(ranks))
        turns = self._turns.get(key)
        if turns is None:
            turns = self._turns[key] = _Turns()
            self._sizes[group_id] = len(ranks)
            arrived = self._arrival(group_id)
            if not arrived.done():
                arrived.set_result(None)
        elif turns.known and turns.state is None:
            return None
        return Ticket(self, turns, key)

    def line(self, group_id: int, ranks: Sequence[int]) -> _Turns | None:
        """The group's line, where an op of it took a ticket before (None: not yet)."""
        return self._turns.get((group_id, tuple(ranks)))

    def _arrival(self, group_id: int) -> asyncio.Future[None]:
        fut = self._arrived.get(group_id)
        if fut is None:
            fut = self._arrived[group_id] = asyncio.get_running_loop().create_future()
        return fut

    def _usable(self, group_id: int) -> bool:
        return self.off is None and not self._closed and group_id not in self._done_with

    def _own_segment(self, group_id: int) -> Segment:
        seg = self._own.get(group_id)
        if seg is None:
            # the latency lane comes on top of AIODIST_SHM_BYTES: the halves keep their size
            # (a 16 MiB all_reduce is still one round of the default 32 MiB)
            extra = lane_bytes(self._sizes.get(group_id, 0)) if self.bell >= 0 else 0
            seg = self._own[group_id] = Segment.create(f"aiodist-shm-g{group_id}-r{self.rank}", self.size + extra)
        return seg

    async def _segment_for(self, group_id: int) -> Segment | None:
        """The fd server's question: this rank's segment for ``group_id``, made once this rank
        has an op of the group in line (a peer may ask first: then this waits for that, at most
        ``_SETUP_S``); None for a group it never reaches, has destroyed or sends down the socket."""
        if not self._usable(group_id):
            return None
        arrived = self._arrival(group_id)
        if not arrived.done():
            try:
                async with asyncio.timeout(_SETUP_S):
                    await asyncio.shield(arrived)
            except TimeoutError:
                if not arrived.done() and self._arrived.get(group_id) is arrived:
                    del self._arrived[group_id]  # a group id this rank never used: keep no future for it
                return None
        return self._own_segment(group_id) if self._usable(group_id) else None

    async def host_ids(self, world_size: int) -> list[str]:
        """Every rank's host identity, from the records every rank published at start (in the
        store before the transport's exchange ends: read after it, one round trip when all are
        there). A rank with no record (a peer that is not an aio backend) is a host of its own
        (``"?<rank>"``): never waited for, never taken for a neighbour."""
        wanted = {f"{_KEY}{r}": r for r in range(world_size) if r not in self._records and r != self.rank}
        keys = await present(self.store, list(wanted))
        if keys:
            for k, v in zip(keys, await self.store.multi_get(keys), strict=True):
                self._records[wanted[k]] = json.loads(v)
        return [
            self._host_id if r == self.rank else str(self._records[r].get("host_id", "")) if r in self._records else f"?{r}"
            for r in range(world_size)
        ]

    async def _record(self, rank: int) -> dict[str, Any]:
        rec = self._records.get(rank)
        if rec is None:
            rec = self._records[rank] = json.loads(await self.store.get(f"{_KEY}{rank}"))
        return rec

    async def _map_all(self, group_id: int, ranks: tuple[int, ...], link: OpLink) -> GroupShm:
        """Every member's segment for the group, mapped here (this rank's own made if need be)."""
        peers = [r for r in ranks if r != self.rank]
        # each a wait on that rank (its record is there once it has started: a rank that never
        # did is named by the op's timeout, as for a receive)
        recs = await asyncio.gather(*(_waited_on(link, ranks.index(r), self._record(r)) for r in peers))
        for r, rec in zip(peers, recs, strict=True):
            if "off" in rec:
                raise ValueError(f"rank {r} has it off ({rec['off']})")
            if rec.get("host_id") != self._host_id:
                raise ValueError(f"rank {r} is on another host")
        if not self._usable(group_id):
            raise ValueError(self.off or "closed")
        own = self._own_segment(group_id)
        fetched = await asyncio.gather(
            *(
                _waited_on(link, ranks.index(r), fetch(bytes.fromhex(rec["name"]).decode(), self.token, group_id))
                for r, rec in zip(peers, recs, strict=True)
            ),
            return_exceptions=True,
        )
        segs = [s for s in fetched if isinstance(s, Segment)]
        self._mapped.setdefault(group_id, []).extend(segs)
        errors = [e for e in fetched if not isinstance(e, Segment)]
        if errors:
            raise errors[0]
        it = iter(segs)
        by_rank = [own if r == self.rank else next(it) for r in ranks]
        smallest = min(s.size for s in by_rank)
        # the lane: where every segment has room for it and every peer has a doorbell (the
        # same for every rank: the same segments, the same records)
        lane_at = lane_bytes(len(ranks))
        lane = _TSO and self.bell >= 0 and smallest >= lane_at + _MIN_BYTES and all(s.bell >= 0 for s in segs)
        half = (smallest - (lane_at if lane else 0)) // 2 // _ALIGN * _ALIGN
        bells = [self.bell if r == self.rank else s.bell for r, s in zip(ranks, by_rank, strict=True)]
        pids = [os.getpid() if r == self.rank else recs[peers.index(r)].get("pid") for r in ranks]
        spin = self.spin_s if len(set(pids)) == len(ranks) else 0.0  # ranks sharing a process (and loop) never spin
        # single copy where this rank reads every peer's probe bytes (the vote makes it all or none)
        cma = lane and self.cma is not None and all(_cma.readable(rec.get("pid"), rec.get("cma")) for rec in recs)
        return GroupShm(
            by_rank, half, lane=lane, bells=bells, spin_s=spin, owner=self, cma=cma, pids=pids if cma else [], me=ranks.index(self.rank)
        )

    async def agree(self, key: tuple[int, tuple[int, ...]], link: OpLink) -> GroupShm | None:
        """Map the group's segments here and agree with its ranks whether all could; the group's
        shared memory, or None (the socket path, said once at INFO)."""
        group_id, ranks = key
        state: GroupShm | None = None
        why = self.off
        if why is None:
            try:
                async with asyncio.timeout(_SETUP_S):
                    state = await self._map_all(group_id, ranks, link)
            except Exception as exc:  # whatever went wrong, this rank votes (CancelledError goes through)
                why = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
                state = None
        vote = np.array([state is not None, state is not None and state.cma], np.uint8)
        # The vote goes without the op's digest: a desync (which the op's next messages, or its
        # lane's and phases' checks, still find at once) is then seen on a message of the op
        # itself, whose size lets the sentence name the peer's shape (a vote's 2 bytes tell nothing).
        digest = link.digest
        if digest:
            link.digest = 0
        try:
            await alg.all_reduce(SubP2P(link, _AGREE_SUB), vote, _min, thresholds=_LATENCY)
        except BaseException:
            self._drop(group_id)
            raise
        finally:
            if digest:
                link.digest = digest
        if vote[0] == 1:
            assert state is not None
            state.cma = bool(vote[1])
            log.debug("rank %d: group %d uses shared memory (%d ranks, %d-byte rounds)", self.rank, group_id, len(ranks), state.half)
            return state
        self._drop(group_id)  # every rank has voted: no peer fetches any of these any more
        if why is None:
            why = "another rank of the group could not (see its log)"
        if self.off is None:  # an off rank said so once, at start
            log.info("rank %d: group %d does not use shared memory (%s): its same-host peers use the socket", self.rank, group_id, why)
        return None

    def _drop(self, group_id: int) -> None:
        """Close the group's segments here (own and mapped) and serve it no more."""
        self._done_with.add(group_id)
        arrived = self._arrived.pop(group_id, None)
        if arrived is not None and not arrived.done():
            arrived.set_result(None)  # a fetch waiting on it finds the group done with
        own = self._own.pop(group_id, None)
        self._sizes.pop(group_id, None)
        for seg in [*self._mapped.pop(group_id, []), *([own] if own is not None else [])]:
            seg.close()

    def release_group(self, group_id: int) -> None:
        """The group is destroyed: its line goes (ops still waiting for their turn are
        cancelled) and its segments are closed here; its host part's too (``HOST_PART``), where it
        had one (a group on one host keeps no second entry among the refused ids)."""
        part = group_id | HOST_PART
        if part != group_id and (part in self._arrived or part in self._own or part in self._mapped):
            self.release_group(part)
        for key in [k for k in self._turns if k[0] == group_id]:
            _cancel(self._turns.pop(key))
        self._drop(group_id)
        # a destroyed group's id is refused for the next _RELEASED_KEPT destroys (a peer's late
        # fetch for it finds it done with), then forgotten: group churn keeps no memory per group
        self._released.append(group_id)
        if len(self._released) > _RELEASED_KEPT:
            self._done_with.discard(self._released.popleft())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._turns.values():
            _cancel(t)
        if self.server is not None:
            await self.server.close()
        for group_id in {*self._own, *self._mapped, *self._arrived}:
            self._drop(group_id)
        self._close_bell()

    def stats(self) -> dict[str, Any]:
        return {
            "off": self.off,
            "segment_bytes": self.size,
            "groups": sorted(k[0] for k, t in self._turns.items() if t.state is not None),
            "lane_groups": sorted(k[0] for k, t in self._turns.items() if t.state is not None and t.state.lane),
            "lane_ops": sum(t.state.lane_ops for t in self._turns.values() if t.state is not None),
            "lane_sleeps": sum(t.state.lane_sleeps for t in self._turns.values() if t.state is not None),
            "lane_lost_wakeups": sum(t.state.lane_lost for t in self._turns.values() if t.state is not None),
            "cma": self.cma is not None,
            "cma_groups": sorted(k[0] for k, t in self._turns.items() if t.state is not None and t.state.cma),
            "cma_ops": sum(t.state.cma_ops for t in self._turns.values() if t.state is not None),
            "own_segments": len(self._own),
            "mapped_segments": sum(len(m) for m in self._mapped.values()),
        }


def _cancel(t: _Turns) -> None:
    t.state = None
    for w in t.waiters.values():
        if not w.done():
            w.cancel()


_WATCH_S = 0.01  # a wait on a peer outside the transport (a fetch) looks at the transport this often


async def _waited_on(link: OpLink, peer: int, aw: Awaitable[Any]) -> Any:
    """Await ``aw``, a wait on group rank ``peer`` (a fetch its fd server answers once that rank
    has the op in line), as a receive from it would: counted in the op's tracker
    (``OpLink.wait_on``: a timeout names the rank that never came), and failed with the
    transport's error once that peer dies or the group is aborted (checked every ``_WATCH_S``)."""
    link.wait_on((peer,))
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=_WATCH_S)
            if done:
                got = task.result()
                break
            link.check_peer(peer)
    except (asyncio.CancelledError, TimeoutError):
        raise  # still counted: the timeout message reads what was pending when it fired
    except BaseException:
        link.waited_on((peer,), heard=False)
        raise
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(retrieve)
    link.waited_on((peer,), heard=False)
    return got


def retrieve(t: asyncio.Future[Any]) -> None:
    """A done callback: read the outcome of a future nobody awaits (no "never retrieved" log)."""
    if not t.cancelled():
        t.exception()


def _wake(w: asyncio.Future[bool], value: bool) -> None:
    if not w.done():
        w.set_result(value)


def _min(dst: np.ndarray, src: np.ndarray) -> None:
    np.minimum(dst, src, out=dst)
