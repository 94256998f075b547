"""Calls made on a thread that is not their World's event loop: where the op runs, and what
the caller gets back.

A job's groups live on one event loop: the one ``init_process_group`` ran on (the World's
loop). Their sockets, shared-memory waits and timers belong to it, so an op can only run there.
``elsewhere`` decides, for a call of ``communicating(fn, home=...)`` made anywhere else, in
this order (the first rule that applies wins):

1. The World's loop is **closed** (``asyncio.run`` returned): refused at once with
   ``DistError``, naming the rule and the fix: run ``init_process_group`` and every call in one
   ``asyncio.run(main())``. The World's sockets and store server belong to the closed loop, so
   that World can be neither used nor destroyed in this process; destroy it before its loop ends.
2. **No loop runs on this thread and the World's loop is not running either** (the line before
   ``loop.run_until_complete(dist.all_reduce(x))``): nothing to decide yet; the call returns
   the usual lazy handle, and runs on the loop that runs it.
3. **A loop runs on this thread, and the World's loop does not** (it is between two
   ``run_until_complete`` calls): refused at once with ``DistError``: run the call on that loop.
4. **No loop runs on this thread, the World's loop runs on another** (a plain thread, a thread
   pool, ``asyncio.to_thread(dist.all_reduce, x)``, the line before ``asyncio.run(...)`` in a
   thread): the op is handed to the World's loop now, in call order, and this thread blocks
   until it ends, as torch's blocking call does: errors raise here, and what comes back is a
   finished handle (awaiting it gives the result at once, so ``asyncio.run(dist.all_reduce(x))``
   on a thread works too).
5. **Another loop runs on this thread, the World's loop runs on another**: the op is handed to
   the World's loop now, in call order, and the call returns a handle of *this* loop: awaiting
   it waits for the op there.

In rules 4 and 5 the op has not started until the World's loop runs it: if that loop has not
started it within the group's timeout (``LoopHome.start_timeout``), the caller gets
``DistTimeoutError`` saying that the loop is blocked (typically by a coroutine on it waiting for
this very thread: ``thread.join()``, ``future.result()``), and the op never starts there (no
sequence number is taken, so the group stays in step). Once started, the op's own deadline
applies. A ``Work`` (``async_op=True``) comes back as a
``ForeignWork``: the same methods, awaitable on any loop.

The default group is never touched by a refusal, and an op always runs on the World's loop, so
the first op of a job and the hundredth behave the same. Stores are not forwarded: a store is
bound to the loop that made it and refuses another (``store.clone()`` makes one for it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from aiodist._pending import Pending, _is_work, finished
from aiodist.errors import DistError, DistTimeoutError

__all__ = ["ForeignWork", "LoopHome", "closed_loop_error", "elsewhere"]

_RULE = "a job's groups live on the event loop init_process_group ran on"


class LoopHome:
    """A ``communicating`` home (``aiodist._pending.Home``) whose calls made elsewhere follow
    this module's rules: give ``loop()`` and ``start_timeout()``."""

    def loop(self) -> asyncio.AbstractEventLoop | None:
        raise NotImplementedError

    def start_timeout(self) -> float:
        raise NotImplementedError

    def forward(
        self,
        name: str,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        running: asyncio.AbstractEventLoop | None,
        site: tuple[str, int],
    ) -> Pending | None:
        return elsewhere(name, fn, args, kwargs, self, loop, running, site)


def elsewhere(
    name: str,
    fn: Callable[..., Coroutine[Any, Any, Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    home: LoopHome,
    loop: asyncio.AbstractEventLoop,
    running: asyncio.AbstractEventLoop | None,
    site: tuple[str, int],
) -> Pending | None:
    """The handle for a call of ``fn`` made where ``running`` (None: no loop) runs, whose op must
    run on ``loop`` (the module docstring's rules, in order); None: make the usual handle."""
    where = f"{name}(...) called at {site[0]}:{site[1]} on thread {threading.current_thread().name!r}"
    if loop.is_closed():  # rule 1
        raise closed_loop_error(where)
    if not loop.is_running():
        if running is None:  # rule 2
            return None
        raise DistError(f"{where}: {_RULE}, and that loop is not running: run the call on it")  # rule 3
    hand = _Handoff(home.start_timeout())
    cf = asyncio.run_coroutine_threadsafe(hand.run(fn, args, kwargs), loop)
    if running is None:  # rule 4: block this thread until the op ends
        if not hand.started(block=True):
            raise hand.blocked(where)
        return finished(name, _here(cf.result(), loop), site, used=True)  # the op's own deadline bounds it
    return Pending(name, _there(cf, hand, where, loop), site)  # rule 5


def closed_loop_error(where: str) -> DistError:
    """Rule 1's refusal for a call described by ``where``."""
    return DistError(
        f"{where}: {_RULE}, and that loop is closed (asyncio.run returned), so this process's groups are gone with it: "
        "run init_process_group and every call inside one asyncio.run(main()) (destroy_process_group() before it returns)"
    )


class _Handoff:
    """An op handed to the World's loop: it starts there unless the caller gave up first (the
    start deadline), and then it never starts."""

    __slots__ = ("patience", "_lock", "_state", "_event")

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self._lock = threading.Lock()
        self._state = "waiting"  # -> "started" (the World's loop) or "abandoned" (the caller)
        self._event = threading.Event()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            if self._state == "abandoned":
                return None  # nobody waits: the caller was told the op never started
            self._state = "started"
        self._event.set()
        return await fn(*args, **kwargs)

    def started(self, block: bool) -> bool:
        """Whether the op has started; ``block``: wait for it up to ``patience`` first. False:
        it never will (it is abandoned now)."""
        if block:
            self._event.wait(self.patience)
        with self._lock:
            if self._state == "waiting":
                self._state = "abandoned"
            return self._state == "started"

    def blocked(self, where: str) -> DistTimeoutError:
        return DistTimeoutError(
            f"{where}: the event loop init_process_group ran on did not start the op within {self.patience:g} s (the group's timeout), "
            "so it is blocked: is a coroutine on it waiting for this thread (thread.join(), future.result(), queue.get())? "
            "Wait for the thread without blocking that loop (await asyncio.to_thread(thread.join)); the op was not started"
        )


async def _there(cf: concurrent.futures.Future[Any], hand: _Handoff, where: str, loop: asyncio.AbstractEventLoop) -> Any:
    fut = asyncio.wrap_future(cf)
    await asyncio.wait({fut}, timeout=hand.patience)
    if not fut.done() and not hand.started(block=False):
        fut.cancel()
        raise hand.blocked(where)
    return _here(await fut, loop)


def _here(value: Any, loop: asyncio.AbstractEventLoop) -> Any:
    """What an op of ``loop`` returned, for a caller on another thread: Works (futures of that
    loop) wrapped."""
    if _loop_work(value):
        return ForeignWork(value, loop)
    if isinstance(value, list) and value and all(_loop_work(v) for v in value):  # batch_isend_irecv
        return [ForeignWork(v, loop) for v in value]
    return value


def _loop_work(v: object) -> bool:
    """A Work: a future of the job's loop."""
    return isinstance(v, asyncio.Future) and _is_work(v)


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return await fn(*args)


class ForeignWork:
    """A ``Work`` of the World's loop, handed to a caller on another thread: ``await work`` and
    ``await work.wait(timeout)`` work on any loop (they wait on the World's loop); the other
    methods (``is_completed``, ``is_success``, ``exception``, ``source_rank``, ``op``, ``seq``) are
    the Work's. ``get_future()`` is the Work itself, a future of the World's loop."""

    __slots__ = ("_work", "_loop")

    def __init__(self, work: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._work = work
        self._loop = loop

    def __repr__(self) -> str:
        return f"<ForeignWork {self._work!r}>"

    def _on_home(self, fn: Callable[..., Any], *args: Any) -> Any:
        if asyncio._get_running_loop() is self._loop:
            return fn(*args)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_call(fn, *args), self._loop))

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield from self._on_home(_outputs, self._work).__await__())

    async def wait(self, timeout: Any = None) -> bool:
        return bool(await self._on_home(self._work.wait, timeout))

    def is_completed(self) -> bool:
        return bool(self._work.done())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._work, name)


async def _outputs(work: Any) -> Any:
    return await work
