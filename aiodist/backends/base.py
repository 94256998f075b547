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
- Point-to-point does not use channels: ``p2p_send(group_id, dst, buf, tag)`` and
  ``p2p_recv(group_id, src, buf, tag)`` (``src=None``: any source) move one message between
  global ranks, a rank may send to itself, and matching is MPI's non-overtaking rule: per
  (group, tag, sender, receiver), messages are received in the order they were sent, a
  message going to the earliest-posted receive that accepts its source. The c10d layer
  issues sends and receives in the op's first step, so "call order" is issue order.
  A backend that only provides channels gets p2p over a channel named ``P2P_SEQ`` (no any-source
  receive, no send to self).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aiodist._message import P2P_SEQ  # the channel seq of every point-to-point message (it lives below the transport)
from aiodist.algorithms.p2p import P2P
from aiodist.errors import DistBackendError
from aiodist.store.base import Store

if TYPE_CHECKING:
    from aiodist.algorithms.thresholds import Thresholds

__all__ = ["CommBackend", "BackendOptions", "P2P_SEQ", "ProcessGroupLike"]


class ProcessGroupLike(Protocol):
    """What a backend may use of a group it serves: the seam from the backends (the routes, the
    device backends, ``aiodist_cuda``) up to c10d's ``ProcessGroup``, which implements it (mypy
    checks that, in ``aiodist.c10d.process_group``). A backend that needs more of the group adds
    it here, so the contract stays written down."""

    @property
    def group_id(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, in group-rank order."""

    @property
    def timeout_s(self) -> float: ...
    @property
    def thresholds(self) -> Thresholds:
        """The group's size rules (the same on every rank)."""

    @property
    def host_refusal(self) -> str | None:
        """Why CPU arrays are refused (a World with no CPU backend), else None."""

    @property
    def store(self) -> Store | None: ...
    @property
    def backend(self) -> CommBackend: ...
    @property
    def devices(self) -> dict[str, Any]:
        """Device type -> the World's device backend for it (shared by every group)."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def describe(self) -> str:
        """How errors name the group: ``"group 3 (id 3, ranks [0, 1])"``."""

    def check_usable(self) -> None:
        """Raise the group's error if it is broken or destroyed."""

    def issue_device(
        self, op: str, body: Any, make_work: Any, *, meta: dict[str, Any] | None = None, waiting: Any = None, p2p: bool = False
    ) -> Any:
        """Start a device backend's op under the group's numbering, timeout and failure rules."""


class CommBackend(abc.ABC):
    """One process's end of a backend: a factory of per-op channels."""

    #: the backend's registered name ("memory", "aio", ...)
    name: str = ""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    #: whether ``channel`` takes a ``digest`` and fails an op whose peers' frames carry another
    #: one (always-on desync detection, aiodist._digest); the socket backend does
    carries_digests = False

    @abc.abstractmethod
    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0, call: Any = None) -> P2P:
        """A fresh P2P for one op (see the module docstring for the naming rules). Must not
        suspend: the caller opens it in the op's first step. ``digest``/``call``: see
        ``carries_digests`` (a backend that does not carry them ignores them)."""

    async def p2p_send(self, group_id: int, dst: int, buf: np.ndarray, tag: int) -> None:
        """Send ``buf`` to global rank ``dst`` (see the module docstring for matching)."""
        if dst == self.rank:
            raise DistBackendError(f"backend {self.name!r} cannot send to oneself")
        ranks = sorted((self.rank, dst))
        await self.channel(group_id, P2P_SEQ, ranks).send(ranks.index(dst), buf, tag)

    async def p2p_recv(self, group_id: int, src: int | None, buf: np.ndarray, tag: int) -> int:
        """Receive into ``buf`` from global rank ``src`` (None: any); returns the sender."""
        if src is None:
            raise DistBackendError(f"backend {self.name!r} cannot receive from any source")
        if src == self.rank:
            raise DistBackendError(f"backend {self.name!r} cannot receive from oneself")
        ranks = sorted((self.rank, src))
        await self.channel(group_id, P2P_SEQ, ranks).recv(ranks.index(src), buf, tag)
        return src

    def layout(self, ranks: Sequence[int]) -> Any:
        """The ranks (global) by host, as ``aiodist.algorithms.hier.layout_of`` gives it (group
        ranks per host), where they are spread over hosts with more than one on some; else None.
        A backend that does not know its ranks' hosts (one process, one host) says None."""
        return None

    async def connect(self) -> None:  # noqa: B027 - optional
        """Make the connections to every peer now (``init_process_group(device_id=...)``'s eager
        mode); backends without connections do nothing."""

    async def abort_group(  # noqa: B027 - optional
        self, group_id: int, reason: str, ranks: Sequence[int] = (), culprits: dict[int, str] | None = None
    ) -> None:
        """Tell the peers that ``group_id`` is broken, so their pending ops on it fail now rather
        than at their timeouts. Called once, when an op of the group fails on this rank.
        ``ranks``: the group's global ranks, every one of which should hear of it; ``culprits``:
        the ranks the failure names (global rank -> what it did), which the peers' errors then
        name too (every survivor agrees on whom to exclude)."""

    async def release_group(self, group_id: int) -> None:  # noqa: B027 - optional
        """``group_id`` is destroyed on this rank (its ops have all ended): release what the
        backend holds for it."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release what the backend holds. Idempotent."""

    def connection_report(self, peers: Sequence[int]) -> str:
        """For a timeout message: what is known of the connections to ``peers`` that were never
        made (``"; no connection to rank 1 at ADDR was ever made (...)"``); empty by default."""
        return ""

    def address_info(self) -> dict[str, Any] | None:
        """Where this rank's peers reach it (the socket backend: docs/multi_host.md); None for
        backends without addresses."""
        return None

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
