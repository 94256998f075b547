"""The loop watchdog (aiodist._instrument.loop_watchdog): a rank whose event loop is blocked by
synchronous code (``time.sleep`` in a coroutine) is named with the file:line of that call, in a
WARNING and in the flight recorder; a healthy loop is never warned about; the thread goes away
with destroy_process_group, one thread for the ranks that share a loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist._instrument.loop_watchdog import WARN_ENV, loop_state, watchdog_of
from aiodist.c10d.world import current_world
from aiodist.debug.recorder import dump_flight_recorder
from aiodist.testing import run_world


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiodist loop watchdog"]


def line_of(marker: str) -> int:
    lines = open(__file__).read().splitlines()  # noqa: SIM115 - a test reading its own source
    return 1 + next(i for i, line in enumerate(lines) if marker in line and "line_of" not in line)


async def test_blocked_loop_warns_with_the_sleeping_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(WARN_ENV, "0.3")
    seen: dict[str, Any] = {}

    async def step() -> None:
        time.sleep(0.8)  # noqa: ASYNC251 - the blocking call under test  (blocking-here)

    async def fn(rank: int) -> None:
        await dist.all_reduce(np.ones(2, np.float32))
        await step()
        await asyncio.sleep(0.1)  # the loop runs again: the watchdog records the block
        seen["dump"] = dump_flight_recorder()
        seen["state"] = loop_state(current_world())

    with caplog.at_level(logging.WARNING, logger="aiodist.debug.loop"):
        await run_world(1, fn, backend="memory", timeout=10)
    where = f"tests/test_loop_watchdog.py:{line_of('(blocking-here)')} in step: time.sleep(0.8)"
    warned = [r.getMessage() for r in caplog.records if r.name == "aiodist.debug.loop" and r.levelno == logging.WARNING]
    assert any(m.startswith("rank 0: event loop blocked for ") and f"at {where}" in m for m in warned), warned
    assert any("in fn: await step()" in m for m in warned), warned  # the whole stack follows the headline
    assert any(m.startswith("rank 0: event loop ran again after ") and where in m for m in warned), warned
    entries = [e for g in seen["dump"]["groups"] for e in g["entries"] if e["op"] == "loop_blocked"]
    assert len(entries) == 1 and entries[0]["kind"] == "loop" and entries[0]["state"] == "completed", entries
    assert entries[0]["meta"]["local"]["at"].startswith(where) and 0.7 < entries[0]["meta"]["local"]["blocked_s"] < 2.0
    assert seen["state"]["blocked"] is False and seen["state"]["last_block"]["at"].startswith(where)


async def test_healthy_loop_is_not_warned_about(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(WARN_ENV, "0.6")  # 12x the longest synchronous step below: a loaded CI machine stays under it

    async def fn(rank: int) -> float:
        t = np.ones(256, np.float32)
        # a fixed count, the same on every rank (a per-rank clock let one rank issue one more
        # all_reduce than the other, which had already destroyed: a fresh-clone CI run hit it)
        for _ in range(16):  # about 1 s: busy, but never holding the loop for long
            await dist.all_reduce(t)
            time.sleep(0.05)  # noqa: ASYNC251 - short synchronous work, well under the threshold
            await asyncio.sleep(0.01)
        dog = watchdog_of(current_world())
        assert dog is not None and dog.beats >= 2
        return dog.max_lag_s

    with caplog.at_level(logging.WARNING, logger="aiodist.debug.loop"):
        lags = await run_world(2, fn, backend="gloo", timeout=10)
    assert [r.getMessage() for r in caplog.records if r.name == "aiodist.debug.loop"] == []
    assert max(lags) < 0.6


async def test_watchdog_thread_shared_by_a_loop_and_gone_after_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WARN_ENV, raising=False)
    before = len(watchdog_threads())
    seen: list[Any] = []
    names: list[str] = []

    async def fn(rank: int) -> None:
        dog = watchdog_of(current_world())
        assert dog is not None and dog.thread.is_alive() and dog.warn_s == 2.0
        seen.append(dog)
        await dist.barrier()  # every rank is initialised (and watched) now
        if rank == 0:
            names.append(dog.labels())

    await run_world(3, fn, backend="memory", timeout=10)
    assert len({id(d) for d in seen}) == 1  # the three ranks share one loop, so one watchdog
    assert names == ["rank 0, rank 1, rank 2"]
    assert not seen[0].thread.is_alive()  # destroy_process_group of the last rank stopped it
    assert len(watchdog_threads()) == before


async def test_watchdog_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WARN_ENV, "0")

    async def fn(rank: int) -> None:
        assert watchdog_of(current_world()) is None and loop_state(current_world()) is None

    await run_world(1, fn, backend="memory", timeout=10)
