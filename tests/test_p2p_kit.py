"""The P2P conformance kit (aiodist.testing.p2p_kit) over every implementation of the
point-to-point contract the collectives are written over: the in-memory LocalP2P (which the
"memory" backend hands out), a sub-op's SubP2P, and the transport's Channel over real loopback
sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from aiodist import HashStore
from aiodist.algorithms.p2p import LocalP2P, LocalWorld, SubP2P
from aiodist.backends.memory import MemoryHub
from aiodist.testing.p2p_kit import Op, check_p2p
from aiodist.transport import Channel, Transport

pytestmark = pytest.mark.timeout(120)


@asynccontextmanager
async def local(n: int) -> AsyncIterator[Op]:
    w = LocalWorld(n, capacity=2, seed=7)
    yield Op([LocalP2P(w, r) for r in range(n)], w.abort)


@asynccontextmanager
async def sub_op(n: int) -> AsyncIterator[Op]:
    w = LocalWorld(n, capacity=2, seed=3)
    yield Op([SubP2P(LocalP2P(w, r), 2) for r in range(n)], w.abort)


@asynccontextmanager
async def memory_backend(n: int) -> AsyncIterator[Op]:
    hub = MemoryHub(n)
    yield Op([hub.channel(r, 4, 1, list(range(n))) for r in range(n)], lambda err: hub.abort(4, str(err)))


@asynccontextmanager
async def transport(n: int) -> AsyncIterator[Op]:
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, n, token="kit", timeout=10) for r in range(n))))
    tasks: list[asyncio.Task[None]] = []
    try:
        ends = [Channel(t, 5, 1, list(range(n))) for t in ts]
        yield Op(ends, lambda err: tasks.append(asyncio.ensure_future(ts[0].abort(5, str(err), list(range(n))))))
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.parametrize("make", [local, sub_op, memory_backend, transport], ids=["LocalP2P", "SubP2P", "memory", "Channel"])
async def test_every_p2p_keeps_the_contract(make: object) -> None:
    await check_p2p(make)  # type: ignore[arg-type]


class _NoNowait(LocalP2P):
    """send_nowait says it sent, and sends nothing."""

    def send_nowait(self, peer: int, buf: object, tag: int) -> bool:
        return True


class _Truncating(LocalP2P):
    """Sends the message cut to its first half: bytes and sizes go wrong."""

    async def send(self, peer: int, buf: object, tag: int) -> None:
        import numpy as np

        b = np.asarray(buf).reshape(-1).view(np.uint8)
        await super().send(peer, b[: b.size // 2], tag)


class _Ghost(LocalP2P):
    """A cancelled receive keeps listening: it takes the next message of its peer and tag."""

    async def recv(self, peer: int, buf: object, tag: int) -> None:
        import numpy as np

        try:
            await super().recv(peer, buf, tag)
        except asyncio.CancelledError:
            self.ghost = asyncio.ensure_future(super().recv(peer, np.empty_like(buf), tag))
            raise


class _VagueSizes(LocalP2P):
    """A size mismatch whose error names the tag and a rank, not the sizes."""

    async def recv(self, peer: int, buf: object, tag: int) -> None:
        if tag == 40:
            raise ValueError(f"tag {tag} failed from rank 8")
        await super().recv(peer, buf, tag)


async def test_the_kit_fails_an_implementation_that_breaks_the_contract() -> None:
    def broken(kind: type[LocalP2P]) -> object:
        @asynccontextmanager
        async def make(n: int) -> AsyncIterator[Op]:
            w = LocalWorld(n)
            yield Op([kind(w, r) for r in range(n)], None)

        return make

    with pytest.raises(AssertionError) as info:
        await check_p2p(broken(_NoNowait), timeout=0.3)  # type: ignore[arg-type]
    assert "send_nowait:" in str(info.value) and "bytes:" not in str(info.value)
    with pytest.raises(AssertionError) as info:
        await check_p2p(broken(_Truncating), timeout=0.3)  # type: ignore[arg-type]
    assert "bytes:" in str(info.value) and "size_mismatch:" in str(info.value)
    with pytest.raises(AssertionError) as info:
        await check_p2p(broken(_Ghost), timeout=0.3)  # type: ignore[arg-type]
    assert "cancel:" in str(info.value) and "bytes:" not in str(info.value)
    with pytest.raises(AssertionError) as info:
        await check_p2p(broken(_VagueSizes), timeout=0.3)  # type: ignore[arg-type]
    assert "size_mismatch:" in str(info.value) and "bytes:" not in str(info.value)
