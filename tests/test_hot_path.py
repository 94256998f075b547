"""The small-op hot path: how many calls one 4-byte op costs, counted, not timed.

The real path (``test_the_real_path_stays_within_its_call_budget``): two processes over the
socket backend with shared memory (env://), the path users run, where a small op posts and
collects in its call; every Python-level call counted, in aiodist and outside it (numpy's Python
wrappers), but for the loop's own by the clock. The spin on a peer not there yet calls
``collect`` again at each turn: those repeats are the wait's, not the op's, and are left out.

The task path (the rest of this file): two ranks in this process (run_world, the in-memory backend) on a uvloop loop (its loop is C, so
every Python call counted is the op's own); ``sys.setprofile`` counts Python-level calls
("call": a function entered or a coroutine resumed) and C calls, per op and rank, leaving out
the backend's own code (it is not this path's: the socket transport has its own budget) and the
loop watchdog's timer. The count is the same on every run; the bounds are the count measured
for the current code plus about 20 %, so a regression shows and noise cannot.

This is the one place the op path's calls are counted. Each mechanism on it exists once (the
handle's constructor, the runner's ``Deadline``, the op launch, the recursive-doubling
exchange): a call that a copy written out in line would save is paid here, and counted."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world
from aiodist.testing.ports import free_port

uvloop = pytest.importorskip("uvloop")

_PKG = os.path.dirname(dist.__file__) + os.sep
#: code that is not the op's own path: the backend under it, and timers that fire by the clock
_OTHERS = tuple(
    os.path.join(_PKG, p) for p in ("backends" + os.sep, "transport" + os.sep, "wire" + os.sep, "algorithms/p2p.py", "_message.py")
) + (os.path.join(_PKG, "_instrument", "loop_watchdog.py"),)

OPS = 200
RANKS = 2
#: measured per op and rank: 59.0 Python-level calls and 54.0 C calls; the bounds leave ~20 %
PY_BOUND = 70
TOTAL_BOUND = 136


def _count(ops: int, setup: Any = None) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if not name.startswith(_OTHERS):
                counts["py"] += 1
                counts[f"{os.path.basename(name)}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            if not frame.f_code.co_filename.startswith(_OTHERS):
                counts["c"] += 1
                counts[f"C:{getattr(arg, '__qualname__', arg)}"] += 1

    async def rank(r: int) -> None:
        x = np.zeros(1, dtype=np.float32)  # 4 bytes (zeros: the sum stays put over any number of ops)
        for _ in range(20):  # warm: the group's kept checks, the recorder's slots
            await dist.all_reduce(x)
        await dist.barrier()
        if r == 0:
            sys.setprofile(prof)
        try:
            for _ in range(ops):
                await dist.all_reduce(x)
        finally:
            sys.setprofile(None)  # the first rank to finish ends the count
        assert x[0] == 0.0

    loop = uvloop.new_event_loop()
    gc.collect()  # an earlier test's garbage collected during the count runs its finalizers' calls
    gc.disable()
    try:
        loop.run_until_complete(run_world(RANKS, rank, backend="memory", timeout=60))
    finally:
        gc.enable()
        sys.setprofile(None)
        loop.close()
    return counts


def _report(counts: collections.Counter[str]) -> str:
    per = OPS * RANKS
    top = ", ".join(f"{k} {v / per:.2f}" for k, v in counts.most_common(40) if k not in ("py", "c"))
    return f"per op and rank: {counts['py'] / per:.1f} Python-level calls, {counts['c'] / per:.1f} C calls; {top}"


def test_a_small_all_reduce_stays_within_its_call_budget() -> None:
    counts = _count(OPS)
    per = OPS * RANKS
    py, total = counts["py"] / per, (counts["py"] + counts["c"]) / per
    print(_report(counts))
    assert py <= PY_BOUND, _report(counts)
    assert total <= TOTAL_BOUND, _report(counts)


def test_ops_in_tasks_share_their_groups_timer() -> None:
    """An op that runs in a task keeps its deadline on its group's clock (aiodist._time.Clock):
    no loop timer made per op (a timer made and cancelled per op cost ~2 us on uvloop). The
    loop's timers are counted by a loop that counts them (uvloop's are not Python calls)."""
    made = collections.Counter[str]()

    class Counting(uvloop.Loop):  # type: ignore[misc,name-defined]
        def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> Any:
            made[getattr(callback, "__qualname__", str(callback))] += 1
            return super().call_at(when, callback, *args, context=context)

        def call_later(self, delay: float, callback: Any, *args: Any, context: Any = None) -> Any:
            made[getattr(callback, "__qualname__", str(callback))] += 1
            return super().call_later(delay, callback, *args, context=context)

    async def rank(r: int) -> None:
        x = np.zeros(1, dtype=np.float32)
        for _ in range(OPS):
            await dist.all_reduce(x)

    loop = Counting()
    try:
        loop.run_until_complete(run_world(RANKS, rank, backend="memory", timeout=60))
    finally:
        loop.close()
    assert sum(made.values()) <= 20, made  # the clocks' few, the watchdog's, the world's own; 400 ops ran


def test_the_count_is_deterministic() -> None:
    """The bound means something only if the count does not wander: two runs, one count."""
    a, b = _count(50), _count(50)
    assert (a["py"], a["c"]) == (b["py"], b["c"]), (_report(a), _report(b))


async def test_a_cancelled_wait_leaves_the_op_running() -> None:
    """What the hot path's awaits keep (no asyncio.shield now: the waiter is the caller's own
    future): cancelling a task blocked in ``await dist.all_reduce(x)`` ends that task at once,
    while the op waits on a peer that has not called yet; the op then completes on every rank,
    and the group stays usable."""
    from aiodist.c10d.world import default_group

    go = asyncio.Event()  # both ranks are tasks of this loop

    async def rank(r: int) -> None:
        x = np.full(4, r + 1.0, np.float32)
        if r == 0:
            blocked = asyncio.ensure_future(dist.all_reduce(x))
            for _ in range(5):
                await asyncio.sleep(0)
            (work,) = default_group().pending().values()  # the op, issued, waiting on rank 1
            assert not blocked.done()
            blocked.cancel()
            done, _ = await asyncio.wait([blocked], timeout=10)  # at once; awaiting the Work itself would wait for the op
            assert blocked in done and blocked.cancelled()
            assert not work.done()
            go.set()
            async with asyncio.timeout(10):
                await work  # the op ran on without its awaiter
        else:
            await go.wait()
            await dist.all_reduce(x)
        assert (x == 3.0).all()
        y = np.ones(1, np.float32)
        await dist.all_reduce(y)  # the group is still usable
        assert y[0] == 2.0

    await run_world(RANKS, rank, backend="memory", timeout=30)


#: the real path's budget per small op and rank, all Python-level calls (the issue's goal: 30;
#: measured: all_reduce 16, broadcast 15, reduce 18, all_gather_into_tensor 16, all_gather 16, gather 16,
#: scatter 17, all_to_all_single 20, reduce_scatter_tensor 19, barrier 15; the task path, 70)
REAL_BOUND = 30
_WORKER = Path(__file__).resolve().parent / "helpers" / "hot_path_rank.py"


def _real_path(op: str) -> tuple[float, str]:
    from helpers.rank_procs import run_ranks

    port = str(free_port())
    envs = [dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2") for r in range(2)]
    for e in envs:
        e.pop("AIODIST_SHM_BYTES", None)
        e.pop("AIODIST_DEBUG", None)
    res = run_ranks([[sys.executable, str(_WORKER), op]] * 2, envs, 90)
    worst, report = 0.0, []
    for r, out in enumerate(res):
        counts, ops = out["counts"], out["ops"]
        spins = counts.get("shm/_lane.py:collect", 0) - counts.get("shm/_lane.py:now", 0)
        py = (counts.get("py", 0) - spins) / ops
        top = sorted(((v, k) for k, v in counts.items() if k not in ("py", "c")), reverse=True)[:24]
        report.append(
            f"rank {r}: {py:.1f} calls per op (spin repeats {spins / ops:.2f} left out, ops done in their call {out['eager']}): "
            + ", ".join(f"{k} {v / ops:.2f}" for v, k in top)
        )
        worst = max(worst, py)
    return worst, "; ".join(report)


@pytest.mark.subprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "op",
    [
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather_into_tensor",
        "all_gather",
        "reduce_scatter_tensor",
        "gather",
        "scatter",
        "all_to_all_single",
        "barrier",
    ],
)
def test_the_real_path_stays_within_its_call_budget(op: str) -> None:
    """Two real ranks, shared memory on: a small op posts and collects in its call, and costs at
    most REAL_BOUND Python-level calls per op and rank (the handle, the kept call's lookup, the
    post, the collect, the result, the recorder's slot)."""
    per, report = _real_path(op)
    print(report)
    assert per <= REAL_BOUND, report
