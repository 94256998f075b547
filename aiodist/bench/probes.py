"""What a benchmark rank measures besides time: how late its event loop wakes up while an op
runs (a loop-lag probe) and how much memory the op adds at its peak (VmHWM growth).

Both are for the benchmark's own rank processes; neither asserts anything.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import resource
import time

__all__ = ["LagProbe", "PeakRss", "percentile"]


class LagProbe:
    """A task that sleeps ``period`` seconds in a loop on the running event loop and records,
    for every wake-up, how much later than asked it came (seconds). A step that holds the loop
    for 30 ms shows as one wake-up about 30 ms late.

    The floor is the loop's timer resolution: uvloop (libuv) rounds timers to whole
    milliseconds, so an idle uvloop shows lags of up to about 1 ms.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        clock, sleep, period, lags = time.perf_counter, asyncio.sleep, self.period, self.lags
        while True:
            t0 = clock()
            await sleep(period)
            lags.append(max(0.0, clock() - t0 - period))

    def start(self) -> None:
        if self._task is None:
            self.lags = []
            self._task = asyncio.get_running_loop().create_task(self._run(), name="aiodist-bench-lag-probe")

    async def stop(self) -> list[float]:
        """Stop the probe; the lags it recorded since ``start``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # our own cancel; a cancel of ours still propagates
        return self.lags


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim() -> None:
    """Hand the allocator's free memory back to the system (glibc's ``malloc_trim``), so that
    memory the code under measurement allocates shows as growth even where it reuses what
    earlier code freed."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakRss:
    """Peak resident memory growth over a stretch of code, in bytes.

    At ``start`` the allocator's free memory is returned to the system and, on Linux, the peak (VmHWM) is reset (``echo 5 > /proc/self/clear_refs``), so
    the growth is ``VmHWM`` at ``stop`` minus ``VmRSS`` at ``start``: what the code added at its
    worst moment, even if it freed it again. Where the reset is refused, it is the growth of
    the process's lifetime peak (``ru_maxrss``), which misses anything below an earlier peak:
    ``exact`` says which one was measured.
    """

    def __init__(self) -> None:
        self.exact = False
        self._base = 0

    def start(self) -> None:
        _trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss = _status_kib("VmRSS")
            self.exact = rss is not None
        except OSError:
            rss, self.exact = None, False
        self._base = (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def stop(self) -> int:
        hwm = _status_kib("VmHWM") if self.exact else None
        peak = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return max(0, peak - self._base)
