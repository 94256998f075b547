"""The TCPStore client's connection: what ``TCPStore`` (aiodist/store/tcp.py) sends requests
through. ``Connection`` is the asyncio protocol of one connection to the server: it writes
requests (pipelined), parses the replies (aiodist.wire.store) and resolves each request's future
in order, spinning briefly for a same-host reply (``AIODIST_STORE_SPIN_US``) instead of a loop
pass; a connection that breaks fails every request still waiting with why. ``_Call`` (and its
``get``/``add`` kinds) is the call handle of the one-op-at-a-time path: the request's future is
the call itself. The API (keys, timeouts, waits, clones, the server) is ``TCPStore``'s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Coroutine, Generator
from types import CodeType
from typing import Any, NamedTuple, Protocol, TypeVar

from aiodist._pending import file_line, not_produced, say_never_awaited
from aiodist.knobs import knob
from aiodist.store.server import TCPStoreServer
from aiodist.wire.store import (
    CHECK_READY,
    QUICK,
    ProtocolError,
    Reply,
    ReplyParser,
)

log = logging.getLogger("aiodist.store")

I64 = ((Reply.I64, 0),)
U32 = ((Reply.U32, 0),)
CHECK_GET = ((Reply.U8, 0), (Reply.BYTES, 0))
QUICK_I64, QUICK_CHECK_GET = QUICK[I64], QUICK[CHECK_GET]
# Spinning for a reply (``Connection.spin``): how long at most, per request (a same-host reply
# comes in 7-40 us here, p99 65 us across CPUs); how recently the loop must have run for a call
# to finish without it; and the back-off from spins that see no reply.
SPIN_LOOP_S = 0.001
SPIN_BACKOFF_MAX = 8  # after k spins in a row that saw no reply, 2**k - 1 requests do not spin (k <= 8)


def _spin_seconds(raw: str | None = None) -> float:
    """``AIODIST_STORE_SPIN_US`` (through the registry; ``raw``: that value instead of the
    environment's) in seconds: microseconds, default 100, 0 never spins. A malformed value is
    named in a WARNING and the default used (this runs at import)."""
    k = knob("AIODIST_STORE_SPIN_US")
    try:
        return k.number(None if raw is None else {k.name: raw}) * 1e-6
    except ValueError as exc:
        log.warning("%s (0: never spin); using %g", exc, k.default)
        return k.number({}) * 1e-6


SPIN_S = _spin_seconds()
T = TypeVar("T")
_get_running_loop = asyncio._get_running_loop
_monotonic = time.monotonic
_read = os.read
_yield = os.sched_yield
_current_task = asyncio.current_task


class Lost(Exception):
    """The connection under a request broke (wrapped into a DistError by the caller)."""


class BadPeer(Lost):
    """The peer sent bytes that break the protocol: not (or no longer) a TCPStore server."""


class NoReply(Lost):
    """The server did not answer this request in time; the connection is closed."""


class Dropped(Lost):
    """The connection was closed because another request on it had no reply in time: this one
    may be fine, and a read can be repeated on a new connection."""


class _Pending(NamedTuple):
    """One request group in flight: the future of its replies, how many they are, when they
    are due, and what it was (``op``/``arg``, for the error of the others if it is the one
    overdue). Made with ``_new_pending`` (the tuple's C constructor: this is the hot path)."""

    fut: asyncio.Future[list[Any]]
    replies: int  # how many replies the group has
    deadline: float | None
    seconds: float | None
    op: str
    arg: object
    quick: Any  # the group's decoder for ReplyParser.feed_group, or None


_new_pending = tuple.__new__


class Connection(asyncio.Protocol):
    """One client connection: writes request groups, hands each group's replies (which come
    back in order) to one future. A single timer per connection watches the earliest deadline
    of the groups in flight, instead of one timer per request (the hot path only compares it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, counts: dict[str, int] | None = None) -> None:
        self.loop = loop
        self.counts = {"spun": 0, "spin_misses": 0} if counts is None else counts  # the store's stats()
        self.parser = ReplyParser()
        self.pending: deque[_Pending] = deque()
        self.transport: asyncio.Transport | None = None
        self.error: Exception | None = None
        self.paused = False
        self._drain: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # spin(): the socket's fd and a poll on it (None: this connection never spins); when
        # the current run of spins began, and whether the loop has yet to run since (_loop_ran);
        # the back-off.
        self._fd = -1
        self._poll: Any = None
        self._ran = 0.0
        self._stamp_due = False
        self._skip = 0
        self._misses = 0
        self._last_task: Any = None  # the task of the last request sent that could spin

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sock is not None and SPIN_S > 0 and _same_host(sock):
            self._fd = sock.fileno()
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)

    def data_received(self, data: bytes) -> None:
        parser, pending = self.parser, self.pending
        try:
            if not pending:
                parser.feed(data)  # bytes with no reply owed: feed raises
                return
            head = pending[0]
            # The usual chunk is exactly the replies of the one group in flight: read in place.
            values = parser.feed_group(data, head.replies, head.quick)
            while values is not None:
                pending.popleft()
                if not head.fut.done():
                    head.fut.set_result(values)
                if not pending:
                    parser.next_reply()  # nothing is owed now: a byte past the last reply raises
                    return
                head = pending[0]
                values = parser.next_group(head.replies)
        except ProtocolError as exc:
            self._fail(BadPeer(f"protocol error from the server: {exc}"))
            assert self.transport is not None
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(Lost(f"connection closed by the server{': ' + str(exc) if exc else ''}"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _fail(self, exc: Exception, overdue: float | None = None) -> None:
        """Fail every request in flight with ``exc``; with ``overdue`` (a loop time), those
        whose deadline had passed by then with ``NoReply`` instead."""
        if self.error is None:
            self.error = exc
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)  # a writer blocked on flow control learns of the failure
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.pending:
            p = self.pending.popleft()
            if not p.fut.done():
                late = overdue is not None and p.deadline is not None and p.deadline <= overdue
                p.fut.set_exception(NoReply("no reply from the server in time") if late else exc)

    def _check_deadline(self) -> None:
        self._timer = None
        now = self.loop.time()
        late = next((p for p in self.pending if p.deadline is not None and p.deadline <= now), None)
        if late is not None:
            # One overdue reply means the server is stuck or the stream is lost: every reply
            # behind it is stuck too. The others are told why, and reads among them are retried.
            self._fail(
                Dropped(
                    f"the connection was closed because {describe_call(late.op, late.arg)}, sent on it before or "
                    f"with this request, had no reply from the server within {late.seconds:g} s"
                ),
                overdue=now,
            )
            if self.transport is not None:
                self.transport.abort()  # close() would wait to flush to a peer that is not reading
            return
        due = min((p.deadline for p in self.pending if p.deadline is not None), default=None)
        if due is not None:
            self._arm(due)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            if self._timer.when() <= when:
                return  # an earlier check is already due; it re-arms for the rest
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._check_deadline)

    def _loop_ran(self) -> None:
        self._stamp_due = False

    # API
    def spin(self, fut: asyncio.Future[Any]) -> None:
        """Read the reply to ``fut``'s request (just sent, the only one in flight) straight
        from the socket if it comes within ``SPIN_S``, so the call is done before it is
        awaited: a round trip to a same-host server then costs no pass of the event loop, nor
        a wake-up from idle of this CPU (tens of microseconds in a VM). Between
        polls the thread yields its CPU, to the server when it shares it. Otherwise the
        transport reads the reply as always.

        The loop is never held long: one spin is at most ``SPIN_S``, and spins follow one
        another without a pass of the loop (``_loop_ran``, a callback, sees one) for at most
        ``SPIN_LOOP_S``; then a call waits in the loop, so a task making calls one after
        another still lets the loop run every millisecond. After k spins in a row that saw no
        reply (a busy or slow server), the next 2**k - 1 requests do not spin (k at most
        ``SPIN_BACKOFF_MAX``); a reply in time resets k. Never while a server runs in this
        process (it may need this thread's GIL or this loop to answer), nor on a connection to
        another host, nor for a call from another task than the last one: tasks that take
        turns on a store pipeline their requests (one round trip for many), which a spin
        would serialise."""
        poll = self._poll
        if poll is None:
            return
        task = _current_task()
        if task is not self._last_task:
            self._last_task = task  # a task's first call, or tasks taking turns: they pipeline
            return
        if len(self.pending) != 1 or TCPStoreServer.serving_here:
            return
        if self._skip:
            self._skip -= 1
            return
        start = _monotonic()
        if not self._stamp_due:  # the loop ran since the last spin: a new run of spins starts
            self._stamp_due = True
            self._ran = start
            self.loop.call_soon(self._loop_ran)
        elif start - self._ran > SPIN_LOOP_S:
            return  # spins since `_ran` held the loop long enough: this call waits in it
        if self.transport.get_write_buffer_size():  # type: ignore[union-attr]
            return
        end = start + SPIN_S
        try:
            while True:
                if poll.poll(0):
                    data = _read(self._fd, 65536)
                    if not data:
                        return  # end of stream: the transport sees it too, and says so
                    self.data_received(data)
                    if fut.done() or self.error is not None:
                        self._misses = 0
                        self.counts["spun"] += 1
                        return
                elif _monotonic() > end:
                    self.counts["spin_misses"] += 1
                    if self._misses < SPIN_BACKOFF_MAX:
                        self._misses += 1
                    self._skip = (1 << self._misses) - 1
                    return
                else:
                    _yield()
        except OSError:
            return  # (a reset, EAGAIN after a spurious wake-up): left to the transport

    @property
    def usable(self) -> bool:
        return self.error is None and self.transport is not None and not self.transport.is_closing()

    def send(
        self,
        payload: bytes,
        shapes: tuple[tuple[Reply, int], ...],
        timeout: float | None,
        op: str = "request",
        arg: object = None,
        fut: asyncio.Future[Any] | None = None,
        quick: Any = None,
    ) -> asyncio.Future[Any]:
        """Write one request group (``op(arg)``, as errors name it); a future of its replies
        (``fut`` when given: a ``_Call``, which makes the call's value of them). With
        ``timeout``, the connection is closed if they are not all in by then: the group fails
        with ``NoReply``, every other one in flight with ``Dropped``. A caller that stops
        waiting earlier cancels the future; its replies are then read and dropped."""
        if self.error is not None:
            raise self.error
        assert self.transport is not None
        self.parser.expect_each(shapes)
        if fut is None:
            fut = self.loop.create_future()
        if timeout is None:
            deadline = None
        else:
            deadline = self.loop.time() + timeout
            timer = self._timer
            if timer is None or timer.when() > deadline:  # (the hot path: a timer due earlier is armed)
                self._arm(deadline)
        self.pending.append(_new_pending(_Pending, (fut, len(shapes), deadline, timeout, op, arg, quick)))
        self.transport.write(payload)
        return fut

    async def drain(self) -> None:
        if self.paused and self.error is None:
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await self._drain

    def close(self) -> None:
        # abort, not close: nothing unconfirmed is worth flushing (every write is confirmed by a
        # reply), and close() would keep the socket until a stuck server read it.
        if self.transport is not None:
            self.transport.abort()
        self._fail(Lost("connection closed by this client"))

    @property
    def kind(self) -> str:
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        return "unix" if sock is not None and sock.family == socket.AF_UNIX else "tcp"


_future_await = asyncio.Future.__await__
_future_result = asyncio.Future.set_result
_future_exception = asyncio.Future.set_exception
_future_add_done_callback = asyncio.Future.add_done_callback
_future_del = asyncio.Future.__del__
_future_get_result = asyncio.Future.result
_future_get_exception = asyncio.Future.exception


class CallOwner(Protocol):
    """What a call asks of the store it belongs to (``TCPStore`` keeps it; mypy checks that
    where the store makes its calls), as the transport's connections have ``ConnectionOwner``:
    the error a broken call raises, and the rest of a get that must wait (a missing key) or be
    retried on a new connection. Its members are the store's own private hooks, not its API."""

    _timeout_s: float

    def _failure(self, exc: Exception, op: str, arg: object, seconds: float) -> Exception: ...
    def _get_rest(self, key: str, payload: bytes, deadline: float, retry: bool) -> Coroutine[Any, Any, bytes]: ...


class _Call(asyncio.Future, Coroutine):
    """What ``get`` and ``add`` return while the main connection is up: the request is already
    sent, and this future is the call itself. The connection resolves it as any request's
    future, with the group's replies (``set_result``) or why it broke (``set_exception``), and
    the subclass turns those into the call's value or error, or hands what is left (a missing
    key's WAIT, a read's retry on a new connection) to a task that resolves it later. So
    ``await store.add(k, 1)`` resumes no Python frame when the reply comes: the cost of one op
    at a time is one loop pass. Everywhere else it is a ``Pending``, as the other
    calls' handles (``aiodist._pending``): a Coroutine (``create_task``, ``gather``,
    ``wait_for`` take it), ``wait()`` and ``is_completed()``, and an ERROR that names the
    line of a call dropped without an ``await`` (the request is sent anyway)."""

    __slots__ = ("_store", "_arg", "_payload", "_deadline", "_site", "_used", "_it", "_task")
    _op = "call"
    _store: CallOwner
    _arg: Any  # what errors name: get's key, add's (key, amount)
    _payload: bytes  # get's request, for what is left of it
    _deadline: float  # get's, time.monotonic(): the whole call ends by then
    _site: tuple[CodeType, int]  # where it was called (code, instruction offset), for a dropped call's ERROR
    _used: bool  # awaited (or waited on, or run as a task)
    _it: Any  # the future's iterator, when a task runs this as its coroutine
    _task: asyncio.Task[Any]  # the task finishing the call, if any

    def __await__(self) -> Generator[Any, None, Any]:
        self._used = True
        return _future_await(self)

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        # What gather, wait_for, shield and asyncio.wait do with a future instead of awaiting it.
        self._used = True
        _future_add_done_callback(self, fn, context=context)

    def _then(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Finish the call in a task running ``coro`` (cancelled with this future)."""
        self._task = task = self.get_loop().create_task(coro)
        task.add_done_callback(self._finished)
        _future_add_done_callback(self, _cancel_task)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        if self.done():
            if not task.cancelled():
                task.exception()  # retrieved: the call was cancelled, nobody wants it
            return
        if task.cancelled():
            self.cancel()
        elif (exc := task.exception()) is not None:
            _future_exception(self, exc)
        else:
            _future_result(self, task.result())

    def set_exception(self, exc: Any) -> None:  # the connection broke under the request
        store = self._store
        _future_exception(self, store._failure(exc, self._op, self._arg, store._timeout_s))

    # the Coroutine protocol, for create_task
    def send(self, value: Any) -> Any:
        if self._it is None:
            self._used = True
            self._it = _future_await(self)
        return self._it.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._it is None:
            self._used = True
            self._it = _future_await(self)
        return self._it.throw(typ if val is None else val)

    def close(self) -> None:
        self._used = True
        if self._it is not None:
            self._it.close()

    # torch's Work methods, as Pending's (for a call that returns no Work)
    async def wait(self, timeout: Any = None) -> bool:
        await self
        return True

    def is_completed(self) -> bool:
        self._used = True
        return self.done()

    def is_success(self) -> bool:
        self._used = True
        return self.done() and not self.cancelled() and _future_get_exception(self) is None

    def result(self) -> Any:
        self._used = True
        if not self.done():
            raise not_produced(f"store.{self._op}", "result")
        return _future_get_result(self)

    def exception(self) -> BaseException | None:
        self._used = True
        if not self.done():
            raise not_produced(f"store.{self._op}", "exception")
        return _future_get_exception(self)

    def source_rank(self) -> int:
        raise RuntimeError(f"source_rank() is only defined for receives, not for store.{self._op}")

    def __del__(self) -> None:  # (a Python call per op: kept to what the check needs)
        if not self._used:
            try:
                file, line = file_line(self._site)
                say_never_awaited(f"store.{self._op}", file, line, "the op was started when called; nothing waits for it")
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
        _future_del(self)  # the Future's own: an error nobody retrieved is logged


def _cancel_task(call: asyncio.Future[Any]) -> None:
    task = call._task  # type: ignore[attr-defined]
    if call.cancelled() and not task.done():
        task.cancel()


class AddCall(_Call):
    __slots__ = ()
    _op = "add"

    def set_result(self, values: Any) -> None:
        _future_result(self, values[0])


class GetCall(_Call):
    __slots__ = ()
    _op = "get"

    def set_result(self, values: Any) -> None:
        if values[0] == CHECK_READY:
            _future_result(self, values[1])
        else:  # not there yet: WAIT for it, then read it again
            self._then(self._store._get_rest(self._arg, self._payload, self._deadline, False))

    def set_exception(self, exc: Any) -> None:
        if isinstance(exc, Lost) and not isinstance(exc, NoReply) and time.monotonic() < self._deadline:
            self._then(self._store._get_rest(self._arg, self._payload, self._deadline, True))  # a read: retried
        else:
            super().set_exception(exc)


NO_ARG: Any = object()


def describe_call(op: str, arg: object) -> str:
    """How an error message names a call: ``get('k')``, ``add('k', 1)``, ``num_keys()``."""
    if arg is NO_ARG:
        return f"{op}()"
    if isinstance(arg, tuple):
        return f"{op}({', '.join(repr(a) for a in arg)})"
    return f"{op}({arg!r})"


def _same_host(sock: Any) -> bool:
    """Whether a connected socket's peer is on this host: a Unix socket, or a loopback peer."""
    if sock.family == socket.AF_UNIX:
        return True
    try:
        return is_loopback(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
