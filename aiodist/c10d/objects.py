"""The object collectives: ``broadcast_object_list``, ``all_gather_object``, ``gather_object``,
``scatter_object_list``, ``send_object_list``, ``recv_object_list``; each an ``async def``.

Wire format (docs/objects.md): every object is pickled (protocol 5) on its own; the sizes go
first, as an int64 array through one collective (or message), then the payload, the pickles
back to back as one uint8 array of exactly the total size. Nothing is padded to the largest
object: the byte collectives take a differently sized buffer per rank (``all_gather``,
``gather`` and ``scatter`` with uneven sizes).

Every argument is checked (TypeError/ValueError) before the first op is issued, so a refused
call sends nothing and leaves the group usable. Each call is two ops of the group (sizes, then
bytes), each bounded by the group's timeout; like every op, they are matched across ranks by
issue order, so do not run an object collective concurrently with other ops of the same group
from another task. A rank that knows both ops up front issues them together; one that must wait
for the sizes aborts the group if it is cancelled in between, rather than stay one op behind its
peers (docs/objects.md).

Unpickling runs arbitrary code: only exchange objects with ranks you trust (torch's warning).
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable, MutableSequence, Sequence
from typing import Any, TypeVar

import numpy as np

from aiodist.c10d._args import group_root
from aiodist.c10d.collectives import all_gather, broadcast, gather, gather_uneven, scatter, scatter_uneven
from aiodist.c10d.init import GroupArg, not_member, resolve_group
from aiodist.c10d.point_to_point import isend, recv
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.work import Work
from aiodist.c10d.world import on_world_loop
from aiodist.errors import DistError, DistNetworkError, DistTimeoutError

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "PICKLE_PROTOCOL",
]

#: The pickle protocol every object is serialised with.
PICKLE_PROTOCOL = 5

_EMPTY = np.empty(0, dtype=np.uint8)
_LENGTHS = "{op}: this rank expected the sizes of {n} objects (len(object_list)); if the message did not fit, the lists' lengths differ across ranks"


def _hint_lengths(exc: DistError, op: str, n: int) -> None:
    """The lists' lengths may be why a sizes op failed, unless a peer was lost or timed out
    (a peer that exited is not a length that differs)."""
    if not isinstance(exc, (DistNetworkError, DistTimeoutError)) and "closed the connection" not in str(exc):
        exc.add_note(_LENGTHS.format(op=op, n=n))


T = TypeVar("T")


# -- ordering: no rank left one op behind -------------------------------------------------------


def _issued(work: Work | None) -> Work:
    assert isinstance(work, Work), "async_op=True returns the issued op's Work"
    return work


async def _before_next(pg: ProcessGroup, op: str, step: Awaitable[T]) -> T:
    """Await the sizes op of a call whose bytes op this rank can issue only once the sizes are in.

    Cancelling the caller here (``asyncio.timeout``, ``task.cancel()``) would leave this rank one
    op behind its peers: its next op would be matched with their bytes op. So the group is aborted
    instead (this rank refuses every later op on it, loudly; the peers' bytes op fails at their
    timeout) and the cancellation goes on. Ranks that know both ops up front issue them together
    and have no such window."""
    try:
        return await step
    except asyncio.CancelledError:
        pg.abort(f"{op} was cancelled on global rank {pg.ranks[pg.rank()]} between its sizes op and its bytes op; this rank is out of step")
        raise


# -- local helpers (no communication) -----------------------------------------------------------


def _dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def _pack(objs: Sequence[object]) -> tuple[np.ndarray, np.ndarray]:
    """The sizes (int64) and the payload (uint8, the pickles back to back) of ``objs``."""
    pickles = [_dumps(o) for o in objs]
    sizes = np.array([len(p) for p in pickles], dtype=np.int64)
    payload = np.frombuffer(b"".join(pickles), dtype=np.uint8) if pickles else _EMPTY
    return sizes, payload


def _loads(part: np.ndarray) -> Any:
    return pickle.loads(part.data)


def _unpack(payload: np.ndarray, sizes: np.ndarray) -> list[Any]:
    """The objects pickled back to back in ``payload`` with the given ``sizes``."""
    out: list[Any] = []
    view = payload.data  # a memoryview: the pickles are read in place
    start = 0
    for size in sizes.tolist():
        out.append(pickle.loads(view[start : start + size]))
        start += size
    return out


def _checked(sizes: np.ndarray, what: str) -> np.ndarray:
    """``sizes`` as received; a negative size means the ranks disagree on the call (a size
    message of another op, or of another length, was matched)."""
    if sizes.size and int(sizes.min()) < 0:
        raise ValueError(f"{what}: received a negative object size {int(sizes.min())}; the ranks do not agree on the call")
    return sizes


def _alloc(sizes: np.ndarray, what: str) -> np.ndarray:
    """One receive buffer for the pickles of ``sizes``, back to back."""
    return np.empty(int(_checked(sizes, what).sum()), dtype=np.uint8)


def _out_list(obj: object, what: str) -> MutableSequence[Any]:
    if not isinstance(obj, MutableSequence):
        raise TypeError(f"{what} must be a list, not {type(obj).__name__}")
    return obj


def _in_list(obj: object, what: str) -> Sequence[Any]:
    if isinstance(obj, (str, bytes, bytearray)) or not isinstance(obj, Sequence):
        raise TypeError(f"{what} must be a list, not {type(obj).__name__}")
    return obj


def _group_sized(obj: object, what: str, pg: ProcessGroup) -> MutableSequence[Any]:
    lst = _out_list(obj, what)
    if len(lst) != pg.size():
        raise ValueError(f"{what} has {len(lst)} entries, the group has {pg.size()} ranks (it must be sized as the group)")
    return lst


def _device(device: object, what: str) -> None:
    """``device`` is accepted for torch's signature and otherwise ignored: the bytes always live in
    host memory (a numpy array), whatever device the objects' tensors are on."""
    if device is not None and not isinstance(device, str) and not hasattr(device, "type"):
        raise TypeError(f"{what}: device must be None, a str or a torch.device, not {type(device).__name__}")


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, not {type(value).__name__}")
    return value


# -- collectives --------------------------------------------------------------------------------


@on_world_loop
async def broadcast_object_list(
    object_list: list[Any], src: int | None = None, group: GroupArg = None, device: Any = None, group_src: int | None = None
) -> None:
    """Broadcast the picklable objects of ``object_list`` on ``src`` into ``object_list`` of every
    other rank, in place (``src`` a global rank, ``group_src`` a group rank; global rank 0 if
    neither is given). Every rank passes a list of the same length; the source's list is left as
    it is."""
    if not_member(group, "broadcast_object_list"):
        return None
    pg = resolve_group(group, what="broadcast_object_list")
    root = group_root(pg, "broadcast_object_list", "src", src, group_src, default_global=0 if group_src is None else None)
    objs = _out_list(object_list, "broadcast_object_list object_list")
    _device(device, "broadcast_object_list")
    if pg.rank() == root:
        sizes, payload = _pack(objs)
        works = [_issued(await broadcast(sizes, group=pg, group_src=root, async_op=True))]
        if payload.size:  # both issued at once: the source has no window between its two ops
            works.append(_issued(await broadcast(payload, group=pg, group_src=root, async_op=True)))
        for w in works:
            await w
        return
    sizes = np.empty(len(objs), dtype=np.int64)
    try:
        sizes_op = broadcast(sizes, group=pg, group_src=root)
        await (_before_next(pg, "broadcast_object_list", sizes_op) if objs else sizes_op)
    except DistError as exc:
        _hint_lengths(exc, "broadcast_object_list", len(objs))
        raise
    payload = _alloc(sizes, "broadcast_object_list")
    if payload.size:
        await broadcast(payload, group=pg, group_src=root)
    objs[:] = _unpack(payload, sizes)


@on_world_loop
async def all_gather_object(object_list: list[Any], obj: Any, group: GroupArg = None) -> None:
    """Every rank's picklable ``obj`` into ``object_list[that group rank]`` on every rank, in place
    (``object_list`` must have one entry per rank of the group). Each entry, this rank's own
    included, is an unpickled copy."""
    if not_member(group, "all_gather_object"):
        return None
    pg = resolve_group(group, what="all_gather_object")
    out = _group_sized(object_list, "all_gather_object object_list", pg)
    sizes, payload = _pack([obj])
    n = pg.size()
    all_sizes = [np.empty(1, dtype=np.int64) for _ in range(n)]
    await _before_next(pg, "all_gather_object", all_gather(all_sizes, sizes, group=pg))
    got = np.concatenate(all_sizes)
    parts = [np.empty(int(s), dtype=np.uint8) for s in _checked(got, "all_gather_object")]
    await all_gather(parts, payload, group=pg)
    out[:] = [_loads(p) for p in parts]


@on_world_loop
async def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None, group: GroupArg = None, group_dst: int | None = None
) -> None:
    """Every rank's picklable ``obj`` into ``object_gather_list[that group rank]`` of ``dst``
    (global rank 0 if neither ``dst`` nor ``group_dst`` is given). The list must be sized as the
    group on the destination and None (or empty) elsewhere."""
    if not_member(group, "gather_object"):
        return None
    pg = resolve_group(group, what="gather_object")
    root = group_root(pg, "gather_object", "dst", dst, group_dst, default_global=0 if group_dst is None else None)
    is_root = pg.rank() == root
    out: MutableSequence[Any] | None = None
    if is_root:
        if object_gather_list is None:
            raise ValueError("gather_object: object_gather_list must be specified on the destination rank")
        out = _group_sized(object_gather_list, "gather_object object_gather_list", pg)
    elif object_gather_list:
        raise ValueError("gather_object: object_gather_list must NOT be specified on non-destination ranks")
    sizes, payload = _pack([obj])
    n = pg.size()
    if out is None:  # both issued at once: no window between the two ops
        w1 = _issued(await gather(sizes, None, group=pg, group_dst=root, async_op=True))
        w2 = _issued(await gather_uneven(payload, None, group=pg, group_dst=root, async_op=True))
        await w1
        await w2
        return
    all_sizes = [np.empty(1, dtype=np.int64) for _ in range(n)]
    await _before_next(pg, "gather_object", gather(sizes, all_sizes, group=pg, group_dst=root))
    got = np.concatenate(all_sizes)
    parts = [np.empty(int(s), dtype=np.uint8) for s in _checked(got, "gather_object")]
    await gather_uneven(payload, parts, group=pg, group_dst=root)
    out[:] = [_loads(p) for p in parts]


@on_world_loop
async def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    group_src: int | None = None,
) -> None:
    """``scatter_object_input_list[i]`` of ``src`` (global rank 0 if neither ``src`` nor
    ``group_src`` is given) into ``scatter_object_output_list[0]`` of group rank i. The input list
    must be sized as the group on the source; elsewhere it is ignored (as in torch)."""
    if not_member(group, "scatter_object_list"):
        return None
    pg = resolve_group(group, what="scatter_object_list")
    root = group_root(pg, "scatter_object_list", "src", src, group_src, default_global=0 if group_src is None else None)
    out = _out_list(scatter_object_output_list, "scatter_object_list scatter_object_output_list")
    if not out:
        raise ValueError(
            "scatter_object_list: Expected argument scatter_object_output_list to be a list of size at least 1."
        )  # torch's words
    n = pg.size()
    size = np.empty(1, dtype=np.int64)
    if pg.rank() == root:
        if scatter_object_input_list is None:
            raise ValueError("scatter_object_list: scatter_object_input_list must be specified on the source rank")
        ins = _in_list(scatter_object_input_list, "scatter_object_list scatter_object_input_list")
        if len(ins) != n:
            raise ValueError(f"scatter_object_list scatter_object_input_list has {len(ins)} entries, the group has {n} ranks")
        pickles = [_dumps(o) for o in ins]
        sizes = [np.array([len(p)], dtype=np.int64) for p in pickles]
        parts = [np.frombuffer(p, dtype=np.uint8) for p in pickles]
        mine = np.empty(len(pickles[root]), dtype=np.uint8)
        w1 = _issued(await scatter(size, sizes, group=pg, group_src=root, async_op=True))
        w2 = _issued(await scatter_uneven(mine, parts, group=pg, group_src=root, async_op=True))  # no window between them
        await w1
        await w2
    else:
        await _before_next(pg, "scatter_object_list", scatter(size, None, group=pg, group_src=root))
        mine = np.empty(int(_checked(size, "scatter_object_list")[0]), dtype=np.uint8)
        await scatter_uneven(mine, None, group=pg, group_src=root)
    out[0] = _loads(mine)


# -- point-to-point -----------------------------------------------------------------------------


@on_world_loop
async def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: GroupArg = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the picklable objects of ``object_list`` to ``dst`` (global rank) or ``group_dst``: their
    sizes, then their bytes, as two messages with tag 0. The receiver passes a list of the same
    length to ``recv_object_list``. ``device`` and ``use_batch`` are accepted and ignored (the
    messages are the same either way)."""
    if not_member(group, "send_object_list"):
        return None
    pg = resolve_group(group, what="send_object_list")
    peer = group_root(pg, "send_object_list", "dst", dst, group_dst)
    objs = _in_list(object_list, "send_object_list object_list")
    _device(device, "send_object_list")
    _bool(use_batch, "send_object_list use_batch")
    if peer == pg.rank():
        raise ValueError(f"send_object_list: dst is this rank ({pg.ranks[peer]}); sending to oneself is not supported")
    sizes, payload = _pack(objs)
    works = [await isend(sizes, group=pg, group_dst=peer)]
    if payload.size:  # both issued at once: no window between the two messages
        works.append(await isend(payload, group=pg, group_dst=peer))
    for w in works:
        assert w is not None  # pg is a live group of this rank
        await w


@on_world_loop
async def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: GroupArg = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive ``len(object_list)`` objects sent by ``send_object_list`` into ``object_list``, in
    place, from ``src`` (global rank), ``group_src``, or any rank of the group if both are None.
    Returns the sender's global rank; the bytes are received from that same sender."""
    if not_member(group, "recv_object_list"):
        return -1
    pg = resolve_group(group, what="recv_object_list")
    peer: int | None = None
    if src is not None or group_src is not None:
        peer = group_root(pg, "recv_object_list", "src", src, group_src)
        if peer == pg.rank():
            raise ValueError(f"recv_object_list: src is this rank ({pg.ranks[peer]}); receiving from oneself is not supported")
    objs = _out_list(object_list, "recv_object_list object_list")
    _device(device, "recv_object_list")
    _bool(use_batch, "recv_object_list use_batch")
    sizes = np.empty(len(objs), dtype=np.int64)
    try:
        sizes_op = recv(sizes, group=pg) if peer is None else recv(sizes, group=pg, group_src=peer)
        sender = await (_before_next(pg, "recv_object_list", sizes_op) if objs else sizes_op)
    except DistError as exc:
        _hint_lengths(exc, "recv_object_list", len(objs))
        raise
    payload = _alloc(sizes, "recv_object_list")
    if payload.size:
        await recv(payload, src=sender, group=pg)
    objs[:] = _unpack(payload, sizes)
    return int(sender)
