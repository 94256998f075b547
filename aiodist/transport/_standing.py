"""What this rank knows of its peers and groups: which peers are lost (died or left) and which
groups are broken (aborted), with why, and the error an op of them raises. Sans-I/O: the
transport records what its connections and ABORT frames tell (``lose``, ``break_group``,
``blame``) and asks before it sends or posts a receive (``check``).
"""

from __future__ import annotations

from aiodist.errors import DistBackendError, DistNetworkError

__all__ = ["Standing"]


class Standing:
    """Lost peers (global rank -> the error that lost it), broken groups (id -> why) and the
    ranks a group's break names (id -> rank -> what it did: errors' ``culprits``)."""

    __slots__ = ("dead", "aborted", "blamed")

    def __init__(self) -> None:
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
