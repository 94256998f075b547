"""The CPU socket backend ("aio", alias "gloo"): ``aiodist.transport.Transport`` as a channel
factory. Imported lazily, so aiodist still imports while the transport is absent; then the
creator refuses with a DistBackendError that says so.

The job token (checked in every connection's handshake, so two jobs on one host never cross)
is agreed through the store: every rank offers a random one with ``compare_set`` on one key
and the first offer wins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from aiodist.algorithms.hier import layout_of
from aiodist.algorithms.p2p import P2P
from aiodist.backends.base import P2P_SEQ, CommBackend
from aiodist.errors import DistBackendError
from aiodist.store.base import Store

__all__ = ["AioBackend", "create_aio_backend", "transport_available"]

_TOKEN_KEY = "aiodist/aio_backend/token"

log = logging.getLogger("aiodist.transport")


def rendezvous_host(store: Store) -> str | None:
    """The host the job's store lives on (through PrefixStores), or MASTER_ADDR; None for a
    store with no host (FileStore, HashStore) and no MASTER_ADDR."""
    seen = 0
    while seen < 32:  # PrefixStore chains; a bound against a cycle
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store, seen = inner, seen + 1
    host = getattr(store, "host", None)
    if isinstance(host, str) and host:
        return host
    return os.environ.get("MASTER_ADDR") or None


def transport_available() -> bool:
    try:
        import aiodist.transport  # noqa: F401
    except ImportError:
        return False
    return True


class AioBackend(CommBackend):
    name = "aio"

    def __init__(self, transport: Any, rank: int, world_size: int, shm: Any = None, hosts: Sequence[str] = ()) -> None:
        super().__init__(rank, world_size)
        self.transport = transport
        #: same-host shared memory (aiodist.shm.SharedMemory); the collectives take its tickets
        self.shm = shm
        #: each global rank's host identity (what it published at start), read once at init
        self.hosts = tuple(hosts)
        self._layouts: dict[tuple[int, ...], Any] = {}

    def layout(self, ranks: Sequence[int]) -> Any:
        key = ranks if type(ranks) is tuple else tuple(ranks)
        try:
            return self._layouts[key]
        except KeyError:
            pass
        got = layout_of([self.hosts[r] for r in key]) if self.hosts else None
        if len(self._layouts) < 256:  # a group's ranks: one entry per group in practice
            self._layouts[key] = got
        return got

    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0, call: Any = None) -> P2P:
        ch: P2P = self.transport.channel(group_id, seq, global_ranks, digest, call)
        return ch

    carries_digests = True  # the transport checks each collective frame's digest (aiodist._digest)

    async def p2p_send(self, group_id: int, dst: int, buf: np.ndarray, tag: int) -> None:
        await self.transport.lines.send(dst, buf, group=group_id, seq=P2P_SEQ, tag=tag)  # the per-message path: no hop through the façade

    async def p2p_recv(self, group_id: int, src: int | None, buf: np.ndarray, tag: int) -> int:
        src_rank: int = await self.transport.inbox.recv(src, buf, group=group_id, seq=P2P_SEQ, tag=tag)
        return src_rank

    async def connect(self) -> None:
        await self.transport.connect()

    async def abort_group(self, group_id: int, reason: str, ranks: Sequence[int] = (), culprits: dict[int, str] | None = None) -> None:
        await self.transport.abort(group_id, reason, ranks, culprits)

    async def release_group(self, group_id: int) -> None:
        self.transport.release_group(group_id)
        if self.shm is not None:
            self.shm.release_group(group_id)

    def address_info(self) -> dict[str, Any]:
        """Where this rank's peers reach it: the address, the lanes (one per interface named),
        the interfaces and why that address was chosen (docs/multi_host.md)."""
        st = self.transport.stats()
        return {k: st[k] for k in ("address", "lanes", "interfaces", "advertised_because")}

    def connection_report(self, peers: Sequence[int]) -> str:
        report: str = self.transport.connection_report(peers)
        return report

    async def close(self) -> None:
        await self.transport.close()
        if self.shm is not None:
            await self.shm.close()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["transport"] = self.transport.stats()
        if self.shm is not None:
            out["shm"] = self.shm.stats()
        return out


_TRANSPORT_BACKSTOP_S = 7 * 24 * 3600.0


async def create_aio_backend(store: Store, rank: int, world_size: int, timeout: timedelta) -> AioBackend:
    """The "aio" backend's creator, as ``Backend.register_backend`` takes it."""
    try:
        from aiodist.shm import SharedMemory
        from aiodist.transport import Transport, host_id
        from aiodist.transport._ifaces import choose
    except ImportError as exc:
        raise DistBackendError(
            "the CPU socket backend ('aio', alias 'gloo') is not wired yet: aiodist.transport is not available "
            f"({exc}). Use backend='memory' for ranks in one process (aiodist.testing.run_world)"
        ) from exc
    token = (await store.compare_set(_TOKEN_KEY, "", secrets.token_hex(16))).decode()
    # Each op runs under its own group's timeout (ProcessGroup), which may be longer than the
    # default group's; so the transport's own per-send/recv deadline is only a backstop for
    # waits outside any op, set far beyond any group timeout it could cut short.
    where = rendezvous_host(store)
    # refuses a named interface that is not there, at once; off the loop: it may resolve names
    advertise = await asyncio.to_thread(choose, where)
    transport = await Transport.start(
        store, rank, world_size, token=token, timeout=max(timeout.total_seconds(), _TRANSPORT_BACKSTOP_S), advertise=advertise
    )
    shm = None
    try:
        # published before the exchange, so every rank's record is in the store before any op
        shm = await SharedMemory.start(store, rank, token.encode(), host_id())
        # every rank's address, and the same number of interfaces everywhere, before any op
        await transport.exchange(timeout.total_seconds())
        # every rank's host (its shared-memory record is in the store by now): the groups' layouts
        hosts = await shm.host_ids(world_size)
    except BaseException:
        if shm is not None:
            await shm.close()
        await transport.close()
        raise
    assert transport.address is not None
    lanes = f"; interfaces {', '.join(f'{n}={h}' for n, h in zip(advertise.ifnames, advertise.hosts))}" if advertise.ifnames else ""
    log.info("rank %d advertises %s (chosen by %s)%s", rank, transport.address.describe(), advertise.why, lanes)
    return AioBackend(transport, rank, world_size, shm, hosts)
