"""TCPStore under faults: a server that stops answering (its loop frozen, as under SIGSTOP), and
the sans-I/O store parsers fed the same bytes split every way."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.errors import DistError, DistStoreError
from aiodist.store.server import ServerThread, TCPStoreServer
from aiodist.store.tcp import TCPStore
from aiodist.wire.store import (
    MAGIC,
    Limits,
    Op,
    ProtocolError,
    Reply,
    ReplyParser,
    RequestParser,
    encode,
    encode_bytes,
    encode_bytes_list,
    encode_i64,
    encode_queue_pop,
    encode_u8,
    encode_u32,
)

HOST = "127.0.0.1"
SLACK = 0.5  # what the issue allows past a call's own timeout


# -- a server that stops answering --------------------------------------------------------


class Frozen:
    """A ``ServerThread`` whose loop can be blocked, as SIGSTOP would stop its process: the
    kernel still accepts connections (the socket listens), nothing is read or answered."""

    def __init__(self, st: ServerThread) -> None:
        self.st = st
        self._go = threading.Event()
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        return self.st.server.port

    async def freeze(self) -> None:
        """Block the server's loop; return once it is blocked (requests sent before may have
        been answered, none sent after will be)."""
        assert self.st.loop is not None
        self._go.clear()
        self._stopped.clear()

        def stop() -> None:
            self._stopped.set()
            self._go.wait(10.0)

        self.st.loop.call_soon_threadsafe(stop)
        assert await asyncio.to_thread(self._stopped.wait, 5.0)

    def thaw(self) -> None:
        self._go.set()

    def reset_connections(self) -> None:
        """Abort every client connection (they see a reset)."""
        assert self.st.loop is not None

        def abort() -> None:
            for c in list(self.st.server._conns):
                if c.transport is not None:
                    c.transport.abort()

        self.st.loop.call_soon_threadsafe(abort)


@pytest.fixture
async def server() -> AsyncIterator[Frozen]:
    f = Frozen(await ServerThread(TCPStoreServer(HOST, 0)).astart())
    try:
        yield f
    finally:
        f.thaw()
        await f.st.astop()


async def client(server: Frozen, timeout: float) -> TCPStore:
    return await TCPStore(HOST, server.port, timeout=timeout)


async def timed(coro: Any) -> tuple[float, BaseException]:
    t = time.monotonic()
    with pytest.raises(DistError) as info:
        await coro
    return time.monotonic() - t, info.value


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_wait_timeout_bounds_the_missing_keys_check(server: Frozen) -> None:
    """The server answers the CHECK, then freezes under the WAIT: the error comes at the wait's
    timeout, not a second later (the CHECK naming the missing keys waited up to 1 s)."""
    store = await client(server, timeout=3)
    try:
        task = asyncio.ensure_future(store.wait(["k"], 0.4))
        await asyncio.sleep(0.1)  # the CHECK is answered and the WAIT sent
        await server.freeze()
        elapsed, exc = await timed(task)
        assert 0.35 <= elapsed < 0.4 + SLACK, elapsed
        assert f"{HOST}:{server.port}" in str(exc) and "timed out" in str(exc)
    finally:
        await store.close()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_wait_timeout_bounds_the_reconnect(server: Frozen) -> None:
    """The main connection was reset and the server is frozen: the reconnect is bounded by the
    wait's 0.4 s, not the store's timeout (it took the store's 3 s)."""
    store = await client(server, timeout=3)
    try:
        server.reset_connections()
        await asyncio.sleep(0.1)
        await server.freeze()
        elapsed, exc = await timed(store.wait(["k"], 0.4))
        assert elapsed < 0.4 + SLACK, elapsed
        assert f"{HOST}:{server.port}" in str(exc) or f"({HOST}, {server.port})" in str(exc)
    finally:
        await store.close()


async def test_short_wait_timeout_leaves_the_connection_to_the_others(server: Frozen) -> None:
    """A wait with a short timeout on a stopped server fails alone: a write pipelined on the same
    connection gets its answer once the server runs again (before, it failed with the wait)."""
    store = await client(server, timeout=3)
    try:
        await server.freeze()
        add = asyncio.ensure_future(store.add("n", 1))
        elapsed, exc = await timed(store.wait(["k"], 0.3))
        assert elapsed < 0.3 + SLACK and f"{HOST}:{server.port}" in str(exc)
        server.thaw()
        assert await asyncio.wait_for(add, 2) == 1
    finally:
        await store.close()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.7 s a run); a second loop waits them out again for the same result")
async def test_a_missed_deadline_names_itself_to_the_other_requests(server: Frozen) -> None:
    """One request overdue closes the connection: a write behind it is told which request was
    overdue (not "no reply within" its own timeout, which it did not wait), and a read behind it
    is retried on a new connection and succeeds once the server answers again."""
    store = await client(server, timeout=0.6)
    try:
        await store.set("x", "1")
        await server.freeze()
        first = asyncio.ensure_future(store.add("a", 1))  # overdue at 0.6 s
        await asyncio.sleep(0.4)
        write = asyncio.ensure_future(store.delete_key("x"))  # its own deadline: at 1.0 s
        read = asyncio.ensure_future(store.num_keys())
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, server.thaw)  # at 0.7 s: after the close, well before the read's deadline
        with pytest.raises(DistStoreError, match=r"no reply from the server within 0.6 s"):
            await first
        with pytest.raises(DistStoreError) as info:
            await write
        msg = str(info.value)
        assert "because add('a', 1)" in msg and "within 0.6 s" in msg, msg
        assert "delete_key('x')" in msg and "unknown" in msg
        assert await read >= 1
    finally:
        server.thaw()
        await store.close()


# -- the parsers: the same bytes, split any way ----------------------------------------------


def drive(feed: Callable[[bytes], None], step: Callable[[], object | None], chunks: list[bytes]) -> tuple[list[object], str | None]:
    """Feed ``chunks``, collecting every complete item; (the items, the error's text or None).
    After an error the parser must stay dead: both calls raise it again."""
    got: list[object] = []
    try:
        for c in chunks:
            feed(c)
            while (r := step()) is not None:
                got.append(r)
        while (r := step()) is not None:  # items of no bytes (an empty MULTI_GET reply) at the end
            got.append(r)
    except ProtocolError as exc:
        for again in (lambda: feed(b"\x00"), step):
            with pytest.raises(ProtocolError) as info:
                again()
            assert str(info.value) == str(exc)
        return got, str(exc)
    return got, None


def splits(data: bytes, cuts: list[int]) -> list[list[bytes]]:
    """The stream whole, byte by byte, and cut at ``cuts``."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [[data], [data[i : i + 1] for i in range(len(data))], [data[a:b] for a, b in zip(points, points[1:])]]


small = st.binary(max_size=12)
reply = st.one_of(
    st.integers(0, 255).map(lambda v: ((Reply.U8, 0), encode_u8(v))),
    st.integers(0, 2**32 - 1).map(lambda v: ((Reply.U32, 0), encode_u32(v))),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ((Reply.I64, 0), encode_i64(v))),
    small.map(lambda v: ((Reply.BYTES, 0), encode_bytes(v))),
    st.lists(small, max_size=3).map(lambda vs: ((Reply.BYTES_LIST, len(vs)), encode_bytes_list(vs))),
    st.lists(small, max_size=3).map(lambda vs: ((Reply.COUNTED_LIST, 0), encode_bytes_list(vs, counted=True))),
    small.map(lambda v: ((Reply.QUEUE_POP, 0), encode_queue_pop(len(v), v if v else None))),
)
shapes = st.sampled_from([(s, 0) for s in Reply if s is not Reply.BYTES_LIST] + [(Reply.BYTES_LIST, 2)])
TINY = Limits(max_key_bytes=16, max_value_bytes=16, max_keys=4, max_request_bytes=96)


@settings(max_examples=150, deadline=None)
@given(
    items=st.lists(reply, max_size=6),
    extra=st.lists(shapes, max_size=2),
    junk=st.binary(max_size=24),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_reply_parser_ignores_how_bytes_are_split(
    items: list[tuple[tuple[Reply, int], bytes]], extra: list[tuple[Reply, int]], junk: bytes, cuts: list[int]
) -> None:
    """Valid replies, then junk (bytes past the last reply owed, or the start of replies
    expected with ``extra`` shapes that the junk may break): every split gives the same replies
    and the same error, and after it the parser stays dead."""
    data = b"".join(d for _, d in items) + junk
    expected = [s for s, _ in items] + extra
    results = []
    for chunks in splits(data, cuts):
        p = ReplyParser(TINY)
        for shape, count in expected:
            p.expect(shape, count)
        results.append(drive(p.feed, p.next_reply, chunks))
    assert results[0] == results[1] == results[2]
    assert len(results[0][0]) >= len(items)  # the valid replies all came out, the last one too


def test_reply_after_the_last_one_owed_is_delivered_before_the_error() -> None:
    """The issue's case: the last reply and stray bytes in one chunk dropped that reply."""
    whole = ReplyParser()
    pieces = ReplyParser()
    for p in (whole, pieces):
        for _ in range(23):
            p.expect(Reply.I64)
    data = b"".join(encode_i64(i) for i in range(23)) + b"\x07"
    got, err = drive(whole.feed, whole.next_reply, [data])
    assert (got, err) == drive(pieces.feed, pieces.next_reply, [data[:-1], data[-1:]])
    assert got == list(range(23)) and err is not None and "unexpected" in err


def test_reply_parser_stays_dead_after_an_error() -> None:
    """A bad count used to leave a finished generator behind: the next call returned None and
    dropped an expected reply without a word."""
    p = ReplyParser()
    p.expect(Reply.COUNTED_LIST)
    p.expect(Reply.U8)
    p.feed(encode_i64(-1) + b"\x00")
    with pytest.raises(ProtocolError, match="bad key count"):
        p.next_reply()
    with pytest.raises(ProtocolError, match="bad key count"):
        p.next_reply()
    assert p.pending == 2


key = st.binary(max_size=20)
request = st.one_of(
    st.tuples(st.sampled_from([Op.SET, Op.APPEND, Op.QUEUE_PUSH]), key, key).map(lambda t: encode(t[0], (t[1],), (t[2],))),
    st.tuples(st.sampled_from([Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN]), key).map(lambda t: encode(t[0], (t[1],))),
    st.tuples(key, st.integers(-(2**63), 2**63 - 1)).map(lambda t: encode(Op.ADD, (t[0],), number=t[1])),
    st.tuples(st.sampled_from([Op.CHECK, Op.WAIT, Op.MULTI_GET]), st.lists(key, max_size=6)).map(lambda t: encode(t[0], t[1])),
    st.lists(st.tuples(key, key), max_size=5).map(lambda kv: encode(Op.MULTI_SET, [k for k, _ in kv], [v for _, v in kv])),
    st.tuples(key, key, key).map(lambda t: encode(Op.COMPARE_SET, (t[0],), (t[1], t[2]))),
    st.sampled_from(
        [encode(Op.GETNUMKEYS), encode(Op.LIST), encode(Op.CANCEL_WAIT), encode(Op.PING, number=7), encode(Op.VALIDATE, number=MAGIC)]
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    validate=st.booleans(),
    reqs=st.lists(request, max_size=6),
    junk=st.binary(max_size=24),
    cuts=st.lists(st.integers(0, 600), max_size=8),
)
def test_request_parser_ignores_how_bytes_are_split(validate: bool, reqs: list[bytes], junk: bytes, cuts: list[int]) -> None:
    """Requests (some over ``TINY``'s limits, a second VALIDATE, no VALIDATE first), then junk:
    every split gives the same requests and the same error; after it the parser stays dead. A
    request over ``max_request_bytes`` is refused however it arrives (in one chunk it used to
    pass)."""
    data = (encode(Op.VALIDATE, number=MAGIC) if validate else b"") + b"".join(reqs) + junk
    results = []
    for chunks in splits(data, cuts):
        p = RequestParser(TINY)
        results.append(drive(p.feed, p.next_request, chunks))
    assert results[0] == results[1] == results[2]


def test_request_over_the_size_cap_is_refused_in_one_chunk() -> None:
    big = encode(Op.MULTI_SET, [b"k%d" % i for i in range(4)], [b"v" * 16] * 4)
    assert len(big) > TINY.max_request_bytes
    data = encode(Op.VALIDATE, number=MAGIC) + big
    for chunks in ([data], [data[:10], data[10:]]):
        p = RequestParser(TINY)
        got, err = drive(p.feed, p.next_request, chunks)
        assert len(got) == 1 and err == f"request of over {TINY.max_request_bytes} bytes"
