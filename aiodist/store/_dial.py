"""Opening a TCPStore client's connections (``TCPStore`` in aiodist/store/tcp.py keeps the store
API and asks here for a new connection): connect over the server's same-host Unix socket where it
has one, else TCP; the handshake (VALIDATE, then a PING with the pid, as torch's client);
retries with backoff until the deadline, and the start-up warnings that say who waits for whom.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from aiodist import _startup
from aiodist._time import within
from aiodist.errors import DistNetworkError
from aiodist.store._connection import NO_ARG, U32, BadPeer, Connection, Lost, NoReply, is_loopback, log
from aiodist.store.server import local_socket_name
from aiodist.wire.store import Op, encode

__all__ = ["Target", "open_connection"]

_CONNECT_ATTEMPT_S = 5.0  # one connect attempt's deadline
#: how long one connection waits for the handshake's reply: a TCPStore answers in milliseconds;
#: a program that accepted and says nothing (another server on the port) is named after this
_HANDSHAKE_S = 3.0


@dataclass(frozen=True, slots=True)
class Target:
    """Where a store's new connection goes: its address, whether a same-host Unix socket may be
    used, the store's timeout (its first connect's), and the store's counters (the
    connections count their bytes and spins there)."""

    host: str
    port: int
    use_local: bool
    timeout_s: float
    counts: Any

    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def describe(self) -> str:
        return f"TCPStore({self.addr()})"


def _connect_ms(t: Target, deadline: float, start: float, starting: bool) -> int:
    """The milliseconds torch's connect-timeout sentence names: the store's timeout for its
    first connect (the deadline was set a moment before the first try: measured from that
    try, a loaded machine printed 999ms for a 1 s timeout), else the time this try had."""
    return round(t.timeout_s * 1000) if starting else round(max(0.0, deadline - start) * 1000)


async def open_connection(t: Target, deadline: float, starting: bool = False) -> Connection:
    """A new validated connection, retrying with backoff until ``deadline``: a refused
    connect, and a connection the server drops during the handshake (a server that is
    starting or stopping), are both retried. A host name that does not resolve is warned
    about at the first failure; any failure that lasts, every ``AIODIST_INIT_WARN_INTERVAL``
    seconds. ``starting``: the store's first connect, whose warnings name the start-up phase."""
    loop = asyncio.get_running_loop()
    delay, start = 0.01, time.monotonic()
    warned, every, unresolved, why = start, _startup.warn_interval(), False, ""
    warned_silent = False
    while True:
        shaking = False  # connected, waiting for the handshake's reply
        try:
            conn = await _open_local(t, loop)
            if conn is None:
                # one attempt is bounded too, so a host that drops SYNs is retried and warned about
                connecting = loop.create_connection(lambda: Connection(loop, t.counts), t.host, t.port)
                _, tcp = await within(connecting, max(0.001, min(deadline - time.monotonic(), _CONNECT_ATTEMPT_S)))
                conn = tcp
            shaking = True
            got, nonce = await _handshake(conn, min(deadline, time.monotonic() + _HANDSHAKE_S))
        except BadPeer as exc:
            raise DistNetworkError(
                f"{t.describe()}: handshake failed: {exc}: not a TCPStore server; is another program listening on port {t.port}?"
            ) from None
        except (OSError, TimeoutError, Lost) as exc:
            now = time.monotonic()
            # an attempt cut short by the deadline says nothing new: keep the error before it
            why = str(exc) or why or "no answer in time"
            if shaking and isinstance(exc, (TimeoutError, NoReply)):  # something accepted, and said nothing a TCPStore would
                why = (
                    f"something accepted the connection at {t.addr()} but did not answer the TCPStore "
                    f"handshake within {_HANDSHAKE_S:g} s: is another program listening on port {t.port}?"
                )
                if not warned_silent:
                    warned_silent, warned = True, now
                    log.warning("%s", _unreachable(t, why, now - start, deadline - start, starting))
            if isinstance(exc, socket.gaierror) and not unresolved:  # a misspelt MASTER_ADDR: say so at once
                unresolved, warned = True, now
                log.warning("%s", _unresolved(t, exc, deadline - start, starting))
            elif now - warned >= every:
                warned = now
                log.warning("%s", _unreachable(t, why, now - start, deadline - start, starting))
            now = time.monotonic()
            if now >= deadline:
                raise DistNetworkError(
                    f"The client socket has timed out after {_connect_ms(t, deadline, start, starting)}ms while trying to "
                    f"connect to ({t.host}, {t.port}). Could not connect to the TCPStore server at "
                    f"{t.addr()} within the connect timeout (tried for {now - start:.1f} s): {why}"
                ) from None
            await asyncio.sleep(min(delay, deadline - now))  # the last try comes at the deadline
            delay = min(delay * 2, 1.0)
            continue
        if got != nonce:
            conn.close()
            heard = int(got).to_bytes(4, "little")
            raise DistNetworkError(
                f"{t.describe()}: handshake failed: the server at {t.addr()} answered {heard!r} "
                f"(ping echo {got} != {nonce}): it is not a TCPStore server; is another program listening on port {t.port}?"
            )
        return conn


def _waiter(t: Target, starting: bool) -> tuple[str, str]:
    """Who waits and for what: ``("init_process_group: rank 1", "rank 0's TCPStore server")``
    during start-up, else this store and "the TCPStore server"."""
    if not starting:
        return t.describe(), "the TCPStore server"
    p = _startup.current()
    return _startup.who(t.describe()), f"{p.server_of}'s TCPStore server" if p.server_of else "the TCPStore server"


def _unresolved(t: Target, exc: OSError, total: float, starting: bool) -> str:
    who, server = _waiter(t, starting)
    source = _startup.current().addr_from if starting else None
    return (
        f"{who} cannot resolve {t.host!r}, the host of {server} at {t.addr()}"
        f"{f' (from {source})' if source else ''}: {exc}; is the name right? Still trying, "
        f"until the timeout ({_startup.seconds(total)})"
    )


def _unreachable(t: Target, why: str, elapsed: float, total: float, starting: bool) -> str:
    who, server = _waiter(t, starting)
    return f"{who} waiting for {server} at {t.addr()} to accept a connection ({_startup.waited(elapsed, total)}; last error: {why})"


async def _handshake(conn: Connection, deadline: float) -> tuple[int, int]:
    """VALIDATE, then a PING with this process's pid as the nonce (as torch's client): (the echo, the nonce)."""
    nonce = os.getpid() & 0xFFFFFFFF  # torch's client pings with its pid
    try:
        (got,) = await conn.send(
            encode(Op.VALIDATE, number=0x3C85F7CE) + encode(Op.PING, number=nonce),
            U32,
            max(0.001, deadline - time.monotonic()),
            "handshake",
            NO_ARG,
        )
    except BaseException:  # lost, or cancelled mid-handshake: do not leak the socket
        conn.close()
        raise
    return got, nonce


async def _open_local(t: Target, loop: asyncio.AbstractEventLoop) -> Connection | None:
    """A connection over the server's same-host Unix socket, when the host is loopback and
    an aiodist server listens there (see ``TCPStoreServer``); else None (use TCP)."""
    name = local_socket_name(t.port) if t.use_local and is_loopback(t.host) else None
    if name is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(name)  # abstract sockets connect at once or refuse at once
    except OSError:
        sock.close()
        return None
    _, conn = await loop.create_unix_connection(lambda: Connection(loop, t.counts), sock=sock)
    return conn
