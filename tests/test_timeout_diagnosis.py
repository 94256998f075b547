"""A group timeout's message leads with the culprit and what it did (docs/c10d.md, "Timeouts and
broken groups"): a rank that never issued the op, a rank at another op, a store that cannot be
asked (its host stopped: SIGSTOP), and a TimeoutError raised inside an op body, which is that
body's failure, not the group's deadline. Also the pure ``explain`` on hand-made findings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist._time import Deadline
from aiodist.c10d._diagnosis import DETAIL_HINT, Findings, Note, Report, culprits_of, explain
from aiodist.testing import run_world
from aiodist.testing.ports import free_port

LIMIT_S = 1.0


async def _fail_text(aw: Any) -> str:
    """The error an op fails with, as its type's name and message."""
    try:
        await aw
    except dist.DistError as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the op completed")


async def _warm_up() -> None:
    for _ in range(2):  # seq 0 and 1 complete: the case is at seq 2
        await dist.all_reduce(np.ones(4, np.float32))


# -- (b) a rank that never issues the op ----------------------------------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_a_rank_that_never_issues_the_op_is_named_first() -> None:
    done = asyncio.Event()
    failed: list[int] = []

    async def fn(rank: int) -> str | None:
        if rank == 3:  # alive, never calls it
            await asyncio.wait_for(done.wait(), 10)
            return None
        try:
            return await _fail_text(dist.all_reduce(np.ones(4, np.float32)))
        finally:
            failed.append(rank)
            if len(failed) == 3:
                done.set()

    start = time.monotonic()
    msgs = await run_world(4, fn, backend="gloo", timeout=15, pg_timeout=LIMIT_S)
    assert time.monotonic() - start < LIMIT_S + 3
    for rank, msg in enumerate(msgs[:3]):
        assert msg is not None
        assert msg.startswith("DistTimeoutError: rank 3 never issued all_reduce seq 0 of group 0"), msg
        assert f"seq 0 timed out after 1 s on rank {rank}" in msg, msg  # the detail stays, after
        assert "ranks stuck outside this op (never reported being in it): [3]" in msg, msg


# -- (a) ranks at different ops ---------------------------------------------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_a_rank_at_another_op_on_the_same_seq_is_named_with_that_op() -> None:
    """Rank 0 calls broadcast at seq 2, the others all_reduce. Frames of the two ops may meet, so
    a desync check (when frames carry digests) may fail the op first; otherwise the timeout's
    headline names rank 0 and its broadcast."""

    async def fn(rank: int) -> str:
        await _warm_up()
        if rank == 0:
            return await _fail_text(dist.broadcast(np.ones(4, np.float32), src=1))
        return await _fail_text(dist.all_reduce(np.ones(4, np.float32)))

    msgs = await run_world(4, fn, backend="gloo", timeout=15, pg_timeout=LIMIT_S)
    for msg in msgs[1:]:
        if "desync" in msg.lower():  # the always-on digest saw it first
            assert "broadcast" in msg and "all_reduce" in msg, msg
            continue
        assert "DistTimeoutError: rank 0 issued broadcast at seq 2, not all_reduce;" in msg, msg
        assert msg.endswith(DETAIL_HINT), msg


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.3 s a run); a second loop waits them out again for the same result")
async def test_a_rank_in_another_op_where_no_frames_meet_is_found_there() -> None:
    """Rank 0 waits in a point-to-point receive (its own numbering, no frame of the collective
    meets it) while the others call all_reduce at seq 2: they find it through its note."""

    async def fn(rank: int) -> str:
        await _warm_up()
        if rank == 0:
            return await _fail_text(dist.recv(np.ones(4, np.float32), src=1))
        return await _fail_text(dist.all_reduce(np.ones(4, np.float32)))

    msgs = await run_world(4, fn, backend="gloo", timeout=15, pg_timeout=LIMIT_S)
    assert "recv on default_pg" in msgs[0] and "timed out after 1 s on rank 0" in msgs[0], msgs[0]
    for msg in msgs[1:]:
        assert msg.startswith("DistTimeoutError: rank 0 never issued all_reduce seq 2 of group 0: it is in recv p2p seq 0"), msg
        assert "of group 0;" in msg and "all_reduce on default_pg" in msg, msg


# -- (d) a TimeoutError of the op body's own ----------------------------------------------------------------


async def test_a_timeout_error_raised_inside_an_op_body_is_not_the_groups_deadline() -> None:
    """A backend whose receive gives up on its own (a builtin TimeoutError after 50 ms) fails the
    op at once as that error; the group's 5 s deadline did not fire and is not reported."""

    class GivesUp:
        def __init__(self, inner: Any) -> None:
            self.inner, self.rank, self.size = inner, inner.rank, inner.size

        async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
            await self.inner.send(peer, buf, tag)

        def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool:
            return False

        async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
            await asyncio.sleep(0.05)
            raise TimeoutError("the backend's own receive deadline (50 ms)")

    async def fn(rank: int) -> tuple[str, float]:
        pg = dist.GroupMember.WORLD
        assert isinstance(pg, dist.ProcessGroup)
        real = pg.backend.channel
        pg.backend.channel = lambda *a: GivesUp(real(*a))  # type: ignore[method-assign]
        t0 = time.monotonic()
        msg = await _fail_text(dist.all_reduce(np.ones(4, np.float32)))
        return msg, time.monotonic() - t0

    for msg, took in await run_world(2, fn, timeout=15, pg_timeout=5.0):
        assert took < 2.5, (msg, took)
        assert msg.startswith("DistBackendError: all_reduce on default_pg"), msg
        assert "TimeoutError: the backend's own receive deadline (50 ms)" in msg, msg
        assert "timed out after 5 s" not in msg, msg


async def test_deadline_knows_whether_it_fired() -> None:
    d = Deadline(0.01)
    with pytest.raises(TimeoutError):
        async with d:
            await asyncio.sleep(1)
    assert d.fired
    mine = Deadline(5)
    with pytest.raises(TimeoutError, match="inner"):
        async with mine:
            raise TimeoutError("inner")
    assert not mine.fired


# -- (c) the store's host is stopped ---------------------------------------------------------------------------

_WORKER = Path(__file__).resolve().parent / "helpers" / "stopped_store_job.py"


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_a_stopped_store_host_is_said_and_no_live_rank_is_blamed() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("AIODIST_DEBUG", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(_WORKER), str(port), str(r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    try:
        for p in procs:  # every rank past the first op (each readline bounded by the test's timeout)
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.strip() == "ready", (line, p.poll())
        os.kill(procs[0].pid, signal.SIGSTOP)
        for p in procs[1:]:  # all at once: their all_reduce starts together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=20) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate(timeout=10)
    for rank, (out, err) in enumerate(outs, start=1):
        res = json.loads(out.strip().splitlines()[-1])
        msg = res.get("message", "")
        assert res["error"] in ("DistTimeoutError", "DistBackendError"), (res, err)
        assert "the store did not answer within 0.06 s, so no rank is named as the cause" in msg, (rank, msg)
        assert "never issued" not in msg and "stuck outside" not in msg, (rank, msg)  # nobody blamed by inference
        assert " is in " not in msg and "in the op but" not in msg and "issued" not in msg, (rank, msg)
        assert DETAIL_HINT in msg, (rank, msg)  # (inside a peer's abort, where that came first)


# -- the decision alone ------------------------------------------------------------------------------------------


def test_explain_names_a_silent_rank_in_the_op_and_what_it_did() -> None:
    now = 100.0
    found = Findings({1: Report("all_reduce", (0,), {0: 90.0}), 2: Report("all_reduce", (1,))})
    head, tail, hint = explain(2, "all_reduce", 5, 7, found, since=89.0, now=now, grace=0.5)
    assert head == "rank 0 is in the op but sent nothing for 10.0 s (stopped or overloaded)"
    assert "waits seen through the store: rank 1 on [0]" in tail and "in this op but silent" in tail and not hint

    found = Findings({0: Report("all_reduce", (3,))})
    head, tail, _ = explain(0, "all_reduce", 0, 7, found, since=0.0, now=1.0, grace=0.1)
    assert head.startswith("rank 3 never issued all_reduce seq 0 of group 7")

    found = Findings({0: Report("all_reduce", (3,))}, notes={3: [Note(1, "seq 4", "barrier", 0.5)]})
    head, _, _ = explain(0, "all_reduce", 0, 7, found, since=0.0, now=1.0, grace=0.1)
    assert head == "rank 3 never issued all_reduce seq 0 of group 7: it is in barrier seq 4 of group 1"

    # rank 3 waits at seq 4 of this group on rank 1, whose chain there ends at rank 2 (stopped
    # mid-loop): rank 2 is blamed, not the waiting rank 3 (every survivor must name the same)
    found = Findings({0: Report("all_reduce", (3,))}, notes={3: [Note(7, "seq 4", "barrier", 0.5, 4)]}, beyond={3: ([1], [2])})
    head, _, _ = explain(0, "all_reduce", 5, 7, found, since=0.0, now=1.0, grace=0.1)
    assert head.endswith("waiting on rank 1 there (and through them on rank 2)"), head
    assert set(culprits_of(0, "all_reduce", 5, found)) == {2}
    found.beyond = {3: ([1], [1])}
    assert set(culprits_of(0, "all_reduce", 5, found)) == {1}
    found.beyond = {3: ([0], [0])}  # back to this rank: the waiting rank is named
    assert set(culprits_of(0, "all_reduce", 5, found)) == {3}

    found = Findings({0: Report("all_reduce", (1, 2)), 1: Report("broadcast", ()), 2: Report("broadcast", ())})
    head, _, hint = explain(0, "all_reduce", 2, 0, found, since=0.0, now=1.0, grace=0.1)
    assert head == "ranks [1, 2] issued broadcast at seq 2, not all_reduce" and hint

    found = Findings({2: Report("all_reduce", (1,))}, answered=False)
    head, tail, hint = explain(2, "all_reduce", 0, 0, found, since=0.0, now=1.0, grace=0.1)
    assert head.startswith("the store did not answer within 0.1 s") and tail == "" and hint


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.4 s a run); a second loop waits them out again for the same result")
async def test_deadline_late_is_the_timers_delay_not_the_unwinding() -> None:
    """``Deadline.late`` is measured when the timer runs: a blocked loop makes it late; a body
    that takes long to unwind after the cancel does not (the runner's "did not run" verdict)."""
    d = Deadline(0.05)
    with pytest.raises(TimeoutError):
        async with d:
            try:
                await asyncio.sleep(10)
            finally:
                await asyncio.shield(asyncio.sleep(0.6))  # slow teardown after the cancel
    assert d.fired and d.late < 0.5, d.late
    d = Deadline(0.05)
    with pytest.raises(TimeoutError):
        async with d:
            time.sleep(0.7)  # noqa: ASYNC251 - the loop is blocked past the due time: the timer runs late
            await asyncio.sleep(10)
    assert d.fired and d.late >= 0.6, d.late
    d = Deadline(5)  # a cancellation from outside is not this deadline's
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_later(0.05, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        async with d:
            await asyncio.sleep(10)
    assert not d.fired and d.late == 0.0
    task.uncancel()


async def test_a_rank_whose_report_lands_between_two_looks_is_read_not_blamed() -> None:
    """Rank 1 writes its report, then its note of the same op, just after rank 0 looked for the
    report and just before it looks for the note (a race seen in the chaos tier, where every
    rank times out together; rank 1's last note may be of another op it had in flight): rank 0
    reads the report the note says is there, follows rank 1's wait to rank 2 and names rank 2
    alone, not rank 1 as 'never issued' the op it is in."""
    from aiodist import HashStore
    from aiodist.c10d._diagnosis import NOTES, consult, culprits_of

    class LateReport(HashStore):
        """Rank 1's report and note appear right after the first look for its report."""

        looked = False

        async def check(self, keys: Any) -> bool:
            got = await super().check(keys)
            if not self.looked and list(keys) == ["aiodist/hang/3/4/1"]:
                self.looked = True
                await self.set("aiodist/hang/3/4/1", Report("reduce", (2,)).encode())
                await self.append(NOTES + "1", Note(3, "seq 4", "reduce", time.time(), 4).encode() + "\n")
                # and another op of rank 1 in flight that timed out too, noted after this one
                await self.append(NOTES + "1", Note(0, "seq 5", "reduce_scatter_tensor", time.time(), 5).encode() + "\n")
            return got

    store = LateReport()
    since = time.time() - 1
    found = await consult(store, 3, 4, 0, Report("reduce", (1, 2)), Note(3, "seq 4", "reduce", time.time(), 4), 0.5, since=since)
    assert 1 in found.reports and 1 not in found.notes, found
    assert set(culprits_of(0, "reduce", 4, found)) == {2}
