"""The transport's receiving side (aiodist/transport/_inbox.py) with no socket: an ``Inbox`` driven
as a table of arriving headers, arriving payloads and sends to self, against fake connections
(what they are handed back: staging room, retries) and a fake route, each row checking what
happened to the posted receives, the staged messages, the held connections and the group."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from aiodist.errors import DistBackendError, DistNetworkError
from aiodist.transport._digests import DigestBook
from aiodist.transport._inbox import Inbox
from aiodist.transport._landing import GRACE_MIN_BYTES, Fate
from aiodist.transport._mailbox import PostedRecv, StagedMessage
from aiodist.transport._standing import Standing
from aiodist.wire.frame import FrameHeader, FrameKind, FrameLimits

ME = 0
SRC = 1
KEY = (3, 7, 5)
LIMITS = FrameLimits(max_staged_bytes=4 << 20)


class FakeConn:
    """A connection as the inbox sees it: its peer, and what it gets back."""

    def __init__(self, peer: int | None = SRC) -> None:
        self.peer = peer
        self.released = 0
        self.retries = 0

    def release_staged(self, nbytes: int) -> None:
        self.released += nbytes

    def retry_held(self) -> None:
        self.retries += 1


class FakeRoute:
    """The dialer as the inbox sees it: no striping; records the connections asked for."""

    striping = False
    stripe_min_bytes = 1 << 30
    lanes = 1

    def __init__(self) -> None:
        self.wanted: list[int] = []

    def splits(self, peer: int, nbytes: int, seq: int) -> bool:
        return False

    def want_connection(self, peer: int) -> None:
        self.wanted.append(peer)

    def report(self, peers: Any) -> str:
        return "; (never connected)"


def make(conns: Iterable[FakeConn] = ()) -> tuple[Inbox, Standing, DigestBook, list[tuple[int, ...]], FakeRoute]:
    standing, book, route = Standing(ME), DigestBook(), FakeRoute()
    desyncs: list[tuple[int, ...]] = []
    inbox = Inbox(ME, 4, 5.0, LIMITS, standing, book, route, lambda *a: desyncs.append(a), conns)
    return inbox, standing, book, desyncs, route


def header(length: int = 16, *, key: tuple[int, int, int] = KEY, src: int = SRC, digest: int = 0) -> FrameHeader:
    return FrameHeader(FrameKind.DATA, key[0], key[1], key[2], src, length, 0, digest)


@dataclass
class Row:
    """One event (``header``, ``payload`` or ``self``: a send to self) of ``length`` bytes, the
    receives posted before it (``(src, nbytes)``, key ``KEY``), the world around it, and what
    must follow: the header's fate, the receive that got the bytes or failed (an index), the
    staged messages, whether the connection is held, the desync reported, the bytes given back
    to the connection, an error raised."""

    name: str
    event: str
    length: int = 16
    posted: list[tuple[int | None, int]] = field(default_factory=list)
    digest: int = 0  # the frame's
    mine: int | None = None  # this rank's digest for the op (None: not issued yet)
    aborted: bool = False
    staged_bytes: int = 0
    fate: Fate | None = None
    got: int | None = None
    failed: int | None = None
    staged: int = 0
    held: bool = False
    desync: bool = False
    released: int = 0
    raises: str | None = None


BIG = GRACE_MIN_BYTES
ROWS = [
    # a DATA header (the connection then reads the payload where the fate says)
    Row("header, receive posted: land, the receive claimed", "header", posted=[(SRC, 16)], fate=Fate.LAND),
    Row("header, no receive, room: stage (the payload comes whole later)", "header", fate=Fate.STAGE),
    Row("header, no room: hold, the connection remembered", "header", staged_bytes=LIMITS.max_staged_bytes - 8, fate=Fate.HOLD, held=True),
    Row("header, big, room: the grace, held", "header", length=BIG, fate=Fate.GRACE, held=True),
    Row("header, sizes differ: mismatch, its receive fails", "header", length=24, posted=[(SRC, 16)], fate=Fate.MISMATCH, failed=0),
    Row("header, group aborted: drop, the receive left alone", "header", posted=[(SRC, 16)], aborted=True, fate=Fate.DROP),
    Row("header, digest not this rank's: desync", "header", posted=[(SRC, 16)], digest=0x12, mine=0x34, fate=Fate.DESYNC, desync=True),
    Row("header, digest agrees: land", "header", posted=[(SRC, 16)], digest=0x12, mine=0x12, fate=Fate.LAND),
    Row("header, op not issued here yet: stage (the digest is kept)", "header", digest=0x12, fate=Fate.STAGE),
    Row("header, receive from another rank only: stage", "header", posted=[(2, 16)], fate=Fate.STAGE),
    # a whole payload (staged as it was read, or zero-length)
    Row("payload, no receive: staged", "payload", staged=1),
    Row("payload, receive posted meanwhile: one copy into it", "payload", posted=[(None, 16)], got=0, released=16),
    Row("payload, receive of another size: it fails", "payload", posted=[(SRC, 8)], failed=0, released=16),
    Row("payload, group aborted: dropped", "payload", posted=[(SRC, 16)], aborted=True, released=16),
    Row("zero-length payload, digest not this rank's: desync", "payload", length=0, digest=0x12, mine=0x34, desync=True),
    Row("zero-length payload, no receive: staged", "payload", length=0, staged=1),
    # a send to self (no socket: the inbox takes it at once)
    Row("self, receive posted: copied into it", "self", posted=[(ME, 16)], got=0),
    Row("self, any-source receive posted: copied into it", "self", posted=[(None, 16)], got=0),
    Row("self, receive from another rank only: staged", "self", posted=[(SRC, 16)], staged=1),
    Row("self, no receive, fits: a staged copy", "self", staged=1),
    Row("self, over the bound: refused, nothing staged", "self", length=LIMITS.max_staged_bytes + 1, raises="post the receive first"),
    Row("self, receive of another size: it fails", "self", posted=[(ME, 8)], failed=0),
]


def test_table_covers_every_fate_and_event() -> None:
    assert {r.fate for r in ROWS if r.fate} == set(Fate)
    assert {r.event for r in ROWS} == {"header", "payload", "self"}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
async def test_inbox(row: Row) -> None:
    conn = FakeConn()
    inbox, standing, book, desyncs, _ = make((conn,))
    loop = asyncio.get_running_loop()
    if row.mine is not None:
        assert book.record(KEY[0], KEY[1], row.mine, ("all_reduce", None, None), 2) is None
    if row.aborted:
        standing.break_group(KEY[0], "group 3 broke")
    recvs = [PostedRecv(KEY, src, np.zeros(n, np.uint8), loop.create_future()) for src, n in row.posted]
    for r in recvs:
        inbox.mailbox.post(r)
    data = np.arange(row.length, dtype=np.uint32).astype(np.uint8).tobytes()
    hdr = header(row.length, digest=row.digest, src=ME if row.event == "self" else SRC)
    if row.event == "header":
        fate, recv = inbox.on_header(conn, hdr, row.staged_bytes, False)
        assert fate is row.fate
        assert recv is (recvs[0] if fate in (Fate.LAND, Fate.MISMATCH) else None)
    elif row.event == "payload":
        inbox.on_payload(conn, hdr, memoryview(bytearray(data)))
    elif row.raises:
        with pytest.raises(DistBackendError, match=row.raises):
            inbox.deliver_self(KEY, np.frombuffer(data, np.uint8))
    else:
        inbox.deliver_self(KEY, np.frombuffer(data, np.uint8))
    src = ME if row.event == "self" else SRC
    for i, r in enumerate(recvs):
        if i == row.got:
            assert r.fut.result() == src and bytes(r.dst) == data
        elif i == row.failed:
            assert isinstance(r.fut.exception(), ValueError) and "bytes, the receive buffer" in str(r.fut.exception())
        else:
            assert not r.fut.done()
    claimed = {i for i in (row.got, row.failed) if i is not None}
    if row.fate is Fate.LAND:
        claimed.add(0)
    assert inbox.mailbox.pending == len(recvs) - len(claimed)
    assert inbox.mailbox.staged_messages == row.staged and inbox.staged_total == row.staged
    assert (conn in inbox.held) is row.held
    assert desyncs == ([(KEY[0], KEY[1], src, row.digest, row.length)] if row.desync else [])
    assert conn.released == row.released


async def test_a_staged_message_is_taken_by_its_receive_and_given_back() -> None:
    conn = FakeConn()
    inbox, *_ = make((conn,))
    inbox.on_payload(conn, header(4), memoryview(bytearray(b"abcd")))
    out = np.zeros(4, np.uint8)
    assert await inbox.recv(SRC, out, group=KEY[0], seq=KEY[1], tag=KEY[2]) == SRC
    assert bytes(out) == b"abcd" and conn.released == 4 and inbox.mailbox.staged_messages == 0


async def test_a_posted_receive_retries_the_held_connections_soon() -> None:
    conn = FakeConn()
    inbox, _, _, _, route = make((conn,))
    assert inbox.on_header(conn, header(16), LIMITS.max_staged_bytes, False)[0] is Fate.HOLD
    task = asyncio.ensure_future(inbox.recv(SRC, np.zeros(16, np.uint8), group=KEY[0], seq=KEY[1], tag=KEY[2]))
    await asyncio.sleep(0)
    assert conn.retries == 0 and inbox.mailbox.pending == 1 and route.wanted == [SRC]  # posted; a connection asked for
    await asyncio.sleep(0)
    assert conn.retries == 1  # soon, never from inside the step that posted it
    fate, recv = inbox.on_header(conn, header(16), LIMITS.max_staged_bytes, False)  # what the retry asks
    assert fate is Fate.LAND and recv is not None and conn not in inbox.held
    recv.fut.set_result(SRC)  # the connection read the payload into it
    assert await task == SRC and inbox.mailbox.pending == 0


async def test_a_lost_peer_fails_a_receive_at_once_only_when_its_last_connection_closed() -> None:
    conn = FakeConn()
    conns = {conn}
    inbox, standing, *_ = make(conns)  # the façade's live set of open connections
    standing.lose(SRC, DistNetworkError("rank 0: rank 1 closed its transport (GOODBYE)"))
    task = asyncio.ensure_future(inbox.recv(SRC, np.zeros(4, np.uint8), tag=1))
    await asyncio.sleep(0)
    assert not task.done() and inbox.mailbox.pending == 1  # its connection may still deliver
    inbox.fail(lambda r: r.src == SRC, lambda r: standing.dead_error(SRC))  # what the façade does when it closes
    with pytest.raises(DistNetworkError, match="GOODBYE"):
        await task
    conns.clear()
    with pytest.raises(DistNetworkError, match="GOODBYE"):
        await inbox.recv(SRC, np.zeros(4, np.uint8), tag=2)


async def test_a_receive_times_out_naming_itself_and_is_withdrawn() -> None:
    inbox, *_ = make()
    inbox.timeout = 0.05
    with pytest.raises(TimeoutError, match=r"receive from rank 1 \(group 0, seq 0, tag 9, 4 bytes\) not complete after 0.05 s; \(never"):
        await inbox.recv(SRC, np.zeros(4, np.uint8), tag=9)
    assert inbox.mailbox.pending == 0


async def test_sends_to_self_are_bounded_by_what_is_unclaimed() -> None:
    inbox, *_ = make()
    half = LIMITS.max_staged_bytes // 2
    inbox.deliver_self((0, 0, 1), np.zeros(half, np.uint8))
    inbox.deliver_self((0, 0, 2), np.zeros(half, np.uint8))
    with pytest.raises(DistBackendError, match="would hold"):
        inbox.deliver_self((0, 0, 3), np.zeros(1, np.uint8))
    await inbox.recv(ME, np.zeros(half, np.uint8), tag=1)  # claimed: room again
    inbox.deliver_self((0, 0, 3), np.zeros(1, np.uint8))
    assert inbox.mailbox.staged_messages == 2


def test_staged_message_keeps_its_release() -> None:
    """A staged message gives its bytes back to whoever counted them (the connection's room)."""
    got: list[int] = []
    m = StagedMessage(SRC, memoryview(b"xy"), got.append)
    assert m.consume(np.zeros(2, np.uint8), KEY, ME) == SRC and got == [2]
