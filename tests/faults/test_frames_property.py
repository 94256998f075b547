"""Property tests of the transport's sans-I/O frame decoder (aiodist.wire.frame.FrameDecoder): a
byte stream (a HELLO, DATA and ABORT frames, maybe a GOODBYE, maybe hostile bytes after them:
random garbage, a huge length, a bad magic, a frame cut short) decoded whole, byte by byte, in
random chunks through ``feed``, or through the BufferedProtocol side (``get_buffer`` /
``buffer_updated``) in random read sizes, gives the same events and the same error; after an
error the decoder stays dead (every later call raises that error again)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from aiodist.wire.frame import (
    FIRST_READ_AHEAD,
    HEADER_SIZE,
    AbortReceived,
    DecoderState,
    FrameDecoder,
    FrameKind,
    FrameLimits,
    GoodbyeReceived,
    HeaderReceived,
    Hello,
    HelloReceived,
    PayloadReceived,
    RemoteProtocolError,
    abort_frame,
    encode_header,
    goodbye_frame,
    hello_frame,
)

RANK = 3
LIMITS = FrameLimits(max_payload_bytes=4096, max_hello_bytes=64, max_control_bytes=256)
MAX_EXAMPLES = 60  # x 4 ways of feeding each; well under a second or two in all

# ---------------------------------------------------------------- streams

_payloads = st.binary(max_size=300)
_frame = st.one_of(
    st.tuples(st.just("data"), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), _payloads),
    st.tuples(st.just("abort"), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 0), st.text(max_size=60)),
)


def _encode(spec: tuple[Any, ...]) -> bytes:
    kind, group, seq, tag, body = spec
    if kind == "data":
        return encode_header(FrameKind.DATA, group, seq, tag, RANK, len(body)) + body
    return abort_frame(RANK, group, seq, body)


_tails: st.SearchStrategy[bytes] = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=120),  # garbage
    st.builds(
        lambda n: encode_header(FrameKind.DATA, 0, 1, 0, RANK, n), st.integers(LIMITS.max_payload_bytes + 1, 2**64 - 1)
    ),  # huge length
    st.builds(lambda n: encode_header(FrameKind.ABORT, 0, 1, 0, RANK, n), st.integers(LIMITS.max_control_bytes + 1, 2**64 - 1)),
    st.builds(lambda b: bytes([b]) + bytes(HEADER_SIZE - 1), st.integers(0, 255)),  # bad magic / version
    st.builds(lambda p, cut: (encode_header(FrameKind.DATA, 0, 1, 0, RANK, len(p)) + p)[:cut], _payloads, st.integers(1, 40)),  # cut short
    st.builds(lambda r: hello_frame(Hello(b"t", r, 8)), st.integers(0, 7)),  # a second HELLO
    st.builds(lambda r: encode_header(FrameKind.DATA, 0, 1, 0, r, 0), st.integers(0, 2**32 - 1)),  # another source
)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    head = hello_frame(Hello(draw(st.binary(max_size=20)), RANK, 4))
    if not draw(st.integers(0, 9)):  # now and then no HELLO first: refused at once
        head = b""
    body = b"".join(_encode(s) for s in draw(st.lists(_frame, max_size=8)))
    bye = goodbye_frame(RANK) if draw(st.booleans()) else b""
    return head + body + bye + draw(_tails)


# ---------------------------------------------------------------- drivers


def _norm(ev: Any, targets: list[bytearray]) -> tuple[Any, ...]:
    if type(ev) is PayloadReceived:
        data = bytes(targets.pop(0)) if ev.staged is None else bytes(ev.staged)
        return ("payload", tuple(ev.header), data)
    if type(ev) is HelloReceived:
        return ("hello", tuple(ev.header), ev.hello)
    if type(ev) is AbortReceived:
        return ("abort", tuple(ev.header), ev.reason)
    assert type(ev) is GoodbyeReceived, ev
    return ("goodbye", tuple(ev.header))


class Owner:
    """Handles events as a transport would: DATA with an odd seq goes to a posted target, with an
    even seq is staged (a choice that depends on the frame, never on how the bytes came)."""

    def __init__(self, dec: FrameDecoder) -> None:
        self.dec = dec
        self.got: list[tuple[Any, ...]] = []
        self.targets: list[bytearray] = []  # posted, in order: payloads complete in stream order

    def handle(self, events: list[Any]) -> None:
        while events:
            later: list[Any] = []
            for ev in events:
                if type(ev) is HeaderReceived:
                    if ev.header.seq % 2:
                        buf = bytearray(ev.header.length)
                        self.targets.append(buf)  # before set_target: it may complete the payload at once
                        later = self.dec.set_target(buf)
                    else:
                        later = self.dec.set_target(None)
                else:
                    if type(ev) is PayloadReceived and ev.staged is not None:
                        self.dec.release_staged(len(ev.staged))
                    self.got.append(_norm(ev, self.targets))
            events = later


def _run(stream: bytes, pieces: list[bytes], buffered: bool, read_ahead: int) -> tuple[list[tuple[Any, ...]], str | None, FrameDecoder]:
    dec = FrameDecoder(LIMITS, read_ahead=read_ahead, first_read_ahead=FIRST_READ_AHEAD)
    owner = Owner(dec)
    err: str | None = None
    try:
        for piece in pieces:
            if not buffered:
                owner.handle(dec.feed(piece))
                continue
            while piece:
                buf = dec.get_buffer(-1)
                n = min(len(buf), len(piece))
                buf[:n] = piece[:n]
                piece = piece[n:]
                owner.handle(dec.buffer_updated(n))
        dec.eof_received()
    except RemoteProtocolError as exc:
        owner.handle(list(exc.events))  # decoded before the fault: a transport delivers them first
        err = f"{type(exc).__name__}: {exc}"
    return owner.got, err, dec


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    edges = [0, *points, len(stream)]
    return [stream[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


# A count of the bytes that came after GOODBYE in the one read that had them: how many arrived
# together is the only part of any error that depends on how the stream was cut.
_AFTER_GOODBYE = re.compile(r"^RemoteProtocolError: \d+ byte\(s\) after GOODBYE")


def _same_error(e: str | None) -> str | None:
    return None if e is None else _AFTER_GOODBYE.sub("RemoteProtocolError: N byte(s) after GOODBYE", e)


def _assert_dead(dec: FrameDecoder, err: str) -> None:
    assert dec.state is DecoderState.ERROR
    calls: list[Callable[[], object]] = [
        lambda: dec.feed(b"\0"),
        lambda: dec.feed(goodbye_frame(RANK)),
        lambda: dec.get_buffer(-1),
        lambda: dec.buffer_updated(0),
        lambda: dec.set_target(None),
        dec.eof_received,
    ]
    for call in calls:
        try:
            call()
        except RemoteProtocolError as exc:
            assert f"{type(exc).__name__}: {exc}" == err
        else:
            raise AssertionError(f"a dead decoder accepted {call}")


@settings(
    max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
)  # no explain phase: its tracing is slow
@given(
    stream=streams(),
    cuts=st.lists(st.integers(0, 2**16), max_size=12),
    reads=st.lists(st.integers(0, 2**16), max_size=12),
    read_ahead=st.sampled_from([HEADER_SIZE, 64, 1024, 64 * 1024]),
)
def test_any_chunking_gives_the_same_events_and_error(stream: bytes, cuts: list[int], reads: list[int], read_ahead: int) -> None:
    whole = _run(stream, [stream] if stream else [], False, read_ahead)
    ways = {
        "byte by byte": _run(stream, [stream[i : i + 1] for i in range(len(stream))], False, read_ahead),
        "random chunks": _run(stream, _split(stream, cuts), False, read_ahead),
        "buffered, random reads": _run(stream, _split(stream, reads), True, read_ahead),
    }
    for name, (events, err, dec) in ways.items():
        assert events == whole[0], name
        assert _same_error(err) == _same_error(whole[1]), name
        if err is not None:
            _assert_dead(dec, err)
    if whole[1] is not None:
        _assert_dead(whole[2], whole[1])
