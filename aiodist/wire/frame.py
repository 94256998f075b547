"""Framing of the rank-to-rank transport, sans-I/O: a fixed 40-byte header, then the payload.

Rules this module keeps:
- A frame is a little-endian header (``encode_header``; layout in ``HEADER``) and ``length``
  payload bytes. Byte 0 is ``MAGIC | VERSION``: a peer that speaks another protocol or another
  version of this one is refused on its first frame. Reserved header bytes are zero on the
  wire and are checked; ``flags`` is carried verbatim for the transport to give meaning to.
- Kinds: HELLO (handshake: ``Hello(token, rank, world_size)``), DATA (an op's payload, named by
  group id, the op's sequence number, and a tag), ABORT (utf-8 reason: this op/group is dead),
  GOODBYE (orderly close, no payload). A connection opens with the peer's HELLO; every later
  frame's source is the HELLO's rank; nothing may follow GOODBYE.
- Everything a peer sends is bounded *before* it is buffered: a length over ``FrameLimits``
  is refused as soon as its header is read, before any payload byte is stored. A DATA payload
  no receive has claimed is staged only within ``max_staged_bytes`` per connection.
- DATA payloads go where the owner says, after ``HeaderReceived``: ``set_target(view)`` for a
  posted receive (the bytes land straight in the user's array), ``set_target(None)`` to stage
  them. Either way the decoder copies each payload byte at most once after the kernel's copy
  (a staged payload is copied once more by the owner, when its receive is posted).
- Errors say whose fault they are: ``RemoteProtocolError`` (the peer's bytes broke a rule; final:
  the decoder is dead, close the connection) and ``LocalProtocolError`` (this side misused the
  decoder; the call is refused and the state is unchanged).
No sockets, no asyncio here: ``FrameDecoder`` has the shape of an ``asyncio.BufferedProtocol``
(``get_buffer`` / ``buffer_updated``) and hands out events; ``frame_parts`` builds what a
transport passes to ``writelines`` / ``sendmsg`` without copying the payload.
"""

from __future__ import annotations

import enum
import json
import pickle
import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "HEADER_SIZE",
    "FrameKind",
    "FrameHeader",
    "FrameLimits",
    "FrameProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "StagingLimitError",
    "Hello",
    "encode_header",
    "encode_hello",
    "decode_hello",
    "hello_frame",
    "abort_frame",
    "decode_abort",
    "goodbye_frame",
    "frame_parts",
    "DecoderState",
    "FrameDecoder",
    "FIRST_READ_AHEAD",
    "HeaderReceived",
    "PayloadReceived",
    "HelloReceived",
    "AbortReceived",
    "GoodbyeReceived",
    "Event",
]

# Anything with the buffer protocol: bytes, bytearray, memoryview, numpy arrays. (typeshed's
# Buffer protocol would say it, but numpy's stubs only declare __buffer__ from Python 3.12 on.)
BufferLike: TypeAlias = Any

MAGIC = 0xA0  # high nibble: "aiodist frame"; low nibble: the version
VERSION = 2  # 2: bytes 28-31 carry the op's digest (was reserved, 0)
_MAGIC_BYTE = MAGIC | VERSION

# offset size field
#   0    1   magic | version (0xA1)
#   1    1   kind (FrameKind)
#   2    1   flags (carried verbatim)
#   3    1   reserved, 0
#   4    4   group id (u32)
#   8    8   sequence number (u64): the op's per-group sequence number
#  16    8   tag (i64): the user's p2p tag, or an algorithm's step/chunk index
#  24    4   source rank (u32, global)
#  28    4   digest (u32): what every rank must agree on for this op (0: none); see aiodist._digest
#  32    8   payload length (u64)
# Every field sits at its natural alignment, so a C or numpy reader can map the header as is.
HEADER = struct.Struct("<BBBBIQqIIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 40

_HELLO = struct.Struct("<II")


class FrameKind(enum.IntEnum):
    # 0 is not a kind: a zeroed buffer is never a valid frame.
    HELLO = 1
    DATA = 2
    ABORT = 3
    GOODBYE = 4


# by kind byte: a tuple index is much cheaper than FrameKind(code), and None marks unknown kinds
_KINDS: tuple[FrameKind | None, ...] = tuple(FrameKind(c) if c in FrameKind._value2member_map_ else None for c in range(256))
_DATA = FrameKind.DATA
_HELLO_KIND = FrameKind.HELLO
_ABORT = FrameKind.ABORT
_GOODBYE = FrameKind.GOODBYE


class FrameHeader(NamedTuple):
    """One decoded header. Field order is ``encode_header``'s, so ``encode_header(*h)`` works.
    (A NamedTuple rather than a frozen dataclass: one is made per frame, and a tuple is cheaper.)"""

    kind: FrameKind
    group: int
    seq: int
    tag: int
    source: int
    length: int
    flags: int = 0
    digest: int = 0

    def encode(self) -> bytes:
        return encode_header(self.kind, self.group, self.seq, self.tag, self.source, self.length, self.flags, self.digest)


class FrameProtocolError(Exception):
    """A frame or a use of the decoder broke this module's rules."""


class LocalProtocolError(FrameProtocolError):
    """This side misused the decoder (e.g. asked for a payload buffer before ``set_target``).
    The call was refused and nothing changed."""


class RemoteProtocolError(FrameProtocolError):
    """The peer's bytes broke the protocol or its limits. Final: the decoder is dead and every
    later call raises this again; close the connection.

    ``events`` holds the events decoded from the same bytes before the fault, in order: deliver
    them before closing (an ABORT among them likely explains the garbage after it).
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.events: list[Event] = []


class StagingLimitError(RemoteProtocolError):
    """The peer sent more unclaimed payload bytes (no receive posted for them) than
    ``FrameLimits.max_staged_bytes`` allows one connection to hold."""


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Bounds on what one peer may make this side hold."""

    max_payload_bytes: int = 1 << 30  # one DATA frame
    max_staged_bytes: int = 64 << 20  # unclaimed DATA payloads held at once (until release_staged)
    max_hello_bytes: int = 4096  # HELLO payload (rank, world size, job token)
    max_control_bytes: int = 64 << 10  # ABORT reason

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_staged_bytes", "max_hello_bytes", "max_control_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"FrameLimits.{name} must be a positive int, got {v!r}")
        if self.max_hello_bytes < _HELLO.size:
            raise ValueError(f"FrameLimits.max_hello_bytes must be at least {_HELLO.size}, got {self.max_hello_bytes}")


# ---------------------------------------------------------------- encoding


def encode_header(kind: FrameKind, group: int, seq: int, tag: int, source: int, length: int, flags: int = 0, digest: int = 0) -> bytes:
    """The 40 header bytes of one frame. Refuses values that do not fit their fields."""
    if not isinstance(kind, int) or not 0 <= kind <= 0xFF or _KINDS[kind] is None:
        raise ValueError(f"unknown frame kind {kind!r}")
    try:
        return HEADER.pack(_MAGIC_BYTE, kind, flags, 0, group, seq, tag, source, digest, length)
    except struct.error:
        raise ValueError(
            f"frame header field out of range: flags={flags!r} (u8), group={group!r} (u32), seq={seq!r} (u64), "
            f"tag={tag!r} (i64), source={source!r} (u32), digest={digest!r} (u32), length={length!r} (u64)"
        ) from None


class Hello(NamedTuple):
    """The handshake: who the peer is, and the job it belongs to (``token`` keeps two jobs on
    one host from crossing; comparing it is the transport's business)."""

    token: bytes
    rank: int
    world_size: int


def encode_hello(hello: Hello) -> bytes:
    """HELLO's payload: rank (u32), world size (u32), then the token (the rest)."""
    token, rank, world_size = hello
    if not isinstance(token, bytes | bytearray):
        raise TypeError(f"HELLO token must be bytes, got {type(token).__name__}")
    if not 0 <= rank < world_size <= 0xFFFFFFFF:
        raise ValueError(f"HELLO needs 0 <= rank < world_size < 2**32, got rank={rank} world_size={world_size}")
    return _HELLO.pack(rank, world_size) + token


def decode_hello(payload: BufferLike) -> Hello:
    """The ``Hello`` in a HELLO payload; ``RemoteProtocolError`` when it is malformed."""
    mv = memoryview(payload)
    if mv.nbytes < _HELLO.size:
        raise RemoteProtocolError(f"HELLO payload of {mv.nbytes} bytes is shorter than its {_HELLO.size}-byte fixed part")
    rank, world_size = _HELLO.unpack_from(mv, 0)
    if not rank < world_size:
        raise RemoteProtocolError(f"HELLO from rank {rank} with world size {world_size}")
    return Hello(mv[_HELLO.size :].tobytes(), rank, world_size)


def hello_frame(hello: Hello, lane: int = 0) -> bytes:
    """A whole HELLO frame (header + payload); its source is ``hello.rank``. The header's tag
    carries the connection's lane: which of the ranks' interfaces it runs over (0 unless
    several interfaces are named; see aiodist.transport)."""
    payload = encode_hello(hello)
    return encode_header(_HELLO_KIND, 0, 0, lane, hello.rank, len(payload)) + payload


#: an ABORT frame's payload: the reason (UTF-8), then, where the break names ranks, a NUL and
#: ``{"<global rank>": "<what it did>", ...}`` as JSON (every survivor learns whom to exclude)
_ABORT_CULPRITS = b"\0"
_ABORT_MAX = 60 << 10  # under FrameLimits.max_control_bytes' default, whatever the reason's length


def abort_frame(source: int, group: int, seq: int, reason: str, tag: int = 0, culprits: Mapping[int, str] | None = None) -> bytes:
    """A whole ABORT frame: rank ``source`` tells its peer that op ``seq`` of ``group`` is dead,
    why, and which ranks the break names (``culprits``: global rank -> what it did)."""
    payload = reason.replace("\0", " ").encode("utf-8", "replace")
    if culprits:
        named = {str(int(r)): str(why)[:400] for r, why in list(culprits.items())[:256]}
        payload = payload[: _ABORT_MAX - 2 - len(named) * 420] + _ABORT_CULPRITS + json.dumps(named).encode()
    payload = payload[:_ABORT_MAX]
    return encode_header(_ABORT, group, seq, tag, source, len(payload)) + payload


def decode_abort(payload: bytes) -> tuple[str, dict[int, str]]:
    """An ABORT frame's reason and the ranks it names (``abort_frame``); named ranks that do not
    parse are left out (the reason still stands)."""
    text, _, tail = payload.partition(_ABORT_CULPRITS)
    reason = text.decode("utf-8", "replace")
    culprits: dict[int, str] = {}
    if tail:
        try:
            named = json.loads(tail)
        except ValueError:
            return reason, culprits
        if isinstance(named, dict):
            for r, why in named.items():
                if isinstance(r, str) and r.isdigit() and isinstance(why, str):
                    culprits[int(r)] = why
    return reason, culprits


def goodbye_frame(source: int) -> bytes:
    """A whole GOODBYE frame: ``source`` sends nothing more on this connection."""
    return encode_header(_GOODBYE, 0, 0, 0, source, 0)


def frame_parts(header: FrameHeader, payload: BufferLike | None = None, *, join_below: int = 2048) -> list[bytes | memoryview]:
    """What to pass to ``transport.writelines`` / ``sock.sendmsg`` for one frame.

    The payload (any C-contiguous buffer: bytes, memoryview, a numpy array) is returned as a
    byte ``memoryview`` of the same memory, not copied: do not modify it until the transport
    has written it out. Payloads under ``join_below`` bytes are joined to the header in one
    bytes object instead (copying a few bytes is cheaper than another buffer, and it frees
    the caller's array at once).
    """
    head = encode_header(header.kind, header.group, header.seq, header.tag, header.source, header.length, header.flags, header.digest)
    if payload is None:
        if header.length:
            raise ValueError(f"header says {header.length} payload bytes, but no payload was given")
        return [head]
    mv = _byte_view(payload)
    if mv.nbytes != header.length:
        raise ValueError(f"header says {header.length} payload bytes, but the payload has {mv.nbytes}")
    if mv.nbytes == 0:
        return [head]
    if mv.nbytes < join_below:
        return [head + mv]
    return [head, mv]


def _byte_view(obj: BufferLike) -> memoryview:
    """A 1-D unsigned-byte view of ``obj``'s memory (any format, incl. complex), no copy."""
    mv = memoryview(obj)
    if mv.ndim == 1 and mv.format == "B" and mv.c_contiguous:
        return mv
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    # memoryview.cast refuses formats like numpy's complex 'Zf'; PickleBuffer.raw() takes any.
    return pickle.PickleBuffer(mv).raw()


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class HeaderReceived:
    """A DATA header with a payload. The owner must now call ``set_target``; until then
    ``get_buffer`` refuses. Always the last event of the list it comes in."""

    header: FrameHeader


@dataclass(frozen=True, slots=True)
class PayloadReceived:
    """A DATA payload is complete. ``staged`` is None when it went into the owner's target; else
    the decoder staged it and ``staged`` is a writable byte view the owner now owns (count it
    back with ``release_staged(len(staged))`` once consumed). A zero-length payload needs no
    target: it comes as this event alone (no HeaderReceived), with an empty ``staged`` view."""

    header: FrameHeader
    staged: memoryview | None


@dataclass(frozen=True, slots=True)
class HelloReceived:
    header: FrameHeader
    hello: Hello


@dataclass(frozen=True, slots=True)
class AbortReceived:
    header: FrameHeader  # its group and seq name the dead op
    reason: str
    culprits: dict[int, str] = field(default_factory=dict)  # the ranks the break names (global rank -> what it did)


@dataclass(frozen=True, slots=True)
class GoodbyeReceived:
    header: FrameHeader


Event: TypeAlias = HeaderReceived | PayloadReceived | HelloReceived | AbortReceived | GoodbyeReceived


class DecoderState(enum.Enum):
    HEADER = "header"  # reading headers (and the payload bytes that come with them) into the read-ahead buffer
    NEED_TARGET = "need_target"  # a DATA header is out; the owner must call set_target()
    PAYLOAD = "payload"  # reading the rest of a payload straight into its target (or staging buffer)
    CLOSED = "closed"  # GOODBYE received; any further byte is a RemoteProtocolError
    ERROR = "error"  # the peer broke the protocol; every call raises that error again


_HEADER_ST = DecoderState.HEADER
_NEED_TARGET = DecoderState.NEED_TARGET
_PAYLOAD = DecoderState.PAYLOAD
_CLOSED = DecoderState.CLOSED
_ERROR = DecoderState.ERROR

# where the payload being read goes
_TO_TARGET, _TO_STAGED, _TO_CONTROL = 0, 1, 2


FIRST_READ_AHEAD = 256  # the transport's read-ahead until a connection's HELLO is in (then read_ahead)


class FrameDecoder:
    """Decodes one connection's incoming frames, in the shape of an ``asyncio.BufferedProtocol``.

    The owner's protocol forwards ``get_buffer(sizehint)`` and ``buffer_updated(n)`` to it and
    handles the events; ``HeaderReceived`` asks it where the payload goes::

        events = decoder.buffer_updated(n)
        while events:
            later = []
            for ev in events:
                if type(ev) is HeaderReceived:      # always the last of its list
                    later = decoder.set_target(posted_buffer_for(ev.header))   # or None: stage it
                else:
                    deliver(ev)
            events = later

    ``set_target`` returns the events decoded from bytes already read once the decoder can go on
    (several frames may have come in one read). ``feed(data)`` does the same for transports that
    hand over bytes; it keeps (not copies) the unread part of ``data`` while a target is pending.

    Buffers (the read-ahead choice). While between payloads the decoder hands the socket a
    read-ahead buffer (``read_ahead`` bytes, 64 KiB by default), not a header-sized one: one
    recv then brings in many small frames, which are decoded out of it, and their payloads
    copied once (to the target, or to a staged copy). When a header announces more payload
    than has arrived, the bytes that came with it are copied to the target and the rest of
    the payload is read straight into the target (zero-copy), one recv after another, never
    past the payload's end. So a big payload is copied for at most ``read_ahead`` bytes (what
    shared a recv with its header); a stream of tiny frames costs one recv per ``read_ahead``
    bytes rather than two per frame. Between reads at most a partial header (< 40 bytes) is
    left in the read-ahead buffer; it is moved to the front before the next read. With
    ``first_read_ahead`` (the transport passes ``FIRST_READ_AHEAD``) the read-ahead is that
    small until the HELLO is in, so a connection that never says HELLO holds next to nothing;
    it grows to ``read_ahead`` once the HELLO is decoded.
    """

    __slots__ = (
        "limits",
        "_ra",
        "_rav",
        "_pos",
        "_end",
        "_state",
        "_header",
        "_target",
        "_got",
        "_mode",
        "_handed",
        "_staged",
        "_hello",
        "_peer",
        "_require_hello",
        "_error",
        "_input",
        "_ra_size",
        "_small",
    )

    def __init__(
        self,
        limits: FrameLimits | None = None,
        *,
        read_ahead: int = 64 * 1024,
        require_hello: bool = True,
        first_read_ahead: int | None = None,
    ) -> None:
        if not isinstance(read_ahead, int) or read_ahead < HEADER_SIZE:
            raise ValueError(f"read_ahead must be an int of at least {HEADER_SIZE} (one header), got {read_ahead!r}")
        if first_read_ahead is not None and (not isinstance(first_read_ahead, int) or first_read_ahead < HEADER_SIZE):
            raise ValueError(f"first_read_ahead must be None or an int of at least {HEADER_SIZE} (one header), got {first_read_ahead!r}")
        self.limits = limits or FrameLimits()
        # With first_read_ahead, the read-ahead is that small until the peer's HELLO is in: a
        # connection that never says HELLO (a port scanner, a stuck client) costs a few hundred
        # bytes, not 64 KiB.
        self._ra_size = read_ahead
        self._small = require_hello and first_read_ahead is not None and first_read_ahead < read_ahead
        self._ra = bytearray(first_read_ahead if self._small and first_read_ahead is not None else read_ahead)
        self._rav = memoryview(self._ra)
        self._pos = 0  # ra[pos:end] holds bytes read and not yet decoded
        self._end = 0
        self._state = _HEADER_ST
        self._header: FrameHeader | None = None  # the DATA/control frame whose payload is pending
        self._target: memoryview | None = None  # where the rest of that payload goes (PAYLOAD)
        self._got = 0  # payload bytes already in _target
        self._mode = _TO_TARGET
        self._handed = 0  # size of the last buffer get_buffer handed out
        self._staged = 0  # staged bytes handed to the owner and not released
        self._hello: Hello | None = None
        self._peer: int | None = None  # the HELLO's rank: every frame's source must be it
        self._require_hello = require_hello
        self._error: RemoteProtocolError | None = None
        self._input: deque[memoryview] = deque()  # feed()'s bytes not yet taken in

    # ------------------------------------------------------------ queries

    @property
    def state(self) -> DecoderState:
        return self._state

    @property
    def hello(self) -> Hello | None:
        """The peer's HELLO, once received."""
        return self._hello

    @property
    def pending_header(self) -> FrameHeader | None:
        """The header waiting for ``set_target``, or whose payload is being read."""
        return self._header if self._state is _NEED_TARGET or self._state is _PAYLOAD else None

    @property
    def staged_bytes(self) -> int:
        """Staged payload bytes handed out and not yet ``release_staged``, plus any being read."""
        return self._staged

    # ------------------------------------------------------------ the BufferedProtocol side

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next bytes from the socket must be written (``sizehint`` is ignored)."""
        st = self._state
        if st is _PAYLOAD:
            assert self._target is not None
            buf = self._target[self._got :]
        elif st is _HEADER_ST or st is _CLOSED:
            if self._small and self._hello is not None:
                self._grow_read_ahead()
            pos = self._pos
            if pos:
                n = self._end - pos  # < HEADER_SIZE: only a partial header is ever left
                if n:
                    self._ra[:n] = self._ra[pos : self._end]
                self._pos, self._end = 0, n
            buf = self._rav[self._end :]
        elif st is _NEED_TARGET:
            raise LocalProtocolError(f"{_describe(self._header)} needs set_target() before its payload can be received")
        else:
            assert self._error is not None
            raise self._error
        self._handed = len(buf)
        return buf

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """``nbytes`` were written into the last buffer ``get_buffer`` returned: decode them."""
        if self._error is not None:
            raise self._error
        if not 0 <= nbytes <= self._handed:
            raise LocalProtocolError(f"buffer_updated({nbytes}) after get_buffer handed out {self._handed} bytes")
        self._handed = 0
        events: list[Event] = []
        if nbytes:
            try:
                self._received(nbytes, events)
            except RemoteProtocolError as exc:
                exc.events = events
                raise
        return events

    def set_target(self, target: BufferLike | None) -> list[Event]:
        """Say where the pending DATA payload goes: a writable C-contiguous buffer of exactly its
        length (a posted receive's array: the payload lands there, no copy), or None to have the
        decoder stage it (``StagingLimitError`` if that would exceed ``max_staged_bytes``).
        Returns the events decoded from bytes already read, as ``buffer_updated`` does."""
        if self._error is not None:
            raise self._error
        if self._state is not _NEED_TARGET:
            raise LocalProtocolError(f"set_target() with no DATA header waiting for one (state {self._state.value})")
        header = self._header
        assert header is not None
        length = header.length
        events: list[Event] = []
        try:
            if target is None:
                if self._staged + length > self.limits.max_staged_bytes:
                    raise self._fail(
                        StagingLimitError(
                            f"{_describe(header)}: staging its {length} bytes (no receive posted for it) would hold "
                            f"{self._staged + length} unclaimed bytes, over the limit of {self.limits.max_staged_bytes} "
                            f"(FrameLimits.max_staged_bytes)"
                        )
                    )
                self._staged += length
                self._start_payload(None, _TO_STAGED, events)
            else:
                self._start_payload(_target_view(target, header), _TO_TARGET, events)
            self._pump(events)
        except RemoteProtocolError as exc:
            exc.events = events
            raise
        return events

    def feed(self, data: BufferLike) -> list[Event]:
        """Decode ``data`` (for transports that hand over bytes, and for tests): the same state
        machine, fed through ``get_buffer``/``buffer_updated``. While a ``set_target`` is pending
        the rest of ``data`` is kept (a view, not a copy) and decoded by ``set_target``."""
        if self._error is not None:
            raise self._error
        mv = _byte_view(data)
        if not mv.nbytes:
            return []
        self._input.append(mv)
        events: list[Event] = []
        try:
            self._pump(events)
        except RemoteProtocolError as exc:
            exc.events = events
            raise
        return events

    def eof_received(self) -> None:
        """The peer closed its side. ``RemoteProtocolError`` when that cut a frame short; a close
        between frames is no protocol error (``state is CLOSED`` tells whether GOODBYE came first)."""
        if self._error is not None:
            raise self._error
        st = self._state
        if st is _NEED_TARGET:
            raise LocalProtocolError(f"eof_received() while {_describe(self._header)} waits for set_target(): set its target first")
        if st is _PAYLOAD:
            assert self._header is not None
            raise self._fail(
                RemoteProtocolError(
                    f"connection closed {self._got} of {self._header.length} bytes into the payload of {_describe(self._header)}"
                )
            )
        if st is _HEADER_ST and self._end > self._pos:
            raise self._fail(RemoteProtocolError(f"connection closed {self._end - self._pos} bytes into a {HEADER_SIZE}-byte frame header"))

    def release_staged(self, nbytes: int) -> None:
        """The owner is done with ``nbytes`` of staged payload: they no longer count against
        ``max_staged_bytes``."""
        if not 0 <= nbytes <= self._staged:
            raise LocalProtocolError(f"release_staged({nbytes}) with {self._staged} staged bytes outstanding")
        self._staged -= nbytes

    def _grow_read_ahead(self) -> None:
        """The HELLO is in: from now on, the full read-ahead (the unread bytes move along)."""
        n = self._end - self._pos
        ra = bytearray(self._ra_size)
        ra[:n] = self._ra[self._pos : self._end]
        self._ra, self._rav = ra, memoryview(ra)
        self._pos, self._end = 0, n
        self._small = False

    # ------------------------------------------------------------ the state machine

    def _received(self, nbytes: int, events: list[Event]) -> None:
        st = self._state
        if st is _PAYLOAD:
            self._got += nbytes
            header = self._header
            assert header is not None
            if self._got == header.length:
                self._finish_payload(events)
        elif st is _HEADER_ST:
            self._end += nbytes
            self._decode(events)
        else:  # CLOSED: get_buffer handed out the read-ahead buffer only to catch this
            raise self._fail(RemoteProtocolError(f"{nbytes} byte(s) after GOODBYE{_from(self._peer)}"))

    def _pump(self, events: list[Event]) -> None:
        """Take feed()'s input in, until it is used up or a target is needed."""
        inp = self._input
        while inp and self._state is not _NEED_TARGET:
            src = inp[0]
            buf = self.get_buffer()
            n = min(len(buf), len(src))
            buf[:n] = src[:n]
            if n == len(src):
                inp.popleft()
            else:
                inp[0] = src[n:]
            self._handed = 0
            self._received(n, events)

    def _decode(self, events: list[Event]) -> None:
        """Decode frames out of the read-ahead buffer until it runs out or a target is needed."""
        ra = self._ra
        pos, end = self._pos, self._end
        lim = self.limits
        while end - pos >= HEADER_SIZE:
            magic, code, flags, r1, group, seq, tag, source, digest, length = HEADER.unpack_from(ra, pos)
            kind = _KINDS[code]
            if magic != _MAGIC_BYTE or kind is None or r1:
                self._pos = pos
                raise self._fail(RemoteProtocolError(_bad_header(ra[pos : pos + HEADER_SIZE], self._peer)))
            header = FrameHeader(kind, group, seq, tag, source, length, flags, digest)
            if source != self._peer:
                self._check_source(header)
            pos += HEADER_SIZE
            if kind is _DATA:
                if length > lim.max_payload_bytes:
                    raise self._fail(
                        RemoteProtocolError(
                            f"{_describe(header)}: payload over the limit of {lim.max_payload_bytes} bytes (FrameLimits.max_payload_bytes)"
                        )
                    )
                if not length:
                    events.append(PayloadReceived(header, memoryview(bytearray())))
                    continue
                self._pos, self._end = pos, end
                self._header = header
                self._state = _NEED_TARGET
                events.append(HeaderReceived(header))
                return
            # control frames: small and bounded, so the decoder reads their payloads itself
            if kind is _HELLO_KIND:
                if self._hello is not None:
                    raise self._fail(RemoteProtocolError(f"second HELLO on the connection of rank {self._peer}"))
                if length > lim.max_hello_bytes:
                    raise self._fail(
                        RemoteProtocolError(
                            f"{_describe(header)}: over the limit of {lim.max_hello_bytes} bytes (FrameLimits.max_hello_bytes)"
                        )
                    )
            elif kind is _ABORT:
                if length > lim.max_control_bytes:
                    raise self._fail(
                        RemoteProtocolError(
                            f"{_describe(header)}: over the limit of {lim.max_control_bytes} bytes (FrameLimits.max_control_bytes)"
                        )
                    )
            elif length:
                raise self._fail(RemoteProtocolError(f"{_describe(header)}: GOODBYE carries no payload"))
            self._header = header
            if end - pos >= length:
                self._pos = pos + length
                self._control(header, self._rav[pos : pos + length], events)
                pos = self._pos
                if self._state is _CLOSED:
                    if end > pos:
                        raise self._fail(RemoteProtocolError(f"{end - pos} byte(s) after GOODBYE{_from(self._peer)}"))
                    self._pos = self._end = 0
                    return
                continue
            self._pos = pos
            self._start_payload(None, _TO_CONTROL, events)
            return
        self._pos, self._end = pos, end

    def _start_payload(self, target: memoryview | None, mode: int, events: list[Event]) -> None:
        """The pending header's payload goes to ``target`` (None: a fresh buffer): copy the bytes
        already read, then either finish it or read the rest straight into it."""
        header = self._header
        assert header is not None
        length = header.length
        pos, end = self._pos, self._end
        n = min(end - pos, length)
        if target is None:
            if n == length:  # all here: one copy, no zero-fill
                target = memoryview(bytearray(self._rav[pos : pos + n]))
            else:
                target = memoryview(bytearray(length))
                target[:n] = self._rav[pos : pos + n]
        elif n:
            target[:n] = self._rav[pos : pos + n]
        self._target, self._got, self._mode = target, n, mode
        if n == length:
            self._pos = pos + n
            self._finish_payload(events)
            if self._state is _HEADER_ST:
                self._decode(events)
        else:  # everything read so far belonged to this payload
            self._pos = self._end = 0
            self._state = _PAYLOAD

    def _finish_payload(self, events: list[Event]) -> None:
        header, target, mode = self._header, self._target, self._mode
        assert header is not None and target is not None
        self._target = None
        self._state = _HEADER_ST
        if mode == _TO_TARGET:
            events.append(PayloadReceived(header, None))
        elif mode == _TO_STAGED:
            events.append(PayloadReceived(header, target))
        else:
            self._control(header, target, events)

    def _control(self, header: FrameHeader, payload: memoryview, events: list[Event]) -> None:
        kind = header.kind
        if kind is _HELLO_KIND:
            try:
                hello = decode_hello(payload)
            except RemoteProtocolError as exc:
                raise self._fail(exc) from None
            if hello.rank != header.source:
                raise self._fail(RemoteProtocolError(f"HELLO sent as rank {header.source} says it is rank {hello.rank}"))
            self._hello, self._peer = hello, hello.rank
            events.append(HelloReceived(header, hello))
        elif kind is _ABORT:
            events.append(AbortReceived(header, *decode_abort(payload.tobytes())))
        else:
            self._state = _CLOSED
            events.append(GoodbyeReceived(header))

    def _check_source(self, header: FrameHeader) -> None:
        """Slow path for a frame whose source is not the HELLO's rank (or before any HELLO)."""
        if self._hello is not None:
            raise self._fail(RemoteProtocolError(f"{_describe(header)} on the connection of rank {self._peer}"))
        if header.kind is _HELLO_KIND:
            return
        if self._require_hello:
            raise self._fail(RemoteProtocolError(f"first frame must be HELLO, got {_describe(header)}"))

    def _fail(self, exc: RemoteProtocolError) -> RemoteProtocolError:
        self._error = exc
        self._state = _ERROR
        self._target = None
        self._input.clear()
        return exc


def _target_view(target: BufferLike, header: FrameHeader) -> memoryview:
    try:
        mv = memoryview(target)
    except TypeError:
        raise LocalProtocolError(f"set_target() takes a writable buffer or None, got {type(target).__name__}") from None
    if mv.readonly:
        raise LocalProtocolError(f"set_target() got a read-only buffer for {_describe(header)}")
    if not mv.c_contiguous:
        raise LocalProtocolError(f"set_target() got a non-contiguous buffer for {_describe(header)}")
    if mv.nbytes != header.length:
        raise LocalProtocolError(f"set_target() got a buffer of {mv.nbytes} bytes for {_describe(header)}")
    return _byte_view(mv)


def _describe(header: FrameHeader | None) -> str:
    if header is None:
        return "frame"
    h = header
    return f"{h.kind.name} frame from rank {h.source} (group {h.group}, seq {h.seq}, tag {h.tag}, {h.length} payload bytes)"


def _from(peer: int | None) -> str:
    return "" if peer is None else f" from rank {peer}"


def _bad_header(raw: bytes | bytearray, peer: int | None) -> str:
    magic, code, r1 = raw[0], raw[1], raw[3]
    who = _from(peer)
    if magic >> 4 != MAGIC >> 4:
        return f"bad frame magic 0x{magic:02X}{who} (not an aiodist transport peer?); header bytes {bytes(raw).hex()}"
    if magic & 0x0F != VERSION:
        return f"frame version {magic & 0x0F}{who}, this side speaks version {VERSION}"
    if _KINDS[code] is None:
        return f"unknown frame kind {code}{who}"
    return f"non-zero reserved header byte{who}: byte 3 = {r1}"
