"""aiodist._threads' rules, in order, on real event loops in real threads (no processes): where
a call made off its home loop runs, what the caller gets back, and the refusals. The rules are
the module docstring's; tests/test_threads.py runs them in real two-rank jobs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from aiodist._pending import Pending, communicating
from aiodist._threads import ForeignWork, LoopHome
from aiodist.c10d.work import Work
from aiodist.errors import DistError, DistTimeoutError


class FakeHome(LoopHome):
    def __init__(self, loop: asyncio.AbstractEventLoop | None, patience: float = 5.0) -> None:
        self._loop = loop
        self.patience = patience

    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def start_timeout(self) -> float:
        return self.patience


@pytest.fixture
def home_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop running in a thread of its own (the World's loop of a job)."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, name="home-loop")
    t.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def make_op(home: FakeHome) -> Any:
    async def op(x: int) -> tuple[int, str]:
        await asyncio.sleep(0)
        return x * 2, threading.current_thread().name

    return communicating(op, home=home)


def test_rule1_a_closed_home_loop_refuses_at_once() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    op = make_op(FakeHome(loop))
    with pytest.raises(DistError, match=r"op\(\.\.\.\) called at .*test_threads_rules.py:\d+ on thread 'MainThread'.*loop is closed"):
        op(1)


def test_rule2_no_loop_anywhere_gives_the_usual_lazy_handle() -> None:
    loop = asyncio.new_event_loop()
    try:
        op = make_op(FakeHome(loop))
        p = op(3)
        assert isinstance(p, Pending)
        assert loop.run_until_complete(p) == (6, "MainThread")  # it runs on the loop that runs it
    finally:
        loop.close()


def test_rule3_a_loop_here_while_home_is_not_running_is_refused() -> None:
    idle = asyncio.new_event_loop()
    try:
        op = make_op(FakeHome(idle))

        async def main() -> None:
            with pytest.raises(DistError, match="not running: run the call on it"):
                op(1)

        asyncio.run(main())
    finally:
        idle.close()


def test_rule4_a_thread_without_a_loop_blocks_until_the_op_ends_on_home(home_loop: asyncio.AbstractEventLoop) -> None:
    op = make_op(FakeHome(home_loop))
    p = op(5)  # this (main) thread has no loop: blocks
    assert asyncio.run(p) == (10, "home-loop")  # awaiting it gives the value at once, on any loop
    # and asyncio.run(op(...)) on a thread: the call finished before asyncio.run started
    assert asyncio.run(op(7)) == (14, "home-loop")


def test_rule4_errors_raise_in_the_calling_thread(home_loop: asyncio.AbstractEventLoop) -> None:
    async def bad() -> None:
        raise ValueError("refused on home")

    op = communicating(bad, home=FakeHome(home_loop))
    with pytest.raises(ValueError, match="refused on home"):
        op()


def test_rule5_another_loop_awaits_the_op_run_on_home(home_loop: asyncio.AbstractEventLoop) -> None:
    op = make_op(FakeHome(home_loop))

    async def main() -> list[tuple[int, str]]:
        a, b = op(1), op(2)  # handed over in call order
        return [await b, await a]

    assert asyncio.run(main()) == [(4, "home-loop"), (2, "home-loop")]


@pytest.mark.parametrize("caller", ["thread", "loop"])
def test_a_blocked_home_loop_times_out_and_the_op_never_starts(home_loop: asyncio.AbstractEventLoop, caller: str) -> None:
    ran: list[int] = []

    async def op() -> None:
        ran.append(1)

    call = communicating(op, home=FakeHome(home_loop, patience=0.3))
    release = threading.Event()
    home_loop.call_soon_threadsafe(release.wait, 5)  # a coroutine on home blocks it (thread.join())
    try:
        with pytest.raises(DistTimeoutError, match=r"did not start the op within 0.3 s.*is blocked.*was not started"):
            if caller == "thread":
                call()
            else:
                asyncio.run(call())
    finally:
        release.set()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), home_loop).result(5)  # home ran everything queued
    assert ran == []


def test_a_work_comes_back_as_a_foreign_work_awaitable_on_any_loop(home_loop: asyncio.AbstractEventLoop) -> None:
    async def issue() -> Work:
        w = Work("all_reduce", "group 0", 3, ["out"])
        asyncio.get_running_loop().call_later(0.05, w._complete)
        return w

    call = communicating(issue, home=FakeHome(home_loop))

    async def main() -> list[Any]:
        w = await call()
        assert isinstance(w, ForeignWork) and w.seq == 3 and w.op == "all_reduce"
        outputs = await w
        return [outputs, await w.wait(), w.is_completed(), w.is_success()]

    assert asyncio.run(main()) == [["out"], True, True, True]
