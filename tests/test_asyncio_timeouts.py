"""asyncio's own timeouts around aiodist's calls and Works: each raises at its deadline on every
supported Python, the op goes on in its group and writes its outputs when the late peer comes,
and the wait given up is logged once (op, group, seq, "still running")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world

LATE_S = 0.4  # rank 1 joins the all_reduce this late
T_S = 0.05  # the caller's asyncio deadline on rank 0


async def _wait_for_work(x: np.ndarray) -> None:
    work = await dist.all_reduce(x, async_op=True)
    try:
        await asyncio.wait_for(work, T_S)
    finally:
        _WORKS.append(work)


async def _timeout_around_work(x: np.ndarray) -> None:
    work = await dist.all_reduce(x, async_op=True)
    _WORKS.append(work)
    async with asyncio.timeout(T_S):
        await work


async def _timeout_around_call(x: np.ndarray) -> None:
    async with asyncio.timeout(T_S):
        await dist.all_reduce(x)


async def _wait_for_call(x: np.ndarray) -> None:
    await asyncio.wait_for(dist.all_reduce(x), T_S)


_WORKS: list[Any] = []
WAYS: dict[str, Callable[[np.ndarray], Awaitable[None]]] = {
    "wait_for(work)": _wait_for_work,
    "timeout: await work": _timeout_around_work,
    "timeout: await all_reduce": _timeout_around_call,
    "wait_for(all_reduce)": _wait_for_call,
}


@pytest.mark.parametrize("way", list(WAYS))
async def test_asyncio_timeout_raises_at_its_deadline_and_the_op_goes_on(way: str, caplog: pytest.LogCaptureFixture) -> None:
    _WORKS.clear()
    caplog.set_level(logging.WARNING, logger="aiodist.c10d")
    seen: dict[str, float] = {}

    async def fn(rank: int) -> None:
        x = np.full(4, float(rank + 1))
        if rank == 1:
            await asyncio.sleep(LATE_S)
            await dist.all_reduce(x)
        else:
            t0 = time.perf_counter()
            with pytest.raises(TimeoutError):
                await WAYS[way](x)
            seen["raised_after"] = time.perf_counter() - t0
            assert (x == 1.0).all()  # not reduced yet: the op waits for rank 1
            await asyncio.sleep(LATE_S + 0.5)  # rank 1 comes: the op completes, on its own
        assert (x == 3.0).all(), way
        await dist.barrier()  # the group is still in step

    await run_world(2, fn, timeout=10)
    # at its deadline, not when the op ended (rank 1 came LATE_S after)
    assert seen["raised_after"] < LATE_S - 0.1, seen
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert len(said) == 1, said  # once
    assert said[0].startswith("all_reduce on default_pg") and "seq 0" in said[0] and "will write its outputs" in said[0]
    for w in _WORKS:
        assert w.is_completed() and w.is_success()


async def test_a_work_is_an_awaitable_to_asyncio_helpers_and_keeps_its_future_methods() -> None:
    async def fn(rank: int) -> None:
        x = np.ones(3)
        w = await dist.all_reduce(x, async_op=True)
        assert isinstance(w, asyncio.Future) and not asyncio.isfuture(w)
        assert w.cancel() is False
        got: list[Any] = []
        w.add_done_callback(got.append)
        done, _ = await asyncio.wait([asyncio.ensure_future(w)], timeout=5)
        assert len(done) == 1
        assert (await asyncio.gather(w)) == [[x]]
        assert await asyncio.shield(w) == [x]
        assert await asyncio.wait_for(w, 5) == [x]
        assert got == [w] and w.done() and w.result() == [x]
        assert (x == 2).all()

    await run_world(2, fn)


async def test_a_finished_wait_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiodist.c10d")

    async def fn(rank: int) -> None:
        x = np.ones(3)
        work = await dist.all_reduce(x, async_op=True)
        await asyncio.wait_for(work, 5)
        async with asyncio.timeout(5):
            await dist.all_reduce(x)
        assert (x == 4).all()

    await run_world(2, fn)
    assert not [r for r in caplog.records if "still running" in r.getMessage()]
