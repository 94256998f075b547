"""Property tests of the TCPStore protocol's sans-I/O parsers (aiodist.wire.store): the server's
``RequestParser`` and the client's ``ReplyParser``. A byte stream (valid requests or replies,
then maybe hostile bytes: random garbage, an unknown opcode, a huge key, value or key-count
field, a request over the size cap, a second VALIDATE or a bad magic, a message cut short) fed
whole, byte by byte, or in random chunks (draining after every chunk, or only now and then)
gives the same decoded items, the same error and the same leftover state; after an error the
parser stays dead (every later call raises that same error). The client side is also fed with
its ``expect`` calls made just in time (each before the first byte of its reply arrives, as a
real client sends its request first), which must not change anything either."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

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

LIMITS = Limits(max_key_bytes=16, max_value_bytes=16, max_keys=4, max_request_bytes=96)
MAX_EXAMPLES = 150  # per test, x 4 ways of feeding each; about a second in all
RUNS: dict[str, int] = {"requests": 0, "replies": 0}  # examples run (the tests print them)

_u64 = struct.Struct("<Q").pack
VALIDATE = encode(Op.VALIDATE, number=MAGIC)

# ---------------------------------------------------------------- streams: requests

_key = st.binary(max_size=20)  # some over LIMITS.max_key_bytes
_request = st.one_of(
    st.tuples(st.sampled_from([Op.SET, Op.APPEND, Op.QUEUE_PUSH]), _key, _key).map(lambda t: encode(t[0], (t[1],), (t[2],))),
    st.tuples(st.sampled_from([Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN]), _key).map(lambda t: encode(t[0], (t[1],))),
    st.tuples(_key, st.integers(-(2**63), 2**63 - 1)).map(lambda t: encode(Op.ADD, (t[0],), number=t[1])),
    st.tuples(st.sampled_from([Op.CHECK, Op.WAIT, Op.MULTI_GET]), st.lists(_key, max_size=6)).map(lambda t: encode(t[0], t[1])),
    st.lists(st.tuples(_key, _key), max_size=5).map(lambda kv: encode(Op.MULTI_SET, [k for k, _ in kv], [v for _, v in kv])),
    st.tuples(_key, _key, _key).map(lambda t: encode(Op.COMPARE_SET, (t[0],), (t[1], t[2]))),
    st.builds(lambda n: encode(Op.PING, number=n), st.integers(0, 2**32 - 1)),
    st.sampled_from([encode(Op.GETNUMKEYS), encode(Op.LIST), encode(Op.CANCEL_WAIT)]),
)
_request_tails: st.SearchStrategy[bytes] = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=60),  # garbage
    st.integers(len(Op), 255).map(lambda c: bytes([c])),  # unknown opcode
    st.integers(LIMITS.max_key_bytes + 1, 2**64 - 1).map(lambda n: bytes([Op.SET]) + _u64(n)),  # huge key
    st.integers(LIMITS.max_value_bytes + 1, 2**64 - 1).map(lambda n: bytes([Op.SET]) + encode_bytes(b"/k") + _u64(n)),  # huge value
    st.integers(LIMITS.max_keys + 1, 2**64 - 1).map(lambda n: bytes([Op.MULTI_GET]) + _u64(n)),  # huge key count
    st.just(encode(Op.MULTI_SET, [b"k%d" % i for i in range(4)], [b"v" * 16] * 4)),  # over max_request_bytes
    st.just(VALIDATE),  # a second VALIDATE
    st.tuples(_request, st.integers(1, 40)).map(lambda t: t[0][: max(1, len(t[0]) - t[1])]),  # cut short
)


@st.composite
def request_streams(draw: st.DrawFn) -> bytes:
    head = VALIDATE
    first = draw(st.integers(0, 9))
    if first == 0:
        head = b""  # no VALIDATE: the first request is refused
    elif first == 1:
        head = encode(Op.VALIDATE, number=draw(st.integers(0, 2**32 - 1).filter(lambda m: m != MAGIC)))  # bad magic
    return head + b"".join(draw(st.lists(_request, max_size=6))) + draw(_request_tails)


# ---------------------------------------------------------------- streams: replies

_small = st.binary(max_size=12)
_reply = st.one_of(
    st.integers(0, 255).map(lambda v: ((Reply.U8, 0), encode_u8(v))),
    st.integers(0, 2**32 - 1).map(lambda v: ((Reply.U32, 0), encode_u32(v))),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ((Reply.I64, 0), encode_i64(v))),
    _small.map(lambda v: ((Reply.BYTES, 0), encode_bytes(v))),
    st.lists(_small, max_size=3).map(lambda vs: ((Reply.BYTES_LIST, len(vs)), encode_bytes_list(vs))),
    st.lists(_small, max_size=3).map(lambda vs: ((Reply.COUNTED_LIST, 0), encode_bytes_list(vs, counted=True))),
    _small.map(lambda v: ((Reply.QUEUE_POP, 0), encode_queue_pop(len(v), v if v else None))),
)
_shapes = st.sampled_from([(s, 0) for s in Reply if s is not Reply.BYTES_LIST] + [(Reply.BYTES_LIST, 2)])
_reply_tails: st.SearchStrategy[bytes] = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=40),  # garbage (stray bytes, or the start of replies to `extra`)
    st.integers(LIMITS.max_value_bytes + 1, 2**64 - 1).map(_u64),  # a huge length, if a BYTES is owed
    st.integers(-(2**63), 2**63 - 1).filter(lambda n: not 0 <= n <= LIMITS.max_keys).map(encode_i64),  # a bad LIST count
)


@st.composite
def reply_streams(draw: st.DrawFn) -> tuple[list[tuple[tuple[Reply, int], int]], int, bytes]:
    """(each expected shape with the offset of its reply's first byte, how many of them have
    their whole reply in the stream, the stream)."""
    items = draw(st.lists(_reply, max_size=6))
    shapes: list[tuple[tuple[Reply, int], int]] = []
    data = b""
    for shape, raw in items:
        shapes.append((shape, len(data)))
        data += raw
    shapes += [(s, len(data)) for s in draw(st.lists(_shapes, max_size=2))]  # owed, maybe never (fully) answered
    return shapes, len(items), data + draw(_reply_tails)


# ---------------------------------------------------------------- drivers


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


Outcome = tuple[list[Any], str | None, int]  # items, the error's text, the leftover (buffered / pending)


def _drive(
    pieces: list[bytes],
    feed: Callable[[bytes], None],
    step: Callable[[], Any],
    drain_every: int,
    before: Callable[[int], None] = lambda end: None,
) -> tuple[list[Any], str | None]:
    """Feed ``pieces``, collecting complete items after every ``drain_every``-th piece and at the
    end; ``before(end)`` runs before a piece that ends at offset ``end`` is fed."""
    got: list[Any] = []
    end = 0
    try:
        for i, piece in enumerate(pieces):
            end += len(piece)
            before(end)
            feed(piece)
            if (i + 1) % drain_every == 0:
                while (r := step()) is not None:
                    got.append(r)
        before(end + 1)
        while (r := step()) is not None:
            got.append(r)
    except ProtocolError as exc:
        return got, f"{type(exc).__name__}: {exc}"
    return got, None


def _assert_dead(calls: list[Callable[[], object]], err: str) -> None:
    for call in calls:
        try:
            call()
        except ProtocolError as exc:
            assert f"{type(exc).__name__}: {exc}" == err
        else:
            raise AssertionError(f"a dead parser accepted {call}")


def _requests(pieces: list[bytes], drain_every: int) -> Outcome:
    p = RequestParser(LIMITS)
    got, err = _drive(pieces, p.feed, p.next_request, drain_every)
    if err is not None:
        _assert_dead([lambda: p.feed(b"\0"), lambda: p.feed(VALIDATE), p.next_request, lambda: next(iter(p))], err)
    return got, err, p.buffered if err is None else -1


def _replies(shapes: list[tuple[tuple[Reply, int], int]], pieces: list[bytes], drain_every: int, just_in_time: bool) -> Outcome:
    p = ReplyParser(LIMITS)
    todo = list(shapes)

    def expect_until(end: int) -> None:
        # a real client's request goes out before its reply's first byte can come back
        while todo and (not just_in_time or todo[0][1] < end):
            (shape, count), _ = todo.pop(0)
            p.expect(shape, count)

    expect_until(0)
    got, err = _drive(pieces, p.feed, p.next_reply, drain_every, expect_until)
    expect_until(1 << 62)
    if err is not None:
        _assert_dead([lambda: p.feed(b"\0"), p.next_reply, p.next_reply], err)
    return got, err, p.pending


def _ways(data: bytes, cuts: list[int], every: int) -> dict[str, tuple[list[bytes], int]]:
    return {
        "whole": ([data] if data else [], 1),
        "byte by byte": ([data[i : i + 1] for i in range(len(data))], 1),
        "random chunks": (_split(data, cuts), 1),
        "random chunks, drained now and then": (_split(data, cuts), every),
    }


_settings = settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


@_settings
@given(stream=request_streams(), cuts=st.lists(st.integers(0, 2**16), max_size=12), every=st.integers(2, 5))
def request_property(stream: bytes, cuts: list[int], every: int) -> None:
    RUNS["requests"] += 1
    results = {name: _requests(pieces, n) for name, (pieces, n) in _ways(stream, cuts, every).items()}
    for name, outcome in results.items():
        assert outcome == results["whole"], name


@_settings
@given(spec=reply_streams(), cuts=st.lists(st.integers(0, 2**16), max_size=12), every=st.integers(2, 5), just_in_time=st.booleans())
def reply_property(spec: tuple[list[tuple[tuple[Reply, int], int]], int, bytes], cuts: list[int], every: int, just_in_time: bool) -> None:
    RUNS["replies"] += 1
    shapes, n_items, stream = spec
    whole = _replies(shapes, [stream] if stream else [], 1, False)
    assert len(whole[0]) >= n_items, whole  # the valid replies all come out, however the tail breaks
    for name, (pieces, n) in _ways(stream, cuts, every).items():
        assert _replies(shapes, pieces, n, just_in_time) == whole, (name, just_in_time)


def _run(prop: Callable[[], None], name: str) -> None:
    before = RUNS[name]
    prop()
    ran = RUNS[name] - before
    print(f"{name}: {ran} examples x 4 ways of feeding each")
    assert ran >= MAX_EXAMPLES // 2, ran


def test_request_parser_any_chunking_gives_the_same_requests_and_error() -> None:
    _run(request_property, "requests")


def test_reply_parser_any_chunking_gives_the_same_replies_and_error() -> None:
    """Also with each expect() made just before its reply's first byte is fed."""
    _run(reply_property, "replies")
