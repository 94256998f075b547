"""``ProcessGroup``: a set of global ranks, a sequence counter, a timeout, and the backend's
channel factory; it issues ops and owns the tasks that run them.

Rules:
- ``issue`` is synchronous: it takes the next sequence number and opens the op's channel, so an
  API coroutine that validates and then issues does both in its first step, before any
  suspension point. Ops of one group run concurrently (each on its own channel).
- An op runs as a task owned by the group: cancelling whoever awaits it leaves it running.
- An op that does not finish within the group's timeout fails with ``DistTimeoutError`` naming
  the op, the group, its sequence number, and the ranks this rank was still waiting on. Any
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
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from aiodist.algorithms.p2p import P2P
from aiodist.algorithms.thresholds import Thresholds, current
from aiodist.backends.base import CommBackend
from aiodist.c10d.work import Work
from aiodist.debug.levels import DebugLevel, get_debug_level
from aiodist.debug.recorder import Entry, FlightRecorder, dump_on_timeout
from aiodist.errors import DistBackendError, DistError, DistTimeoutError
from aiodist.store.base import Store

__all__ = ["ProcessGroup"]

log = logging.getLogger("aiodist.c10d")

Body = Callable[[P2P], Coroutine[Any, Any, None]]


class _Tracked:
    """A P2P that remembers which peers it is still waiting on (for timeout messages)."""

    def __init__(self, inner: P2P, ranks: Sequence[int]) -> None:
        self.inner = inner
        self.ranks = ranks
        self.rank = inner.rank
        self.size = inner.size
        self.waiting_recv: Counter[int] = Counter()
        self.waiting_send: Counter[int] = Counter()

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._track(self.waiting_send, peer, self.inner.send(peer, buf, tag))

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._track(self.waiting_recv, peer, self.inner.recv(peer, buf, tag))

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        """The inner P2P's ``send_nowait`` where it has one (False: use ``send``)."""
        nowait = getattr(self.inner, "send_nowait", None)
        if nowait is None:
            return False
        sent: bool | asyncio.Future[None] = nowait(peer, buf, tag)
        if isinstance(sent, asyncio.Future) and not sent.done():  # written, still draining: a wait on the peer
            self.waiting_send[peer] += 1
            sent.add_done_callback(lambda _: self.waiting_send.subtract([peer]))
        return sent

    diagnose = True  # a timeout follows the waits through the store (ProcessGroup._diagnose)

    def silent(self) -> list[int]:
        """The global ranks a receive of this op was still waiting on."""
        return sorted(self.ranks[p] for p, n in self.waiting_recv.items() if n > 0)

    def unsent(self) -> list[int]:
        """The global ranks a send of this op was still waiting on."""
        return sorted(self.ranks[p] for p, n in self.waiting_send.items() if n > 0)

    def peers(self) -> list[int]:
        """Every global rank this op still waits on, either way."""
        return sorted({*self.silent(), *self.unsent()})

    def describe_waiting(self) -> str:
        """The timeout message's tail: whom this op was still waiting on."""
        out = ""
        silent = self.silent()
        unsent = self.unsent()
        if silent:
            out += f"; ranks not heard from: {silent}"
        if unsent:
            out += f"; ranks not taking delivery: {unsent}"
        return out

    @staticmethod
    async def _track(counter: Counter[int], peer: int, transfer: Awaitable[None]) -> None:
        counter[peer] += 1
        try:
            await transfer
        except (asyncio.CancelledError, TimeoutError):
            raise  # still counted: the timeout message reads what was pending when it fired
        except BaseException:
            counter[peer] -= 1
            raise
        counter[peer] -= 1


class _DeviceTracker:
    """A device op's stand-in for ``_Tracked``: the device library does not say which peer it
    waits on, so a timed-out collective reports waiting on every other rank and lets the store
    (``ProcessGroup._diagnose``) find the ranks that never reached the op."""

    def __init__(self, pg: ProcessGroup, waiting: Callable[[], str] | None, *, diagnose: bool) -> None:
        self._pg = pg
        self._waiting = waiting
        self.diagnose = diagnose

    def silent(self) -> list[int]:
        me = self._pg.backend.rank
        return [r for r in self._pg.ranks if r != me]

    def peers(self) -> list[int]:
        return self.silent()

    def describe_waiting(self) -> str:
        return self._waiting() if self._waiting is not None else "; the device op had not completed"


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
    from aiodist.debug.desync import check_fingerprint

    async def checked(p2p: P2P) -> None:
        await check_fingerprint(p2p, pg, op, seq, meta)
        await body(p2p)

    return checked


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
        level = get_debug_level()
        self.detail = level >= DebugLevel.DETAIL  # read once: a group keeps the level it was made at
        # INFO: per-op-name tallies for the summary logged when the group ends (None at OFF: no cost)
        self._op_stats: dict[str, list[float]] | None = {} if level >= DebugLevel.INFO else None
        if level >= DebugLevel.INFO:
            log.info("rank %d: made %s, backend %s, timeout %g s", backend.rank, self.describe(), backend_name, timeout_s)
        self.thresholds: Thresholds = current()  # read once per group, the same on every rank
        self.seq = 0
        self.store: Store | None = store  # the World's store: used to explain a timeout
        self.splits = 0  # split_group calls on this group (part of the children's ids)
        self.shrinks = 0  # shrink_group calls on this group
        self.p2p_seq = 0  # point-to-point ops issued (their own numbering, apart from collectives')
        self.broken: str | None = None
        self._pending: dict[asyncio.Task[None], Work] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        self.completed = 0

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
            "broken": self.broken,
            "timeout_s": self.timeout_s,
        }

    # -- issuing ops -----------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            raise DistBackendError(f"{self.describe()} is unusable: {self.broken}; destroy it and create a new group")

    def _check_host(self, op: str) -> None:
        if self.host_refusal is not None:
            raise DistBackendError(f"{op} on {self.describe()}: {self.host_refusal}")

    def issue(self, op: str, body: Body, outputs: list[Any], *, timeout_s: float | None = None, meta: dict[str, Any] | None = None) -> Work:
        """Take the next sequence number, open the channel and start the op (no suspension).
        ``timeout_s`` replaces the group's timeout for this op (monitored_barrier's own).
        ``meta`` describes the call for the flight recorder and DETAIL's desync check: its
        ``"same"`` dict holds what every rank must agree on (dtype, shape, root, reduce op)."""
        self.check_usable()
        if self.host_refusal is not None:
            self._check_host(op)
        seq = self.seq
        self.seq += 1
        entry = self.recorder.issued(op, seq, "collective", meta, with_stack=self.detail)
        staging = _STAGING.get()
        if staging is not None:  # host copies of device arrays: copy in before, copy back after
            body = _staged_body(staging, body)
        return self._start(op, seq, self.ranks, body, outputs, None, timeout_s, entry, meta)

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
        tracker = _DeviceTracker(self, waiting, diagnose=not p2p)
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
        from aiodist.c10d.point_to_point import PeerOps  # the body's view of the backend

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

    def _start(
        self,
        op: str,
        seq: int,
        ranks: Sequence[int],
        body: Body,
        outputs: list[Any],
        source_rank: int | None,
        timeout_s: float | None = None,
        entry: Entry | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Work:
        p2p = _Tracked(self.backend.channel(self.group_id, seq, ranks), ranks)
        work = Work(op, self.describe(), seq, outputs, source_rank=source_rank)
        if self.detail:  # compare the call across ranks before running it (aiodist.debug.desync)
            body = _checked_body(self, op, seq, meta, body)
        return self._launch(op, f"seq {seq}", seq, p2p, body, work, timeout_s, entry)

    def _launch(
        self,
        op: str,
        label: str,
        seq: int,
        tracker: Any,
        body: Callable[[Any], Coroutine[Any, Any, None]],
        work: Work,
        timeout_s: float | None = None,
        entry: Entry | None = None,
    ) -> Work:
        limit = self.timeout_s if timeout_s is None else timeout_s
        task = asyncio.get_running_loop().create_task(
            self._run(op, label, tracker, body, work, limit, entry), name=f"aiodist {op} {self.group_desc} {label}"
        )
        self._pending[task] = work
        if self._op_stats is None:  # (the flight recorder's entry is closed by _run itself)
            task.add_done_callback(self._pending.pop)  # type: ignore[arg-type]
        else:  # INFO: one callback also counts the op (each callback is a loop callback per op)
            task.add_done_callback(functools.partial(self._task_done, op, work, time.perf_counter()))
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

    async def _run(
        self,
        op: str,
        label: str,
        tracker: Any,
        body: Callable[[Any], Coroutine[Any, Any, None]],
        work: Work,
        limit: float,
        entry: Entry | None = None,
    ) -> None:
        if entry is not None:
            self.recorder.started(entry)
        what = f"{op} on {self.describe()}, {label}"
        # a collective keeps the last part of its time to find out, through the store, which
        # rank the wait is really stuck on (see _diagnose)
        diagnose = self.store is not None and getattr(tracker, "diagnose", False) and len(self.ranks) > 2
        grace = min(max(limit * 0.1, 0.05), 5.0) if diagnose else 0.0
        try:
            async with asyncio.timeout(limit - grace):
                await body(tracker)
        except TimeoutError as exc:
            if isinstance(exc, DistError) and getattr(exc, "verdict", False):  # the op's own ruling, not a deadline
                self._failed(op, label, what, work, exc)
                return
            msg = f"{what} timed out after {limit:g} s on rank {self.backend.rank}"
            waiting = tracker.describe_waiting()
            msg += waiting or "; it was not waiting on any peer (the group was still running it)"
            if waiting:
                msg += self.backend.connection_report(tracker.peers())
            if diagnose:
                msg += await self._diagnose(work.seq, tracker.silent(), grace)
            err: DistError = DistTimeoutError(msg)
            if isinstance(exc, DistError):  # the backend's own deadline came first: keep its words
                err.__cause__ = exc
            if entry is not None:
                self.recorder.timed_out(entry, msg)
            try:
                dump_on_timeout()  # AIODIST_FR_DUMP_ON_TIMEOUT=1
            except OSError as dump_err:
                log.warning("rank %d: could not dump the flight recorder: %s", self.backend.rank, dump_err)
            work._fail(err)
            self._break(msg, err)
            return
        except asyncio.CancelledError:
            work._fail(DistBackendError(f"{what} was aborted: {self.broken or 'the group was torn down'}"))
            raise
        except DistError as exc:
            self._failed(op, label, what, work, exc)
            return
        except Exception as exc:
            wrapped = DistBackendError(f"{what} failed on rank {self.backend.rank}: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            work._fail(wrapped)
            self._break(f"{op} {label} failed: {exc}", wrapped)
            return
        finally:  # every way out: the Work is failed by now, or the op completed (just below)
            if entry is not None:
                self.recorder.ended(entry, work)
        self.completed += 1
        work._complete()

    async def _diagnose(self, seq: int, silent: list[int], grace: float) -> str:
        """Follow the waits of a timed-out collective through the store: this rank writes whom it
        was waiting on under the op's key, then reads what the ranks it waited on wrote, and
        theirs, for at most ``grace`` seconds. A rank that never writes is not stuck in this op
        (it never reached it, or died): that is the rank the group waits for. Best effort: a
        store that does not answer in time leaves the message as it was."""
        assert self.store is not None
        me = self.backend.rank
        prefix = f"aiodist/hang/{self.group_id}/{seq}/"
        reports: dict[int, list[int]] = {me: silent}
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        try:
            async with asyncio.timeout(grace):
                await self.store.set(prefix + str(me), json.dumps(silent))
                while True:
                    missing = self._unreported(reports)
                    if not missing or loop.time() + 0.02 >= end:
                        break
                    for r in missing:
                        if await self.store.check([prefix + str(r)]):
                            reports[r] = json.loads(await self.store.get(prefix + str(r)))
                    if self._unreported(reports):
                        await asyncio.sleep(0.02)
        except (TimeoutError, DistError, ValueError) as exc:
            log.debug("rank %d: diagnosing seq %d of %s: %s", me, seq, self.describe(), exc)
        chain = ", ".join(f"rank {r} on {w}" for r, w in sorted(reports.items()) if r != me and w)
        missing = self._unreported(reports)
        out = f"; waits seen through the store: {chain}" if chain else ""
        if missing:
            out += f"; ranks stuck outside this op (never reported being in it): {missing}"
        return out

    @staticmethod
    def _unreported(reports: dict[int, list[int]]) -> list[int]:
        """Ranks reachable through the reported waits that have not reported themselves."""
        return sorted({r for waits in reports.values() for r in waits} - set(reports))

    def _failed(self, op: str, label: str, what: str, work: Work, exc: DistError) -> None:
        try:  # same type, with the op, group and seq in front
            named: DistError = type(exc)(f"{what} failed on rank {self.backend.rank}: {exc}")
            named.__cause__ = exc
        except Exception:  # pragma: no cover - a subclass with another constructor
            named = exc
        work._fail(named)
        self._break(f"{op} {label} failed: {exc}", named)

    # -- breaking and tearing down ---------------------------------------------------------------

    def _break(self, reason: str, cause: BaseException | None = None, *, tell_peers: bool = True, abort_devices: bool = True) -> None:
        if self.broken is None:
            self.broken = reason
            for dev in set(self.devices.values()) if abort_devices else ():  # e.g. abort the group's NCCL communicator
                try:
                    dev.abort_group(self.group_id, reason)
                except Exception as exc:  # best effort, like telling the peers
                    log.warning("rank %d: aborting %s on %s: %s", self.backend.rank, self.describe(), getattr(dev, "name", dev), exc)
            if tell_peers:  # an op failed here: let the peers' pending ops on this group fail now
                t = asyncio.get_running_loop().create_task(self._tell_peers(reason), name=f"aiodist abort {self.group_desc}")
                self._aborting.add(t)
                t.add_done_callback(self._aborting.discard)
        current_task = asyncio.current_task()
        for task, work in list(self._pending.items()):
            if task is not current_task:
                err = DistBackendError(f"{work.op} on {self.describe()}, {work.label} aborted: the group broke ({self.broken})")
                err.__cause__ = cause
                work._fail(err)
                # A consequence of the failure the user already sees: awaiting it still raises,
                # but asyncio must not log one "exception was never retrieved" per pending op.
                work.exception()
                task.cancel()

    async def _tell_peers(self, reason: str) -> None:
        try:
            await self.backend.abort_group(self.group_id, f"{self.describe()} broke on rank {self.backend.rank}: {reason}")
        except Exception as exc:  # best effort: the peers still have their own timeouts
            log.warning("rank %d: could not tell peers that %s broke: %s", self.backend.rank, self.describe(), exc)

    def abort(self, reason: str = "the group was aborted") -> None:
        """Fail every pending op of this group (on this rank) and refuse new ones."""
        self._break(reason, tell_peers=False)

    async def shutdown(self, reason: str) -> None:
        """Abort pending ops and wait for their tasks to end; then the device backends release
        what they hold for the group (an NCCL communicator is destroyed, or aborted where an op
        of it is still on the GPU)."""
        works = list(self._pending.values())
        tasks = list(self._pending) + list(self._aborting)
        self._break(reason, tell_peers=False, abort_devices=False)
        for w in works:
            if w.done():
                w.exception()  # torn down on purpose: not an error nobody looked at
        if tasks:
            await asyncio.wait(tasks)
        for dev in dict.fromkeys(self.devices.values()):
            try:
                await dev.release_group(self.group_id)
            except Exception as exc:  # best effort at teardown
                log.warning("rank %d: releasing %s on %s: %s", self.backend.rank, self.describe(), getattr(dev, "name", dev), exc)
        self._log_summary()
