"""``aiodist._time.Clock``: one loop timer for many ops' deadlines (a group's), the rules of its
docstring, each with a case that breaks it."""

from __future__ import annotations

import asyncio

from aiodist._time import Clock, Deadline


def _armed(clock: Clock, seconds: float, cell: list[asyncio.Task[None]]) -> Deadline:
    return Deadline(seconds, clock, cell, 0)


async def _sleeper() -> None:
    await asyncio.sleep(3600)


async def test_deadlines_fire_in_due_order_an_earlier_one_armed_later_moves_the_timer() -> None:
    loop = asyncio.get_running_loop()
    clock = Clock(loop)
    tasks = [asyncio.ensure_future(_sleeper()) for _ in range(3)]
    late = _armed(clock, 0.30, [tasks[0]])
    soon = _armed(clock, 0.05, [tasks[1]])  # armed after, due first: the timer moves to it
    ended = _armed(clock, 0.02, [tasks[2]])
    assert ended.end(None) is False  # ended before its time: never fires
    await asyncio.sleep(0.15)
    assert soon.fired and tasks[1].cancelled()
    assert not late.fired and not tasks[0].done()
    assert not ended.fired and not tasks[2].done()
    await asyncio.sleep(0.3)
    assert late.fired
    assert tasks[0].done() and tasks[0].cancelled()
    assert not tasks[2].done()
    tasks[2].cancel()
    assert len(clock) == 0


async def test_one_loop_timer_for_many_deadlines() -> None:
    """Arming and ending a thousand deadlines, one after the other, makes one loop timer (the
    first's), not one each."""
    loop = asyncio.get_running_loop()
    made = 0
    call_at = loop.call_at

    def counting(*args: object, **kwargs: object) -> asyncio.TimerHandle:
        nonlocal made
        made += 1
        return call_at(*args, **kwargs)  # type: ignore[arg-type]

    loop.call_at = counting  # type: ignore[method-assign]
    try:
        clock = Clock(loop)
        cell = [asyncio.current_task()]
        for _ in range(1000):
            d = _armed(clock, 60, cell)  # type: ignore[arg-type]
            assert d.end(None) is False
    finally:
        del loop.call_at  # type: ignore[method-assign]
    assert made == 1
    assert len(clock) == 0


async def test_ended_deadlines_behind_a_long_one_do_not_pile_up() -> None:
    """A long op at the top of the heap while thousands end behind it: the heap is rebuilt
    without the ended ones (it never holds more than about twice the live ones, plus 64)."""
    loop = asyncio.get_running_loop()
    clock = Clock(loop)
    cell = [asyncio.current_task()]
    long = _armed(clock, 600, cell)  # type: ignore[arg-type]
    for _ in range(5000):
        _armed(clock, 700, cell).end(None)  # type: ignore[arg-type]
    assert len(clock) == 1
    assert len(clock._heap) <= 2 + 64
    long.end(None)
    assert len(clock) == 0 and clock._heap == []


async def test_a_fired_deadline_reports_its_own_cancellation_and_how_late() -> None:
    loop = asyncio.get_running_loop()
    clock = Clock(loop)

    async def op() -> bool:
        d = Deadline(0.02, clock, [asyncio.current_task()], 0)  # type: ignore[list-item]
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError as exc:
            return d.end(exc)
        return False

    t = asyncio.ensure_future(op())
    assert await asyncio.wait_for(t, 5) is True


async def test_close_cancels_the_timer_a_torn_down_group_would_leave_armed() -> None:
    """The timer stays armed after the last deadline ends (it fires once for nothing); a group
    torn down closes its clock, so neither the clock nor the loop's timer outlives it (5000
    group lifecycles in tests/faults/test_group_lifecycles.py)."""
    loop = asyncio.get_running_loop()
    clock = Clock(loop)
    _armed(clock, 600, [asyncio.current_task()]).end(None)  # type: ignore[list-item]
    assert clock._handle is not None
    handle = clock._handle
    clock.close()
    assert clock._handle is None and handle.cancelled()
