"""Faults and bounds of the transport: a flood of sends to a late receiver keeps the
sender's memory bounded on both loops (no write to a paused connection); connections that never
complete their handshake are closed after the handshake deadline, and their memory and fds come
back, while a real job runs on; a failed ``Work``'s repr does not silence asyncio's warning."""

# ruff: noqa: B023

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import numpy as np
import pytest

from aiodist import DistBackendError, HashStore
from aiodist.c10d.work import Work
from aiodist.testing import until
from aiodist.transport import FrameLimits, Transport
from aiodist.wire.frame import FIRST_READ_AHEAD, FrameDecoder, FrameKind, HeaderReceived, Hello, PayloadReceived, encode_header, hello_frame

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def rss() -> int:
    """This process's resident set size, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")  # pragma: no cover


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class PeakRSS:
    """Samples ``rss()`` every millisecond in a thread: the peak of a span of time."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


@asynccontextmanager
async def pair(**kw: Any) -> AsyncIterator[list[Transport]]:
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, 2, token="faults", timeout=20, **kw) for r in range(2))))
    try:
        await ts[0].connect()
        yield ts
    finally:
        await asyncio.gather(*(t.close() for t in ts))


# -- a flood of sends to a late receiver ------------------------------------------------------


@pytest.mark.parametrize("unix", [True, False], ids=["unix", "tcp"])
async def test_send_flood_to_a_late_receiver_keeps_sender_memory_bounded(unix: bool, any_loop: str) -> None:
    """8 x 8 MiB sends issued at once (as isends are) to a rank that posts its receives 0.5 s
    later, with a staging bound that holds them all back: the sends wait for the connection to
    resume instead of being written to it while it is paused (asyncio's selector transport
    would copy every unsent remainder: +56 MiB here). Extra memory stays under 0.3 x the bytes
    in flight, every byte arrives."""
    n, size = 8, 8 * MIB
    rng = np.random.default_rng(14)
    srcs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    dsts = [np.full(size, 0, np.uint8) for _ in range(n)]  # touched now, not while receiving
    async with pair(unix=unix, limits=FrameLimits(max_staged_bytes=64 * 1024)) as ts:
        gc.collect()
        before = rss()
        with PeakRSS() as peak:
            sends = [asyncio.create_task(ts[0].send(1, s, tag=i)) for i, s in enumerate(srcs)]
            await asyncio.sleep(0.5)
            assert not any(s.done() for s in sends[1:]), "the receiver should hold the sender back"
            during = rss()
            got = await asyncio.gather(*(ts[1].recv(0, d, tag=i) for i, d in enumerate(dsts)))
            await asyncio.gather(*sends)
        after = rss()
    in_flight = n * size
    extra = peak.peak - before
    print(
        f"[{any_loop}, {'unix' if unix else 'tcp'}] in flight {in_flight / MIB:.0f} MiB: RSS before {before / MIB:.1f} MiB, "
        f"while held +{(during - before) / MIB:.1f}, peak +{extra / MIB:.1f}, after +{(after - before) / MIB:.1f}"
    )
    assert got == [0] * n
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)
    assert extra <= 0.3 * in_flight, f"sender memory grew by {extra / MIB:.1f} MiB for {in_flight / MIB:.0f} MiB in flight"


# -- connections that never say HELLO ---------------------------------------------------------


def idle_count(t: Transport) -> int:
    return sum(c.peer is None for c in t._conns)


async def exchange_rounds(ts: list[Transport], rounds: int, tag0: int) -> None:
    """A real job: both ranks send each other 256 KiB and check every byte."""
    for i in range(rounds):
        a = np.full(1 << 16, i, np.float32)
        b = np.full(1 << 16, -i, np.float32)
        ra, rb = np.empty_like(a), np.empty_like(b)
        async with asyncio.timeout(10):
            await asyncio.gather(
                ts[0].send(1, a, tag=tag0 + i),
                ts[1].send(0, b, tag=tag0 + i),
                ts[1].recv(0, ra, tag=tag0 + i),
                ts[0].recv(1, rb, tag=tag0 + i),
            )
        assert np.array_equal(ra, a) and np.array_equal(rb, b)


def test_handshake_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.transport._transport import HANDSHAKE_TIMEOUT_S, _handshake_timeout

    monkeypatch.delenv("AIODIST_HANDSHAKE_TIMEOUT", raising=False)
    assert _handshake_timeout(None) == HANDSHAKE_TIMEOUT_S == 10
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "2.5")
    assert _handshake_timeout(None) == 2.5 and _handshake_timeout(1) == 1  # the argument wins
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="AIODIST_HANDSHAKE_TIMEOUT"):
            _handshake_timeout(None)


def open_idle(where: list[tuple[int, Any]], n: int) -> list[socket.socket]:
    """``n`` connections to each address that never say HELLO (every 25th sends half a header)."""
    out = []
    for family, addr in where:
        for i in range(n):
            c = socket.socket(family, socket.SOCK_STREAM)
            out.append(c)
            c.connect(addr)
            if i % 25 == 0:
                c.sendall(bytes([0xA2, 0]) + bytes(18))
            c.setblocking(False)
    return out


async def test_idle_connections_are_closed_after_the_handshake_deadline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, any_loop: str
) -> None:
    """100 TCP and 100 Unix connections to a rank's listeners that never complete a HELLO (a few
    send half of one): closed once ``AIODIST_HANDSHAKE_TIMEOUT`` passes, summed up in one
    warning; while they are open they cost little memory (a small read-ahead each), and after
    it the rank's fds and memory are back where they were. A real job runs on meanwhile."""
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "1.5")
    caplog.set_level(logging.INFO, "aiodist.transport")
    loop = asyncio.get_running_loop()
    if any_loop == "asyncio":
        # debug mode keeps a traceback with every handle and future (~20 KiB per connection
        # here): not what a rank pays. tests/conftest.py's loop refuses set_debug(False).
        monkeypatch.setattr(loop, "set_debug", functools.partial(asyncio.BaseEventLoop.set_debug, cast(asyncio.BaseEventLoop, loop)))
        loop.set_debug(False)
    n = 100
    async with pair() as ts:
        t = ts[1]
        assert t.address is not None and t.address.unix is not None
        await exchange_rounds(ts, 2, 0)
        gc.collect()
        rss0, fds0 = rss(), open_fds()
        started = time.monotonic()
        clients = await asyncio.to_thread(open_idle, [(socket.AF_INET, ("127.0.0.1", t.address.port)), (socket.AF_UNIX, t.address.unix)], n)
        await until(lambda: idle_count(t) == 2 * n, "the listeners to accept every idle connection", 5)
        gc.collect()
        rss1, fds1 = rss(), open_fds()
        await exchange_rounds(ts, 3, 10)  # a job runs on meanwhile
        await until(lambda: idle_count(t) == 0, "the handshake deadline to close the idle connections", 10)
        waited = time.monotonic() - started
        for c in clients:  # each one sees its connection closed by the rank
            try:
                assert await asyncio.wait_for(loop.sock_recv(c, 16), 5) == b""
            except ConnectionResetError:
                pass
        await exchange_rounds(ts, 3, 20)
        assert (
            t.handshake_timeout == 1.5
            and t.stats()["handshake_timeouts"] == 2 * n
            and t.stats()["dead_peers"] == []
            and ts[0].stats()["dead_peers"] == []
        )
        gc.collect()
        fds2 = open_fds()
        for c in clients:
            c.close()
        clients.clear()
        gc.collect()
        rss3, fds3 = rss(), open_fds()

        def said(level: int) -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.levelno == level and "sent no HELLO" in r.getMessage()]

        await until(lambda: len(said(logging.WARNING)) == 1, "the summary warning", 5)
    print(
        f"[{any_loop}] {2 * n} idle connections: fds {fds0} -> {fds1} -> {fds2} (clients still open) -> {fds3}; "
        f"RSS {rss0 / MIB:.1f} MiB, with them open +{(rss1 - rss0) / MIB:.2f} MiB, after +{(rss3 - rss0) / MIB:.2f} MiB; closed within {waited:.2f} s"
    )
    assert fds1 == fds0 + 4 * n  # each idle connection: the client's socket and the rank's
    assert fds2 == fds0 + 2 * n  # the rank's side closed
    assert fds3 <= fds0
    assert rss1 - rss0 < 2 * n * 16 * 1024, f"{2 * n} idle connections cost {(rss1 - rss0) / MIB:.1f} MiB"
    assert rss3 - rss0 < 4 * MIB
    warned = said(logging.WARNING)
    assert len(warned) == 1, [r.getMessage() for r in warned]  # one summary, not one line per connection
    total = sum(int(r.getMessage().split("closed ")[1].split()[0]) for r in warned + said(logging.INFO))
    assert total == 2 * n, [r.getMessage() for r in warned + said(logging.INFO)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "sent no HELLO" not in r.getMessage()]


async def test_hello_that_came_while_the_loop_was_blocked_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop is blocked past an accepted connection's deadline while its HELLO arrives: the
    HELLO is read before the connection is closed (uvloop runs timers before polling)."""
    monkeypatch.setenv("AIODIST_HANDSHAKE_TIMEOUT", "0.2")
    async with pair() as ts:
        t = ts[1]
        assert t.address is not None
        c = socket.create_connection(("127.0.0.1", t.address.port))
        try:
            await until(lambda: idle_count(t) == 1, "the connection to be accepted")
            hello = hello_frame(Hello(b"faults", 0, 2))
            sender = threading.Timer(0.1, c.sendall, (hello,))
            sender.start()
            block_the_loop(0.4)  # past the deadline; the HELLO comes meanwhile
            sender.join()
            await until(lambda: idle_count(t) == 0, "the HELLO to be read")
            assert t.stats()["handshake_timeouts"] == 0 and len(t._conns) == 2
            await exchange_rounds(ts, 1, 0)
        finally:
            c.close()


def block_the_loop(seconds: float) -> None:
    time.sleep(seconds)


# -- the decoder's read-ahead before HELLO ----------------------------------------------------


def test_read_ahead_is_small_until_hello() -> None:
    dec = FrameDecoder(first_read_ahead=FIRST_READ_AHEAD)
    assert len(dec.get_buffer()) == FIRST_READ_AHEAD
    long_hello = hello_frame(Hello(b"t" * 500, 1, 2))  # longer than the first buffer
    frame = long_hello + encode_header(FrameKind.DATA, 0, 0, 0, 1, 3) + b"abc"
    events = dec.feed(frame)
    assert [type(e).__name__ for e in events] == ["HelloReceived", "HeaderReceived"]
    assert [type(e).__name__ for e in dec.set_target(None)] == ["PayloadReceived"]
    assert len(dec.get_buffer()) == 64 * 1024  # full size once the peer is known
    assert len(FrameDecoder().get_buffer()) == 64 * 1024  # the default: full size at once
    assert len(FrameDecoder(require_hello=False, first_read_ahead=FIRST_READ_AHEAD).get_buffer()) == 64 * 1024
    with pytest.raises(ValueError, match="first_read_ahead"):
        FrameDecoder(first_read_ahead=8)


def decode_in_reads(dec: FrameDecoder, stream: bytes, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """Run ``stream`` through the BufferedProtocol side in reads of random sizes; stage every payload."""
    out: list[tuple[str, bytes]] = []
    off = 0
    while off < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - off, int(rng.integers(1, 3000)))
        buf[:n] = stream[off : off + n]
        off += n
        events = dec.buffer_updated(n)
        while events:
            later: list[Any] = []
            for ev in events:
                if isinstance(ev, HeaderReceived):
                    later = dec.set_target(None)
                elif isinstance(ev, PayloadReceived):
                    assert ev.staged is not None
                    out.append((f"data {ev.header.tag}", bytes(ev.staged)))
                    dec.release_staged(len(ev.staged))
                else:
                    out.append((type(ev).__name__, b""))
            events = later
    return out


def test_small_first_read_ahead_decodes_the_same() -> None:
    rng = np.random.default_rng(7)
    frames = [hello_frame(Hello(b"job" * 40, 1, 2))]
    for i in range(300):
        payload = rng.integers(0, 256, int(rng.choice([0, 1, 39, 40, 41, 300, 5000])), dtype=np.uint8).tobytes()
        frames.append(encode_header(FrameKind.DATA, 0, 0, i, 1, len(payload)) + payload)
    stream = b"".join(frames)
    for seed in range(5):
        whole = decode_in_reads(FrameDecoder(), stream, np.random.default_rng(seed))
        small = decode_in_reads(FrameDecoder(first_read_ahead=FIRST_READ_AHEAD), stream, np.random.default_rng(seed))
        assert small == whole and len(whole) == 301


# -- Work.__repr__ --------------------------------------------------------------------------------


async def test_repr_of_a_failed_work_leaves_asyncio_warning() -> None:
    """repr() of a failed Work nobody awaited must not mark its error as retrieved."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        w = Work("all_reduce", "group 0", 3, [])
        assert repr(w) == "<Work all_reduce group 0 seq 3 pending>"
        w._fail(DistBackendError("boom"))
        assert repr(w) == "<Work all_reduce group 0 seq 3 failed>"
        del w
        gc.collect()
        assert any("never retrieved" in ctx["message"] for ctx in seen), seen
        ok = Work("barrier", "group 0", 4, [])
        ok._complete()
        assert repr(ok) == "<Work barrier group 0 seq 4 completed>"
    finally:
        loop.set_exception_handler(old)
