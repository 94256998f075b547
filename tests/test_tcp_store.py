"""TCPStore in one process: a master (port 0) and clients on the test's loop.

What is covered: construction (await, ``async with``), ``host``/``port``, the world-size join
(master + clients, and a master whose workers never come), connecting to nothing, ADD on a
non-integer (and the reconnect after it), the waiter-connection design (a blocked ``get`` never
stalls a ``set`` on the same object), the round trips of ``get``, ``clone()`` on this loop and on
another thread's loop, use from a foreign loop, ``multi_tenant``, ``master_listen_fd``, what
``close()`` does to the server and its clients, a server restart, ``stats()``, and aiodist's store
conformance kit on a master, on a client of a separate master (same host: the abstract Unix socket
path) and on a client of a server bound to 127.0.0.1 (plain TCP).

Every wait is bounded: a condition is polled with a deadline, never slept for.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from aiodist.errors import DistError, DistNetworkError, DistStoreError, StoreTimeoutError
from aiodist.store.base import Store
from aiodist.store.tcp import TCPStore
from aiodist.testing import until
from aiodist.testing.ports import free_port

HOST = "127.0.0.1"
SLACK_S = 1.5  # how late (beyond its timeout) a call may report on a busy 2-core box


def refused_port() -> tuple[socket.socket, int]:
    """A port on which nothing listens, kept that way by holding it bound (not listening)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    return s, s.getsockname()[1]


async def started(store: TCPStore) -> TCPStore:
    """``await store`` as a coroutine (for create_task)."""
    return await store


def server_waiters(master: TCPStore) -> int:
    assert master.server is not None
    return int(master.server.stats()["waiters"])


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


# -- construction ----------------------------------------------------------------------------


async def test_construct_by_await() -> None:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    try:
        assert isinstance(m, TCPStore) and isinstance(m, Store)
        assert m.host == HOST
        assert 0 < m.port < 65536
        assert m.server is not None and m.server.port == m.port
        assert (await m) is m  # awaiting again is a no-op
        await m.set("k", "v")
        assert await m.get("k") == b"v"
        c = await TCPStore(HOST, m.port, timeout=5)
        try:
            assert c.host == HOST and c.port == m.port and c.server is None
            assert await c.get("k") == b"v"
        finally:
            await c.close()
    finally:
        await m.close()
    with pytest.raises(DistStoreError, match="closed"):
        await m.get("k")
    with pytest.raises(DistStoreError, match="closed"):
        await m  # a closed store cannot be started again


async def test_async_with() -> None:
    async with TCPStore(HOST, 0, is_master=True, timeout=5) as m:
        assert m.port > 0
        async with TCPStore(HOST, m.port, timeout=5) as c:
            await c.set("a", b"\x00\xff")
            assert await m.get("a") == b"\x00\xff"
        with pytest.raises(DistStoreError, match="closed"):
            await c.set("a", "b")
        assert await m.get("a") == b"\x00\xff"  # the client closing leaves the master alone


async def test_not_awaited_store_refuses() -> None:
    s = TCPStore(HOST, 1234, timeout=1)
    with pytest.raises(DistStoreError, match="not started"):
        await s.get("k")


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="port=0"):
        TCPStore(HOST, 0, is_master=False)
    with pytest.raises(ValueError):
        TCPStore(HOST, 70000, is_master=True)
    with pytest.raises(ValueError, match="empty"):
        TCPStore("", 1234)
    with pytest.raises(TypeError):
        TCPStore(b"127.0.0.1", 1234)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="master_listen_fd"):
        TCPStore(HOST, 1234, master_listen_fd=3)


# -- world size --------------------------------------------------------------------------------


async def test_world_size_master_and_clients_join() -> None:
    s, port = refused_port()
    fd = s.detach()  # the master takes the bound socket, so clients know the port up front
    master_task = asyncio.ensure_future(TCPStore(HOST, port, world_size=3, is_master=True, timeout=5, master_listen_fd=fd))
    stores: list[TCPStore] = []
    try:
        clients = await asyncio.gather(*(TCPStore(HOST, port, world_size=3, timeout=5) for _ in range(2)))
        stores.extend(clients)
        m = await asyncio.wait_for(master_task, 5)
        stores.append(m)
        assert m.server is not None
        assert m.server.state.get(b"init/") == b"3"
        assert await m.num_keys() == 1  # torch counts init/ ...
        assert await m.list_keys() == []  # ... but list_keys shows only user keys
        await clients[0].set("x", "1")
        assert await clients[1].get("x") == b"1"
    finally:
        master_task.cancel()
        await asyncio.gather(master_task, return_exceptions=True)
        for st in stores:
            await st.close()


async def test_world_size_master_and_clients_gathered_on_a_fixed_port() -> None:
    """The master's await blocks until all joined: create master and clients concurrently."""

    async def team(port: int) -> list[TCPStore] | None:
        tasks: list[asyncio.Task[TCPStore]] = []
        taken = False
        try:
            async with asyncio.TaskGroup() as tg:  # one failing cancels the others
                tasks.append(tg.create_task(started(TCPStore(HOST, port, world_size=3, is_master=True, timeout=5))))
                tasks += [tg.create_task(started(TCPStore(HOST, port, world_size=3, timeout=5))) for _ in range(2)]
        except* DistNetworkError:  # pragma: no cover - the port was taken meanwhile
            taken = True
        if taken:  # pragma: no cover
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    await t.result().close()
            return None
        return [t.result() for t in tasks]

    for _ in range(5):  # a free port is not reserved: retry if another process took it
        got = await team(free_port())
        if got is not None:
            stores = got
            break
    else:  # pragma: no cover
        pytest.fail("no free port")
    try:
        m = stores[0]
        assert m.server is not None and m.server.state.get(b"init/") == b"3"
        await stores[1].set("from-1", "x")
        assert await stores[2].get("from-1") == b"x"
    finally:
        for st in stores:
            await st.close()


async def test_world_size_without_wait_for_workers_returns_at_once() -> None:
    t = time.monotonic()
    m = await TCPStore(HOST, 0, world_size=4, is_master=True, timeout=5, wait_for_workers=False)
    try:
        assert time.monotonic() - t < 2
        assert m.server is not None and m.server.state.get(b"init/") is None  # nobody joined
    finally:
        await m.close()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_master_times_out_waiting_for_workers() -> None:
    t = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="1/3 clients joined") as info:
        await TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.5)
    waited = time.monotonic() - t
    assert isinstance(info.value, DistStoreError) and isinstance(info.value, TimeoutError)
    assert 0.45 <= waited < 0.5 + SLACK_S, waited


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_master_times_out_with_one_of_three_workers() -> None:
    s, port = refused_port()
    m_task = asyncio.ensure_future(TCPStore(HOST, port, world_size=3, is_master=True, timeout=0.5, master_listen_fd=s.detach()))
    c = await TCPStore(HOST, port, world_size=3, timeout=0.5)  # a client joins and returns at once
    try:
        with pytest.raises(StoreTimeoutError, match="2/3 clients joined"):
            await asyncio.wait_for(m_task, 0.5 + SLACK_S)
        # the failed master stopped its server: the client's next call fails within its timeout
        t = time.monotonic()
        with pytest.raises((DistStoreError, DistNetworkError)):
            await c.get("x")
        assert time.monotonic() - t < 0.5 + SLACK_S
    finally:
        await c.close()


# -- connecting to nothing -------------------------------------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_connect_to_nothing_raises_network_error_within_timeout() -> None:
    s, port = refused_port()
    try:
        t = time.monotonic()
        with pytest.raises(DistNetworkError, match=f"{HOST}:{port}"):
            await TCPStore(HOST, port, timeout=0.5)
        assert time.monotonic() - t < 0.5 + SLACK_S
    finally:
        s.close()


async def test_connect_retries_until_server_appears() -> None:
    """torch's client retries with backoff until its timeout: a late server is found."""
    s, port = refused_port()
    fd = s.detach()
    c_task = asyncio.ensure_future(TCPStore(HOST, port, timeout=5))
    await asyncio.sleep(0.05)  # a head start so the client meets a refused connection first (passes either way)
    m = await TCPStore(HOST, port, is_master=True, timeout=5, master_listen_fd=fd)
    try:
        c = await asyncio.wait_for(c_task, 5)
        await c.set("late", "1")
        assert await m.get("late") == b"1"
        await c.close()
    finally:
        c_task.cancel()
        await asyncio.gather(c_task, return_exceptions=True)
        await m.close()


# -- errors and reconnects ---------------------------------------------------------------------


async def test_add_on_non_integer_raises_and_store_recovers(master: TCPStore, client: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    await client.set("text", "not a number")
    with caplog.at_level("WARNING", logger="aiodist.store.server"):
        with pytest.raises(DistStoreError) as info:
            await client.add("text", 1)
    assert not isinstance(info.value, TimeoutError)
    assert "add('text', 1)" in str(info.value)
    assert any("not an integer" in r.getMessage() for r in caplog.records)
    # the next calls reconnect and work; the value is untouched
    assert await client.get("text") == b"not a number"
    assert await client.add("n", 5) == 5
    assert client.stats()["reconnects"] >= 1
    assert await master.get("n") == b"5"


async def test_value_over_server_limit_raises_and_store_recovers() -> None:
    from aiodist.wire.store import Limits

    async with TCPStore(HOST, 0, is_master=True, timeout=5, limits=Limits(max_value_bytes=1024)) as m:
        async with TCPStore(HOST, m.port, timeout=5) as c:
            with pytest.raises(DistStoreError, match="set"):
                await c.set("big", b"x" * 2048)
            assert not await c.check(["big"])
            await c.set("small", b"x" * 1024)
            assert await c.get("small") == b"x" * 1024


# -- the waiter connections -------------------------------------------------------------------


async def test_blocked_get_does_not_block_set_on_same_store(master: TCPStore, client: TCPStore) -> None:
    getter = asyncio.create_task(client.get("later"))
    try:
        await until(lambda: server_waiters(master) == 1, "the get to block in a WAIT")
        # the same store object stays usable for everything else while the get waits
        await asyncio.wait_for(client.set("other", "1"), 2)
        assert await asyncio.wait_for(client.add("count", 2), 2) == 2
        assert await asyncio.wait_for(client.get("other"), 2) == b"1"
        assert not getter.done()
        await asyncio.wait_for(client.set("later", "L"), 2)
        assert await asyncio.wait_for(getter, 2) == b"L"
    finally:
        getter.cancel()
        await asyncio.gather(getter, return_exceptions=True)
    assert server_waiters(master) == 0


async def test_many_blocked_gets_on_one_store(master: TCPStore, client: TCPStore) -> None:
    getters = [asyncio.create_task(client.get(f"k{i}")) for i in range(20)]
    try:
        await until(lambda: server_waiters(master) == 20, "20 gets to block")
        assert await client.add("c", 1) == 1
        await client.multi_set([f"k{i}" for i in range(20)], [str(i) for i in range(20)])
        assert await asyncio.wait_for(asyncio.gather(*getters), 5) == [str(i).encode() for i in range(20)]
        assert client.stats()["waiter_connections"] <= 8  # the idle pool is bounded
    finally:
        for g in getters:
            g.cancel()
        await asyncio.gather(*getters, return_exceptions=True)


async def test_cancelled_get_frees_its_server_waiter(master: TCPStore, client: TCPStore) -> None:
    getter = asyncio.create_task(client.get("never"))
    await until(lambda: server_waiters(master) == 1, "the get to block")
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    await until(lambda: server_waiters(master) == 0, "the server to drop the waiter")
    await client.set("never", "now")
    assert await client.get("never") == b"now"


async def test_get_missing_times_out_naming_key(master: TCPStore) -> None:
    c = await TCPStore(HOST, master.port, timeout=0.3)
    try:
        t = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="'absent'"):
            await c.get("absent")
        assert 0.25 <= time.monotonic() - t < 0.3 + SLACK_S
        await c.set("absent", "1")  # the store still works after a timeout
        assert await c.get("absent") == b"1"
    finally:
        await c.close()
    await until(lambda: server_waiters(master) == 0, "the timed-out waiter to be dropped")


async def test_get_of_existing_key_is_one_round_trip(master: TCPStore, client: TCPStore) -> None:
    assert master.server is not None
    await client.set("k", "v")
    before, waits_before, conns_before = master.server.stats()["requests"], client.stats()["waits"], master.server.stats()["connections"]
    assert await client.get("k") == b"v"
    assert master.server.stats()["requests"] - before == 2  # CHECK + GET in one write, no WAIT
    assert client.stats()["waits"] == waits_before
    assert master.server.stats()["connections"] == conns_before  # no waiter connection opened
    # a missing key costs a WAIT on a waiter connection, then CHECK + GET again
    getter = asyncio.create_task(client.get("k2"))
    await until(lambda: server_waiters(master) == 1, "the get to block")
    await master.set("k2", "v2")
    assert await asyncio.wait_for(getter, 2) == b"v2"
    assert client.stats()["waits"] == waits_before + 1


async def test_set_returns_after_server_has_it(master: TCPStore, client: TCPStore) -> None:
    """set has no reply in the protocol; the client confirms with a PING behind it."""
    assert master.server is not None
    for i in range(50):
        await client.set(f"s{i}", str(i))
        assert master.server.state.get(f"/s{i}".encode()) == str(i).encode()
        await client.append("ap", "x")
        assert master.server.state.get(b"/ap") == b"x" * (i + 1)


# -- clone and loops --------------------------------------------------------------------------


async def test_clone_on_same_loop(master: TCPStore) -> None:
    c = master.clone()
    try:
        assert isinstance(c, TCPStore) and c is not master
        assert c.port == master.port and c.server is None
        await c.set("from-clone", "1")
        assert await master.get("from-clone") == b"1"
        assert await c.add("n", 1) == 1
        assert await master.add("n", 1) == 2
    finally:
        await c.close()
    assert await master.get("n") == b"2"  # closing a clone leaves the master serving


async def test_clone_used_from_another_thread_and_loop(master: TCPStore) -> None:
    clone = master.clone()
    result: dict[str, object] = {}

    async def on_other_loop() -> None:
        try:
            await clone.set("t", "from-thread")
            result["n"] = [await clone.add("tn", 1) for _ in range(10)][-1]
            result["blocked"] = await clone.get("from-main")  # woken by the main loop's set
        finally:
            await clone.close()

    def thread_main() -> None:
        try:
            asyncio.run(on_other_loop())
        except BaseException as exc:  # pragma: no cover - reported below
            result["error"] = exc

    th = threading.Thread(target=thread_main, daemon=True)
    th.start()
    assert await asyncio.wait_for(master.get("t"), 5) == b"from-thread"
    await master.set("from-main", "hello")
    await asyncio.to_thread(th.join, 5)
    assert not th.is_alive()
    assert "error" not in result, result.get("error")
    assert result == {"n": 10, "blocked": b"hello"}


async def test_store_from_a_different_loop_raises(master: TCPStore) -> None:
    await master.set("k", "v")
    errors: list[BaseException] = []

    def thread_main() -> None:
        async def use() -> None:
            await master.get("k")

        try:
            asyncio.run(use())
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=thread_main, daemon=True)
    th.start()
    await asyncio.to_thread(th.join, 5)
    assert len(errors) == 1
    assert isinstance(errors[0], DistStoreError), repr(errors[0])
    assert "another event loop" in str(errors[0])
    assert await master.get("k") == b"v"  # still fine on its own loop


async def test_store_from_a_different_loop_raises_after_a_reconnect(master: TCPStore) -> None:
    client = await TCPStore(HOST, master.port, timeout=5)
    try:
        await client.set("t", "text")
        with pytest.raises(DistStoreError):
            await client.add("t", 1)  # the server closes the main connection
        errors: list[BaseException] = []

        def thread_main() -> None:
            try:
                asyncio.run(client.get("t"))
            except BaseException as exc:
                errors.append(exc)

        th = threading.Thread(target=thread_main, daemon=True)
        th.start()
        await asyncio.to_thread(th.join, 5)
        assert len(errors) == 1 and isinstance(errors[0], DistStoreError) and "another event loop" in str(errors[0])
        assert await client.get("t") == b"text"  # still fine on its own loop
    finally:
        try:
            await client.close()
        except RuntimeError:  # with the bug, its connection belongs to the thread's closed loop
            pass


async def test_client_survives_a_server_restart_on_the_same_port() -> None:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    port = m.port
    c = await TCPStore(HOST, port, timeout=5)
    try:
        await c.set("k", "old")
        assert await c.get("k") == b"old"
        await m.close()
        m = await TCPStore(HOST, port, is_master=True, timeout=5)  # e.g. a restarted agent
        await m.set("k", "new")
        assert await c.get("k") == b"new"  # a read is retried once on a fresh connection
        assert await c.add("n", 1) == 1
        blocked = asyncio.create_task(c.get("later"))
        await until(lambda: server_waiters(m) == 1, "the get to block on the new server")
        await m.set("later", "L")
        assert await asyncio.wait_for(blocked, 5) == b"L"
        assert c.stats()["reconnects"] >= 1
    finally:
        await c.close()
        await m.close()


# -- multi_tenant and master_listen_fd ---------------------------------------------------------


async def test_multi_tenant_masters_share_one_server() -> None:
    for _ in range(5):  # a free port is not reserved: retry if another process took it
        port = free_port()
        try:
            m1 = await TCPStore(HOST, port, is_master=True, timeout=5, multi_tenant=True)
            break
        except DistNetworkError:  # pragma: no cover
            continue
    else:  # pragma: no cover
        pytest.fail("no free port")
    m2 = await TCPStore(HOST, port, is_master=True, timeout=5, multi_tenant=True)
    try:
        assert m1.port == m2.port == port
        assert m1.server is m2.server is not None
        await m1.set("shared", "1")
        assert await m2.get("shared") == b"1"
        await m1.close()  # one tenant leaves; the server stays for the other
        assert await m2.add("n", 1) == 1
        async with TCPStore(HOST, port, timeout=5) as c:
            assert await c.get("shared") == b"1"
    finally:
        await m1.close()
        await m2.close()
    # the last tenant stopped the server
    with pytest.raises(DistNetworkError):
        await TCPStore(HOST, port, timeout=0.3)


async def test_multi_tenant_shares_by_port_whatever_the_host_string() -> None:
    port = free_port()
    m1 = await TCPStore("127.0.0.1", port, is_master=True, timeout=5, multi_tenant=True)
    try:
        m2 = await TCPStore("localhost", port, is_master=True, timeout=5, multi_tenant=True)
        try:
            assert m1.server is m2.server
        finally:
            await m2.close()
    finally:
        await m1.close()


async def test_second_master_on_a_taken_port_fails(master: TCPStore) -> None:
    with pytest.raises(DistNetworkError, match=str(master.port)):
        await TCPStore(HOST, master.port, is_master=True, timeout=1)
    assert await master.add("still", 1) == 1


async def test_master_listen_fd() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    fd = s.detach()  # the store owns the descriptor from here on
    m = await TCPStore(HOST, 0, is_master=True, timeout=5, master_listen_fd=fd)
    try:
        assert m.port == port  # the port comes from the socket
        async with TCPStore(HOST, port, timeout=5) as c:
            await c.set("via-fd", "1")
        assert await m.get("via-fd") == b"1"
    finally:
        await m.close()
    with pytest.raises(DistNetworkError):
        await TCPStore(HOST, port, timeout=0.3)


# -- close -----------------------------------------------------------------------------------


async def test_close_stops_the_server() -> None:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    c = await TCPStore(HOST, m.port, timeout=0.5)
    try:
        await c.set("k", "v")
        blocked = asyncio.create_task(c.get("never"))
        await until(lambda: server_waiters(m) == 1, "the get to block")
        await m.close()
        # a blocked call fails promptly (its waiter connection broke), not at its timeout
        with pytest.raises(DistError):
            await asyncio.wait_for(blocked, 0.5 + SLACK_S)
        # the next call fails within the client's timeout
        t = time.monotonic()
        with pytest.raises((DistStoreError, DistNetworkError)):
            await c.get("k")
        assert time.monotonic() - t < 0.5 + SLACK_S
    finally:
        await c.close()
        await m.close()  # idempotent


async def test_close_is_idempotent_and_frees_port() -> None:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    port = m.port
    await m.close()
    await m.close()
    m2 = await TCPStore(HOST, port, is_master=True, timeout=5)  # the port can be taken again
    await m2.close()


# -- stats --------------------------------------------------------------------------------------


async def test_stats(master: TCPStore, client: TCPStore) -> None:
    await client.set("a", "1")
    await client.get("a")
    getter = asyncio.create_task(client.get("b"))
    await until(lambda: server_waiters(master) == 1, "a waiter")
    await client.set("b", "2")
    await asyncio.wait_for(getter, 2)
    await client.queue_push("q", "x")

    cs = client.stats()
    assert cs["type"] == "TCPStore"
    assert cs["host"] == HOST and cs["port"] == master.port and cs["is_master"] is False
    assert cs["timeout_s"] == 5.0
    assert cs["requests"] >= 5 and cs["waits"] == 1 and cs["reconnects"] == 0
    assert cs["waiter_connections"] == 1
    assert "server" not in cs

    ms = master.stats()
    assert ms["is_master"] is True
    ss = ms["server"]
    assert ss["type"] == "TCPStoreServer" and ss["port"] == master.port
    assert ss["clients"] == 3  # master's main, client's main, client's idle waiter
    assert ss["keys"] == 2 and ss["queues"] == 1 and ss["waiters"] == 0
    assert ss["requests"] >= cs["requests"]
    assert ss["uptime_s"] > 0
    assert master.server is not None and master.server.stats()["keys"] == 2


async def test_ping(client: TCPStore) -> None:
    rtt = await client.ping()
    assert 0 <= rtt < 1


# -- the conformance kit -------------------------------------------------------------------------


async def _run_kit(make_store: Callable[[], Awaitable[Store]]) -> None:
    from aiodist.testing import check_store

    await check_store(make_store)


async def test_conformance_kit_on_master() -> None:
    async def make() -> Store:
        return await TCPStore(HOST, 0, is_master=True, timeout=5)

    await _run_kit(make)


async def test_conformance_kit_on_client_of_separate_master() -> None:
    masters: list[TCPStore] = []

    async def make() -> Store:
        m = await TCPStore(HOST, 0, is_master=True, timeout=5)  # a fresh, empty server per check
        masters.append(m)
        return await TCPStore(HOST, m.port, timeout=5)

    try:
        await _run_kit(make)
    finally:
        for m in masters:
            await m.close()


async def test_conformance_kit_on_client_over_tcp() -> None:
    """A server bound to 127.0.0.1 has no same-host Unix listener: the client speaks TCP."""
    from aiodist.store.server import ServerThread, TCPStoreServer

    servers: list[ServerThread] = []

    async def make() -> Store:
        st = await ServerThread(TCPStoreServer(HOST, 0)).astart()
        servers.append(st)
        return await TCPStore(HOST, st.server.port, timeout=5)

    try:
        await _run_kit(make)
    finally:
        for st in servers:
            await st.astop()


# -- misbehaving servers ------------------------------------------------------------------------


async def fake_server(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> asyncio.Server:
    return await asyncio.start_server(handler, HOST, 0)


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read VALIDATE + PING and echo the PING's nonce, as a TCPStore server does."""
    hello = await reader.readexactly(10)
    assert hello[0] == 0 and hello[5] == 13
    writer.write(hello[6:10])
    await writer.drain()


@pytest.mark.parametrize("kind", ["wrong_echo", "banner"])
async def test_handshake_with_a_non_tcpstore_server_fails_fast(kind: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if kind == "wrong_echo":
            await reader.readexactly(10)
            writer.write(b"\x00\x00\x00\x00")
        elif kind == "banner":
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        writer.close()

    srv = await fake_server(handler)
    port = srv.sockets[0].getsockname()[1]
    try:
        t = time.monotonic()
        with pytest.raises(DistNetworkError):
            await TCPStore(HOST, port, timeout=5)
        assert time.monotonic() - t < 2  # refused at once, not after the 5 s timeout
    finally:
        srv.close()
        await srv.wait_closed()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_a_server_that_drops_the_handshake_is_retried_until_the_timeout() -> None:
    """A connection closed during the handshake may be a server starting or stopping: the client
    retries, as for a refused connect, and names host:port when the timeout runs out."""
    attempts = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        writer.close()

    srv = await fake_server(handler)
    port = srv.sockets[0].getsockname()[1]
    try:
        t = time.monotonic()
        with pytest.raises(DistNetworkError, match=f"{HOST}:{port}"):
            await TCPStore(HOST, port, timeout=1)
        assert time.monotonic() - t >= 0.5 and attempts >= 2
    finally:
        srv.close()
        await srv.wait_closed()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
async def test_silent_server_times_out_each_call() -> None:
    """A server that completes the handshake and then never answers: every call fails within the
    store's timeout instead of hanging."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _handshake(reader, writer)
        while await reader.read(65536):  # swallow requests, answer none
            pass
        writer.close()

    srv = await fake_server(handler)
    port = srv.sockets[0].getsockname()[1]
    c = await TCPStore(HOST, port, timeout=0.3)
    try:
        for call in (lambda: c.add("n", 1), lambda: c.get("k"), lambda: c.set("k", "v"), lambda: c.num_keys()):
            t = time.monotonic()
            with pytest.raises(DistStoreError):
                await call()
            assert time.monotonic() - t < 0.3 + SLACK_S
    finally:
        await c.close()
        srv.close()
        await srv.wait_closed()


async def test_server_sending_unexpected_bytes_breaks_only_that_connection() -> None:
    """Extra bytes after a reply are a protocol error: the client drops that connection and the
    next call reconnects (here to a server that behaves)."""
    conns = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        first = conns == 1
        await _handshake(reader, writer)
        while req := await reader.read(65536):
            if req[0] == 7:  # GETNUMKEYS: i64 reply
                writer.write((5).to_bytes(8, "little") + (b"\xee" * 3 if first else b""))
                await writer.drain()
        writer.close()

    srv = await fake_server(handler)
    port = srv.sockets[0].getsockname()[1]
    c = await TCPStore(HOST, port, timeout=2)
    try:
        try:
            assert await c.num_keys() == 5  # the reply itself may still be delivered...
        except DistStoreError:
            pass  # ...or the request fails with the connection
        assert await c.num_keys() == 5
        assert conns == 2
    finally:
        await c.close()
        srv.close()
        await srv.wait_closed()


async def test_a_port_held_by_another_program_is_named(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program on the port: a server that answers something else is refused at once, one
    that accepts and says nothing is named after the handshake's bound (3 s; 0.5 s here), and a
    master that cannot listen says so in one sentence (no chained traceback)."""
    import aiodist.store._dial as dial

    monkeypatch.setattr(dial, "_HANDSHAKE_S", 0.5)

    async def talker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # (never answers)
        writer.close()

    for handler in (talker, silent):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        try:
            with pytest.raises(DistNetworkError) as e:
                await TCPStore("127.0.0.1", port, 2, False, timeout=1.2)
            took = time.monotonic() - t0
            if handler is talker:
                assert "(first byte 0x53)" in str(e.value) and "is another program listening on port" in str(e.value), e.value
                assert took < 2, took
            else:
                assert "did not answer the TCPStore handshake within 0.5 s: is another program listening on port" in str(e.value)
                assert any("is another program listening" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
            with pytest.raises(DistNetworkError) as busy:
                await TCPStore("127.0.0.1", port, 1, True, timeout=1)
            assert "Address already in use" in str(busy.value) and busy.value.__cause__ is None and busy.value.__suppress_context__
        finally:
            server.close()
            await server.wait_closed()
