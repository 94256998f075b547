"""TCPStoreServer against raw sockets: bad input closes only the offending connection, and the
bytes of the protocol, opcode by opcode.

Requests here are built by hand with ``struct`` (not with aiodist's encoder), so an encoder and
a parser that agree with each other but not with torch would still be caught.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections.abc import AsyncIterator

import pytest
from helpers.streams import open_unix

from aiodist.errors import DistStoreError
from aiodist.store.server import ServerThread, TCPStoreServer
from aiodist.store.tcp import TCPStore
from aiodist.testing import until
from aiodist.wire.store import Limits

HOST = "127.0.0.1"
MAGIC = 0x3C85F7CE
IO_TIMEOUT_S = 3.0
LIMITS = Limits(max_value_bytes=1024, max_keys=16)

# opcodes, written out (torch's numbering)
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST = range(10, 18)


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def i64(n: int) -> bytes:
    return struct.pack("<q", n)


def s(b: bytes) -> bytes:
    return u64(len(b)) + b


def op(code: int, *fields: bytes) -> bytes:
    return bytes((code,)) + b"".join(fields)


def keys(*ks: bytes) -> bytes:
    return u64(len(ks)) + b"".join(s(k) for k in ks)


HELLO = op(VALIDATE, u32(MAGIC))


class Raw:
    """A raw connection to the server (asyncio streams on the test's loop)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, hello: bool = True) -> Raw:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), IO_TIMEOUT_S)
        raw = cls(reader, writer)
        if hello:
            await raw.send(HELLO)
        return raw

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read(self, n: int) -> bytes:
        return await asyncio.wait_for(self.reader.readexactly(n), IO_TIMEOUT_S)

    async def ask(self, request: bytes, reply_len: int) -> bytes:
        await self.send(request)
        return await self.read(reply_len)

    async def sync(self, nonce: int = 0xC0FFEE) -> None:
        """A PING round trip: everything sent before it has been handled by the server."""
        assert await self.ask(op(PING, u32(nonce)), 4) == u32(nonce)

    async def expect_closed(self) -> None:
        """The server closed this connection without replying: EOF (or a reset, when unread
        bytes were still in the server's receive buffer)."""
        got = b""
        try:
            async with asyncio.timeout(IO_TIMEOUT_S):
                while chunk := await self.reader.read(65536):
                    got += chunk
        except ConnectionResetError:
            pass
        assert got == b"", f"server replied {got[:64]!r} instead of closing"

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


@pytest.fixture
async def server() -> AsyncIterator[TCPStoreServer]:
    st = await ServerThread(TCPStoreServer(HOST, 0, limits=LIMITS)).astart()
    try:
        yield st.server
    finally:
        await st.astop()


@pytest.fixture
async def good(server: TCPStoreServer) -> AsyncIterator[TCPStore]:
    c = await TCPStore(HOST, server.port, timeout=5)
    try:
        yield c
    finally:
        await c.close()


# -- bad input closes that connection only -------------------------------------------------------

_rng = random.Random(1234)

BAD_INPUTS: dict[str, tuple[bytes, str | None]] = {
    # name: (bytes sent on a fresh connection, what the server's warning says)
    "garbage": (bytes(_rng.randrange(18, 256) for _ in range(4096)), "unknown opcode"),
    "garbage_after_validate": (HELLO + b"\xfe\xed\xfa\xce" * 64, "unknown opcode"),
    "no_validate_first": (op(SET, s(b"/k"), s(b"v")), "VALIDATE"),
    "ping_before_validate": (op(PING, u32(1)), "VALIDATE"),
    "bad_magic": (op(VALIDATE, u32(0xDEADBEEF)), "magic"),
    "second_validate": (HELLO + op(VALIDATE, u32(0x3C85F7CE)), "VALIDATE sent twice"),
    "unknown_opcode_99": (HELLO + bytes((99,)), "unknown opcode 99"),
    "unknown_opcode_18": (HELLO + bytes((18,)), "unknown opcode 18"),
    "absurd_key_length": (HELLO + op(GET, u64(2**60)), "over the limit"),
    "absurd_key_length_max_u64": (HELLO + op(SET, u64(2**64 - 1)), "over the limit"),
    "value_over_limit": (HELLO + op(SET, s(b"/big"), s(b"x" * 2000)), "over the limit"),
    "value_over_limit_header_only": (HELLO + op(SET, s(b"/big"), u64(1025)), "over the limit"),
    "compare_set_desired_over_limit": (HELLO + op(COMPARE_SET, s(b"/k"), s(b""), u64(5000)), "over the limit"),
    "too_many_keys_multi_get": (HELLO + op(MULTI_GET, keys(*[b"/k%d" % i for i in range(17)])), "over the limit"),
    "too_many_keys_check": (HELLO + op(CHECK, u64(2**40)), "over the limit"),
    "too_many_keys_wait": (HELLO + op(WAIT, u64(17)), "over the limit"),
    "too_many_keys_multi_set": (HELLO + op(MULTI_SET, u64(10**9)), "over the limit"),
    "add_on_non_integer": (HELLO + op(SET, s(b"/txt"), s(b"abc")) + op(ADD, s(b"/txt"), i64(1)), "not an integer"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
async def test_bad_input_closes_only_that_connection(
    name: str, server: TCPStoreServer, good: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    data, warning = BAD_INPUTS[name]
    assert await good.add("before", 1) == 1
    bystander = await Raw.open(server.port)  # another raw connection, idle meanwhile
    refused = server.stats().get("refused", 0)
    with caplog.at_level(logging.WARNING, logger="aiodist.store.server"):
        raw = await Raw.open(server.port, hello=False)
        try:
            await raw.send(data)
            await raw.expect_closed()
        finally:
            await raw.close()
    assert warning is not None
    records = [r for r in caplog.records if r.name == "aiodist.store.server" and r.levelno == logging.WARNING]
    assert any(warning in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert any(HOST in r.getMessage() for r in records), "the warning names the peer"
    assert server.stats()["refused"] == refused + 1
    # everyone else is unaffected
    assert await good.add("before", 1) == 2
    await good.set("after", "ok")
    assert await good.get("after") == b"ok"
    await bystander.sync()
    await bystander.close()
    assert not await good.check(["big"])  # nothing of the refused request was stored


async def test_truncated_frame_then_close(server: TCPStoreServer, good: TCPStore) -> None:
    raw = await Raw.open(server.port)
    await raw.sync()
    # a SET whose key says 10 bytes but carries 3, and no value: the peer goes away mid-frame
    await raw.send(op(SET, u64(10), b"/ab"))
    raw.writer.write_eof()
    await raw.expect_closed()
    await raw.close()
    await until(lambda: server.stats()["clients"] == 1, "the server to drop the half-sent connection")
    assert not await good.check(["ab"])
    assert await good.num_keys() == 0
    await good.set("k", "v")
    assert await good.get("k") == b"v"


async def test_truncated_frame_completed_later_is_served(server: TCPStoreServer) -> None:
    """Partial reads: a request may arrive in pieces (here one byte at a time)."""
    raw = await Raw.open(server.port, hello=False)
    frame = HELLO + op(SET, s(b"/k"), s(b"value")) + op(GET, s(b"/k")) + op(ADD, s(b"/n"), i64(-7))
    for b in frame:
        await raw.send(bytes((b,)))
    assert await raw.read(8 + 5) == s(b"value")
    assert await raw.read(8) == i64(-7)
    await raw.close()


async def test_bad_connections_while_a_client_works(server: TCPStoreServer, good: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Before, during and after: a client keeps working while many bad peers come and go."""
    stop = asyncio.Event()
    done = 0

    async def worker() -> None:
        nonlocal done
        while not stop.is_set():
            done += 1
            assert await good.add("counter", 1) == done
            await good.set(f"k{done % 8}", str(done))
            assert await good.get(f"k{done % 8}") == str(done).encode()

    async def bad(data: bytes) -> None:
        raw = await Raw.open(server.port, hello=False)
        try:
            await raw.send(data)
            await raw.expect_closed()
        finally:
            await raw.close()

    with caplog.at_level(logging.ERROR, logger="aiodist.store.server"):  # the warnings are expected: keep output quiet
        task = asyncio.create_task(worker())
        try:
            await until(lambda: done >= 10, "the client to get going")
            for _ in range(3):
                await asyncio.gather(*(bad(data) for data, _ in BAD_INPUTS.values()))
            assert not task.done()
            reached = done
            await until(lambda: done >= reached + 10, "the client to keep going")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
    assert int(await good.get("counter")) == done
    assert server.stats()["refused"] >= 3 * len(BAD_INPUTS)
    assert server.stats()["clients"] == 1  # only the good client's connection is left


async def test_bad_input_on_same_host_unix_socket() -> None:
    """A server on every interface also listens on an abstract Unix socket; bad input there is
    handled the same way."""
    from aiodist.store.server import local_socket_name

    st = await ServerThread(TCPStoreServer(None, 0, limits=LIMITS)).astart()
    try:
        name = local_socket_name(st.server.port)
        if name is None:
            pytest.skip("no same-host Unix socket on this platform")
        async with TCPStore(HOST, st.server.port, timeout=5) as c:
            await c.set("k", "v")
            for data in (b"\xff" * 64, op(VALIDATE, u32(1)), HELLO + op(GET, u64(2**60))):
                reader, writer = await open_unix(name)
                raw = Raw(reader, writer)
                await raw.send(data)
                await raw.expect_closed()
                await raw.close()
            assert await c.get("k") == b"v"
            reader, writer = await open_unix(name)
            raw = Raw(reader, writer)
            await raw.send(HELLO)
            assert await raw.ask(op(GET, s(b"/k")), 9) == s(b"v")
            await raw.close()
    finally:
        await st.astop()


async def test_client_refused_value_over_limit_recovers(server: TCPStoreServer, good: TCPStore) -> None:
    with pytest.raises(DistStoreError):
        await good.set("big", b"x" * (LIMITS.max_value_bytes + 1))
    with pytest.raises(DistStoreError):
        await good.multi_get([f"k{i}" for i in range(LIMITS.max_keys + 1)])
    await good.set("ok", b"x" * LIMITS.max_value_bytes)
    assert await good.get("ok") == b"x" * LIMITS.max_value_bytes
    assert await good.multi_get(["ok" for _ in range(LIMITS.max_keys)]) == [b"x" * LIMITS.max_value_bytes] * LIMITS.max_keys


# -- the bytes of each opcode -----------------------------------------------------------------------


@pytest.fixture
async def raw(server: TCPStoreServer) -> AsyncIterator[Raw]:
    r = await Raw.open(server.port)
    try:
        yield r
    finally:
        await r.close()


async def test_validate_has_no_reply(server: TCPStoreServer) -> None:
    r = await Raw.open(server.port, hello=False)
    await r.send(HELLO)
    await r.sync(7)  # the only bytes back are the PING's
    await r.close()


async def test_ping_echoes(raw: Raw) -> None:
    for nonce in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert await raw.ask(op(PING, u32(nonce)), 4) == u32(nonce)


async def test_set_get_and_missing_get(raw: Raw) -> None:
    await raw.send(op(SET, s(b"/k"), s(b"\x00v\xff")))
    assert await raw.ask(op(GET, s(b"/k")), 11) == s(b"\x00v\xff")
    assert await raw.ask(op(GET, s(b"/missing")), 8) == u64(0)  # a missing key answers empty
    await raw.send(op(SET, s(b"/empty"), s(b"")))
    assert await raw.ask(op(GET, s(b"/empty")), 8) == u64(0)
    assert await raw.ask(op(CHECK, keys(b"/empty")), 1) == b"\x00"  # but it exists


async def test_add(raw: Raw) -> None:
    assert await raw.ask(op(ADD, s(b"/n"), i64(5)), 8) == i64(5)
    assert await raw.ask(op(ADD, s(b"/n"), i64(-12)), 8) == i64(-7)
    assert await raw.ask(op(GET, s(b"/n")), 10) == s(b"-7")  # ASCII decimal
    assert await raw.ask(op(ADD, s(b"/n"), i64(0)), 8) == i64(-7)
    await raw.send(op(SET, s(b"/m"), s(b"41")))
    assert await raw.ask(op(ADD, s(b"/m"), i64(1)), 8) == i64(42)
    assert await raw.ask(op(ADD, s(b"/big"), i64(2**62)), 8) == i64(2**62)


async def test_add_overflow_wraps_like_torch(server: TCPStoreServer, caplog: pytest.LogCaptureFixture) -> None:
    r = await Raw.open(server.port)
    try:
        await r.send(op(ADD, s(b"/o"), i64(2**63 - 1)) + op(ADD, s(b"/o"), i64(1)) + op(ADD, s(b"/o"), i64(0)))
        assert await r.read(24) == i64(2**63 - 1) + i64(-(2**63)) + i64(-(2**63))
    finally:
        await r.close()


async def test_add_on_value_outside_i64_is_refused_cleanly(server: TCPStoreServer, caplog: pytest.LogCaptureFixture) -> None:
    """torch's server refuses (closes) an ADD on a stored value its stoll cannot parse."""
    r = await Raw.open(server.port)
    with caplog.at_level(logging.WARNING):
        await r.send(op(SET, s(b"/huge"), s(b"99999999999999999999999")) + op(ADD, s(b"/huge"), i64(1)))
        await r.expect_closed()
    await r.close()
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not errors, errors  # refused with the server's warning, not by a crash in its handler
    assert any(rec.name == "aiodist.store.server" for rec in caplog.records)


async def test_compare_set(raw: Raw) -> None:
    # missing key, empty expected: stores desired, returns desired
    assert await raw.ask(op(COMPARE_SET, s(b"/c"), s(b""), s(b"new")), 11) == s(b"new")
    # missing key, non-empty expected: returns expected, stores nothing
    assert await raw.ask(op(COMPARE_SET, s(b"/d"), s(b"exp"), s(b"des")), 11) == s(b"exp")
    assert await raw.ask(op(CHECK, keys(b"/d")), 1) == b"\x01"
    # present key, matching: sets desired
    assert await raw.ask(op(COMPARE_SET, s(b"/c"), s(b"new"), s(b"newer")), 13) == s(b"newer")
    # present key, not matching: returns the current value
    assert await raw.ask(op(COMPARE_SET, s(b"/c"), s(b"nope"), s(b"x")), 13) == s(b"newer")


async def test_check_num_keys_delete_list(raw: Raw) -> None:
    assert await raw.ask(op(CHECK, keys()), 1) == b"\x00"  # no keys: all present
    assert await raw.ask(op(CHECK, keys(b"/a")), 1) == b"\x01"
    assert await raw.ask(op(GETNUMKEYS), 8) == i64(0)
    assert await raw.ask(op(LIST), 8) == i64(0)
    await raw.send(op(SET, s(b"/a"), s(b"1")) + op(SET, s(b"/b"), s(b"2")))
    assert await raw.ask(op(CHECK, keys(b"/a", b"/b")), 1) == b"\x00"
    assert await raw.ask(op(CHECK, keys(b"/a", b"/zz")), 1) == b"\x01"
    assert await raw.ask(op(GETNUMKEYS), 8) == i64(2)
    listed = await raw.ask(op(LIST), 8 + 2 * 10)
    assert listed[:8] == i64(2)
    assert sorted([listed[8:18], listed[18:28]]) == [s(b"/a"), s(b"/b")]
    assert await raw.ask(op(DELETE_KEY, s(b"/a")), 8) == i64(1)
    assert await raw.ask(op(DELETE_KEY, s(b"/a")), 8) == i64(0)
    assert await raw.ask(op(GETNUMKEYS), 8) == i64(1)


async def test_append_multi_get_multi_set(raw: Raw) -> None:
    await raw.send(op(APPEND, s(b"/p"), s(b"po")) + op(APPEND, s(b"/p"), s(b"tato")))  # creates, then appends
    assert await raw.ask(op(GET, s(b"/p")), 14) == s(b"potato")
    await raw.send(op(MULTI_SET, u64(2), s(b"/x"), s(b"1"), s(b"/y"), s(b"22")))
    assert await raw.ask(op(MULTI_GET, keys(b"/x", b"/y", b"/p")), 9 + 10 + 14) == s(b"1") + s(b"22") + s(b"potato")
    await raw.send(op(MULTI_GET, keys()))  # no keys: no bytes back
    await raw.sync()


async def test_queue_ops(raw: Raw) -> None:
    assert await raw.ask(op(QUEUE_POP, s(b"/q")), 8) == i64(0)  # empty: i64 0 and nothing else
    assert await raw.ask(op(QUEUE_LEN, s(b"/q")), 8) == i64(0)
    await raw.send(op(QUEUE_PUSH, s(b"/q"), s(b"a")) + op(QUEUE_PUSH, s(b"/q"), s(b"bb")))
    assert await raw.ask(op(QUEUE_LEN, s(b"/q")), 8) == i64(2)
    assert await raw.ask(op(CHECK, keys(b"/q")), 1) == b"\x00"  # a non-empty queue counts
    assert await raw.ask(op(GETNUMKEYS), 8) == i64(0)  # but not as a key
    assert await raw.ask(op(QUEUE_POP, s(b"/q")), 8 + 9) == i64(2) + s(b"a")  # length before the pop
    assert await raw.ask(op(QUEUE_POP, s(b"/q")), 8 + 10) == i64(1) + s(b"bb")
    assert await raw.ask(op(QUEUE_POP, s(b"/q")), 8) == i64(0)
    assert await raw.ask(op(CHECK, keys(b"/q")), 1) == b"\x01"


async def test_pipelined_wait_then_get(server: TCPStoreServer, raw: Raw) -> None:
    """A pending WAIT does not hold up the connection: the GET behind it is answered first,
    and STOP_WAITING comes once another connection sets the key."""
    await raw.send(op(SET, s(b"/a"), s(b"1")) + op(WAIT, keys(b"/w")) + op(GET, s(b"/a")) + op(PING, u32(99)))
    assert await raw.read(9) == s(b"1")  # GET's reply, not the WAIT's
    assert await raw.read(4) == u32(99)  # and the PING behind it: the WAIT is still pending
    assert server.stats()["waiters"] == 1
    other = await Raw.open(server.port)
    await other.send(op(SET, s(b"/w"), s(b"x")))
    await other.sync()
    assert await raw.read(1) == b"\x00"  # STOP_WAITING
    await raw.sync()  # nothing else came
    assert server.stats()["waiters"] == 0
    await other.close()


async def test_wait_on_existing_keys_answers_at_once(raw: Raw) -> None:
    await raw.send(op(SET, s(b"/a"), s(b"1")))
    assert await raw.ask(op(WAIT, keys(b"/a")), 1) == b"\x00"
    assert await raw.ask(op(WAIT, keys()), 1) == b"\x00"


async def test_wait_for_several_keys(server: TCPStoreServer, raw: Raw) -> None:
    other = await Raw.open(server.port)
    await raw.send(op(WAIT, keys(b"/a", b"/b")))
    await raw.sync(1)
    await other.send(op(SET, s(b"/a"), s(b"1")))
    await other.sync()
    await raw.sync(2)  # one of two keys: still waiting (only the echo came back)
    await other.send(op(ADD, s(b"/b"), i64(1)))
    assert await other.read(8) == i64(1)
    assert await raw.read(1) == b"\x00"
    await other.close()


async def test_cancel_wait(server: TCPStoreServer, raw: Raw) -> None:
    await raw.send(op(WAIT, keys(b"/never")) + op(CANCEL_WAIT))
    assert await raw.read(1) == b"\x01"  # WAIT_CANCELED
    assert server.stats()["waiters"] == 0
    other = await Raw.open(server.port)
    await other.send(op(SET, s(b"/never"), s(b"now")))
    await other.sync()
    await raw.sync(5)  # the cancelled WAIT sends nothing when its key appears
    assert await raw.ask(op(CANCEL_WAIT), 1) == b"\x01"  # with nothing pending, still answered
    await other.close()


async def test_wait_woken_by_queue_push_wakes_one(server: TCPStoreServer) -> None:
    w1, w2, pusher = [await Raw.open(server.port) for _ in range(3)]
    await w1.send(op(WAIT, keys(b"/q")))
    await w1.sync()
    await w2.send(op(WAIT, keys(b"/q")))
    await w2.sync()
    assert server.stats()["waiters"] == 2
    await pusher.send(op(QUEUE_PUSH, s(b"/q"), s(b"item")))
    await pusher.sync()
    assert await w1.read(1) == b"\x00"  # the oldest waiter is woken...
    assert server.stats()["waiters"] == 1  # ...and only it
    assert await w1.ask(op(QUEUE_POP, s(b"/q")), 8 + 12) == i64(1) + s(b"item")
    await pusher.send(op(QUEUE_PUSH, s(b"/q"), s(b"item2")))
    await pusher.sync()
    assert await w2.read(1) == b"\x00"
    for r in (w1, w2, pusher):
        await r.close()


async def test_closed_connection_drops_its_waiters(server: TCPStoreServer) -> None:
    r = await Raw.open(server.port)
    await r.send(op(WAIT, keys(b"/a")) + op(WAIT, keys(b"/b", b"/c")))
    await r.sync()
    assert server.stats()["waiters"] == 2  # two WAITs (one of them on two keys)
    await r.close()
    await until(lambda: server.stats()["waiters"] == 0, "the server to drop the closed connection's waiters")


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_peer_that_never_reads_does_not_make_the_server_buffer_without_bound(server: TCPStoreServer, good: TCPStore) -> None:
    value = b"v" * LIMITS.max_value_bytes
    await good.set("v", value)
    n = 20_000  # 20k GETs of 1 KiB: ~20 MiB of replies from ~260 KiB of requests
    reader, writer = await asyncio.open_connection(HOST, server.port, limit=2**16)
    sock = writer.get_extra_info("socket")
    try:
        writer.transport.pause_reading()  # never read: the replies pile up on the server
        writer.write(HELLO + op(GET, s(b"/v")) * n)
        await good.ping()  # the server is still responsive meanwhile

        def buffered() -> int:  # white-box: what the server holds for its peers
            return sum(c.transport.get_write_buffer_size() for c in list(server._conns) if c.transport is not None)

        end = time.monotonic() + 1.0
        peak = 0
        while time.monotonic() < end:  # a bounded look for the (bad) growth; it appears at once if at all
            peak = max(peak, buffered())
            if peak > 4 * 2**20:
                break
            await asyncio.sleep(0.01)
        assert peak <= 4 * 2**20, f"server buffered {peak} bytes for a peer that does not read"
    finally:
        writer.transport.resume_reading()
        del sock
        writer.close()


async def test_many_requests_in_one_write(raw: Raw) -> None:
    n = 2000
    await raw.send(b"".join(op(ADD, s(b"/n"), i64(1)) for _ in range(n)))
    got = await raw.read(8 * n)
    assert [struct.unpack_from("<q", got, 8 * i)[0] for i in range(n)] == list(range(1, n + 1))
