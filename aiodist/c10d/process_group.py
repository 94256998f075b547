"""``ProcessGroup``: a set of global ranks, a sequence counter, a timeout, and the backend's
channel factory; it issues ops and owns the tasks that run them.

Rules:
- ``issue`` is synchronous: it takes the next sequence number and opens the op's channel, so an
  API coroutine that validates and then issues does both in its first step, before any
  suspension point. Ops of one group run concurrently (each on its own channel).
- An op runs as a task owned by the group: cancelling whoever awaits it leaves it running.
- An op that does not finish within the group's timeout fails with ``DistTimeoutError`` naming
  the culprit first (found through the store), then the op, the group, its sequence number, and
  the ranks this rank was still waiting on (the runner, ``aiodist.c10d._runner``). Any
  failure of an op breaks the group: its other pending ops fail, new ops are refused with the
  reason, and the backend is asked to tell the peers (``CommBackend.abort_group``), so their
  pending ops on the group fail now rather than at their own timeouts. Destroying (or
  ``abort()``-ing) a group fails its pending ops on this rank only: peers are not told, since a
  rank may destroy a group while a peer still receives what it sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiodist._digest import op_digest
from aiodist._instrument.levels import DebugLevel, get_debug_level
from aiodist._instrument.recorder import Entry, FlightRecorder, _freeze, dump_groups
from aiodist._time import Clock
from aiodist.algorithms.collectives import together
from aiodist.algorithms.p2p import P2P
from aiodist.algorithms.thresholds import Thresholds, current
from aiodist.backends.base import CommBackend, ProcessGroupLike
from aiodist.c10d._runner import DeviceTracker, PeerOps, Tracker, run
from aiodist.c10d._runner import TrackedP2P as _Tracked
from aiodist.c10d.work import Work
from aiodist.errors import DistBackendError
from aiodist.knobs import value
from aiodist.store.base import Store

#: ops done in their issuing calls (``issue_now``) let the loop run at least this often: where
#: no op of the group let it run within this many seconds, a call's await lets it run once
#: (aiodist.c10d.collectives ``_now``)
EAGER_S = 0.001


__all__ = ["ProcessGroup", "NOT_NOW"]

#: ``issue_now``'s answer where the op must take its route instead
NOT_NOW = object()

log = logging.getLogger("aiodist.c10d")
_TELL_AT_TEARDOWN_S = 0.2  # shutdown: how long a pending 'tell the peers' may still dial

Body = Callable[[P2P], Coroutine[Any, Any, None]]


#: set by a stager around the issue of a CPU op on host copies of device arrays: an object with
#: ``async copy_in()`` (the host copies are ready) and ``async copy_out()`` (results written back)
_STAGING: contextvars.ContextVar[Any] = contextvars.ContextVar("aiodist_staging", default=None)


def _staged_body(staging: Any, body: Body) -> Body:
    async def staged(p2p: P2P) -> None:
        await staging.copy_in()
        await body(p2p)
        await staging.copy_out()

    return staged


def _checked_body(pg: ProcessGroup, op: str, seq: int, meta: dict[str, Any] | None, body: Body) -> Body:
    """DETAIL: the op's body, preceded by a comparison of the call across the group's ranks."""
    from aiodist._instrument.desync import check_fingerprint

    async def checked(p2p: P2P) -> None:
        await check_fingerprint(p2p, pg, op, seq, meta, together)
        await body(p2p)

    return checked


#: ``describe_call(op, meta)``: ``(meta, meta["same"], the flight recorder's frozen meta, the
#: op's desync digest)``. Made once per distinct call and kept by the collectives (calls repeat).
Described = tuple[dict[str, Any] | None, dict[str, Any] | None, tuple[Any, ...] | None, int]


def describe_call(op: str, meta: dict[str, Any] | None) -> Described:
    """What ``issue`` derives from an op's ``meta``, in one tuple that can be kept and reused
    (its parts are never changed once made)."""
    same = meta.get("same") if meta is not None else None
    return (meta, same, _freeze(meta), op_digest(op, same))


class ProcessGroup:
    """A group of ranks. Made by ``init_process_group`` / ``new_group``, never directly."""

    def __init__(
        self,
        backend: CommBackend,
        backend_name: str,
        group_id: int,
        global_ranks: Sequence[int],
        timeout_s: float,
        *,
        name: str = "",
        desc: str = "",
        store: Store | None = None,
        devices: dict[str, Any] | None = None,
        host_refusal: str | None = None,
        thresholds: Thresholds | None = None,
    ) -> None:
        self.backend = backend
        self.backend_name = backend_name
        # device type -> DeviceBackend (aiodist.backends.device), shared with the World; the
        # World's stagers serve device arrays the group has no backend for
        self.devices: dict[str, Any] = devices if devices is not None else {}
        # set when the World has no CPU backend ("nccl" alone): why CPU arrays are refused
        self.host_refusal = host_refusal
        self.group_id = group_id
        self.ranks: tuple[int, ...] = tuple(global_ranks)
        self._rank = self.ranks.index(backend.rank)
        self.timeout_s = timeout_s
        self.group_name = name or str(group_id)
        self.group_desc = desc or ("default_pg" if group_id == 0 else f"group {group_id}")
        self._described: tuple[str, str] | None = None
        self.recorder = FlightRecorder()
        #: the World's rank, size and groups, for a timeout's dump of every recorder (set by
        #: whoever makes the group in a World: c10d's init; None: this group alone)
        self.world_groups: Callable[[], tuple[int, int, list[Any]]] | None = None
        level = get_debug_level()
        self.detail = level >= DebugLevel.DETAIL  # read once: a group keeps the level it was made at
        # always-on desync detection: each collective's frames carry its digest (DETAIL checks more)
        # (AIODIST_DESYNC_DIGESTS=0 turns it off, for measuring its cost: python -m aiodist.bench debug)
        self._digests = backend.carries_digests and not self.detail and value("AIODIST_DESYNC_DIGESTS") != "0"
        # INFO: per-op-name tallies for the summary logged when the group ends (None at OFF: no cost)
        self._op_stats: dict[str, list[float]] | None = {} if level >= DebugLevel.INFO else None
        if level >= DebugLevel.INFO:
            log.info("rank %d: made %s, backend %s, timeout %g s", backend.rank, self.describe(), backend_name, timeout_s)
        # the group's rules (given: its pg_options), else the process's, read once per group;
        # the same on every rank (aiodist.algorithms.plan decides every op's path from them)
        self.thresholds: Thresholds = thresholds if thresholds is not None else current()
        self.seq = 0
        self.store: Store | None = store  # the World's store: used to explain a timeout
        self.splits = 0  # split_group calls on this group (part of the children's ids)
        self.shrinks = 0  # shrink_group calls on this group
        self.p2p_seq = 0  # point-to-point ops issued (their own numbering, apart from collectives')
        self.broken: str | None = None
        self._pending: dict[asyncio.Task[None], Work] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        # when an op of this group last let the loop run (time.perf_counter()): one that started
        # in a task, or a call done in its issuing call that let it run once (EAGER_S)
        self.ran = 0.0
        self.eager = 0  # ops done in their issuing call (issue_now)
        self.completed = 0
        # what the collectives' checks found for calls seen before, by call (aiodist.c10d.collectives)
        self.hot: dict[tuple[Any, ...], Any] = {}
        # one timer for the deadlines of this group's running ops (aiodist._time.Clock), made
        # by its first op on its loop
        self.clock: Clock | None = None
        # ops may take their in-call path (issue_now): not where DETAIL compares every call
        # first, nor where INFO tallies every op, nor where CPU arrays are refused
        self.quick = not self.detail and self._op_stats is None and host_refusal is None
        # the group rank whose ops the others idle for (idle_until_leader), or None
        self.idle_leader: int | None = None

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.describe()} rank {self._rank}/{len(self.ranks)}>"

    def describe(self) -> str:
        d = self._described
        if d is None or d[0] != self.group_desc:  # group_desc is settable; the rest is fixed
            d = self._described = (self.group_desc, f"{self.group_desc} (id {self.group_id}, ranks {list(self.ranks)})")
        return d[1]

    # -- torch's ProcessGroup queries -----------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    def name(self) -> str:
        return self.group_name

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def pending(self) -> dict[asyncio.Task[None], Work]:
        """The ops of this group still running on this rank: each op's task -> its Work (a
        copy, for the debug server's stacks and the test watchdogs)."""
        return dict(self._pending)

    def stats(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "desc": self.group_desc,
            "ranks": list(self.ranks),
            "seq": self.seq,
            "pending": len(self._pending),
            "completed": self.completed,
            "eager": self.eager,
            "broken": self.broken,
            "timeout_s": self.timeout_s,
        }

    def idle_until(self, leader: int) -> None:
        """Make this group's collectives idle until ``leader`` (a group rank) issues them:
        ``aiodist.c10d.idle_until_leader``. Its ops then take their task path (the go first)."""
        self.idle_leader = leader
        self.quick = False

    # -- issuing ops -----------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            raise DistBackendError(
                f"{self.describe()} is unusable: {self.broken}; destroy it and create a new group",
                group=self.group_desc,
                rank=self.backend.rank,
            )

    def _check_host(self, op: str) -> None:
        if self.host_refusal is not None:
            raise DistBackendError(f"{op} on {self.describe()}: {self.host_refusal}")

    def issue(
        self,
        op: str,
        body: Body,
        outputs: list[Any],
        *,
        timeout_s: float | None = None,
        meta: dict[str, Any] | None = None,
        described: Described | None = None,
    ) -> Work:
        """Take the next sequence number, open the channel and start the op in a task (no
        suspension). ``timeout_s`` replaces the group's timeout for this op (monitored_barrier's
        own). ``meta`` describes the call for the flight recorder and DETAIL's desync check: its
        ``"same"`` dict holds what every rank must agree on (dtype, shape, root, reduce op).
        ``described`` is ``describe_call(op, meta)`` made once and kept (a collective's cache for
        calls it has seen): the same description, without building it again."""
        if self.broken is not None:
            self.check_usable()
        if self.host_refusal is not None:
            self._check_host(op)
        if described is None:
            described = describe_call(op, meta)
        seq = self.seq
        self.seq = seq + 1
        entry = self.recorder.issued(op, seq, "collective", described[0], with_stack=self.detail, frozen=described[2])
        staging = _STAGING.get()
        if staging is not None:  # host copies of device arrays: copy in before, copy back after
            body = _staged_body(staging, body)
        return self._open(op, seq, entry, described, body, outputs, timeout_s)

    def _open(
        self,
        op: str,
        seq: int,
        entry: Entry | None,
        described: Described,
        body: Body,
        outputs: list[Any],
        timeout_s: float | None = None,
    ) -> Work:
        """The op's channel (its digest recorded), its Work, and its launch."""
        ranks = self.ranks
        if self._digests and described[0] is not None:  # what every rank must agree on, sent with the op's frames
            channel = self.backend.channel(self.group_id, seq, ranks, described[3], (op, described[1], self.group_desc))
        else:
            channel = self.backend.channel(self.group_id, seq, ranks)
        d = self._described
        desc = d[1] if d is not None and d[0] is self.group_desc else self.describe()
        work = Work(op, desc, seq, outputs)
        if self.detail:  # compare the call across ranks before running it (aiodist.debug.desync)
            body = _checked_body(self, op, seq, described[0], body)
        return self._launch(op, f"seq {seq}", seq, _Tracked(channel, ranks, self._rank), body, work, timeout_s, entry, self.idle_leader)

    def issue_now(self, op: str, now: Callable[..., Any], a: Any, b: Any, outputs: list[Any], described: Described, asy: bool) -> Any:
        """Issue an op by its in-call path (``aiodist.backends.routes.Quick``): the next sequence
        number, then ``now(seq, digest, a, b)``, which posts the op and collects the peers' parts.
        Done in the call: the flight recorder's slot says so, and the answer is a finished Work
        (``asy``) or None; posted and parked (``now`` gave the op's ``Rest``): the op's Work, its
        rest running as any op's body. ``NOT_NOW`` where the op must take its route (nothing
        done, no number taken): the group is broken or has a refusal, its calls are compared
        first (DETAIL) or tallied (INFO), or the op stages device arrays, or ``now`` says so."""
        if self.broken is not None or not self.quick or _STAGING.get() is not None:
            return NOT_NOW
        seq = self.seq
        self.seq = seq + 1
        try:
            got = now(seq, described[3] if self._digests else 0, a, b)
        except BaseException as exc:  # (KeyboardInterrupt in the spin): the op may be posted and not read
            self.break_group(
                f"{op} seq {seq} was interrupted in its issuing call ({type(exc).__name__}): its part may be posted, its peers' unread",
            )
            raise
        if got is None:  # nothing done: the number is not taken
            self.seq = seq
            return NOT_NOW
        if got is True:
            self.recorder.done_now(op, seq, described[2])
            self.completed += 1
            self.eager += 1
            if not asy:
                return None
            work = Work(op, self.describe(), seq, outputs)
            work._complete()
            return work
        try:
            entry = self.recorder.issued(op, seq, "collective", described[0], frozen=described[2])
            work = self._open(op, seq, entry, described, got.body, outputs)
        except BaseException:
            got.release()  # its place in line passes on, as a Work's done callback would
            raise
        work.add_done_callback(got.release)
        return work

    def issue_device(
        self,
        op: str,
        body: Callable[[], Coroutine[Any, Any, None]],
        make_work: Callable[[str, str, int], Work],
        *,
        meta: dict[str, Any] | None = None,
        waiting: Callable[[], str] | None = None,
        p2p: bool = False,
    ) -> Work:
        """Start an op of a device backend (``aiodist.backends.device``): the group's next
        sequence number (its p2p counter for point-to-point ops), a flight-recorder entry, the
        group's timeout and failure rules. ``make_work(op, group_desc, seq)`` makes its Work;
        ``body()`` runs it; ``waiting()`` tells a timeout message what the op was waiting on."""
        self.check_usable()
        if p2p:
            n = self.p2p_seq
            self.p2p_seq += 1
            label = f"p2p seq {n}"
        else:
            n = self.seq
            self.seq += 1
            label = f"seq {n}"
        entry = self.recorder.issued(op, n, "p2p" if p2p else "collective", meta, with_stack=self.detail)
        work = make_work(op, self.describe(), n)
        work.label = label
        tracker = DeviceTracker(self, waiting, diagnose=not p2p)
        return self._launch(op, label, n, tracker, lambda _t: body(), work, None, entry)

    def issue_p2p(
        self,
        op: str,
        peers: Sequence[int],
        tag: int,
        body: Callable[[Any], Coroutine[Any, Any, None]],
        outputs: list[Any],
        *,
        receive: bool,
    ) -> Work:
        """Start a point-to-point op (see aiodist.c10d.point_to_point); it gets the next number of
        the group's separate p2p counter, which names it in errors ("p2p seq")."""
        self.check_usable()
        if self.host_refusal is not None:
            self._check_host(op)
        n = self.p2p_seq
        self.p2p_seq += 1
        ops = PeerOps(self.backend, self.group_id, self.ranks)
        work = Work(op, self.describe(), n, outputs, source_rank=-1 if receive else None)
        work.label = f"p2p seq {n}"
        staging = _STAGING.get()
        if staging is not None:
            body = _staged_body(staging, body)
        entry = self.recorder.issued(op, n, "p2p", {"tag": tag, "peers": list(peers)}, with_stack=self.detail)
        return self._launch(op, f"p2p seq {n} (tag {tag}, peers {list(peers)})", n, ops, body, work, None, entry)

    def _launch(
        self,
        op: str,
        label: str,
        seq: int,
        tracker: Tracker,
        body: Callable[[Any], Coroutine[Any, Any, None]],
        work: Work,
        timeout_s: float | None = None,
        entry: Entry | None = None,
        idle: int | None = None,
    ) -> Work:
        """Run the op under the runner, in a task the group owns (``pending``); ``idle``: a
        collective of a group that idles until its leader (the runner's ``idle``)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        coro = run(self, op, label, tracker, body, work, limit, entry, loop=loop, idle=idle)
        t0 = time.perf_counter() if self._op_stats is not None else 0.0
        task = loop.create_task(coro, name=f"aiodist {op} {self.group_desc} {label}")
        self._pending[task] = work
        if self._op_stats is None:  # (the flight recorder's entry is closed by the runner itself)
            task.add_done_callback(self._pending.pop)
        else:  # INFO: one callback also counts the op (each callback is a loop callback per op)
            task.add_done_callback(functools.partial(self._task_done, op, work, t0))
        return work

    def _task_done(self, op: str, work: Work, t0: float, task: asyncio.Task[None]) -> None:
        """INFO: an op's task ended (its Work is resolved by then, whichever way it ended):
        forget it and count it for the group's summary."""
        self._pending.pop(task, None)
        self._tally(op, t0, work)

    def _tally(self, op: str, t0: float, work: Work) -> None:
        """INFO: count the op (completed / failed) and its time from issue to end."""
        if self._op_stats is None:  # ended during the group's shutdown, after its summary
            return
        row = self._op_stats.setdefault(op, [0, 0, 0.0])
        ok = work.is_success_unseen()
        row[0 if ok else 1] += 1
        took = time.perf_counter() - t0
        row[2] += took
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rank %d: %s on %s, %s: %s in %.3f ms",
                self.backend.rank,
                op,
                self.group_desc,
                work.label,
                "completed" if ok else "failed",
                took * 1e3,
            )

    def _log_summary(self) -> None:
        """INFO: one line at the end of the group's life: ops completed / failed by name, and
        their total time (issue to end, summed over ops; concurrent ops overlap)."""
        stats = self._op_stats
        if stats is None:
            return
        self._op_stats = None  # once
        done = sum(int(r[0]) for r in stats.values())
        failed = sum(int(r[1]) for r in stats.values())
        total = sum(r[2] for r in stats.values())
        parts = ", ".join(
            f"{op} {int(r[0])}" + (f" (+{int(r[1])} failed)" if r[1] else "") + f" {r[2] * 1e3:.1f} ms" for op, r in sorted(stats.items())
        )
        log.info(
            "rank %d: %s ends: %d ops completed, %d failed, %.1f ms in ops%s",
            self.backend.rank,
            self.describe(),
            done,
            failed,
            total * 1e3,
            f": {parts}" if parts else "",
        )

    # -- breaking and tearing down ---------------------------------------------------------------

    def break_group(self, reason: str, cause: BaseException | None = None, *, tell_peers: bool = True, abort_devices: bool = True) -> None:
        """Mark the group broken (once, with ``reason``), fail its other pending ops, and (for a
        failure here, ``tell_peers``) let the peers' pending ops on the group fail now."""
        if self.broken is None:
            self.broken = reason
            for dev in set(self.devices.values()) if abort_devices else ():  # e.g. abort the group's NCCL communicator
                try:
                    dev.abort_group(self.group_id, reason)
                except Exception as exc:  # best effort, like telling the peers
                    log.warning("rank %d: aborting %s on %s: %s", self.backend.rank, self.describe(), getattr(dev, "name", dev), exc)
            if tell_peers:
                named = getattr(cause, "culprits", None) or None
                t = asyncio.get_running_loop().create_task(self._tell_peers(reason, named), name=f"aiodist abort {self.group_desc}")
                self._aborting.add(t)
                t.add_done_callback(self._aborting.discard)
        current_task = asyncio.current_task()
        for task, work in list(self._pending.items()):
            if task is not current_task:
                err = DistBackendError(
                    f"{work.op} on {self.describe()}, {work.label} aborted: the group broke ({self.broken})",
                    op=work.op,
                    group=self.group_desc,
                    seq=work.seq,
                    rank=self.backend.rank,
                    culprits=getattr(cause, "culprits", None),
                )
                err.__suppress_context__ = True  # the sentence says what broke it; the cause is the group's other error
                work._fail(err)
                # A consequence of the failure the user already sees: awaiting it still raises,
                # but asyncio must not log one "exception was never retrieved" per pending op.
                work.exception()
                task.cancel()

    async def _tell_peers(self, reason: str, culprits: dict[int, str] | None = None) -> None:
        """Tell the group's peers it broke, and whom the failure names (every survivor's errors
        then name the same ranks)."""
        try:
            await self.backend.abort_group(
                self.group_id, f"{self.describe()} broke on rank {self.backend.rank}: {reason}", self.ranks, culprits
            )
        except Exception as exc:  # best effort: the peers still have their own timeouts
            log.warning("rank %d: could not tell peers that %s broke: %s", self.backend.rank, self.describe(), exc)

    def dump_recorders(self, directory: str) -> None:
        """This rank's flight recorders, every group of this group's World, to ``directory``
        (the instrumentation's ``dump_groups``: ``AIODIST_FR_DUMP_ON_TIMEOUT``)."""
        b = self.backend
        rank, world_size, groups = self.world_groups() if self.world_groups is not None else (b.rank, b.world_size, [self])
        dump_groups(rank, world_size, groups, directory)

    def abort(self, reason: str = "the group was aborted") -> None:
        """Fail every pending op of this group (on this rank) and refuse new ones."""
        self.break_group(reason, tell_peers=False)

    async def shutdown(self, reason: str) -> None:
        """Abort pending ops and wait for their tasks to end; then the device backends release
        what they hold for the group (an NCCL communicator is destroyed, or aborted where an op
        of it is still on the GPU)."""
        works = list(self._pending.values())
        if self._aborting:  # telling the peers dials the ones never connected: a short while, then not
            _, late = await asyncio.wait(list(self._aborting), timeout=_TELL_AT_TEARDOWN_S)
            for t in late:
                t.cancel()
        tasks = list(self._pending) + list(self._aborting)
        self.break_group(reason, tell_peers=False, abort_devices=False)
        for w in works:
            if w.done():
                w.exception()  # torn down on purpose: not an error nobody looked at
        if tasks:
            await asyncio.wait(tasks)
        if self.clock is not None:  # its timer would keep it (and the loop's timer) until it is due
            self.clock.close()
        for dev in dict.fromkeys(self.devices.values()):
            try:
                await dev.release_group(self.group_id)
            except Exception as exc:  # best effort at teardown
                log.warning("rank %d: releasing %s on %s: %s", self.backend.rank, self.describe(), getattr(dev, "name", dev), exc)
        await self.backend.release_group(self.group_id)  # e.g. the socket backend's shared segments
        self._log_summary()


if TYPE_CHECKING:

    def _implements(pg: ProcessGroup) -> ProcessGroupLike:
        return pg  # mypy checks ProcessGroup against the backends' contract (aiodist.backends.base)
