"""Timeout arguments: torch takes ``datetime.timedelta``; aiodist also takes seconds."""

from __future__ import annotations

import math
from datetime import timedelta

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
