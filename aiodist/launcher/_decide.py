"""The launcher's decisions, apart from their effects: what an agent does next, from what it
has seen of its workers, of the other nodes and of the rendezvous store.

Pure: no I/O and no clock (the caller passes ``now``, a ``time.monotonic()`` reading). The
agent's monitor loop (``aiodist.launcher.agent``) builds a ``View``, asks ``next_action`` and
carries the answer out; ``close_round`` does the same for the rendezvous's "is the round
closed" question. Tested as tables in tests/test_launcher_decide.py.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = [
    "Why",
    "State",
    "Exit",
    "View",
    "Wait",
    "Stop",
    "Restart",
    "Report",
    "Action",
    "next_action",
    "root_cause",
    "heartbeat_interval",
    "Close",
    "Shortfall",
    "WaitFor",
    "close_round",
]


class Why(enum.Enum):
    """Why a round ends."""

    SUCCEEDED = "succeeded"  # every worker of every node exited 0
    SIGNAL = "signal"  # this launcher got SIGINT/SIGTERM/SIGHUP/SIGQUIT
    WORKER_FAILED = "worker failed"  # a worker of this node exited non-zero or died of a signal
    REMOTE_FAILED = "remote failed"  # another node published a failure (or its launcher's signal)
    NODE_SILENT = "node silent"  # another node's heartbeat stood still for the heartbeat timeout
    STORE_LOST = "store lost"  # the rendezvous store has not answered for the heartbeat timeout


class State(enum.Enum):
    RUNNING = "running"  # the round's workers run (or some have exited)
    FAILED = "failed"  # the round is over, failed; its failures are gathered


@dataclass(frozen=True)
class Exit:
    """One worker of this node: ``rc`` None while it runs, ``-N`` when signal N ended it."""

    rank: int
    rc: int | None = None


class _Failure(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def is_comm_error(self) -> bool: ...
    @property
    def timestamp_ns(self) -> int: ...


F = TypeVar("F", bound=_Failure)


@dataclass(frozen=True)
class View:
    """What the agent knows at ``now``.

    ``peers``: for each other node, when its heartbeat counter was last seen moving;
    ``store_ok_at``: when the rendezvous store last answered (a heartbeat look). A peer is
    judged against ``store_ok_at``, not ``now``: while the store itself is silent nobody's
    heartbeat can be seen, and the store is what is lost, not the peers.
    """

    now: float
    state: State = State.RUNNING
    workers: tuple[Exit, ...] = ()
    nnodes: int = 1
    signal: str | None = None
    remote: Mapping[str, Any] | None = None  # the round's first failure, published by any node
    all_done: bool = False  # every node marked its workers done
    peers: Mapping[int, float] = field(default_factory=dict)
    store_ok_at: float = 0.0  # multi-node views only (a node on its own has no store to watch)
    heartbeat_timeout: float = 30.0
    failures: Sequence[_Failure] = ()  # State.FAILED: the round's failures (every node's known ones)
    restarts: int = 0  # restarts used so far (the round's number)
    max_restarts: int = 0
    keep_survivors: bool = False  # aiodist-run --keep-survivors: a worker's death stops no other


@dataclass(frozen=True)
class Wait:
    """Nothing to do: wait for news (a worker's exit, a signal, a store reply), at most
    ``seconds`` (None: no deadline of its own; single-node rounds wait for their workers)."""

    seconds: float | None


@dataclass(frozen=True)
class Stop:
    """End the round (stop the workers that still run): ``why``; ``node``: the silent one."""

    why: Why
    node: int | None = None


@dataclass(frozen=True)
class Restart:
    """The round failed and a restart is left: join round ``round``."""

    round: int


@dataclass(frozen=True)
class Report:
    """The round failed with no restart left: report, ``root_cause`` first (None: no failure
    of a worker is known, an agent's observation is all there is)."""

    root_cause: Any


Action = Wait | Stop | Restart | Report


def heartbeat_interval(timeout: float) -> float:
    """How often an agent counts its heartbeat and looks at the others': every second, or a
    third of the timeout when that is shorter (so a beat or two may be lost, not three)."""
    return min(1.0, timeout / 3)


def root_cause(failures: Sequence[F]) -> F | None:
    """The first failure, as ``ChildFailedError.get_first_failure`` picks it: communication
    errors (usually a peer's exit seen from here) after the others, then the earliest, then
    the lowest rank."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.is_comm_error, f.timestamp_ns, f.rank))


def next_action(v: View) -> Action:
    """The one thing to do next (see ``View``; the module docstring). In order:

    1. a signal: ``Stop(SIGNAL)``;
    2. a failed round: ``Restart`` while restarts are left, else ``Report``;
    3. ``keep_survivors`` (a worker's death stops no other): ``_keep_survivors``'s answer;
    4. a worker of this node failed: ``Stop(WORKER_FAILED)``;
    5. one node: ``Stop(SUCCEEDED)`` once every worker exited 0, else ``Wait``;
    6. another node failed: ``Stop(REMOTE_FAILED)``; every node done: ``Stop(SUCCEEDED)``;
    7. the store silent for the heartbeat timeout: ``Stop(STORE_LOST)``; a node's heartbeat
       still for it: ``Stop(NODE_SILENT)``; else ``Wait`` until the store's deadline."""
    if v.signal is not None:
        return Stop(Why.SIGNAL)
    if v.state is State.FAILED:
        if v.restarts < v.max_restarts:
            return Restart(v.restarts + 1)
        return Report(root_cause(v.failures))
    if v.keep_survivors:
        return _keep_survivors(v)
    if any(w.rc not in (None, 0) for w in v.workers):
        return Stop(Why.WORKER_FAILED)
    local_done = bool(v.workers) and all(w.rc == 0 for w in v.workers)
    if v.nnodes == 1:
        return Stop(Why.SUCCEEDED) if local_done else Wait(None)
    if v.remote is not None:
        return Stop(Why.REMOTE_FAILED)
    if v.all_done:
        return Stop(Why.SUCCEEDED)
    if v.now - v.store_ok_at > v.heartbeat_timeout:
        return Stop(Why.STORE_LOST)
    silent = [(seen, node) for node, seen in v.peers.items() if v.store_ok_at - seen > v.heartbeat_timeout]
    if silent:
        return Stop(Why.NODE_SILENT, node=min(silent)[1])
    # Peers are judged when the store answers (which wakes the loop); the store, by the clock.
    return Wait(max(0.0, v.store_ok_at + v.heartbeat_timeout - v.now) + 0.01)


def _keep_survivors(v: View) -> Action:
    """``next_action`` under ``--keep-survivors``: the round ends when every worker of this node
    has ended, whatever each one's end. In order:

    1. a worker still runs: one node, ``Wait``; several, the store's and the heartbeats'
       deadlines as always (a node whose workers ended goes quiet once it said how: another
       node's failure known, a silent node is not judged);
    2. every worker ended, one failed: ``Stop(WORKER_FAILED)`` (the report names it, and says
       the others went on);
    3. every worker exited 0: one node, ``Stop(SUCCEEDED)``; several, another node's failure:
       ``Stop(REMOTE_FAILED)``; every node done: ``Stop(SUCCEEDED)``; else the deadlines."""
    if v.workers and all(w.rc is not None for w in v.workers):
        if any(w.rc != 0 for w in v.workers):
            return Stop(Why.WORKER_FAILED)
        if v.nnodes == 1 or v.all_done:
            return Stop(Why.SUCCEEDED)
        if v.remote is not None:
            return Stop(Why.REMOTE_FAILED)
    elif v.nnodes == 1:
        return Wait(None)
    if v.now - v.store_ok_at > v.heartbeat_timeout:
        return Stop(Why.STORE_LOST)
    if v.remote is None:
        silent = [(seen, node) for node, seen in v.peers.items() if v.store_ok_at - seen > v.heartbeat_timeout]
        if silent:
            return Stop(Why.NODE_SILENT, node=min(silent)[1])
    return Wait(max(0.0, v.store_ok_at + v.heartbeat_timeout - v.now) + 0.01)


# -- closing a rendezvous round ---------------------------------------------------------------


@dataclass(frozen=True)
class Close:
    """Close the round with ``nodes`` nodes (compare-and-set: an earlier close wins)."""

    nodes: int


@dataclass(frozen=True)
class Shortfall:
    """Too few nodes arrived within the join timeout."""


@dataclass(frozen=True)
class WaitFor:
    """Wait until the ``arrival``-th node arrived (None: until the round is closed), at most
    ``seconds``; then look again."""

    arrival: int | None
    seconds: float


def close_round(
    count: int, min_nodes: int, max_nodes: int, now: float, deadline: float, min_at: float | None, last_call: float
) -> Close | Shortfall | WaitFor:
    """Whether an agent closes the round, from ``count`` (nodes arrived), the round's bounds,
    ``min_at`` (when this agent saw ``min_nodes`` arrive), the join ``deadline`` and
    ``last_call`` (how long a round that reached its minimum waits for more)."""
    if count >= max_nodes:
        return Close(max_nodes)
    if count >= min_nodes:
        end = min((now if min_at is None else min_at) + last_call, deadline)
        if now >= end:
            return Close(count)
        # the max-th arrival closes the round itself: wait for the close (or the last call)
        return WaitFor(None, end - now)
    if now >= deadline:
        return Shortfall()
    return WaitFor(min_nodes, deadline - now)
