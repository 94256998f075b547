"""The op runner: how a ``ProcessGroup`` runs one op under its deadline, explains a timeout with
the culprit first, and breaks the group when an op fails.

Rules:
- One deadline per op (``aiodist._time.Deadline``). A ``TimeoutError`` is the group's timeout
  only when that deadline fired; one raised inside the op's body (user code, a store's or a
  backend's own deadline) fails the op as what it is.
- With a store, an op keeps the last part of its time (10 %, at least 50 ms, at most 5 s) to
  consult it on a timeout (``aiodist.c10d._diagnosis``: the rank writes what it is doing and
  whom it waits on, reads what the ranks it waits on wrote, and the message's first clause
  names the culprit and what it did). The error itself comes at the op's timeout, not before:
  what the consultation left of the grace is waited out (torch's tests check that a timeout is
  not raised early).
- Any failure of an op breaks its group (``ProcessGroup.break_group``): the group's other
  pending ops fail, later ops are refused, and the peers are told.
- The runner reaches the group only through ``OpGroup`` (below), a Protocol c10d's
  ``ProcessGroup`` keeps: this module imports nothing of c10d's groups or World.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aiodist._instrument.recorder import Entry, FlightRecorder, dump_dir_on_timeout
from aiodist._message import GO_TAG
from aiodist._time import Clock, Deadline
from aiodist.algorithms.p2p import P2P
from aiodist.c10d._diagnosis import (
    DETAIL_HINT,
    LATE_S,
    Note,
    Report,
    consult,
    culprits_of,
    did_not_run,
    explain,
    grace_for,
    note_only,
)
from aiodist.errors import DistBackendError, DistError, DistTimeoutError
from aiodist.shm._link import OpLink, op_link

if TYPE_CHECKING:
    from aiodist.backends.base import CommBackend
    from aiodist.c10d.work import Work
    from aiodist.store.base import Store

__all__ = ["Tracker", "TrackedP2P", "DeviceTracker", "PeerOps", "OpGroup", "run"]

log = logging.getLogger("aiodist.c10d")


class OpGroup(Protocol):
    """What the runner asks of the group whose op it runs: c10d's ``ProcessGroup`` keeps it
    (mypy checks that where the group calls ``run``). It reads the group's identity, rules and
    recorder, keeps its clock and counters (``clock``, ``ran``, ``completed``), and breaks it
    (``break_group``) or dumps its World's recorders through it."""

    backend: CommBackend
    ranks: tuple[int, ...]
    group_id: int
    group_desc: str
    timeout_s: float
    store: Store | None
    detail: bool
    recorder: FlightRecorder
    broken: str | None
    clock: Clock | None
    ran: float
    completed: int

    def rank(self) -> int: ...
    def describe(self) -> str: ...
    def break_group(
        self, reason: str, cause: BaseException | None = None, *, tell_peers: bool = True, abort_devices: bool = True
    ) -> None: ...
    def dump_recorders(self, directory: str) -> None: ...


class Tracker(Protocol):
    """What the runner asks of the object an op's body runs on: a CPU collective's
    ``TrackedP2P``, a point-to-point op's ``PeerOps``, a device op's ``DeviceTracker``."""

    #: whether a timeout follows the waits through the store: true where the op's seq names the
    #: same op on every rank (collectives), false for point-to-point (each rank's own numbering)
    diagnose: bool

    def silent(self) -> list[int]:
        """The global ranks a receive of this op is still waiting on."""
        ...

    def peers(self) -> list[int]:
        """Every global rank this op still waits on, either way."""
        ...

    def heard(self) -> dict[int, float]:
        """Global rank -> when (``time.time()``) a message of this op last came from it."""
        ...

    def describe_waiting(self) -> str:
        """The timeout message's part on whom this op waits (``"; ranks not heard from: [1]"``),
        empty when it waits on nobody."""
        ...


class TrackedP2P:
    """A collective's P2P that remembers which peers it is still waiting on, and when it last
    heard from each (for the timeout message). Plain dicts, not Counters: this is on every
    message's path. It is the op's ``OpLink`` (aiodist.shm._link) for shared memory, whose
    waits it counts with its receives'; the rest of that contract is its channel's."""

    diagnose = True
    __slots__ = ("inner", "ranks", "rank", "size", "waiting_recv", "waiting_send", "_heard", "_link")

    def __init__(self, inner: P2P, ranks: Sequence[int], rank: int | None = None) -> None:
        self.inner = inner
        self.ranks = ranks
        self.rank = inner.rank if rank is None else rank
        self.size = len(ranks) if rank is not None else inner.size
        self.waiting_recv: dict[int, int] = {}
        self.waiting_send: dict[int, int] = {}
        self._heard: dict[int, float] = {}
        self._link: OpLink | None = None  # the channel's OpLink, once shared memory asks

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        counter = self.waiting_send
        counter[peer] = counter.get(peer, 0) + 1
        try:
            await self.inner.send(peer, buf, tag)
        except (asyncio.CancelledError, TimeoutError):
            raise  # still counted: the timeout message reads what was pending when it fired
        except BaseException:
            counter[peer] -= 1
            raise
        counter[peer] -= 1

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        counter = self.waiting_recv
        counter[peer] = counter.get(peer, 0) + 1
        try:
            await self.inner.recv(peer, buf, tag)
        except (asyncio.CancelledError, TimeoutError):
            raise  # still counted (as above)
        except BaseException:
            counter[peer] -= 1
            raise
        counter[peer] -= 1
        self._heard[peer] = time.time()

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        sent = self.inner.send_nowait(peer, buf, tag)
        if sent is not True and sent is not False and not sent.done():  # written, still draining: a wait on the peer
            counter = self.waiting_send
            counter[peer] = counter.get(peer, 0) + 1
            sent.add_done_callback(lambda _: counter.__setitem__(peer, counter[peer] - 1))
        return sent

    # -- the OpLink side (aiodist.shm._link): the waits here, the rest the channel's ----------

    def wait_on(self, peers: Iterable[int]) -> None:
        counter = self.waiting_recv
        for q in peers:
            counter[q] = counter.get(q, 0) + 1

    def waited_on(self, peers: Iterable[int], heard: bool) -> None:
        counter = self.waiting_recv
        now = time.time() if heard else 0.0
        for q in peers:
            counter[q] -= 1
            if heard:
                self._heard[q] = now

    def _channel(self) -> OpLink:
        link = self._link
        if link is None:
            link = self._link = op_link(self.inner)
        return link

    @property
    def group_id(self) -> int:
        return self._channel().group_id

    @property
    def seq(self) -> int:
        return self._channel().seq

    @property
    def line_seq(self) -> int:
        return self._channel().line_seq

    @property
    def digest(self) -> int:
        return self._channel().digest

    @digest.setter
    def digest(self, value: int) -> None:
        self._channel().digest = value

    @property
    def op_name(self) -> str | None:
        return self._channel().op_name

    def check_peer(self, peer: int) -> None:
        self._channel().check_peer(peer)

    def abort_group(self, reason: str) -> DistBackendError:
        return self._channel().abort_group(reason)

    def desync(self, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        return self._channel().desync(peer, theirs, nbytes)

    # -- what the runner reads -----------------------------------------------------------------

    def silent(self) -> list[int]:
        return sorted(self.ranks[p] for p, n in self.waiting_recv.items() if n > 0)

    def unsent(self) -> list[int]:
        """The global ranks a send of this op was still waiting on."""
        return sorted(self.ranks[p] for p, n in self.waiting_send.items() if n > 0)

    def peers(self) -> list[int]:
        return sorted({*self.silent(), *self.unsent()})

    def heard(self) -> dict[int, float]:
        return {self.ranks[p]: t for p, t in self._heard.items()}

    def describe_waiting(self) -> str:
        out = ""
        silent = self.silent()
        unsent = self.unsent()
        if silent:
            out += f"; ranks not heard from: {silent}"
        if unsent:
            out += f"; ranks not taking delivery: {unsent}"
        return out


class DeviceTracker:
    """A device op's tracker: the device library does not say which peer it waits on, so a
    timed-out collective reports waiting on every other rank and lets the store find the ranks
    that never reached the op."""

    def __init__(self, pg: OpGroup, waiting: Callable[[], str] | None, *, diagnose: bool) -> None:
        self._pg = pg
        self._waiting = waiting
        self.diagnose = diagnose

    def silent(self) -> list[int]:
        me = self._pg.backend.rank
        return [r for r in self._pg.ranks if r != me]

    def peers(self) -> list[int]:
        return self.silent()

    def heard(self) -> dict[int, float]:
        return {}

    def describe_waiting(self) -> str:
        return self._waiting() if self._waiting is not None else "; the device op had not completed"


# -- running an op ---------------------------------------------------------------------------------


_GO_OUT = np.zeros(1, np.uint8)  # the leader's go (idle_until_leader): one byte, never written
_GO_IN = np.empty(1, np.uint8)  # where the others read it (its value is not looked at)
_GRACE: dict[float, float] = {}  # limit -> grace_for(limit): a group's ops share one limit


async def run(
    pg: OpGroup,
    op: str,
    label: str,
    tracker: Tracker,
    body: Callable[[Any], Coroutine[Any, Any, None]],
    work: Work,
    limit: float,
    entry: Entry | None = None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    idle: int | None = None,
) -> None:
    """Run one op of ``pg`` to its end, in the task ``_launch`` made for it (on ``loop``):
    complete ``work``, or fail it (and break the group).

    ``idle`` (a collective of a group that idles until its leader, ``idle_until_leader``) is the
    leader's group rank: the leader sends every other rank a go before the op's body; the others
    wait for it first, with no deadline (the recorder says "idle"), and their deadline starts
    when it arrives. A lost leader still fails the wait at once (its connection).

    The op's deadline is an ``aiodist._time.Deadline`` on the group's clock, armed without a
    block (its constructor, then ``end``): its cancellation is a timeout only when no other came
    after the op started (asyncio.timeout's uncancel rule)."""
    since = pg.recorder.started(entry) if entry is not None else time.time()
    if loop is None:
        loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # (an op runs in its own task)
    cell = [task]
    cancelling = task.cancelling()
    pg.ran = time.perf_counter()
    grace = 0.0
    if pg.store is not None:
        grace = _GRACE.get(limit, -1.0)
        if grace < 0:
            grace = grace_for(limit)
            if len(_GRACE) < 64:
                _GRACE[limit] = grace
    clock = pg.clock
    if clock is None or clock.loop is not loop:
        clock = pg.clock = Clock(loop)
    deadline: Deadline | None = None
    try:
        try:
            if idle is not None and idle != pg.rank():  # idle until the leader's go: no deadline yet
                assert isinstance(tracker, TrackedP2P)  # (a collective's)
                if entry is not None:
                    pg.recorder.idle(entry)
                await tracker.recv(idle, _GO_IN, GO_TAG)  # (a P2P's peers are group ranks)
                if entry is not None:
                    pg.recorder.started(entry)
            deadline = Deadline(limit - grace, clock, cell, cancelling)
            if idle == pg.rank():
                assert isinstance(tracker, TrackedP2P)
                for q in range(len(pg.ranks)):
                    if q != idle:
                        await tracker.send(q, _GO_OUT, GO_TAG)
            await body(tracker)
        except BaseException as exc:
            if deadline is not None and deadline.end(exc):
                raise TimeoutError from exc
            raise
        deadline.end(None)  # (it may have fired, and the body completed anyway)
    except asyncio.CancelledError:
        work._fail(
            DistBackendError(
                f"{op} on {pg.describe()}, {label} was aborted: {pg.broken or 'the group was torn down'}",
                op=op,
                group=pg.group_desc,
                seq=work.seq,
                rank=pg.backend.rank,
            )
        )
        raise
    except Exception as exc:
        what = f"{op} on {pg.describe()}, {label}"
        if deadline is not None and deadline.fired:
            # how late the timer ran, not how long the cancelled body then took to unwind
            await _timed_out(pg, op, label, what, tracker, work, limit, grace, entry, since, deadline.late, end=deadline.due + grace)
        else:  # the body's own failure, a TimeoutError of its own included
            _failed(pg, op, label, what, work, exc)
        return
    finally:  # every way out: the Work is failed by now, or the op completed (just below)
        if entry is not None:
            pg.recorder.ended(entry, work)
    pg.completed += 1
    work._complete()


def _dump_on_timeout(pg: OpGroup) -> None:
    """``AIODIST_FR_DUMP_ON_TIMEOUT=1``: this rank's flight recorders (every group of the op's
    World) to the dump directory (the group hands its World's groups to the instrumentation)."""
    directory = dump_dir_on_timeout()
    if directory is not None:
        pg.dump_recorders(directory)


async def _timed_out(
    pg: OpGroup,
    op: str,
    label: str,
    what: str,
    tracker: Tracker,
    work: Work,
    limit: float,
    grace: float,
    entry: Entry | None,
    since: float,
    late: float = 0.0,
    *,
    end: float = 0.0,
) -> None:
    """Explain the timeout (with the store, in the grace), then fail the op and break the group
    at ``end`` (the loop time the op's whole limit ends), or at once if that has passed."""
    me = pg.backend.rank
    # " timeout " as a word of its own: torch's tests match ``" (Timed out|closed|timeout) "``,
    # and a message that has the word keeps its culprit-first headline (no ``Timeout: `` prefix)
    whose = "the group" if limit == pg.timeout_s else "the call"
    msg = f"{what} timed out after {limit:g} s on rank {me} (the timeout of {whose})"
    waiting = tracker.describe_waiting()
    msg += waiting or "; it was not waiting on any peer (the group was still running it)"
    if waiting:
        msg += pg.backend.connection_report(tracker.peers())
    explained = False  # explain() leads with this rank's own stop, when it did not run
    blamed = {r: f"not heard from in {op} seq {work.seq}" for r in tracker.silent()}
    if pg.store is not None and grace > 0:
        note = Note(pg.group_id, label, op, time.time(), work.seq if tracker.diagnose else None)
        if tracker.diagnose and len(pg.ranks) > 1:
            mine = Report(op, tuple(tracker.silent()), tracker.heard())
            found = await consult(pg.store, pg.group_id, work.seq, me, mine, note, grace, since=since)
            headline, tail, hint = explain(me, op, work.seq, pg.group_id, found, since=since, now=time.time(), grace=grace, late=late)
            blamed = culprits_of(me, op, work.seq, found) or blamed
            explained = True
            if headline:
                msg = f"{headline}; {msg}"
            msg += tail
            if hint and not pg.detail:
                msg += DETAIL_HINT
        else:
            await note_only(pg.store, me, note, grace)
    if late >= LATE_S and not explained:  # no store to consult, or point-to-point
        msg = f"{did_not_run(me, late)}; {msg}"
    err = DistTimeoutError(msg, op=op, group=pg.group_desc, seq=work.seq, rank=me, culprits=blamed)
    rest = end - asyncio.get_running_loop().time()
    if rest > 0:  # the consultation ended early: the op still fails at its timeout, not before
        try:
            await asyncio.sleep(rest)
        except asyncio.CancelledError:  # torn down meanwhile: the op still fails, with this message
            pg.break_group(msg, err)
            work._fail(err)
            raise
    if entry is not None:
        pg.recorder.timed_out(entry, msg)
    try:
        _dump_on_timeout(pg)  # AIODIST_FR_DUMP_ON_TIMEOUT=1
    except OSError as dump_err:
        log.warning("rank %d: could not dump the flight recorder: %s", me, dump_err)
    # the peers are told first: the abort's task is queued before this Work's waiter wakes, so a
    # rank that exits on the error (os._exit) still sends the ABORT that names the real cause
    pg.break_group(msg, err)
    work._fail(err)


def _failed(pg: OpGroup, op: str, label: str, what: str, work: Work, exc: Exception) -> None:
    """The op's body raised: a DistError keeps its type, with the op, group and seq in front;
    anything else is wrapped in a DistBackendError naming it."""
    named: DistError
    if isinstance(exc, DistError):
        try:
            named = type(exc)(f"{what} failed on rank {pg.backend.rank}: {exc}")
        except Exception:  # pragma: no cover - a subclass with another constructor
            named = exc
    else:
        named = DistBackendError(f"{what} failed on rank {pg.backend.rank}: {type(exc).__name__}: {exc}")
    named.with_facts(op=op, group=pg.group_desc, seq=work.seq, rank=pg.backend.rank, culprits=getattr(exc, "culprits", None))
    if named is not exc:
        if isinstance(exc, DistError):
            # its sentence is in named's: the user reads it once, without the internal frames
            # that raised it (they go to the DEBUG log and the flight recorder)
            log.debug("rank %d: %s: the failure inside the op", pg.backend.rank, what, exc_info=exc)
            named.__suppress_context__ = True
        else:  # not one of ours: its traceback says where
            named.__cause__ = exc
    pg.break_group(f"{op} {label} failed: {exc}", named)  # first: see _timed_out
    work._fail(named)


class PeerOps:
    """What a point-to-point op's body uses: the backend's p2p calls on global ranks, counting
    what is pending so a timeout can name the ranks not heard from (a ``Tracker``,
    aiodist.c10d._runner)."""

    diagnose = False  # p2p numbering is each rank's own: there is no seq to compare through the store

    def __init__(self, backend: CommBackend, group_id: int, ranks: Sequence[int]) -> None:
        self.backend = backend
        self.group_id = group_id
        self.ranks = tuple(ranks)
        self.waiting_recv: Counter[int | None] = Counter()
        self.waiting_send: Counter[int] = Counter()

    async def send(self, dst: int, b: np.ndarray, tag: int) -> None:
        self.waiting_send[dst] += 1
        await self.backend.p2p_send(self.group_id, dst, b, tag)
        self.waiting_send[dst] -= 1

    async def recv(self, src: int | None, b: np.ndarray, tag: int) -> int:
        self.waiting_recv[src] += 1
        got = await self.backend.p2p_recv(self.group_id, src, b, tag)
        self.waiting_recv[src] -= 1
        if src is None and got not in self.ranks:
            raise ValueError(f"an any-source receive got a message from rank {got}, which is not in the group {list(self.ranks)}")
        return got

    def silent(self) -> list[int]:
        """The global ranks a receive of this op waits on (any source: every other rank)."""
        out = {r for r, n in self.waiting_recv.items() if n > 0 and r is not None}
        if self.waiting_recv.get(None):
            out |= {r for r in self.ranks if r != self.backend.rank}
        return sorted(out)

    def heard(self) -> dict[int, float]:
        return {}  # not asked for: a p2p op's timeout does not follow waits through the store

    def peers(self) -> list[int]:
        """The global ranks this op still waits on (any source: every other rank)."""
        out = {r for r, n in self.waiting_recv.items() if n > 0 and r is not None} | {r for r, n in self.waiting_send.items() if n > 0}
        if self.waiting_recv.get(None):
            out |= set(self.ranks)
        return sorted(out)

    def describe_waiting(self) -> str:
        """The timeout message's tail: whom this op was still waiting on."""
        out = ""
        silent = sorted(r for r, n in self.waiting_recv.items() if n > 0 and r is not None)
        if self.waiting_recv.get(None):
            out += f"; ranks not heard from: any of {[r for r in self.ranks if r != self.backend.rank] or list(self.ranks)} (a receive from any source)"
        elif silent:
            out += f"; ranks not heard from: {silent}"
        unsent = sorted(r for r, n in self.waiting_send.items() if n > 0)
        if unsent:
            out += f"; ranks not taking delivery: {unsent}"
        return out
