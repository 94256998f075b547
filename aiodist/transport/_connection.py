"""One rank-to-rank connection: an ``asyncio.BufferedProtocol`` pumping bytes between the socket
and a sans-I/O ``FrameDecoder``, plus the write side (frames out, flow control).

Rules this module keeps:
- Reading: a DATA header's fate (``aiodist.transport._landing.decide``, asked through the
  owner's ``on_header``) is carried out here: LAND gives the decoder the posted receive's
  memory (the payload lands there, zero-copy); STAGE lets the decoder stage it, bounded per
  connection by ``FrameLimits.max_staged_bytes``; HOLD pauses reading (``pause_reading``), so
  TCP flow control makes the sender's send wait, until ``retry_held`` (called by the owner once
  a receive was posted, or by the connection itself once its own staged bytes were released:
  staging room is per connection) finds it another fate. A message bigger than the bound thus
  simply waits for its receive. A big payload held for its GRACE gets ``GRACE_SECONDS``
  before it is staged: its receive is usually about to be posted (a peer running ahead by one
  op), and staging would cost an allocation and two extra copies; no program that staging
  serves can stall on it. DROP, MISMATCH and DESYNC read the payload into scratch memory and
  drop it. A peer that breaks the protocol kills the connection, with the reason.
- Writing: the write buffer limits are (0, 0), so the protocol is paused whenever anything is
  buffered and resumed only when the buffer is empty. ``send_frame`` returns once the buffer
  has been seen empty after its frame was written: every byte of it is then in the kernel,
  whatever the loop does with the memoryview it was given (asyncio on 3.11 copies a partial
  remainder, asyncio 3.12+ and uvloop keep a reference), so the caller may reuse its array.
  The transport writes a DATA frame only to a connection that is not paused (``writable``):
  at most one frame's remainder is ever buffered per connection, whatever the loop copies.
- Handshake deadline: an accepted connection that has not completed its HELLO within the
  transport's ``handshake_timeout`` is closed (and reported to the transport, which counts and
  summarises them). Until then its decoder's read-ahead is small (``FIRST_READ_AHEAD``).
- The owner (``ConnectionOwner``: the ``Transport``, whose inbox takes the two per-frame calls)
  owns matching and failure; this class only reports to it, through the seven methods of that
  protocol, and reads four of its attributes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiodist.errors import DistNetworkError
from aiodist.knobs import knob
from aiodist.transport._landing import GRACE, GRACE_MIN_BYTES, HOLD, LAND, STAGE, Landing
from aiodist.transport._mailbox import PostedRecv
from aiodist.wire.frame import (
    FIRST_READ_AHEAD,
    HEADER_SIZE,
    AbortReceived,
    Event,
    FrameDecoder,
    FrameHeader,
    FrameLimits,
    GoodbyeReceived,
    HeaderReceived,
    Hello,
    HelloReceived,
    PayloadReceived,
    RemoteProtocolError,
    frame_parts,
    goodbye_frame,
    hello_frame,
)

__all__ = ["Connection", "ConnectionOwner", "GRACE_MIN_BYTES", "GRACE_SECONDS"]

#: the handshake's refusal of a peer's HELLO once this rank's transport is closed (logged at
#: DEBUG: the ordinary end of a job, a peer dialing while this rank leaves)
CLOSED_REFUSAL = "this transport is closed"
log = logging.getLogger("aiodist.transport")

_HOLD = object()  # _target_for's answer: hold the header (reading paused)

GRACE_SECONDS = 0.005  # how long a big payload with staging room waits for its receive (GRACE_MIN_BYTES)


class ConnectionOwner(Protocol):
    """What a ``Connection`` needs of its owner (``Transport`` implements it). Each ``on_*`` is
    called from the connection's protocol callbacks: none may suspend or raise."""

    rank: int  # this rank, for messages
    limits: FrameLimits  # the decoder's
    hello: Hello  # what this rank says in its HELLO
    handshake_timeout: float  # seconds an accepted connection has to say HELLO

    def attach(self, conn: Connection) -> None:
        """``conn`` is open (handshake not done)."""

    def on_hello(self, conn: Connection, hello: Hello, lane: int) -> str | None:
        """The peer's HELLO (``lane``: the one it dialed, for an accepted ``conn``): why it is
        refused, or None, and then ``conn`` carries rank ``hello.rank``'s messages on ``lane``."""

    def on_header(self, conn: Connection, header: FrameHeader, staged_bytes: int, grace_over: bool) -> Landing:
        """Where the payload of DATA ``header`` goes (``aiodist.transport._landing.decide``), with
        its effects: a LAND or MISMATCH receive is claimed, a DESYNC breaks the group, a HOLD or
        GRACE is remembered so that ``conn.retry_held`` is called once something changed."""

    def on_payload(self, conn: Connection, header: FrameHeader, data: memoryview) -> None:
        """A whole payload the decoder staged (or a zero-length one), now the owner's: it gives
        the bytes back with ``conn.release_staged`` once done with them."""

    def on_abort(self, header: FrameHeader, reason: str, culprits: dict[int, str]) -> None:
        """The peer aborted ``header.group`` for ``reason``, naming ``culprits`` (global rank ->
        what it did; may be empty)."""

    def on_unheard(self, conn: Connection, why: str | None) -> None:
        """Accepted ``conn`` is closed before its HELLO: it broke the protocol (``why``), or sent
        none within ``handshake_timeout`` (None)."""

    def on_lost(self, conn: Connection, err: BaseException, current: PostedRecv | None) -> None:
        """``conn`` is closed, because of ``err``; ``current`` is the receive its payload was
        landing in, if one was."""


_NO_GOODBYE = "closed the connection without GOODBYE (its process ended or crashed)"


class Connection(asyncio.BufferedProtocol):
    """A connection to one peer rank (``peer`` is None until its HELLO is in)."""

    def __init__(self, owner: ConnectionOwner, kind: str, dialed_peer: int | None = None, lane: int = 0) -> None:
        self.owner = owner
        self.kind = kind  # "unix" | "tcp"
        self.dialed_peer = dialed_peer  # the rank we dialed; None for an accepted connection
        self.lane = lane  # which interface it runs over (the dialer's HELLO says, for an accepted one)
        self.peer: int | None = None
        self.decoder = FrameDecoder(owner.limits, first_read_ahead=FIRST_READ_AHEAD)  # small until HELLO
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.current: PostedRecv | None = None  # the receive whose payload is being read
        self.bytes_in = 0
        self.bytes_out = 0
        self.goodbye = False  # the peer said GOODBYE
        self._closed_here = False  # this rank closed it (``close``)
        self.timed_out = False  # the kernel gave up on the peer: nothing acknowledged (_watch_link)
        self.closed = asyncio.get_running_loop().create_future()  # set in connection_lost
        self._paused = False
        self._drain: list[tuple[int | None, asyncio.Future[None]]] = []
        self._error: BaseException | None = None
        self.held: FrameHeader | None = None  # a DATA header waiting (reading paused) for room or its receive
        self._grace: asyncio.TimerHandle | None = None  # the held header's grace before staging
        self._grace_over = False
        self._retry_soon = False  # a retry_held is scheduled (release_staged)
        self._deadline: asyncio.TimerHandle | None = None  # an accepted connection's handshake deadline
        self.peername: object = None  # where an accepted connection came from (for the deadline's warning)

    def __repr__(self) -> str:
        return f"<Connection {self.kind} rank {self.owner.rank} <-> rank {self.peer}>"

    # -- the asyncio side ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        transport = self.transport
        transport.set_write_buffer_limits(high=0, low=0)
        _grow_socket_buffers(transport)
        _watch_link(transport, link_timeout())
        self.owner.attach(self)
        if self.dialed_peer is not None:
            transport.write(hello_frame(self.owner.hello, self.lane))
        else:
            # An accepted connection must say HELLO in time (a dialed one is bounded by its dial's deadline)
            self.peername = transport.get_extra_info("peername")
            self._deadline = asyncio.get_running_loop().call_later(self.owner.handshake_timeout, self._handshake_expired)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        self._decode(self.decoder.buffer_updated, nbytes)

    def _decode(self, step: Callable[[Any], list[Event]], arg: object) -> None:
        """Run one decoder step (``buffer_updated``/``set_target``) and handle its events."""
        try:
            events = step(arg)
            while events:
                later: list[Event] = []
                for ev in events:
                    if type(ev) is HeaderReceived:
                        target = self._target_for(ev.header)
                        if target is _HOLD:
                            self._hold(ev.header)
                        else:
                            later = self.decoder.set_target(target)
                    elif type(ev) is PayloadReceived:  # _event's first case, inline: once per message
                        if ev.staged is None:  # landed in self.current's buffer
                            cur, self.current = self.current, None
                            if cur is not None and not cur.fut.done():  # None: a payload read to be dropped
                                cur.fut.set_result(ev.header.source)
                        else:
                            self.owner.on_payload(self, ev.header, ev.staged)
                    else:
                        self._event(ev)
                events = later
        except RemoteProtocolError as exc:
            for ev in exc.events:
                if type(ev) is not HeaderReceived:
                    self._event(ev)
            self._unheard_broke(exc)
            self.fail(DistNetworkError(f"rank {self.owner.rank}: connection with {self._who()} broken by the peer: {exc}"))

    def eof_received(self) -> bool:
        try:
            self.decoder.eof_received()
        except RemoteProtocolError as exc:
            self._unheard_broke(exc)
            self.fail(DistNetworkError(f"rank {self.owner.rank}: {self._who()} closed the connection mid-frame: {exc}"))
            return False
        if self._error is None and not self.goodbye and self.peer is not None:
            # the peer's process ended: said now, with the peer named, for a send that comes
            # before the transport reports the loss (it would find the connection closing)
            self._error = DistNetworkError(
                f"rank {self.owner.rank}: {self._who()} {_NO_GOODBYE}",
                culprits=self._lost_peer(),
            )
        return False  # close our side too

    def lost_how(self) -> str:
        """How the peer ended this connection, as a lost peer's ``culprits`` say it."""
        if self.goodbye:
            return "lost its connection: it left"
        if self.timed_out:
            return "lost its connection: it stopped answering (its link or host is down)"
        return "lost its connection: closed it without GOODBYE (its process ended or crashed)"

    def _lost_peer(self) -> dict[int, str]:
        """The ``culprits`` of an error on this connection that its peer ended (as the
        transport's loss names it), or none where this rank closed it or the peer is unknown."""
        if self.peer is None or self._closed_here:
            return {}
        return {self.peer: self.lost_how()}

    def _handshake_expired(self) -> None:
        # After a long block of the loop a HELLO that came meanwhile is read first: both loops
        # poll before running the timers that fell due (asyncio; uvloop with libuv >= 1.45)
        self._deadline = None
        if self.handshake.done() or self._error is not None:
            return
        timeout = self.owner.handshake_timeout
        self.fail(DistNetworkError(f"rank {self.owner.rank}: closed a {self.kind} connection that sent no HELLO within {timeout:g} s"))
        self.owner.on_unheard(self, None)

    def _unheard_broke(self, exc: RemoteProtocolError) -> None:
        """An accepted connection broke the protocol before its HELLO: the transport sums such
        closes up in a warning (a refused HELLO was logged already, and a known peer's break
        is reported when the connection is lost)."""
        if self.dialed_peer is None and self.peer is None and self._error is None:
            self._cancel_deadline()
            self.owner.on_unheard(self, str(exc))

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._error is None:
            if self.goodbye:
                why = f"{self._who()} closed its transport (GOODBYE)"
            elif isinstance(exc, OSError) and exc.errno in _LINK_DOWN:
                self.timed_out = True
                why = (
                    f"connection with {self._who()} lost: its link or host stopped answering (nothing acknowledged for "
                    f"{link_timeout():g} s, {ENV_LINK_TIMEOUT}: {exc})"
                )
            elif exc is not None:
                why = f"connection with {self._who()} lost: {exc}"
            else:
                why = f"{self._who()} {_NO_GOODBYE}"
            self._error = DistNetworkError(f"rank {self.owner.rank}: {why}")
        err = self._error
        for _, fut in self._drain:
            if not fut.done():
                fut.set_exception(err)
        self._drain.clear()
        if not self.handshake.done():
            self.handshake.set_exception(err)
            self.handshake.exception()  # an accepted connection's handshake has no awaiter
        cur, self.current = self.current, None
        self.held = None
        self._end_grace()
        self.owner.on_lost(self, err, cur)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for _, fut in self._drain:
            if not fut.done():
                fut.set_result(None)
        self._drain.clear()

    # -- decoding events -------------------------------------------------------------------

    def _target_for(self, header: FrameHeader) -> object | None:
        """What the decoder gets for ``header``'s payload: the receive's memory, None (stage it),
        scratch memory (drop it), or ``_HOLD``."""
        fate, recv = self.owner.on_header(self, header, self.decoder.staged_bytes, self._grace_over)
        if fate is HOLD or fate is GRACE:
            if fate is GRACE and self._grace is None:
                self._grace = asyncio.get_running_loop().call_later(GRACE_SECONDS, self._grace_ended)
            return _HOLD
        if self._grace is not None or self._grace_over:
            self._end_grace()
        if fate is LAND:
            self.current = recv
            assert recv is not None
            return recv.dst
        if fate is STAGE:
            return None
        self.current = None
        return bytearray(header.length)  # read and dropped

    def _grace_ended(self) -> None:
        self._grace = None
        self._grace_over = True
        self.retry_held()

    def _end_grace(self) -> None:
        """The current header's fate is decided (or the connection is gone): reset the grace."""
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self._grace_over = False

    def _hold(self, header: FrameHeader) -> None:
        """No receive and no staging room for ``header``'s payload: stop reading (the sender's
        send then waits on TCP flow control) until ``retry_held`` finds a place for it."""
        self.held = header
        if self.transport is not None:
            self.transport.pause_reading()

    def retry_held(self) -> None:
        """A receive was posted or staged bytes were released: go on if the held payload now
        has a place (its receive's memory, or staging room)."""
        header = self.held
        if header is None or self._error is not None or self.transport is None or self.transport.is_closing():
            return
        target = self._target_for(header)
        if target is _HOLD:
            return
        self.held = None
        self._decode(self.decoder.set_target, target)
        if self.held is None and self._error is None and not self.transport.is_closing():
            self.transport.resume_reading()

    def release_staged(self, nbytes: int) -> None:
        """The owner is done with ``nbytes`` of a payload ``on_payload`` handed it: they no longer
        count against this connection's staging room, so a header held for want of room may
        fit now (retried soon: never from inside a decoder step). Staging room is per
        connection, so no other connection can gain by it."""
        self.decoder.release_staged(nbytes)
        if self.held is not None and not self._retry_soon:
            self._retry_soon = True
            asyncio.get_running_loop().call_soon(self._retry_now)

    def _retry_now(self) -> None:
        self._retry_soon = False
        self.retry_held()

    def _event(self, ev: object) -> None:
        if type(ev) is PayloadReceived:
            if ev.staged is None:
                cur, self.current = self.current, None
                if cur is not None and not cur.fut.done():  # None: a payload read to be dropped
                    cur.fut.set_result(ev.header.source)
            else:
                self.owner.on_payload(self, ev.header, ev.staged)
        elif type(ev) is HelloReceived:
            self._hello(ev.hello, ev.header.tag)
        elif type(ev) is AbortReceived:
            self.owner.on_abort(ev.header, ev.reason, ev.culprits)
        elif type(ev) is GoodbyeReceived:
            self.goodbye = True

    def _hello(self, hello: Hello, lane: int = 0) -> None:
        self._cancel_deadline()
        owner = self.owner
        lane = self.lane if self.dialed_peer is not None else lane  # a dialer's HELLO names the lane; the answer does not
        why = owner.on_hello(self, hello, lane)
        if why is not None:
            # a peer's HELLO after this rank closed is the ordinary end of a job (the peer dialed
            # while this rank was leaving): DEBUG; every other refusal is a real error
            level = logging.DEBUG if why == CLOSED_REFUSAL else logging.ERROR
            log.log(level, "rank %d: refused a %s connection: %s", owner.rank, self.kind, why)
            self.fail(DistNetworkError(f"rank {owner.rank}: refused a {self.kind} connection: {why}"))
            return
        self.peer = hello.rank
        self.lane = lane
        if self.dialed_peer is None:
            assert self.transport is not None
            self.transport.write(hello_frame(owner.hello))
        if not self.handshake.done():
            self.handshake.set_result(None)

    # -- writing ---------------------------------------------------------------------------

    def can_write_now(self) -> bool:
        """Open, not paused, and nothing buffered: a small frame written now goes to the kernel."""
        tr = self.transport
        return self._error is None and tr is not None and not self._paused and not tr.is_closing() and tr.get_write_buffer_size() == 0

    def writable(self, group: int | None) -> asyncio.Future[None] | None:
        """None when the connection is not paused (a frame written now goes to the kernel, or
        starts to); else a future that resolves when the protocol resumes (fails when the
        connection dies, or when ``group`` is aborted). A frame is never written to a paused
        connection: asyncio's selector transport would copy all of it that the kernel did not
        take, so n sends queued behind a slow receiver would hold n copies of their arrays."""
        if self._error is not None:
            raise self._error
        tr = self.transport
        assert tr is not None
        if not self._paused and tr.get_write_buffer_size() == 0:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain.append((group, fut))
        return fut

    async def send_frame(self, header: FrameHeader, payload: object | None, group: int | None) -> None:
        """Write one frame; return once all of it is in the kernel (see the module docstring)."""
        fut = self.write_frame(header, payload, group)
        if fut is not None:
            await fut

    def write_frame(self, header: FrameHeader, payload: object | None, group: int | None) -> asyncio.Future[None] | None:
        """Write one frame now; None when all of it is already in the kernel, else a future that
        resolves once it is (``send_frame`` without the coroutine, for the send fast path)."""
        if self._error is not None:
            raise self._error
        tr = self.transport
        assert tr is not None
        if tr.is_closing():
            # write() on a closing transport is silently dropped: refuse rather than report
            # success; closing and not by this rank, the peer ended it (the loss is on its way)
            raise DistNetworkError(
                f"connection to rank {self.peer} is closed; cannot send (group {header.group}, seq {header.seq}, tag {header.tag})",
                culprits=self._lost_peer(),
            )
        for part in frame_parts(header, payload):
            tr.write(part)
        self.bytes_out += HEADER_SIZE + header.length
        if tr.get_write_buffer_size() == 0 and not self._paused:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain.append((group, fut))
        return fut

    def fail_sends(self, group: int, err: BaseException) -> None:
        """Fail the sends of ``group`` waiting for the write buffer (their bytes may still go)."""
        keep = []
        for g, fut in self._drain:
            if g == group and not fut.done():
                fut.set_exception(err)
            else:
                keep.append((g, fut))
        self._drain = keep

    def write_control(self, frame: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing() and self._error is None:
            self.transport.write(frame)

    def say_goodbye(self) -> None:
        """GOODBYE on this connection where this rank said HELLO on it: every dialed one (its
        HELLO went out when it connected, answered or not: a peer that answers after this rank
        has gone must still read that it left, not a lost connection) and every accepted one
        whose handshake is done."""
        hs = self.handshake
        if self.dialed_peer is not None or (hs.done() and not hs.cancelled() and not hs.exception()):
            self.write_control(goodbye_frame(self.owner.rank))

    def fail(self, err: BaseException) -> None:
        """Close this connection because of ``err`` (reported to the transport on close)."""
        if self._error is None:
            self._error = err
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self._closed_here = True
        if self.transport is not None:
            self.transport.close()

    def _who(self) -> str:
        p = self.peer if self.peer is not None else self.dialed_peer
        return f"rank {p}" if p is not None else "an unidentified peer"


SOCKET_BUFFER_BYTES = 4 << 20  # kernel send/receive buffer asked for (the kernel may cap it)
ENV_LINK_TIMEOUT = "AIODIST_LINK_TIMEOUT_S"
#: how the kernel ends a connection whose peer stopped acknowledging (ETIMEDOUT; a route gone
#: with the link reports its own error instead)
_LINK_DOWN = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN})


def link_timeout() -> float:
    """``AIODIST_LINK_TIMEOUT_S`` (default 10 s; 0: the kernel's own timers)."""
    return knob(ENV_LINK_TIMEOUT).number()


def _watch_link(transport: asyncio.BaseTransport, seconds: float) -> None:
    """A TCP connection whose peer's kernel stops acknowledging (a cut link, a host gone) is
    closed by the kernel within about ``seconds``, with ETIMEDOUT: keepalive probes on an idle
    connection (the first after ``seconds`` / 5 of silence, then every ``seconds`` / 10), and
    ``TCP_USER_TIMEOUT`` for data sent and not acknowledged (which also bounds the probes). A
    peer that is only slow or busy still acknowledges (its kernel does), so a long op on a slow
    link is not cut; nor is a stopped process (SIGSTOP), which the group's timeout names.
    Best effort: a platform without an option keeps its default."""
    if seconds <= 0:
        return
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = max(1, int(seconds / 5))
    every = max(1, int(seconds / 10))
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), idle),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), every),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), max(1, int((seconds - idle) / every))),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), int(seconds * 1000)),
    ]
    for level, opt, value in options:
        if opt is None:
            continue
        try:
            sock.setsockopt(level, opt, value)
        except OSError:  # pragma: no cover - best effort
            pass


def _grow_socket_buffers(transport: asyncio.BaseTransport) -> None:
    """Bigger kernel buffers: a large payload then goes out in fewer writes and wake-ups."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - best effort
            pass
