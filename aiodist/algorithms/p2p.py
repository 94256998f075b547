"""The two-method point-to-point interface the collective algorithms are written over, and
``LocalP2P``, an in-memory implementation for tests.

The contract a ``P2P`` keeps (a backend's transport implements it; ``LocalP2P`` checks it):
- One ``P2P`` object is bound to ONE op of one group. The caller makes a fresh one per op, so
  the messages of different ops, even ops in flight at once, never meet.
- A message is matched by ``(peer, tag)``. Tags are the algorithm's own (step and piece
  indices), ``0 <= tag < TAG_LIMIT`` (``SubP2P`` moves a sub-op's above it, below
  ``CHANNEL_TAG_LIMIT``), unique per (peer, direction) within the op; a message
  may arrive before its receive is posted (the transport stages it, within a bound).
- ``send(peer, buf, tag)``: ``buf`` is a C-contiguous array read as raw bytes. It may return as
  soon as the data is handed to the transport (written or copied); until it returns the
  caller must not change ``buf``, afterwards it may.
- ``recv(peer, buf, tag)`` fills ``buf`` exactly: the message must be exactly ``buf.nbytes``
  long, else ValueError. Zero-length messages exist and are delivered (a barrier is made of
  them); the algorithms skip messages both ends know to be empty.
- ``peer`` is another rank of the group, never this one (the algorithms copy locally).
- A send can wait for its receive to be posted (flow control), so the algorithms keep every
  send concurrent with the receives it might wait on: any transport that eventually moves a
  message once its receive is posted runs them without deadlock.
- Cancelling a ``send``/``recv`` abandons it; the op is then broken and its P2P is dropped.
- ``send_nowait(peer, buf, tag)`` is a declared capability: do the send at once where that
  needs no waiting and return True (done) or a future (written, still draining: await it before
  changing ``buf``); return False where it cannot, and nothing is sent (then use ``send``).
  A P2P without a fast path returns False always (``LocalP2P``, ``SubP2P``'s inner may differ).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque

import numpy as np

from aiodist._message import CHANNEL_TAG_LIMIT, P2P, TAG_LIMIT, byte_view  # re-exported: they live below the transport

__all__ = ["P2P", "TAG_LIMIT", "CHANNEL_TAG_LIMIT", "SubP2P", "LocalP2P", "LocalWorld", "local_world", "byte_view"]

_SUB_OPS = CHANNEL_TAG_LIMIT // TAG_LIMIT - 2  # the last block is GO_TAG's (aiodist._message)


class SubP2P:
    """Sub-op ``index`` of an op that runs several algorithms one after another on one P2P (e.g.
    ``all_reduce_coalesced`` with one buffer per dtype): the same peers, its tags moved above
    every algorithm tag, so its messages never meet another sub-op's."""

    __slots__ = ("_p2p", "_base")

    def __init__(self, p2p: P2P, index: int) -> None:
        if not 0 <= index < _SUB_OPS:
            raise ValueError(f"sub-op index {index} is outside [0, {_SUB_OPS})")
        self._p2p = p2p
        self._base = (index + 1) * TAG_LIMIT

    @property
    def rank(self) -> int:
        return self._p2p.rank

    @property
    def size(self) -> int:
        return self._p2p.size

    def _tag(self, tag: int) -> int:
        if not isinstance(tag, int) or not 0 <= tag < TAG_LIMIT:
            raise ValueError(f"tag {tag!r} is outside [0, 2**31)")
        return self._base + tag

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._p2p.send(peer, buf, self._tag(tag))

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self._p2p.recv(peer, buf, self._tag(tag))

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        return self._p2p.send_nowait(peer, buf, self._tag(tag))


class _Channel:
    """Messages from one rank to another: posted receives and messages staged before them."""

    __slots__ = ("staged", "posted", "waiting", "used")

    def __init__(self) -> None:
        self.staged: dict[int, bytes] = {}
        self.posted: dict[int, tuple[asyncio.Future[bytes], int]] = {}
        # senders blocked for room (or for their receive to be posted); woken on every change
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.used: set[int] = set()

    def wake(self) -> None:
        while self.waiting:
            w = self.waiting.popleft()
            if not w.done():
                w.set_result(None)


class LocalWorld:
    """The shared state of one op's ``LocalP2P`` ranks, on one event loop.

    Bounded like a real transport: at most ``capacity`` messages per ordered pair of ranks may
    be staged (sent, not yet received); a further send waits until one is received or its own
    receive is posted. ``capacity=0`` is a rendezvous: every send waits for its receive, the
    strictest test that a schedule cannot deadlock. Data is copied when it is handed over (at
    staging or delivery), not when ``send`` is called, so a schedule that changes a buffer
    while its send is pending delivers the wrong bytes and fails its test.
    ``seed`` adds a random number (0-2) of event-loop turns before each send and receive, to
    shake out interleavings; None adds none.
    """

    def __init__(self, size: int, capacity: int = 8, seed: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.size = size
        self.capacity = capacity
        self._rng = random.Random(seed) if seed is not None else None
        self._channels: dict[tuple[int, int], _Channel] = {}
        self.aborted: BaseException | None = None

    def abort(self, err: BaseException) -> None:
        """Fail every send and receive of this op that waits, and every later one, with ``err``."""
        if self.aborted is None:
            self.aborted = err
        for ch in self._channels.values():
            for fut, _ in ch.posted.values():
                if not fut.done():
                    fut.set_exception(err)
            ch.posted.clear()
            ch.wake()

    def channel(self, src: int, dst: int) -> _Channel:
        ch = self._channels.get((src, dst))
        if ch is None:
            ch = self._channels[(src, dst)] = _Channel()
        return ch

    def unmatched(self) -> list[tuple[int, int, int]]:
        """``(src, dst, tag)`` of every message staged or receive posted and not yet matched:
        empty once an op has completed on every rank."""
        out = []
        for (src, dst), ch in sorted(self._channels.items()):
            out += [(src, dst, t) for t in sorted(ch.staged)]
            out += [(src, dst, t) for t in sorted(ch.posted)]
        return out

    async def jitter(self) -> None:
        if self._rng is not None:
            for _ in range(self._rng.randrange(3)):
                await asyncio.sleep(0)


class LocalP2P:
    """One rank's end of a ``LocalWorld``; counts what it sends."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.sent_messages = 0
        self.sent_bytes = 0

    def __repr__(self) -> str:
        return f"LocalP2P(rank={self.rank}, size={self.size})"

    def _check(self, peer: int, tag: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: peer {peer!r} is not another rank of a group of {self.size}")
        if not isinstance(tag, int) or not 0 <= tag < CHANNEL_TAG_LIMIT:
            raise ValueError(f"rank {self.rank}: tag {tag!r} is outside [0, 2**36)")

    def _what(self, src: int, dst: int, tag: int) -> str:
        return f"message from rank {src} to rank {dst} with tag {tag}"

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool:
        """Not supported: every send goes through ``send`` (its staging and jitter are the test)."""
        return False

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        self._check(peer, tag)
        src = byte_view(buf)
        ch = self.world.channel(self.rank, peer)
        if tag in ch.used:
            raise ValueError(f"{self._what(self.rank, peer, tag)} sent twice in one op")
        ch.used.add(tag)
        await self.world.jitter()
        while True:
            if self.world.aborted is not None:
                raise self.world.aborted
            posted = ch.posted.pop(tag, None)
            if posted is not None:
                fut, nbytes = posted
                if fut.done():  # its receiver was cancelled
                    continue
                if nbytes != src.nbytes:
                    err = ValueError(f"{self._what(self.rank, peer, tag)} is {src.nbytes} bytes, the receive buffer {nbytes}")
                    fut.set_exception(err)
                    raise err
                fut.set_result(src.tobytes())
                break
            if len(ch.staged) < self.world.capacity:
                ch.staged[tag] = src.tobytes()
                break
            w = asyncio.get_running_loop().create_future()
            ch.waiting.append(w)
            await w
        self.sent_messages += 1
        self.sent_bytes += src.nbytes

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        self._check(peer, tag)
        dst = byte_view(buf, writable=True)
        ch = self.world.channel(peer, self.rank)
        if tag in ch.posted:
            raise ValueError(f"{self._what(peer, self.rank, tag)} received twice at once")
        await self.world.jitter()
        if self.world.aborted is not None:
            raise self.world.aborted
        data = ch.staged.pop(tag, None)
        if data is not None:
            ch.wake()  # room for a blocked sender
        else:
            fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            ch.posted[tag] = (fut, dst.nbytes)
            ch.wake()  # a sender may be blocked on exactly this receive
            try:
                data = await fut
            except asyncio.CancelledError:
                if ch.posted.get(tag, (None,))[0] is fut:
                    del ch.posted[tag]
                elif fut.done() and not fut.cancelled() and fut.exception() is None:
                    ch.staged[tag] = fut.result()  # delivered as we were cancelled: keep it for a retry
                raise
        if len(data) != dst.nbytes:
            raise ValueError(f"{self._what(peer, self.rank, tag)} is {len(data)} bytes, the receive buffer {dst.nbytes}")
        dst[:] = np.frombuffer(data, dtype=np.uint8)


def local_world(size: int, *, capacity: int = 8, seed: int | None = None) -> list[LocalP2P]:
    """``size`` connected ``LocalP2P`` ranks for one op (see ``LocalWorld`` for the arguments)."""
    world = LocalWorld(size, capacity, seed)
    return [LocalP2P(world, r) for r in range(size)]
