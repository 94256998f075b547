"""send, recv, isend, irecv, P2POp, batch_isend_irecv.

Matching is MPI's non-overtaking rule, as torch's backends do it: per (group, tag, sender,
receiver), messages are received in the order they were sent; a message goes to the
earliest-issued receive on its receiver that accepts its source (a receive from ``src=None``
accepts any rank of the group). Every call issues its send or receive in its first step, so
"order" means issue order on each rank. The backend moves the bytes
(``CommBackend.p2p_send`` / ``p2p_recv``, named by group id and tag); the ProcessGroup bounds
each op by the group's timeout.

A rank may send to itself with ``isend`` and receive it with ``irecv`` (or ``recv``); a blocking
``send`` to oneself is refused, as in torch. Tags are ints in [0, 2**31).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiodist.c10d._args import buf, group_root
from aiodist.c10d._device import device_backend
from aiodist.c10d._runner import PeerOps
from aiodist.c10d.init import GroupArg, not_member, resolve_group
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.work import Work
from aiodist.c10d.world import on_world_loop

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "P2P_TAG_LIMIT", "PeerOps"]

P2P_TAG_LIMIT = 1 << 31


def _tag(tag: object, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{op}: tag must be an int, not {type(tag).__name__}")
    if not 0 <= tag < P2P_TAG_LIMIT:
        raise ValueError(f"{op}: tag {tag} is outside [0, 2**31)")
    return tag


class _Checked:
    """One validated p2p op, ready to issue (validation of a whole batch comes before any issue).
    ``dev`` is set for arrays in device memory: the op goes to that device backend instead."""

    __slots__ = ("op", "pg", "tensor", "flat", "peer", "tag", "sending", "dev")

    def __init__(
        self, op: str, pg: ProcessGroup, tensor: Any, flat: Any, peer: int | None, tag: int, sending: bool, dev: Any = None
    ) -> None:
        self.op, self.pg, self.tensor, self.flat, self.peer, self.tag, self.sending = op, pg, tensor, flat, peer, tag, sending
        self.dev = dev

    def device_args(self) -> dict[str, Any]:
        pg, peer = self.pg, self.peer
        return {
            "tensor": self.tensor,
            "peer": None if peer is None else pg.ranks.index(peer),  # the group rank
            "tag": self.tag,
            "sending": self.sending,
            "op": self.op,
        }

    async def start(self) -> Work:
        if self.dev is None:
            return self.issue()
        works: list[Work] = await self.dev.issue(self.pg, "p2p", {"ops": [self.device_args()]})
        return works[0]

    def issue(self) -> Work:
        pg, flat, tag, peer = self.pg, self.flat, self.tag, self.peer
        work_ref: list[Work] = []
        if self.sending:
            assert peer is not None

            async def body(ops: PeerOps) -> None:
                await ops.send(peer, flat, tag)

        else:

            async def body(ops: PeerOps) -> None:
                work_ref[0]._source_rank = await ops.recv(peer, flat, tag)

        ranks = pg.ranks if peer is None else (peer,)
        work = pg.issue_p2p(self.op, ranks, tag, body, [self.tensor], receive=not self.sending)
        work_ref.append(work)
        return work


def _check(
    op: str, tensor: Any, peer_global: int | None, group: GroupArg, tag: object, peer_group: int | None, sending: bool, *, blocking: bool
) -> _Checked:
    pg = resolve_group(group, what=op)
    name = "dst" if sending else "src"
    if not sending and peer_global is None and peer_group is None:
        peer: int | None = None  # any source
    else:
        g = group_root(pg, op, name, peer_global, peer_group)
        peer = pg.ranks[g]
        if sending and blocking and peer == pg.ranks[pg.rank()]:
            raise ValueError(
                "Invalid destination rank: destination rank should not be the same as the rank of the current process. "
                f"({op} to rank {peer}, this rank: a blocking send to oneself would never return; use isend and irecv)"
            )
    t = _tag(tag, op)
    dev = device_backend(pg, tensor, f"{op} tensor")
    if dev is not None:  # the device backend checks the array itself
        pg.check_usable()
        return _Checked(op, pg, tensor, None, peer, t, sending, dev)
    b = buf(tensor, f"{op} tensor", writable=not sending)
    pg.check_usable()
    return _Checked(op, pg, tensor, b.flat, peer, t, sending)


@on_world_loop
async def send(tensor: Any, dst: int | None = None, group: GroupArg = None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst`` (global rank) or ``group_dst``; returns once the bytes are
    handed to the transport (the tensor may then change)."""
    if not_member(group, "send"):
        return
    await (await _check("send", tensor, dst, group, tag, group_dst, True, blocking=True).start())


@on_world_loop
async def recv(tensor: Any, src: int | None = None, group: GroupArg = None, tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (global rank), ``group_src``, or any rank of the group
    (both None); returns the sender's global rank (-1 on a rank outside ``group``, as torch)."""
    if not_member(group, "recv"):
        return -1
    work = await _check("recv", tensor, src, group, tag, group_src, False, blocking=True).start()
    await work
    return work.source_rank()


@on_world_loop
async def isend(tensor: Any, dst: int | None = None, group: GroupArg = None, tag: int = 0, group_dst: int | None = None) -> Work | None:
    """Issue a send and return its Work (``tensor`` must not change until it completes); None on
    a rank outside ``group``, as torch."""
    if not_member(group, "isend"):
        return None
    return await _check("isend", tensor, dst, group, tag, group_dst, True, blocking=False).start()


@on_world_loop
async def irecv(tensor: Any, src: int | None = None, group: GroupArg = None, tag: int = 0, group_src: int | None = None) -> Work | None:
    """Issue a receive and return its Work; ``work.source_rank()`` is the sender once it completes.
    None on a rank outside ``group``, as torch."""
    if not_member(group, "irecv"):
        return None
    return await _check("irecv", tensor, src, group, tag, group_src, False, blocking=False).start()


class P2POp:
    """One point-to-point op for ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv`` (aiodist's
    or torch's), ``peer`` a global rank or ``group_peer`` a group rank."""

    def __init__(
        self, op: Any, tensor: Any, peer: int | None = None, group: GroupArg = None, tag: int = 0, group_peer: int | None = None
    ) -> None:
        name = getattr(op, "__name__", None)
        if name not in ("isend", "irecv"):
            raise ValueError(f"P2POp: op must be isend or irecv, not {op!r}")
        if peer is None and group_peer is None:
            raise ValueError("P2POp: give peer or group_peer")
        if peer is not None and group_peer is not None:
            raise ValueError("P2POp: give peer or group_peer, not both")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    @property
    def sending(self) -> bool:
        return bool(self.op.__name__ == "isend")

    def __repr__(self) -> str:
        peer = f"peer={self.peer}" if self.peer is not None else f"group_peer={self.group_peer}"
        return f"P2POp({self.op.__name__}, {peer}, tag={self.tag})"


@on_world_loop
async def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Issue every op of the list (all are checked first: a bad one issues none) and return their
    Works in list order. Order within the list does not matter: every op is in flight at once."""
    if isinstance(p2p_op_list, (str, bytes)) or not isinstance(p2p_op_list, Sequence):
        raise TypeError(f"batch_isend_irecv takes a list of P2POp, not {type(p2p_op_list).__name__}")
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: the list of P2POp is empty")
    checked = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: item {i} is a {type(p).__name__}, not a P2POp")
        checked.append(_check(p.op.__name__, p.tensor, p.peer, p.group, p.tag, p.group_peer, p.sending, blocking=False))
    groups = {id(c.pg) for c in checked}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: all ops of a batch must use the same group")
    devs = {id(c.dev) for c in checked}
    if len(devs) > 1:
        raise ValueError("batch_isend_irecv: all tensors of a batch must live on one device type (host or device memory, not both)")
    dev = checked[0].dev
    if dev is not None:  # one grouped device call (NCCL's group semantics: every op in flight at once)
        works: list[Work] = await dev.issue(checked[0].pg, "p2p", {"ops": [c.device_args() for c in checked]})
        return works
    return [c.issue() for c in checked]
