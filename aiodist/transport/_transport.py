"""``Transport``: one rank's listeners, connections and receive matching (``channel()`` hands out
the ``P2P`` of one op of one group over it).

Rules this module keeps:
- Addresses: each rank listens on TCP port 0 on every interface and, on Linux, on an abstract
  Unix socket (named from a hash of the job token, the rank, the pid and a random nonce, so
  no two transports ever share a name), and publishes both with its host id under
  ``aiodist/transport/<rank>``. The host id is the kernel boot id plus the network namespace
  (abstract socket names are per namespace); peers with equal host ids use the Unix socket.
- Connections are made on first use by whichever side needs one first: a send dials the
  peer; a receive from one peer starts a dial in the background (so that peer's death is
  noticed). If both sides dial at once there are two connections; each side SENDS on the
  first one whose handshake completed and keeps it for good (so its messages to that peer stay
  in order) and RECEIVES on both. At most two connections per pair, never a race to close one.
- Handshake: the dialer sends HELLO (job token, rank, world size), the acceptor checks it and
  answers with its own; the dialer checks that the answer comes from the rank it dialed. A
  wrong token, world size or rank closes the connection and logs an error. An accepted
  connection that sends no HELLO within ``handshake_timeout`` is closed; such closes are
  summed up in one warning at most every 10 s.
- Matching key: ``(group, seq, tag)`` plus the source rank (or any source). A payload whose
  receive is posted lands in the receive's array (zero-copy); one that comes first is staged
  and copied once when its receive is posted. Staging is bounded per connection by
  ``FrameLimits.max_staged_bytes`` with back-pressure, not failure: a payload that would go
  over the bound is held and that connection stops reading, so TCP flow control slows the
  sender (its send waits, within its deadline), until the payload's receive is posted (it then
  lands there, zero-copy; so a message bigger than the bound just waits for its receive) or
  staged messages are claimed and it fits. A late rank thus slows its peers, never kills the
  job. Send to self has no socket to push back on: going over the bound there raises
  ``DistBackendError`` at once (post the receive first).
  While a connection holds a payload it reads nothing, so a peer that dies then is noticed
  only when reading resumes or a send to it fails: its receives then end by their deadline.
- ``send`` returns once the whole frame is in the kernel's socket buffer (or, to self, copied):
  the array may then be changed. Send to self never touches a socket. A send never writes
  to a paused connection (one with bytes still buffered): it waits in the peer's line for it
  to resume, so at most one frame's remainder is buffered per connection (asyncio's loop
  copies what it buffers).
- Failure is fail-stop: a connection that dies (without GOODBYE, or after it) marks its peer
  dead for this transport: every pending and later receive from it, and every later send to
  it, fails with a ``DistNetworkError`` naming the peer (and the op's key). ``abort(group)``
  and an incoming ABORT fail the group's pending and later ops with ``DistBackendError``.
- Every wait is bounded by ``timeout``; running past it raises ``DistTimeoutError`` naming the
  peer and the key.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from aiodist import _startup
from aiodist._message import P2P_SEQ, byte_view
from aiodist.errors import DistBackendError, DistError, DistNetworkError, DistTimeoutError
from aiodist.knobs import knob
from aiodist.store.base import Store
from aiodist.transport._address import PeerAddress, address_key, host_id, listen_tcp, unix_name
from aiodist.transport._channel import Channel
from aiodist.transport._connection import Connection
from aiodist.transport._digests import DigestBook
from aiodist.transport._ifaces import Advertised, choose
from aiodist.transport._landing import DESYNC, GRACE, HOLD, LAND, MISMATCH, STAGE, Landing, decide
from aiodist.transport._mailbox import _PART_SHIFT, Key, Mailbox, PostedRecv, StagedMessage, describe_key, size_error
from aiodist.transport._standing import Standing
from aiodist.wire.frame import FrameHeader, FrameKind, FrameLimits, Hello, abort_frame

__all__ = ["Transport"]

log = logging.getLogger("aiodist.transport")

_CLOSE_WAIT = 2.0  # seconds close() waits for connections to finish closing
_DIAL_GRACE = 0.05  # seconds a waiting receive gives its peer to connect before dialing it
_ABORT_DIAL_S = 2.0  # abort: how long a dial to a peer not yet connected may take
_DIGESTS_KEPT = 4096  # per group: a collective digest is kept until its op is this many seqs old
_NOWAIT_MAX_BYTES = 64 * 1024  # send_nowait only tries messages this small (the kernel takes them at once)
_CONNECT_ATTEMPT_S = 5.0  # one connect attempt's deadline (a dropped SYN would otherwise wait minutes)
_DIAGNOSE_S = 5.0  # how long a failed exchange() may spend finding the ranks it waited for
_WARN_AFTER_S = 1.0  # a peer that cannot be connected to for this long gets a warning ...
_WARN_EVERY_S: float | None = None  # ... and another this often while it lasts (None: AIODIST_INIT_WARN_INTERVAL, default 10 s)
LISTEN_BACKLOG = 1024  # each listener's accept queue (the kernel caps it at net.core.somaxconn)
HANDSHAKE_TIMEOUT_S = knob("AIODIST_HANDSHAKE_TIMEOUT").number({})  # an accepted connection must complete its HELLO this soon
_HANDSHAKE_WARN_EVERY_S = 10.0  # at most one warning this often about connections closed for want of a HELLO ...
_HANDSHAKE_COALESCE_S = 0.5  # ... each summing up those closed within this long of the first
STRIPE_MIN_BYTES = knob("AIODIST_STRIPE_MIN_BYTES").whole({})  # collective messages this big are split across the lanes
_STRIPE_TAG = 1 << _PART_SHIFT  # part j of a striped message travels under tag + (j + 1) * _STRIPE_TAG (tags stay below 2**31)
_STRIPE_ALIGN = 64


def stripe_parts(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """The byte ranges of a striped message's parts, one per lane: equal, 64-byte aligned, the
    last one taking the rest. Sender and receiver compute the same parts from the size."""
    step = (nbytes // lanes) // _STRIPE_ALIGN * _STRIPE_ALIGN
    cuts = [j * step for j in range(lanes)] + [nbytes]
    return [(cuts[j], cuts[j + 1]) for j in range(lanes)]


def _stripe_min_bytes() -> int:
    return knob("AIODIST_STRIPE_MIN_BYTES").whole()


def _handshake_timeout(given: float | None) -> float:
    if given is None:
        given = knob("AIODIST_HANDSHAKE_TIMEOUT").number()
    if not 0 < given < float("inf"):
        raise ValueError(f"the handshake timeout (AIODIST_HANDSHAKE_TIMEOUT) must be a finite number of seconds > 0, got {given!r}")
    return float(given)


class _Unheard:
    """Accepted connections closed before their HELLO for one reason, not reported yet."""

    __slots__ = ("count", "peers", "why", "report", "said")

    def __init__(self) -> None:
        self.count = 0
        self.peers: list[str] = []  # a few of their peers' addresses, for the report
        self.why = ""  # the first reason since the last report
        self.report: asyncio.TimerHandle | None = None
        self.said = -float("inf")  # when the last report was logged (loop time)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a send_nowait write whose caller's receive failed first: seen, not logged


async def _parts(coros: list[Coroutine[Any, Any, Any]]) -> None:
    """Run a striped message's parts at once. Part 0 runs in the caller's task, so its first
    step (where a send is written, or a receive posted) happens in the caller's step: sends to
    one peer still start in call order. The first failure cancels the other parts."""
    rest = [asyncio.ensure_future(c) for c in coros[1:]]
    for t in rest:
        t.add_done_callback(_retrieve)
    try:
        await coros[0]
        await asyncio.gather(*rest)
    except BaseException:
        for t in rest:
            t.cancel()
        raise


class Transport:
    """Rank-to-rank data for one process of a job. Make one with ``await Transport.start(...)``."""

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
        self._peers: dict[int, PeerAddress] = {}  # every rank's address, once exchange() read them
        self._striping = False  # some peer's messages are split (exchange() sets it)
        self._lane_conn: dict[tuple[int, int], Connection] = {}  # (peer, lane >= 1): the connection we send that lane on
        self._lane_dialing: dict[tuple[int, int], asyncio.Task[Connection]] = {}
        self._ready_waiters: dict[Any, set[asyncio.Future[None]]] = {}  # peer or (peer, lane): sends waiting for a connection
        self._connected: set[Any] = set()  # peer (lane 0) or (peer, lane): a connection was ever made (either way)
        self._connect_errors: dict[Any, list[Any]] = {}  # the same keys -> [first failure, last warning, target, error]
        self._servers: list[asyncio.AbstractServer] = []
        self.address: PeerAddress | None = None
        self._mailbox = Mailbox()
        self._conns: set[Connection] = set()  # every open connection, handshake done or not
        self._send_conn: dict[int, Connection] = {}  # the one connection we send to a peer on
        self._dialing: dict[int, asyncio.Task[Connection]] = {}
        self._watching: dict[int, asyncio.Task[None]] = {}
        self._order: dict[Any, asyncio.Lock] = {}  # per peer (or (peer, lane)): sends waiting for the connection, in call order
        self._queued: dict[Any, int] = {}  # per peer (or (peer, lane)): how many sends wait in that line
        self.staged_total = 0  # messages ever staged (came before their receive)
        # always-on desync detection (aiodist._digest): (group, seq) -> (digest, op, args, the
        # group's name, its size) of this rank's own collectives, and (digest, source, length)
        # of a message that came before its op
        self._book = DigestBook(_DIGESTS_KEPT)  # the collective ops' digests (sans-I/O: _digests.py)
        self._standing = Standing(rank)  # lost peers, broken groups and their errors (sans-I/O: _standing.py)
        self._self_staged = 0
        self._held: set[Connection] = set()  # connections holding a DATA header (reading paused)
        self._retry_soon = False
        self._bytes_lost = [0, 0]  # bytes in/out of connections already gone
        self.handshake_timeouts = 0  # accepted connections closed for sending no HELLO in time
        self.handshake_refusals = 0  # ... closed for breaking the protocol before a HELLO
        self._late = _Unheard()  # the former, not reported yet
        self._broken = _Unheard()  # the latter

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
        the lanes: striping needs both ends of a pair to split a message alike, so every rank
        must have as many lanes (and, with several, the same split size) as every other. A
        mismatch fails on every rank, naming the ranks and their interface lists.

        Every rank counts itself in under its own lane configuration, in a round of its own
        (a store reused by a later init counts afresh). Where all ranks have one lane, that is
        all: a few store calls per rank. Otherwise (or on a mismatch, to name the ranks) every
        rank reads every rank's address: striping needs each peer's host id."""
        store, world = self.store, self.world_size
        mine = f"{self.lanes}" if self.lanes == 1 else f"{self.lanes}x{self.stripe_min_bytes}"
        base = "aiodist/transport/config/"
        joined = await store.add(base + "joined", 1)
        rnd = (joined - 1) // world
        await store.add(f"{base}{rnd}/lanes/{mine}", 1)
        if (await store.add(f"{base}{rnd}/counted", 1)) == world:
            await store.set(f"{base}{rnd}/all", "1")
        keys = [address_key(r) for r in range(world)]
        who, there = _startup.who(f"rank {self.rank}"), _startup.where(store)

        async def progress(elapsed: float) -> str:
            if world > 4096:  # too many to ask one by one every few seconds: count them
                n = await store.add(f"{base}{rnd}/counted", 0)
                return f"{who} waiting for {world - n} ranks to publish their transport addresses in {there} ({n}/{world} counted in, {_startup.waited(elapsed, timeout)})"
            have = await asyncio.gather(*(store.check([k]) for k in keys))
            missing = [r for r, ok in enumerate(have) if not ok]
            return (
                f"{who} waiting for ranks {_startup.ranks(missing)} to publish their transport addresses in {there} "
                f"({world - len(missing)}/{world} published, {_startup.waited(elapsed, timeout)})"
            )

        def unknown(elapsed: float, exc: BaseException) -> str:
            return (
                f"{who} waiting for every rank's transport address in {there} ({_startup.waited(elapsed, timeout)}; "
                f"the store did not say which ranks are missing: {exc!r})"
            )

        try:
            async with _startup.warn_while(progress, unknown, log):
                await store.wait([f"{base}{rnd}/all"], timeout)
        except TimeoutError:
            try:
                async with asyncio.timeout(_DIAGNOSE_S):  # naming the absent ranks is best effort
                    missing = [r for r in range(world) if not await store.check([keys[r]])]
                    counted = await store.add(f"{base}{rnd}/counted", 0)
                who = f"ranks {missing}" if missing else f"{world - counted} of {world} ranks"
            except (TimeoutError, DistError):
                who = "some ranks (the store did not say which)"
            raise DistTimeoutError(
                f"rank {self.rank}: timeout after {timeout:g} s waiting for the transport addresses of {who} "
                f"(have they started? is world_size={world} right?)"
            ) from None
        if self.lanes == 1 and await store.add(f"{base}{rnd}/lanes/{mine}", 0) == world:
            return  # one lane everywhere: nothing to split, addresses are read when dialing
        addrs = [PeerAddress.decode(raw) for raw in await store.multi_get(keys)]
        by_count: dict[int, list[int]] = {}
        for a in addrs:
            by_count.setdefault(len(a.lanes), []).append(a.rank)
        if len(by_count) > 1:
            parts = []
            for count, ranks in sorted(by_count.items()):
                named = sorted({addrs[r].ifnames for r in ranks})
                lists = " or ".join(str(list(n)) if n else "(none named)" for n in named)
                parts.append(f"{count} ({lists}): ranks {ranks}")
            raise DistNetworkError(
                f"rank {self.rank}: ranks name different numbers of network interfaces (AIODIST_SOCKET_IFNAME / GLOO_SOCKET_IFNAME): "
                f"{'; '.join(parts)}. Every rank must name the same number of interfaces"
            )
        by_min: dict[int, list[int]] = {}
        for a in addrs:
            by_min.setdefault(a.stripe_min, []).append(a.rank)
        if len(by_min) > 1:
            sizes = "; ".join(f"{m} bytes: ranks {ranks}" for m, ranks in sorted(by_min.items()))
            raise DistNetworkError(
                f"rank {self.rank}: ranks split messages across interfaces from different sizes (AIODIST_STRIPE_MIN_BYTES): {sizes}. "
                "Every rank must use the same value"
            )
        self._peers = {a.rank: a for a in addrs}
        self._striping = any(self.striped(p) for p in self._peers)

    def _splits(self, peer: int, nbytes: int, seq: int) -> bool:
        """A message of ``nbytes`` to or from ``peer`` in op ``seq`` is split across the lanes:
        a collective's (never user p2p: an any-source receive cannot know the split), big
        enough, with a striped peer. Sender and receiver decide alike."""
        return self._striping and nbytes >= self.stripe_min_bytes and seq != P2P_SEQ and self.striped(peer)

    def striped(self, peer: int) -> bool:
        """Messages to and from ``peer`` are split across the lanes: several interfaces are named,
        the addresses were exchanged, and the peer is on another host."""
        if self.lanes < 2:
            return False
        addr = self._peers.get(peer)
        return addr is not None and addr.host_id != self._host_id

    # -- public API ------------------------------------------------------------------------

    def release_group(self, group_id: int) -> None:
        """Group ``group_id`` is destroyed on this rank: forget its ops' digests (a live group
        keeps its last ``_DIGESTS_KEPT``, for late frames' desync checks). A frame of it that
        arrives later is held as any early one is (bounded), and never matched."""
        self._book.release(group_id)

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

    def _own_digest(self, header: FrameHeader) -> int | None:
        """This rank's digest for the op of collective frame ``header``, for ``decide`` to compare
        (a mismatch breaks the group, on every rank); None before this rank issued that op: the
        frame's digest is then kept for the op to check when it is issued."""
        return self._book.own(header.group, header.seq, header.digest, header.source, header.length)

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
        return self._abort_error(key)

    def desync_op(self, key: Key, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        """Global rank ``peer``'s digest for op ``key`` is ``theirs``: break the group on every
        rank (``_desync``) and return the error its ops raise; None where this rank kept no
        digest for the op (nothing is aborted)."""
        if self._book.mine(key[0], key[1]) is None:
            return None
        self._desync(key[0], key[1], peer, theirs, nbytes)
        return self._abort_error(key)

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
        Sends to one peer go out in the order they were called (their first steps' order)."""
        view = byte_view(buf)
        self._check_peer(dst)
        key = (group, seq, tag)
        self._standing.usable(key, dst)
        if view.nbytes > self.limits.max_payload_bytes:
            raise ValueError(
                f"rank {self.rank}: a {view.nbytes}-byte message ({describe_key(key)}) is over the limit of "
                f"{self.limits.max_payload_bytes} bytes per message (FrameLimits.max_payload_bytes): split it"
            )
        if dst == self.rank:
            self._deliver_self(key, view)
            return
        if self._splits(dst, view.nbytes, seq):
            parts = stripe_parts(view.nbytes, self.lanes)
            await _parts(
                [self._send_lane(dst, j, view[a:b], (group, seq, tag + (j + 1) * _STRIPE_TAG), digest) for j, (a, b) in enumerate(parts)]
            )
            return
        await self._send_lane(dst, 0, view, key, digest)

    async def _send_lane(self, dst: int, lane: int, view: np.ndarray, key: Key, digest: int = 0) -> None:
        """One frame to ``dst`` on ``lane``'s connection (lane 0's is the usual one)."""
        group, seq, tag = key
        header = FrameHeader(FrameKind.DATA, group, seq, tag, self.rank, view.nbytes, 0, digest)
        conns: dict[Any, Connection] = self._send_conn if lane == 0 else self._lane_conn
        k: Any = dst if lane == 0 else (dst, lane)
        conn = conns.get(k)
        if conn is not None and not self._queued.get(k) and conn.can_write_now():
            # the fast path: connected, not paused and nobody waiting in line; most small sends
            # end here, written straight into the kernel without arming a deadline. A paused
            # connection is waited for in line (never written to: see Connection.writable)
            drained = self._write(conn, header, view, key, dst)
            if drained is None:
                return
        else:
            drained = None
        on = f", lane {lane}" if lane else ""
        try:
            async with asyncio.timeout(self.timeout):
                if drained is not None:
                    await drained
                else:
                    conn = await self._in_line(dst, lane, group)
                    await conn.send_frame(header, view, group)  # writes in this step, before any suspension
        except TimeoutError:
            raise DistTimeoutError(
                f"rank {self.rank}: send to rank {dst} ({describe_key(key)}{on}, {view.nbytes} bytes) did not complete in {self.timeout:g} s{self._never(dst)}"
            ) from None
        except DistNetworkError as exc:
            raise DistNetworkError(f"{exc} (during a send to rank {dst}, {describe_key(key)}{on})") from exc
        if group in self._standing.aborted:
            raise self._abort_error(key)

    def _write(self, conn: Connection, header: FrameHeader, view: np.ndarray, key: Key, dst: int) -> asyncio.Future[None] | None:
        try:
            drained = conn.write_frame(header, view, key[0])
        except DistNetworkError as exc:
            raise DistNetworkError(f"{exc} (during a send to rank {dst}, {describe_key(key)})") from exc
        if drained is None and key[0] in self._standing.aborted:
            raise self._abort_error(key)
        return drained

    def send_nowait(
        self, dst: int, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0, digest: int = 0
    ) -> bool | asyncio.Future[None]:
        """``send`` without waiting, where it can be done: False (nothing sent) when ``send`` would
        have to wait for a connection or for earlier sends in line; True when the bytes are in the
        kernel; a future when they were written but the kernel did not take them all at once: the
        caller must await it before changing ``buf``."""
        view = byte_view(buf)
        self._check_peer(dst)
        key = (group, seq, tag)
        self._standing.usable(key, dst)
        if dst == self.rank or view.nbytes > min(self.limits.max_payload_bytes, _NOWAIT_MAX_BYTES):
            return False
        if self._splits(dst, view.nbytes, seq):
            return False  # its receiver expects the parts: send() splits it
        conn = self._send_conn.get(dst)
        if conn is None or self._queued.get(dst) or not conn.can_write_now():
            return False
        header = FrameHeader(FrameKind.DATA, group, seq, tag, self.rank, view.nbytes, 0, digest)
        drained = self._write(conn, header, view, key, dst)
        if drained is None:
            return True
        drained.add_done_callback(_retrieve)  # awaited by the caller, unless its receive failed first
        return drained

    async def recv(self, src: int | None, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0) -> int:
        """Receive message ``(group, seq, tag)`` from global rank ``src`` (None: from any rank)
        into ``buf``, which it must fill exactly. Returns the source rank."""
        dst = byte_view(buf, writable=True)
        key = (group, seq, tag)
        if src is not None:
            self._check_peer(src)
        self._standing.usable(key, None)
        if src is None and self._striping and dst.nbytes >= self.stripe_min_bytes and seq != P2P_SEQ:
            raise ValueError(
                f"rank {self.rank}: an any-source receive of a {dst.nbytes}-byte collective message ({describe_key(key)}) cannot be "
                f"matched while messages from {self.stripe_min_bytes} bytes are split across interfaces: name the source"
            )
        if src is not None and self._splits(src, dst.nbytes, seq):
            parts = stripe_parts(dst.nbytes, self.lanes)
            await _parts([self._recv_one(src, dst[a:b], (group, seq, tag + (j + 1) * _STRIPE_TAG)) for j, (a, b) in enumerate(parts)])
            return src
        return await self._recv_one(src, dst, key)

    async def _recv_one(self, src: int | None, dst: np.ndarray, key: Key) -> int:
        m = self._mailbox.take_staged(key, src)  # a peer that left may have sent it before leaving
        if m is not None:
            return m.consume(dst, key, self.rank)
        if src is not None:
            if self._gone(src):
                raise self._standing.dead_error(src)
            if src != self.rank:
                self._want_connection(src)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        recv = PostedRecv(key, src, dst, fut)
        self._mailbox.post(recv)
        if self._held:
            self._room_freed()  # a held payload may be this receive's
        try:
            async with asyncio.timeout(self.timeout):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return fut.result()
            never = self.connection_report([src] if src is not None else range(self.world_size))
            raise DistTimeoutError(f"rank {self.rank}: {recv.what()} not complete after {self.timeout:g} s{never}") from None
        finally:
            # A payload already being read into ``buf`` keeps landing there after a timeout or a
            # cancellation: the op is broken then, and ``buf`` holds undefined bytes.
            self._mailbox.unpost(recv)
            if not fut.done():
                fut.cancel()

    async def connect(self, peers: Sequence[int] | None = None) -> None:
        """Eagerly make the connections to ``peers`` (default: every other rank)."""
        todo = [p for p in (range(self.world_size) if peers is None else peers) if p != self.rank]
        for p in todo:
            self._check_peer(p)
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.gather(*(self._connection(p) for p in todo))
        except TimeoutError:
            raise DistTimeoutError(
                f"rank {self.rank}: connecting to ranks {todo} did not complete in {self.timeout:g} s{self.connection_report(todo)}"
            ) from None

    async def abort(self, group_id: int, reason: str, ranks: Sequence[int] = ()) -> None:
        """Tell every connected peer that ``group_id`` is dead, and fail its local pending and
        later ops with ``DistBackendError(reason)``. Where this rank is the first to abort the
        group, each of ``ranks`` (the group's) it has no connection to is dialed and told too,
        within ``_ABORT_DIAL_S`` (a group torn down first cancels that): ranks whose ops met
        only through shared memory never needed a socket (aiodist.shm's lane)."""
        first = group_id not in self._standing.aborted  # a peer's ABORT came first: that peer told everyone
        self._abort_now(group_id, reason)
        todo = [r for r in ranks if first and r != self.rank and r not in self._send_conn and r not in self._standing.dead]
        if todo and not self._standing.closed:
            frame = abort_frame(self.rank, group_id, 0, reason)

            async def tell(peer: int) -> None:
                async with asyncio.timeout(_ABORT_DIAL_S):
                    conn = await self._connection(peer)
                conn.write_control(frame)

            for peer, res in zip(todo, await asyncio.gather(*(tell(p) for p in todo), return_exceptions=True), strict=True):
                if isinstance(res, BaseException):
                    log.debug("rank %d: could not tell rank %d that group %d was aborted: %s", self.rank, peer, group_id, res)

    def _abort_now(self, group_id: int, reason: str) -> None:
        """``abort``'s work, which does not suspend (a frame's handler calls it too)."""
        frame = abort_frame(self.rank, group_id, 0, reason)
        for conn in list(self._send_conn.values()):
            conn.write_control(frame)
        self._abort_local(group_id, f"rank {self.rank} broke group {group_id}: {reason}")

    async def close(self) -> None:
        """Say GOODBYE to every peer, close every connection and listener, fail what is pending.
        Idempotent; waits at most a couple of seconds for sockets to finish closing."""
        if self._standing.closed:
            return
        self._standing.closed = True
        for closes in (self._late, self._broken):
            if closes.report is not None:  # closes not reported yet: said now, below WARNING (one per period)
                closes.report.cancel()
                self._report_unheard(closes, logging.INFO)
        for t in [*self._dialing.values(), *self._watching.values(), *self._lane_dialing.values()]:
            t.cancel()
        err = DistBackendError(f"rank {self.rank}: the transport was closed")
        for r in self._mailbox.remove_posted(lambda r: True):
            if not r.fut.done():
                r.fut.set_exception(err)
        self._mailbox.drop_staged(lambda k, m: True)
        for srv in self._servers:
            srv.close()
        conns = list(self._conns)
        for c in conns:
            c.say_goodbye()
            c.close()
        waits: list[asyncio.Future[Any]] = [c.closed for c in conns] + [
            *self._dialing.values(),
            *self._watching.values(),
            *self._lane_dialing.values(),
        ]
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
                "sending": c.peer is not None and (self._send_conn.get(c.peer) is c or self._lane_conn.get((c.peer, c.lane)) is c),
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
            "staged_bytes": self._mailbox.staged_bytes,
            "staged_messages": self._mailbox.staged_messages,
            "staged_total": self.staged_total,
            "held_connections": len(self._held),
            "handshake_timeouts": self.handshake_timeouts,
            "handshake_refusals": self.handshake_refusals,
            "pending_receives": self._mailbox.pending,
            "dead_peers": sorted(self._standing.dead),
            "aborted_groups": sorted(self._standing.aborted),
            "closed": self._standing.closed,
        }

    # -- checks ----------------------------------------------------------------------------

    def _check_peer(self, peer: int) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.world_size:
            raise ValueError(f"rank {self.rank}: peer {peer!r} is not a rank of a world of {self.world_size}")

    def _gone(self, peer: int) -> bool:
        """Nothing more can come from ``peer``: it died or left, and its last connection closed."""
        return peer in self._standing.dead and not any(c.peer == peer for c in self._conns)

    def _abort_error(self, key: Key) -> DistBackendError:
        return self._standing.abort_error(key[0])

    # -- connections -----------------------------------------------------------------------

    async def _in_line(self, peer: int, lane: int = 0, group: int | None = None) -> Connection:
        """The connection to ``peer`` (on ``lane``) for a send that must wait for it, or for it to
        resume writing (a paused connection is never written to): sends to one peer are written
        in the order they were called (an earlier one waiting is never overtaken by a later one),
        which is what p2p's non-overtaking matching relies on. Each lane keeps its own line."""
        k: Any = peer if lane == 0 else (peer, lane)
        self._queued[k] = self._queued.get(k, 0) + 1
        try:
            lock = self._order.get(k)
            if lock is None:
                lock = self._order[k] = asyncio.Lock()
            async with lock:  # FIFO; released before the caller writes, which it does in this step
                conn = await self._connection(peer, lane)
                while (resumed := conn.writable(group)) is not None:
                    await resumed
                return conn
        finally:
            self._queued[k] -= 1

    async def _connection(self, peer: int, lane: int = 0) -> Connection:
        """The connection this rank sends to ``peer`` on (on ``lane``), dialing it if there is
        none: one dial at a time per peer and lane, shared by every caller that waits for it."""
        conns: dict[Any, Connection] = self._send_conn if lane == 0 else self._lane_conn
        dialing: dict[Any, asyncio.Task[Connection]] = self._dialing if lane == 0 else self._lane_dialing
        k: Any = peer if lane == 0 else (peer, lane)
        conn = conns.get(k)
        if conn is not None:
            return conn
        if peer in self._standing.dead:
            raise self._standing.dead[peer]
        if self._standing.closed:
            raise DistBackendError(f"rank {self.rank}: the transport is closed")
        task = dialing.get(k)
        if task is None:
            task = dialing[k] = asyncio.get_running_loop().create_task(self._dial(peer, lane))
            task.add_done_callback(functools.partial(self._dial_done, dialing, k))
        # Done when the dial is, or as soon as the peer's own connection to us is ready (we send on
        # it too): a peer this rank cannot reach but which reaches us is not waited for.
        ready = asyncio.get_running_loop().create_future()
        self._ready_waiters.setdefault(k, set()).add(ready)
        try:
            await asyncio.wait((task, ready), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._ready_waiters[k].discard(ready)
            if not self._ready_waiters[k]:
                del self._ready_waiters[k]
            ready.cancel()
        conn = conns.get(k)
        if conn is None and task.done():
            if task.cancelled():  # close() cancels the dials in flight
                raise DistBackendError(f"rank {self.rank}: the transport was closed while connecting to rank {peer}")
            task.result()  # the dial's error
        if conn is None:  # the dial's connection died at once
            on = f" (lane {lane})" if lane else ""
            raise self._standing.dead.get(peer) or DistNetworkError(
                f"rank {self.rank}: connection to rank {peer}{on} closed right after the handshake"
            )
        return conn

    def _want_connection(self, peer: int) -> None:
        """A receive from ``peer`` waits: make sure a connection exists soon, so that the peer's
        death fails the receive. After a short grace, since the peer's send usually dials first
        (one connection instead of two)."""
        if (
            peer in self._send_conn
            or peer in self._dialing
            or peer in self._standing.dead
            or self._standing.closed
            or peer in self._watching
        ):
            return
        task = self._watching[peer] = asyncio.get_running_loop().create_task(self._watch(peer))
        task.add_done_callback(functools.partial(self._watch_done, peer))

    async def _watch(self, peer: int) -> None:
        await asyncio.sleep(_DIAL_GRACE)
        if peer in self._send_conn or peer in self._standing.dead or self._standing.closed:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self._connection(peer)
        except (DistError, TimeoutError) as exc:
            log.debug("rank %d: background connection to rank %d failed: %s", self.rank, peer, exc)

    def _watch_done(self, peer: int, task: asyncio.Task[None]) -> None:
        if self._watching.get(peer) is task:
            del self._watching[peer]

    def _dial_done(self, dialing: dict[Any, asyncio.Task[Connection]], k: Any, task: asyncio.Task[Connection]) -> None:
        if dialing.get(k) is task:
            del dialing[k]
        if not task.cancelled() and task.exception() is not None:
            log.debug(
                "rank %d: dialing %s failed: %s",
                self.rank,
                f"rank {k}" if isinstance(k, int) else f"rank {k[0]} on lane {k[1]}",
                task.exception(),
            )

    async def _dial(self, peer: int, lane: int = 0) -> Connection:
        try:
            async with asyncio.timeout(self.timeout):
                addr = self._peers.get(peer)
                if addr is None:
                    raw = await self.store.get(address_key(peer))
                    addr = PeerAddress.decode(raw)
                if addr.rank != peer:
                    raise DistNetworkError(f"rank {self.rank}: the store's address for rank {peer} is rank {addr.rank}'s")
                conn = await self._open(addr, lane)
                await asyncio.shield(conn.handshake)  # a cancelled dial leaves the connection to finish its handshake
                return conn
        except TimeoutError:
            raise DistTimeoutError(
                f"rank {self.rank}: could not connect to rank {peer} within {self.timeout:g} s{self._never(peer)}"
            ) from None
        except DistError as exc:
            if isinstance(exc, DistTimeoutError):
                raise
            raise DistNetworkError(f"rank {self.rank}: could not connect to rank {peer}: {exc}") from exc

    async def _open(self, addr: PeerAddress, lane: int = 0) -> Connection:
        """Connect to ``addr`` (on ``lane``: the peer's address for it, from this rank's own
        address for it when interfaces are named), retrying failures with backoff (the caller
        holds the deadline). A peer that cannot be reached for a while gets a warning every few
        seconds, naming the address and the OS error."""
        loop = asyncio.get_running_loop()
        same_host = addr.host_id == self._host_id
        delay = 0.005
        while True:
            try:
                if self._use_unix and same_host and addr.unix is not None and lane == 0:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        sock.setblocking(False)
                        sock.connect(addr.unix)  # abstract sockets connect at once or refuse at once
                    except OSError:
                        sock.close()
                        raise
                    _, uconn = await loop.create_unix_connection(lambda: Connection(self, "unix", addr.rank), sock=sock)
                    return uconn
                host = "127.0.0.1" if same_host else addr.lanes[lane]
                local = (self.advertised.hosts[lane], 0) if self.advertised.bind and not same_host else None
                async with asyncio.timeout(_CONNECT_ATTEMPT_S):
                    _, tconn = await loop.create_connection(
                        lambda: Connection(self, "tcp", addr.rank, lane), host, addr.port, local_addr=local
                    )
                return tconn
            except (OSError, TimeoutError) as exc:
                if (self._send_conn.get(addr.rank) if lane == 0 else self._lane_conn.get((addr.rank, lane))) is not None:
                    raise DistNetworkError(f"rank {self.rank}: stopped dialing rank {addr.rank}: its own connection came first") from None
                why = str(exc) if isinstance(exc, OSError) else f"no answer within {_CONNECT_ATTEMPT_S:g} s"
                self._connect_failed(addr, lane, why)
                log.debug("rank %d: connecting to rank %d failed (%s); retrying in %g s", self.rank, addr.rank, why, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _connect_failed(self, addr: PeerAddress, lane: int, why: str) -> None:
        now = time.monotonic()
        k: Any = addr.rank if lane == 0 else (addr.rank, lane)
        rec = self._connect_errors.get(k)
        if rec is None:
            rec = self._connect_errors[k] = [now, 0.0, "", ""]
        rec[2], rec[3] = addr.describe(lane), why
        every = _startup.warn_interval() if _WARN_EVERY_S is None else _WARN_EVERY_S
        if now - rec[0] >= _WARN_AFTER_S and now - rec[1] >= every:
            rec[1] = now
            log.warning(
                "rank %d: cannot connect to rank %d%s at %s, waiting for it to accept a connection (%s, until the op's timeout; last error: %s)",
                self.rank,
                addr.rank,
                f" on lane {lane} ({self.advertised.ifnames[lane]})" if lane and lane < len(self.advertised.ifnames) else "",
                rec[2],
                _startup.waited(now - rec[0], None),
                why,
            )

    def _never(self, peer: int) -> str:
        """``"; no connection to rank P at ADDR was ever made (last error: ...)"`` where so, for
        lane 0 and for each other lane (an interface that does not route between the hosts)."""
        out = ""
        for lane in range(self.lanes):
            k: Any = peer if lane == 0 else (peer, lane)
            rec = self._connect_errors.get(k)
            if k in self._connected or rec is None:
                continue
            on = f" on lane {lane}" + (f" ({self.advertised.ifnames[lane]})" if lane < len(self.advertised.ifnames) else "") if lane else ""
            out += f"; no connection to rank {peer}{on} at {rec[2]} was ever made (last error: {rec[3]})"
        return out

    def connection_report(self, peers: Sequence[int]) -> str:
        """For a timeout message: the peers among ``peers`` never connected to, with the address
        tried and the last error (empty when every one was connected at some point)."""
        return "".join(self._never(p) for p in sorted(set(peers)) if p != self.rank)

    # -- the ConnectionOwner side (aiodist.transport._connection): what connections report ----

    def attach(self, conn: Connection) -> None:
        self._conns.add(conn)

    def on_hello(self, conn: Connection, hello: Hello, lane: int) -> str | None:
        why = self._check_hello(hello, conn.dialed_peer)
        if why is None and conn.dialed_peer is None and not 0 <= lane < self.lanes:
            why = f"rank {hello.rank} dialed lane {lane}, but this rank has {self.lanes} (one per interface named)"
        if why is None:
            self._connection_ready(conn, hello.rank, lane)
        return why

    def on_unheard(self, conn: Connection, why: str | None) -> None:
        """Accepted ``conn`` was closed before its HELLO: for sending none in time (``why`` None)
        or for breaking the protocol (garbage, another protocol, a bad header, half a frame then
        EOF). Counted, and such closes summed up in one warning at most every
        ``_HANDSHAKE_WARN_EVERY_S`` (a flood of idle connections must not flood the log)."""
        if why is None:
            self.handshake_timeouts += 1
            self._unheard(self._late, conn, "")
        else:
            self.handshake_refusals += 1
            self._unheard(self._broken, conn, why)

    def on_abort(self, header: FrameHeader, reason: str) -> None:
        self._abort_local(header.group, f"the failure started on rank {header.source}, which broke group {header.group}: {reason}")

    def _check_hello(self, hello: Hello, dialed: int | None) -> str | None:
        """Why a peer's HELLO is refused, or None."""
        if hello.token != self.hello.token:
            return f"rank {hello.rank} of another job (job token mismatch): two jobs on one host must not cross"
        if hello.world_size != self.world_size:
            return f"rank {hello.rank} says the world size is {hello.world_size}, here it is {self.world_size}"
        if dialed is not None and hello.rank != dialed:
            return f"dialed rank {dialed}, but rank {hello.rank} answered (stale address in the store?)"
        if hello.rank == self.rank:
            return f"a connection from this rank ({hello.rank}) itself"
        if self._standing.closed:
            return "this transport is closed"
        return None

    def _unheard(self, closes: _Unheard, conn: Connection, why: str) -> None:
        closes.count += 1
        closes.why = closes.why or why
        if len(closes.peers) < 3:
            closes.peers.append(f"{conn.kind} {conn.peername!r}" if conn.peername else conn.kind)
        if closes.report is None and not self._standing.closed:
            loop = asyncio.get_running_loop()
            delay = max(_HANDSHAKE_COALESCE_S, closes.said + _HANDSHAKE_WARN_EVERY_S - loop.time())
            closes.report = loop.call_later(delay, self._report_unheard, closes, logging.WARNING)

    def _report_unheard(self, closes: _Unheard, level: int) -> None:
        n, peers, why = closes.count, closes.peers, closes.why
        closes.count, closes.peers, closes.why, closes.report = 0, [], "", None
        closes.said = asyncio.get_running_loop().time()
        if not n:
            return
        if closes is self._late:
            what = f"sent no HELLO within {self.handshake_timeout:g} s (AIODIST_HANDSHAKE_TIMEOUT; not an aiodist rank of this job, or one that stalled while connecting)"
            total = self.handshake_timeouts
        else:
            what = f"broke the protocol before their HELLO (not an aiodist rank; the first: {why})"
            total = self.handshake_refusals
        log.log(
            level,
            "rank %d: closed %d connection%s to its transport listeners that %s; from %s%s; %d so far, at most one such warning every %g s",
            self.rank,
            n,
            "" if n == 1 else "s",
            what,
            ", ".join(peers),
            ", ..." if n > len(peers) else "",
            total,
            _HANDSHAKE_WARN_EVERY_S,
        )

    def _connection_ready(self, conn: Connection, peer: int, lane: int) -> None:
        k: Any = peer if lane == 0 else (peer, lane)
        self._connected.add(k)
        self._connect_errors.pop(k, None)
        if peer in self._standing.dead:
            return
        if lane:
            self._lane_conn.setdefault((peer, lane), conn)
        elif peer not in self._send_conn:
            self._send_conn[peer] = conn
        for fut in self._ready_waiters.get(k, ()):
            if not fut.done():
                fut.set_result(None)

    def on_lost(self, conn: Connection, err: BaseException, current: PostedRecv | None) -> None:
        self._conns.discard(conn)
        self._held.discard(conn)
        self._bytes_lost[0] += conn.bytes_in
        self._bytes_lost[1] += conn.bytes_out
        peer = conn.peer
        if peer is None or self._standing.closed:
            if current is not None and not current.fut.done():
                current.fut.set_exception(err)
            return
        if self._send_conn.get(peer) is conn:
            del self._send_conn[peer]
        if conn.lane and self._lane_conn.get((peer, conn.lane)) is conn:
            del self._lane_conn[(peer, conn.lane)]
        dead = err if isinstance(err, DistNetworkError) else DistNetworkError(str(err))
        if not dead.culprits:
            dead.culprits = {
                peer: "lost its connection: " + ("it left" if conn.goodbye else "closed it without GOODBYE (its process ended or crashed)")
            }
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
        for r in self._mailbox.remove_posted(lambda r: r.src == peer):
            if not r.fut.done():
                r.fut.set_exception(DistNetworkError(str(dead), culprits=dead.culprits))

    # -- receiving (called by connections) ---------------------------------------------------

    def on_header(self, conn: Connection, header: FrameHeader, staged_bytes: int, grace_over: bool) -> Landing:
        aborted = self._standing.aborted
        digest = self._own_digest(header) if header.digest and header.group not in aborted else None
        d = decide(header, self._mailbox, self.limits, staged_bytes, False, grace_over, aborted, digest)  # by position: see decide
        fate, recv = d
        if fate is HOLD or fate is GRACE:
            self._held.add(conn)
            return d
        if self._held:
            self._held.discard(conn)
        if fate is LAND:
            assert recv is not None
            self._mailbox.claim(recv)
        elif fate is not STAGE:
            self._land_elsewhere(d, header)
        return d

    def on_payload(self, conn: Connection, header: FrameHeader, data: memoryview) -> None:
        """A whole payload that no receive claimed when its header came (or a zero-length one,
        which comes without a header event): a receive may have been posted meanwhile."""
        aborted = self._standing.aborted
        check = header.digest and not data.nbytes and header.group not in aborted  # a longer one was checked at its header
        digest = self._own_digest(header) if check else None
        fate, recv = decide(header, self._mailbox, self.limits, 0, True, False, aborted, digest)  # in memory, by position
        if fate is STAGE:
            self.staged_total += 1
            key = (header.group, header.seq, header.tag)
            self._mailbox.stage(key, StagedMessage(header.source, data, conn.release_staged))
            return
        try:
            if fate is LAND:
                assert recv is not None
                self._mailbox.claim(recv)
                recv.fill(data, header.source, self.rank)
            else:
                self._land_elsewhere((fate, recv), header)
        finally:
            conn.release_staged(data.nbytes)

    def _land_elsewhere(self, d: Landing, header: FrameHeader) -> None:
        """The effects of a payload that is dropped: MISMATCH fails its receive, DESYNC breaks
        the group (DROP has none)."""
        fate, recv = d
        if fate is MISMATCH:
            assert recv is not None
            self._mailbox.claim(recv)
            if not recv.fut.done():
                recv.fut.set_exception(size_error(self.rank, header.source, recv.key, header.length, recv.dst.nbytes))
        elif fate is DESYNC:
            self._desync(header.group, header.seq, header.source, header.digest, header.length)

    def _room_freed(self) -> None:
        """A receive was posted or a group aborted: soon, let every connection holding a payload
        try again (soon, not now: never from inside a decoder step). Staged bytes released
        retry only their own connection (``Connection.release_staged``)."""
        if self._held and not self._retry_soon:
            self._retry_soon = True
            asyncio.get_running_loop().call_soon(self._retry_held)

    def _retry_held(self) -> None:
        self._retry_soon = False
        for c in list(self._held):
            c.retry_held()

    def _deliver_self(self, key: Key, view: np.ndarray) -> None:
        recv = self._mailbox.match(key, self.rank)
        if recv is not None:
            recv.fill(view.data, self.rank, self.rank)
            return
        n = view.nbytes
        if self._self_staged + n > self.limits.max_staged_bytes:
            raise DistBackendError(
                f"rank {self.rank}: send to self ({describe_key(key)}, {n} bytes) would hold {self._self_staged + n} unclaimed bytes, "
                f"over the limit of {self.limits.max_staged_bytes} (FrameLimits.max_staged_bytes): post the receive first"
            )
        self._self_staged += n
        self.staged_total += 1
        self._mailbox.stage(key, StagedMessage(self.rank, memoryview(view.tobytes()), self._release_self))

    def _release_self(self, n: int) -> None:
        self._self_staged -= n

    def _abort_local(self, group: int, why: str) -> None:
        self._standing.break_group(group, why)
        err_for = self._abort_error
        for r in self._mailbox.remove_posted(lambda r: r.key[0] == group):
            if not r.fut.done():
                r.fut.set_exception(err_for(r.key))
        for c in self._conns:
            cur = c.current
            if cur is not None and cur.key[0] == group and not cur.fut.done():
                cur.fut.set_exception(err_for(cur.key))
            c.fail_sends(group, DistBackendError(why))
        self._mailbox.drop_staged(lambda k, m: k[0] == group)
        self._room_freed()  # a held payload of this group is now read and dropped
