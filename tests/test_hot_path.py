"""The small-op hot path: how many calls one 4-byte all_reduce costs, counted, not timed. Two
ranks in this process (run_world, the in-memory backend) on a uvloop loop (its loop is C, so
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
import os
import sys
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world

uvloop = pytest.importorskip("uvloop")

_PKG = os.path.dirname(dist.__file__) + os.sep
#: code that is not the op's own path: the backend under it, and timers that fire by the clock
_OTHERS = tuple(
    os.path.join(_PKG, p) for p in ("backends" + os.sep, "transport" + os.sep, "wire" + os.sep, "algorithms/p2p.py", "_message.py")
) + (os.path.join(_PKG, "_instrument", "loop_watchdog.py"),)

OPS = 200
RANKS = 2
#: measured per op and rank: 51.0 Python-level calls and 50.0 C calls; the bounds leave ~20 %
PY_BOUND = 62
TOTAL_BOUND = 122


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
    try:
        loop.run_until_complete(run_world(RANKS, rank, backend="memory", timeout=60))
    finally:
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
