"""``Lines``: sending, the per-peer send lines and striping across lanes.

Rules this module keeps:
- ``send`` returns once the whole frame is in the kernel's socket buffer (or, to self, copied
  by the inbox): the array may then be changed. A send to self never touches a socket.
- Sends to one peer are written in the order they were called (their first steps' order): a
  send that must wait, for a connection or for a paused one to resume, waits in that peer's
  line (one FIFO lock per peer, and per (peer, lane)), and a later send never overtakes a
  waiting one. That order is what p2p's non-overtaking matching relies on.
- A send never writes to a paused connection (one with bytes still buffered): it waits in line
  for it to resume, so at most one frame's remainder is buffered per connection (asyncio's loop
  copies what it buffers). The fast path (connected, not paused, nobody in line) writes in
  the caller's step without arming a deadline; every other send is bounded by the timeout.
- Striping: a collective's message of ``stripe_min_bytes`` or more to or from a peer on
  another host, where several interfaces are named, is split into one part per lane
  (``aiodist.transport._striping``: equal, 64-byte aligned), part j under tag ``tag + (j + 1) << 40``; sender
  and receiver decide alike from the size (``Dialer.splits``, which knows the peers' hosts).
  User p2p (``P2P_SEQ``) is never split: an any-source receive could not know the split.
- The connections come from the ``Dialer`` (its ``send_conn``/``lane_conn`` tables are read
  directly on the fast path); a lost peer or a broken group is the ``Standing``'s word.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import numpy as np

from aiodist._message import byte_view
from aiodist.errors import DistNetworkError, DistTimeoutError
from aiodist.transport._connection import Connection
from aiodist.transport._dialer import Dialer
from aiodist.transport._mailbox import Key, describe_key
from aiodist.transport._standing import Standing
from aiodist.transport._striping import STRIPE_TAG, check_rank, retrieve, run_parts, stripe_parts
from aiodist.wire.frame import FrameHeader, FrameKind, FrameLimits

__all__ = ["Lines", "SelfDelivery"]

NOWAIT_MAX_BYTES = 64 * 1024  # send_nowait only tries messages this small (the kernel takes them at once)


class SelfDelivery(Protocol):
    """What a send to this rank asks of the receiving side (the transport's ``Inbox``)."""

    def deliver_self(self, key: Key, view: np.ndarray) -> None: ...


class Lines:
    """This rank's sends (the module docstring). ``inbox`` takes the sends to self."""

    def __init__(
        self, dialer: Dialer, standing: Standing, inbox: SelfDelivery, world_size: int, timeout: float, limits: FrameLimits
    ) -> None:
        self.rank = dialer.rank
        self.world_size = world_size
        self.timeout = timeout
        self.limits = limits
        self.lanes = dialer.lanes
        self._dialer = dialer
        self._standing = standing
        self._inbox = inbox
        self._send_conn = dialer.send_conn  # the dialer's tables, read on the fast path
        self._lane_conn = dialer.lane_conn
        self._order: dict[Any, asyncio.Lock] = {}  # per peer (or (peer, lane)): sends waiting for the connection, in call order
        self._queued: dict[Any, int] = {}  # per peer (or (peer, lane)): how many sends wait in that line

    async def send(self, dst: int, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0, digest: int = 0) -> None:
        """``Transport.send``: the bytes of ``buf`` to global rank ``dst`` as message
        ``(group, seq, tag)``, returning once they are in the kernel (or copied, to self)."""
        view = byte_view(buf)
        check_rank(self.rank, dst, self.world_size)
        key = (group, seq, tag)
        self._standing.usable(key, dst)
        if view.nbytes > self.limits.max_payload_bytes:
            raise ValueError(
                f"rank {self.rank}: a {view.nbytes}-byte message ({describe_key(key)}) is over the limit of "
                f"{self.limits.max_payload_bytes} bytes per message (FrameLimits.max_payload_bytes): split it"
            )
        if dst == self.rank:
            self._inbox.deliver_self(key, view)
            return
        if self._dialer.splits(dst, view.nbytes, seq):
            parts = stripe_parts(view.nbytes, self.lanes)
            await run_parts(
                [self._send_lane(dst, j, view[a:b], (group, seq, tag + (j + 1) * STRIPE_TAG), digest) for j, (a, b) in enumerate(parts)]
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
                f"rank {self.rank}: send to rank {dst} ({describe_key(key)}{on}, {view.nbytes} bytes) did not complete in {self.timeout:g} s{self._dialer.never(dst)}"
            ) from None
        except DistNetworkError as exc:
            raise DistNetworkError(f"{exc} (during a send to rank {dst}, {describe_key(key)}{on})", culprits=exc.culprits) from exc
        if group in self._standing.aborted:
            raise self._standing.abort_error(group)

    def _write(self, conn: Connection, header: FrameHeader, view: np.ndarray, key: Key, dst: int) -> asyncio.Future[None] | None:
        try:
            drained = conn.write_frame(header, view, key[0])
        except DistNetworkError as exc:
            raise DistNetworkError(f"{exc} (during a send to rank {dst}, {describe_key(key)})", culprits=exc.culprits) from exc
        if drained is None and key[0] in self._standing.aborted:
            raise self._standing.abort_error(key[0])
        return drained

    def send_nowait(
        self, dst: int, buf: np.ndarray, *, group: int = 0, seq: int = 0, tag: int = 0, digest: int = 0
    ) -> bool | asyncio.Future[None]:
        """``Transport.send_nowait``: ``send`` where it can be done without waiting (False:
        nothing sent; True: sent; a future: written, to await before changing ``buf``)."""
        view = byte_view(buf)
        check_rank(self.rank, dst, self.world_size)
        key = (group, seq, tag)
        self._standing.usable(key, dst)
        if dst == self.rank or view.nbytes > min(self.limits.max_payload_bytes, NOWAIT_MAX_BYTES):
            return False
        if self._dialer.splits(dst, view.nbytes, seq):
            return False  # its receiver expects the parts: send() splits it
        conn = self._send_conn.get(dst)
        if conn is None or self._queued.get(dst) or not conn.can_write_now():
            return False
        header = FrameHeader(FrameKind.DATA, group, seq, tag, self.rank, view.nbytes, 0, digest)
        drained = self._write(conn, header, view, key, dst)
        if drained is None:
            return True
        drained.add_done_callback(retrieve)  # awaited by the caller, unless its receive failed first
        return drained

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
                conn = await self._dialer.connection(peer, lane)
                while (resumed := conn.writable(group)) is not None:
                    await resumed
                return conn
        finally:
            self._queued[k] -= 1
