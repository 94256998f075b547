"""The in-memory backend ("memory"): every rank of a world in one process, on one event loop,
over ``aiodist.algorithms.p2p.LocalP2P`` channels. For tests (``aiodist.testing.run_world``)
and for trying programs without a network.

The ranks find each other through the store they were initialised with: each rank offers a
fresh hub under a random id with ``compare_set`` on
one key; the first offer wins and every rank uses that hub (held in a process-wide table until
every rank has joined). So it works with any store the
ranks share *within one process* (HashStore, or a TCPStore served in this process); across
processes the hub id is unknown there and init fails with a clear error.

Point-to-point messages go through one ``aiodist.transport.Mailbox`` per rank (the socket
transport's matching table, so the matching rules are the same): a send completes at once, its bytes copied into
the receive's buffer, or staged (a copy, without a bound) until the receive is posted.
"""

from __future__ import annotations

import asyncio
import secrets
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from aiodist.algorithms.p2p import LocalP2P, LocalWorld, byte_view
from aiodist.backends.base import P2P_SEQ, CommBackend
from aiodist.errors import DistBackendError
from aiodist.store.base import Store
from aiodist.transport import Mailbox, PostedRecv, StagedMessage, describe_key

__all__ = ["MemoryBackend", "MemoryHub", "create_memory_backend"]

#: hubs by id until every rank has joined (the table is how ranks in one process meet); a hub
#: some rank never joins stays until the process ends
_HUBS: dict[str, MemoryHub] = {}
_HUB_KEY = "aiodist/memory_backend/hub"


class MemoryHub:
    """The shared state of one in-memory world: a ``LocalWorld`` per open channel."""

    def __init__(self, world_size: int, capacity: int = 8) -> None:
        self.world_size = world_size
        self.capacity = capacity
        self.joined = 0
        self._open: dict[tuple[int, int, tuple[int, ...]], tuple[LocalWorld, int]] = {}
        self.mailboxes = [Mailbox() for _ in range(world_size)]
        self._by_group: dict[int, weakref.WeakSet[LocalWorld]] = {}
        self.aborted: dict[int, str] = {}
        self.blamed: dict[int, dict[int, str]] = {}  # the ranks a group's break names (the first naming stays)

    def abort(self, group_id: int, reason: str, culprits: dict[int, str] | None = None) -> None:
        """Fail every pending and later send/receive of ``group_id`` on every rank, naming
        ``culprits`` (global rank -> what it did) as the break's first naming did."""
        self.aborted.setdefault(group_id, reason)
        if culprits:
            self.blamed.setdefault(group_id, culprits)
        named = self.blamed.get(group_id)
        for w in list(self._by_group.get(group_id, ())):
            w.abort(DistBackendError(reason, culprits=named))
        for box in self.mailboxes:
            box.drop_staged(lambda k, m: k[0] == group_id)
            for r in box.remove_posted(lambda r: r.key[0] == group_id):
                if not r.fut.done():
                    r.fut.set_exception(DistBackendError(f"{reason} ({describe_key(r.key)})", culprits=named))

    def channel(self, rank: int, group_id: int, seq: int, global_ranks: Sequence[int]) -> LocalP2P:
        ranks = tuple(global_ranks)
        key = (group_id, seq, ranks)
        world, taken = self._open.get(key, (None, 0))
        if world is None:
            world = LocalWorld(len(ranks), self.capacity)
            self._by_group.setdefault(group_id, weakref.WeakSet()).add(world)
            if group_id in self.aborted:
                world.abort(DistBackendError(self.aborted[group_id], culprits=self.blamed.get(group_id)))
        taken += 1
        if taken >= len(ranks):
            self._open.pop(key, None)  # every end is out: the LocalP2Ps keep the world alive
        else:
            self._open[key] = (world, taken)
        return LocalP2P(world, ranks.index(rank))

    def open_channels(self) -> int:
        """Channels some rank opened and another has not yet: 0 when every op was joined."""
        return len(self._open)


class MemoryBackend(CommBackend):
    name = "memory"

    def __init__(self, hub: MemoryHub, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.hub = hub

    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0, call: Any = None) -> LocalP2P:
        if self.rank not in global_ranks:
            raise ValueError(f"rank {self.rank} opened a channel of group {group_id} it is not a member of ({list(global_ranks)})")
        return self.hub.channel(self.rank, group_id, seq, global_ranks)

    async def abort_group(self, group_id: int, reason: str, ranks: Sequence[int] = (), culprits: dict[int, str] | None = None) -> None:
        self.hub.abort(group_id, reason, culprits)

    async def p2p_send(self, group_id: int, dst: int, buf: np.ndarray, tag: int) -> None:
        if group_id in self.hub.aborted:
            raise DistBackendError(self.hub.aborted[group_id], culprits=self.hub.blamed.get(group_id))
        view = byte_view(buf)
        key = (group_id, P2P_SEQ, tag)
        box = self.hub.mailboxes[dst]
        recv = box.match(key, self.rank)
        if recv is None:
            box.stage(key, StagedMessage(self.rank, memoryview(view.tobytes())))
            return
        recv.fill(view, self.rank, dst)

    async def p2p_recv(self, group_id: int, src: int | None, buf: np.ndarray, tag: int) -> int:
        if group_id in self.hub.aborted:
            raise DistBackendError(self.hub.aborted[group_id], culprits=self.hub.blamed.get(group_id))
        dst = byte_view(buf, writable=True)
        key = (group_id, P2P_SEQ, tag)
        box = self.hub.mailboxes[self.rank]
        m = box.take_staged(key, src)
        if m is not None:
            return m.consume(dst, key, self.rank)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        recv = PostedRecv(key, src, dst, fut)
        box.post(recv)
        try:
            return await fut
        finally:
            box.unpost(recv)


async def create_memory_backend(store: Store, rank: int, world_size: int, timeout: timedelta) -> MemoryBackend:
    """The "memory" backend's creator, as ``Backend.register_backend`` takes it."""
    offer = MemoryHub(world_size)
    offer_id = secrets.token_hex(8)
    _HUBS[offer_id] = offer
    won = ""
    try:
        won = (await store.compare_set(_HUB_KEY, "", offer_id)).decode()
    finally:
        if won != offer_id:  # lost (or failed): withdraw the offer
            del _HUBS[offer_id]
    hub = _HUBS.get(won)
    if hub is None:
        raise DistBackendError(
            f"memory backend: rank {rank} cannot find hub {won!r} in this process; the in-memory backend "
            f"only joins ranks of one process (use a store that is fresh for this world)"
        )
    if hub.world_size != world_size:
        raise DistBackendError(f"memory backend: rank {rank} has world_size {world_size}, the hub was made for {hub.world_size}")
    hub.joined += 1
    if hub.joined >= world_size:
        del _HUBS[won]
    return MemoryBackend(hub, rank, world_size)
