"""Tier 1: the transport's frame format on bytes: golden headers written out by hand, the
decoder fed in every split and through a simulated BufferedProtocol loop (payloads must land
exactly in the owner's targets or in staged copies), limits, and the errors that say whose fault."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.wire.frame import (
    HEADER_SIZE,
    AbortReceived,
    DecoderState,
    Event,
    FrameDecoder,
    FrameHeader,
    FrameKind,
    FrameLimits,
    GoodbyeReceived,
    HeaderReceived,
    Hello,
    HelloReceived,
    LocalProtocolError,
    PayloadReceived,
    RemoteProtocolError,
    StagingLimitError,
    abort_frame,
    decode_hello,
    encode_header,
    encode_hello,
    frame_parts,
    goodbye_frame,
    hello_frame,
)


def hx(s: str) -> bytes:
    return bytes.fromhex(s.replace(" ", "").replace("|", ""))


# Golden headers, spelled out byte by byte from the layout (not produced by the encoder):
#  magic|kind|flags|rsv  group     seq (u64)          tag (i64)          source    rsv       length (u64)
GOLDEN_DATA = hx("a2 02 00 00 | 01000000 | 0200000000000000 | ffffffffffffffff | 03000000 | 00000000 | 0500000000000000")
GOLDEN_DATA_MAX = hx("a2 02 80 00 | ffffffff | ffffffffffffffff | ffffffffffffff7f | 07000000 | 00000000 | 0000000000000000")
GOLDEN_HELLO = hx("a2 01 00 00 | 00000000 | 0000000000000000 | 0000000000000000 | 01000000 | 00000000 | 0d00000000000000")
GOLDEN_HELLO_PAYLOAD = hx("01000000 04000000") + b"job-7"
GOLDEN_ABORT = hx("a2 03 00 00 | 04030201 | 0807060504030201 | 0000000000000000 | 02000000 | 00000000 | 0400000000000000")
GOLDEN_GOODBYE = hx("a2 04 00 00 | 00000000 | 0000000000000000 | 0000000000000000 | 10000000 | 00000000 | 0000000000000000")

HELLO1 = Hello(b"job-7", 1, 4)


def test_header_layout_golden() -> None:
    assert HEADER_SIZE == 40
    assert encode_header(FrameKind.DATA, 1, 2, -1, 3, 5) == GOLDEN_DATA
    assert encode_header(FrameKind.DATA, 2**32 - 1, 2**64 - 1, 2**63 - 1, 7, 0, flags=0x80) == GOLDEN_DATA_MAX
    assert FrameHeader(FrameKind.DATA, 1, 2, -1, 3, 5).encode() == GOLDEN_DATA
    assert encode_hello(HELLO1) == GOLDEN_HELLO_PAYLOAD
    assert hello_frame(HELLO1) == GOLDEN_HELLO + GOLDEN_HELLO_PAYLOAD
    assert abort_frame(2, 0x01020304, 0x0102030405060708, "dead") == GOLDEN_ABORT + b"dead"
    assert goodbye_frame(0x10) == GOLDEN_GOODBYE
    assert all(len(h) == HEADER_SIZE for h in (GOLDEN_DATA, GOLDEN_DATA_MAX, GOLDEN_HELLO, GOLDEN_ABORT, GOLDEN_GOODBYE))


def test_golden_decode() -> None:
    dec = FrameDecoder()
    stream = (
        GOLDEN_HELLO
        + GOLDEN_HELLO_PAYLOAD
        + GOLDEN_DATA.replace(b"\x03\0\0\0", b"\x01\0\0\0")
        + b"hello"
        + GOLDEN_GOODBYE.replace(b"\x10", b"\x01")
    )
    evs = dec.feed(stream)
    assert evs == [
        HelloReceived(FrameHeader(FrameKind.HELLO, 0, 0, 0, 1, 13), HELLO1),
        HeaderReceived(FrameHeader(FrameKind.DATA, 1, 2, -1, 1, 5)),
    ]
    target = bytearray(5)
    evs = dec.set_target(target)
    assert evs == [
        PayloadReceived(FrameHeader(FrameKind.DATA, 1, 2, -1, 1, 5), None),
        GoodbyeReceived(FrameHeader(FrameKind.GOODBYE, 0, 0, 0, 1, 0)),
    ]
    assert target == b"hello"
    assert dec.hello == HELLO1 and dec.state is DecoderState.CLOSED
    dec.eof_received()


def test_flags_carried_verbatim_and_max_fields() -> None:
    dec = FrameDecoder(require_hello=False)
    (ev,) = dec.feed(GOLDEN_DATA_MAX)
    assert isinstance(ev, PayloadReceived)
    assert ev.header == FrameHeader(FrameKind.DATA, 2**32 - 1, 2**64 - 1, 2**63 - 1, 7, 0, 0x80)
    assert ev.staged is not None and ev.staged.nbytes == 0


# ---------------------------------------------------------------- the owner, as the docstring shows it


@dataclass
class Frame:
    header: FrameHeader
    payload: bytes
    to_target: bool = True  # DATA: a posted receive (target) or unexpected (staged)
    hello: Hello | None = None

    def bytes(self) -> bytes:
        return self.header.encode() + self.payload


GUARD = 8


@dataclass
class Owner:
    """Plays the transport: answers HeaderReceived with a target (a slice of a guarded buffer)
    or None, checks every payload against the frame it came from, releases staged bytes."""

    dec: FrameDecoder
    frames: list[Frame]
    log: list[Event] = field(default_factory=list)
    guarded: dict[int, bytearray] = field(default_factory=dict)

    def handle(self, events: list[Event]) -> None:
        while events:
            later: list[Event] = []
            for i, ev in enumerate(events):
                self.log.append(ev)
                if type(ev) is HeaderReceived:
                    assert i == len(events) - 1, "HeaderReceived must end its list"
                    later = self.dec.set_target(self.choose(ev.header))
                elif type(ev) is PayloadReceived and ev.staged is not None:
                    self.dec.release_staged(ev.staged.nbytes)
            events = later

    def choose(self, header: FrameHeader) -> memoryview | None:
        frame = self.frames[header.seq]
        if not frame.to_target:
            return None
        buf = bytearray(b"\xee" * (header.length + 2 * GUARD))
        self.guarded[header.seq] = buf
        return memoryview(buf)[GUARD : GUARD + header.length]

    def check(self) -> None:
        expected: list[tuple[type, FrameHeader]] = []
        for f in self.frames:
            h = f.header
            if h.kind is FrameKind.DATA and h.length:
                expected.append((HeaderReceived, h))
            kind_event = {
                FrameKind.HELLO: HelloReceived,
                FrameKind.DATA: PayloadReceived,
                FrameKind.ABORT: AbortReceived,
                FrameKind.GOODBYE: GoodbyeReceived,
            }
            expected.append((kind_event[h.kind], h))
        assert [(type(e), e.header) for e in self.log] == expected
        for ev in self.log:
            if isinstance(ev, PayloadReceived):
                f = self.frames[ev.header.seq]
                if f.to_target and f.header.length:
                    assert ev.staged is None
                    buf = self.guarded[f.header.seq]
                    assert buf[GUARD:-GUARD] == f.payload
                    assert buf[:GUARD] == buf[-GUARD:] == b"\xee" * GUARD, "wrote outside the target"
                else:
                    assert ev.staged is not None and ev.staged.tobytes() == f.payload
                    assert not ev.staged.readonly
            elif isinstance(ev, HelloReceived):
                assert ev.hello == self.frames[0].hello
            elif isinstance(ev, AbortReceived):
                assert ev.reason.encode() == next(fr.payload for fr in self.frames if fr.header == ev.header)
        assert self.dec.staged_bytes == 0


def make_frames(rng: random.Random, specs: list[tuple[str, int, bool]], goodbye: bool, rank: int = 3) -> list[Frame]:
    """A HELLO, then DATA/ABORT frames (seq = index, so the owner can find each), maybe GOODBYE."""
    hello = Hello(b"tok-" + rng.randbytes(rng.randrange(0, 20)), rank, 8)
    payload = encode_hello(hello)
    frames = [Frame(FrameHeader(FrameKind.HELLO, 0, 0, 0, rank, len(payload)), payload, hello=hello)]
    for kind, length, to_target in specs:
        seq = len(frames)
        if kind == "abort":
            reason = "".join(rng.choice("abc é∑") for _ in range(length % 40)).encode()
            frames.append(Frame(FrameHeader(FrameKind.ABORT, rng.randrange(2**32), seq, 0, rank, len(reason)), reason))
        else:
            h = FrameHeader(FrameKind.DATA, rng.randrange(2**32), seq, rng.randrange(-(2**63), 2**63), rank, length, rng.randrange(256))
            frames.append(Frame(h, rng.randbytes(length), to_target))
    if goodbye:
        frames.append(Frame(FrameHeader(FrameKind.GOODBYE, 0, len(frames), 0, rank, 0), b""))
    return frames


def run_buffered(dec: FrameDecoder, owner: Owner, stream: bytes, recv_sizes: list[int]) -> int:
    """A BufferedProtocol loop: get_buffer, the 'kernel' writes min(buffer, what is left, this
    recv's size) bytes into it, buffer_updated. Returns how many reads it took."""
    off = reads = 0
    while off < len(stream):
        buf = dec.get_buffer(65536)
        n = min(len(buf), len(stream) - off, recv_sizes[reads % len(recv_sizes)])
        assert n > 0
        buf[:n] = stream[off : off + n]
        off += n
        reads += 1
        owner.handle(dec.buffer_updated(n))
    return reads


frame_specs = st.lists(
    st.tuples(
        st.sampled_from(["data", "data", "data", "abort"]),
        st.one_of(st.integers(0, 60), st.integers(0, 5000)),
        st.booleans(),
    ),
    max_size=12,
)
read_aheads = st.sampled_from([HEADER_SIZE, HEADER_SIZE + 1, 57, 100, 1000, 64 * 1024])


@settings(max_examples=150, deadline=None)
@given(frame_specs, st.booleans(), st.integers(0, 2**32), read_aheads, st.lists(st.integers(1, 6000), min_size=1, max_size=10))
def test_random_frames_feed_any_chunking(
    specs: list[tuple[str, int, bool]], goodbye: bool, seed: int, read_ahead: int, cuts: list[int]
) -> None:
    rng = random.Random(seed)
    frames = make_frames(rng, specs, goodbye)
    stream = b"".join(f.bytes() for f in frames)
    dec = FrameDecoder(read_ahead=read_ahead)
    owner = Owner(dec, frames)
    off = i = 0
    while off < len(stream):
        n = cuts[i % len(cuts)]
        owner.handle(dec.feed(stream[off : off + n]))
        off += n
        i += 1
    owner.check()
    assert dec.state is (DecoderState.CLOSED if goodbye else DecoderState.HEADER)
    dec.eof_received()


@settings(max_examples=150, deadline=None)
@given(frame_specs, st.booleans(), st.integers(0, 2**32), read_aheads, st.lists(st.integers(1, 6000), min_size=1, max_size=10))
def test_random_frames_buffered_protocol_loop(
    specs: list[tuple[str, int, bool]], goodbye: bool, seed: int, read_ahead: int, recv_sizes: list[int]
) -> None:
    rng = random.Random(seed)
    frames = make_frames(rng, specs, goodbye)
    stream = b"".join(f.bytes() for f in frames)
    dec = FrameDecoder(read_ahead=read_ahead)
    owner = Owner(dec, frames)
    run_buffered(dec, owner, stream, recv_sizes)
    owner.check()
    dec.eof_received()


def fixed_frames() -> list[Frame]:
    return make_frames(
        random.Random(7), [("data", 5, True), ("data", 0, True), ("abort", 9, True), ("data", 3, False), ("data", 70, True)], goodbye=True
    )


def test_split_at_every_byte_offset() -> None:
    frames = fixed_frames()
    stream = b"".join(f.bytes() for f in frames)
    for cut in range(len(stream) + 1):
        for read_ahead in (HEADER_SIZE, 64 * 1024):
            dec = FrameDecoder(read_ahead=read_ahead)
            owner = Owner(dec, frames)
            owner.handle(dec.feed(stream[:cut]))
            owner.handle(dec.feed(stream[cut:]))
            owner.check()


def test_byte_at_a_time_and_all_at_once() -> None:
    frames = fixed_frames()
    stream = b"".join(f.bytes() for f in frames)
    for sizes in ([1], [len(stream)], [39, 1, 41, 2]):
        dec = FrameDecoder()
        owner = Owner(dec, frames)
        run_buffered(dec, owner, stream, sizes)
        owner.check()


# ---------------------------------------------------------------- the read-ahead choice


def data_frame(seq: int, payload: bytes, source: int = 3, group: int = 0, tag: int = 0) -> bytes:
    return encode_header(FrameKind.DATA, group, seq, tag, source, len(payload)) + payload


def started(limits: FrameLimits | None = None, read_ahead: int = 64 * 1024) -> FrameDecoder:
    dec = FrameDecoder(limits, read_ahead=read_ahead)
    assert dec.feed(hello_frame(Hello(b"t", 3, 4)))[0].hello.rank == 3  # type: ignore[union-attr]
    return dec


def test_many_tiny_frames_share_one_read() -> None:
    frames = make_frames(random.Random(1), [("data", 4, i % 2 == 0) for i in range(1000)], goodbye=False)
    stream = b"".join(f.bytes() for f in frames)
    assert len(stream) < 64 * 1024
    dec = FrameDecoder()
    owner = Owner(dec, frames)
    assert run_buffered(dec, owner, stream, [1 << 30]) == 1
    owner.check()


def test_big_payload_is_received_straight_into_the_target() -> None:
    payload = random.Random(2).randbytes(1 << 20)
    dec = started(read_ahead=4096)
    stream = memoryview(data_frame(1, payload) + data_frame(2, b"tail"))
    target = bytearray(len(payload))
    off = outside = 0
    events: list[Event] = []
    while off < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - off)
        if buf.obj is not target:
            outside += n
        buf[:n] = stream[off : off + n]
        off += n
        evs = dec.buffer_updated(n)
        events += evs
        if evs and type(evs[-1]) is HeaderReceived and evs[-1].header.seq == 1:
            events += dec.set_target(target)
    assert target == payload
    assert [type(e) for e in events] == [HeaderReceived, PayloadReceived, HeaderReceived]
    # only what shared a read with the header went through the read-ahead buffer
    assert outside <= 4096 + HEADER_SIZE + 4


def test_target_may_be_any_contiguous_array() -> None:
    x = (np.arange(6) * (1 + 2j)).astype(np.complex64).reshape(2, 3)
    dec = started()
    (ev,) = dec.feed(data_frame(1, x.tobytes())[:HEADER_SIZE])
    assert type(ev) is HeaderReceived
    y = np.zeros_like(x)
    assert dec.set_target(y) == []
    buf = dec.get_buffer()
    assert np.shares_memory(np.frombuffer(buf, np.uint8), y)  # zero-copy: the socket writes into y
    buf[:] = x.tobytes()
    assert dec.buffer_updated(x.nbytes) == [PayloadReceived(ev.header, None)]
    np.testing.assert_array_equal(y, x)


def test_zero_length_payload_needs_no_target() -> None:
    dec = started()
    h = FrameHeader(FrameKind.DATA, 5, 6, 7, 3, 0)
    evs = dec.feed(h.encode() * 3)
    assert [type(e) for e in evs] == [PayloadReceived] * 3
    assert all(e.header == h and e.staged is not None and e.staged.nbytes == 0 for e in evs if isinstance(e, PayloadReceived))
    assert dec.state is DecoderState.HEADER and dec.staged_bytes == 0


# ---------------------------------------------------------------- limits


def test_oversize_payload_refused_at_its_header() -> None:
    dec = started(FrameLimits(max_payload_bytes=100))
    assert dec.feed(data_frame(1, b"x" * 100)[:HEADER_SIZE])[0].header.length == 100  # type: ignore[union-attr]
    dec.set_target(None)
    dec.feed(b"x" * 100)
    header_only = encode_header(FrameKind.DATA, 0, 2, 0, 3, 101)
    with pytest.raises(RemoteProtocolError, match="max_payload_bytes") as ei:
        dec.feed(header_only)  # the header alone: not one payload byte needed to refuse it
    assert dec.state is DecoderState.ERROR
    for call in (lambda: dec.feed(b"x"), dec.get_buffer, lambda: dec.buffer_updated(0), lambda: dec.set_target(None)):
        with pytest.raises(RemoteProtocolError) as again:
            call()
        assert again.value is ei.value


def test_oversize_payload_refused_in_buffered_loop() -> None:
    dec = started(FrameLimits(max_payload_bytes=2**40))
    buf = dec.get_buffer()
    buf[:HEADER_SIZE] = encode_header(FrameKind.DATA, 0, 1, 0, 3, 2**40 + 1)
    with pytest.raises(RemoteProtocolError, match="over the limit"):
        dec.buffer_updated(HEADER_SIZE)
    assert dec.staged_bytes == 0


def test_staging_limit_enforced_and_released() -> None:
    dec = started(FrameLimits(max_staged_bytes=100))
    (h1,) = dec.feed(data_frame(1, b"a" * 60))
    (p1,) = dec.set_target(None)
    assert isinstance(p1, PayloadReceived) and p1.staged is not None and p1.staged.tobytes() == b"a" * 60
    assert dec.staged_bytes == 60
    (h2,) = dec.feed(data_frame(2, b"b" * 40))
    dec.set_target(None)  # 100: exactly the limit
    assert dec.staged_bytes == 100
    dec.release_staged(60)
    dec.feed(data_frame(3, b"c" * 60))
    dec.set_target(None)
    assert dec.staged_bytes == 100
    with pytest.raises(LocalProtocolError):
        dec.release_staged(101)
    dec.release_staged(100)
    # a target never counts against staging
    dec.feed(data_frame(4, b"d" * 1000))
    dec.set_target(bytearray(1000))
    assert dec.staged_bytes == 0
    dec.feed(data_frame(5, b"e" * 60))
    dec.set_target(None)
    (h6,) = dec.feed(data_frame(6, b"f" * 41))
    with pytest.raises(StagingLimitError, match="max_staged_bytes") as ei:
        dec.set_target(None)
    assert isinstance(ei.value, RemoteProtocolError) and "rank 3" in str(ei.value)
    assert dec.state is DecoderState.ERROR


def test_staged_payload_split_over_reads() -> None:
    dec = started(FrameLimits(max_staged_bytes=5000), read_ahead=HEADER_SIZE)
    payload = bytes(range(256)) * 10
    owner_events: list[Event] = []
    stream = data_frame(1, payload)
    for i in range(0, len(stream), 7):
        evs = dec.feed(stream[i : i + 7])
        owner_events += evs
        if evs and type(evs[-1]) is HeaderReceived:
            owner_events += dec.set_target(None)
            assert dec.staged_bytes == len(payload)
    (ev,) = [e for e in owner_events if isinstance(e, PayloadReceived)]
    assert ev.staged is not None and ev.staged.tobytes() == payload


def test_control_frame_limits() -> None:
    dec = FrameDecoder(FrameLimits(max_hello_bytes=16))
    with pytest.raises(RemoteProtocolError, match="max_hello_bytes"):
        dec.feed(hello_frame(Hello(b"x" * 9, 0, 1))[:HEADER_SIZE])
    dec = started(FrameLimits(max_control_bytes=10))
    dec.feed(abort_frame(3, 1, 2, "0123456789"))
    with pytest.raises(RemoteProtocolError, match="max_control_bytes"):
        dec.feed(abort_frame(3, 1, 2, "0123456789a")[:HEADER_SIZE])


def test_an_abort_names_its_culprits_and_garbage_in_them_is_left_out() -> None:
    """An ABORT carries the ranks the break names (every survivor learns whom to exclude): they
    decode as they were sent; a reason with a NUL keeps its words; culprits that do not parse
    (a hostile or broken peer) are left out, the reason still read; a reason of any length is
    cut to fit the control-frame limit."""
    dec = started()
    (ev,) = dec.feed(abort_frame(3, 1, 2, "rank 2 died", culprits={2: "lost its connection", 5: "x" * 1000}))
    assert isinstance(ev, AbortReceived) and ev.reason == "rank 2 died"
    assert ev.culprits == {2: "lost its connection", 5: "x" * 400}
    (ev,) = dec.feed(abort_frame(3, 1, 2, "a\0b"))
    assert isinstance(ev, AbortReceived) and (ev.reason, ev.culprits) == ("a b", {})
    for tail in (b"{not json", b'["list"]', b'{"x": "y", "7": 3, "4": "ok"}'):
        (ev,) = dec.feed(encode_header(FrameKind.ABORT, 1, 2, 0, 3, 5 + len(tail)) + b"dead\0" + tail)
        assert isinstance(ev, AbortReceived) and ev.reason == "dead"
        assert ev.culprits == ({4: "ok"} if tail.startswith(b'{"x') else {}), (tail, ev.culprits)
    big = abort_frame(3, 1, 2, "y" * (200 << 10), culprits={1: "z"})
    assert len(big) - HEADER_SIZE <= FrameLimits().max_control_bytes
    (ev,) = dec.feed(big)
    assert isinstance(ev, AbortReceived) and ev.culprits == {1: "z"} and ev.reason.startswith("yyy")


def test_limits_validated() -> None:
    with pytest.raises(ValueError):
        FrameLimits(max_payload_bytes=0)
    with pytest.raises(ValueError):
        FrameLimits(max_hello_bytes=7)
    with pytest.raises(ValueError):
        FrameDecoder(read_ahead=HEADER_SIZE - 1)


# ---------------------------------------------------------------- local misuse: refused, nothing changes


def test_get_buffer_before_set_target_refused() -> None:
    dec = started()
    stream = data_frame(1, b"abc") + data_frame(2, b"defg")
    (h,) = dec.feed(stream)
    assert type(h) is HeaderReceived and dec.pending_header == h.header
    with pytest.raises(LocalProtocolError, match="set_target"):
        dec.get_buffer()
    with pytest.raises(LocalProtocolError):
        dec.eof_received()
    assert dec.state is DecoderState.NEED_TARGET
    t = bytearray(3)
    evs = dec.set_target(t)
    assert t == b"abc"
    assert [type(e) for e in evs] == [PayloadReceived, HeaderReceived]
    evs = dec.set_target(bytearray(4))
    assert [type(e) for e in evs] == [PayloadReceived]
    assert dec.state is DecoderState.HEADER


@pytest.mark.parametrize(
    "target,match",
    [
        (bytearray(2), "buffer of 2 bytes"),
        (b"abc", "read-only"),
        (np.zeros(6, np.uint8)[::2], "non-contiguous"),
        (object(), "writable buffer"),
    ],
)
def test_bad_target_refused_and_state_kept(target: object, match: str) -> None:
    dec = started()
    dec.feed(data_frame(1, b"abc"))
    with pytest.raises(LocalProtocolError, match=match):
        dec.set_target(target)
    assert dec.state is DecoderState.NEED_TARGET
    t = bytearray(3)
    assert dec.set_target(t) == [PayloadReceived(FrameHeader(FrameKind.DATA, 0, 1, 0, 3, 3), None)] and t == b"abc"


def test_other_local_misuse() -> None:
    dec = started()
    with pytest.raises(LocalProtocolError):
        dec.set_target(None)  # no header waiting
    buf = dec.get_buffer()
    with pytest.raises(LocalProtocolError):
        dec.buffer_updated(len(buf) + 1)
    assert dec.buffer_updated(0) == []
    with pytest.raises(LocalProtocolError):
        dec.buffer_updated(1)  # no buffer handed out since
    with pytest.raises(LocalProtocolError):
        dec.release_staged(1)
    assert dec.feed(data_frame(1, b"")) != []  # still alive


# ---------------------------------------------------------------- remote faults


def bad(header: bytes, byte: int, value: int) -> bytes:
    b = bytearray(header)
    b[byte] = value
    return bytes(b)


HDR = encode_header(FrameKind.DATA, 0, 1, 0, 3, 0)


def test_the_digest_rides_in_bytes_28_to_31() -> None:
    raw = encode_header(FrameKind.DATA, 0, 1, 0, 3, 0, digest=0xDEADBEEF)
    assert raw[28:32] == bytes.fromhex("efbeadde")
    (ev,) = started().feed(raw)
    assert ev.header.digest == 0xDEADBEEF


@pytest.mark.parametrize(
    "raw,match",
    [
        (bad(HDR, 0, 0x00), "bad frame magic 0x00"),
        (bad(HDR, 0, 0xB1), "bad frame magic"),
        (bad(HDR, 0, 0xA1), "frame version 1"),  # version 2 carries the op digest in bytes 28-31
        (bad(HDR, 1, 0), "unknown frame kind 0"),
        (bad(HDR, 1, 5), "unknown frame kind 5"),
        (bad(HDR, 1, 255), "unknown frame kind 255"),
        (bad(HDR, 3, 1), "reserved"),
    ],
)
def test_bad_header_refused(raw: bytes, match: str) -> None:
    dec = started()
    with pytest.raises(RemoteProtocolError, match=match):
        dec.feed(raw)
    assert dec.state is DecoderState.ERROR


def test_torch_store_client_on_the_wrong_port_is_refused_at_once() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="magic"):
        dec.feed(b"\x00\xce\xf7\x85\x3c" + b"\0" * 40)  # a TCPStore VALIDATE


@pytest.mark.parametrize(
    "stream,match",
    [
        (data_frame(1, b"x"), "first frame must be HELLO"),
        (abort_frame(3, 0, 0, "x"), "first frame must be HELLO"),
        (hello_frame(Hello(b"t", 3, 4)) + hello_frame(Hello(b"t", 3, 4)), "second HELLO"),
        (hello_frame(Hello(b"t", 3, 4)) + data_frame(1, b"x", source=2), "on the connection of rank 3"),
        (encode_header(FrameKind.HELLO, 0, 0, 0, 3, 8) + hx("03000000 03000000"), "rank 3 with world size 3"),
        (encode_header(FrameKind.HELLO, 0, 0, 0, 3, 7) + b"\0" * 7, "shorter than"),
        (encode_header(FrameKind.HELLO, 0, 0, 0, 2, 8) + hx("03000000 04000000"), "says it is rank 3"),
        (hello_frame(Hello(b"t", 3, 4)) + encode_header(FrameKind.GOODBYE, 0, 0, 0, 3, 1) + b"x", "GOODBYE carries no payload"),
        (hello_frame(Hello(b"t", 3, 4)) + goodbye_frame(3) + b"\xa2", "after GOODBYE"),
    ],
)
def test_protocol_rules(stream: bytes, match: str) -> None:
    dec = FrameDecoder(read_ahead=HEADER_SIZE)
    with pytest.raises(RemoteProtocolError, match=match):
        dec.feed(stream)
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match=match):
        dec.feed(stream)


def test_bytes_after_goodbye_in_a_later_read() -> None:
    dec = started()
    (ev,) = dec.feed(goodbye_frame(3))
    assert type(ev) is GoodbyeReceived and dec.state is DecoderState.CLOSED
    buf = dec.get_buffer()
    buf[0] = 1
    with pytest.raises(RemoteProtocolError, match="1 byte"):
        dec.buffer_updated(1)


def test_require_hello_off() -> None:
    dec = FrameDecoder(require_hello=False)
    dec.feed(data_frame(1, b"x", source=5))
    dec.set_target(bytearray(1))
    dec.feed(hello_frame(Hello(b"t", 2, 4)))
    with pytest.raises(RemoteProtocolError):
        dec.feed(data_frame(2, b"", source=5))


def test_events_before_a_fault_are_kept_on_the_error() -> None:
    dec = started()
    with pytest.raises(RemoteProtocolError) as ei:
        dec.feed(abort_frame(3, 9, 41, "rank 3: out of memory") + b"\xff" * HEADER_SIZE)
    assert ei.value.events == [AbortReceived(FrameHeader(FrameKind.ABORT, 9, 41, 0, 3, 21), "rank 3: out of memory")]


def test_eof() -> None:
    dec = started()
    dec.eof_received()  # between frames: not a protocol error
    dec.feed(HDR[:10])
    with pytest.raises(RemoteProtocolError, match="10 bytes into a 40-byte frame header"):
        dec.eof_received()
    dec = started()
    dec.feed(data_frame(1, b"abcdef")[:-2])
    dec.set_target(bytearray(6))
    with pytest.raises(RemoteProtocolError, match="4 of 6 bytes"):
        dec.eof_received()


def test_abort_reason_undecodable_bytes_replaced() -> None:
    dec = started()
    (ev,) = dec.feed(encode_header(FrameKind.ABORT, 1, 2, 0, 3, 3) + b"a\xffb")
    assert isinstance(ev, AbortReceived) and ev.reason == "a\ufffdb"
    assert abort_frame(3, 1, 2, "é")[HEADER_SIZE:] == "é".encode()


# ---------------------------------------------------------------- codecs and the send side


def test_hello_codec() -> None:
    for h in (Hello(b"", 0, 1), Hello(b"\0" * 100, 2**32 - 2, 2**32 - 1), HELLO1):
        assert decode_hello(encode_hello(h)) == h
    for rank, ws in ((1, 1), (-1, 2), (0, 2**32)):
        with pytest.raises(ValueError):
            encode_hello(Hello(b"t", rank, ws))
    with pytest.raises(TypeError):
        encode_hello(Hello("t", 0, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args",
    [
        (FrameKind.DATA, -1, 0, 0, 0, 0),
        (FrameKind.DATA, 2**32, 0, 0, 0, 0),
        (FrameKind.DATA, 0, 2**64, 0, 0, 0),
        (FrameKind.DATA, 0, 0, 2**63, 0, 0),
        (FrameKind.DATA, 0, 0, 0, -1, 0),
        (FrameKind.DATA, 0, 0, 0, 0, -1),
        (0, 0, 0, 0, 0, 0),
        (9, 0, 0, 0, 0, 0),
    ],
)
def test_encode_header_refuses_out_of_range(args: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        encode_header(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_header(FrameKind.DATA, 0, 0, 0, 0, 0, flags=256)


def test_frame_parts_does_not_copy_the_payload() -> None:
    arr = np.arange(1024, dtype=np.float32)
    h = FrameHeader(FrameKind.DATA, 1, 2, 3, 4, arr.nbytes)
    head, body = frame_parts(h, arr)
    assert head == h.encode()
    assert isinstance(body, memoryview) and body.nbytes == arr.nbytes and body.format == "B"
    arr[0] = 42.0
    assert body[:4].tobytes() == np.float32(42.0).tobytes()  # the same memory
    dec = started()
    (hr,) = dec.feed(h._replace(source=3).encode())
    out = np.zeros_like(arr)
    dec.set_target(out)
    dec.feed(body)
    np.testing.assert_array_equal(out, arr)


def test_frame_parts_small_and_empty() -> None:
    h = FrameHeader(FrameKind.DATA, 0, 0, 0, 0, 3)
    assert frame_parts(h, b"abc") == [h.encode() + b"abc"]
    z = FrameHeader(FrameKind.DATA, 0, 0, 0, 0, 0)
    assert frame_parts(z) == frame_parts(z, b"") == [z.encode()]
    c = np.ones(300, np.complex128)
    parts = frame_parts(FrameHeader(FrameKind.DATA, 0, 0, 0, 0, c.nbytes), c)
    assert len(parts) == 2 and bytes(parts[1]) == c.tobytes()
    with pytest.raises(ValueError, match="4 payload bytes"):
        frame_parts(h._replace(length=4), b"abc")
    with pytest.raises(ValueError):
        frame_parts(h)
    with pytest.raises(ValueError, match="contiguous"):
        frame_parts(FrameHeader(FrameKind.DATA, 0, 0, 0, 0, 3), np.zeros(6, np.uint8)[::2])
