"""TCPStore calls that read their reply by spinning (``aiodist.store._connection.Connection.spin``).

A call made one at a time on a connection to a same-host server polls the socket for up to
``SPIN_S`` before it is awaited, so the reply is read without a pass of the event loop. Checked
here, against a server in another process (``python -m aiodist.store``):

- the values are those of the loop path, over the Unix socket and TCP, for adds, gets of
  small and of multi-MiB values (a reply read partly by the spin, the rest by the transport),
  and a get whose key is set later (the WAIT that follows runs in a task as before);
- the loop still runs while a task makes calls back to back (``SPIN_LOOP_S``);
- no spinning while a server runs in this process (it may need this thread's GIL);
- a spin that sees no reply (a stopped server) gives up after ``SPIN_S``, leaves the reply
  to the transport, and the next request does not spin (the back-off); a reply resets it;
- a server that dies during a spin fails the call with the usual error, at once.

``SPIN_S`` is raised to 50 ms in the tests that count spins, so that a loaded machine's late
reply is not a miss; the rules do not depend on its value.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from aiodist.errors import DistStoreError
from aiodist.store import _connection as tcp  # the connection reads SPIN_S
from aiodist.store.tcp import TCPStore
from aiodist.wire.store import encode_add

pytestmark = pytest.mark.subprocess

HOST = "127.0.0.1"


def _start_server() -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(
        [sys.executable, "-m", "aiodist.store", "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # the server prints it once it listens; EOF if it died
    m = re.search(r"listening on \S+:(\d+)", line)
    if m is None:
        p.kill()
        p.wait(10)
        raise AssertionError(f"store server printed {line!r}")
    return p, int(m.group(1))


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
    p.wait(10)
    assert p.stdout is not None
    p.stdout.close()


def _sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (kill returns before it has)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    p, port = _start_server()
    try:
        yield p, port
    finally:
        _stop(p)


@pytest.fixture
def long_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "SPIN_S", 0.05)


async def _client(port: int, unix: bool = True) -> TCPStore:
    store = TCPStore(HOST, port, timeout=10)
    store._use_local = unix
    return await store


@pytest.fixture
async def client(server: tuple[subprocess.Popen[str], int]) -> AsyncIterator[TCPStore]:
    store = await _client(server[1])
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("unix", [True, False], ids=["unix", "tcp"])
async def test_calls_one_at_a_time_read_their_reply_by_spinning(
    server: tuple[subprocess.Popen[str], int], long_spin: None, unix: bool, any_loop: str
) -> None:
    store = await _client(server[1], unix)
    try:
        assert store.stats()["transport"] == ("unix" if unix else "tcp")
        key = f"spin/{any_loop}/{unix}"
        first = await store.add(key, 0)
        done_at_once = 0
        for i in range(1, 201):
            call = store.add(key, 1)
            done_at_once += call.done()  # type: ignore[attr-defined]
            assert await call == first + i
        await store.set(key + "/v", b"x" * 100)
        for _ in range(100):
            assert await store.get(key + "/v") == b"x" * 100
        stats = store.stats()
        # Every call may spin but the ones after a loop pass is due (one per millisecond).
        assert done_at_once > 0 and stats["spun"] > 0, stats
        assert stats["spin_misses"] == 0, stats
    finally:
        await store.close()


@pytest.mark.parametrize("size", [70_000, 3 << 20])
async def test_a_big_value_read_partly_by_the_spin_is_whole(client: TCPStore, long_spin: None, size: int, any_loop: str) -> None:
    value = os.urandom(size)
    key = f"big/{any_loop}/{size}"  # the server is the module's: each loop's run has its own keys
    await client.set(key, value)
    for _ in range(3):
        assert await client.get(key) == value
    assert await client.add(f"{key}/n", 1) == 1  # the stream is in step after it


async def test_a_get_of_a_missing_key_still_waits_for_it(
    client: TCPStore, server: tuple[subprocess.Popen[str], int], long_spin: None, any_loop: str
) -> None:
    other = await _client(server[1])
    try:
        got = asyncio.ensure_future(client.get(f"late/{any_loop}"))
        await asyncio.sleep(0.05)
        assert not got.done()
        await other.set(f"late/{any_loop}", b"here")
        assert await asyncio.wait_for(got, 5) == b"here"
    finally:
        await other.close()


async def test_the_loop_runs_while_a_task_makes_calls_back_to_back(client: TCPStore, long_spin: None) -> None:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.ensure_future(ticker())
    await client.add("loop/n", 1)  # this task's first call (it does not spin), with the loop running
    ticks = 0
    before = client.stats()["spun"]
    for _ in range(2000):
        await client.add("loop/n", 1)
    stop = True
    await t
    spun = client.stats()["spun"] - before
    # Most calls end by spinning, and still the ticker ran: every SPIN_LOOP_S at the latest,
    # a call goes through the loop. (Without that rule no call would yield: ticks == 0.)
    assert spun > 1000, spun
    assert ticks > 0


async def test_no_spinning_while_a_server_runs_in_this_process(long_spin: None) -> None:
    master = await TCPStore(HOST, 0, is_master=True, timeout=10)
    try:
        assert tcp.TCPStoreServer.serving_here >= 1
        for i in range(1, 101):
            assert await master.add("here/n", 1) == i
        assert master.stats()["spun"] == 0 and master.stats()["spin_misses"] == 0
    finally:
        await master.close()


async def test_a_spin_that_sees_no_reply_backs_off(server: tuple[subprocess.Popen[str], int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "SPIN_S", 0.02)
    p, port = server
    store = await _client(port)
    try:
        n = await store.add("backoff/n", 0)
        _sigstop(p.pid)
        try:
            start = time.monotonic()
            call = store.add("backoff/n", 1)
            took = time.monotonic() - start
            assert not call.done()  # type: ignore[attr-defined]
            assert store.stats()["spin_misses"] == 1
            assert took >= 0.02  # it spun for SPIN_S, and no longer than a loaded machine allows
            assert took < 1.0
        finally:
            os.kill(p.pid, signal.SIGCONT)
        assert await call == n + 1  # the transport read it
        monkeypatch.setattr(tcp, "SPIN_S", 0.05)
        spun = store.stats()["spun"]
        assert await store.add("backoff/n", 1) == n + 2  # skipped: 2**1 - 1 requests do not spin
        assert store.stats()["spun"] == spun
        assert await store.add("backoff/n", 1) == n + 3  # spins again, and the reply resets it
        assert store.stats()["spun"] == spun + 1
        assert store._main is not None and store._main._misses == 0
    finally:
        await store.close()


async def test_a_server_that_dies_during_a_spin_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    p, port = _start_server()
    try:
        store = await _client(port)
        try:
            assert await store.add("die/n", 1) == 1
            monkeypatch.setattr(tcp, "SPIN_S", 2.0)
            _sigstop(p.pid)
            killer = threading.Timer(0.05, p.kill)
            killer.start()
            start = time.monotonic()
            call = store.add("die/n", 1)
            took = time.monotonic() - start
            killer.join()
            assert took < 1.5, took  # the spin ended at the end of the stream, not at SPIN_S
            with pytest.raises(DistStoreError, match=r"add\('die/n', 1\) failed"):
                await asyncio.wait_for(call, 5)
        finally:
            await store.close()
    finally:
        _stop(p)


async def test_a_spin_ends_at_the_end_of_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server that read the request and closed its side: the spin sees the end of the stream,
    # returns at once, and the transport fails the call when the loop runs. (A server killed
    # with the request unread resets the connection instead: the test above.)
    monkeypatch.setattr(tcp, "SPIN_S", 0.5)
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    _, conn = await loop.create_unix_connection(lambda: tcp.Connection(loop), sock=ours)
    try:
        conn._last_task = asyncio.current_task()  # as if this task had made the last call
        fut = conn.send(encode_add(b"/k", 1), tcp.I64, 5.0, "add", ("k", 1))
        assert theirs.recv(64) == encode_add(b"/k", 1)
        theirs.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        conn.spin(fut)
        assert time.monotonic() - start < 0.4
        with pytest.raises(tcp.Lost, match="closed by the server"):
            await asyncio.wait_for(fut, 5)
    finally:
        conn.close()
        theirs.close()


async def test_tasks_that_take_turns_pipeline_instead_of_spinning(client: TCPStore, long_spin: None, any_loop: str) -> None:
    # 32 tasks making calls on one store: each call's request goes out with the others' in one
    # round trip. A spin would make each task wait out its own (the seq rate, not the pipe's).
    async def adder() -> None:
        for _ in range(50):
            await client.add(f"turns/{any_loop}", 1)

    before = client.stats()["spun"]
    await asyncio.gather(*(adder() for _ in range(32)))
    assert await client.add(f"turns/{any_loop}", 0) == 32 * 50
    assert client.stats()["spun"] - before <= 100


def test_the_spin_setting(caplog: pytest.LogCaptureFixture) -> None:
    assert tcp._spin_seconds(None) == tcp._spin_seconds("") == pytest.approx(100e-6)
    assert tcp._spin_seconds("0") == 0.0
    assert tcp._spin_seconds("250") == pytest.approx(250e-6)
    for bad in ("fast", "-5", "inf", "nan"):
        caplog.clear()
        assert tcp._spin_seconds(bad) == pytest.approx(100e-6)
        assert "AIODIST_STORE_SPIN_US" in caplog.text
