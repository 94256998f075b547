"""``run_world(n, fn)``: n ranks as n tasks on the running loop, each in its own contextvars
Context with its own ``World`` (initialised before ``fn`` runs, destroyed after), all sharing
one in-process HashStore. A watchdog fails a world that runs past ``timeout``: it prints the
stack of every pending rank task and of every op still running, cancels them, and raises
``DistTimeoutError`` naming the stuck ranks.
"""

from __future__ import annotations

import asyncio
import contextvars
import linecache
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TextIO, TypeVar

from aiodist._time import TimeoutLike, to_seconds
from aiodist.c10d.init import destroy_process_group, init_process_group, is_initialized
from aiodist.c10d.world import World, set_world
from aiodist.errors import DistTimeoutError
from aiodist.store.hash import HashStore

__all__ = ["run_world", "print_async_stack"]

T = TypeVar("T")


async def _rank_main(
    rank: int,
    n: int,
    fn: Callable[[int], Awaitable[T]],
    backend: str,
    store: HashStore,
    pg_timeout: TimeoutLike | None,
    pg_options: Any,
) -> T:
    await init_process_group(backend, store=store, rank=rank, world_size=n, timeout=pg_timeout, pg_options=pg_options)
    try:
        return await fn(rank)
    finally:
        if is_initialized():
            await destroy_process_group()


async def run_world(
    n: int,
    fn: Callable[[int], Awaitable[T]],
    backend: str = "memory",
    timeout: TimeoutLike = 30,
    *,
    pg_timeout: TimeoutLike | None = None,
    pg_options: Any = None,
) -> list[T]:
    """Run ``await fn(rank)`` for every rank 0..n-1 concurrently; return their results in rank order.

    Inside ``fn`` the aiodist API works on that rank's own World (``aiodist.get_rank()`` is
    ``rank``). ``pg_timeout`` is the default group's timeout (torch's 30 min if None).
    ``pg_options`` is passed to every rank's ``init_process_group``: a
    ``aiodist.algorithms.Thresholds``, or a mapping of its field names to byte counts (for
    example ``{"lane_max": 0}``), sets the default group's path rules on every rank alike
    (``aiodist.algorithms.thresholds.rules_from``); groups made later take their own.
    The first rank to fail (lowest rank among the first failures) has its error raised, with a
    note naming the rank; the other ranks are then cancelled. A world still running after
    ``timeout`` seconds is a ``DistTimeoutError`` naming the ranks that did not finish.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run_world needs n >= 1 ranks, got {n!r}")
    seconds = to_seconds(timeout)
    store = HashStore(timeout=seconds)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[T]] = []
    worlds: list[World] = []
    for rank in range(n):
        ctx = contextvars.copy_context()
        world = World(f"rank {rank}")
        ctx.run(set_world, world)
        worlds.append(world)
        tasks.append(
            loop.create_task(_rank_main(rank, n, fn, backend, store, pg_timeout, pg_options), name=f"run_world rank {rank}", context=ctx)
        )
    try:
        done, pending = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await _cancel(tasks)
        raise
    failed = [r for r, t in enumerate(tasks) if t in done and not t.cancelled() and t.exception() is not None]
    if failed:
        await _cancel(tasks)
        exc = tasks[failed[0]].exception()
        assert exc is not None
        exc.add_note(f"(raised on rank {failed[0]} of run_world({n}); ranks that failed first: {failed})")
        raise exc
    if pending:
        stuck = sorted(tasks.index(t) for t in pending)
        print(f"run_world({n}): ranks {stuck} still running after {seconds:g} s; their stacks:", file=sys.stderr)
        for r in stuck:
            print_async_stack(tasks[r])
        for r in stuck:
            for g in worlds[r].groups.values():
                for t in g.pending():
                    print_async_stack(t)
        await _cancel(tasks)
        raise DistTimeoutError(f"run_world({n}) timed out after {seconds:g} s; ranks still running: {stuck} (stacks printed to stderr)")
    return [t.result() for t in tasks]


def print_async_stack(task: asyncio.Task[Any], file: TextIO | None = None) -> None:
    """Print where ``task`` is suspended, following the chain of awaits down to the innermost
    coroutine (``Task.print_stack`` shows only the outermost frame of a suspended task)."""
    out = file or sys.stderr
    print(f"Stack for {task!r} (innermost last):", file=out)
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            print(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}', file=out)
            line = linecache.getline(code.co_filename, frame.f_lineno).strip()
            if line:
                print(f"    {line}", file=out)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if coro is not None and not (hasattr(coro, "cr_frame") or hasattr(coro, "gi_frame")):
            print(f"  awaiting {coro!r}", file=out)
            break


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
