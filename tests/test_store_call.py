"""TCPStore ``get``/``add`` handles (``aiodist.store._connection._Call``, the one-op-at-a-time path).

While the main connection is up, ``get`` and ``add`` send their request when called and return
a future that the connection resolves itself, instead of a coroutine wrapped in a ``Pending``.
What is checked here is that the handle keeps the ``Pending`` contract and every path of the
calls it replaced:

- a call dropped without ``await`` still happens and logs an ERROR naming its line;
- the handle goes where a coroutine goes: ``create_task``, ``gather``, ``wait_for``, ``shield``,
  ``.wait()``, and none of them counts as a forgotten await;
- a get of a missing key waits for it (the rest of the call runs in a task) and a timeout or a
  cancellation of that wait stops the task and frees the server's waiter;
- a connection lost under the request: a get is read again on a new connection, an add fails
  saying that whether it took effect is unknown;
- with no main connection (closed, or before a reconnect) the calls are ``Pending`` as before.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest

from aiodist._pending import Pending
from aiodist.errors import DistStoreError, StoreTimeoutError
from aiodist.store._connection import _Call
from aiodist.store.tcp import TCPStore
from aiodist.testing import until

HOST = "127.0.0.1"


@pytest.fixture
async def master() -> AsyncIterator[TCPStore]:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    try:
        yield m
    finally:
        await m.close()


@pytest.fixture
async def client(master: TCPStore) -> AsyncIterator[TCPStore]:
    c = await TCPStore(HOST, master.port, timeout=5)
    try:
        yield c
    finally:
        await c.close()


def _line_of(text: str) -> int:
    """The line number of ``text`` in this file (where a call is made)."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return i
    raise AssertionError(text)


def server_waiters(master: TCPStore) -> int:
    assert master.server is not None
    return int(master.server.stats()["waiters"])


async def test_get_and_add_return_started_calls(client: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="aiodist.store")
    await client.set("k", "v")
    g, a = client.get("k"), client.add("n", 2)
    assert isinstance(g, _Call) and isinstance(a, _Call)
    assert (await g, await a) == (b"v", 2)
    assert await asyncio.create_task(client.add("n", 1)) == 3  # type: ignore[arg-type]
    assert await asyncio.gather(client.get("k"), client.add("n", 1)) == [b"v", 4]
    assert await asyncio.wait_for(client.get("k"), 5) == b"v"
    assert await asyncio.shield(client.add("n", 1)) == 5
    h = client.add("n", 1)
    assert await h.wait() is True  # type: ignore[attr-defined]
    assert h.is_completed() and await h == 6  # type: ignore[attr-defined]
    del h
    gc.collect()
    assert [r.getMessage() for r in caplog.records] == []  # each of them counts as awaited


async def test_a_forgotten_await_still_adds_and_says_where(client: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("ERROR", logger="aiodist.store"):
        client.add("n", 1)  # forgotten await: the request is sent anyway
        gc.collect()
        line = _line_of('client.add("n", 1)  # forgotten await')
        assert await client.add("n", 0) == 1
    words = [r.getMessage() for r in caplog.records]
    assert any(f"store.add(...) called at {__file__}:{line} was never awaited" in w and "await store.add" in w for w in words), words


async def test_get_of_a_missing_key_waits_for_it(master: TCPStore, client: TCPStore) -> None:
    h = client.get("later")
    await until(lambda: server_waiters(master) == 1, "the get to block in a WAIT")
    assert not h.done()  # type: ignore[attr-defined]
    await master.set("later", "L")
    assert await asyncio.wait_for(h, 5) == b"L"


async def test_a_timed_out_or_cancelled_get_frees_the_server_waiter(master: TCPStore) -> None:
    # A store timeout far past until's 5 s: a wait left running would keep its server waiter.
    async with TCPStore(HOST, master.port, timeout=60) as client:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.get("never"), 0.2)
        await until(lambda: server_waiters(master) == 0, "the server to drop the waiter")
        h = client.get("never")
        await until(lambda: server_waiters(master) == 1, "the get to block")
        h.cancel()  # type: ignore[attr-defined]
        await until(lambda: server_waiters(master) == 0, "the server to drop the waiter")
        with pytest.raises(asyncio.CancelledError):
            await h


async def test_a_get_missing_past_the_timeout_names_the_key(master: TCPStore) -> None:
    async with TCPStore(HOST, master.port, timeout=0.3) as c:
        with pytest.raises(StoreTimeoutError, match="gone"):
            await c.get("gone")


async def test_a_lost_connection_rereads_a_get_and_fails_an_add(master: TCPStore, client: TCPStore) -> None:
    await client.set("k", "v")
    g = client.get("k")
    assert client._main is not None and client._main.transport is not None
    client._main.transport.abort()  # the reply to the get is lost with the connection
    assert await asyncio.wait_for(g, 5) == b"v"  # read again on a new one
    assert client.stats()["reconnects"] == 1
    a = client.add("n", 1)
    assert client._main is not None and client._main.transport is not None
    client._main.transport.abort()
    with pytest.raises(DistStoreError, match=r"add\('n', 1\) failed.*Whether it took effect is unknown"):
        await asyncio.wait_for(a, 5)
    assert await client.add("n", 0) in (0, 1)  # the next call reconnects


async def test_without_a_main_connection_the_calls_are_pending(master: TCPStore, client: TCPStore) -> None:
    assert client._main is not None
    client._main.close()  # as a broken connection: the next call reconnects, in a Pending
    h = client.add("n", 1)
    assert isinstance(h, Pending)
    assert await h == 1
    a = client.add("n", 1)
    assert isinstance(a, _Call)  # reconnected: the fast path again
    assert await a == 2
    await client.close()
    with pytest.raises(DistStoreError, match="closed"):
        await client.get("k")


def test_argument_errors_raise_at_the_call() -> None:
    store = TCPStore(HOST, 1)
    with pytest.raises(TypeError):
        store.get(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.add("k", True)
    with pytest.raises(ValueError):
        store.add("k", 2**63)
