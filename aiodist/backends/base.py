"""The Backend interface: what a process group needs from a communication backend.

A backend is made once per ``init_process_group`` (one per process, shared by every group of
that World) and is a *channel factory*: ``channel(group_id, seq, global_ranks)`` hands out a
fresh ``aiodist.algorithms.P2P`` bound to one op. Groups multiplex over it by group id, so a
sub-group opens no connections of its own.

Naming of channels (the contract a backend keeps, and what the c10d layer guarantees):

- ``group_id`` is a u32 agreed by every member of the group (0 is the default group).
- Collectives: ``seq`` is the group's op counter (0, 1, 2, ... below ``2**63``) and
  ``global_ranks`` is the group's member list in group-rank order; the P2P's ranks are
  indices into it. Every member opens each ``(group_id, seq)`` exactly once.
- Point-to-point: ``seq`` has bit 63 set (see ``aiodist.c10d.p2p.p2p_seq``) and
  ``global_ranks`` is ``[sender, receiver]``: one channel carries exactly one message, tag 0,
  from index 0 to index 1. The same ``(group_id, seq)`` may be opened for different pairs
  of ranks (a message is named by group id, seq, tag *and* its two ends).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiodist.algorithms.p2p import P2P
from aiodist.store.base import Store

__all__ = ["CommBackend", "BackendOptions"]


class CommBackend(abc.ABC):
    """One process's end of a backend: a factory of per-op channels."""

    #: the backend's registered name ("memory", "aio", ...)
    name: str = ""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int]) -> P2P:
        """A fresh P2P for one op (see the module docstring for the naming rules). Must not
        suspend: the caller opens it in the op's first step."""

    async def abort_group(self, group_id: int, reason: str) -> None:  # noqa: B027 - optional
        """Tell the peers that ``group_id`` is broken, so their pending ops on it fail now rather
        than at their timeouts. Called once, when an op of the group fails on this rank."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release what the backend holds. Idempotent."""

    def stats(self) -> dict[str, Any]:
        return {"backend": self.name, "rank": self.rank, "world_size": self.world_size}


@dataclass(frozen=True)
class BackendOptions:
    """What an ``extended_api=True`` backend creator receives (torch's ``DistributedBackendOptions``)."""

    store: Store
    group_rank: int
    group_size: int
    timeout: timedelta
    group_id: str
    global_ranks_in_group: Sequence[int]
