"""``Mailbox``: matching of incoming messages to posted receives, the table of receives waiting
for a message and of messages that came before their receive (staged). Public (exported by
``aiodist.transport``): the socket transport and the in-memory backend share it, so both match
alike.

Rules this module keeps:
- A message is named by ``(group, seq, tag)`` and its source rank. A receive names the same
  key and either one source or any source (``src=None``).
- Per key, matching is first-come first-served in both directions: a message goes to the
  earliest-posted receive that accepts its source; a receive takes the earliest-staged message
  from a source it accepts. With one ordered byte stream per (sender, receiver), two messages
  with the same key and source are therefore received in the order they were sent.
- ``find`` only looks (the landing decision, ``aiodist.transport._landing``, is a pure function
  of the mailbox); ``claim`` or ``match`` take the receive out.
- Nothing here waits or does I/O: the owner completes and fails the futures.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Key", "PostedRecv", "StagedMessage", "Mailbox", "describe_key", "size_error"]

Key = tuple[int, int, int]  # (group, seq, tag)


_PART_SHIFT = 40  # a striped message's part j travels under tag + (j + 1) << 40 (aiodist.transport)


def describe_key(key: Key) -> str:
    tag = key[2]
    if tag >> _PART_SHIFT:
        return f"group {key[0]}, seq {key[1]}, tag {tag & ((1 << _PART_SHIFT) - 1)}, striped part {(tag >> _PART_SHIFT) - 1}"
    return f"group {key[0]}, seq {key[1]}, tag {tag}"


def size_error(rank: int, src: int, key: Key, nbytes: int, buffer: int) -> ValueError:
    """A message whose size is not its receive buffer's: the receive fails with this."""
    return ValueError(f"rank {rank}: message from rank {src} ({describe_key(key)}) is {nbytes} bytes, the receive buffer {buffer}")


@dataclass(eq=False, slots=True)
class PostedRecv:
    """A receive waiting for its message. ``fut`` resolves to the source rank."""

    key: Key
    src: int | None
    dst: np.ndarray  # flat uint8 view of the user's buffer
    fut: asyncio.Future[int]

    def accepts(self, src: int) -> bool:
        return self.src is None or self.src == src

    def what(self) -> str:
        frm = "any source" if self.src is None else f"rank {self.src}"
        return f"receive from {frm} ({describe_key(self.key)}, {self.dst.nbytes} bytes)"

    def fill(self, data: memoryview | np.ndarray, src: int, rank: int) -> None:
        """Complete this receive with message ``data`` from ``src`` (a copy into its buffer), or
        fail it with ``size_error`` (naming ``rank``, the receiver) when the sizes differ."""
        nbytes = data.nbytes
        if self.dst.nbytes != nbytes:
            if not self.fut.done():
                self.fut.set_exception(size_error(rank, src, self.key, nbytes, self.dst.nbytes))
            return
        if nbytes:
            self.dst[:] = np.frombuffer(data, np.uint8)
        if not self.fut.done():
            self.fut.set_result(src)


@dataclass(eq=False, slots=True)
class StagedMessage:
    """A message received before its receive was posted. ``release`` gives its bytes back to
    the staging budget they were counted against."""

    src: int
    data: memoryview
    release: Callable[[int], None] = field(default=lambda n: None)

    def consume(self, dst: np.ndarray, key: Key, rank: int) -> int:
        """Copy this message into receive buffer ``dst`` (flat uint8) and release its bytes;
        returns its source. ``size_error`` (naming ``rank``, the receiver) when the sizes differ."""
        try:
            if self.data.nbytes != dst.nbytes:
                raise size_error(rank, self.src, key, self.data.nbytes, dst.nbytes)
            if dst.nbytes:
                dst[:] = np.frombuffer(self.data, np.uint8)
            return self.src
        finally:
            self.release(self.data.nbytes)


class Mailbox:
    """Posted receives and staged messages of one rank (one transport, or one rank of the
    in-memory backend). ``post``/``unpost``/``take_staged`` serve receives; ``find`` then
    ``claim`` (or ``match``, both at once) and ``stage`` serve arriving messages."""

    def __init__(self) -> None:
        self._posted: dict[Key, list[PostedRecv]] = {}
        self._staged: dict[Key, deque[StagedMessage]] = {}
        self.staged_bytes = 0

    # -- receives --------------------------------------------------------------------------

    def take_staged(self, key: Key, src: int | None) -> StagedMessage | None:
        """The earliest staged message for ``key`` from ``src`` (any when None), removed."""
        q = self._staged.get(key)
        if not q:
            return None
        for i, m in enumerate(q):
            if src is None or m.src == src:
                del q[i]
                if not q:
                    del self._staged[key]
                self.staged_bytes -= m.data.nbytes
                return m
        return None

    def post(self, recv: PostedRecv) -> None:
        self._posted.setdefault(recv.key, []).append(recv)

    def unpost(self, recv: PostedRecv) -> bool:
        """Withdraw a receive (timed out or cancelled); False when it was already matched."""
        lst = self._posted.get(recv.key)
        if lst is None or recv not in lst:
            return False
        lst.remove(recv)
        if not lst:
            del self._posted[recv.key]
        return True

    # -- messages --------------------------------------------------------------------------

    def find(self, key: Key, src: int) -> PostedRecv | None:
        """The earliest posted receive, not yet done, that takes a message ``key`` from ``src``;
        nothing is removed (``claim`` it)."""
        lst = self._posted.get(key)
        if lst:
            for r in lst:
                if not r.fut.done() and (r.src is None or r.src == src):
                    return r
        return None

    def claim(self, recv: PostedRecv) -> None:
        """Take ``recv`` (which ``find`` returned) out: it gets this message."""
        lst = self._posted[recv.key]
        if len(lst) == 1:
            del self._posted[recv.key]
        else:
            lst.remove(recv)

    def match(self, key: Key, src: int) -> PostedRecv | None:
        """The earliest posted receive that takes a message ``key`` from ``src``, removed."""
        lst = self._posted.get(key)
        if not lst:
            return None
        i = 0
        while i < len(lst):
            r = lst[i]
            if r.fut.done():  # cancelled or failed, not yet withdrawn: never give it a message
                del lst[i]
                continue
            if r.accepts(src):
                del lst[i]
                if not lst:
                    del self._posted[key]
                return r
            i += 1
        if not lst:
            del self._posted[key]
        return None

    def stage(self, key: Key, msg: StagedMessage) -> None:
        self._staged.setdefault(key, deque()).append(msg)
        self.staged_bytes += msg.data.nbytes

    # -- failure ---------------------------------------------------------------------------

    def posted(self) -> Iterator[PostedRecv]:
        for lst in self._posted.values():
            yield from lst

    def remove_posted(self, pred: Callable[[PostedRecv], bool]) -> list[PostedRecv]:
        """Remove and return every posted receive ``pred`` selects."""
        out: list[PostedRecv] = []
        for key in list(self._posted):
            keep: list[PostedRecv] = []
            for r in self._posted[key]:
                (out if pred(r) else keep).append(r)
            if keep:
                self._posted[key] = keep
            else:
                del self._posted[key]
        return out

    def drop_staged(self, pred: Callable[[Key, StagedMessage], bool]) -> int:
        """Drop (and release) the staged messages ``pred`` selects; returns how many."""
        n = 0
        for key in list(self._staged):
            q = self._staged[key]
            keep: deque[StagedMessage] = deque()
            for m in q:
                if pred(key, m):
                    n += 1
                    self.staged_bytes -= m.data.nbytes
                    m.release(m.data.nbytes)
                else:
                    keep.append(m)
            if keep:
                self._staged[key] = keep
            else:
                del self._staged[key]
        return n

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._posted.values())

    @property
    def staged_messages(self) -> int:
        return sum(len(v) for v in self._staged.values())
