"""What this rank knows of its peers and groups: whether its transport is closed, which peers
are lost (died or left) and which groups are broken (aborted), with why, and the error an op of
them raises. Sans-I/O: the transport records what its connections and ABORT frames tell
(``lose``, ``break_group``, ``blame``, ``closed``) and asks before it sends or posts a receive
(``usable``); ``Transport.check_peer`` answers the runner and shared memory from it.

Rules this module keeps:
- The first word stays: a peer is lost once (the first error is its sentence), a group breaks
  once (the first reason), and the first naming of a break's culprits stays.
- An op meets, in this order: a closed transport, a broken group, a lost peer (``usable``;
  ``check`` without the first).
"""

from __future__ import annotations

from aiodist.errors import DistBackendError, DistNetworkError
from aiodist.transport._mailbox import Key, describe_key

__all__ = ["Standing"]


class Standing:
    """Lost peers (global rank -> the error that lost it), broken groups (id -> why), the ranks
    a group's break names (id -> rank -> what it did: errors' ``culprits``), and whether the
    transport of rank ``rank`` is closed."""

    __slots__ = ("rank", "closed", "dead", "aborted", "blamed")

    def __init__(self, rank: int = -1) -> None:
        self.rank = rank  # for the closed transport's sentence
        self.closed = False
        self.dead: dict[int, DistNetworkError] = {}
        self.aborted: dict[int, str] = {}
        self.blamed: dict[int, dict[int, str]] = {}

    def lose(self, peer: int, err: DistNetworkError) -> bool:
        """``peer`` is lost (the first error stays); True the first time."""
        first = peer not in self.dead
        self.dead.setdefault(peer, err)
        return first

    def break_group(self, group: int, why: str) -> bool:
        """Group ``group`` is broken (the first reason stays); True the first time."""
        first = group not in self.aborted
        self.aborted.setdefault(group, why)
        return first

    def blame(self, group: int, culprits: dict[int, str]) -> None:
        """The ranks group ``group``'s break names (the first naming stays)."""
        self.blamed.setdefault(group, culprits)

    def abort_error(self, group: int) -> DistBackendError:
        """The error an op of broken group ``group`` raises: the group's reason alone (the op that
        reads it names itself: c10d's op, group, seq)."""
        return DistBackendError(self.aborted[group], culprits=self.blamed.get(group))

    def dead_error(self, peer: int) -> DistNetworkError:
        """The error an op with lost peer ``peer`` raises: the peer's sentence."""
        lost = self.dead[peer]
        return DistNetworkError(str(lost), culprits=lost.culprits)

    def check(self, group: int, peer: int | None) -> None:
        """Raise what an op of ``group`` with ``peer`` (None: no peer) meets: a broken group
        first, then a lost peer."""
        if group in self.aborted:
            raise self.abort_error(group)
        if peer is not None and peer in self.dead:
            raise self.dead_error(peer)

    def usable(self, key: Key, peer: int | None) -> None:
        """Raise what a message ``key`` (group, seq, tag) with ``peer`` (None: no peer) meets: a
        closed transport (``DistBackendError``), then ``check``'s."""
        if self.closed:
            raise DistBackendError(f"rank {self.rank}: the transport is closed ({describe_key(key)})")
        if key[0] in self.aborted:
            raise self.abort_error(key[0])
        if peer is not None and peer in self.dead:
            raise self.dead_error(peer)
