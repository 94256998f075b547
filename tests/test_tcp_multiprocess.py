"""TCPStore across real processes: a team of client processes around the test's master, 64
concurrent clients on one counter (with a raw socket sending garbage meanwhile), and the
standalone ``python -m aiodist.store`` server.

Client processes run ``tests/helpers/tcp_store_worker.py``; every process has a hard deadline
and is killed (and reaped) if the test fails early.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from aiodist.errors import DistError, DistNetworkError, StoreTimeoutError
from aiodist.store.tcp import TCPStore

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.one_loop(
        reason="the clients and the standalone server are child processes that run their own loops; this process starts them and waits on them"
    ),
]

HOST = "127.0.0.1"
WORKER = str(Path(__file__).parent / "helpers" / "tcp_store_worker.py")
REPO = str(Path(__file__).resolve().parents[1])
DEADLINE_S = 40.0  # no process of this file may live longer


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@asynccontextmanager
async def processes() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """A list to start processes into; on exit every one still running is killed and reaped."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:  # pragma: no cover
                pass


async def start_worker(procs: list[asyncio.subprocess.Process], *args: object) -> asyncio.subprocess.Process:
    p = await asyncio.create_subprocess_exec(
        sys.executable, WORKER, *map(str, args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env()
    )
    procs.append(p)
    return p


async def result_of(p: asyncio.subprocess.Process, timeout: float = DEADLINE_S) -> dict[str, object]:
    out, err = await asyncio.wait_for(p.communicate(), timeout)
    assert p.returncode == 0, f"worker exited {p.returncode}:\n{err.decode(errors='replace')}"
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def bound_socket() -> tuple[int, int]:
    """(fd, port) of a bound, not yet listening socket: a master takes the fd, so its port is
    known before the master's await (which waits for the workers) returns."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    return s.detach(), port


async def test_team_of_three_processes_around_a_master() -> None:
    """A master in this process and 3 client processes: the init/ join with world_size=4, adds,
    two barriers, and a queue with two producers and one consumer; totals are exact."""
    fd, port = bound_socket()
    async with processes() as procs:
        workers = [await start_worker(procs, "team", port, rank, 4) for rank in range(3)]
        # the master's await returns once all three client processes have joined
        m = await asyncio.wait_for(TCPStore(HOST, port, world_size=4, is_master=True, timeout=30, master_listen_fd=fd), DEADLINE_S)
        try:
            assert m.server is not None and m.server.state.get(b"init/") == b"4"
            await asyncio.wait_for(m.barrier("b1", 4), DEADLINE_S)
            assert await m.get("counter") == b"600"  # every add happened before its barrier arrival
            await asyncio.wait_for(m.barrier("b2", 4), DEADLINE_S)
            results = sorted([await result_of(w) for w in workers], key=lambda r: r["rank"])  # type: ignore[arg-type,return-value]
            assert [r["counter_after_barrier"] for r in results] == [600, 600, 600]
            popped = results[2]["popped"]
            assert isinstance(popped, list) and len(popped) == 100
            assert sorted(popped) == sorted(f"{r}:{i}" for r in (0, 1) for i in range(50))
            for r in (0, 1):  # one producer's items come out in its order
                mine = [p for p in popped if p.startswith(f"{r}:")]
                assert mine == [f"{r}:{i}" for i in range(50)]
            assert await m.queue_len("jobs") == 0
            assert [await m.get(f"rank/{r}") for r in range(3)] == [b"1", b"2", b"3"]
            assert await m.get("b1/num_members") == b"4"
        finally:
            await m.close()


async def test_64_clients_add_to_one_counter_with_garbage_alongside(caplog: pytest.LogCaptureFixture) -> None:
    """4 processes x 16 TCPStore objects (64 connections) x 1,000 adds = exactly 64,000, while
    raw sockets send garbage to the same server."""
    n_procs, n_stores, n_adds = 4, 16, 1000
    total = n_procs * n_stores * n_adds
    t0 = time.monotonic()
    m = await TCPStore(HOST, 0, is_master=True, timeout=30)
    try:
        assert m.server is not None
        async with processes() as procs:
            workers = [await start_worker(procs, "adder", m.port, i, n_stores, n_adds) for i in range(n_procs)]
            # first halves done: 64 connections open, half the adds counted
            await asyncio.wait_for(m.wait([f"half/{i}" for i in range(n_procs)], DEADLINE_S), DEADLINE_S)
            assert await m.get("counter") == str(total // 2).encode()
            assert m.server.stats()["clients"] >= n_procs * n_stores
            refused = m.server.stats().get("refused", 0)

            async def garbage(seed: int) -> None:
                reader, writer = await asyncio.open_connection(HOST, m.port)  # TCP, past the Unix fast path
                writer.write(bytes((seed * 37 + i * 101) % 238 + 18 for i in range(8192)))  # opcodes >= 18: all unknown
                await writer.drain()
                try:
                    assert await asyncio.wait_for(reader.read(), 5) == b""
                except ConnectionResetError:
                    pass
                writer.close()

            with caplog.at_level(logging.ERROR, logger="aiodist.store.server"):
                await garbage(0)  # while the 64 connections are open...
                await m.set("go", "1")
                await asyncio.gather(*(garbage(i) for i in range(1, 9)))  # ...and while they add
                results = [await result_of(w) for w in workers]
            assert m.server.stats()["refused"] == refused + 9
        assert await m.get("counter") == str(total).encode()
        lasts = [v for r in results for v in r["last"]]  # type: ignore[attr-defined]
        assert len(lasts) == n_procs * n_stores and max(lasts) == total and len(set(lasts)) == len(lasts)
    finally:
        await m.close()
    assert time.monotonic() - t0 < 30


async def test_standalone_server_process() -> None:
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodist.store", "--host", HOST, "--port", "0", "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env(),
    )  # fmt: skip
    try:
        assert p.stdout is not None
        line = (await asyncio.wait_for(p.stdout.readline(), DEADLINE_S)).decode()
        match = re.fullmatch(r"aiodist TCPStore server listening on (\S+):(\d+)\n", line)
        assert match, line
        assert match.group(1) == HOST
        port = int(match.group(2))
        assert 0 < port < 65536
        a = await TCPStore(HOST, port, timeout=5)
        b = await TCPStore(HOST, port, timeout=5)
        try:
            getter = asyncio.create_task(b.get("hello"))
            await a.set("hello", "world")
            assert await asyncio.wait_for(getter, 5) == b"world"
            assert await asyncio.gather(*(a.add("n", 1) for _ in range(50))) == list(range(1, 51))
            assert await b.get("n") == b"50"
            await a.queue_push("q", "x")
            assert await b.queue_pop("q") == b"x"
            assert sorted(await b.list_keys()) == ["hello", "n"]
        finally:
            await a.close()
            await b.close()
        p.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(p.wait(), 10)
        err = (await p.stderr.read()).decode(errors="replace") if p.stderr else ""
        assert rc == 0, err
        assert "Traceback" not in err, err
        with pytest.raises(DistNetworkError):
            await TCPStore(HOST, port, timeout=0.3)
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()


async def test_standalone_server_sigterm_with_clients_connected() -> None:
    """SIGTERM with clients still connected (one blocked in a get): the server exits cleanly and
    the blocked client fails promptly instead of hanging."""
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiodist.store", "--port", "0", "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env(),
    )  # fmt: skip
    try:
        assert p.stdout is not None
        line = (await asyncio.wait_for(p.stdout.readline(), DEADLINE_S)).decode()
        match = re.fullmatch(r"aiodist TCPStore server listening on \*:(\d+)\n", line)
        assert match, line
        port = int(match.group(1))
        c = await TCPStore(HOST, port, timeout=20)
        try:
            blocked = asyncio.create_task(c.get("never"))
            end = time.monotonic() + 10
            while c.stats()["waiter_connections"] != 1:  # its WAIT is on the wire
                assert time.monotonic() < end, "the get never started its WAIT"
                await asyncio.sleep(0.002)
            await c.set("k", "v")  # a round trip on the same store while the get waits
            assert not blocked.done()
            p.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(p.wait(), 10) == 0
            with pytest.raises(DistError) as info:
                await asyncio.wait_for(blocked, 5)  # well before its 20 s timeout
            assert not isinstance(info.value, StoreTimeoutError)
        finally:
            await c.close()
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
