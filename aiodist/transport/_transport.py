"""``Transport``: one rank's transport, the façade over its parts (``channel()`` hands out the
``P2P`` of one op of one group over it).

The parts, each with its own rules in its module docstring:
- ``Dialer`` (``_dialer.py``): the connection this rank sends to each peer on, per lane, made
  on first use (dials, retries, deadlines, connect warnings), and the striping decision;
- ``Lines`` (``_lines.py``): sending, in call order per peer, the write fast path, striping;
- ``Inbox`` (``_inbox.py``): receiving, matching, staging, sends to self (no socket);
- ``Standing`` (``_standing.py``): closed or not, lost peers, broken groups and their errors;
- ``DigestBook`` (``_digests.py``): the collective ops' digests and the desync sentence;
- ``exchange`` (``_exchange.py``): the start-up address exchange and the lanes' agreement;
- ``refusal`` and ``Tallies`` (``_handshake.py``): a HELLO's verdict, and the accepted
  connections closed before their HELLO, counted and summed up in warnings;
- ``Connection`` (``_connection.py``): one socket, reporting to this façade as its
  ``ConnectionOwner``.

Seams: ``lines`` and ``inbox`` are public attributes, and the per-message callers (``Channel``,
the socket backend's p2p) call them directly: this façade's ``send``/``recv`` are for the
others, and a connection's two per-frame calls (``on_header``/``on_payload``) are the inbox's
own bound methods. The parts share the ``Standing`` and reach one another through what their
constructors are given (the inbox sees the dialer only as its ``Route`` protocol); none reaches
into this façade but through ``ConnectionOwner`` (which the dialer hands the connections it
opens) and the desync call the inbox is given.

Rules this module keeps:
- Addresses: each rank listens on TCP port 0 on every interface and, on Linux, on an abstract
  Unix socket (named from a hash of the job token, the rank, the pid and a random nonce, so
  no two transports ever share a name), and publishes both with its host id under
  ``aiodist/transport/<rank>``. The host id is the kernel boot id plus the network namespace
  (abstract socket names are per namespace); peers with equal host ids use the Unix socket.
- Connections are made on first use (the dialer); if both sides dial at once there are two
  connections, each side SENDS on the first one whose handshake completed and RECEIVES on
  both. At most two connections per pair, never a race to close one.
- Handshake: the dialer sends HELLO (job token, rank, world size), the acceptor checks it and
  answers with its own; the dialer checks that the answer comes from the rank it dialed. A
  wrong token, world size or rank closes the connection and logs an error. An accepted
  connection that sends no HELLO within ``handshake_timeout`` is closed; such closes are
  summed up in one warning at most every 10 s.
- Back-pressure, not failure: a payload over a connection's staging bound is held and that
  connection stops reading, so TCP flow control slows the sender (its send waits, within its
  deadline) until the receive is posted or room is freed (the inbox). A late rank thus slows
  its peers, never kills the job. While a connection holds a payload it reads nothing, so a
  peer that dies then is noticed only when reading resumes or a send to it fails: its
  receives then end by their deadline.
- Failure is fail-stop: a connection that dies (without GOODBYE, or after it) marks its peer
  dead for this transport: every pending and later receive from it, and every later send to
  it, fails with a ``DistNetworkError`` naming the peer (and the op's key). ``abort(group)``
  and an incoming ABORT fail the group's pending and later ops with ``DistBackendError``.
  ``check_peer`` answers, without suspending, what an op with a peer would meet now.
- Every wait is bounded by ``timeout``; running past it raises ``DistTimeoutError`` naming the
  peer and the key.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiodist.errors import DistBackendError, DistNetworkError, DistTimeoutError
from aiodist.knobs import knob
from aiodist.store.base import Store
from aiodist.transport._address import PeerAddress, address_key, host_id, listen_tcp, unix_name
from aiodist.transport._channel import Channel
from aiodist.transport._connection import Connection
from aiodist.transport._dialer import Dialer
from aiodist.transport._digests import DigestBook
from aiodist.transport._exchange import exchange
from aiodist.transport._handshake import Tallies, refusal
from aiodist.transport._ifaces import Advertised, choose
from aiodist.transport._inbox import Inbox
from aiodist.transport._landing import Landing
from aiodist.transport._lines import Lines
from aiodist.transport._mailbox import Key, PostedRecv
from aiodist.transport._standing import Standing
from aiodist.transport._striping import check_rank
from aiodist.wire.frame import FrameHeader, FrameLimits, Hello, abort_frame

__all__ = ["Transport"]

log = logging.getLogger("aiodist.transport")

_CLOSE_WAIT = 2.0  # seconds close() waits for connections to finish closing
_ABORT_DIAL_S = 2.0  # abort: how long a dial to a peer not yet connected may take
_DIGESTS_KEPT = 4096  # per group: a collective digest is kept until its op is this many seqs old
LISTEN_BACKLOG = 1024  # each listener's accept queue (the kernel caps it at net.core.somaxconn)
HANDSHAKE_TIMEOUT_S = knob("AIODIST_HANDSHAKE_TIMEOUT").number({})  # an accepted connection must complete its HELLO this soon
STRIPE_MIN_BYTES = knob("AIODIST_STRIPE_MIN_BYTES").whole({})  # collective messages this big are split across the lanes


def _stripe_min_bytes() -> int:
    return knob("AIODIST_STRIPE_MIN_BYTES").whole()


def _handshake_timeout(given: float | None) -> float:
    if given is None:
        given = knob("AIODIST_HANDSHAKE_TIMEOUT").number()
    if not 0 < given < float("inf"):
        raise ValueError(f"the handshake timeout (AIODIST_HANDSHAKE_TIMEOUT) must be a finite number of seconds > 0, got {given!r}")
    return float(given)


class Transport:
    """Rank-to-rank data for one process of a job. Make one with ``await Transport.start(...)``."""

    # ConnectionOwner's two per-frame calls: the inbox's own bound methods (set in __init__)
    on_header: Callable[[Connection, FrameHeader, int, bool], Landing]
    on_payload: Callable[[Connection, FrameHeader, memoryview], None]

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        token: bytes,
        timeout: float,
        limits: FrameLimits,
        unix: bool,
        host: str | None,
        advertise: Advertised | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.handshake_timeout = _handshake_timeout(handshake_timeout)
        self.limits = limits
        self.hello = Hello(token, rank, world_size)
        self._use_unix = unix and sys.platform.startswith("linux")
        if advertise is None:
            advertise = Advertised((host,), (), False, "given") if host else choose(None)
        self.advertised = advertise
        self.lanes = len(advertise.hosts)  # one per interface named (striping when > 1)
        self.stripe_min_bytes = _stripe_min_bytes()
        self._host = advertise.hosts[0]
        self._host_id = host_id()
        self._servers: list[asyncio.AbstractServer] = []
        self.address: PeerAddress | None = None
        self._conns: set[Connection] = set()  # every open connection, handshake done or not
        self._book = DigestBook(_DIGESTS_KEPT)  # this rank's collective ops' digests (always-on desync detection, aiodist._digest)
        # a group's ranks, checked once (this rank among them, none twice) -> this rank's place in them
        self._members: dict[tuple[int, ...], int] = {}
        self._standing = Standing(rank)  # closed or not, lost peers, broken groups and their errors
        #: the parts (the module docstring); ``lines`` and ``inbox`` are what the per-message
        #: callers (``Channel``, the socket backend's p2p) hold, with no hop through this façade
        self.dialer = Dialer(self, self._standing, store, timeout, advertise, self._host_id, self._use_unix, self.stripe_min_bytes)
        self.inbox = Inbox(rank, world_size, timeout, limits, self._standing, self._book, self.dialer, self._desync, self._conns)
        self.lines = Lines(self.dialer, self._standing, self.inbox, world_size, timeout, limits)
        self.on_header = self.inbox.on_header  # the connections' two per-frame calls, bound to the inbox itself
        self.on_payload = self.inbox.on_payload
        self._bytes_lost = [0, 0]  # bytes in/out of connections already gone
        self.handshakes = Tallies(rank, self.handshake_timeout, self._standing)  # connections closed before their HELLO

    @classmethod
    async def start(
        cls,
        store: Store,
        rank: int,
        world_size: int,
        *,
        token: str | bytes,
        timeout: float,
        limits: FrameLimits | None = None,
        unix: bool = True,
        host: str | None = None,
        advertise: Advertised | None = None,
        handshake_timeout: float | None = None,
    ) -> Transport:
        """Listen, publish this rank's address in ``store``, and return the transport.

        ``token`` names the job (peers with another token are refused); ``timeout`` (seconds)
        bounds every wait; ``unix=False`` keeps same-host peers on TCP; ``host`` is the name or
        address peers on other hosts dial, or ``advertise`` the addresses, one per lane (default:
        ``aiodist.transport._ifaces.choose(None)``: this host's first non-loopback address).
        ``handshake_timeout`` (seconds; default ``AIODIST_HANDSHAKE_TIMEOUT``, else 10) is how
        long an accepted connection may take to say HELLO before it is closed.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is not in [0, {world_size})")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        tok = token.encode() if isinstance(token, str) else bytes(token)
        self = cls(store, rank, world_size, tok, float(timeout), limits or FrameLimits(), unix, host, advertise, handshake_timeout)
        try:
            await self._listen()
            assert self.address is not None
            await store.set(address_key(rank), self.address.encode())
        except BaseException:
            await self.close()
            raise
        return self

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        tsock = listen_tcp()
        # create_server listens again, with its own backlog (default 100): name ours, or a burst
        # of dials at a busy rank (a big job's start) overflows the accept queue (dropped SYNs,
        # retried after 1 s, 3 s, ...)
        srv = await loop.create_server(lambda: Connection(self, "tcp"), sock=tsock, backlog=LISTEN_BACKLOG)
        self._servers.append(srv)
        port = tsock.getsockname()[1]
        name = unix_name(self.hello.token, self.rank) if self._use_unix else None
        if name is not None:
            usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                usock.bind(name)
                usock.listen(LISTEN_BACKLOG)
                usock.setblocking(False)
                self._servers.append(await loop.create_unix_server(lambda: Connection(self, "unix"), sock=usock, backlog=LISTEN_BACKLOG))
            except OSError as exc:
                usock.close()
                log.warning("rank %d: no Unix socket listener (same-host peers will use TCP): %s", self.rank, exc)
                name = None
        adv = self.advertised
        lanes = adv.hosts if adv.ifnames else ()
        self.address = PeerAddress(
            self.rank, self._host, port, name, self._host_id, lanes, adv.ifnames, self.stripe_min_bytes if lanes else 0
        )

    async def exchange(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until every rank has published its address, and agree on
        the lanes: every rank must have as many lanes (and, with several, the same split size)
        as every other, else every rank fails naming the ranks and their interface lists
        (``aiodist.transport._exchange``)."""
        addrs = await exchange(self.store, self.rank, self.world_size, self.lanes, self.stripe_min_bytes, timeout)
        if addrs is not None:
            self.dialer.set_peers(addrs)

    def striped(self, peer: int) -> bool:
        """Messages to and from ``peer`` are split across the lanes: several interfaces are named,
        the addresses were exchanged, and the peer is on another host."""
        return self.dialer.striped(peer)

    # -- public API ------------------------------------------------------------------------

    def release_group(self, group_id: int) -> None:
        """Group ``group_id`` is destroyed on this rank: forget its ops' digests (a live group
        keeps its last ``_DIGESTS_KEPT``, for late frames' desync checks). A frame of it that
        arrives later is held as any early one is (bounded), and never matched."""
        self._book.release(group_id)

    def member(self, ranks: tuple[int, ...]) -> int:
        """This rank's place in a group's ``ranks`` (global ranks), checked the first time a
        group of them has an op (this rank among them, none twice: ValueError) and kept."""
        got = self._members.get(ranks)
        if got is None:
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not in the group's ranks {list(ranks)}")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"the group's ranks {list(ranks)} repeat a rank")
            got = ranks.index(self.rank)
            if len(self._members) < 4096:
                self._members[ranks] = got
        return got

    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0, call: Any = None) -> Channel:
        """The ``P2P`` of op ``seq`` of group ``group_id``, whose rank i is global rank
        ``global_ranks[i]``; this rank must be one of them. ``digest`` (not 0) is what every rank
        must agree on for this op, sent with its frames; ``call`` is ``(op, args)`` for the
        sentence when a peer's digest differs (aiodist._digest)."""
        ch = Channel(self, group_id, seq, global_ranks, digest)
        if digest:
            early = self._book.record(group_id, seq, digest, call, len(global_ranks))
            if early is not None:  # a peer's frame came first, with another digest
                self._desync(group_id, seq, early.source, early.digest, early.nbytes)
        return ch

    # -- what an op's Channel asks for shared memory (its OpLink side, aiodist.shm._link) ----

    def check_peer(self, peer: int | None, group: int, seq: int = 0) -> None:
        """Whether op ``seq`` of group ``group`` can still go on with global rank ``peer`` (None:
        the group alone): returns where it can, else raises what a message of that op from
        ``peer`` would meet, in this order: the transport is closed (``DistBackendError``), the
        group was aborted (``DistBackendError`` with its reason: an ``abort``, a peer's ABORT,
        a desync), ``peer`` died or left (``DistNetworkError`` with its sentence). It does not
        suspend; shared memory and the runner ask it (through ``Channel.check_peer``) while they
        wait on a peer outside the sockets."""
        self._standing.usable((group, seq, 0), peer)

    def abort_op(self, key: Key, reason: str) -> DistBackendError:
        """Abort op ``key``'s group now, on every rank (``abort``'s work, which does not suspend),
        and return the error its ops raise."""
        self._abort_now(key[0], reason)
        return self._standing.abort_error(key[0])

    def desync_op(self, key: Key, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        """Global rank ``peer``'s digest for op ``key`` is ``theirs``: break the group on every
        rank (``_desync``) and return the error its ops raise; None where this rank kept no
        digest for the op (nothing is aborted)."""
        if self._book.mine(key[0], key[1]) is None:
            return None
        self._desync(key[0], key[1], peer, theirs, nbytes)
        return self._standing.abort_error(key[0])

    def op_name(self, key: Key) -> str | None:
        """The name of op ``key`` in this rank's digest record (``channel``'s ``call``), None
        where it kept none."""
        return self._book.op_name(key[0], key[1])

    def _desync(self, group: int, seq: int, peer: int, theirs: int, nbytes: int = -1) -> None:
        """Break ``group`` on every rank: ``peer``'s digest for op ``seq`` is ``theirs``, not this
        rank's; ``nbytes`` is the length of a message of the peer's in the op (-1: none seen)."""
        found = self._book.mismatch(self.rank, group, seq, peer, theirs, nbytes)
        if found is None:
            return
        reason, culprits = found
        log.debug("rank %d: %s", self.rank, reason)  # the ops' errors carry it: said once, by them
        self._standing.blame(group, culprits)
        self._abort_now(group, reason)

    async def send(self, dst: int, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0, digest: int = 0) -> None:
        """Send ``buf``'s bytes to global rank ``dst`` as message ``(group, seq, tag)``.
        Returns once the bytes are in the kernel (or copied, to self): ``buf`` may then change.
        Sends to one peer go out in the order they were called (their first steps' order).
        (``lines.send``: a per-message caller calls that.)"""
        await self.lines.send(dst, buf, group=group, seq=seq, tag=tag, digest=digest)

    def send_nowait(
        self, dst: int, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0, digest: int = 0
    ) -> bool | asyncio.Future[None]:
        """``send`` without waiting, where it can be done: False (nothing sent) when ``send`` would
        have to wait for a connection or for earlier sends in line; True when the bytes are in the
        kernel; a future when they were written but the kernel did not take them all at once: the
        caller must await it before changing ``buf``. (``lines.send_nowait``.)"""
        return self.lines.send_nowait(dst, buf, group=group, seq=seq, tag=tag, digest=digest)

    async def recv(self, src: int | None, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0) -> int:
        """Receive message ``(group, seq, tag)`` from global rank ``src`` (None: from any rank)
        into ``buf``, which it must fill exactly. Returns the source rank. (``inbox.recv``.)"""
        return await self.inbox.recv(src, buf, group=group, seq=seq, tag=tag)

    async def connect(self, peers: Sequence[int] | None = None) -> None:
        """Eagerly make the connections to ``peers`` (default: every other rank)."""
        todo = [p for p in (range(self.world_size) if peers is None else peers) if p != self.rank]
        for p in todo:
            check_rank(self.rank, p, self.world_size)
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.gather(*(self.dialer.connection(p) for p in todo))
        except TimeoutError:
            raise DistTimeoutError(
                f"rank {self.rank}: connecting to ranks {todo} did not complete in {self.timeout:g} s{self.connection_report(todo)}"
            ) from None

    async def abort(self, group_id: int, reason: str, ranks: Sequence[int] = (), culprits: dict[int, str] | None = None) -> None:
        """Tell every connected peer that ``group_id`` is dead, and fail its local pending and
        later ops with ``DistBackendError(reason)``; ``culprits`` (global rank -> what it did) are
        the ranks the break names, told with it (the group's first naming stays: ``blame``). Where this rank is the first to abort the
        group, each of ``ranks`` (the group's) it has no connection to is dialed and told too,
        within ``_ABORT_DIAL_S`` (a group torn down first cancels that): ranks whose ops met
        only through shared memory never needed a socket (aiodist.shm's lane)."""
        first = group_id not in self._standing.aborted  # a peer's ABORT came first: that peer told everyone
        if culprits:
            self._standing.blame(group_id, culprits)
        self._abort_now(group_id, reason)
        todo = [r for r in ranks if first and r != self.rank and r not in self.dialer.send_conn and r not in self._standing.dead]
        if todo and not self._standing.closed:
            frame = abort_frame(self.rank, group_id, 0, reason, culprits=self._standing.blamed.get(group_id))

            async def tell(peer: int) -> None:
                async with asyncio.timeout(_ABORT_DIAL_S):
                    conn = await self.dialer.connection(peer)
                conn.write_control(frame)

            for peer, res in zip(todo, await asyncio.gather(*(tell(p) for p in todo), return_exceptions=True), strict=True):
                if isinstance(res, BaseException):
                    log.debug("rank %d: could not tell rank %d that group %d was aborted: %s", self.rank, peer, group_id, res)

    def _abort_now(self, group_id: int, reason: str) -> None:
        """``abort``'s work, which does not suspend (a frame's handler calls it too): the ABORT
        frame names the ranks the group's break names, where it names any (``blame``)."""
        frame = abort_frame(self.rank, group_id, 0, reason, culprits=self._standing.blamed.get(group_id))
        for conn in list(self.dialer.send_conn.values()):
            conn.write_control(frame)
        self._abort_local(group_id, f"rank {self.rank} broke group {group_id}: {reason}")

    async def close(self) -> None:
        """Say GOODBYE to every peer, close every connection and listener, fail what is pending.
        Idempotent; waits at most a couple of seconds for sockets to finish closing."""
        if self._standing.closed:
            return
        self._standing.closed = True
        self.handshakes.flush()  # closes not reported yet: said now, below WARNING (one per period)
        tasks = self.dialer.stop()
        err = DistBackendError(f"rank {self.rank}: the transport was closed")
        self.inbox.fail(lambda r: True, lambda r: err)
        self.inbox.mailbox.drop_staged(lambda k, m: True)
        for srv in self._servers:
            srv.close()
        conns = list(self._conns)
        for c in conns:
            c.say_goodbye()
            c.close()
        waits: list[asyncio.Future[Any]] = [c.closed for c in conns]
        waits += tasks
        if waits:
            await asyncio.wait(waits, timeout=_CLOSE_WAIT)
        for c in conns:
            if not c.closed.done() and c.transport is not None:
                c.transport.abort()
        for srv in self._servers:
            try:
                async with asyncio.timeout(_CLOSE_WAIT):
                    await srv.wait_closed()
            except TimeoutError:
                pass

    @property
    def closed(self) -> bool:
        return self._standing.closed

    def stats(self) -> dict[str, Any]:
        conns: list[dict[str, Any]] = [
            {
                "peer": c.peer,
                "kind": c.kind,
                "lane": c.lane,
                "dialed": c.dialed_peer is not None,
                "sending": self.dialer.sending(c),
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "staged_bytes": c.decoder.staged_bytes,
            }
            for c in self._conns
        ]
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "address": None if self.address is None else self.address.describe(),
            "lanes": list(self.advertised.hosts),
            "interfaces": list(self.advertised.ifnames),
            "advertised_because": self.advertised.why,
            "connections": conns,
            "bytes_in": self._bytes_lost[0] + sum(c["bytes_in"] for c in conns),
            "bytes_out": self._bytes_lost[1] + sum(c["bytes_out"] for c in conns),
            "staged_bytes": self.inbox.mailbox.staged_bytes,
            "staged_messages": self.inbox.mailbox.staged_messages,
            "staged_total": self.inbox.staged_total,
            "held_connections": len(self.inbox.held),
            "handshake_timeouts": self.handshakes.timeouts,
            "handshake_refusals": self.handshakes.refusals,
            "pending_receives": self.inbox.mailbox.pending,
            "dead_peers": sorted(self._standing.dead),
            "aborted_groups": sorted(self._standing.aborted),
            "closed": self._standing.closed,
        }

    @property
    def staged_total(self) -> int:
        """Messages ever staged (they came before their receive)."""
        return self.inbox.staged_total

    def connection_report(self, peers: Sequence[int]) -> str:
        """For a timeout message: the peers among ``peers`` never connected to, with the address
        tried and the last error (empty when every one was connected at some point)."""
        return self.dialer.report(peers)

    # -- the ConnectionOwner side (aiodist.transport._connection): what connections report ----

    def attach(self, conn: Connection) -> None:
        self._conns.add(conn)

    def on_hello(self, conn: Connection, hello: Hello, lane: int) -> str | None:
        why = refusal(self.hello, hello, conn.dialed_peer, self._standing.closed)
        if why is None and conn.dialed_peer is None and not 0 <= lane < self.lanes:
            why = f"rank {hello.rank} dialed lane {lane}, but this rank has {self.lanes} (one per interface named)"
        if why is None:
            self.dialer.ready(conn, hello.rank, lane)
        return why

    def on_unheard(self, conn: Connection, why: str | None) -> None:
        """Accepted ``conn`` was closed before its HELLO (``why``: the protocol broken; None: no
        HELLO in time): counted and summed up (``aiodist.transport._handshake``)."""
        self.handshakes.unheard(conn, why)

    def on_abort(self, header: FrameHeader, reason: str, culprits: dict[int, str]) -> None:
        if culprits:  # whom the break names, as its first rank named them: every survivor agrees
            self._standing.blame(header.group, culprits)
        self._abort_local(header.group, f"the failure started on rank {header.source}, which broke group {header.group}: {reason}")

    def on_lost(self, conn: Connection, err: BaseException, current: PostedRecv | None) -> None:
        self._conns.discard(conn)
        self.inbox.held.discard(conn)
        self._bytes_lost[0] += conn.bytes_in
        self._bytes_lost[1] += conn.bytes_out
        peer = conn.peer
        if peer is None or self._standing.closed:
            if current is not None and not current.fut.done():
                current.fut.set_exception(err)
            return
        self.dialer.dropped(conn, peer)
        dead = err if isinstance(err, DistNetworkError) else DistNetworkError(str(err))
        if not dead.culprits:
            dead.culprits = {peer: conn.lost_how()}
        if self._standing.lose(peer, dead):  # said once per peer, not once per connection to it
            log.log(logging.INFO if conn.goodbye else logging.WARNING, "%s", dead)
        # the receives' errors are the peer's sentence: the op that reads one names itself
        # (c10d: op, group, seq), so the message key and tag are not repeated
        if current is not None and not current.fut.done():
            current.fut.set_exception(DistNetworkError(str(dead), culprits=dead.culprits))
        if conn.goodbye:
            # A graceful leave: the peer says GOODBYE on each of its connections after all it
            # sent there, so its other connections still deliver what it sent before leaving;
            # receives from it fail once the last of them has closed.
            if any(other.peer == peer for other in self._conns):
                return
        else:
            for other in list(self._conns):  # fail-stop: nothing more from this peer
                if other.peer == peer:
                    other.fail(dead)
        self.inbox.fail(lambda r: r.src == peer, lambda r: DistNetworkError(str(dead), culprits=dead.culprits))

    def _abort_local(self, group: int, why: str) -> None:
        standing = self._standing
        standing.break_group(group, why)
        self.inbox.fail(lambda r: r.key[0] == group, lambda r: standing.abort_error(group))
        for c in self._conns:
            cur = c.current
            if cur is not None and cur.key[0] == group and not cur.fut.done():
                cur.fut.set_exception(standing.abort_error(group))
            c.fail_sends(group, DistBackendError(why))
        self.inbox.mailbox.drop_staged(lambda k, m: k[0] == group)
        self.inbox.room_freed()  # a held payload of this group is now read and dropped
