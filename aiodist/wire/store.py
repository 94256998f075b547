"""torch's TCPStore wire protocol, sans-I/O: encode/decode requests and replies on bytes.

Rules this module keeps (torch 2.13's TCPStore protocol, as its C++ client and server speak it):
- A request is one opcode byte and its fields; integers are little-endian; strings are a
  u64 length then bytes; key lists are a u64 count then strings. There is no framing and no
  request id: replies come in request order (but a WAIT's reply may come after the replies
  of requests sent after it, so a client never sends anything behind a WAIT on the same
  connection).
- The first request on a connection must be VALIDATE with the magic; anything else is a
  protocol error.
- Everything a peer sends is bounded by ``Limits`` *before* it is buffered: a length field
  over the limit is a ``ProtocolError`` at once, never a large allocation.
No sockets, no asyncio here: ``RequestParser`` (server side) and ``ReplyParser`` (client
side) take bytes in and hand decoded values out.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "MAGIC",
    "Op",
    "Reply",
    "Limits",
    "Request",
    "ProtocolError",
    "RequestParser",
    "ReplyParser",
    "QUICK",
    "quick_request",
    "encode_request",
    "encode",
    "encode_u8",
    "encode_u32",
    "encode_i64",
    "encode_bytes",
    "encode_bytes_list",
    "encode_queue_pop",
    "encode_check_get",
    "encode_add",
    "encode_set_ping",
    "STOP_WAITING",
    "WAIT_CANCELED",
    "CHECK_READY",
    "CHECK_NOT_READY",
]

MAGIC = 0x3C85F7CE

STOP_WAITING = 0
WAIT_CANCELED = 1
CHECK_READY = 0
CHECK_NOT_READY = 1

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Op(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST = 17


class Reply(enum.Enum):
    """The shape of a reply, as a client expects it."""

    U8 = "u8"
    U32 = "u32"
    I64 = "i64"
    BYTES = "bytes"
    BYTES_LIST = "bytes_list"  # a known count of strings (MULTI_GET): count given with the shape
    COUNTED_LIST = "counted_list"  # i64 count, then strings (LIST)
    QUEUE_POP = "queue_pop"  # i64 length before the pop, then a string if it was > 0

    # Members are singletons, so identity hashing is right, and it runs in C: Enum's own hashes
    # the name in Python, which the client's per-reply dict lookup (``_WHOLE``) would pay for.
    __hash__ = object.__hash__


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol or its limits. Close that connection."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one peer may send. Defaults are torch's libuv server's, plus a request cap."""

    max_key_bytes: int = 8 * 1024
    max_value_bytes: int = 8 * 1024 * 1024
    max_keys: int = 128 * 1024
    max_request_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_keys", "max_request_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {v!r}")


class Request(NamedTuple):
    """One decoded request. ``keys``/``values`` hold the string fields, ``number`` the integer one.

    SET/APPEND/QUEUE_PUSH: keys=(k,), values=(v,). COMPARE_SET: keys=(k,), values=(expected,
    desired). ADD: keys=(k,), number=delta. CHECK/WAIT/MULTI_GET: keys. MULTI_SET: keys, values
    pairwise. GET/DELETE_KEY/QUEUE_POP/QUEUE_LEN: keys=(k,). PING/VALIDATE: number.
    (A NamedTuple rather than a frozen dataclass: the server makes one per request, and a
    tuple is several times cheaper to build.)
    """

    op: Op
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0


# ---------------------------------------------------------------- encoding


def _keylist(keys: tuple[bytes, ...] | list[bytes]) -> bytes:
    return _U64.pack(len(keys)) + encode_bytes_list(list(keys))


def encode_request(req: Request) -> bytes:
    """The bytes of ``req``. Refuses requests whose fields do not fit the opcode."""
    return encode(req.op, req.keys, req.values, req.number)


def encode(op: Op, keys: tuple[bytes, ...] | list[bytes] = (), values: tuple[bytes, ...] | list[bytes] = (), number: int = 0) -> bytes:
    """The bytes of one request, from its fields (see ``Request`` for which fields each op takes)."""
    k, v = keys, values
    head = _OPBYTE[op]
    if op is Op.SET or op is Op.APPEND or op is Op.QUEUE_PUSH:
        _arity(op, k, v, 1, 1)
        return head + _U64.pack(len(k[0])) + k[0] + _U64.pack(len(v[0])) + v[0]
    if op is Op.GET or op is Op.DELETE_KEY or op is Op.QUEUE_POP or op is Op.QUEUE_LEN:
        _arity(op, k, v, 1, 0)
        return head + _U64.pack(len(k[0])) + k[0]
    if op is Op.ADD:
        _arity(op, k, v, 1, 0)
        return head + _U64.pack(len(k[0])) + k[0] + _I64.pack(number)
    if op is Op.CHECK or op is Op.WAIT or op is Op.MULTI_GET:
        return head + _keylist(k)
    if op is Op.VALIDATE or op is Op.PING:
        return head + _U32.pack(number & 0xFFFFFFFF)
    if op is Op.COMPARE_SET:
        _arity(op, k, v, 1, 2)
        return head + encode_bytes(k[0]) + encode_bytes(v[0]) + encode_bytes(v[1])
    if op is Op.MULTI_SET:
        if len(k) != len(v):
            raise ValueError(f"MULTI_SET needs as many values as keys ({len(k)} keys, {len(v)} values)")
        return head + _U64.pack(len(k)) + b"".join(encode_bytes(a) + encode_bytes(b) for a, b in zip(k, v))
    if op is Op.GETNUMKEYS or op is Op.CANCEL_WAIT or op is Op.LIST:
        return head
    raise ValueError(f"unknown opcode {op!r}")


_OPBYTE = {op: bytes((op,)) for op in Op}
_OPS = tuple(Op)  # by opcode: a tuple index is much cheaper than Op(code)
assert all(op == i for i, op in enumerate(_OPS))


def _arity(op: Op, k: tuple[bytes, ...] | list[bytes], v: tuple[bytes, ...] | list[bytes], nkeys: int, nvalues: int) -> None:
    if len(k) != nkeys or len(v) != nvalues:
        raise ValueError(f"{op.name} takes {nkeys} key(s) and {nvalues} value(s), got {len(k)} and {len(v)}")


def encode_u8(v: int) -> bytes:
    return bytes((v,))


def encode_u32(v: int) -> bytes:
    return _U32.pack(v & 0xFFFFFFFF)


def encode_i64(v: int) -> bytes:
    return _I64.pack(v)


def encode_bytes(b: bytes) -> bytes:
    return _U64.pack(len(b)) + b


def encode_bytes_list(items: list[bytes], counted: bool = False) -> bytes:
    """Strings back to back; with ``counted`` an i64 count first (the LIST reply)."""
    body = b"".join(_U64.pack(len(b)) + b for b in items)
    return (_I64.pack(len(items)) + body) if counted else body


def encode_queue_pop(length_before: int, value: bytes | None) -> bytes:
    if length_before > 0:
        assert value is not None
        return _I64.pack(length_before) + _U64.pack(len(value)) + value
    return _I64.pack(0)


# The client's hot requests, built in one step each: the same bytes as ``encode`` (the tests
# compare them), without its checks and its walk down the opcodes.
_OP_LEN = struct.Struct("<BQ")  # an opcode, then a string's length
_OP_ONE_LEN = struct.Struct("<BQQ")  # an opcode, a key count of 1, the key's length
_PING_0 = bytes((13,)) + _U32.pack(0)


def encode_check_get(key: bytes) -> bytes:
    """CHECK then GET of ``key``: what a client's ``get`` sends."""
    n = len(key)
    return b"".join((_OP_ONE_LEN.pack(5, 1, n), key, _OP_LEN.pack(3, n), key))


def encode_add(key: bytes, number: int) -> bytes:
    """ADD ``number`` to ``key``."""
    return b"".join((_OP_LEN.pack(4, len(key)), key, _I64.pack(number)))


def encode_set_ping(key: bytes, value: bytes) -> bytes:
    """SET ``key`` to ``value``, then PING 0 (SET has no reply: the echo confirms it)."""
    return b"".join((_OP_LEN.pack(1, len(key)), key, _U64.pack(len(value)), value, _PING_0))


# ---------------------------------------------------------------- decoding
#
# The parsers are resumable: each request/reply is decoded by a generator that reads fields
# from a growing buffer and yields whenever it needs bytes that have not arrived. The next
# chunk resumes it where it stopped, so every byte is looked at once however the stream is
# split (a re-parse from the start on every chunk would make large multi-key messages cost
# time quadratic in their size).

_U8S = struct.Struct("<B")


class _Stream:
    """A growing buffer and the read position of the message being decoded. ``cap``: the most
    bytes a message may have (a request's ``max_request_bytes``): a field that would end past it
    is refused when the decoder reaches it, so the error is the same however the bytes arrive."""

    __slots__ = ("buf", "pos", "cap")

    def __init__(self, cap: int = sys.maxsize) -> None:
        self.buf = bytearray()
        self.pos = 0
        self.cap = cap

    def consume(self) -> None:
        """Drop the bytes of the message just decoded (O(1): bytearray trims its front lazily)."""
        del self.buf[: self.pos]
        self.pos = 0


def _over(st: _Stream) -> ProtocolError:
    return ProtocolError(f"request of over {st.cap} bytes")


def _fixed(st: _Stream, fmt: struct.Struct) -> Generator[None, None, int]:
    if st.pos + fmt.size > st.cap:
        raise _over(st)
    while len(st.buf) - st.pos < fmt.size:
        yield
    (v,) = fmt.unpack_from(st.buf, st.pos)
    st.pos += fmt.size
    return v


def _string(st: _Stream, limit: int, what: str) -> Generator[None, None, bytes]:
    n = yield from _fixed(st, _U64)
    if n > limit:
        raise ProtocolError(f"{what} of {n} bytes is over the limit of {limit} bytes")
    if st.pos + n > st.cap:
        raise _over(st)
    while len(st.buf) - st.pos < n:
        yield
    v = bytes(st.buf[st.pos : st.pos + n])
    st.pos += n
    return v


def _count(st: _Stream, limit: int, what: str) -> Generator[None, None, int]:
    n = yield from _fixed(st, _U64)
    if n > limit:
        raise ProtocolError(f"{what} of {n} keys is over the limit of {limit} keys")
    return n


# What ``quick_request`` does with each opcode (0: leaves it to the resumable decoder). Plain
# ints and a table: comparing an int with an IntEnum member costs several times more.
_Q_ONE_KEY, _Q_ADD, _Q_KEY_VALUE, _Q_KEY_LIST, _Q_PING, _Q_BARE = 1, 2, 3, 4, 5, 6
_QUICK_OPS: dict[int, int] = {
    Op.GET: _Q_ONE_KEY,
    Op.DELETE_KEY: _Q_ONE_KEY,
    Op.QUEUE_POP: _Q_ONE_KEY,
    Op.QUEUE_LEN: _Q_ONE_KEY,
    Op.ADD: _Q_ADD,
    Op.SET: _Q_KEY_VALUE,
    Op.APPEND: _Q_KEY_VALUE,
    Op.QUEUE_PUSH: _Q_KEY_VALUE,
    Op.CHECK: _Q_KEY_LIST,
    Op.WAIT: _Q_KEY_LIST,
    Op.MULTI_GET: _Q_KEY_LIST,
    Op.PING: _Q_PING,
    Op.GETNUMKEYS: _Q_BARE,
    Op.CANCEL_WAIT: _Q_BARE,
    Op.LIST: _Q_BARE,
}
_QUICK_KIND = bytes(_QUICK_OPS.get(code, 0) for code in range(256))
_PING = Op.PING
_new_request = tuple.__new__  # Request(...) runs a Python __new__; this builds the same tuple in C


def quick_request(buf: bytes | bytearray, pos: int, lim: Limits) -> tuple[Request, int] | None:
    """The request at ``buf[pos:]`` and where it ends, decoded in one step, when it is one of the
    common ops (not VALIDATE), complete and within ``lim``. None for anything else (a request cut
    short, over a limit, a rarer opcode, an unknown one): ``RequestParser`` then takes it and
    raises its errors as it always did, so this path changes no outcome, only the cost. A
    server may call it on a chunk it received while its parser holds nothing (``idle``)."""
    have = len(buf)
    code = buf[pos]
    kind = _QUICK_KIND[code]
    if kind == _Q_ONE_KEY or kind == _Q_ADD or kind == _Q_KEY_VALUE:
        if have < pos + 9:
            return None
        (n,) = _U64.unpack_from(buf, pos + 1)
        at = pos + 9
        end = at + n
        if n > lim.max_key_bytes:
            return None
        if kind == _Q_ONE_KEY:
            if have < end:
                return None
            return _new_request(Request, (_OPS[code], (bytes(buf[at:end]),), (), 0)), end
        if have < end + 8:
            return None
        if kind == _Q_ADD:
            return _new_request(Request, (_OPS[code], (bytes(buf[at:end]),), (), _I64.unpack_from(buf, end)[0])), end + 8
        (m,) = _U64.unpack_from(buf, end)
        v_end = end + 8 + m
        if m > lim.max_value_bytes or have < v_end or v_end - pos > lim.max_request_bytes:
            return None
        return _new_request(Request, (_OPS[code], (bytes(buf[at:end]),), (bytes(buf[end + 8 : v_end]),), 0)), v_end
    if kind == _Q_KEY_LIST:
        if have < pos + 9:
            return None
        (count,) = _U64.unpack_from(buf, pos + 1)
        if count > lim.max_keys:
            return None
        keys = []
        at = pos + 9
        for _ in range(count):
            if have < at + 8:
                return None
            (n,) = _U64.unpack_from(buf, at)
            at += 8
            if n > lim.max_key_bytes or have < at + n:
                return None
            keys.append(bytes(buf[at : at + n]))
            at += n
        if at - pos > lim.max_request_bytes:
            return None
        return _new_request(Request, (_OPS[code], tuple(keys), (), 0)), at
    if kind == _Q_PING:
        return (_new_request(Request, (_PING, (), (), _U32.unpack_from(buf, pos + 1)[0])), pos + 5) if have >= pos + 5 else None
    if kind == _Q_BARE:
        return _new_request(Request, (_OPS[code], (), (), 0)), pos + 1
    return None


class RequestParser:
    """Server side: ``feed(bytes)``, then iterate to get each complete ``Request`` in order.

    Raises ``ProtocolError`` (from ``feed`` or iteration) when the peer breaks the protocol:
    no VALIDATE first, a bad magic, an unknown opcode, a field over ``limits``. After that the
    parser is dead; the caller closes the connection.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._st = _Stream(self.limits.max_request_bytes)
        self._gen: Generator[None, None, Request] | None = None
        self._validated = False
        self._dead: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._st.buf)

    @property
    def idle(self) -> bool:
        """Past VALIDATE, alive, and holding no part of a request: the next byte fed starts one."""
        return self._validated and not self._st.buf and self._dead is None

    def feed(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        self._st.buf += data

    def __iter__(self) -> Iterator[Request]:
        return self

    def __next__(self) -> Request:
        req = self.next_request()
        if req is None:
            raise StopIteration
        return req

    def next_request(self) -> Request | None:
        """The next complete request, or None until more bytes arrive."""
        if self._dead is not None:
            raise self._dead
        gen = self._gen
        if gen is None:
            buf = self._st.buf
            if not buf:
                return None
            if self._validated and (got := quick_request(buf, 0, self.limits)) is not None:
                req, end = got
                del buf[:end]
                return req
            gen = self._gen = self._request()
        try:
            next(gen)
        except StopIteration as done:
            self._gen = None
            self._st.consume()
            return done.value
        except ProtocolError as exc:
            raise self._die(exc)  # noqa: B904 - the parser's own error, raised as is
        # Incomplete. The request cap needs no check here: the decoder refuses a field that would
        # cross it before it waits for that field's bytes (_fixed, _string), however they arrive.
        return None

    def _die(self, exc: ProtocolError) -> ProtocolError:
        self._dead = exc
        self._gen = None
        return exc

    def _request(self) -> Generator[None, None, Request]:
        st, lim = self._st, self.limits
        code = yield from _fixed(st, _U8S)
        if code >= len(_OPS):
            raise ProtocolError(f"unknown opcode {code}")
        op = _OPS[code]
        if not self._validated:
            if op is not Op.VALIDATE:
                raise ProtocolError(f"first request must be VALIDATE, got {op.name}")
            magic = yield from _fixed(st, _U32)
            if magic != MAGIC:
                raise ProtocolError(f"bad validation magic 0x{magic:08X}")
            self._validated = True
            return Request(op, number=magic)
        K, V = lim.max_key_bytes, lim.max_value_bytes
        if op is Op.SET or op is Op.APPEND or op is Op.QUEUE_PUSH:
            key = yield from _string(st, K, "key")
            value = yield from _string(st, V, "value")
            return Request(op, (key,), (value,))
        if op is Op.GET or op is Op.DELETE_KEY or op is Op.QUEUE_POP or op is Op.QUEUE_LEN:
            key = yield from _string(st, K, "key")
            return Request(op, (key,))
        if op is Op.ADD:
            key = yield from _string(st, K, "key")
            delta = yield from _fixed(st, _I64)
            return Request(op, (key,), number=delta)
        if op is Op.CHECK or op is Op.WAIT or op is Op.MULTI_GET:
            n = yield from _count(st, lim.max_keys, op.name)
            keys = []
            for _ in range(n):
                keys.append((yield from _string(st, K, "key")))
            return Request(op, tuple(keys))
        if op is Op.COMPARE_SET:
            key = yield from _string(st, K, "key")
            expected = yield from _string(st, V, "expected value")
            desired = yield from _string(st, V, "desired value")
            return Request(op, (key,), (expected, desired))
        if op is Op.MULTI_SET:
            n = yield from _count(st, lim.max_keys, op.name)
            keys, values = [], []
            for _ in range(n):
                keys.append((yield from _string(st, K, "key")))
                values.append((yield from _string(st, V, "value")))
            return Request(op, tuple(keys), tuple(values))
        if op is Op.PING:
            nonce = yield from _fixed(st, _U32)
            return Request(op, number=nonce)
        if op is Op.VALIDATE:
            raise ProtocolError("VALIDATE sent twice on one connection")  # torch closes it too
        # GETNUMKEYS, CANCEL_WAIT, LIST take no fields
        return Request(op)


def _unexpected(first: int) -> ProtocolError:
    # No byte count: it would depend on how the stream was split.
    return ProtocolError(f"unexpected byte(s) from the server with no reply outstanding (first byte 0x{first:02x})")


# Decoders of the replies of one or two fields, read whole once complete: ``(value, end)`` for
# the reply at ``buf[pos:]``, or None until it is all in. A string length over ``limit`` raises
# as soon as it is in, as the resumable decoder does.


def _u8_reply(buf: bytearray, pos: int, limit: int) -> tuple[object, int] | None:
    return (buf[pos], pos + 1) if len(buf) > pos else None


def _u32_reply(buf: bytearray, pos: int, limit: int) -> tuple[object, int] | None:
    return (_U32.unpack_from(buf, pos)[0], pos + 4) if len(buf) >= pos + 4 else None


def _i64_reply(buf: bytearray, pos: int, limit: int) -> tuple[object, int] | None:
    return (_I64.unpack_from(buf, pos)[0], pos + 8) if len(buf) >= pos + 8 else None


def _bytes_reply(buf: bytearray, pos: int, limit: int) -> tuple[object, int] | None:
    if len(buf) < pos + 8:
        return None
    (n,) = _U64.unpack_from(buf, pos)
    if n > limit:
        raise ProtocolError(f"value of {n} bytes is over the limit of {limit} bytes")
    end = pos + 8 + n
    return (bytes(buf[pos + 8 : end]), end) if len(buf) >= end else None


def _queue_pop_reply(buf: bytearray, pos: int, limit: int) -> tuple[object, int] | None:
    if len(buf) < pos + 8:
        return None
    (length,) = _I64.unpack_from(buf, pos)
    if length <= 0:
        return (length, None), pos + 8
    got = _bytes_reply(buf, pos + 8, limit)
    return None if got is None else ((length, got[0]), got[1])


# By shape. The two lists are not here: they take the resumable decoder (a long list may come
# in many chunks, and reading it again from its start each time would cost quadratic time).
_WHOLE: dict[Reply, Callable[[bytearray, int, int], tuple[object, int] | None]] = {
    Reply.U8: _u8_reply,
    Reply.U32: _u32_reply,
    Reply.I64: _i64_reply,
    Reply.BYTES: _bytes_reply,
    Reply.QUEUE_POP: _queue_pop_reply,
}


def _quick_i64(data: bytes) -> tuple[int] | None:
    return _I64.unpack(data) if len(data) == 8 else None


def _quick_u8_bytes(data: bytes) -> tuple[int, bytes] | None:
    if len(data) >= 9 and len(data) == 9 + _U64.unpack_from(data, 1)[0]:
        return data[0], data[9:]
    return None


# Decoders of a whole reply group from a chunk that holds exactly it (None for any other
# chunk), by the group's shapes: what ``ReplyParser.feed_group`` takes as ``quick``. The
# client's hot calls: ADD's one i64, and a get's CHECK and GET.
QUICK: dict[tuple[tuple[Reply, int], ...], Callable[[bytes], Any]] = {
    ((Reply.I64, 0),): _quick_i64,
    ((Reply.U8, 0), (Reply.BYTES, 0)): _quick_u8_bytes,
}


class ReplyParser:
    """Client side: ``expect(shape)`` for each request sent, in order; ``feed`` bytes;
    ``next_reply()`` returns each decoded reply in that order (None until complete).

    Decoded values: U8/U32/I64 -> int; BYTES -> bytes; BYTES_LIST/COUNTED_LIST -> list[bytes];
    QUEUE_POP -> (length_before, bytes | None).

    How the bytes are split never matters: the same stream gives the same replies and then the
    same ``ProtocolError`` fed whole or byte by byte. A byte with no reply owed is an error
    (raised by ``feed`` if it arrives then, else by the ``next_reply()`` after the last reply,
    which is still returned first). After an error the parser is dead: ``feed`` and
    ``next_reply`` raise it again.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        # A server may legitimately hold values past a client's own limits; cap only absurd sizes.
        self.limits = limits or Limits(max_key_bytes=1 << 40, max_value_bytes=1 << 40, max_keys=1 << 40, max_request_bytes=1 << 40)
        self._st = _Stream()
        self._gen: Generator[None, None, object] | None = None
        self._expected: deque[tuple[Reply, int]] = deque()
        self._dead: ProtocolError | None = None
        self._group: list[object] = []  # the replies of a group that ``next_group`` has so far
        self._max_value = self.limits.max_value_bytes
        self.expect_each = self._expected.extend  # type: ignore[method-assign,assignment] # the method, bound in C: called per request

    @property
    def pending(self) -> int:
        return len(self._expected)

    def expect(self, shape: Reply, count: int = 0) -> None:
        self._expected.append((shape, count))

    def expect_each(self, shapes: Iterable[tuple[Reply, int]]) -> None:
        """``expect(shape, count)`` for each pair, in order."""
        self._expected.extend(shapes)

    def feed(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        if data and not self._expected and not self._st.buf:
            raise self._die(_unexpected(data[0]))
        self._st.buf += data

    def next_reply(self) -> object | None:
        if self._dead is not None:
            raise self._dead
        if not self._expected:
            if self._st.buf:  # bytes past the last reply owed
                raise self._die(_unexpected(self._st.buf[0]))
            return None
        gen = self._gen
        if gen is None:
            shape, count = self._expected[0]
            whole = _WHOLE.get(shape)
            if whole is not None:
                try:
                    got = whole(self._st.buf, 0, self._max_value)
                except ProtocolError as exc:
                    raise self._die(exc)  # noqa: B904 - the parser's own error, raised as is
                if got is None:
                    return None
                del self._st.buf[: got[1]]
                self._expected.popleft()
                return got[0]
            gen = self._gen = self._reply(shape, count)
        try:
            next(gen)
        except StopIteration as done:
            self._gen = None
            self._st.consume()
            self._expected.popleft()
            return done.value  # bytes after it, if nothing more is owed, fail the next call
        except ProtocolError as exc:
            raise self._die(exc)  # noqa: B904 - the parser's own error, raised as is
        return None

    def feed_group(self, data: bytes, n: int, quick: Callable[[bytes], Any] | None = None) -> Any:
        """``feed(data)`` then ``next_group(n)``, for a chunk that holds the next ``n`` replies
        and nothing else while nothing is buffered (a client's one request in flight): those are
        read from ``data`` in place, never copied into the buffer; by ``quick`` when given (one
        of ``QUICK``'s decoders, of this group's shapes: None unless the chunk is exactly its
        replies). Any other chunk is fed and read as those two calls would, with the same
        replies and errors."""
        if self._st.buf or self._gen is not None or self._group or self._dead is not None:
            self.feed(data)
            return self.next_group(n)
        expected = self._expected
        if quick is not None and len(data) <= self._max_value:  # (a value over the limit: the slow path refuses it)
            got = quick(data)
            if got is not None:
                for _ in range(n):
                    expected.popleft()
                return got
        limit, pos = self._max_value, 0
        values: list[object] = []
        try:
            for i in range(n):
                whole = _WHOLE.get(expected[i][0])
                one = whole(data, pos, limit) if whole is not None else None  # type: ignore[arg-type]
                if one is None:
                    break
                values.append(one[0])
                pos = one[1]
        except ProtocolError:
            values = []  # the slow path raises it, and kills the parser
        if len(values) == n and pos == len(data):
            for _ in values:
                expected.popleft()
            return values
        self.feed(data)
        return self.next_group(n)

    def next_group(self, n: int) -> list[object] | None:
        """The next ``n`` replies (``n`` <= ``pending``) as a list, once the last of them is
        complete; None until then (the complete ones are kept for the next call). The same
        replies and errors as ``n`` calls of ``next_reply``, in one call: a client reads the
        replies of one request group (a get's CHECK and GET) together."""
        if self._dead is not None:
            raise self._dead
        got, expected = self._group, self._expected
        if not got and self._gen is None:
            # The usual case, every reply of the group whole in the buffer: read them in place.
            buf, limit, pos = self._st.buf, self._max_value, 0
            values: list[object] = []
            try:
                for i in range(n):
                    whole = _WHOLE.get(expected[i][0])
                    one = whole(buf, pos, limit) if whole is not None else None
                    if one is None:
                        break
                    values.append(one[0])
                    pos = one[1]
            except ProtocolError as exc:
                raise self._die(exc)  # noqa: B904 - the parser's own error, raised as is
            finally:
                if pos:
                    del buf[:pos]
                    for _ in values:
                        expected.popleft()
            if len(values) == n:
                return values
            got = self._group = values
        while len(got) < n:  # the rest one at a time: a reply cut short, or a list
            value = self.next_reply()
            if value is None:
                return None
            got.append(value)
        self._group = []
        return got

    def _die(self, exc: ProtocolError) -> ProtocolError:
        self._dead = exc
        self._gen = None
        self._group = []
        return exc

    def _reply(self, shape: Reply, count: int) -> Generator[None, None, object]:
        st, V = self._st, self.limits.max_value_bytes
        if shape is Reply.U8:
            return (yield from _fixed(st, _U8S))
        if shape is Reply.I64:
            return (yield from _fixed(st, _I64))
        if shape is Reply.BYTES:
            return (yield from _string(st, V, "value"))
        if shape is Reply.QUEUE_POP:
            n = yield from _fixed(st, _I64)
            return (n, (yield from _string(st, V, "value"))) if n > 0 else (n, None)
        if shape is Reply.BYTES_LIST or shape is Reply.COUNTED_LIST:
            if shape is Reply.COUNTED_LIST:
                count = yield from _fixed(st, _I64)
                if count < 0 or count > self.limits.max_keys:
                    raise ProtocolError(f"bad key count {count} in LIST reply")
            items = []
            for _ in range(count):
                items.append((yield from _string(st, V, "value")))
            return items
        if shape is Reply.U32:
            return (yield from _fixed(st, _U32))
        raise AssertionError(shape)  # pragma: no cover
