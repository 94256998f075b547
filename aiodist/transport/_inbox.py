"""``Inbox``: receiving. Which posted receive an arriving payload meets, the messages that come
before their receive (staged), the sends to self, and the receives themselves.

Rules this module keeps:
- Matching key: ``(group, seq, tag)`` plus the source rank (or any source); the rule is the
  ``Mailbox``'s (earliest posted receive that accepts the source, earliest staged message a
  receive accepts) and the fate of an arriving payload is ``_landing.decide``'s. The inbox
  carries the fate out: LAND claims the receive (the connection reads the payload into its
  array, zero-copy; a payload read already is copied once), STAGE keeps the bytes until the
  receive is posted, HOLD and GRACE remember the connection (reading paused) until a receive is
  posted or a group is aborted (``room_freed``: every held connection retries, soon, never
  from inside a decoder step), MISMATCH fails the receive with ``size_error``, DESYNC hands
  the frame to the façade's desync (the group breaks on every rank), DROP does nothing.
- Staging is bounded per connection by ``FrameLimits.max_staged_bytes`` (the connection's
  decoder counts it and gets the bytes back through ``release_staged``). A send to self has no
  socket to push back on: one that would hold more than that many unclaimed bytes raises
  ``DistBackendError`` at once (post the receive first); under it the bytes are copied once,
  into the posted receive or into a staged copy (the sender may change its array at once).
- A receive takes a staged message first (a peer that left may have sent it before leaving);
  else a receive from a lost peer whose last connection closed fails at once; else it is
  posted and waits, bounded by the timeout, while the dialer makes sure a connection to its
  peer exists (so that peer's death fails it). A payload already being read into its array
  keeps landing there after a timeout or a cancellation: the op is broken then.
- Nothing here opens, reads or writes a socket: the connections call ``on_header`` and
  ``on_payload`` (the two per-frame calls of their ``ConnectionOwner``, bound straight to this
  object), and tests/test_transport_inbox.py drives it as a table with no socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

from aiodist._message import P2P_SEQ, byte_view
from aiodist.errors import DistBackendError, DistTimeoutError
from aiodist.transport._digests import DigestBook
from aiodist.transport._landing import DESYNC, GRACE, HOLD, LAND, MISMATCH, STAGE, Landing, decide
from aiodist.transport._mailbox import Key, Mailbox, PostedRecv, StagedMessage, describe_key, size_error
from aiodist.transport._standing import Standing
from aiodist.transport._striping import STRIPE_TAG, check_rank, run_parts, stripe_parts
from aiodist.wire.frame import FrameHeader, FrameLimits

__all__ = ["Inbox", "Reader", "Route"]


class Reader(Protocol):
    """What the inbox needs of a connection that hands it frames."""

    @property
    def peer(self) -> int | None: ...

    def release_staged(self, nbytes: int) -> None:
        """The inbox is done with ``nbytes`` of a payload it was handed (staging room back)."""

    def retry_held(self) -> None:
        """A receive was posted or a group aborted: see whether the held payload has a place now."""


class Route(Protocol):
    """What the inbox needs of the dialer (``aiodist.transport._dialer.Dialer``)."""

    striping: bool
    stripe_min_bytes: int
    lanes: int

    def splits(self, peer: int, nbytes: int, seq: int) -> bool: ...

    def want_connection(self, peer: int) -> None: ...

    def report(self, peers: Sequence[int]) -> str: ...


#: the façade's desync: ``(group, seq, peer, its digest, its message's length)``
Desync = Callable[[int, int, int, int, int], None]


class Inbox:
    """This rank's receiving side (the module docstring). ``conns`` are the open connections
    (a lost peer's receive fails at once only when none of them is its)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        limits: FrameLimits,
        standing: Standing,
        book: DigestBook,
        route: Route,
        desync: Desync,
        conns: Iterable[Reader] = (),
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.limits = limits
        self.mailbox = Mailbox()
        self.held: set[Reader] = set()  # connections holding a DATA header (reading paused)
        self.staged_total = 0  # messages ever staged (came before their receive)
        self._standing = standing
        self._book = book
        self._route = route
        self._desync = desync
        self._conns = conns
        self._self_staged = 0
        self._retry_soon = False

    # -- arriving frames (the connections' per-frame calls) ------------------------------------

    def on_header(self, conn: Reader, header: FrameHeader, staged_bytes: int, grace_over: bool) -> Landing:
        """``ConnectionOwner.on_header``: the fate of DATA ``header``'s payload, with its effects."""
        aborted = self._standing.aborted
        check = header.digest and header.group not in aborted
        digest = self._book.own(header.group, header.seq, header.digest, header.source, header.length) if check else None
        d = decide(header, self.mailbox, self.limits, staged_bytes, False, grace_over, aborted, digest)  # by position: see decide
        fate, recv = d
        if fate is HOLD or fate is GRACE:
            self.held.add(conn)
            return d
        if self.held:
            self.held.discard(conn)
        if fate is LAND:
            assert recv is not None
            self.mailbox.claim(recv)
        elif fate is not STAGE:
            self._land_elsewhere(d, header)
        return d

    def on_payload(self, conn: Reader, header: FrameHeader, data: memoryview) -> None:
        """``ConnectionOwner.on_payload``: a whole payload that no receive claimed when its header
        came (or a zero-length one, which comes without a header event): a receive may have been
        posted meanwhile."""
        aborted = self._standing.aborted
        check = header.digest and not data.nbytes and header.group not in aborted  # a longer one was checked at its header
        digest = self._book.own(header.group, header.seq, header.digest, header.source, header.length) if check else None
        fate, recv = decide(header, self.mailbox, self.limits, 0, True, False, aborted, digest)  # in memory, by position
        if fate is STAGE:
            self.staged_total += 1
            key = (header.group, header.seq, header.tag)
            self.mailbox.stage(key, StagedMessage(header.source, data, conn.release_staged))
            return
        try:
            if fate is LAND:
                assert recv is not None
                self.mailbox.claim(recv)
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
            self.mailbox.claim(recv)
            if not recv.fut.done():
                recv.fut.set_exception(size_error(self.rank, header.source, recv.key, header.length, recv.dst.nbytes))
        elif fate is DESYNC:
            self._desync(header.group, header.seq, header.source, header.digest, header.length)

    def room_freed(self) -> None:
        """A receive was posted or a group aborted: soon, let every connection holding a payload
        try again (soon, not now: never from inside a decoder step). Staged bytes released
        retry only their own connection (``Connection.release_staged``)."""
        if self.held and not self._retry_soon:
            self._retry_soon = True
            asyncio.get_running_loop().call_soon(self._retry_held)

    def _retry_held(self) -> None:
        self._retry_soon = False
        for c in list(self.held):
            c.retry_held()

    # -- sends to self -------------------------------------------------------------------------

    def deliver_self(self, key: Key, view: np.ndarray) -> None:
        """A send to this rank: into the posted receive, else a staged copy (bounded)."""
        recv = self.mailbox.match(key, self.rank)
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
        self.mailbox.stage(key, StagedMessage(self.rank, memoryview(view.tobytes()), self._release_self))

    def _release_self(self, n: int) -> None:
        self._self_staged -= n

    # -- receives ------------------------------------------------------------------------------

    async def recv(self, src: int | None, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0) -> int:
        """``Transport.recv``: message ``(group, seq, tag)`` from global rank ``src`` (None: any)
        into ``buf``, which it must fill exactly; returns the source rank."""
        dst = byte_view(buf, writable=True)
        key = (group, seq, tag)
        if src is not None:
            check_rank(self.rank, src, self.world_size)
        self._standing.usable(key, None)
        route = self._route
        if src is None and route.striping and dst.nbytes >= route.stripe_min_bytes and seq != P2P_SEQ:
            raise ValueError(
                f"rank {self.rank}: an any-source receive of a {dst.nbytes}-byte collective message ({describe_key(key)}) cannot be "
                f"matched while messages from {route.stripe_min_bytes} bytes are split across interfaces: name the source"
            )
        if src is not None and route.splits(src, dst.nbytes, seq):
            parts = stripe_parts(dst.nbytes, route.lanes)
            await run_parts([self._recv_one(src, dst[a:b], (group, seq, tag + (j + 1) * STRIPE_TAG)) for j, (a, b) in enumerate(parts)])
            return src
        return await self._recv_one(src, dst, key)

    async def _recv_one(self, src: int | None, dst: np.ndarray, key: Key) -> int:
        m = self.mailbox.take_staged(key, src)  # a peer that left may have sent it before leaving
        if m is not None:
            return m.consume(dst, key, self.rank)
        if src is not None:
            if self._gone(src):
                raise self._standing.dead_error(src)
            if src != self.rank:
                self._route.want_connection(src)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        recv = PostedRecv(key, src, dst, fut)
        self.mailbox.post(recv)
        if self.held:
            self.room_freed()  # a held payload may be this receive's
        try:
            async with asyncio.timeout(self.timeout):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return fut.result()
            never = self._route.report([src] if src is not None else range(self.world_size))
            raise DistTimeoutError(f"rank {self.rank}: {recv.what()} not complete after {self.timeout:g} s{never}") from None
        finally:
            # A payload already being read into ``buf`` keeps landing there after a timeout or a
            # cancellation: the op is broken then, and ``buf`` holds undefined bytes.
            self.mailbox.unpost(recv)
            if not fut.done():
                fut.cancel()

    def _gone(self, peer: int) -> bool:
        """Nothing more can come from ``peer``: it died or left, and its last connection closed."""
        return peer in self._standing.dead and not any(c.peer == peer for c in self._conns)

    # -- failure -------------------------------------------------------------------------------

    def fail(self, which: Callable[[PostedRecv], bool], error: Callable[[PostedRecv], BaseException]) -> None:
        """Fail (and withdraw) the posted receives ``which`` selects, each with ``error(it)``."""
        for r in self.mailbox.remove_posted(which):
            if not r.fut.done():
                r.fut.set_exception(error(r))
