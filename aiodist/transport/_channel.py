"""``Channel``: the ``P2P`` (aiodist.algorithms.p2p) of one op of one group over a transport
(``ChannelOwner``: the ``Transport``, typed by a Protocol so this module imports nothing above
it), and the ``OpLink`` (aiodist.shm._link) that shared memory asks of the op: its identity and
digest, the transport's word on a peer (``check_peer``), and the group's abort and desync, by
public methods of the transport. Its sends and receives go straight to the transport's
``lines`` and ``inbox`` (one call per message, none through the façade). A bare channel has no
tracker: it counts no wait (the runner's ``TrackedP2P``, wrapped around it, does)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from aiodist._message import CHANNEL_TAG_LIMIT, LINE_STEP, TAG_LIMIT
from aiodist.errors import DistBackendError
from aiodist.transport._inbox import Inbox
from aiodist.transport._lines import Lines
from aiodist.transport._mailbox import Key

__all__ = ["Channel", "ChannelOwner"]


class ChannelOwner(Protocol):
    """What a channel asks of its transport (``Transport`` keeps it: mypy checks that where the
    transport makes its channels): its send lines and inbox, a group's rank check, and its word
    on a peer, an op's name, abort and desync."""

    @property
    def lines(self) -> Lines: ...
    @property
    def inbox(self) -> Inbox: ...
    def member(self, ranks: tuple[int, ...]) -> int: ...
    def check_peer(self, peer: int | None, group: int, seq: int = 0) -> None: ...
    def abort_op(self, key: Key, reason: str) -> DistBackendError: ...
    def desync_op(self, key: Key, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None: ...
    def op_name(self, key: Key) -> str | None: ...


class Channel:
    """The ``P2P`` (aiodist.algorithms.p2p) of one op of one group over a ``Transport``:
    group ranks in, global ranks and the key ``(group_id, seq, tag)`` on the wire."""

    __slots__ = ("transport", "group_id", "seq", "ranks", "_rank", "digest")

    def __init__(self, transport: ChannelOwner, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0) -> None:
        ranks = global_ranks if type(global_ranks) is tuple else tuple(global_ranks)
        self.transport = transport
        self.group_id = group_id
        self.seq = seq
        self.ranks = ranks
        self._rank = transport.member(ranks)  # (the group's ranks are checked once, not per op)
        self.digest = digest  # the op's digest, sent with every frame (aiodist._digest)

    def __repr__(self) -> str:
        return f"Channel(group={self.group_id}, seq={self.seq}, rank={self._rank}, size={len(self.ranks)})"

    @property
    def line_seq(self) -> int:
        """The op's number in its group's shared-memory line: its seq times ``LINE_STEP``
        (aiodist.shm._link)."""
        return self.seq * LINE_STEP

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _global(self, peer: int, tag: int) -> int:
        if not isinstance(peer, int) or not 0 <= peer < len(self.ranks):
            raise ValueError(f"group rank {self._rank}: peer {peer!r} is not a rank of a group of {len(self.ranks)}")
        if not isinstance(tag, int) or not 0 <= tag < CHANNEL_TAG_LIMIT:
            raise ValueError(f"tag {tag!r} is outside [0, 2**36)")
        return self.ranks[peer]

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self.transport.lines.send(self._global(peer, tag), buf, group=self.group_id, seq=self.seq, tag=tag, digest=self.digest)

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool | asyncio.Future[None]:
        """Send now where it can be done without waiting (see ``Transport.send_nowait``): False
        (nothing sent), True (sent), or a future to await before changing ``buf``."""
        return self.transport.lines.send_nowait(
            self._global(peer, tag), buf, group=self.group_id, seq=self.seq, tag=tag, digest=self.digest
        )

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self.transport.inbox.recv(self._global(peer, tag), buf, group=self.group_id, seq=self.seq, tag=tag)

    # -- the OpLink side (aiodist.shm._link) --------------------------------------------------

    @property
    def op_name(self) -> str | None:
        return self.transport.op_name((self.group_id, self.seq, 0))

    def check_peer(self, peer: int) -> None:
        self.transport.check_peer(self.ranks[peer], self.group_id, self.seq)

    def abort_group(self, reason: str) -> DistBackendError:
        return self.transport.abort_op((self.group_id, self.seq, 0), reason)

    def desync(self, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        return self.transport.desync_op((self.group_id, self.seq, 0), self.ranks[peer], theirs, nbytes)

    def wait_on(self, peers: Iterable[int]) -> None:
        """No tracker, nothing counted (see the module docstring)."""

    def waited_on(self, peers: Iterable[int], heard: bool) -> None:
        """No tracker, nothing counted."""

    async def recv_any(self, buf: np.ndarray, tag: int) -> int:
        """Receive from any rank of the group; returns the sender's group rank."""
        if not isinstance(tag, int) or not 0 <= tag < TAG_LIMIT:
            raise ValueError(f"tag {tag!r} is outside [0, 2**31)")
        src = await self.transport.inbox.recv(None, buf, group=self.group_id, seq=self.seq, tag=tag)
        try:
            return self.ranks.index(src)
        except ValueError:
            raise DistBackendError(f"any-source receive of group {self.group_id} got a message from rank {src}, not in the group") from None
