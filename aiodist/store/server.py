"""The TCPStore server: an asyncio server speaking torch's TCPStore protocol.

``TCPStoreServer`` runs on whatever loop starts it (the launcher hosts it on its own loop);
``ServerThread`` runs one on a private thread and loop, which is how ``TCPStore(is_master=True)``
keeps answering while the master's own code computes.

Rules it keeps:
- A connection is a ``RequestParser`` (sans-I/O) fed by ``data_received``; every complete
  request in a chunk is answered, and the replies of one chunk go out in one write.
- A WAIT does not hold up the connection: later requests are answered at once and the WAIT's
  STOP_WAITING comes when its keys exist (torch's server does the same).
- Bad input (garbage, a bad magic, unknown opcodes, sizes over ``Limits``, ADD on a non-integer)
  closes that connection only, with a log line naming the peer and the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import math
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from aiodist.errors import DistNetworkError, StoreTimeoutError
from aiodist.store.state import KVState, Waiter
from aiodist.wire.store import (
    CHECK_NOT_READY,
    CHECK_READY,
    STOP_WAITING,
    WAIT_CANCELED,
    Limits,
    Op,
    ProtocolError,
    Request,
    RequestParser,
    encode_bytes,
    encode_bytes_list,
    encode_i64,
    encode_queue_pop,
    encode_u8,
    encode_u32,
    quick_request,
)

__all__ = ["TCPStoreServer", "ServerThread", "ListenError", "INIT_KEY", "init_rank_key", "new_event_loop"]

log = logging.getLogger("aiodist.store.server")

INIT_KEY = b"init/"
_MAX_NAMED_RANKS = 1 << 16  # a bigger world's progress warnings give counts, not names


def init_rank_key(rank: int) -> bytes:
    """Where an aiodist client that joins as ``rank`` says so, just before its ``init/`` ADD
    (so the master's progress warnings name the missing ranks). Without the ``/`` of user keys,
    so ``list_keys`` does not show it (as ``init/``); ``num_keys`` counts it."""
    return b"init/rank/%d" % rank


_STOP = encode_u8(STOP_WAITING)
_READY = encode_u8(CHECK_READY)
_NOT_READY = encode_u8(CHECK_NOT_READY)
_CANCELED = encode_u8(WAIT_CANCELED)
_EMPTY = encode_bytes(b"")  # GET of a missing key: an empty value, as torch's server answers
_pack_u64 = struct.Struct("<Q").pack  # the wire's string length and i64, without a wrapper call
_pack_i64 = struct.Struct("<q").pack
_u64_at = struct.Struct("<Q").unpack_from
_i64_at = struct.Struct("<q").unpack_from
# Opcodes as plain ints (comparing with an IntEnum member costs several times more), and the key
# count of a one-key CHECK as it is on the wire.
_OP_GET, _OP_ADD, _OP_SET, _OP_CHECK, _OP_PING = int(Op.GET), int(Op.ADD), int(Op.SET), int(Op.CHECK), int(Op.PING)
_ONE_KEY = struct.pack("<Q", 1)
_FLUSH_BYTES = 64 * 1024
# The accept queue of each listener (the kernel caps it at net.core.somaxconn). Every rank of a
# job connects at once; asyncio's create_server would listen again with its default of 100,
# and a burst beyond that at a busy server has its SYNs dropped (retried after 1 s, 3 s, ...).
LISTEN_BACKLOG = 2048


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop: uvloop's when installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def local_socket_name(port: int) -> str | None:
    """The abstract Unix socket where a server on every interface and ``port`` also listens
    (Linux only; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    return f"\0aiodist-tcpstore-{port}"


class ListenError(DistNetworkError):
    """The server socket could not bind or listen (say, the port is in use). A subclass so that
    ``TCPStore`` can tell it from other start-up failures (torch's TCPStore catches its
    ``SocketError`` there, for ``TORCHELASTIC_USE_AGENT_STORE``). ``os_error``: the OSError
    (its errno: a taken port is EADDRINUSE), kept as a field; the error is raised without the
    chained traceback (its sentence names the OS error)."""

    os_error: OSError | None = None


def _listen_error(host: str | None, port: int, ipv6: bool, exc: OSError) -> ListenError:
    """torch's words for a socket that cannot listen, then aiodist's. torch's server is
    libuv's, which names errors by the negative errno, its symbol and a lowercase text."""
    code = exc.errno or 0
    if isinstance(exc, socket.gaierror):  # a host that does not resolve: getaddrinfo's own codes
        name = next((n for n in dir(socket) if n.startswith("EAI_") and getattr(socket, n) == code), "EAI_UNKNOWN")
        code = -abs(code)
    else:
        name = errno.errorcode.get(code, "UNKNOWN")
    text = exc.strerror or str(exc)
    err = ListenError(
        f"The server socket has failed to listen on any local network address. port: {port}, "
        f"useIpv6: {str(ipv6).lower()}, code: {-abs(code)}, name: {name}, message: {text[:1].lower() + text[1:]} "
        f"(could not start a TCPStore server on {host or '*'}:{port}: {exc})"
    )
    err.os_error = exc
    return err


def _bound(family: socket.AddressFamily, type_: int, proto: int, addr: tuple[Any, ...], backlog: int, dual: bool) -> socket.socket:
    sock = socket.socket(family, type_, proto)
    try:
        if dual:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def bind_listener(host: str | None, port: int, backlog: int | None = None) -> socket.socket:
    """A listening socket on ``host:port``. With no host: one dual-stack socket on every
    interface (IPv6 ``::`` with IPv4 mapped), else, as torch's server does when IPv6 fails,
    ``0.0.0.0``; port 0 yields one port for both families. Failure is a ``ListenError`` in
    torch's words (``The server socket has failed to listen on any local network address...``)."""
    backlog = LISTEN_BACKLOG if backlog is None else backlog
    if host in (None, ""):
        try:
            return _bound(socket.AF_INET6, socket.SOCK_STREAM, 0, ("::", port), backlog, True)
        except OSError:
            pass  # no IPv6, or the port is taken there: try IPv4, as torch's server does
        try:
            return _bound(socket.AF_INET, socket.SOCK_STREAM, 0, ("0.0.0.0", port), backlog, False)
        except OSError as exc:
            raise _listen_error(host, port, False, exc) from None
    family = socket.AF_INET
    try:
        family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        return _bound(family, type_, proto, addr, backlog, False)
    except OSError as exc:
        raise _listen_error(host, port, family == socket.AF_INET6, exc) from None


class _Conn(asyncio.Protocol):
    """One client connection on the server."""

    def __init__(self, server: TCPStoreServer) -> None:
        self.server = server
        self.state = server.state
        self.parser = RequestParser(server.limits)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.waits: list[Waiter] = []
        self.paused = False
        # True while the parser is past VALIDATE and holds no bytes: a chunk then starts a
        # request, and ``_answer_leading`` may read it in place. Set after each ``_process``.
        self.idle = False
        limits = server.limits
        # The request cap cannot cut a GET, ADD or one-key CHECK short unless it is tiny; then
        # the hot path leaves them all to the parser, which refuses them as it should.
        self._max_key = limits.max_key_bytes if limits.max_request_bytes >= limits.max_key_bytes + 25 else -1
        self._max_value = limits.max_value_bytes
        self._max_request = limits.max_request_bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "local"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover
                pass
        self.server._conns.add(self)
        self.server.stats_counter["connections"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._conns.discard(self)
        for w in self.waits:
            self.state.cancel(w)
        self.waits.clear()

    def data_received(self, data: bytes) -> None:
        if self.idle and not self.paused:
            data = self._answer_leading(data)
            if not data:
                return
            self.idle = False
        try:
            self.parser.feed(data)
        except ProtocolError as exc:
            self._refuse(str(exc))
            return
        self._process()

    def _answer_leading(self, data: bytes) -> bytes:
        """The hot path, for a chunk that starts a request (the parser holds nothing): answer
        the requests at its front read in place, so the parser never copies or holds them, and
        return the rest for the parser (b"" when all was answered, or the connection refused).

        GET, ADD, SET, PING and CHECK of one key (what clients send most) are parsed, applied
        and answered right here, in one step each; other complete requests go through
        ``quick_request`` and their handlers. A request cut short, over a limit, or that this
        path does not know stops it: the parser takes it from there with every check it makes.
        Replies are flushed and flow control is obeyed as in ``_process``."""
        out: list[bytes] = []
        size = n = pos = 0
        have = len(data)
        state, max_key = self.state, self._max_key
        try:
            while pos < have:
                code = data[pos]
                if code == _OP_GET or code == _OP_ADD or code == _OP_SET:
                    if have < pos + 9:
                        break
                    key_end = pos + 9 + _u64_at(data, pos + 1)[0]
                    if key_end - pos - 9 > max_key:
                        break
                    if code == _OP_GET:
                        if have < key_end:
                            break
                        v = state.get(data[pos + 9 : key_end])
                        reply = _EMPTY if v is None else _pack_u64(len(v)) + v
                        pos = key_end
                    elif have < key_end + 8:
                        break
                    elif code == _OP_ADD:
                        reply = _pack_i64(state.add(data[pos + 9 : key_end], _i64_at(data, key_end)[0]))
                        pos = key_end + 8
                    else:
                        end = key_end + 8 + _u64_at(data, key_end)[0]
                        if end - key_end - 8 > self._max_value or end - pos > self._max_request or have < end:
                            break
                        state.set(data[pos + 9 : key_end], data[key_end + 8 : end])
                        pos = end
                        n += 1
                        continue  # SET has no reply
                elif code == _OP_CHECK and data[pos + 1 : pos + 9] == _ONE_KEY:
                    if have < pos + 17:
                        break
                    key_end = pos + 17 + _u64_at(data, pos + 9)[0]
                    if key_end - pos - 17 > max_key or have < key_end:
                        break
                    reply = _READY if state.check((data[pos + 17 : key_end],)) else _NOT_READY
                    pos = key_end
                elif code == _OP_PING and have >= pos + 5:
                    reply = data[pos + 1 : pos + 5]  # the echo: the nonce's own 4 bytes
                    pos += 5
                else:
                    got = quick_request(data, pos, self.server.limits)
                    if got is None:
                        break
                    req, pos = got
                    k = len(out)
                    _HANDLERS[req.op](self, req, out)
                    if len(out) == k:  # no reply (MULTI_SET, a WAIT not yet ready, ...)
                        n += 1
                        continue
                    reply = out.pop()
                n += 1
                out.append(reply)
                size += len(reply)
                if size >= _FLUSH_BYTES:
                    self._write(out)
                    out, size = [], 0
                    if self.paused:
                        break
        except Exception as exc:  # ADD on a non-integer, or anything unforeseen: close only this client
            if out:
                self._write(out)  # the replies to the requests before it still go out, as the parser's do
            self._refuse(f"{type(exc).__name__}: {exc}")
            return b""
        finally:
            self.server.stats_counter["requests"] += n
        if out:
            self._write(out)
        return data[pos:] if pos else data

    def _process(self) -> None:
        """Answer every complete request buffered, unless the peer stops reading our replies:
        then stop (and stop reading from it) until the transport drains. Replies go out in one
        write per batch, or sooner when a batch grows past ``_FLUSH_BYTES``."""
        out: list[bytes] = []
        size = n = 0
        handlers = _HANDLERS
        parser = self.parser
        why = None
        try:
            while not self.paused and (req := parser.next_request()) is not None:
                handlers[req.op](self, req, out)
                n += 1
                if out and len(out[-1]) + size >= _FLUSH_BYTES:
                    self._write(out)
                    out, size = [], 0
                elif out:
                    size += len(out[-1])
        except ProtocolError as exc:
            why = str(exc)
        except Exception as exc:  # ADD on a non-integer, or anything unforeseen: close only this client
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self.server.stats_counter["requests"] += n
            self.idle = parser.idle
        if out:
            # Before a refusal too: the requests before the bad one are answered whether it came
            # in the same chunk or a later one (torch's server answers each as it goes).
            self._write(out)
        if why is not None:
            self._refuse(why)

    def _write(self, out: list[bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def pause_writing(self) -> None:
        # The peer is not reading its replies: stop reading its requests, so what we buffer
        # stays bounded by the transport's high-water mark plus one flush.
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._process()

    def _refuse(self, why: str) -> None:
        self.idle = False
        self.server.stats_counter["refused"] += 1
        log.warning("TCPStore server: closing connection from %s: %s", self.peer, why)
        if self.transport is not None:
            self.transport.close()

    # -- handlers: each appends its reply (if any) to ``out`` ------------------------------

    def _validate(self, req: Request, out: list[bytes]) -> None:
        pass

    def _set(self, req: Request, out: list[bytes]) -> None:
        self.state.set(req.keys[0], req.values[0])

    def _compare_set(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_bytes(self.state.compare_set(req.keys[0], req.values[0], req.values[1])))

    def _get(self, req: Request, out: list[bytes]) -> None:
        v = self.state.get(req.keys[0])
        out.append(_EMPTY if v is None else _pack_u64(len(v)) + v)

    def _add(self, req: Request, out: list[bytes]) -> None:
        out.append(_pack_i64(self.state.add(req.keys[0], req.number)))

    def _check(self, req: Request, out: list[bytes]) -> None:
        out.append(_READY if self.state.check(req.keys) else _NOT_READY)

    def _wait(self, req: Request, out: list[bytes]) -> None:
        w = self.state.wait(req.keys)
        if w is None:
            out.append(_STOP)
            return
        self.waits.append(w)
        w.fut.add_done_callback(functools.partial(self._wait_done, w))

    def _wait_done(self, w: Waiter, _fut: object = None) -> None:
        if w.fut.cancelled():
            return
        try:
            self.waits.remove(w)
        except ValueError:
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_STOP)

    def _num_keys(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_i64(self.state.num_keys()))

    def _delete(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_i64(1 if self.state.delete(req.keys[0]) else 0))

    def _append(self, req: Request, out: list[bytes]) -> None:
        self.state.append(req.keys[0], req.values[0])

    def _multi_get(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_bytes_list(self.state.multi_get(req.keys)))

    def _multi_set(self, req: Request, out: list[bytes]) -> None:
        self.state.multi_set(req.keys, req.values)

    def _cancel_wait(self, req: Request, out: list[bytes]) -> None:
        for w in self.waits:
            self.state.cancel(w)
        self.waits.clear()
        out.append(_CANCELED)

    def _ping(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_u32(req.number))

    def _queue_push(self, req: Request, out: list[bytes]) -> None:
        self.state.queue_push(req.keys[0], req.values[0])

    def _queue_pop(self, req: Request, out: list[bytes]) -> None:
        n, v = self.state.queue_pop(req.keys[0])
        out.append(encode_queue_pop(n, v))

    def _queue_len(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_i64(self.state.queue_len(req.keys[0])))

    def _list(self, req: Request, out: list[bytes]) -> None:
        out.append(encode_bytes_list(self.state.list_keys(), counted=True))


_HANDLERS: dict[Op, Callable[[_Conn, Request, list[bytes]], None]] = {
    Op.VALIDATE: _Conn._validate,
    Op.SET: _Conn._set,
    Op.COMPARE_SET: _Conn._compare_set,
    Op.GET: _Conn._get,
    Op.ADD: _Conn._add,
    Op.CHECK: _Conn._check,
    Op.WAIT: _Conn._wait,
    Op.GETNUMKEYS: _Conn._num_keys,
    Op.DELETE_KEY: _Conn._delete,
    Op.APPEND: _Conn._append,
    Op.MULTI_GET: _Conn._multi_get,
    Op.MULTI_SET: _Conn._multi_set,
    Op.CANCEL_WAIT: _Conn._cancel_wait,
    Op.PING: _Conn._ping,
    Op.QUEUE_PUSH: _Conn._queue_push,
    Op.QUEUE_POP: _Conn._queue_pop,
    Op.QUEUE_LEN: _Conn._queue_len,
    Op.LIST: _Conn._list,
}
assert set(_HANDLERS) == set(Op)


class TCPStoreServer:
    """A TCPStore server on the running loop.

    ``host=None`` listens on every interface (dual-stack); ``port=0`` takes an ephemeral port,
    reported by ``.port`` once started. ``sock`` serves an already-bound socket instead
    (``master_listen_fd``). ``limits`` bounds what one client may send.
    """

    # How many servers are serving in this process (any thread, any loop). A client here does
    # not spin for its replies while one is (tcp.py, ``_Connection.spin``): the server it
    # waits for may need this thread's GIL, or this very loop, to answer.
    serving_here: ClassVar[int] = 0
    _serving_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        host: str | None = None,
        port: int = 0,
        *,
        limits: Limits | None = None,
        sock: socket.socket | None = None,
        state: KVState | None = None,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        self.limits = limits or Limits()
        self.state = state if state is not None else KVState()
        self._host = host
        self._port = port
        self._sock = sock
        self._server: asyncio.Server | None = None
        self._local: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self.stats_counter: Counter[str] = Counter()
        self._started_at = 0.0

    async def start(self) -> TCPStoreServer:
        sock = self._sock
        if sock is None:
            sock = bind_listener(self._host, self._port)
        else:
            sock.setblocking(False)
            try:
                sock.listen(LISTEN_BACKLOG)
            except OSError as exc:
                raise DistNetworkError(f"master_listen_fd socket cannot listen: {exc}") from exc
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), sock=sock, backlog=LISTEN_BACKLOG)
        with TCPStoreServer._serving_lock:
            TCPStoreServer.serving_here += 1
        self._port = sock.getsockname()[1]
        if sock.family == socket.AF_INET6 and self._host in (None, "") and self._sock is None:
            await self._start_local_listener(loop)
        self._started_at = time.monotonic()
        log.info("TCPStore server listening on %s:%d", self._host or "*", self._port)
        return self

    async def _start_local_listener(self, loop: asyncio.AbstractEventLoop) -> None:
        """Also listen on the abstract Unix socket named by our port, for same-host clients.

        Only a server bound to every interface does this: then no other process in this network
        namespace can hold the TCP port, so the name cannot point at a different server. The
        name disappears with the socket, so a dead server leaves nothing stale behind.
        """
        name = local_socket_name(self._port)
        if name is None:
            return
        usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            usock.bind(name)
            usock.listen(LISTEN_BACKLOG)
            usock.setblocking(False)
            self._local = await loop.create_unix_server(lambda: _Conn(self), sock=usock, backlog=LISTEN_BACKLOG)
        except OSError as exc:
            usock.close()
            log.debug("TCPStore server: no same-host Unix listener for port %d: %s", self._port, exc)

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str | None:
        return self._host

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def wait_for_workers(self, world_size: int, timeout: float, shown_s: float | None = None) -> None:
        """Until the ``init/`` counter reaches ``world_size`` (server-side, no polling). The
        timeout message names ``shown_s`` (the store's configured timeout) in whole seconds, as
        torch's does, rather than the time that was left of it."""

        def enough(v: bytes | None) -> bool:
            try:
                return v is not None and int(v) >= world_size
            except ValueError:
                return False

        w = self.state.wait_until(INIT_KEY, enough)
        if w is None:
            return
        if not await self.state.settle(w, timeout):
            joined = self.state.get(INIT_KEY) or b"0"
            shown = math.ceil(timeout if shown_s is None else shown_s)
            raise StoreTimeoutError(f"Timed out after {shown} seconds waiting for clients. {int(joined)}/{world_size} clients joined.")

    def joined(self, world_size: int) -> tuple[int, list[int] | None]:
        """How many have joined (the ``init/`` counter), and the ranks still missing when every
        one that joined said its rank (``init_rank_key``); else None."""
        raw = self.state.get(INIT_KEY) or b"0"
        try:
            count = int(raw)
        except ValueError:
            return 0, None
        if world_size > _MAX_NAMED_RANKS:
            return count, None
        absent = self.state.missing([init_rank_key(r) for r in range(world_size)])
        if world_size - len(absent) != count:
            return count, None  # a client that did not say its rank (torch's), or a store joined twice
        return count, sorted(int(k.rsplit(b"/", 1)[1]) for k in absent)

    async def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        with TCPStoreServer._serving_lock:
            TCPStoreServer.serving_here -= 1
        server.close()
        local, self._local = self._local, None
        if local is not None:
            local.close()
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.abort()  # close() would wait (forever, on 3.12+) for a peer that is not reading
        await server.wait_closed()
        if local is not None:
            await local.wait_closed()

    def stats(self) -> dict[str, Any]:
        keys, queues, waiters = self.state.key_count()
        return {
            "type": "TCPStoreServer",
            "port": self._port,
            "clients": len(self._conns),
            "keys": keys,
            "queues": queues,
            "waiters": waiters,
            "uptime_s": time.monotonic() - self._started_at if self._started_at else 0.0,
            **self.stats_counter,
        }


class ServerThread:
    """A ``TCPStoreServer`` on its own daemon thread and event loop (uvloop when present)."""

    def __init__(self, server: TCPStoreServer) -> None:
        self.server = server
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start the thread and return once the server listens (blocking; see ``astart``)."""
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"aiodist-store-server:{self.server.port}", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DistNetworkError(f"the TCPStore server thread did not start listening within {timeout:g} s") from None
        return self

    async def astart(self) -> ServerThread:
        return await asyncio.to_thread(self.start)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        loop = self.loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(ready))
        finally:
            loop.close()

    async def _main(self, ready: concurrent.futures.Future[None]) -> None:
        self._stopped = asyncio.Event()
        try:
            await self.server.start()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        await self._stopped.wait()
        await self.server.close()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the server's loop; a concurrent future of its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and join the thread (blocking; see ``astop``)."""
        loop, stopped = self.loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
