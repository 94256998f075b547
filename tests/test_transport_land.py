"""The landing decision for an arriving DATA payload (aiodist/transport/_landing.py) as a table
over headers and mailboxes, pure (no socket, no I/O); then a ``Connection`` driven on bytes
against an owner that has nothing but the ``ConnectionOwner`` members, so the connection
cannot reach into the transport's privates; then ``Mailbox`` as the public name."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import aiodist.transport
from aiodist.transport import Mailbox, PostedRecv, StagedMessage
from aiodist.transport._connection import Connection, ConnectionOwner
from aiodist.transport._landing import GRACE_MIN_BYTES, Fate, Landing, decide
from aiodist.transport._mailbox import size_error
from aiodist.wire.frame import FrameHeader, FrameKind, FrameLimits, Hello, frame_parts, hello_frame

LIMITS = FrameLimits(max_staged_bytes=4 << 20)  # room for a GRACE_MIN_BYTES payload, and not for two
KEY = (3, 7, 5)  # (group, seq, tag) of every row's message unless it says otherwise
SRC = 1


def header(length: int = 16, *, key: tuple[int, int, int] = KEY, src: int = SRC, digest: int = 0) -> FrameHeader:
    return FrameHeader(FrameKind.DATA, key[0], key[1], key[2], src, length, 0, digest)


@dataclass
class Row:
    """One case: the receives posted (``(key, src, nbytes, done)``), the header, the call's
    other inputs, and the answer: its fate and which posted receive it names (an index into
    ``posted``)."""

    name: str
    fate: Fate
    length: int = 16
    posted: list[tuple[tuple[int, int, int], int | None, int, bool]] = field(default_factory=list)
    hdr: dict[str, Any] = field(default_factory=dict)
    kw: dict[str, Any] = field(default_factory=dict)
    recv: int | None = None


def posted(nbytes: int = 16, src: int | None = SRC, key: tuple[int, int, int] = KEY, done: bool = False) -> tuple[Any, ...]:
    return (key, src, nbytes, done)


BIG = GRACE_MIN_BYTES
ROWS = [
    Row("receive posted, sizes match: land", Fate.LAND, posted=[posted()], recv=0),
    Row("receive posted, sizes differ: mismatch (its receive fails)", Fate.MISMATCH, length=24, posted=[posted(16)], recv=0),
    Row("no receive, room: stage", Fate.STAGE, kw={"staged_bytes": 1000}),
    Row("no receive, exactly fills the room: stage", Fate.STAGE, length=1000, kw={"staged_bytes": LIMITS.max_staged_bytes - 1000}),
    Row("no receive, one byte over the room: hold", Fate.HOLD, length=1000, kw={"staged_bytes": LIMITS.max_staged_bytes - 999}),
    Row("no receive, bigger than the whole bound: hold (waits for its receive)", Fate.HOLD, length=LIMITS.max_staged_bytes + 1),
    Row("big, no receive, room: hold for the grace", Fate.GRACE, length=BIG),
    Row("big, no receive, room, grace over: stage", Fate.STAGE, length=BIG, kw={"grace_over": True}),
    Row("just under the grace size: stage at once", Fate.STAGE, length=BIG - 1),
    Row("big, no receive, no room: hold, not for the grace", Fate.HOLD, length=BIG, kw={"staged_bytes": LIMITS.max_staged_bytes - BIG + 1}),
    Row("big, receive posted: land (no grace)", Fate.LAND, length=BIG, posted=[posted(BIG)], recv=0),
    Row("group aborted, receive posted: drop", Fate.DROP, posted=[posted()], kw={"aborted": {3}}),
    Row(
        "group aborted, no receive, no room: drop (never held)",
        Fate.DROP,
        length=BIG,
        kw={"aborted": {3}, "staged_bytes": LIMITS.max_staged_bytes},
    ),
    Row("another group aborted: land", Fate.LAND, posted=[posted()], kw={"aborted": {4}}, recv=0),
    Row("any-source receive: land", Fate.LAND, posted=[posted(src=None)], recv=0),
    Row("receive from another rank only: stage", Fate.STAGE, posted=[posted(src=2)]),
    Row("earliest receive that accepts the source wins", Fate.LAND, posted=[posted(src=2), posted(src=None), posted(src=SRC)], recv=1),
    Row("a receive already done (cancelled) is passed over", Fate.LAND, posted=[posted(done=True), posted()], recv=1),
    Row("the only receive is done: stage", Fate.STAGE, posted=[posted(done=True)]),
    Row("another tag: stage", Fate.STAGE, posted=[posted(key=(3, 7, 6))]),
    Row("another seq: stage", Fate.STAGE, posted=[posted(key=(3, 8, 5))]),
    Row(
        "striped part: matched on its own tag",
        Fate.LAND,
        posted=[posted(key=(3, 7, 5 + (1 << 40)))],
        hdr={"key": (3, 7, 5 + (1 << 40))},
        recv=0,
    ),
    Row("zero-length, zero-length receive: land", Fate.LAND, length=0, posted=[posted(0)], recv=0),
    Row("zero-length, 4-byte receive: mismatch", Fate.MISMATCH, length=0, posted=[posted(4)], recv=0),
    Row("zero-length, no receive (in memory): stage", Fate.STAGE, length=0, kw={"in_memory": True}),
    Row(
        "in memory, no receive, no room: stage (it was read already)",
        Fate.STAGE,
        kw={"in_memory": True, "staged_bytes": LIMITS.max_staged_bytes},
    ),
    Row("in memory, receive posted: land (one copy)", Fate.LAND, posted=[posted()], kw={"in_memory": True}, recv=0),
    Row(
        "digest differs from this rank's op: desync, even with its receive posted",
        Fate.DESYNC,
        posted=[posted()],
        hdr={"digest": 0x1234},
        kw={"digest": 0x99},
    ),
    Row(
        "digest differs, group aborted: drop (the group broke already)",
        Fate.DROP,
        hdr={"digest": 0x1234},
        kw={"digest": 0x99, "aborted": {3}},
    ),
    Row("digest matches: land", Fate.LAND, posted=[posted()], hdr={"digest": 0x1234}, kw={"digest": 0x1234}, recv=0),
    Row("this rank's op not issued yet (digest unknown): stage", Fate.STAGE, hdr={"digest": 0x1234}, kw={"digest": None}),
    Row("frame without a digest (user p2p): not checked", Fate.LAND, posted=[posted()], kw={"digest": 0x99}, recv=0),
]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def mailbox(loop: asyncio.AbstractEventLoop, row: Row) -> tuple[Mailbox, list[PostedRecv]]:
    box = Mailbox()
    recvs = []
    for key, src, nbytes, done in row.posted:
        r = PostedRecv(key, src, np.zeros(nbytes, np.uint8), loop.create_future())
        if done:
            r.fut.cancel()
        box.post(r)
        recvs.append(r)
    return box, recvs


def test_table_is_big_enough() -> None:
    assert len(ROWS) >= 12 and {r.fate for r in ROWS} == set(Fate)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decide(row: Row, loop: asyncio.AbstractEventLoop) -> None:
    box, recvs = mailbox(loop, row)
    fate, recv = decide(header(row.length, **row.hdr), box, LIMITS, **row.kw)
    assert fate is row.fate
    assert recv is (None if row.recv is None else recvs[row.recv])
    # pure: the mailbox is as it was, and no future was touched
    assert box.pending == len(row.posted) and box.staged_messages == 0
    assert [r.fut.done() for r in recvs] == [p[3] for p in row.posted]


def test_mismatch_error_names_both_sizes(loop: asyncio.AbstractEventLoop) -> None:
    box, (r,) = mailbox(loop, Row("", Fate.MISMATCH, posted=[posted(16)]))
    assert decide(header(24), box, LIMITS) == (Fate.MISMATCH, r)
    err = size_error(0, SRC, r.key, 24, r.dst.nbytes)
    assert str(err) == "rank 0: message from rank 1 (group 3, seq 7, tag 5) is 24 bytes, the receive buffer 16"


def test_decide_does_not_stage() -> None:
    """A staged message is no receive: decide never answers with one."""
    box = Mailbox()
    box.stage(KEY, StagedMessage(SRC, memoryview(bytearray(16))))
    assert decide(header(), box, LIMITS) == (Fate.STAGE, None) and box.staged_messages == 1


# -- a Connection against an owner that has only the ConnectionOwner members -------------------


def protocol_members() -> set[str]:
    return {n for n in vars(ConnectionOwner) if not n.startswith("_")} | set(ConnectionOwner.__annotations__)


class StrictOwner:
    """Exactly ``ConnectionOwner``: any other attribute the connection asks for fails the test."""

    def __init__(self) -> None:
        self.rank = 0
        self.limits = FrameLimits(max_staged_bytes=64)
        self.hello = Hello(b"job", 0, 2)
        self.handshake_timeout = 10.0
        self.box = Mailbox()
        self.calls: list[str] = []
        self.staged: list[tuple[FrameHeader, bytes]] = []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a Connection asked its owner for {name!r}, which is not in ConnectionOwner")

    def attach(self, conn: Connection) -> None:
        self.calls.append("attach")

    def on_hello(self, conn: Connection, hello: Hello, lane: int) -> str | None:
        self.calls.append(f"hello {hello.rank} lane {lane}")
        return None if hello.token == b"job" else "another job"

    def on_header(self, conn: Connection, header: FrameHeader, staged_bytes: int, grace_over: bool) -> Landing:
        fate, recv = decide(header, self.box, self.limits, staged_bytes=staged_bytes, grace_over=grace_over)
        self.calls.append(f"header {header.tag} {fate.value}")
        if fate is Fate.LAND and recv is not None:
            self.box.claim(recv)
        return fate, recv

    def on_payload(self, conn: Connection, header: FrameHeader, data: memoryview) -> None:
        self.calls.append(f"payload {header.tag}")
        self.staged.append((header, bytes(data)))  # released by the test

    def on_abort(self, header: FrameHeader, reason: str) -> None:
        self.calls.append(f"abort {header.group} {reason}")

    def on_unheard(self, conn: Connection, why: str | None) -> None:
        self.calls.append("unheard")

    def on_lost(self, conn: Connection, err: BaseException, current: PostedRecv | None) -> None:
        self.calls.append("lost")


class FakeTransport:
    """The few asyncio transport calls a Connection makes, recorded."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.reading = True
        self.closing = False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return None

    def write(self, data: Any) -> None:
        self.out += bytes(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def abort(self) -> None:
        self.closing = True

    def close(self) -> None:
        self.closing = True


def feed(conn: Connection, data: bytes) -> None:
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def data_frame(tag: int, payload: bytes) -> bytes:
    h = FrameHeader(FrameKind.DATA, 0, 1, tag, 1, len(payload))
    return b"".join(bytes(p) for p in frame_parts(h, payload))


def test_strict_owner_is_the_protocol() -> None:
    ours = {n for n in vars(StrictOwner) if not n.startswith("_")} | {"rank", "limits", "hello", "handshake_timeout"}
    assert ours - {"box", "calls", "staged"} == protocol_members()
    assert len([n for n in protocol_members() if inspect.isfunction(getattr(ConnectionOwner, n, None))]) <= 7


async def test_connection_needs_only_the_owner_protocol() -> None:
    owner = StrictOwner()  # staging room: 64 bytes
    conn = Connection(owner, "unix")
    tr = FakeTransport()
    conn.connection_made(tr)  # type: ignore[arg-type]
    feed(conn, hello_frame(Hello(b"job", 1, 2), 0))
    assert conn.peer == 1 and conn.handshake.done() and tr.out  # answered with its own HELLO
    loop = asyncio.get_running_loop()
    r = PostedRecv((0, 1, 10), 1, np.zeros(8, np.uint8), loop.create_future())
    owner.box.post(r)
    feed(conn, data_frame(10, b"landed!!") + data_frame(11, b"early"))
    assert r.fut.result() == 1 and bytes(r.dst) == b"landed!!"  # landed in the receive's array
    assert owner.staged == [(FrameHeader(FrameKind.DATA, 0, 1, 11, 1, 5), b"early")] and conn.decoder.staged_bytes == 5
    feed(conn, data_frame(12, bytes(60)))  # 5 + 60 staged would be over 64: held
    assert not tr.reading and conn.held is not None
    conn.release_staged(5)  # the early message was consumed: room for the held one, retried soon
    assert conn.held is not None
    await asyncio.sleep(0)
    assert tr.reading and conn.held is None and owner.staged[-1] == (FrameHeader(FrameKind.DATA, 0, 1, 12, 1, 60), bytes(60))
    feed(conn, data_frame(13, bytes(range(10))))  # 60 + 10: held again
    assert not tr.reading
    late = PostedRecv((0, 1, 13), 1, np.zeros(10, np.uint8), loop.create_future())
    owner.box.post(late)
    conn.retry_held()  # what the owner does once a receive is posted
    assert tr.reading and conn.held is None and bytes(late.dst) == bytes(range(10))
    conn.connection_lost(None)
    assert owner.calls == [
        "attach",
        "hello 1 lane 0",
        "header 10 land",
        "header 11 stage",
        "payload 11",  # staged by the decoder, handed over whole
        "header 12 hold",
        "header 12 stage",
        "payload 12",
        "header 13 hold",
        "header 13 land",
        "lost",
    ]


async def test_connection_refused_hello() -> None:
    owner = StrictOwner()
    conn = Connection(owner, "tcp")
    tr = FakeTransport()
    conn.connection_made(tr)  # type: ignore[arg-type]
    feed(conn, hello_frame(Hello(b"other", 1, 2), 0))
    assert conn.peer is None and tr.closing and owner.calls == ["attach", "hello 1 lane 0"]
    conn.connection_lost(None)
    assert owner.calls[-1] == "lost"


# -- the public names -------------------------------------------------------------------------


def test_mailbox_is_public() -> None:
    for name in ("Mailbox", "PostedRecv", "StagedMessage"):
        assert name in aiodist.transport.__all__ and getattr(aiodist.transport, name).__doc__
    import aiodist.backends.memory as memory

    assert memory.Mailbox is aiodist.transport.Mailbox


def test_old_homes_still_export_message_helpers() -> None:
    """``byte_view`` and the tag limits moved below the transport (aiodist/_message.py);
    the algorithms and the backends still export them under their old names."""
    import aiodist._message as message
    import aiodist.algorithms as algorithms
    import aiodist.algorithms.p2p as p2p
    import aiodist.backends.base as base

    assert p2p.byte_view is message.byte_view and p2p.TAG_LIMIT == algorithms.TAG_LIMIT == message.TAG_LIMIT
    assert algorithms.CHANNEL_TAG_LIMIT == message.CHANNEL_TAG_LIMIT and base.P2P_SEQ == message.P2P_SEQ
