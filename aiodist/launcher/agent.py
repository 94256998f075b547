"""The local agent: start this node's workers, pump their output, watch them, stop them, and
restart the group when a worker fails (see docs/launcher.md).

Everything runs on one asyncio loop: workers are ``asyncio.create_subprocess_exec`` children,
each in its own session (process group), so a signal the launcher forwards reaches the worker
and anything it started, and a terminal's Ctrl-C reaches the launcher alone, which forwards it.
The stores (rendezvous, and the workers' store of each round) run on their own threads and
loops (``ServerThread``), so neither a busy output pump nor the workers can stall them.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any, TextIO, TypeVar

from aiodist.elastic.errors import ChildFailedError, ProcessFailure
from aiodist.errors import DistError
from aiodist.launcher._config import LaunchConfig
from aiodist.launcher._console import Console
from aiodist.launcher._decide import Exit, Report, Restart, State, Stop, View, Wait, Why, next_action, root_cause
from aiodist.launcher._tracebacks import TracebackScanner
from aiodist.launcher._watch import RoundWatch
from aiodist.launcher.rendezvous import AgentRendezvous, Assignment, RendezvousError

__all__ = ["SignalException", "WorkerSpec", "LocalAgent", "Std"]

STDERR_TAIL_LINES = 40
FAILURE_SETTLE_S = 0.5  # after a first failure, how long the others may exit on their own
OUTCOME_SETTLE_S = 3.0  # how long a failed job's agents wait for each other's failure lists
REPORT_TIMEOUT_S = 5.0  # at most this long (and heartbeat_timeout) for one word to the store after a failure
_STORE_ERRORS = (DistError, OSError, TimeoutError)
_CHUNK = 1 << 16
T = TypeVar("T")

ORPHAN_GRACE_S = 2.0  # after the launcher died: how long its workers have between SIGTERM and SIGKILL

# Workers start through this trampoline on Linux (no preexec_fn: the launcher has threads, and
# preexec_fn is unsafe with them). It asks the kernel for SIGTERM when the launcher dies
# (PR_SET_PDEATHSIG, kept across exec), checks the launcher did not die before that, starts the
# worker's watchdog, then execs the worker (same pid, same session).
#
# The watchdog is what makes "a SIGKILLed launcher leaves no workers behind" hold for workers
# that ignore SIGTERM, and for their children (which PR_SET_PDEATHSIG does not reach). It is a
# double fork of the trampoline (so never the worker's child: nothing for the worker to reap),
# its stdio on /dev/null (the worker's pipes see EOF when the worker exits), deaf to SIGTERM,
# SIGINT, SIGHUP and SIGQUIT (a launcher stopping its workers, then killed itself before its
# SIGKILL, must still leave nothing), and a member of the worker's process group: while it lives
# the group's id cannot be reused, so its killpg never reaches a stranger. It waits on the
# launcher's lifeline (a pipe whose write end only the launcher holds: EOF when it dies, however
# it dies) and on the worker (a pidfd). Worker gone first: it exits. Lifeline gone first: SIGTERM
# to the group, up to ORPHAN_GRACE_S for the worker to exit, then SIGKILL to the group (itself
# included).
_TRAMPOLINE = """\
import ctypes,os,select,signal,sys,time
launcher,life,grace=int(sys.argv[1]),int(sys.argv[2]),float(sys.argv[3])
try:
    ctypes.CDLL(None,use_errno=True).prctl(1,15)
except Exception:
    pass
if os.getppid()!=launcher:
    os._exit(143)
me=os.getpid()
kid=os.fork()
if kid==0:
    try:
        if os.fork():
            os._exit(0)
        for s in (signal.SIGTERM,signal.SIGINT,signal.SIGHUP,signal.SIGQUIT):
            signal.signal(s,signal.SIG_IGN)
        null=os.open(os.devnull,os.O_RDWR)
        for fd in (0,1,2):
            os.dup2(null,fd)
        try:
            pid=os.pidfd_open(me)
        except (AttributeError,OSError):
            pid=-1
        def gone():
            try:
                os.kill(me,0)
            except ProcessLookupError:
                return True
            return False
        p=select.poll()
        p.register(life,select.POLLIN)
        if pid>=0:
            p.register(pid,select.POLLIN)
        while True:
            ev=dict(p.poll(None if pid>=0 else 500))
            if life in ev and not os.read(life,1):
                break
            if pid in ev or (pid<0 and gone()):
                os._exit(0)
        os.killpg(me,signal.SIGTERM)
        end=time.monotonic()+grace
        while time.monotonic()<end and not gone():
            time.sleep(0.05)
        os.killpg(me,signal.SIGKILL)
    finally:
        os._exit(0)
os.waitpid(kid,0)
os.close(life)
os.execvp(sys.argv[4],sys.argv[4:])
"""


class Std:
    """Which standard streams (torch's ``Std``): 0 none, 1 stdout, 2 stderr, 3 both."""

    NONE, OUT, ERR, ALL = 0, 1, 2, 3

    @staticmethod
    def parse(value: str | int | dict[int, int], nproc: int) -> dict[int, int]:
        """``"3"``, ``3`` or ``"0:1,1:2"`` (per local rank) -> {local_rank: mask}."""
        if isinstance(value, dict):
            return {r: int(value.get(r, 0)) for r in range(nproc)}
        if isinstance(value, int):
            return dict.fromkeys(range(nproc), _check_std(value))
        text = str(value).strip() or "0"
        if ":" not in text:
            return dict.fromkeys(range(nproc), _check_std(int(text)))
        out = dict.fromkeys(range(nproc), 0)
        for part in text.split(","):
            r, _, v = part.partition(":")
            out[int(r)] = _check_std(int(v))
        return out


def _open_log(path: str) -> IO[bytes]:
    """A worker's log file (closed by ``LocalAgent._drain``)."""
    return open(path, "wb")  # noqa: SIM115


def _why(exc: BaseException) -> str:
    """An exception for a message: its type and text (a bare timeout says so)."""
    text = str(exc)
    if isinstance(exc, TimeoutError) and not text:
        return "no reply in time"
    return f"{type(exc).__name__}: {text}"


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any and not done) and wait for it; its outcome is dropped. A
    cancellation of the calling task that arrives meanwhile is not: it propagates (``task``,
    cancelled twice, may then still be winding down). One already under way when this is
    called (a ``finally`` cleaning up) is not raised again here."""
    if task is None:
        return
    me = asyncio.current_task()
    before = me.cancelling() if me is not None else 0
    if not task.done():
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if me is not None and me.cancelling() > before:
            raise
    except Exception:  # noqa: S110 - a failure nobody waits for any more
        pass


def _check_std(v: int) -> int:
    if v not in (0, 1, 2, 3):
        raise ValueError(f"redirects/tee must be 0, 1, 2 or 3, got {v}")
    return v


class SignalException(Exception):
    """The launcher got SIGINT/SIGTERM (or SIGHUP/SIGQUIT): workers were stopped. ``failures``
    names the round's workers when they were running (empty otherwise); ``format_msg()`` is
    their report, as ``ChildFailedError``'s."""

    def __init__(self, msg: str, sigval: signal.Signals, name: str = "", failures: dict[int, ProcessFailure] | None = None) -> None:
        super().__init__(msg)
        self.sigval = sigval
        self.name = name
        self.failures = failures or {}

    def format_msg(self) -> str:
        """The failure report of the stopped workers ('' when none were running)."""
        return ChildFailedError(self.name, self.failures).format_msg() if self.failures else ""


@dataclass
class WorkerSpec:
    """What to run and how: the job's ``config`` as given, and the program: ``cmd`` (argv;
    ``${local_rank}`` is replaced per worker) or ``fn`` (a picklable callable run through
    ``aiodist.launcher._bootstrap``). ``redirects``/``tee`` are ``config``'s, per local rank."""

    config: LaunchConfig
    name: str
    cmd: list[str] | None = None
    fn: Callable[..., Any] | None = None
    fn_args: tuple[Any, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    exit_barrier_timeout: float = 10.0
    redirects: dict[int, int] = field(init=False)
    tee: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.redirects = Std.parse(self.config.redirects, self.config.nproc_per_node)
        self.tee = Std.parse(self.config.tee, self.config.nproc_per_node)


@dataclass
class _Worker:
    local_rank: int
    rank: int
    dir: str
    proc: asyncio.subprocess.Process | None = None
    rc: int | None = None
    exit_ns: int = 0
    signalled: bool = False
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    # What it died of, read from stderr as the lines arrive: for a worker without @record.
    tracebacks: TracebackScanner = field(default_factory=TracebackScanner)
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    watcher: asyncio.Task[None] | None = None
    files: list[IO[bytes]] = field(default_factory=list)

    @property
    def error_file(self) -> str:
        return os.path.join(self.dir, "error.json")

    @property
    def result_file(self) -> str:
        return os.path.join(self.dir, "result.pkl")


@dataclass
class _RoundResult:
    ok: bool
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    remote: dict[str, Any] | None = None
    return_values: dict[int, Any] = field(default_factory=dict)
    # The rendezvous store did not answer: why (this node cannot tell the others, nor hear them).
    store_down: str | None = None
    # What this node could not publish about the round: (first failure, this node's failures).
    unpublished: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    # Failures the agents observed (a lost store, a silent node): not of a worker of this node.
    agent_failures: list[ProcessFailure] = field(default_factory=list)
    # Nodes found lost (silent): nobody waits for them at the exit barrier.
    lost: set[int] = field(default_factory=set)


class LocalAgent:
    """Runs ``spec`` on this node through the rendezvous ``rdzv`` until success, or until a
    failure with no restarts left (``ChildFailedError``), or a signal (``SignalException``)."""

    def __init__(self, spec: WorkerSpec, rdzv: AgentRendezvous, log: Any) -> None:
        self.spec = spec
        self.rdzv = rdzv
        self.log = log
        self.workers: list[_Worker] = []
        self._wake = asyncio.Event()
        self._signal: signal.Signals | None = None
        self._ok = False
        self._assignment: Assignment | None = None
        # The workers' watchdogs hold the read end; only this process holds the write end (not
        # inheritable), so they see EOF when the launcher dies, however it dies.
        self._life: tuple[int, int] | None = None
        self._consoles: list[Console] = []
        self._keep_run_dir = spec.config.log_dir is not None or any(spec.redirects.values()) or any(spec.tee.values())
        base = spec.config.log_dir
        if base is not None:
            os.makedirs(base, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix=f"{spec.config.run_id or 'aiodist'}_", dir=base)

    # -- public ---------------------------------------------------------------------------

    async def run(self) -> dict[int, Any]:
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
                    break
            if self.spec.config.log_dir is None and self._keep_run_dir:
                self.log.warning("--redirects/--tee without --log-dir: worker logs in %s", self.run_dir)
            elif self._keep_run_dir:
                self.log.info("worker logs in %s", self.run_dir)
            return await self._run()
        finally:
            await self._stop_workers(signal.SIGTERM)
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self.rdzv.close()
            if self._life is not None:
                for fd in self._life:
                    os.close(fd)
                self._life = None
            # The workers' last lines before the launcher's own report (bounded: a console
            # that takes nothing for a second is given up on).
            consoles, self._consoles = self._consoles, []
            for c in consoles:
                await asyncio.to_thread(c.close)
            if not self._keep_run_dir and self._ok:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _lifeline(self) -> int:
        """The read end of the launcher's lifeline, for the workers' watchdogs (see _TRAMPOLINE)."""
        if self._life is None:
            self._life = os.pipe()
        return self._life[0]

    def _console(self, target: TextIO) -> Console:
        """The one ``Console`` of ``target`` (so lines of different workers never interleave)."""
        for c in self._consoles:
            if c.target is target:
                return c
        c = Console(target)
        self._consoles.append(c)
        return c

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._signal is None:
            self.log.warning("received %s: stopping the workers", sig.name)
        self._signal = sig
        self._wake.set()

    def _check_signal(self, report: bool = False) -> None:
        """Raise ``SignalException`` if a signal came; with ``report``, it names this round's
        workers (those that failed on their own, and those the launcher stopped)."""
        if self._signal is None:
            return
        failures: dict[int, ProcessFailure] = {}
        if report:
            failures = self._failures()
            failures.update(self._stopped(f"stopped by this node's launcher: it got {self._signal.name}", failures))
        raise SignalException(
            f"Process {os.getpid()} got signal: {self._signal.value}", sigval=self._signal, name=self.spec.name, failures=failures
        )

    # -- the restart loop -----------------------------------------------------------------

    async def _run(self) -> dict[int, Any]:
        spec = self.spec
        await self._guard(self.rdzv.start())
        restarts = 0
        last: tuple[Assignment, _RoundResult] | None = None
        while True:
            self._check_signal()
            try:
                late = None if last is None or last[1].unpublished is None else (last[0].round, *last[1].unpublished)
                a = await self._guard(self.rdzv.join(restarts, late))
            except (RendezvousError, *_STORE_ERRORS) as exc:
                if last is None:
                    raise
                # The restart could not meet the other nodes (the link or host stayed down past
                # join_timeout): the report is the failed round's, plus why the restart failed.
                prev, res = last
                msg = f"restart {restarts}/{spec.config.max_restarts} failed: {type(exc).__name__}: {exc}"
                self.log.error("%s", msg)
                restart = self._agent_failure(prev, prev.node_rank, msg, pid=os.getpid())
                raise ChildFailedError(spec.name, self._report(prev, res, [restart])) from exc
            self._assignment = a
            if restarts == 0 or a.node_rank == 0:
                self.log.info(
                    "round %d: node %d of %d, ranks %d..%d of %d, workers' store at %s:%d",
                    restarts,
                    a.node_rank,
                    a.nnodes,
                    a.rank_offset,
                    a.rank_offset + spec.config.nproc_per_node - 1,
                    a.world_size,
                    a.master_addr,
                    a.master_port,
                )
            res = await self._run_round(a)
            if res.ok:
                await self._finish(a)
                self._ok = True
                return res.return_values
            act = next_action(
                View(
                    now=time.monotonic(),
                    state=State.FAILED,
                    signal=self._signal.name if self._signal is not None else None,
                    failures=tuple(res.failures.values()),
                    restarts=restarts,
                    max_restarts=spec.config.max_restarts,
                )
            )
            if isinstance(act, Stop):  # a signal came meanwhile
                self._check_signal()
            if isinstance(act, Restart):
                restarts = act.round
                first = min(res.failures.values(), key=lambda f: (f.observed_ns, f.rank), default=None)
                self.log.warning(
                    "worker group failed (round %d)%s; restarting (%d/%d)",
                    a.round,
                    ""
                    if first is None
                    else f": rank {first.rank} exited with {first.exit_text()}"
                    + (f" ({len(res.failures) - 1} more failed)" if len(res.failures) > 1 else ""),
                    restarts,
                    spec.config.max_restarts,
                )
                last = (a, res)
                continue
            assert isinstance(act, Report), act
            more: list[ProcessFailure] = []
            skip = set(res.lost)
            if a.nnodes > 1 and res.store_down is None:
                # Every node's failures, so the root cause is the earliest of the job, not of this node.
                try:
                    gathered, missing = await self._bounded(
                        functools.partial(self.rdzv.gather_outcomes, a.round, OUTCOME_SETTLE_S, res.lost), OUTCOME_SETTLE_S + 2
                    )
                except _STORE_ERRORS as exc:
                    self.log.debug("could not gather the other nodes' failures: %s", _why(exc))
                else:
                    more = [ProcessFailure.from_dict(d) for d in gathered]
                    known = {f.rank for f in (*res.failures.values(), *res.agent_failures, *more)}
                    if res.remote is not None:
                        known.add(int(res.remote["rank"]))
                    for i in missing:
                        skip.add(i)
                        first = a.first_rank(i)
                        if i != a.node_rank and not known & set(range(first, first + a.nodes[i].nproc)):
                            more.append(self._unheard(a, i))
            if res.store_down is None:
                await self._finish(a, skip)
            raise ChildFailedError(spec.name, self._report(a, res, more))

    def _report(self, a: Assignment, res: _RoundResult, more: list[ProcessFailure]) -> dict[int, ProcessFailure]:
        """The failures of a failed round for the report: this node's workers, the first failure
        the nodes agreed on, what the agents observed, and ``more`` (other nodes' failures).
        Keyed by rank; a second entry for a rank (an agent's observation about a node, named by
        its first rank) gets a negative key (the report shows its rank)."""
        failures = dict(res.failures)
        extra = ([ProcessFailure.from_dict(res.remote)] if res.remote is not None else []) + res.agent_failures + more
        for f in extra:
            if any(g.rank == f.rank and g.message == f.message for g in failures.values()):
                continue  # the same failure, heard twice (published, then read back)
            failures[f.rank if f.rank not in failures else min(min(failures), 0) - 1] = f
        return failures

    async def _guard(self, coro: Any) -> Any:
        """Await ``coro`` unless a signal comes first."""
        task = asyncio.ensure_future(coro)
        while not task.done():
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if self._signal is not None and not task.done():
                await _cancel(task)
                self._check_signal()
        return task.result()

    async def _bounded(self, call: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """``call()``, retried until it succeeds or ``timeout`` s passed (default
        ``REPORT_TIMEOUT_S``, at most the heartbeat timeout): a word to the store after a failure
        must not hang on a lost link, nor give up on one reset connection (the next try
        reconnects). Only for requests that may be repeated (set, compare_set of our own value,
        reads)."""
        limit = min(REPORT_TIMEOUT_S, self.rdzv.heartbeat_timeout) if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                return await asyncio.wait_for(call(), max(0.0, deadline - time.monotonic()))
            except _STORE_ERRORS:
                if time.monotonic() + 0.2 >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _finish(self, a: Assignment, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Tell the other agents we are leaving; the rendezvous host waits (bounded) for them,
        but not for ``skip`` (nodes lost or silent), so nobody loses the store while it still
        reads the outcome."""
        if a.nnodes == 1:
            return
        try:
            await self._bounded(lambda: self.rdzv.mark(a.round, "exit"))
            if self.rdzv.is_host:
                await self.rdzv.wait_marked(a.round, "exit", self.spec.exit_barrier_timeout, skip)
        except _STORE_ERRORS as exc:  # the store went away: nothing left to tell
            self.log.debug("exit barrier: %s", _why(exc))

    # -- one round --------------------------------------------------------------------------

    async def _run_round(self, a: Assignment) -> _RoundResult:
        spec = self.spec
        attempt_dir = os.path.join(self.run_dir, f"attempt_{a.round}")
        self.workers = [_Worker(i, a.rank_offset + i, os.path.join(attempt_dir, str(i))) for i in range(spec.config.nproc_per_node)]
        try:
            for w in self.workers:
                os.makedirs(w.dir, exist_ok=True)
                await self._start_worker(w, a)
        except BaseException:
            await self._stop_workers(signal.SIGTERM)
            raise
        # Another node's news (a failure, every node done, heartbeats) arrives through the watch,
        # beside this loop, so a store that stops answering (a lost link) never keeps the loop
        # from seeing its workers exit; next_action judges a silent store by the clock.
        watch = RoundWatch(self.rdzv, a.round, self._wake, self.log) if a.nnodes > 1 else None
        local_done = False
        try:
            while True:
                self._wake.clear()
                act = next_action(self._view(a, watch))
                if isinstance(act, Wait):
                    await self._sleep(act.seconds)
                    continue
                assert isinstance(act, Stop), act
                if watch is not None:
                    await watch.close()  # before acting on the decision
                if act.why is Why.SUCCEEDED:
                    local_done = True
                    break
                if act.why is Why.SIGNAL:
                    await self._stop_workers(self._signal or signal.SIGTERM)
                    if watch is not None:
                        await self._publish_signal(a)
                    self._check_signal(report=True)
                assert watch is not None or act.why is Why.WORKER_FAILED, act
                if act.why is Why.WORKER_FAILED:
                    return await self._local_failure(a, watch.ok_at if watch is not None else time.monotonic())
                assert watch is not None
                if act.why is Why.REMOTE_FAILED:
                    assert watch.remote is not None
                    local_done = all(w.rc == 0 for w in self.workers)
                    return await self._remote_failure(a, watch.remote, local_done)
                if act.why is Why.NODE_SILENT:
                    assert act.node is not None
                    return await self._silent_failure(a, act.node)
                return await self._store_lost(a, watch.error, time.monotonic() - watch.ok_at)
        finally:
            if watch is not None and watch.watching:  # the loop left by an exception or a cancellation
                await watch.close()
            # Every worker of this round is gone (or being torn down): a new round gets a new store.
            if not local_done:
                await self._stop_workers(signal.SIGTERM)
            await self.rdzv.stop_worker_store()
        for w in self.workers:
            await self._drain(w)
        return _RoundResult(True, return_values={w.rank: self._result(w) for w in self.workers})

    def _view(self, a: Assignment, watch: RoundWatch | None) -> View:
        """What this agent knows now, for ``next_action``; tells ``watch`` once this node's
        workers are all done (so it marks the node done and waits for the others)."""
        exits = tuple(Exit(w.rank, w.rc) for w in self.workers)
        sig = self._signal.name if self._signal is not None else None
        keep = self.spec.config.keep_survivors
        if watch is None:
            return View(now=time.monotonic(), workers=exits, signal=sig, keep_survivors=keep)
        if exits and all(e.rc == 0 for e in exits):
            watch.local_done()
        return View(
            now=time.monotonic(),
            workers=exits,
            nnodes=a.nnodes,
            signal=sig,
            remote=watch.remote,
            all_done=watch.all_done,
            peers=dict(watch.peers),
            store_ok_at=watch.ok_at,
            heartbeat_timeout=self.rdzv.heartbeat_timeout,
            keep_survivors=keep,
        )

    async def _sleep(self, seconds: float | None) -> None:
        """Until the wake event (a worker's exit, a signal, the watch's news), at most ``seconds``."""
        if seconds is None:
            await self._wake.wait()
            return
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _local_failure(self, a: Assignment, last_ok: float) -> _RoundResult:
        """A worker of this node failed: the others get ``FAILURE_SETTLE_S`` to exit on their own
        (the first exit is not always the root cause: a worker that raised may still be tearing
        down while its peers already died of the lost connection), then they are stopped, and
        the other nodes are told (bounded: the store may be what failed)."""
        await self._settle(FAILURE_SETTLE_S)
        await self._stop_workers(signal.SIGTERM)
        failures = self._failures()
        if self.spec.config.keep_survivors:
            went_on = [f"rank {w.rank} exit {w.rc}" for w in self.workers if w.rank not in failures]
            self.log.warning(
                "worker(s) %s failed; the other workers went on (--keep-survivors) and ended: %s",
                ", ".join(f"rank {r}" for r in sorted(failures)) or "none",
                ", ".join(went_on) or "none on this node",
            )
        if a.nnodes == 1:
            return _RoundResult(False, failures)
        cause = root_cause(list(failures.values()))
        assert cause is not None  # a worker failed on its own: it is in failures
        first = cause.to_dict()
        mine = [f.to_dict() for f in failures.values()]
        try:
            remote = await self._bounded(lambda: self.rdzv.report_failure(a.round, first))
            await self._bounded(lambda: self.rdzv.publish_outcome(a.round, mine))
        except _STORE_ERRORS as exc:
            return self._unreachable(a, failures, exc, time.monotonic() - last_ok, (first, mine))
        return _RoundResult(False, failures, remote)

    async def _remote_failure(self, a: Assignment, remote: dict[str, Any], local_done: bool) -> _RoundResult:
        if not local_done:
            self.log.warning("rank %s on %s failed: stopping this node's workers", remote.get("rank"), remote.get("hostname"))
        await self._stop_workers(signal.SIGTERM)
        mine = self._failures()  # workers that failed on their own before we stopped them
        try:
            await self._bounded(lambda: self.rdzv.publish_outcome(a.round, [f.to_dict() for f in mine.values()]))
        except _STORE_ERRORS as exc:
            self.log.debug("could not publish this node's failures: %s", _why(exc))
        return _RoundResult(False, mine, remote)

    async def _silent_failure(self, a: Assignment, node: int) -> _RoundResult:
        """Node ``node``'s agent stopped counting heartbeats (its host died, or the link to it)."""
        n = a.nodes[node]
        msg = f"the agent of {n.describe()} stopped answering: no heartbeat for {self.rdzv.heartbeat_timeout:g} s"
        self.log.warning("%s: stopping this node's workers", msg)
        info = self._agent_failure(a, node, msg)
        remote = described = info.to_dict()
        try:
            remote = await self._bounded(lambda: self.rdzv.report_failure(a.round, described))
        except _STORE_ERRORS as exc:
            self.log.debug("could not publish the silent node: %s", _why(exc))
        await self._stop_workers(signal.SIGTERM)
        failures = self._failures()
        try:
            await self._bounded(lambda: self.rdzv.publish_outcome(a.round, [f.to_dict() for f in failures.values()]))
        except _STORE_ERRORS as exc:
            self.log.debug("could not publish this node's failures: %s", _why(exc))
        failures.update(self._stopped(f"stopped by this node's launcher: {msg}", failures))
        return _RoundResult(False, failures, remote, agent_failures=[info], lost={node})

    async def _store_lost(self, a: Assignment, exc: BaseException | None, silent_for: float) -> _RoundResult:
        """The rendezvous store has not answered for heartbeat_timeout while the workers ran:
        stop them; this node can neither tell the others nor hear from them."""
        res = self._unreachable(a, {}, exc, silent_for, None)
        assert res.store_down is not None
        self.log.warning("%s: stopping this node's workers", res.store_down)
        await self._stop_workers(signal.SIGTERM)
        failures = self._failures()
        mine = [f.to_dict() for f in failures.values()]
        first = (root_cause(list(failures.values())) or res.agent_failures[0]).to_dict()
        failures.update(self._stopped(f"stopped by this node's launcher: {res.store_down}", failures))
        res.failures, res.unpublished = failures, (first, mine)
        return res

    def _unreachable(
        self,
        a: Assignment,
        failures: dict[int, ProcessFailure],
        exc: BaseException | None,
        silent_for: float,
        unpublished: tuple[dict[str, Any], list[dict[str, Any]]] | None,
    ) -> _RoundResult:
        host = a.store_node
        why = f" ({_why(exc)})" if exc is not None else ""
        if host is not None and host.index != a.node_rank:
            msg = (
                f"the rendezvous store at {self.rdzv.endpoint}, hosted by node {host.index}'s agent, has not answered for "
                f"{silent_for:.1f} s{why}: {host.describe()} or the link to it is down"
            )
        else:
            msg = f"the rendezvous store at {self.rdzv.endpoint} has not answered for {silent_for:.1f} s{why}: its host or the link to it is down"
        node = host.index if host is not None and host.index != a.node_rank else a.node_rank
        info = self._agent_failure(a, node, msg, pid=host.pid if host is not None else 0)
        return _RoundResult(False, failures, None, store_down=msg, unpublished=unpublished, agent_failures=[info])

    def _unheard(self, a: Assignment, node: int) -> ProcessFailure:
        """Node ``node`` published no outcome of a failed round within ``OUTCOME_SETTLE_S``."""
        quiet = self.rdzv.silence(a.round, node)
        beat = f" (its agent's last heartbeat: {quiet:.1f} s ago)" if quiet is not None else ""
        msg = (
            f"no word from {a.nodes[node].describe()} about round {a.round} within {OUTCOME_SETTLE_S:g} s{beat}: "
            f"node {node} or the link to it may be down"
        )
        return self._agent_failure(a, node, msg)

    def _agent_failure(self, a: Assignment, node: int, msg: str, pid: int | None = None) -> ProcessFailure:
        """A failure that is no worker's: what an agent observed about node ``node`` (named by
        its first rank in the report)."""
        n = a.nodes[node]
        info = ProcessFailure(
            local_rank=0,
            rank=a.first_rank(node),
            pid=n.pid if pid is None else pid,
            exitcode=1,
            hostname=self._host_name(a, node),
            message=msg,
            traceback=msg,
            resolve=False,
        )
        info.timestamp_ns = time.time_ns()
        return info

    def _host_name(self, a: Assignment | None, node: int | None = None) -> str:
        """How the report names a node's host: the host name, with the node and its address when
        several nodes of the round share the name (containers, network namespaces)."""
        if a is None or a.nnodes == 1:
            return socket.getfqdn()
        n = a.nodes[a.node_rank if node is None else node]
        name = socket.getfqdn() if node is None or node == a.node_rank else n.host
        if len({x.host for x in a.nodes}) < a.nnodes:
            return f"{name} (node {n.index}, {n.addr})"
        return name

    async def _publish_signal(self, a: Assignment) -> None:
        assert self._signal is not None
        msg = f"the launcher on node {a.node_rank} got {self._signal.name}"
        info = ProcessFailure(
            local_rank=0,
            rank=a.rank_offset,
            pid=os.getpid(),
            exitcode=-int(self._signal),
            hostname=self._host_name(a),
            message=msg,
            traceback=msg,
            resolve=False,
        )
        info.timestamp_ns = time.time_ns()
        try:
            await asyncio.wait_for(self.rdzv.report_failure(a.round, info.to_dict()), 2.0)
        except Exception as exc:
            self.log.debug("could not publish the signal: %s", exc)

    def _result(self, w: _Worker) -> Any:
        if self.spec.fn is None:
            return None
        try:
            with open(w.result_file, "rb") as f:
                return pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    async def _settle(self, seconds: float) -> None:
        live = [w.proc.wait() for w in self.workers if w.proc is not None and w.proc.returncode is None]
        if live:
            await asyncio.wait([asyncio.ensure_future(c) for c in live], timeout=seconds)

    def _failures(self) -> dict[int, ProcessFailure]:
        """Workers that failed on their own: exited non-zero before we signalled them, or
        wrote an error file (then they failed, even if our signal ended them)."""
        out: dict[int, ProcessFailure] = {}
        for w in self.workers:
            if w.rc in (None, 0) or (w.signalled and not os.path.exists(w.error_file)):
                continue
            assert w.proc is not None and w.rc is not None
            # Without an error file (no @record) the failure is the last traceback on stderr,
            # timed when it arrived: closer to when the error happened than the exit, which
            # comes after the worker's teardown (and whose order among workers is a race).
            cause = w.tracebacks.last
            out[w.rank] = ProcessFailure(
                local_rank=w.local_rank,
                rank=w.rank,
                pid=w.proc.pid,
                exitcode=w.rc,
                error_file=w.error_file if os.path.exists(w.error_file) else "",
                stderr_tail="".join(w.tail),
                observed_ns=w.exit_ns,
                hostname=self._host_name(self._assignment),
                message=cause.message if cause is not None else "",
                timestamp_ns=cause.time_ns if cause is not None else 0,
            )
        return out

    def _stopped(self, why: str, failed: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
        """This node's workers that the launcher stopped (not in ``failed``), for a report that
        names every worker of the node: what ended them and why."""
        out: dict[int, ProcessFailure] = {}
        for w in self.workers:
            if w.rank in failed or w.proc is None or w.rc in (None, 0):
                continue
            f = ProcessFailure(
                local_rank=w.local_rank,
                rank=w.rank,
                pid=w.proc.pid,
                exitcode=w.rc,
                stderr_tail="".join(w.tail),
                observed_ns=w.exit_ns,
                hostname=self._host_name(self._assignment),
            )
            f.message = why
            out[w.rank] = f
        return out

    # -- workers ------------------------------------------------------------------------------

    def _env(self, w: _Worker, a: Assignment) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.extra_env)
        env.update(
            {
                "LOCAL_RANK": str(w.local_rank),
                "RANK": str(w.rank),
                "GROUP_RANK": str(a.node_rank),
                "ROLE_RANK": str(w.rank),
                "ROLE_NAME": spec.config.role,
                "LOCAL_WORLD_SIZE": str(spec.config.nproc_per_node),
                "WORLD_SIZE": str(a.world_size),
                "GROUP_WORLD_SIZE": str(a.nnodes),
                "ROLE_WORLD_SIZE": str(a.world_size),
                "MASTER_ADDR": a.master_addr,
                "MASTER_PORT": str(a.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(a.round),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.config.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.config.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_ERROR_FILE": w.error_file,
            }
        )
        if spec.config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def _argv(self, w: _Worker) -> list[str]:
        spec = self.spec
        if spec.fn is not None:
            payload = os.path.join(self.run_dir, "entrypoint.pkl")
            if not os.path.exists(payload):
                with open(payload, "wb") as f:
                    pickle.dump(list(sys.path), f)
                    pickle.dump({"fn": spec.fn, "args": spec.fn_args}, f)
            return [sys.executable, "-u", "-m", "aiodist.launcher._bootstrap", payload, w.result_file]
        assert spec.cmd is not None
        return [arg.replace("${local_rank}", str(w.local_rank)) for arg in spec.cmd]

    def _prefix(self, w: _Worker) -> bytes:
        cfg = self.spec.config
        tpl = cfg.log_line_prefix_template or "[rank${rank}]:"
        text = tpl.replace("${rank}", str(w.rank)).replace("${local_rank}", str(w.local_rank)).replace("${role_name}", cfg.role)
        return text.encode()

    async def _start_worker(self, w: _Worker, a: Assignment) -> None:
        spec = self.spec
        argv = self._argv(w)
        pass_fds: tuple[int, ...] = ()
        if sys.platform.startswith("linux"):
            life = self._lifeline()
            grace = min(spec.config.stop_timeout, ORPHAN_GRACE_S)
            argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), str(life), f"{grace:g}", *argv]
            pass_fds = (life,)
        w.proc = await asyncio.create_subprocess_exec(
            *argv,
            pass_fds=pass_fds,
            env=self._env(w, a),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        show = spec.config.local_ranks_filter is None or w.local_rank in spec.config.local_ranks_filter
        for bit, stream, console in ((Std.OUT, w.proc.stdout, sys.stdout), (Std.ERR, w.proc.stderr, sys.stderr)):
            assert stream is not None
            redirected = bool(spec.redirects.get(w.local_rank, 0) & bit)
            teed = bool(spec.tee.get(w.local_rank, 0) & bit)
            f: IO[bytes] | None = None
            if redirected or teed:
                f = _open_log(os.path.join(w.dir, "stdout.log" if bit == Std.OUT else "stderr.log"))
                w.files.append(f)
            to_console = show and (teed or not redirected)
            out = self._console(console) if to_console else None
            w.pumps.append(asyncio.ensure_future(self._pump(w, stream, out, f, bit == Std.ERR)))
        w.watcher = asyncio.ensure_future(self._watch(w))

    async def _watch(self, w: _Worker) -> None:
        assert w.proc is not None
        w.rc = await w.proc.wait()
        w.exit_ns = time.time_ns()
        if w.rc != 0 and not w.signalled:
            # Let the pumps catch up so the stderr tail is complete (bounded).
            await asyncio.wait(w.pumps, timeout=1.0)
        self._wake.set()

    async def _pump(self, w: _Worker, stream: asyncio.StreamReader, console: Console | None, f: IO[bytes] | None, is_err: bool) -> None:
        """Copy one stream of a worker: raw into its log file, whole lines with the prefix to
        the console, stderr lines into the tail. Always reads to EOF (a worker must never block
        on a full pipe), whatever happens to the console (it never blocks: ``Console``) or the
        file."""
        prefix = self._prefix(w) + b" "
        pending = b""
        cut = False
        while True:
            chunk = await stream.read(_CHUNK)
            if not chunk:
                break
            if f is not None:
                try:
                    f.write(chunk)
                    f.flush()
                except (OSError, ValueError) as exc:
                    self.log.warning("rank %d: cannot write its log file any more: %s", w.rank, exc)
                    f = None
            *lines, pending = (pending + chunk).split(b"\n")
            if cut and lines and not lines[0]:
                del lines[0]  # the newline that ends a line already passed on in pieces
            cut = False
            if len(pending) > _CHUNK:  # a very long line (or \r progress bars): pass it on in pieces
                lines.append(pending)
                pending = b""
                cut = True
            if lines:
                if is_err:
                    now = time.time_ns()
                    for line in lines:
                        text = line.decode(errors="replace")
                        w.tail.append(text + "\n")
                        w.tracebacks.feed(text, now)
                if console is not None:
                    console.write(b"".join(prefix + line + b"\n" for line in lines))
        if pending:
            if is_err:
                text = pending.decode(errors="replace")
                w.tail.append(text + "\n")
                w.tracebacks.feed(text, time.time_ns())
            if console is not None:
                console.write(prefix + pending + b"\n")

    async def _drain(self, w: _Worker) -> None:
        if w.pumps:
            done, pending = await asyncio.wait(w.pumps, timeout=2.0)
            for t in pending:
                t.cancel()
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    self.log.debug("output pump of rank %d: %s", w.rank, t.exception())
            w.pumps = []
        for f in w.files:
            f.close()
        w.files = []

    async def _stop_workers(self, sig: signal.Signals) -> None:
        """Signal every live worker's process group; SIGKILL what is left after the grace."""
        live = [w for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for w in live:
            w.signalled = True
            self._killpg(w, sig)
        deadline = time.monotonic() + self.spec.config.stop_timeout
        for w in live:
            assert w.proc is not None
            try:
                await asyncio.wait_for(w.proc.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.log.warning("rank %d did not exit %.1f s after %s: SIGKILL", w.rank, self.spec.config.stop_timeout, sig.name)
                self._killpg(w, signal.SIGKILL)
                try:
                    await asyncio.wait_for(w.proc.wait(), 5.0)
                except TimeoutError:
                    self.log.error("rank %d (pid %d) survived SIGKILL", w.rank, w.proc.pid)
        # The group may hold grandchildren that outlive the worker: they go too.
        for w in self.workers:
            if w.proc is not None:
                self._killpg(w, signal.SIGKILL, quiet=True)
        for w in self.workers:
            await self._drain(w)

    def _killpg(self, w: _Worker, sig: signal.Signals, quiet: bool = False) -> None:
        assert w.proc is not None
        try:
            os.killpg(w.proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            if not quiet:
                self.log.warning("could not signal rank %d: %s", w.rank, exc)
