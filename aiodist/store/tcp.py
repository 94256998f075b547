"""TCPStore: the client of torch's TCPStore protocol, and the master that hosts the server.

``store = await TCPStore(host, port, world_size, is_master, timeout)`` connects (and, for the
master, starts the server on its own thread) and returns the store; ``async with`` works too.

How requests travel:
- One *main* connection carries every request that the server answers at once. Requests from
  many tasks are pipelined on it (replies come back in order), so concurrent tasks sharing a
  store never wait for each other's round trips.
- ``get`` sends CHECK and GET in one write: an existing key costs one round trip (torch's
  client pays two: WAIT, then GET). Only a missing key falls back to a WAIT.
- A WAIT blocks its connection (the server answers it late, out of order), so waits run on
  separate *waiter* connections from a small pool. A task blocked in ``get`` never stalls
  another task's ``set`` on the same store object.
- ``set``/``append``/``multi_set``/``queue_push`` have no reply in the protocol; the client sends
  a PING behind them and awaits its echo, so when the call returns the server has the data.
- A lost connection fails the requests on it; the next call reconnects. Requests that are safe
  to repeat (reads) are retried once on the new connection.
- ``get`` and ``add``, the calls made one at a time in a loop, send when called and return a
  ``_Call``: a future the connection resolves with the call's value (no Python frame resumes
  when the reply comes). The other calls are coroutines in a ``Pending``, as everywhere.
A ``TCPStore`` object belongs to the event loop that awaited it; use ``clone()`` for another
loop or thread.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Generator, Sequence
from typing import Any

from aiodist import _startup
from aiodist._pending import communicating, mark_coroutine_function
from aiodist._time import TimeoutLike, within
from aiodist.errors import DistNetworkError, DistStoreError, QueueEmptyError, StoreTimeoutError
from aiodist.store._dial import Target, open_connection
from aiodist.store.base import (
    DEFAULT_STORE_TIMEOUT,
    VALUE_NOT_QUEUE,
    Store,
    ValueLike,
    check_key,
    check_keys,
    first_few,
    ms,
    pair_up,
    store_timeout,
    to_amount,
    to_value,
)
from aiodist.store.server import INIT_KEY, ListenError, ServerThread, TCPStoreServer, init_rank_key
from aiodist.wire.store import (
    CHECK_READY,
    STOP_WAITING,
    Limits,
    Op,
    Reply,
    encode,
    encode_add,
    encode_check_get,
    encode_set_ping,
)

__all__ = ["TCPStore", "InvalidEnvError"]

from aiodist.store._connection import (
    CHECK_GET,
    I64,
    NO_ARG,
    QUICK_CHECK_GET,
    QUICK_I64,
    U32,
    AddCall,
    Connection,
    Dropped,
    GetCall,
    Lost,
    NoReply,
    describe_call,
    log,
)

_U8 = ((Reply.U8, 0),)
_BYTES = ((Reply.BYTES, 0),)
_MAX_IDLE_WAITERS = 8
_DIAGNOSIS_S = 0.1  # how long a timed-out wait may take to learn which keys are missing


def _wire_key(key: str) -> bytes:
    """A user key as torch's client sends it: ``/`` in front."""
    return b"/" + check_key(key).encode()


class InvalidEnvError(ValueError, RuntimeError):
    """An environment variable torch's TCPStore reads holds a value it refuses. torch raises a
    RuntimeError; a wrong setting is a ValueError in aiodist: this is both."""


_TRUE = ("1", "t", "true", "y", "yes")
_FALSE = ("0", "f", "false", "n", "no")


def _agent_store_serves(port: int) -> bool:
    """Whether a master that cannot bind ``port`` should connect to it instead, as torch's
    TCPStore constructor decides: ``TORCHELASTIC_USE_AGENT_STORE`` is true (torch's boolean
    spelling: any case of 1/t/true/y/yes, or 0/f/false/n/no for false) and ``MASTER_PORT`` is
    this port. Like torch, read only after the bind failed; a value torch refuses raises."""
    raw = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if raw is None:
        return False
    if raw.lower() not in _TRUE + _FALSE:
        raise InvalidEnvError(f"Invalid value for environment variable: TORCHELASTIC_USE_AGENT_STORE (got {raw!r})")
    if raw.lower() in _FALSE:
        return False
    master_port = os.environ.get("MASTER_PORT")
    if master_port is None:
        return False  # torch's default, 0, is never a port that failed to bind
    try:
        return int(master_port) == port
    except ValueError:
        raise InvalidEnvError(f"Invalid value for environment variable: MASTER_PORT (got {master_port!r})") from None


class _Tenants:
    """Process-wide servers shared by ``multi_tenant=True`` stores with the same host:port."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[int, tuple[ServerThread, int]] = {}

    def acquire(self, key: int, start: Any) -> ServerThread:
        with self._lock:
            if key in self._servers:
                st, n = self._servers[key]
                self._servers[key] = (st, n + 1)
                return st
            st = start()
            self._servers[st.server.port] = (st, 1)
            return st

    def release(self, st: ServerThread) -> bool:
        """Drop one reference; True when it was the last (the caller stops the server)."""
        with self._lock:
            for key, (s, n) in list(self._servers.items()):
                if s is st:
                    if n > 1:
                        self._servers[key] = (s, n - 1)
                        return False
                    del self._servers[key]
                    return True
        return True


_TENANTS = _Tenants()


class TCPStore(Store):
    """torch's TCPStore, awaitable. See the module docstring for how requests travel.

    Arguments as torch's. ``limits`` (aiodist's) bounds what clients may send to the server
    this store hosts. A master whose port is taken becomes a client when
    ``TORCHELASTIC_USE_AGENT_STORE`` is true and ``MASTER_PORT`` is that port, as torch's
    (torchrun's agent already serves it). ``use_libuv`` is accepted for compatibility; the
    server is asyncio's (uvloop, itself libuv-based, when installed).
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        limits: Limits | None = None,
    ) -> None:
        super().__init__(timeout)
        if not isinstance(host_name, str):
            raise TypeError(f"host_name must be a str, got {type(host_name).__name__}")
        if not host_name:
            raise ValueError("host_name must not be empty")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, int):
                raise TypeError(f"world_size must be an int or None, got {world_size!r}")
            if world_size == 0:
                raise ValueError("TCPStore world size cannot be 0")  # torch's words
            if world_size < 0:
                world_size = None  # torch treats a negative world size as "not fixed"
        if port == 0 and not is_master:
            raise ValueError("a TCPStore client needs the server's port; port=0 is only for is_master=True")
        if master_listen_fd is not None and not is_master:
            raise ValueError("master_listen_fd is only for is_master=True")
        self._host = host_name
        self._port = port
        self._world_size = world_size
        self._is_master = bool(is_master)
        self._wait_for_workers = bool(wait_for_workers)
        self._multi_tenant = bool(multi_tenant)
        self._listen_fd = master_listen_fd
        self._use_libuv = bool(use_libuv)
        self._limits = limits
        # Same-host clients of an aiodist server talk over its abstract Unix socket (fewer
        # kernel steps than TCP loopback); torch servers have none, so TCP is used for them.
        self._use_local = True
        self._served_by: str | None = None
        self._server: ServerThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: Connection | None = None
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._connect_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False
        # spun: calls whose reply was read by spinning (Connection.spin); spin_misses: spins
        # that saw no reply in time
        self._counts: dict[str, int] = {"requests": 0, "reconnects": 0, "waits": 0, "spun": 0, "spin_misses": 0}

    # -- lifecycle ----------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, TCPStore]:
        return self._start().__await__()

    async def __aenter__(self) -> TCPStore:
        return await self._start()

    async def _start(self) -> TCPStore:
        if self._started:
            return self
        if self._closed:
            raise DistStoreError(f"{self._describe()} is closed")
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self._timeout_s
        if self._is_master:
            await self._start_server()
        rank = _startup.current().rank  # set by the rendezvous: the progress warnings name ranks
        self._served_by = _startup.current().server_of
        try:
            self._main = await open_connection(self._target(), deadline, starting=True)
            if self._world_size is not None and self._wait_for_workers:
                # The rank first, in the same write: the master then knows who is missing.
                say = encode(Op.SET, (init_rank_key(rank),), (b"1",)) if rank is not None else b""
                await self._request(say + encode(Op.ADD, (INIT_KEY,), number=1), I64, "join (init/ counter)", repeatable=False)
                if self._server is not None:
                    fut = self._server.submit(
                        self._server.server.wait_for_workers(
                            self._world_size, max(0.0, deadline - time.monotonic()), shown_s=self._timeout_s
                        )
                    )
                    async with _startup.warn_while(self._join_progress, self._join_progress_failed, log):
                        await asyncio.wrap_future(fut)
        except BaseException:
            await self.close()
            raise
        self._started = True
        return self

    async def _join_progress(self, elapsed: float) -> str:
        """The master's progress line while it waits for the workers to join."""
        assert self._server is not None and self._world_size is not None
        n = self._world_size
        count, missing = self._server.server.joined(n)
        who = f"ranks {_startup.ranks(missing)}" if missing is not None else f"{max(0, n - count)} more client(s)"
        return (
            f"{_startup.who(self._describe())} waiting for {who} to join the store at {self._describe_addr()} "
            f"({min(count, n)}/{n} joined, {_startup.waited(elapsed, self._timeout_s)})"
        )

    def _join_progress_failed(self, elapsed: float, exc: BaseException) -> str:
        return (
            f"{_startup.who(self._describe())} waiting for clients to join the store at {self._describe_addr()} "
            f"({_startup.waited(elapsed, self._timeout_s)}; the count is unknown: {exc!r})"
        )

    async def _start_server(self) -> None:
        limits = self._limits

        def start() -> ServerThread:
            sock = socket.socket(fileno=self._listen_fd) if self._listen_fd is not None else None
            return ServerThread(TCPStoreServer(None, self._port, limits=limits, sock=sock)).start()

        if self._multi_tenant and self._listen_fd is None and self._port != 0:
            # Keyed by port alone: the server listens on every interface whatever the host string.
            starting = asyncio.ensure_future(asyncio.to_thread(_TENANTS.acquire, self._port, start))
        else:
            starting = asyncio.ensure_future(asyncio.to_thread(start))
        try:
            self._server = await asyncio.shield(starting)
        except ListenError:
            if not _agent_store_serves(self._port):
                raise
            # torch's TCPStore does the same (and logs it as an error, in these words): under
            # torchrun the agent already serves MASTER_PORT, so this "master" is one more client.
            log.error(
                "[c10d] The server socket on %d has failed to bind. TORCHELASTIC_USE_AGENT_STORE is enabled so "
                "ignoring the error (this store connects to the agent's server as a client).",
                self._port,
            )
            return
        except asyncio.CancelledError:
            # The thread finishes starting the server anyway; stop it rather than leak it.
            try:
                st = await starting
            except Exception:
                raise asyncio.CancelledError from None
            if _TENANTS.release(st):
                await st.astop()
            raise
        self._port = self._server.server.port

    async def close(self) -> None:
        """Close the connections; the master also stops its server (other clients then fail)."""
        self._closed = True
        self._started = False
        for c in [self._main, *self._idle, *self._busy]:
            if c is not None:
                c.close()
        self._main = None
        self._idle.clear()
        self._busy.clear()
        server, self._server = self._server, None
        if server is not None and _TENANTS.release(server):
            await server.astop()

    # -- properties ---------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        return self._use_libuv

    @property
    def served_by(self) -> str | None:
        """Whose process serves this store, as the rendezvous that made it said (``"rank 0"``,
        ``"the launcher agent"``); None when not known (a store the user made). A timed-out op
        whose store does not answer names it (docs/c10d.md, "A frozen rank")."""
        return self._served_by

    @property
    def server(self) -> TCPStoreServer | None:
        """The server this store hosts (master only), for statistics."""
        return self._server.server if self._server is not None else None

    def _describe(self) -> str:
        return self._target().describe()

    def _describe_addr(self) -> str:
        return self._target().addr()

    def _target(self) -> Target:
        """Where a new connection goes, and what its errors and warnings say (store/_dial.py)."""
        return Target(self._host, self._port, self._use_local, self._timeout_s, self._counts)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {**super().stats(), "host": self._host, "port": self._port, "is_master": self._is_master}
        out.update(self._counts)
        out["waiter_connections"] = len(self._idle) + len(self._busy)
        out["transport"] = self._main.kind if self._main is not None and self._main.usable else None
        if self._server is not None:
            out["server"] = self._server.server.stats()
        return out

    def clone(self) -> TCPStore:
        """A new client of the same server; it connects on first use (on its own loop)."""
        c = TCPStore(self._host, self._port, None, False, self._timeout_s, False, use_libuv=self._use_libuv)
        c._started = True
        c._served_by = self._served_by
        return c

    # -- connections ----------------------------------------------------------------------

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop  # a clone belongs to the loop that first uses it
        elif self._loop is not loop:
            raise DistStoreError(f"{self._describe()} belongs to another event loop; use store.clone() on this one")

    async def _main_conn(self, deadline: float) -> Connection:
        """The main connection, reconnected if it broke; the reconnect (and the wait for another
        task's) ends by ``deadline`` (``time.monotonic()``), the calling request's."""
        self._check_loop()
        conn = self._main
        if conn is not None and conn.usable:
            return conn
        if not self._started:
            raise DistStoreError(
                f"{self._describe()} is not started: await it first (store = await TCPStore(...))"
                if not self._closed
                else f"{self._describe()} is closed"
            )
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        try:
            await within(self._connect_lock.acquire(), deadline - time.monotonic())
        except TimeoutError:
            raise DistNetworkError(
                f"{self._describe()}: could not reconnect to the TCPStore server at {self._describe_addr()} in time "
                f"(another task's reconnect was still trying)"
            ) from None
        try:
            conn = self._main
            if conn is None or not conn.usable:
                if conn is not None:
                    self._counts["reconnects"] += 1
                conn = self._main = await open_connection(self._target(), deadline)
        finally:
            self._connect_lock.release()
        return conn

    async def _request(
        self,
        payload: bytes,
        shapes: tuple[tuple[Reply, int], ...],
        op: str,
        arg: object = NO_ARG,
        repeatable: bool = True,
        timeout: float | None = None,
        *,
        retry_by: float | None = None,
    ) -> list[Any]:
        """Send on the main connection; the replies. The call ends within its ``timeout`` (the
        store's by default), reconnects and the retry included. A broken connection is retried
        once for ``repeatable`` requests, else it is a DistStoreError naming the call
        (``op(arg)``, formatted only when it fails: this is the hot path). ``retry_by`` (a
        ``time.monotonic()`` deadline): this is that retry, of a call whose first try (a
        ``_Call``'s) broke; it ends by then."""
        self._counts["requests"] += 1
        seconds = self._timeout_s if timeout is None else timeout
        deadline = time.monotonic() + seconds if retry_by is None else retry_by
        for attempt in (0, 1) if retry_by is None else (1,):
            conn = self._main
            if conn is None or conn.error is not None or conn.loop is not asyncio.get_running_loop():
                conn = await self._main_conn(deadline)
            try:
                if attempt == 0 and timeout is None:
                    # The hot path: the connection's own timer is this call's deadline.
                    fut = conn.send(payload, shapes, seconds, op, arg)
                    if conn.paused:
                        await conn.drain()
                    else:
                        conn.spin(fut)
                    return await fut
                # A shorter deadline than the store's (an explicit timeout, or a retry) ends this
                # call only: the connection stays, and is closed only if the reply is overdue by
                # the store timeout, so one short timeout does not fail the others on it.
                left = deadline - time.monotonic()
                fut = conn.send(payload, shapes, max(left, self._timeout_s), op, arg)
                if conn.paused:
                    await within(conn.drain(), left)
                return await within(fut, deadline - time.monotonic())
            except (Lost, TimeoutError) as exc:
                if repeatable and attempt == 0 and not isinstance(exc, (NoReply, TimeoutError)) and time.monotonic() < deadline:
                    continue  # no time left for a retry: say why the first try failed, not "could not connect in 0 s"
                raise self._failure(exc, op, arg, seconds) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _failure(self, exc: Exception, op: str, arg: object, seconds: float) -> Exception:
        """The error a call ``op(arg)`` fails with when its request broke with ``exc`` (a
        ``Lost`` from the connection, or the TimeoutError of its own deadline)."""
        if isinstance(exc, (NoReply, TimeoutError)):
            return StoreTimeoutError(
                f"{self._describe()}: {describe_call(op, arg)}: no reply from the server within {seconds:g} s (request timeout)"
            )
        if isinstance(exc, Dropped):
            return DistStoreError(
                f"{self._describe()}: {describe_call(op, arg)} failed: {exc}. Whether it took effect is unknown; the next call reconnects."
            )
        return DistStoreError(
            f"{self._describe()}: {describe_call(op, arg)} failed: {exc}. Whether it took effect is unknown. "
            f"A TCPStore server closes a connection when it refuses any request on it (add on a key "
            f"holding a non-integer, a key or value over its limits), which also fails the other "
            f"requests in flight on this store object; the next call reconnects."
        )

    async def _wait_keys(self, keys: list[bytes], deadline: float, what: str, timeout_s: float) -> None:
        """WAIT on a waiter connection until ``keys`` all exist or ``deadline`` (``time.monotonic()``)
        passes. ``timeout_s`` is the call's whole timeout, which the error names as torch's does."""
        self._check_loop()
        self._counts["waits"] += 1
        start = time.monotonic()
        conn = None
        while self._idle and conn is None:
            c = self._idle.pop()
            conn = c if c.usable else None
        try:
            if conn is None:
                conn = await open_connection(self._target(), deadline)
            self._busy.add(conn)
            fut = conn.send(encode(Op.WAIT, keys), _U8, None, "wait", keys)  # the wait's own deadline, below
            (r,) = await within(fut, deadline - time.monotonic())
            if r != STOP_WAITING:
                raise Lost(f"unexpected reply {r} to WAIT")
        except TimeoutError:
            if conn is not None:
                conn.close()
            missing = await self._missing(keys)
            names = [k.decode(errors="replace") for k in keys]  # torch names them with the wire's "/"
            torch_words = f"wait timeout after {ms(timeout_s)}ms, keys: {first_few(names)}"
            raise store_timeout(self._describe(), what, missing or [n[1:] for n in names], time.monotonic() - start, torch_words) from None
        except Lost as exc:
            conn.close()  # type: ignore[union-attr]
            raise DistStoreError(f"{self._describe()}: {what}: the waiter connection broke: {exc}") from None
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        finally:
            if conn is not None:
                self._busy.discard(conn)
        if conn.usable and len(self._idle) < _MAX_IDLE_WAITERS:
            self._idle.append(conn)
        else:
            conn.close()

    async def _missing(self, keys: list[bytes]) -> list[str]:
        """Which of ``keys`` (wire form) are missing now, for a timeout's message; [] when unknown.
        It asks on the main connection if that one is up (never a new one) and waits at most
        ``_DIAGNOSIS_S``: the timeout it explains has already passed. A server that is late
        leaves its answer to be dropped; the connection is not closed for it."""
        conn = self._main
        if conn is None or not conn.usable or conn.loop is not asyncio.get_running_loop():
            return []
        keys = keys[:64]
        payload = b"".join(encode(Op.CHECK, (k,)) for k in keys)
        try:
            fut = conn.send(payload, tuple((Reply.U8, 0) for _ in keys), self._timeout_s, "check", keys)
            ready = await within(fut, _DIAGNOSIS_S)
        except (Lost, TimeoutError):
            return []
        return [k[1:].decode(errors="replace") for k, r in zip(keys, ready) if r != CHECK_READY]

    async def _confirmed(self, payload: bytes, op: str, arg: object) -> None:
        """Send a request that has no reply, followed by a PING; return when it is echoed."""
        await self._request(payload + encode(Op.PING, number=0), U32, op, arg, repeatable=False)

    # -- the Store API ----------------------------------------------------------------------

    async def set(self, key: str, value: ValueLike) -> None:
        k = _wire_key(key)
        await self._request(encode_set_ping(k, to_value(value)), U32, "set", key, repeatable=False)

    # get and add: a ``_Call`` sent on the main connection when it is up on the running loop
    # (the store layer's one fast path: tests/test_handles.py checks it against the general
    # path), else the call as a coroutine (it reconnects, or runs when a loop runs it) made a
    # ``Pending``, as any other.

    def get(self, key: str) -> Awaitable[bytes]:  # type: ignore[override]
        if type(key) is not str:
            check_key(key)
        loop, conn = asyncio._get_running_loop(), self._main
        if loop is None or conn is None or conn.error is not None or conn.loop is not loop or conn.paused:
            return self._get(key)
        payload = encode_check_get(b"/" + key.encode())
        call = GetCall(loop=loop)
        f = sys._getframe(1)
        call._store, call._arg, call._payload, call._used, call._it = self, key, payload, False, None
        call._site = (f.f_code, f.f_lasti)  # the line is worked out only if it is ever named
        seconds = self._timeout_s
        call._deadline = time.monotonic() + seconds
        self._counts["requests"] += 1
        conn.send(payload, CHECK_GET, seconds, "get", key, call, QUICK_CHECK_GET)
        conn.spin(call)
        return call

    def add(self, key: str, amount: int) -> Awaitable[int]:  # type: ignore[override]
        if type(key) is not str:
            check_key(key)
        if type(amount) is not int or not -(2**63) <= amount < 2**63:
            amount = to_amount(amount)
        loop, conn = asyncio._get_running_loop(), self._main
        if loop is None or conn is None or conn.error is not None or conn.loop is not loop or conn.paused:
            return self._add(key, amount)
        call = AddCall(loop=loop)
        f = sys._getframe(1)
        arg = (key, amount)
        call._store, call._arg, call._used, call._it = self, arg, False, None
        call._site = (f.f_code, f.f_lasti)  # the line is worked out only if it is ever named
        self._counts["requests"] += 1
        conn.send(encode_add(b"/" + key.encode(), amount), I64, self._timeout_s, "add", arg, call, QUICK_I64)
        conn.spin(call)
        return call

    async def _get_rest(self, key: str, payload: bytes, deadline: float, retry: bool) -> bytes:
        """What is left of a ``get`` whose first CHECK+GET found no key (``retry`` False) or
        broke with its connection (True: it is read again on a new one, once)."""
        k = _wire_key(key)
        if retry:
            ready, value = await self._request(payload, CHECK_GET, "get", key, retry_by=deadline)
            if ready == CHECK_READY:
                return value
        while True:
            await self._wait_keys([k], deadline, f"get({key!r})", self._timeout_s)
            ready, value = await self._request(payload, CHECK_GET, "get", key)
            if ready == CHECK_READY:
                return value

    async def _get_slow(self, key: str) -> bytes:
        k = _wire_key(key)
        payload = encode_check_get(k)
        deadline = time.monotonic() + self._timeout_s
        ready, value = await self._request(payload, CHECK_GET, "get", key)
        if ready == CHECK_READY:
            return value
        return await self._get_rest(key, payload, deadline, False)

    async def _add_slow(self, key: str, amount: int) -> int:
        (v,) = await self._request(encode_add(_wire_key(key), amount), I64, "add", (key, amount), repeatable=False)
        return v

    _get = communicating(_get_slow, "store.get")
    _add = communicating(_add_slow, "store.add")
    # the hot paths pass for the coroutine functions they stand for, as every communicating call does
    get = mark_coroutine_function(get, _get_slow)
    add = mark_coroutine_function(add, _add_slow)

    async def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        k = _wire_key(key)
        e, d = to_value(expected_value, "expected_value"), to_value(desired_value, "desired_value")
        (v,) = await self._request(encode(Op.COMPARE_SET, (k,), (e, d)), _BYTES, "compare_set", key, repeatable=False)
        return v

    async def wait(self, keys: Sequence[str], timeout: TimeoutLike | None = None) -> None:
        ks = check_keys(keys)
        seconds = self._wait_seconds(timeout)
        deadline = time.monotonic() + seconds  # bounds the whole call: the CHECK, a reconnect, the WAIT
        bkeys = [b"/" + k.encode() for k in ks]
        (ready,) = await self._request(encode(Op.CHECK, bkeys), _U8, "wait", ks, timeout=seconds)
        if ready != CHECK_READY:
            await self._wait_keys(bkeys, deadline, f"wait({ks!r})", seconds)

    async def check(self, keys: Sequence[str]) -> bool:
        ks = check_keys(keys)
        (ready,) = await self._request(encode(Op.CHECK, [b"/" + k.encode() for k in ks]), _U8, "check", ks)
        return ready == CHECK_READY

    async def delete_key(self, key: str) -> bool:
        k = _wire_key(key)
        (n,) = await self._request(encode(Op.DELETE_KEY, (k,)), I64, "delete_key", key, repeatable=False)
        return bool(n)

    async def num_keys(self) -> int:
        (n,) = await self._request(encode(Op.GETNUMKEYS), I64, "num_keys")
        return n

    async def list_keys(self) -> list[str]:
        (keys,) = await self._request(encode(Op.LIST), ((Reply.COUNTED_LIST, 0),), "list_keys")
        return [k[1:].decode(errors="replace") for k in keys if k.startswith(b"/")]

    async def append(self, key: str, value: ValueLike) -> None:
        k = _wire_key(key)
        await self._confirmed(encode(Op.APPEND, (k,), (to_value(value),)), "append", key)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        if not ks:
            return []
        bkeys = [b"/" + k.encode() for k in ks]
        payload = encode(Op.CHECK, bkeys) + encode(Op.MULTI_GET, bkeys)
        shapes = ((Reply.U8, 0), (Reply.BYTES_LIST, len(bkeys)))
        deadline = time.monotonic() + self._timeout_s
        while True:
            ready, values = await self._request(payload, shapes, "multi_get", ks)
            if ready == CHECK_READY:
                return values
            await self._wait_keys(bkeys, deadline, f"multi_get({ks!r})", self._timeout_s)

    async def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        ks, vs = pair_up(keys, values)
        await self._confirmed(encode(Op.MULTI_SET, [b"/" + k.encode() for k in ks], vs), "multi_set", ks)

    async def queue_push(self, key: str, value: ValueLike) -> None:
        k = _wire_key(key)
        await self._confirmed(encode(Op.QUEUE_PUSH, (k,), (to_value(value),)), "queue_push", key)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        k = _wire_key(key)
        payload = encode(Op.QUEUE_POP, (k,))
        probe = encode(Op.CHECK, (k,)) + encode(Op.QUEUE_LEN, (k,))
        deadline = time.monotonic() + self._timeout_s
        while True:
            ((n, value),) = await self._request(payload, ((Reply.QUEUE_POP, 0),), "queue_pop", key, repeatable=False)
            if n > 0:
                return value
            if not block:
                raise QueueEmptyError(f"{self._describe()}: queue_pop({key!r}, block=False): queue is empty")
            # WAIT cannot tell a queue from a value: on a key that holds a value it returns at
            # once, and the pop would spin. CHECK and QUEUE_LEN, answered together, can.
            ready, length = await self._request(probe, ((Reply.U8, 0), (Reply.I64, 0)), "queue_pop", key)
            if length > 0:
                continue
            if ready == CHECK_READY:
                raise QueueEmptyError(VALUE_NOT_QUEUE.format(store=self._describe(), key=key))
            await self._wait_keys([k], deadline, f"queue_pop({key!r})", self._timeout_s)

    async def queue_len(self, key: str) -> int:
        k = _wire_key(key)
        (n,) = await self._request(encode(Op.QUEUE_LEN, (k,)), I64, "queue_len", key)
        return n

    async def ping(self) -> float:
        """One round trip to the server; its time in seconds."""
        t = time.perf_counter()
        await self._request(encode(Op.PING, number=1), U32, "ping")
        return time.perf_counter() - t
