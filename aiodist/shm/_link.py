"""``OpLink``: what shared memory may ask of the op it runs for, beyond sending and receiving.

Shared memory runs an op's bytes outside the transport, yet its failures must read as the
transport's: a dead peer, an aborted group and a desync raise the transport's errors and break
the group on every rank, and a wait on a peer is named by the op's timeout as a receive's is.
``OpLink`` is that seam, and the only one: the op's P2P (``aiodist.algorithms.p2p``), its group
id, seq, ranks, digest and op name, and five calls (``check_peer``, ``abort_group``,
``desync``, ``wait_on``, ``waited_on``). The shm modules reach the transport and the op's
tracker through nothing else (tests/test_shm_link.py checks both sides, and that no shm module
reads another package's private members or walks objects with ``getattr``).

Who implements it:
- the transport's ``Channel`` (aiodist.transport._channel): the op's identity and the
  transport's calls; a bare channel has no tracker, so it counts no wait;
- the runner's ``TrackedP2P`` (aiodist.c10d._runner), the P2P an op's body gets: it counts the
  waits with its receives' (its timeout message reads them) and hands the rest to its channel;
- ``HostLink`` (below): an op's link seen by the ranks of one host, for the in-host phases of a
  hierarchical op; every call goes to the op's own link, its peers mapped.

``op_link`` turns the ``P2P`` that a collective hands to shared memory into its ``OpLink``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeGuard, runtime_checkable

from aiodist._message import LINE_STEP
from aiodist.algorithms.hier import Subset
from aiodist.algorithms.p2p import CHANNEL_TAG_LIMIT, P2P, TAG_LIMIT, SubP2P
from aiodist.errors import DistBackendError

__all__ = ["OpLink", "op_link", "HostLink"]


@runtime_checkable
class OpLink(P2P, Protocol):
    """The ``P2P`` of one op of one group, and what shared memory may ask of that op. Peers are
    group ranks, as for the P2P; ``ranks`` maps them to global ranks for messages."""

    #: the op's digest (aiodist._digest), sent with its frames and written in the latency lane;
    #: 0: the op has none. Shared memory's agreement clears it while its vote runs.
    digest: int

    @property
    def group_id(self) -> int: ...

    @property
    def seq(self) -> int: ...

    @property
    def line_seq(self) -> int:
        """The op's number in its group's shared-memory line, which the lane's flags and the
        ``current`` words carry (they only grow along the line): its ``seq`` times
        ``LINE_STEP`` (the numbers between are its own lane ops': a pair's pieces); a
        hierarchical op's in-host phase (``HostLink``) has one of its own for each phase."""
        ...

    @property
    def ranks(self) -> Sequence[int]:
        """The global rank of each group rank."""
        ...

    @property
    def op_name(self) -> str | None:
        """The op's name as the desync sentence gives it (``"all_reduce"``); None where this rank
        kept no digest for the op."""
        ...

    def check_peer(self, peer: int) -> None:
        """Raise the transport's error where group rank ``peer`` died or left, or the op's group
        was aborted (a peer's ABORT, a desync): what a receive from that peer would raise."""
        ...

    def abort_group(self, reason: str) -> DistBackendError:
        """Abort the op's group on every rank for ``reason`` (the caller logs it) and return the
        error the op raises (the group's first abort's, where it was aborted already)."""
        ...

    def desync(self, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        """Group rank ``peer``'s digest for the op is ``theirs``, not this rank's: break the group
        on every rank with aiodist._digest's sentence (``nbytes``: the size the peer passed, -1
        where unknown) and return the error the op raises; None where this rank kept no digest
        for the op (then nothing is aborted)."""
        ...

    def wait_on(self, peers: Iterable[int]) -> None:
        """A wait on each group rank of ``peers`` starts outside the op's receives (a lane flag, a
        segment fetch): counted where the op is tracked, so its timeout names whom it waited on.
        A wait that a timeout or a cancellation ends stays counted (the timeout message reads
        what was pending when it fired)."""
        ...

    def waited_on(self, peers: Iterable[int], heard: bool) -> None:
        """The waits ``wait_on(peers)`` counted are over; ``heard``: each peer was heard from now
        (the timeout's explanation says when a rank last sent anything)."""
        ...


_PHASES = CHANNEL_TAG_LIMIT // TAG_LIMIT  # sub-op blocks of an op: a HostLink's line_seq steps
_LINKS: dict[type, bool] = {}  # the structural check costs microseconds: it is made once per class


def _is_link(p2p: P2P) -> TypeGuard[OpLink]:
    kind = type(p2p)
    ok = _LINKS.get(kind)
    if ok is None:
        ok = _LINKS[kind] = isinstance(p2p, OpLink)
    return ok


def op_link(p2p: P2P) -> OpLink:
    """``p2p`` as the ``OpLink`` it is: the runner's ``TrackedP2P`` or a transport ``Channel``.
    A TypeError for a P2P that is none (shared memory runs only over the transport)."""
    if _is_link(p2p):
        return p2p
    raise TypeError(f"shared memory runs an op over its OpLink (aiodist.shm._link); {type(p2p).__name__} is not one")


class HostLink(SubP2P):
    """An op's ``OpLink`` seen by some of its ranks (``members``, group ranks of the op): the ranks
    of one host in a hierarchical op over hosts (``aiodist.algorithms.hier``), whose in-host phases
    run through the host's own shared memory. Group rank ``i`` here is ``members[i]`` there.

    Tags below ``TAG_LIMIT`` move to sub-op block ``index`` of the op (as ``SubP2P``'s), so two
    phases of one op never meet; higher tags (a ``SubP2P`` of this link: shared memory's agreement)
    go as they are. The op's identity (group id, seq, digest, name) is the op's own: errors name
    the group the user called, and the peers' digests are the op's."""

    __slots__ = ("_link", "_members", "_index", "ranks")

    def __init__(self, link: OpLink, members: Sequence[int], index: int) -> None:
        # rank, size, send, receive: SubP2P's over the op's ranks ``members`` (hier.Subset)
        super().__init__(Subset(link, members), index)
        self._link = link
        self._members = tuple(members)
        self._index = index
        whole = link.ranks
        self.ranks = tuple(whole[m] for m in self._members)

    def _tag(self, tag: int) -> int:
        return self._base + tag if 0 <= tag < TAG_LIMIT else tag

    @property
    def digest(self) -> int:
        return self._link.digest

    @digest.setter
    def digest(self, value: int) -> None:
        self._link.digest = value

    @property
    def group_id(self) -> int:
        return self._link.group_id

    @property
    def seq(self) -> int:
        return self._link.seq

    @property
    def line_seq(self) -> int:
        """``(line_seq * 32 + index) * LINE_STEP``: every in-host phase of the op (several run in
        one host's line, in the order of their tag blocks) has flags of its own, above the last
        op's, with room for its own pieces."""
        return (self._link.line_seq * _PHASES + self._index) * LINE_STEP

    @property
    def op_name(self) -> str | None:
        return self._link.op_name

    def check_peer(self, peer: int) -> None:
        self._link.check_peer(self._members[peer])

    def abort_group(self, reason: str) -> DistBackendError:
        return self._link.abort_group(reason)

    def desync(self, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        return self._link.desync(self._members[peer], theirs, nbytes)

    def wait_on(self, peers: Iterable[int]) -> None:
        self._link.wait_on([self._members[p] for p in peers])

    def waited_on(self, peers: Iterable[int], heard: bool) -> None:
        self._link.waited_on([self._members[p] for p in peers], heard)
