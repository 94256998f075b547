"""``Pending``: what every communicating call of aiodist's torch API returns, and
``communicating``, the decorator that makes a coroutine function return one.

Why: a forgotten ``await`` used to leave an op unissued, so the ranks went out of
step in silence, and torch's non-blocking forms (``req = dist.isend(...); req.wait()``) did not
port by adding ``await``. Now a call *starts* its op when it is made, and returns a handle:

- The call runs its coroutine's first step at once, in the caller's context, as an eager task
  would: arguments are checked (a bad one raises from the call itself), the sequence number is
  taken and the op is started. So ops issue in *call* order, as torch's do, whoever awaits what.
- ``await handle`` finishes the call and gives what the coroutine returns (``None`` for a
  blocking op, the ``Work`` for ``async_op=True``, the sender for ``recv``, ...).
- Without a first ``await``, the handle answers torch's Work methods, and only those: ``wait()``
  (``await handle.wait()`` always works), ``is_completed()``, ``is_success()``, ``result()``,
  ``exception()``, ``source_rank()``, ``get_future()``, ``synchronize()``,
  ``block_current_stream()``: from the call's Work once it has produced one, else from what the
  call returned (``recv``'s sender is its ``source_rank()``). Asked before the call has produced
  it, a result-reading method says so (``not_produced``). The handle iterates like the list
  ``batch_isend_irecv`` returns. Nothing else is forwarded: any other attribute names the call
  and says where its Work is.
- There is one handle contract and two kinds: ``Pending`` here, and the TCPStore's ``_Call``
  (``aiodist.store._connection``), a future the store's connection resolves, which is that
  layer's one fast path; ``tests/test_handles.py`` runs the same checks over both and checks the
  fast path against the general one. Both log a dropped call in one wording
  (``say_never_awaited``).
- A handle dropped without being awaited or waited on logs an ERROR naming the call and the
  file:line it was made at, at once (CPython frees it when the statement ends), and hands what
  is left of the call to a task, so the op still runs to its end and the ranks stay in step.
- ``Pending`` is a ``collections.abc.Coroutine``, so ``asyncio.create_task``, ``gather`` and
  ``wait_for`` take it as they took the coroutine.
- Because the first step runs in the *caller's* task and the rest in the awaiting one, a call
  must not enter ``asyncio.timeout`` (or read ``current_task()``) before its first suspension:
  the deadline would cancel the caller. ``aiodist._time.within`` is the task-independent bound
  the stores use (the store conformance kit's ``check_timeout_in_another_task`` tests it).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, ParamSpec, Protocol, TypeVar

from aiodist.errors import DistError

__all__ = [
    "Home",
    "Pending",
    "communicating",
    "finished",
    "file_line",
    "mark_coroutine_function",
    "not_produced",
    "say_never_awaited",
    "LATER",
    "LET_RUN",
]

log = logging.getLogger("aiodist.c10d")
_STORE_LOG = logging.getLogger("aiodist.store")  # a store call's never-awaited ERROR: the store's logger

_DONE = object()
_LAZY = object()  # a handle made outside a running loop: nothing started yet
_LET_RUN = object()  # a finished call's handle whose await lets the loop run once first

#: what a call's ``now`` answers where the call must run its coroutine (``communicating``)
LATER: Any = object()
#: ... where the call is done, its value None, and its await should let the loop run once
LET_RUN: Any = object()


class _Failed:
    """A handle's ``_value`` when its call ended with an error (awaiting it again raises it)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C", bound=Callable[..., Any])


class Home(Protocol):
    """Where a call's op must run (``communicating``'s ``home``): c10d's is the World's loop
    (``aiodist._threads.LoopHome`` implements ``forward``)."""

    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the op must run on; None: wherever it is called."""

    @property
    def forward(self) -> Callable[..., Pending | None]:
        """``forward(name, fn, args, kwargs, loop, running, site)``: the handle of a call made where
        ``running`` runs (not ``loop``); None: the usual one."""


def _site(depth: int) -> tuple[str, int]:
    """The caller's file and line, ``depth`` frames up (2 from a decorated call: the line that
    made it; aiodist's own calls name aiodist's line, and they always await)."""
    f = sys._getframe(depth)
    return (f.f_code.co_filename, f.f_lineno)


class Pending(collections.abc.Coroutine[Any, Any, Any]):
    """A communicating call, started (see the module docstring)."""

    __slots__ = ("_op", "_coro", "_yielded", "_value", "_used", "_site", "_it", "_ctx", "_said")

    def __init__(self, op: str, coro: Coroutine[Any, Any, Any], site: tuple[Any, int], *, own_context: bool = False) -> None:
        self._op = op
        self._site = site
        self._said = False
        self._it: Generator[Any, Any, Any] | None = None
        self._value: Any = _DONE
        self._coro: Coroutine[Any, Any, Any] | None = coro
        self._used = False
        # own_context: every step runs in one Context, a copy of the caller's, so that a ContextVar
        # set in the first step and reset in a later one stays valid whichever task awaits the
        # handle (init_process_group's). The ops set none across a suspension: their first step
        # runs in the caller's Context and the rest in the awaiting task's (C speed).
        self._ctx = contextvars.copy_context() if own_context else None
        if asyncio._get_running_loop() is None:  # outside a loop (asyncio.run(store.get(k))): it starts when run
            self._yielded = _LAZY
            return
        try:
            self._yielded = coro.send(None) if self._ctx is None else self._ctx.run(coro.send, None)  # the first step, now
        except StopIteration as stop:
            self._coro, self._yielded, self._value = None, None, stop.value
        except BaseException:
            self._coro = None
            self._used = True
            raise

    def __repr__(self) -> str:
        state = "done" if self._coro is None else "running"
        file, line = file_line(self._site)
        return f"<Pending {self._op} ({state}) from {file}:{line}>"

    # -- awaiting ------------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, Any, Any]:
        self._used = True
        coro = self._coro
        if coro is None:
            if self._yielded is _LET_RUN:  # (a call done in its first step: ``communicating``'s ``now``)
                self._yielded = None
                yield  # a bare yield: the awaiting task lets the loop run once
            v = self._value
            if type(v) is _Failed or v is _DONE:
                return self._settled()  # raises
            return v
        self._coro = None
        try:
            if self._yielded is _LAZY:  # made outside a loop: its first step is now
                if self._ctx is None:
                    value = yield from coro.__await__()
                else:
                    try:
                        first = self._ctx.run(coro.send, None)
                    except StopIteration as stop:
                        value = stop.value
                    else:
                        value = yield from _steps(coro, None, self._ctx.run, first)
            elif self._ctx is None:
                try:
                    yield self._yielded  # the future the first step waits on: the awaiting task waits on it
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:  # thrown in (cancellation): on into the call
                    value = yield from _steps(coro, exc, _plain)
                else:
                    try:
                        value = yield from coro.__await__()  # resumes the call where it waits
                    except DistError as exc:  # the op's error: its sentence says it all
                        _trim(exc)
                        raise
            else:
                try:
                    value = yield from _steps(coro, None, self._ctx.run, self._yielded)
                except DistError as exc:  # (init_process_group's: a port in use, a store that is not one)
                    _trim(exc)
                    raise
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._value = _Failed(exc)
            raise
        self._value = value
        return value

    def _settled(self) -> Any:
        """What awaiting a call that has ended gives again: its value, or its error (as a
        Future's); a call closed before it ended has neither."""
        v = self._value
        if type(v) is _Failed:
            raise v.exc
        if v is _DONE:
            raise RuntimeError(f"{self._op}(...): its handle was closed before the call ended; there is nothing to await")
        return v

    # the Coroutine protocol, so that asyncio.create_task / gather / ensure_future take it
    def send(self, value: Any) -> Any:
        if self._it is None:
            self._it = self.__await__()
        return self._it.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        exc = val if val is not None else (typ() if isinstance(typ, type) else typ)
        if self._it is None:  # thrown before its first send (a task cancelled before it ran)
            self._it = self._thrown(exc)
            return self._it.send(None)
        return self._it.throw(exc)

    def _thrown(self, exc: BaseException) -> Generator[Any, Any, Any]:
        """The call, resumed by throwing ``exc`` in where it waits (not at a generator's start,
        where the call would never see it)."""
        self._used = True
        coro = self._coro
        if coro is None:
            raise exc
        self._coro = None
        try:
            value = yield from _steps(coro, exc, _plain if self._ctx is None else self._ctx.run)
        except GeneratorExit:
            raise
        except BaseException as e:
            self._value = _Failed(e)
            raise
        self._value = value
        return value

    def close(self) -> None:
        self._used = True
        if self._it is not None:
            self._it.close()
        elif self._coro is not None:
            self._coro.close()
            self._coro = None

    # -- torch's Work methods, without a first await -------------------------------------------

    def _work(self, what: str) -> Any:
        """The call's Work (or value), for torch's Work method ``what``; the call's own error
        where it failed (``result()`` raises it, ``exception()`` returns it)."""
        self._used = True
        v = self._value
        if v is _DONE:
            raise not_produced(self._op, what)
        if type(v) is _Failed and what != "exception":
            raise v.exc
        return v

    async def wait(self, timeout: Any = None) -> bool:
        """torch's ``req.wait()``: ``await dist.isend(...).wait()`` works without a first await."""
        self._used = True
        value = await self
        if hasattr(value, "wait"):
            return bool(await value.wait(timeout))
        if isinstance(value, list):  # batch_isend_irecv
            for w in value:
                await w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        self._used = True
        if self._value is _DONE:
            return False
        v = self._value
        return bool(v.is_completed()) if hasattr(v, "is_completed") else self._coro is None

    def is_success(self) -> bool:
        """The Work's ``is_success()``; a call without a Work: whether it has finished (its
        error, if any, is raised where it is awaited)."""
        self._used = True
        v = self._value
        if v is _DONE or type(v) is _Failed:
            return False
        return bool(v.is_success()) if _is_work(v) else self._coro is None

    def result(self) -> Any:
        """The Work's ``result()`` (its outputs); a call without a Work: what it returned."""
        v = self._work("result")
        return v.result() if _is_work(v) else v

    def exception(self) -> BaseException | None:
        """The Work's ``exception()``; a call without a Work that has finished: None (an error
        of the call itself is raised by the call or where it is awaited)."""
        v = self._work("exception")
        if type(v) is _Failed:
            if isinstance(v.exc, asyncio.CancelledError):
                raise v.exc  # as a cancelled Future's exception() does
            return v.exc
        return v.exception() if _is_work(v) else None

    def source_rank(self) -> int:
        """The Work's ``source_rank()``: the global rank a receive got its message from
        (``recv``, which returns the sender, gives that)."""
        v = self._work("source_rank")
        if _is_work(v):
            return int(v.source_rank())
        if type(v) is not int:
            raise RuntimeError(f"source_rank() is only defined for receives, not for {self._op}")
        return v

    def get_future(self) -> Any:
        """The Work's ``get_future()``: the future of the op's outputs."""
        return self._work("get_future").get_future()

    def synchronize(self) -> None:
        """Stream semantics: the Work's ``synchronize()`` (a no-op for CPU ops)."""
        v = self._work("synchronize")
        if _is_work(v):
            v.synchronize()

    def block_current_stream(self) -> None:
        """Stream semantics: the Work's ``block_current_stream()`` (a no-op for CPU ops)."""
        v = self._work("block_current_stream")
        if _is_work(v):
            v.block_current_stream()

    def __getattr__(self, name: str) -> Any:
        # nothing is forwarded: a handle has torch's Work methods above and nothing else; a
        # Work's attribute read off the handle says where the Work is
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self._op}(...) returned a handle, which has torch's Work methods (wait, is_completed, is_success, "
            f"result, exception, source_rank, get_future, synchronize, block_current_stream) but no {name!r}: "
            f"`work = await {self._op}(..., async_op=True)` "
            f"gives the Work itself"
        )

    # batch_isend_irecv returns a list: iterate it as torch code does
    def __iter__(self) -> Any:
        return iter(self._work("__iter__"))

    def __bool__(self) -> bool:
        # a handle is true, as any object: without this, truth would fall back to __len__ (the
        # Work's outputs), which fails before the Work exists; asyncio tests ``if task._coro:``
        # (3.12's task repr, run by asyncio.run on a handle made before the loop ran)
        return True

    def __len__(self) -> int:
        return len(self._work("__len__"))

    def __getitem__(self, i: Any) -> Any:
        return self._work("__getitem__")[i]

    def not_awaited(self, where: str) -> TypeError:
        """The error for this handle passed on as ``where`` (a group, a store, a number, ...)
        without being awaited: it names the call, its line, and what to write. The
        never-awaited ERROR is logged now, before the traceback this error prints, not after it
        when the handle is freed."""
        self._say_dropped()
        file, line = file_line(self._site)
        hint = self._op if "." in self._op else f"dist.{self._op}"
        return TypeError(
            f"{where} is the result of {self._op}(...) called at {file}:{line}, which was not awaited: "
            f"write `await {hint}(...)` and pass what it returns"
        )

    # a number expected (``src = dist.recv(t)`` then ``src + 1``, ``range(src)``): the call's name
    def __index__(self) -> int:
        raise self.not_awaited("a number")

    def __int__(self) -> int:
        raise self.not_awaited("a number")

    def __float__(self) -> float:
        raise self.not_awaited("a number")

    # -- dropped without an await -------------------------------------------------------------------

    def _say_dropped(self) -> None:
        """Log the never-awaited ERROR (once) if nothing has awaited or waited on the handle."""
        if self._used or self._said:
            return
        self._said = True
        running = self._coro is not None
        file, line = file_line(self._site)
        if running and self._yielded is _LAZY:
            state = "it was made outside a running event loop and never run: nothing was sent"
        elif running:
            state = "the op was started when called; the rest of the call now runs in a task, but nothing waits for it"
        elif _is_work(self._value):
            state = "its Work was dropped without wait(): nothing learns whether the op succeeded"
        else:
            state = "it ran, but nothing waited for it"
        say_never_awaited(self._op, file, line, state)

    def __del__(self) -> None:
        if self._used:
            return
        try:
            self._say_dropped()
            running = self._coro is not None
            if running:
                self._it = None
                try:
                    if self._yielded is _LAZY:
                        raise RuntimeError("never started")
                    asyncio.get_running_loop().create_task(_finish_dropped(self))
                except RuntimeError:  # no loop (any more): nothing can finish it
                    assert self._coro is not None
                    self._coro.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def file_line(site: tuple[Any, int]) -> tuple[str, int]:
    """A call's site as (file, line): kept as such, or as (code, instruction offset), whose line
    is worked out only here, when the call is named (``f.f_lineno`` costs more than the rest of
    a handle's making)."""
    a, b = site
    if type(a) is types.CodeType:
        return a.co_filename, next((n for start, end, n in a.co_lines() if start <= b < end), None) or 0
    return a, b


def say_never_awaited(op: str, file: str, line: int, state: str) -> None:
    """The never-awaited ERROR, the one wording every handle logs (``Pending``'s and the store's
    ``_Call``): the call, where it was made, ``state`` (what became of it), what to write."""
    hint = op if "." in op else f"dist.{op}"  # "store.set" for a store's method
    (_STORE_LOG if op.startswith("store.") else log).error(
        "%s(...) called at %s:%d was never awaited: %s. Write `await %s(...)`.", op, file, line, state, hint
    )


def not_produced(op: str, what: str) -> RuntimeError:
    """The error of a Work method asked of a handle whose call has not produced its result yet."""
    return RuntimeError(
        f"{op}(...).{what}(): the call has not produced its Work yet (it is still being issued); "
        f"use `await {op}(...)` or `await handle.wait()`"
    )


def _trim(exc: DistError) -> None:
    """An op's error as the awaiting line gets it, re-raised by a bare ``raise`` after this:
    without the frames inside aiodist that raised it (the runner's, the schedule's, the
    transport's, and the re-raising one), so the user's traceback is their own lines and one
    sentence. Those frames are in the DEBUG log (logger ``aiodist.c10d``)."""
    exc.__traceback__ = None


#: what a call's first step raises to refuse it: its arguments (TypeError, ValueError), the
#: World's state (no default group: ValueError) or a DistError; reached by the user without the
#: frames inside aiodist that found it (``trim_refusal``)
_REFUSALS = (TypeError, ValueError, DistError)


def trim_refusal(exc: BaseException, what: str) -> None:
    """A refusal as the calling line gets it: the frames inside aiodist that raised it go to the
    DEBUG log (logger ``aiodist.c10d``) and leave the exception, which the caller then re-raises
    with a bare ``raise`` (no frame added): the user's traceback is their own line and the
    sentence, as an op's error is (``_trim``)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s refused the call: where inside aiodist", what, exc_info=exc)
    exc.__traceback__ = None


def _plain(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _steps(coro: Any, exc: BaseException | None, run: Callable[..., Any], y: Any = None) -> Generator[Any, Any, Any]:
    """What ``yield from`` does, for a call past its first step, each step through ``run`` (a
    Context's): first throwing ``exc`` in, or (``exc`` None) yielding ``y``, its pending future."""
    try:
        if exc is not None:
            y = run(coro.throw, exc)
    except StopIteration as stop:
        return stop.value
    while True:
        try:
            sent = yield y
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:
            try:
                y = run(coro.throw, e)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            y = run(coro.send, sent)
        except StopIteration as stop:
            return stop.value


async def _finish_dropped(p: Pending) -> None:
    try:
        await p
    except Exception as exc:
        log.error("%s(...) called at %s:%d (never awaited) failed: %s: %s", p._op, *file_line(p._site), type(exc).__name__, exc)


def _is_work(v: object) -> bool:
    return hasattr(v, "is_completed") and hasattr(v, "seq")


_get_running_loop = asyncio._get_running_loop
_new = object.__new__


def finished(op: str, value: Any, site: tuple[Any, int], *, used: bool = False) -> Pending:
    """The handle of a call that ended in its first step, with no coroutine left: awaiting it
    gives ``value`` (``LET_RUN``: None, once the loop ran). ``used``: nothing is left to await
    (never named as dropped); else a dropped one logs as any other."""
    p: Pending = _new(Pending)
    p._op, p._site, p._it, p._coro, p._ctx, p._used, p._said = op, site, None, None, None, used, used
    if value is LET_RUN:
        p._value, p._yielded = None, _LET_RUN
    else:
        p._value, p._yielded = value, None
    return p


def communicating(
    fn: Callable[P, Coroutine[Any, Any, T]], op: str | None = None, home: Home | None = None, now: Callable[..., Any] | None = None
) -> Callable[P, Pending]:
    """Make the coroutine function ``fn`` return a started ``Pending`` (module docstring), named
    ``op`` in its messages (default: ``fn``'s name; a store's methods pass ``store.<name>``).

    ``home``: where the call's op must run (c10d's calls: the World's event loop). A call made
    on another thread runs there (``aiodist._threads.elsewhere``: its rules in order).

    ``now``: the call's first step as a plain function (trio's ``send_nowait`` before ``send``),
    tried first where the call is made on its loop: it answers ``LATER`` having done nothing
    (then ``fn`` runs, as without it), or the call's value (``LET_RUN``: None, and the await
    lets the loop run once), or a coroutine that finishes the call. A call done in ``now`` makes
    no coroutine of ``fn``'s: its handle holds the value and nothing to run."""
    name = op or fn.__name__

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> Pending:
        try:
            f = sys._getframe(1)
            running = _get_running_loop()
            if home is not None and (h := home.loop()) is not None and h is not running:
                done = home.forward(name, fn, args, kwargs, h, running, file_line((f.f_code, f.f_lasti)))
                if done is not None:
                    return done
            if now is not None and running is not None:
                got = now(*args, **kwargs)
                if got is not LATER:
                    if type(got) is types.CoroutineType:
                        return Pending(name, got, (f.f_code, f.f_lasti))
                    return finished(name, got, (f.f_code, f.f_lasti))
            return Pending(name, fn(*args, **kwargs), (f.f_code, f.f_lasti))
        except _REFUSALS as exc:  # a refused call (its arguments, no default group): one sentence
            trim_refusal(exc, name)
            raise  # (a bare raise adds no frame: the traceback starts at the caller's line)

    return mark_coroutine_function(call, fn)


_ASYNCIO_MARK = getattr(asyncio.coroutines, "_is_coroutine", None)  # what asyncio.iscoroutinefunction looks for


def mark_coroutine_function(call: C, fn: Callable[..., Any]) -> C:
    """Let ``call`` (which returns a ``Pending``, or another awaitable) pass for the coroutine
    function ``fn`` it stands for: ``inspect.iscoroutinefunction`` is True on Python 3.12+
    (``inspect.markcoroutinefunction``) and ``asyncio.iscoroutinefunction`` on every version
    (its ``_is_coroutine`` marker), so frameworks that look before they await take it as
    ``async def``. ``__wrapped_coroutine__`` is ``fn``."""
    call.__wrapped_coroutine__ = fn  # type: ignore[attr-defined]
    if _ASYNCIO_MARK is not None:
        call._is_coroutine = _ASYNCIO_MARK  # type: ignore[attr-defined]
    if sys.version_info >= (3, 12):
        inspect.markcoroutinefunction(call)
    return call
