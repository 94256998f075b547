"""``Dialer``: the connection this rank sends to each peer on, per lane, and making it.

Rules this module keeps:
- Connections are made on first use by whichever side needs one first: a send dials the
  peer (``connection``); a receive from one peer starts a dial in the background after a short
  grace (``want_connection``: the peer's send usually dials first, and one connection is
  better than two), so that peer's death is noticed. One dial at a time per peer and lane,
  shared by every caller that waits for it.
- If both sides dial at once there are two connections; this rank SENDS on the first one whose
  handshake completed (``ready``, whichever side dialed it) and keeps it for good, so its
  messages to that peer stay in order. A caller waiting for a dial is also served as soon as
  the peer's own connection is ready: a peer this rank cannot reach but which reaches it is
  not waited for.
- A dial reads the peer's address from the store (or from the addresses ``exchange`` read),
  uses the abstract Unix socket on lane 0 for a peer on this host and TCP otherwise, and
  retries a failed connect with backoff (each attempt bounded by ``CONNECT_ATTEMPT_S``, the
  whole dial by the transport's timeout). A peer that cannot be connected to for
  ``_WARN_AFTER_S`` gets a warning, and another every ``AIODIST_INIT_WARN_INTERVAL`` while it
  lasts; ``report`` names, for a timeout message, the peers never connected to, with the
  address tried and the last error.
- A lost peer (``Standing``) is never dialed again; a closed transport dials nothing.
- Striping is the peers' route too: ``splits`` says whether a message to or from a peer is
  split across the lanes (several interfaces named, the peer on another host, a collective's
  message of ``stripe_min_bytes`` or more), for the sender and the receiver alike.
- The dialer only makes and keeps connections: what they carry is the ``ConnectionOwner``'s
  (the façade), which it hands every ``Connection`` it opens.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

from aiodist import _startup
from aiodist._message import P2P_SEQ
from aiodist.errors import DistBackendError, DistError, DistNetworkError, DistTimeoutError
from aiodist.store.base import Store
from aiodist.transport._address import PeerAddress, address_key
from aiodist.transport._connection import Connection, ConnectionOwner
from aiodist.transport._ifaces import Advertised
from aiodist.transport._standing import Standing

__all__ = ["Dialer", "CONNECT_ATTEMPT_S"]

log = logging.getLogger("aiodist.transport")

_DIAL_GRACE = 0.05  # seconds a waiting receive gives its peer to connect before dialing it
CONNECT_ATTEMPT_S = 5.0  # one connect attempt's deadline (a dropped SYN would otherwise wait minutes)
_WARN_AFTER_S = 1.0  # a peer that cannot be connected to for this long gets a warning ...
_WARN_EVERY_S: float | None = None  # ... and another this often while it lasts (None: AIODIST_INIT_WARN_INTERVAL, default 10 s)


class Dialer:
    """The connections this rank sends on: ``send_conn[peer]`` (lane 0) and
    ``lane_conn[(peer, lane)]`` (lanes >= 1), made on first use (the module docstring)."""

    def __init__(
        self,
        owner: ConnectionOwner,
        standing: Standing,
        store: Store,
        timeout: float,
        advertised: Advertised,
        host_id: str,
        use_unix: bool,
        stripe_min_bytes: int,
    ) -> None:
        self.owner = owner
        self.rank = owner.rank
        self.standing = standing
        self.store = store
        self.timeout = timeout
        self.advertised = advertised
        self.lanes = len(advertised.hosts)  # one per interface named (striping when > 1)
        self.stripe_min_bytes = stripe_min_bytes
        self.striping = False  # some peer's messages are split (set once the addresses were exchanged)
        self.host_id = host_id
        self.use_unix = use_unix
        self.peers: dict[int, PeerAddress] = {}  # every rank's address, once exchange() read them
        self.send_conn: dict[int, Connection] = {}  # the one connection this rank sends to a peer on
        self.lane_conn: dict[tuple[int, int], Connection] = {}  # (peer, lane >= 1): the connection that lane sends on
        self._dialing: dict[int, asyncio.Task[Connection]] = {}
        self._lane_dialing: dict[tuple[int, int], asyncio.Task[Connection]] = {}
        self._watching: dict[int, asyncio.Task[None]] = {}
        self._ready_waiters: dict[Any, set[asyncio.Future[None]]] = {}  # peer or (peer, lane): callers waiting for a connection
        self._connected: set[Any] = set()  # peer (lane 0) or (peer, lane): a connection was ever made (either way)
        self._connect_errors: dict[Any, list[Any]] = {}  # the same keys -> [first failure, last warning, target, error]

    def splits(self, peer: int, nbytes: int, seq: int) -> bool:
        """A message of ``nbytes`` to or from ``peer`` in op ``seq`` is split across the lanes:
        a collective's (never user p2p: an any-source receive cannot know the split), big
        enough, with a striped peer. Sender and receiver decide alike."""
        return self.striping and nbytes >= self.stripe_min_bytes and seq != P2P_SEQ and self.striped(peer)

    def striped(self, peer: int) -> bool:
        """Messages to and from ``peer`` are split across the lanes: several interfaces are named,
        the addresses were exchanged, and the peer is on another host."""
        if self.lanes < 2:
            return False
        addr = self.peers.get(peer)
        return addr is not None and addr.host_id != self.host_id

    def set_peers(self, addrs: Sequence[PeerAddress]) -> None:
        """Every rank's address, as ``exchange`` read them: dials need not ask the store, and
        striping is on where some peer is striped."""
        self.peers = {a.rank: a for a in addrs}
        self.striping = any(self.striped(p) for p in self.peers)

    # -- what the façade reports ---------------------------------------------------------------

    def ready(self, conn: Connection, peer: int, lane: int) -> None:
        """``conn``'s handshake with ``peer`` on ``lane`` is done (either side dialed): the first
        one ready is the one this rank sends on."""
        k: Any = peer if lane == 0 else (peer, lane)
        self._connected.add(k)
        self._connect_errors.pop(k, None)
        if peer in self.standing.dead:
            return
        if lane:
            self.lane_conn.setdefault((peer, lane), conn)
        elif peer not in self.send_conn:
            self.send_conn[peer] = conn
        for fut in self._ready_waiters.get(k, ()):
            if not fut.done():
                fut.set_result(None)

    def dropped(self, conn: Connection, peer: int) -> None:
        """``conn`` (to ``peer``) is closed: it is no longer sent on."""
        if self.send_conn.get(peer) is conn:
            del self.send_conn[peer]
        if conn.lane and self.lane_conn.get((peer, conn.lane)) is conn:
            del self.lane_conn[(peer, conn.lane)]

    def sending(self, conn: Connection) -> bool:
        """``conn`` is the one this rank sends on (to its peer, on its lane)."""
        p = conn.peer
        return p is not None and (self.send_conn.get(p) is conn or self.lane_conn.get((p, conn.lane)) is conn)

    def stop(self) -> list[asyncio.Task[Any]]:
        """The transport closes: cancel every dial and watch in flight; returns them (to wait for)."""
        tasks: list[asyncio.Task[Any]] = [*self._dialing.values(), *self._watching.values(), *self._lane_dialing.values()]
        for t in tasks:
            t.cancel()
        return tasks

    # -- connections ---------------------------------------------------------------------------

    async def connection(self, peer: int, lane: int = 0) -> Connection:
        """The connection this rank sends to ``peer`` on (on ``lane``), dialing it if there is
        none: one dial at a time per peer and lane, shared by every caller that waits for it."""
        conns: dict[Any, Connection] = self.send_conn if lane == 0 else self.lane_conn
        dialing: dict[Any, asyncio.Task[Connection]] = self._dialing if lane == 0 else self._lane_dialing
        k: Any = peer if lane == 0 else (peer, lane)
        conn = conns.get(k)
        if conn is not None:
            return conn
        if peer in self.standing.dead:
            raise self.standing.dead[peer]
        if self.standing.closed:
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
            raise self.standing.dead.get(peer) or DistNetworkError(
                f"rank {self.rank}: connection to rank {peer}{on} closed right after the handshake"
            )
        return conn

    def want_connection(self, peer: int) -> None:
        """A receive from ``peer`` waits: make sure a connection exists soon, so that the peer's
        death fails the receive. After a short grace, since the peer's send usually dials first
        (one connection instead of two)."""
        if peer in self.send_conn or peer in self._dialing or peer in self.standing.dead or self.standing.closed or peer in self._watching:
            return
        task = self._watching[peer] = asyncio.get_running_loop().create_task(self._watch(peer))
        task.add_done_callback(functools.partial(self._watch_done, peer))

    async def _watch(self, peer: int) -> None:
        await asyncio.sleep(_DIAL_GRACE)
        if peer in self.send_conn or peer in self.standing.dead or self.standing.closed:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self.connection(peer)
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
                addr = self.peers.get(peer)
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
                f"rank {self.rank}: could not connect to rank {peer} within {self.timeout:g} s{self.never(peer)}"
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
        owner = self.owner
        same_host = addr.host_id == self.host_id
        delay = 0.005
        while True:
            try:
                if self.use_unix and same_host and addr.unix is not None and lane == 0:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        sock.setblocking(False)
                        sock.connect(addr.unix)  # abstract sockets connect at once or refuse at once
                    except OSError:
                        sock.close()
                        raise
                    _, uconn = await loop.create_unix_connection(lambda: Connection(owner, "unix", addr.rank), sock=sock)
                    return uconn
                host = "127.0.0.1" if same_host else addr.lanes[lane]
                local = (self.advertised.hosts[lane], 0) if self.advertised.bind and not same_host else None
                async with asyncio.timeout(CONNECT_ATTEMPT_S):
                    _, tconn = await loop.create_connection(
                        lambda: Connection(owner, "tcp", addr.rank, lane), host, addr.port, local_addr=local
                    )
                return tconn
            except (OSError, TimeoutError) as exc:
                if (self.send_conn.get(addr.rank) if lane == 0 else self.lane_conn.get((addr.rank, lane))) is not None:
                    raise DistNetworkError(f"rank {self.rank}: stopped dialing rank {addr.rank}: its own connection came first") from None
                why = str(exc) if isinstance(exc, OSError) else f"no answer within {CONNECT_ATTEMPT_S:g} s"
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

    def never(self, peer: int) -> str:
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

    def report(self, peers: Sequence[int]) -> str:
        """For a timeout message: the peers among ``peers`` never connected to, with the address
        tried and the last error (empty when every one was connected at some point)."""
        return "".join(self.never(p) for p in sorted(set(peers)) if p != self.rank)
