"""Start-up progress: while initialisation waits (store connect, the master's wait for workers,
the transport's address exchange), say what it waits for, every few seconds (docs/c10d.md,
"Start-up progress").

Every such warning names what is awaited, who is missing (ranks, where known), where
(host:port), progress (n/N) and the time waited of the total:
``init_process_group: rank 0 waiting for ranks [1] to join the store at 127.0.0.1:29500
(1/2 joined, 20 s of 1800 s)``. The period is ``AIODIST_INIT_WARN_INTERVAL`` seconds (default
10; 0 turns the periodic warnings off), read when a wait starts.

Who is waiting comes from a ``ContextVar`` set with ``phase(...)`` by ``init_process_group``
(the caller) and the rendezvous (the rank): the stores and the transport know neither.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from aiodist.knobs import knob

__all__ = [
    "INTERVAL_ENV",
    "DEFAULT_INTERVAL_S",
    "Phase",
    "phase",
    "current",
    "who",
    "warn_interval",
    "warn_while",
    "seconds",
    "waited",
    "ranks",
    "where",
]

INTERVAL_ENV = "AIODIST_INIT_WARN_INTERVAL"
DEFAULT_INTERVAL_S = knob(INTERVAL_ENV).number({})  # the registry's default
_DESCRIBE_S = 2.0  # what a progress message may spend asking the store (it only improves a log line)


@dataclass(frozen=True)
class Phase:
    """Who is starting up: ``caller`` (``"init_process_group"``), this process's rank and the
    world size, where the store's address came from (``"MASTER_ADDR"``), whose server it is."""

    caller: str | None = None
    rank: int | None = None
    world_size: int | None = None
    addr_from: str | None = None
    server_of: str | None = None


_OUTSIDE = Phase()
_PHASE: ContextVar[Phase | None] = ContextVar("aiodist_startup_phase", default=None)


@contextmanager
def phase(**fields: Any) -> Iterator[Phase]:
    """Within the block, the start-up phase is the current one with ``fields`` replaced
    (those given as None are left as they were)."""
    p = replace(current(), **{k: v for k, v in fields.items() if v is not None})
    token = _PHASE.set(p)
    try:
        yield p
    finally:
        _PHASE.reset(token)


def current() -> Phase:
    return _PHASE.get() or _OUTSIDE


def who(default: str) -> str:
    """How a warning names the waiter: ``"init_process_group: rank 1"``, ``"rank 1"``, or
    ``default`` outside any start-up phase."""
    p = current()
    rank = f"rank {p.rank}" if p.rank is not None else None
    if p.caller is not None:
        return f"{p.caller}: {rank}" if rank else p.caller
    return rank or default


def warn_interval() -> float:
    """Seconds between progress warnings (``AIODIST_INIT_WARN_INTERVAL``, default 10); inf when 0."""
    value = knob(INTERVAL_ENV).number()  # ValueError naming the variable
    return math.inf if value == 0 else value


def seconds(x: float) -> str:
    """``"20 s"``, ``"0.3 s"``: whole seconds where that is precise enough."""
    if x == math.inf:
        return "no limit"
    return f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def waited(elapsed: float, total: float | None) -> str:
    """``"20 s of 1800 s"`` (``"20 s so far"`` with no known total)."""
    if total is None or total == math.inf:
        return f"{seconds(elapsed)} so far"
    return f"{seconds(elapsed).removesuffix(' s')} s of {seconds(total)}"


def ranks(missing: list[int], limit: int = 16) -> str:
    """``[1, 2]``, or the first ``limit`` and how many in all: ``[1, 2, ... (40 in all)]``."""
    if len(missing) <= limit:
        return str(missing)
    return f"[{', '.join(map(str, missing[:limit]))}, ... ({len(missing)} in all)]"


def where(store: Any) -> str:
    """``"the store at host:port"`` through PrefixStores, else ``"the <kind>"``."""
    for _ in range(32):  # PrefixStore chains; a bound against a cycle
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return f"the store at [{host}]:{port}" if ":" in host else f"the store at {host}:{port}"
    return f"the {type(store).__name__}"


@asynccontextmanager
async def warn_while(
    describe: Callable[[float], Awaitable[str]], fallback: Callable[[float, BaseException], str], logger: logging.Logger
) -> AsyncIterator[None]:
    """While the block runs, log ``await describe(elapsed)`` at WARNING every interval. A
    describe that fails or takes more than a couple of seconds logs ``fallback(elapsed, exc)``."""
    interval = warn_interval()
    if interval == math.inf:
        yield
        return
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def tick() -> None:
        n = 1
        while True:
            await asyncio.sleep(max(0.0, start + n * interval - loop.time()))
            n += 1
            try:
                async with asyncio.timeout(min(interval, _DESCRIBE_S)):
                    text = await describe(loop.time() - start)
            except Exception as exc:  # TimeoutError too: the message is best effort, the wait goes on
                text = fallback(loop.time() - start, exc)
            logger.warning("%s", text)

    task = asyncio.create_task(tick(), name="aiodist-startup-progress")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait({task})  # never raises: a cancellation of this task itself still propagates
