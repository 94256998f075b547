"""Waiting in tests for a condition another thread or process makes true, with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["until"]


async def until(predicate: Callable[[], bool], what: str, deadline_s: float = 5.0, interval_s: float = 0.002) -> None:
    """Return once ``predicate()`` holds; AssertionError naming ``what`` after ``deadline_s``.

    For state that has no event to await (a server's statistics, another thread's progress).
    Where an event or future exists, await that instead.
    """
    end = time.monotonic() + deadline_s
    while not predicate():  # noqa: ASYNC110 - polls state that offers nothing to await
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
