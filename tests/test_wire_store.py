"""Tier 1: the TCPStore wire protocol on bytes: golden encodings of every opcode, parsing
back, replies, limits, and arbitrary splitting/pipelining of the byte stream."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist.wire.store import (
    MAGIC,
    Limits,
    Op,
    ProtocolError,
    Reply,
    ReplyParser,
    Request,
    RequestParser,
    encode,
    encode_bytes,
    encode_bytes_list,
    encode_i64,
    encode_queue_pop,
    encode_request,
    encode_u8,
    encode_u32,
)

VALIDATE = b"\x00\xce\xf7\x85\x3c"


def s(b: bytes) -> bytes:
    """A string field, written out by hand: u64 little-endian length, then the bytes."""
    return struct.pack("<Q", len(b)) + b


def q(n: int) -> bytes:
    return struct.pack("<q", n)


# (request, golden bytes). The golden side is spelled out from the protocol reference, not
# produced by the encoder under test.
GOLDEN = [
    (Request(Op.VALIDATE, number=MAGIC), VALIDATE),
    (Request(Op.SET, (b"/k",), (b"v",)), b"\x01" + b"\x02\0\0\0\0\0\0\0/k" + b"\x01\0\0\0\0\0\0\0v"),
    (Request(Op.COMPARE_SET, (b"/k",), (b"old", b"new")), b"\x02" + s(b"/k") + s(b"old") + s(b"new")),
    (Request(Op.GET, (b"/k",)), b"\x03" + s(b"/k")),
    (Request(Op.ADD, (b"/c",), number=-5), b"\x04" + s(b"/c") + b"\xfb\xff\xff\xff\xff\xff\xff\xff"),
    (Request(Op.CHECK, (b"/a", b"/bb")), b"\x05" + b"\x02\0\0\0\0\0\0\0" + s(b"/a") + s(b"/bb")),
    (Request(Op.WAIT, (b"/a",)), b"\x06" + b"\x01\0\0\0\0\0\0\0" + s(b"/a")),
    (Request(Op.GETNUMKEYS), b"\x07"),
    (Request(Op.DELETE_KEY, (b"/k",)), b"\x08" + s(b"/k")),
    (Request(Op.APPEND, (b"/k",), (b"tato",)), b"\x09" + s(b"/k") + s(b"tato")),
    (Request(Op.MULTI_GET, (b"/a", b"/b")), b"\x0a" + b"\x02\0\0\0\0\0\0\0" + s(b"/a") + s(b"/b")),
    (Request(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"")), b"\x0b" + b"\x02\0\0\0\0\0\0\0" + s(b"/a") + s(b"1") + s(b"/b") + s(b"")),
    (Request(Op.CANCEL_WAIT), b"\x0c"),
    (Request(Op.PING, number=1234), b"\x0d\xd2\x04\x00\x00"),
    (Request(Op.QUEUE_PUSH, (b"/q",), (b"x",)), b"\x0e" + s(b"/q") + s(b"x")),
    (Request(Op.QUEUE_POP, (b"/q",)), b"\x0f" + s(b"/q")),
    (Request(Op.QUEUE_LEN, (b"/q",)), b"\x10" + s(b"/q")),
    (Request(Op.LIST), b"\x11"),
]


def test_golden_covers_every_opcode() -> None:
    assert {req.op for req, _ in GOLDEN} == set(Op)
    assert len(Op) == 18


@pytest.mark.parametrize("req,golden", GOLDEN, ids=[r.op.name for r, _ in GOLDEN])
def test_encode_matches_golden(req: Request, golden: bytes) -> None:
    assert encode_request(req) == golden
    assert encode(req.op, req.keys, req.values, req.number) == golden


@pytest.mark.parametrize("req,golden", GOLDEN[1:], ids=[r.op.name for r, _ in GOLDEN[1:]])
def test_parse_golden(req: Request, golden: bytes) -> None:
    p = RequestParser()
    p.feed(VALIDATE + golden)
    assert p.next_request() == Request(Op.VALIDATE, number=MAGIC)
    assert p.next_request() == req
    assert p.next_request() is None
    assert p.buffered == 0


def test_reply_encodings() -> None:
    assert encode_u8(1) == b"\x01"
    assert encode_u32(1234) == b"\xd2\x04\x00\x00"
    assert encode_i64(-1) == b"\xff" * 8
    assert encode_bytes(b"ab") == b"\x02\0\0\0\0\0\0\0ab"
    assert encode_bytes_list([b"a", b""]) == s(b"a") + s(b"")
    assert encode_bytes_list([b"/k"], counted=True) == q(1) + s(b"/k")
    assert encode_queue_pop(0, None) == q(0)
    assert encode_queue_pop(3, b"x") == q(3) + s(b"x")


@pytest.mark.parametrize(
    "shape,count,data,value",
    [
        (Reply.U8, 0, b"\x00", 0),
        (Reply.U32, 0, b"\xd2\x04\x00\x00", 1234),
        (Reply.I64, 0, q(-7), -7),
        (Reply.BYTES, 0, s(b"val"), b"val"),
        (Reply.BYTES, 0, s(b""), b""),
        (Reply.BYTES_LIST, 2, s(b"po") + s(b"tato"), [b"po", b"tato"]),
        (Reply.COUNTED_LIST, 0, q(2) + s(b"/a") + s(b"/b"), [b"/a", b"/b"]),
        (Reply.QUEUE_POP, 0, q(0), (0, None)),
        (Reply.QUEUE_POP, 0, q(2) + s(b"x"), (2, b"x")),
    ],
)
def test_reply_parser(shape: Reply, count: int, data: bytes, value: object) -> None:
    p = ReplyParser()
    p.expect(shape, count)
    for i in range(len(data) - 1):  # byte by byte: nothing until the last byte arrives
        p.feed(data[i : i + 1])
        assert p.next_reply() is None
    p.feed(data[-1:])
    assert p.next_reply() == value
    assert p.pending == 0


def test_reply_parser_refuses_unexpected_bytes() -> None:
    p = ReplyParser()
    with pytest.raises(ProtocolError):
        p.feed(b"\x00")
    p = ReplyParser()  # (the first one is dead now)
    p.expect(Reply.U8)
    p.feed(b"\x00\x01")
    assert p.next_reply() == 0  # the reply owed is delivered; the byte after it is the error
    with pytest.raises(ProtocolError, match="unexpected"):
        p.next_reply()


def test_first_request_must_be_validate() -> None:
    p = RequestParser()
    p.feed(b"\x07")
    with pytest.raises(ProtocolError, match="VALIDATE"):
        p.next_request()
    with pytest.raises(ProtocolError):  # dead for good
        p.feed(b"\x07")


def test_bad_magic() -> None:
    p = RequestParser()
    p.feed(b"\x00\x01\x02\x03\x04")
    with pytest.raises(ProtocolError, match="magic"):
        p.next_request()


def test_unknown_opcode() -> None:
    p = RequestParser()
    p.feed(VALIDATE + b"\x63")
    p.next_request()
    with pytest.raises(ProtocolError, match="unknown opcode 99"):
        p.next_request()


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"\x03" + struct.pack("<Q", 2**60), "key of"),  # absurd key length: refused before buffering
        (b"\x01" + s(b"k") + struct.pack("<Q", 1025), "value of 1025"),
        (b"\x05" + struct.pack("<Q", 17), "CHECK of 17 keys"),
        (b"\x0b" + struct.pack("<Q", 17), "MULTI_SET of 17 keys"),
        (b"\x03" + s(b"k" * 65), "key of 65"),
    ],
)
def test_limits(payload: bytes, match: str) -> None:
    p = RequestParser(Limits(max_key_bytes=64, max_value_bytes=1024, max_keys=16))
    p.feed(VALIDATE + payload)
    p.next_request()
    with pytest.raises(ProtocolError, match=match):
        p.next_request()


def test_request_size_cap() -> None:
    p = RequestParser(Limits(max_request_bytes=100))
    p.feed(VALIDATE)
    p.next_request()
    p.feed(b"\x01" + s(b"k") + struct.pack("<Q", 200) + b"x" * 95)  # incomplete and already over 100 bytes
    with pytest.raises(ProtocolError, match="over 100 bytes"):
        p.next_request()


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        Limits(max_keys=0)


def test_encode_refuses_bad_arity() -> None:
    with pytest.raises(ValueError):
        encode(Op.SET, (b"k",), ())
    with pytest.raises(ValueError):
        encode(Op.MULTI_SET, (b"a", b"b"), (b"1",))


# -- streams split and pipelined arbitrarily ---------------------------------------------

keys = st.binary(min_size=0, max_size=20)
values = st.binary(min_size=0, max_size=200)
requests = st.one_of(
    st.builds(lambda k, v: Request(Op.SET, (k,), (v,)), keys, values),
    st.builds(lambda k: Request(Op.GET, (k,)), keys),
    st.builds(lambda k, n: Request(Op.ADD, (k,), number=n), keys, st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda ks: Request(Op.CHECK, tuple(ks)), st.lists(keys, max_size=5)),
    st.builds(lambda ks: Request(Op.WAIT, tuple(ks)), st.lists(keys, max_size=5)),
    st.builds(lambda ks: Request(Op.MULTI_GET, tuple(ks)), st.lists(keys, max_size=5)),
    st.builds(
        lambda kv: Request(Op.MULTI_SET, tuple(k for k, _ in kv), tuple(v for _, v in kv)), st.lists(st.tuples(keys, values), max_size=5)
    ),
    st.builds(lambda k, a, b: Request(Op.COMPARE_SET, (k,), (a, b)), keys, values, values),
    st.builds(lambda n: Request(Op.PING, number=n), st.integers(0, 2**32 - 1)),
    st.sampled_from([Request(Op.GETNUMKEYS), Request(Op.LIST), Request(Op.CANCEL_WAIT)]),
    st.builds(lambda k, v: Request(Op.QUEUE_PUSH, (k,), (v,)), keys, values),
    st.builds(lambda k: Request(Op.QUEUE_POP, (k,)), keys),
)


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(requests, min_size=1, max_size=10), cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_split_and_pipelined_requests(reqs: list[Request], cuts: list[int]) -> None:
    stream = VALIDATE + b"".join(encode_request(r) for r in reqs)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    p = RequestParser()
    got: list[Request] = []
    for a, b in zip(points, points[1:]):
        p.feed(stream[a:b])
        while (r := p.next_request()) is not None:
            got.append(r)
    assert got == [Request(Op.VALIDATE, number=MAGIC), *reqs]
    assert p.buffered == 0


replies = st.one_of(
    st.builds(lambda v: ((Reply.U8, 0), encode_u8(v), v), st.integers(0, 255)),
    st.builds(lambda v: ((Reply.I64, 0), encode_i64(v), v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: ((Reply.BYTES, 0), encode_bytes(v), v), values),
    st.builds(lambda vs: ((Reply.BYTES_LIST, len(vs)), encode_bytes_list(vs), vs), st.lists(values, max_size=4)),
    st.builds(lambda vs: ((Reply.COUNTED_LIST, 0), encode_bytes_list(vs, counted=True), vs), st.lists(keys, max_size=4)),
    st.builds(lambda v: ((Reply.QUEUE_POP, 0), encode_queue_pop(3, v), (3, v)), values),
)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(replies, min_size=1, max_size=10), cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_split_and_pipelined_replies(items: list[tuple[tuple[Reply, int], bytes, object]], cuts: list[int]) -> None:
    stream = b"".join(data for _, data, _ in items)
    p = ReplyParser()
    for (shape, count), _, _ in items:
        p.expect(shape, count)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    got = []
    for a, b in zip(points, points[1:]):
        p.feed(stream[a:b])
        while (r := p.next_reply()) is not None:
            got.append(r)
    while (r := p.next_reply()) is not None:  # zero-byte replies (an empty MULTI_GET) at the end
        got.append(r)
    assert got == [v for _, _, v in items]


def test_second_validate_is_refused() -> None:
    """torch's server closes a connection that validates twice; so does aiodist's."""
    p = RequestParser()
    p.feed(VALIDATE + VALIDATE)
    p.next_request()
    with pytest.raises(ProtocolError, match="twice"):
        p.next_request()


def test_parsers_resume_instead_of_rescanning() -> None:
    """A big multi-key message arriving in pieces is decoded once, field by field: after each
    piece the parser has moved past every complete field (it does not start over), which keeps
    the cost linear in the message size."""
    keys = [b"/k%05d" % i for i in range(2000)]
    values = [b"v" * 100 for _ in keys]
    frame = encode(Op.MULTI_SET, keys, values)
    p = RequestParser()
    p.feed(VALIDATE)
    p.next_request()
    positions = []
    for i in range(0, len(frame), 4096):
        p.feed(frame[i : i + 4096])
        req = p.next_request()
        if req is None:
            positions.append(p._st.pos)
    assert req == Request(Op.MULTI_SET, tuple(keys), tuple(values))
    # every partial attempt stopped near the end of what had arrived, never back at the start
    assert all(4096 * (n + 1) - 200 <= pos <= 4096 * (n + 1) for n, pos in enumerate(positions))

    replies = encode_bytes_list(values)
    rp = ReplyParser()
    rp.expect(Reply.BYTES_LIST, len(values))
    got = None
    for i in range(0, len(replies), 1000):
        rp.feed(replies[i : i + 1000])
        got = rp.next_reply()
        if got is None:
            assert rp._st.pos > i + 1000 - 120
    assert got == values
