"""The launcher's pure decisions (aiodist.launcher._decide) as tables: one row per case."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from aiodist.launcher._decide import (
    Close,
    Exit,
    Report,
    Restart,
    Shortfall,
    State,
    Stop,
    View,
    Wait,
    WaitFor,
    Why,
    close_round,
    heartbeat_interval,
    next_action,
)


@dataclass(frozen=True)
class F:
    rank: int
    timestamp_ns: int
    is_comm_error: bool = False


RUN2 = (Exit(0), Exit(1))
HB = 30.0
T = 1000.0  # "now" in the multi-node rows; the store answered at T - 1
MULTI = {"nnodes": 2, "store_ok_at": T - 1, "peers": {1: T - 2}, "heartbeat_timeout": HB}
A, B, C = F(0, 30), F(1, 10, is_comm_error=True), F(2, 20)

ROWS = [
    ("single node: all healthy", View(now=T, workers=RUN2), Wait(None)),
    ("single node: one still runs, one exited 0", View(now=T, workers=(Exit(0, 0), Exit(1))), Wait(None)),
    ("single node: every worker exited 0", View(now=T, workers=(Exit(0, 0), Exit(1, 0))), Stop(Why.SUCCEEDED)),
    ("one worker failed", View(now=T, workers=(Exit(0, 1), Exit(1))), Stop(Why.WORKER_FAILED)),
    ("one worker died of SIGKILL", View(now=T, workers=(Exit(0), Exit(1, -9))), Stop(Why.WORKER_FAILED)),
    ("a failure beats another's success", View(now=T, workers=(Exit(0, 0), Exit(1, 2))), Stop(Why.WORKER_FAILED)),
    ("SIGTERM to the agent", View(now=T, workers=RUN2, signal="SIGTERM"), Stop(Why.SIGNAL)),
    ("a signal beats a worker's failure", View(now=T, workers=(Exit(0, 1),), signal="SIGINT"), Stop(Why.SIGNAL)),
    ("multi: all healthy, the next look due", View(now=T, workers=RUN2, **MULTI), Wait(HB - 1 + 0.01)),
    ("multi: this node done, others not yet", View(now=T, workers=(Exit(0, 0), Exit(1, 0)), **MULTI), Wait(HB - 1 + 0.01)),
    ("multi: every node done", View(now=T, workers=(Exit(0, 0), Exit(1, 0)), all_done=True, **MULTI), Stop(Why.SUCCEEDED)),
    ("multi: remote failure", View(now=T, workers=RUN2, remote={"rank": 3}, **MULTI), Stop(Why.REMOTE_FAILED)),
    ("multi: remote failure after we finished", View(now=T, workers=(Exit(0, 0),), remote={"rank": 3}, **MULTI), Stop(Why.REMOTE_FAILED)),
    ("multi: a local failure beats a remote one", View(now=T, workers=(Exit(0, 1),), remote={"rank": 3}, **MULTI), Stop(Why.WORKER_FAILED)),
    (
        "multi: stale heartbeat of node 2",
        View(now=T, workers=RUN2, nnodes=3, store_ok_at=T - 1, peers={1: T - 2, 2: T - 1 - HB - 0.5}, heartbeat_timeout=HB),
        Stop(Why.NODE_SILENT, node=2),
    ),
    (
        "multi: two stale: the longer silent named",
        View(now=T, workers=RUN2, nnodes=3, store_ok_at=T, peers={1: T - HB - 5, 2: T - HB - 1}, heartbeat_timeout=HB),
        Stop(Why.NODE_SILENT, node=1),
    ),
    (
        "multi: store silent: the store is lost, not the peers",
        View(now=T, workers=RUN2, nnodes=2, store_ok_at=T - HB - 1, peers={1: T - HB - 2}, heartbeat_timeout=HB),
        Stop(Why.STORE_LOST),
    ),
    (
        "multi: store silent, but not for the timeout yet",
        View(now=T, workers=RUN2, nnodes=2, store_ok_at=T - HB + 2, peers={1: T - HB + 1}, heartbeat_timeout=HB),
        Wait(2 + 0.01),
    ),
    ("failed round: restarts left", View(now=T, state=State.FAILED, failures=(A,), restarts=0, max_restarts=2), Restart(1)),
    ("failed round: last restart", View(now=T, state=State.FAILED, failures=(A,), restarts=1, max_restarts=2), Restart(2)),
    ("failed round: no restart left", View(now=T, state=State.FAILED, failures=(A,), restarts=2, max_restarts=2), Report(A)),
    (
        "failed round: root cause is the earliest non-comm failure",
        View(now=T, state=State.FAILED, failures=(A, B, C), max_restarts=0),
        Report(C),
    ),
    ("failed round: only comm errors: the earliest", View(now=T, state=State.FAILED, failures=(B,), max_restarts=0), Report(B)),
    ("failed round: nothing known", View(now=T, state=State.FAILED, max_restarts=0), Report(None)),
    ("failed round, then a signal", View(now=T, state=State.FAILED, signal="SIGTERM", failures=(A,), max_restarts=3), Stop(Why.SIGNAL)),
    # --keep-survivors: a worker's death stops no other; the round ends when every worker has
    ("keep: one died, one runs: wait", View(now=T, workers=(Exit(0, -9), Exit(1)), keep_survivors=True), Wait(None)),
    ("keep: one failed, the other ended 0", View(now=T, workers=(Exit(0, 0), Exit(1, 1)), keep_survivors=True), Stop(Why.WORKER_FAILED)),
    ("keep: all exited 0", View(now=T, workers=(Exit(0, 0), Exit(1, 0)), keep_survivors=True), Stop(Why.SUCCEEDED)),
    ("keep: a signal still stops", View(now=T, workers=(Exit(0, 1), Exit(1)), signal="SIGTERM", keep_survivors=True), Stop(Why.SIGNAL)),
    (
        "keep, multi: a remote failure stops no running worker",
        View(now=T, workers=RUN2, remote={"rank": 3}, keep_survivors=True, **MULTI),
        Wait(HB - 1 + 0.01),
    ),
    (
        "keep, multi: this node's workers ended 0, another's failed",
        View(now=T, workers=(Exit(0, 0),), remote={"rank": 3}, keep_survivors=True, **MULTI),
        Stop(Why.REMOTE_FAILED),
    ),
    (
        "keep, multi: a node that failed and went quiet is not judged silent",
        View(
            now=T,
            workers=RUN2,
            nnodes=3,
            store_ok_at=T,
            peers={1: T - HB - 5},
            remote={"rank": 3},
            heartbeat_timeout=HB,
            keep_survivors=True,
        ),
        Wait(HB + 0.01),
    ),
    (
        "keep, multi: a silent node before any failure is still named",
        View(now=T, workers=RUN2, nnodes=3, store_ok_at=T, peers={1: T - HB - 5}, heartbeat_timeout=HB, keep_survivors=True),
        Stop(Why.NODE_SILENT, node=1),
    ),
    (
        "keep, multi: the store silent still ends the round",
        View(now=T, workers=RUN2, nnodes=2, store_ok_at=T - HB - 1, heartbeat_timeout=HB, keep_survivors=True),
        Stop(Why.STORE_LOST),
    ),
]


@pytest.mark.parametrize(("case", "view", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_next_action(case: str, view: View, expected: object) -> None:
    got = next_action(view)
    if isinstance(expected, Wait) and isinstance(got, Wait) and expected.seconds is not None:
        assert got.seconds == pytest.approx(expected.seconds)
    else:
        assert got == expected, case


def test_rows_cover_every_decision() -> None:
    kinds = {type(r[2]) for r in ROWS} | {r[2].why for r in ROWS if isinstance(r[2], Stop)}
    assert kinds >= {Wait, Stop, Restart, Report, *Why}


def test_heartbeat_interval() -> None:
    assert heartbeat_interval(30.0) == 1.0 and heartbeat_interval(1.5) == 0.5


D = 600.0  # the join deadline (now = 0 unless said)
CLOSE_ROWS = [
    ("static 2 of 2: the second closes", (2, 2, 2, 0.0, D, 0.0, 30.0), Close(2)),
    ("static 1 of 2: wait for the 2nd arrival", (1, 2, 2, 0.0, D, None, 30.0), WaitFor(2, D)),
    ("elastic 1:4, none of the min yet", (0, 1, 4, 0.0, D, None, 30.0), WaitFor(1, D)),
    ("elastic 2:4 at 2: wait for the close or the last call", (2, 2, 4, 5.0, D, 5.0, 30.0), WaitFor(None, 30.0)),
    ("elastic 2:4 at 3 after the last call: close with 3", (3, 2, 4, 40.0, D, 5.0, 30.0), Close(3)),
    ("elastic 2:4 at 4: close with 4", (4, 2, 4, 1.0, D, 0.5, 30.0), Close(4)),
    ("more than max arrived: close with max", (5, 2, 4, 1.0, D, 0.5, 30.0), Close(4)),
    ("last call cut by the join deadline", (2, 2, 4, 590.0, D, 580.0, 30.0), WaitFor(None, 10.0)),
    ("min reached at the deadline: close", (2, 2, 4, D, D, 590.0, 30.0), Close(2)),
    ("short at the deadline", (1, 2, 2, D, D, None, 30.0), Shortfall()),
]


@pytest.mark.parametrize(("case", "args", "expected"), CLOSE_ROWS, ids=[r[0] for r in CLOSE_ROWS])
def test_close_round(case: str, args: tuple, expected: object) -> None:  # type: ignore[type-arg]
    assert close_round(*args) == expected, case
