"""Timeout arguments (torch takes ``datetime.timedelta``; aiodist also takes seconds),
``Deadline``, the one way aiodist bounds an operation in time, and ``Clock``, one timer for
the deadlines of many ops (a group's)."""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Awaitable
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

TimeoutLike = timedelta | float | int


def to_seconds(timeout: TimeoutLike, what: str = "timeout") -> float:
    """Seconds in ``timeout`` (a timedelta or a number); refuses negatives, NaN and non-numbers."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{what} must be a datetime.timedelta or a number of seconds, not {type(timeout).__name__}")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{what} must be >= 0, got {timeout!r}")
    return seconds


def to_timedelta(timeout: TimeoutLike, what: str = "timeout") -> timedelta:
    if isinstance(timeout, timedelta):
        to_seconds(timeout, what)
        return timeout
    return timedelta(seconds=to_seconds(timeout, what))


def fmt_seconds(seconds: float) -> str:
    return f"{seconds:g} s"


class Clock:
    """One loop timer for the deadlines armed on it (a group's ops: ``ProcessGroup.clock``), at
    the earliest of them: an op's deadline costs a push on a heap and, when the op ends, a
    mark, where a timer of its own cost a loop timer made and cancelled per op.

    Rules:
    - The timer is armed while the heap holds a deadline (and stays armed when the last ends:
      it then fires once for nothing), never later than the earliest one's due time: ``arm`` moves it earlier where a new deadline is due sooner (a call with its own
      timeout); a deadline that ends leaves it where it is (the ops of a group end in about the
      order they began, so the next is due later: the timer then fires early, finds nothing
      due, and is armed again for the earliest left).
    - When it fires it drops the ended deadlines at the top, fires every live one that is due
      (``Deadline._fire``: the op's task is cancelled, as its own timer did), and is armed again
      for the earliest left.
    - An ended deadline leaves the heap when it reaches the top; where ended ones outnumber the
      live (a long op at the top while many end behind it), the heap is rebuilt without them."""

    __slots__ = ("_loop", "_heap", "_handle", "_at", "_n", "_ended")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, Deadline]] = []
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0  # the timer's due time (loop time), while armed
        self._n = 0  # tie-break: deadlines due at one time fire in the order they were armed
        self._ended = 0  # ended deadlines still in the heap

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def __len__(self) -> int:
        """The deadlines armed on it and not ended."""
        return len(self._heap) - self._ended

    def arm(self, d: Deadline, due: float) -> None:
        n = self._n
        self._n = n + 1
        heapq.heappush(self._heap, (due, n, d))
        h = self._handle
        if h is None or due < self._at:
            if h is not None:
                h.cancel()
            self._at = due
            self._handle = self._loop.call_at(due, self._fire)

    def ended(self) -> None:
        """A deadline armed here ended (``Deadline.end``: its ``_clock`` is None now)."""
        heap = self._heap
        ended = self._ended + 1
        while heap and heap[0][2]._clock is not self:
            heapq.heappop(heap)
            ended -= 1
        if ended > 64 and ended * 2 > len(heap):
            heap[:] = [e for e in heap if e[2]._clock is self]
            heapq.heapify(heap)
            ended = 0
        self._ended = ended

    def close(self) -> None:
        """Cancel its timer and forget its deadlines (their group is torn down: its ops ended)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._heap.clear()
        self._ended = 0

    def _fire(self) -> None:
        self._handle = None
        heap = self._heap
        now = self._loop.time()
        while heap:
            due, _, d = heap[0]
            if d._clock is not self:
                heapq.heappop(heap)
                self._ended -= 1
                continue
            if due > now:
                break
            heapq.heappop(heap)
            d._clock = None
            d._fire(self._loop)
        if heap:
            self._at = heap[0][0]
            self._handle = self._loop.call_at(self._at, self._fire)


class Deadline:
    """``async with Deadline(seconds):`` -- ``asyncio.timeout`` that remembers whether *its own*
    deadline fired, and when. A ``TimeoutError`` that leaves the block is this deadline's only
    when ``fired`` is true; one raised by the code inside (a user's, a store's or a backend's own
    deadline) leaves with ``fired`` false and is that code's failure, not this deadline's.
    Cancellation from outside passes through unchanged (``fired`` stays false).

    ``late`` is how long after its due time the deadline's timer actually ran (the loop was
    blocked, or this process was not scheduled): measured when it fires, so the time the
    cancelled code then takes to unwind is not counted. Like ``asyncio.timeout`` it cancels the
    task that entered it, so it must not be entered in a communicating call's first step
    (see ``within``).

    The op runner uses the same deadline without a block (armed by its constructor, on the
    group's ``Clock``, disarmed by ``end``), for an op whose first step runs before the task
    that runs the rest exists."""

    __slots__ = ("seconds", "_cell", "_handle", "_clock", "_due", "_fired_at", "_cancelling")

    def __init__(
        self,
        seconds: float,
        clock: Clock | None = None,
        cell: list[asyncio.Task[Any]] | None = None,
        cancelling: int = 0,
    ) -> None:
        """``Deadline(seconds)`` is armed by ``async with``. With ``clock`` and ``cell`` it is
        armed now, on that clock, without a block (the op runner's form): when it passes,
        ``cell[0]`` is cancelled (``cell`` may be filled after this, before the loop next runs:
        the timer only fires from the loop); ``cancelling`` is that task's ``cancelling()`` now
        (0 for a task not made yet). ``end`` disarms it."""
        self.seconds = seconds
        self._fired_at: float | None = None
        self._cancelling = cancelling
        self._handle: asyncio.TimerHandle | None = None
        self._clock: Clock | None = None  # while armed on a clock
        if clock is None or cell is None:
            self._cell: list[asyncio.Task[Any]] = []
            self._due = 0.0
            return
        self._cell = cell
        self._due = due = clock._loop.time() + seconds
        self._clock = clock
        clock.arm(self, due)

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        loop = asyncio.get_running_loop()
        self._cell = [task]
        self._cancelling = task.cancelling()
        self._due = loop.time() + self.seconds
        self._handle = loop.call_at(self._due, self._fire, loop)
        return self

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fired_at = loop.time()
        self._cell[0].cancel()

    def end(self, exc: BaseException | None) -> bool:
        """Disarm it, the block (or op) having ended with ``exc`` (None: completed). True when
        ``exc`` is this deadline's own cancellation: the caller raises ``TimeoutError`` from it.
        The cancellation is its own when it fired and no other came after it was armed
        (asyncio.timeout's uncancel rule)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        clock = self._clock
        if clock is not None:
            self._clock = None
            clock.ended()
        cell, self._cell = self._cell, []  # (the task is not kept: a clock's heap may hold this a while)
        if self._fired_at is not None:
            return cell[0].uncancel() <= self._cancelling and isinstance(exc, asyncio.CancelledError)
        return False

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.end(exc):
            raise TimeoutError from exc

    @property
    def fired(self) -> bool:
        """Whether this deadline passed and cancelled the block."""
        return self._fired_at is not None

    @property
    def due(self) -> float:
        """The loop time at which it passes (once started)."""
        return self._due

    @property
    def late(self) -> float:
        """Seconds between the due time and the moment the timer ran (0 when it did not fire)."""
        return 0.0 if self._fired_at is None else max(0.0, self._fired_at - self._due)


async def within(aw: Awaitable[T], seconds: float) -> T:
    """What ``aw`` gives, or ``TimeoutError`` after ``seconds`` (``aw`` is then cancelled).

    Not ``asyncio.timeout``: that one cancels the *task* that entered it, and a communicating
    call's first step runs in the caller's task, the rest in whichever task awaits its handle
    (aiodist/_pending.py). ``gather(store.wait(ks, 1), ...)`` had the wait's deadline cancel the
    caller (and so every call gathered with it) while the wait itself never ended. This bound
    lives on the loop and ends the call in whatever task runs it: use it, not ``asyncio.timeout``,
    for any deadline a communicating call may enter before its first suspension."""
    fut = asyncio.ensure_future(aw)
    if not fut.done():
        try:
            await asyncio.wait((fut,), timeout=max(0.0, seconds))
        except BaseException:  # cancelled from outside: the call ends, and what it waited on
            fut.cancel()
            raise
        if not fut.done():
            fut.cancel()  # it unwinds on its own; what it ends with is retrieved, never logged as lost
            fut.add_done_callback(_retrieve)
            raise TimeoutError
    return fut.result()


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
