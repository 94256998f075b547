"""Timeout arguments (torch takes ``datetime.timedelta``; aiodist also takes seconds), and
``Deadline``, the one way aiodist bounds an operation in time."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from datetime import timedelta
from types import TracebackType
from typing import TypeVar

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


class Deadline:
    """``async with Deadline(seconds):`` -- ``asyncio.timeout`` that remembers whether *its own*
    deadline fired. A ``TimeoutError`` that leaves the block is this deadline's only when
    ``fired`` is true; one raised by the code inside (a user's, a store's or a backend's own
    deadline) leaves with ``fired`` false and is that code's failure, not this deadline's.
    Cancellation from outside passes through unchanged (``fired`` stays false)."""

    __slots__ = ("seconds", "_cm")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._cm: asyncio.Timeout | None = None

    async def __aenter__(self) -> Deadline:
        self._cm = asyncio.timeout(self.seconds)
        await self._cm.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._cm is not None
        await self._cm.__aexit__(exc_type, exc, tb)  # raises TimeoutError where it fired

    @property
    def fired(self) -> bool:
        """Whether this deadline passed and cancelled the block (``asyncio.Timeout.expired``)."""
        return self._cm is not None and self._cm.expired()


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
            fut.cancel()
            raise TimeoutError
    return fut.result()
