"""The transport's grace for big early payloads (aiodist/transport/_connection.py): one whose
receive comes within ``GRACE_SECONDS`` lands in the receive's array (never staged); one whose
receive comes later is staged as before, so nothing that staging serves can stall."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from aiodist import HashStore
from aiodist.testing import until
from aiodist.transport import Transport, _connection
from aiodist.transport._connection import GRACE_MIN_BYTES, GRACE_SECONDS

BIG = GRACE_MIN_BYTES // 4  # int32 elements: just at the threshold


@asynccontextmanager
async def pair() -> AsyncIterator[list[Transport]]:
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, 2, token="grace", timeout=10) for r in range(2))))
    try:
        await ts[0].connect()
        yield ts
    finally:
        await asyncio.gather(*(t.close() for t in ts))


async def test_big_payload_waits_briefly_for_its_receive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_connection, "GRACE_SECONDS", 5.0)  # room for a slow test machine
    async with pair() as ts:
        src = np.arange(BIG, dtype=np.int32)
        dst = np.zeros(BIG, np.int32)
        send = asyncio.create_task(ts[0].send(1, src, tag=1))
        await until(lambda: any(c.held is not None for c in ts[1]._conns), "the big header to be held")
        assert await ts[1].recv(0, dst, tag=1) == 0
        await send
        np.testing.assert_array_equal(dst, src)
        assert ts[1].staged_total == 0  # landed in the receive's array


async def test_big_payload_is_staged_after_the_grace() -> None:
    async with pair() as ts:
        src = np.arange(BIG, dtype=np.int32)
        await ts[0].send(1, src, tag=1)
        await asyncio.sleep(GRACE_SECONDS * 10)
        assert ts[1].stats()["staged_bytes"] == src.nbytes  # not held for good: staged once the grace ran out
        dst = np.zeros(BIG, np.int32)
        await ts[1].recv(0, dst, tag=1)
        np.testing.assert_array_equal(dst, src)
        assert ts[1].staged_total == 1


async def test_later_message_is_received_before_a_big_earlier_one() -> None:
    # received out of order: the big one must not block the small one behind it for longer than the grace
    async with pair() as ts:
        big, small = np.arange(BIG, dtype=np.int32), np.arange(10, dtype=np.int32)
        await ts[0].send(1, big, tag=1)
        await ts[0].send(1, small, tag=2)
        got_small, got_big = np.zeros_like(small), np.zeros_like(big)
        async with asyncio.timeout(5):
            await ts[1].recv(0, got_small, tag=2)
            await ts[1].recv(0, got_big, tag=1)
        np.testing.assert_array_equal(got_small, small)
        np.testing.assert_array_equal(got_big, big)
