"""The collectives, with torch's names, arguments and defaults; each an ``async def``.

Every function: resolves the group, checks its arguments (TypeError/ValueError, nothing sent,
the group stays usable), then issues the op in the same step (its sequence number taken before
any suspension point). ``async_op=True`` returns the ``Work`` at once; otherwise the call
returns None once the op is done. Outputs are written in place. ``src``/``dst`` are global
ranks, ``group_src``/``group_dst`` group ranks, as in torch.

Reductions: ``check_reduce`` refuses an op/dtype pair before anything is sent; PREMUL_SUM
scales each rank's own contribution once (a copy where the caller's tensor is only an input),
AVG divides once at the end (``aiodist.types``).
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiodist._pending import LATER, LET_RUN
from aiodist._time import TimeoutLike, to_seconds
from aiodist.algorithms import collectives as alg
from aiodist.algorithms.p2p import P2P, SubP2P, byte_view
from aiodist.backends.routes import Into, Quick, quick, route
from aiodist.c10d import process_group
from aiodist.c10d._args import buf, bufs, check_async_op, group_root, same_dtype, split_sizes
from aiodist.c10d._device import device_backend, issue_on_device
from aiodist.c10d.init import GroupArg, not_member, resolve_group
from aiodist.c10d.process_group import NOT_NOW, Described, ProcessGroup, describe_call
from aiodist.c10d.work import Work
from aiodist.c10d.world import _CURRENT, default_group, on_world_loop, on_world_loop_now
from aiodist.errors import DistTimeoutError
from aiodist.types import (
    Buffer,
    ReduceOp,
    ReduceOpLike,
    check_reduce,
    combiner,
    finalize,
    folder,
    is_torch_tensor,
    premultiply,
    to_reduce_op,
)

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "monitored_barrier",
]

_PREMUL = ReduceOp.RedOpType.PREMUL_SUM
_AVG = ReduceOp.RedOpType.AVG


_NO_META: dict[str, Any] = {"same": {}}


def _t(b: Buffer) -> str:
    """A tensor as the flight recorder and the desync check show it: ``float32[10, 2]``."""
    return f"{b.dtype_name}{list(b.shape)}"


def _opname(rop: ReduceOp) -> str:
    return rop.op.name if rop.op is not _PREMUL else f"PREMUL_SUM({rop.factor})"


def _meta(local: dict[str, Any] | None = None, **same: Any) -> dict[str, Any]:
    """An op's description (ProcessGroup.issue's ``meta``): ``same`` is what every rank must agree
    on (DETAIL compares it), ``local`` what may differ (uneven sizes): both are recorded."""
    return {"same": same} if local is None else {"same": same, "local": local}


def _premultiply(buf: np.ndarray, rop: ReduceOp, *, dtype: str) -> None:
    if rop.op is _PREMUL:  # a no-op for every other op: skip its checks on the hot path
        premultiply(buf, rop, dtype=dtype)


def _finalize(buf: np.ndarray, rop: ReduceOp, n: int, *, dtype: str) -> None:
    if rop.op is _AVG:
        finalize(buf, rop, n, dtype=dtype)


def _kept_fold(rop: ReduceOp, dtype: str, n: int) -> Any:
    """The fold of a kept call's in-call path (``aiodist.types.folder``), and for AVG the
    division by the group's size after it (torch's AVG: the sum, then the division)."""
    fold = folder(rop, dtype)
    if rop.op is not _AVG:
        return fold

    def fold_then_average(out: np.ndarray, parts: Any, tmp: Any = None) -> None:
        fold(out, parts, tmp)
        finalize(out, rop, n, dtype=dtype)

    return fold_then_average


async def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    await work
    return None


def _reduction(op: object, dtype: str, what: str) -> tuple[ReduceOp, Callable[[np.ndarray, np.ndarray], None]]:
    rop = to_reduce_op(op)
    return rop, combiner(rop, dtype, what)  # checks the pair once, here, before anything is sent


def _same_size(a: Buffer, size: int, what: str) -> None:
    if a.flat.size != size:
        raise ValueError(f"{what} has {a.flat.size} elements, expected {size}")


_KIND = ReduceOp.RedOpType
_ALL_REDUCE = "all_reduce"
_BROADCAST = "broadcast"
_REDUCE = "reduce"
_ALL_GATHER = "all_gather"
_GATHER = "gather"
_SCATTER = "scatter"
_ALL_TO_ALL = "all_to_all_single"
_BARRIER = ("barrier",)  # the barrier's key in pg.hot (its call has nothing else)
#: calls kept per group (``ProcessGroup.hot``): a training loop repeats a few shapes
_HOT_MAX = 256


def _keep(pg: ProcessGroup, key: tuple[Any, ...], value: Any) -> None:
    """Keep what a call's checks found for the next call like it (``pg.hot``, bounded)."""
    if len(pg.hot) < _HOT_MAX:
        pg.hot[key] = value


def _chunks(flat: np.ndarray, n: int) -> list[np.ndarray]:
    m = flat.size // n
    return [flat[i * m : (i + 1) * m] for i in range(n)]


class Prepared:
    """What a call's checks found, kept per group and call (``pg.hot``: the op and what its
    checks depend on: dtype, shape, reduce op kind, root): asyncpg's prepared statement. The
    next call like it reads these fields instead of checking again: the call's description
    (``describe_call``: the recorder's meta and the desync digest), the plan, the route's
    in-call path for it (``quick``, aiodist.backends.routes.Quick; None: every op of the call
    takes its route), and per op: the reduction, its combine and fold, the dtype's name, whether
    there is nothing to do before or after the exchanges (``plain``), the group rank of the
    root (``root``)."""

    __slots__ = ("described", "plan", "quick", "rop", "combine", "fold", "name", "plain", "root")

    def __init__(
        self,
        described: Described,
        plan: Any,
        quick: Quick | None,
        *,
        rop: ReduceOp | None = None,
        combine: Any = None,
        fold: Any = None,
        name: str = "",
        plain: bool = False,
        root: int = -1,
    ) -> None:
        self.described = described
        self.plan = plan
        self.quick = quick
        self.rop = rop
        self.combine = combine
        self.fold = fold
        self.name = name
        self.plain = plain
        self.root = root


def _default_or(group: GroupArg, what: str) -> ProcessGroup | None:
    """The call's group (None on a rank outside it, after torch's warning): the default group
    read straight from the World, else ``resolve_group``."""
    if group is None:
        pg = _CURRENT.get().default_pg
        return default_group() if pg is None else pg  # (default_group raises: no default group)
    if not_member(group, what):
        return None
    return resolve_group(group, what=what)


def _now_group(group: GroupArg) -> ProcessGroup | None:
    """The group of a call's first step (``_now``), other than the default one (the callers read
    that straight from the World): ``group`` where it is a live group of this World; None where
    the call must check it (its coroutine does, and says what is wrong)."""
    if type(group) is ProcessGroup and _CURRENT.get().groups.get(group.group_id) is group:
        return group
    return None


def _int_or_none(x: object) -> bool:
    """A root argument the kept call's key may hold as it is (anything else: the call's own
    checks, which refuse a bool, a float or a list)."""
    return x is None or type(x) is int


_TORCH_TENSOR: list[Any] = []  # torch.Tensor, once torch is imported (aiodist never imports it)


def _host(t: object) -> np.ndarray | None:
    """The array a kept call works on: ``t`` where it is a numpy array; where it is a torch CPU
    tensor, C-contiguous, with no lazy conj or neg bit and not bfloat16 (whose numpy view is
    uint16: another dtype's kept call), its numpy view (torch's c10d works on a tensor that
    requires grad: so does this, on its storage); None otherwise (the call checks it itself,
    and says what is wrong). A call's description names dtype and shape only, so a torch
    tensor's call and a numpy array's of one dtype and shape are one kept call."""
    if type(t) is np.ndarray:
        return t
    if not _TORCH_TENSOR:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _TORCH_TENSOR.extend((torch.Tensor, torch.bfloat16, torch.strided))
    tensor_type, bf16, strided = _TORCH_TENSOR
    if not isinstance(t, tensor_type):
        return None
    if not t.is_cpu or t.layout is not strided or t.dtype is bf16 or not t.is_contiguous() or t.is_neg() or t.is_conj():
        return None
    try:
        return (t.detach() if t.requires_grad else t).numpy()  # type: ignore[no-any-return]
    except (RuntimeError, TypeError):  # (a dtype numpy has no view of)
        return None


def _now(pg: ProcessGroup, op: str, run: Any, a: Any, b: Any, outputs: list[Any], described: Described, asy: bool) -> Any:
    """A kept call's first step (``communicating``'s ``now``): issue its op by its in-call path
    (``ProcessGroup.issue_now``) and answer as the call does: its Work (``async_op``), None once
    done, or what finishes the call (a parked op's wait); ``LATER`` where the op must take its
    route (the call's coroutine then runs). Calls that never suspend would starve the loop, so
    where no op of the group let it run within ``EAGER_S``, a blocking call's await lets it run
    once (``LET_RUN``) and an ``async_op`` call, whose first step must give its Work (torch's
    ``work = dist.all_reduce(x, async_op=True)`` without ``await``), takes its route: its op then
    starts in a task."""
    t = time.perf_counter()
    stale = t - pg.ran >= process_group.EAGER_S  # (read here: a test may set it)
    if asy and stale:
        return LATER
    done = pg.issue_now(op, run, a, b, outputs, described, asy)
    if done is NOT_NOW:
        return LATER
    if asy:
        return done
    if done is not None:  # parked: the call waits for its Work
        return _wait_work(done)
    if stale:
        pg.ran = t
        return LET_RUN
    return None


def _first_step_of(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Name a call's first step as the call (an argument error then reads ``all_reduce() got
    an unexpected keyword argument``, as from the call's own coroutine)."""

    def name_it(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__name__ = f.__qualname__ = name
        return f

    return name_it


# -- broadcast / all_reduce / reduce -----------------------------------------------------------


@_first_step_of("broadcast")
def _broadcast_now(
    tensor: Any, src: int | None = None, group: GroupArg = None, async_op: bool = False, group_src: int | None = None
) -> Any:
    """broadcast's first step (``_now``): a kept call by its in-call path."""
    arr = tensor if type(tensor) is np.ndarray else _host(tensor)
    if arr is None or type(async_op) is not bool or not (_int_or_none(src) and _int_or_none(group_src)):
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None:
        return LATER
    flags = arr.flags
    if not flags.c_contiguous:
        return LATER
    hit = pg.hot.get((_BROADCAST, arr.dtype, arr.shape, src, group_src))
    if hit is None or hit.quick is None or not (flags.writeable or hit.root == pg.rank()):
        return LATER
    flat = arr if arr.ndim == 1 else arr.reshape(-1)
    return _now(pg, _BROADCAST, hit.quick.broadcast, flat, hit.root, [tensor], hit.described, async_op)


@on_world_loop_now(_broadcast_now)
async def broadcast(
    tensor: Any, src: int | None = None, group: GroupArg = None, async_op: bool = False, group_src: int | None = None
) -> Work | None:
    """Copy ``tensor`` of ``src`` into ``tensor`` of every rank of the group."""
    pg = _default_or(group, "broadcast")
    if pg is None:
        return None
    asy = async_op if type(async_op) is bool else check_async_op(async_op)
    # kept for the first step of the next call like it (_broadcast_now)
    arr = _host(tensor)
    key = (_BROADCAST, arr.dtype, arr.shape, src, group_src) if arr is not None and arr.flags.c_contiguous else None
    root = group_root(pg, "broadcast", "src", src, group_src)
    if (dev := device_backend(pg, tensor, "broadcast tensor")) is not None:
        return await issue_on_device(dev, pg, "broadcast", {"tensor": tensor, "root": root}, asy)
    b = buf(tensor, "broadcast tensor", writable=pg.rank() != root)
    flat = b.flat
    r = route(pg, "broadcast", flat.nbytes)
    described = describe_call("broadcast", _meta(tensor=_t(b), root=pg.ranks[root]))
    if key is not None and key not in pg.hot:
        _keep(pg, key, Prepared(described, r.plan, quick(pg, r.plan, flat.nbytes), root=root))

    async def body(p2p: P2P) -> None:
        await r.broadcast(p2p, flat, root)

    return await _finish(r.issue(pg, "broadcast", body, [tensor], described=described), asy)


@_first_step_of("all_reduce")
def _all_reduce_now(tensor: Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False) -> Any:
    """all_reduce's first step (``_now``): a kept call (a writable C-contiguous numpy array, a
    ReduceOp kind, a call seen before on its group) by its in-call path."""
    arr = tensor if type(tensor) is np.ndarray else _host(tensor)
    if arr is None or type(op) is not _KIND or type(async_op) is not bool:
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None:
        return LATER
    flags = arr.flags
    if not (flags.writeable and flags.c_contiguous):
        return LATER
    hit = pg.hot.get((_ALL_REDUCE, op, arr.dtype, arr.shape))
    if hit is None or hit.quick is None:
        return LATER
    flat = arr if arr.ndim == 1 else arr.reshape(-1)
    return _now(pg, _ALL_REDUCE, hit.quick.all_reduce, flat, hit.fold, [tensor], hit.described, async_op)


@on_world_loop_now(_all_reduce_now)
async def all_reduce(tensor: Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group, in place; the same bits on every rank."""
    pg = _default_or(group, "all_reduce")
    if pg is None:
        return None
    asy = async_op if type(async_op) is bool else check_async_op(async_op)
    hit: Prepared | None = None
    if type(tensor) is np.ndarray and type(op) is _KIND:
        # the hot path: a call seen before on this group (same op kind, dtype, shape) with a
        # writable C-contiguous array, whose checks, reduction and description are kept
        flags = tensor.flags
        if flags.writeable and flags.c_contiguous:
            hit = pg.hot.get((_ALL_REDUCE, op, tensor.dtype, tensor.shape))
    if hit is not None:
        flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        assert hit.rop is not None  # (an all_reduce's Prepared has its reduction)
        rop, combine, name, described, pl, plain = hit.rop, hit.combine, hit.name, hit.described, hit.plan, hit.plain
    else:
        if (dev := device_backend(pg, tensor, "all_reduce tensor")) is not None:
            return await issue_on_device(dev, pg, "all_reduce", {"tensor": tensor, "op": op}, asy)
        b = buf(tensor, "all_reduce tensor", writable=True)
        rop, combine = _reduction(op, b.dtype_name, "all_reduce")
        flat, name = b.flat, b.dtype_name
        described = describe_call("all_reduce", _meta(tensor=_t(b), op=_opname(rop)))
        pl = None
        plain = rop.op is not _PREMUL and rop.op is not _AVG  # nothing to do before or after the exchanges
    r = route(pg, "all_reduce", flat.nbytes, planned=pl)
    if hit is None and type(op) is _KIND and (arr := _host(tensor)) is not None and arr.flags.c_contiguous:
        q = quick(pg, r.plan, flat.nbytes) if rop.op is not _PREMUL else None
        fold = _kept_fold(rop, name, len(pg.ranks)) if q is not None else None
        kept = Prepared(described, r.plan, q, rop=rop, combine=combine, fold=fold, name=name, plain=plain)
        _keep(pg, (_ALL_REDUCE, op, arr.dtype, arr.shape), kept)
    if plain:
        work = r.issue(pg, "all_reduce", r.all_reduce_body(flat, combine), [tensor], described=described)
    else:
        n = len(pg.ranks)

        async def body(p2p: P2P) -> None:
            _premultiply(flat, rop, dtype=name)
            await r.all_reduce(p2p, flat, combine)
            _finalize(flat, rop, n, dtype=name)

        work = r.issue(pg, "all_reduce", body, [tensor], described=described)
    if asy:
        return work
    await _wait_work(work)
    return None


async def _wait_work(work: Work) -> None:
    """``await work`` without its generator (a cancelled wait leaves the op running); None."""
    if not work.done():
        try:
            await work._waiter()
        except asyncio.CancelledError:
            work._given_up()
            raise
    work.result()  # the op's error, if it failed
    return None


@on_world_loop
async def all_reduce_into(tensor: Any, outs: Sequence[Any], group: GroupArg = None) -> Work | None:  # not in __all__: CPU only
    """The sum of ``tensor`` across the group, written into ``outs`` (arrays or CPU tensors whose
    elements, one after the other, are ``tensor``'s; C-contiguous, of its dtype), with
    ``async_op=True``'s Work. ``tensor`` is scratch afterwards. Not torch's: DDP's buckets, whose
    results go to the gradients. Where the op's path reads the peers' results by single copy it
    reads them straight into ``outs`` (aiodist.shm.Into); any other path reduces in place, and
    ``outs`` are copied from ``tensor`` before the Work completes. The bits are all_reduce's."""
    if not_member(group, "all_reduce_into"):
        return None
    pg = resolve_group(group, what="all_reduce_into")
    b = buf(tensor, "all_reduce_into tensor", writable=True)
    rop, combine = _reduction(ReduceOp.SUM, b.dtype_name, "all_reduce_into")
    arrays = [buf(o, f"all_reduce_into outs[{k}]", writable=True) for k, o in enumerate(outs)]
    for k, a in enumerate(arrays):
        if a.flat.dtype != b.flat.dtype or not a.flat.flags.c_contiguous:
            raise ValueError(
                f"all_reduce_into: outs[{k}] is {a.dtype_name}, {'' if a.flat.flags.c_contiguous else 'not '}contiguous; want C-contiguous {b.dtype_name}"
            )
    if sum(a.flat.size for a in arrays) != b.flat.size:
        raise ValueError(f"all_reduce_into: outs hold {sum(a.flat.size for a in arrays)} elements, tensor {b.flat.size}")
    flat = b.flat
    into = Into([a.flat for a in arrays])
    r = route(pg, "all_reduce", flat.nbytes)

    body = functools.partial(r.all_reduce, flat=flat, combine=combine, into=into)
    described = describe_call("all_reduce", _meta(tensor=_t(b), op=_opname(rop)))
    return r.issue(pg, "all_reduce", body, [tensor], described=described)


@_first_step_of("reduce")
def _reduce_now(
    tensor: Any,
    dst: int | None = None,
    op: ReduceOpLike = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Any:
    """reduce's first step (``_now``): a kept call by its in-call path."""
    arr = tensor if type(tensor) is np.ndarray else _host(tensor)
    if arr is None or type(op) is not _KIND or type(async_op) is not bool or not (_int_or_none(dst) and _int_or_none(group_dst)):
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None:
        return LATER
    flags = arr.flags
    if not flags.c_contiguous:
        return LATER
    hit = pg.hot.get((_REDUCE, op, arr.dtype, arr.shape, dst, group_dst))
    if hit is None or hit.quick is None or not (flags.writeable or hit.root != pg.rank()):
        return LATER
    flat = arr if arr.ndim == 1 else arr.reshape(-1)
    return _now(pg, _REDUCE, hit.quick.reduce, flat, hit, [tensor], hit.described, async_op)


@on_world_loop_now(_reduce_now)
async def reduce(
    tensor: Any,
    dst: int | None = None,
    op: ReduceOpLike = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` of every rank into ``tensor`` of ``dst``; the others' are left as they were."""
    if not_member(group, "reduce"):
        return None
    pg = resolve_group(group, what="reduce")
    asy = check_async_op(async_op)
    root = group_root(pg, "reduce", "dst", dst, group_dst)
    if (dev := device_backend(pg, tensor, "reduce tensor")) is not None:
        return await issue_on_device(dev, pg, "reduce", {"tensor": tensor, "op": op, "root": root}, asy)
    is_root = pg.rank() == root
    b = buf(tensor, "reduce tensor", writable=is_root)
    rop, combine = _reduction(op, b.dtype_name, "reduce")
    flat, name, n = b.flat, b.dtype_name, pg.size()
    r = route(pg, "reduce", flat.nbytes)
    meta = _meta(tensor=_t(b), op=_opname(rop), root=pg.ranks[root])
    arr = _host(tensor) if type(op) is _KIND else None
    key = (_REDUCE, op, arr.dtype, arr.shape, dst, group_dst) if arr is not None else None
    if (
        rop.op is not _PREMUL and key is not None and arr is not None and arr.flags.c_contiguous and key not in pg.hot
    ):  # kept for _reduce_now
        q = quick(pg, r.plan, flat.nbytes)
        _keep(
            pg, key, Prepared(describe_call("reduce", meta), r.plan, q, fold=_kept_fold(rop, name, n) if q is not None else None, root=root)
        )

    async def body(p2p: P2P) -> None:
        mine = flat if is_root or rop.op is not _PREMUL else flat.copy()
        _premultiply(mine, rop, dtype=name)
        await r.reduce(p2p, mine, root, combine)
        if is_root:
            _finalize(mine, rop, n, dtype=name)

    return await _finish(r.issue(pg, "reduce", body, [tensor], meta=meta), asy)


# -- all_gather / gather / scatter -------------------------------------------------------------


@_first_step_of("all_gather")
def _all_gather_list_now(tensor_list: Sequence[Any], tensor: Any, group: GroupArg = None, async_op: bool = False) -> Any:
    """all_gather's first step (``_now``): a kept call of even parts (every array of the list
    of the input's dtype and shape: the object collectives' size exchange is one) by its
    in-call path."""
    if type(tensor) is not np.ndarray or type(tensor_list) is not list or type(async_op) is not bool:
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None or len(tensor_list) != len(pg.ranks):
        return LATER
    dtype, shape = tensor.dtype, tensor.shape
    for o in tensor_list:
        if type(o) is not np.ndarray or o.shape != shape or o.dtype != dtype or not (o.flags.writeable and o.flags.c_contiguous):
            return LATER
    hit = pg.hot.get((_ALL_GATHER, dtype, shape))
    if hit is None or hit.quick is None or not tensor.flags.c_contiguous:
        return LATER
    return _now(pg, _ALL_GATHER, hit.quick.all_gather_list, tensor_list, tensor, list(tensor_list), hit.described, async_op)


@on_world_loop_now(_all_gather_list_now)
async def all_gather(tensor_list: Sequence[Any], tensor: Any, group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Every rank's ``tensor`` into ``tensor_list[that rank]`` on every rank (sizes may differ per rank)."""
    if not_member(group, "all_gather"):
        return None
    pg = resolve_group(group, what="all_gather")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, tensor, "all_gather tensor")) is not None:
        return await issue_on_device(dev, pg, "all_gather", {"tensor_list": tensor_list, "tensor": tensor}, asy)
    inp = buf(tensor, "all_gather tensor", writable=False)
    outs = bufs(tensor_list, "all_gather tensor_list", pg.size(), writable=True)
    same_dtype(outs, inp, "all_gather tensor_list")
    _same_size(outs[pg.rank()], inp.flat.size, f"all_gather tensor_list[{pg.rank()}] (this rank's own slot)")
    flats, mine = [o.flat for o in outs], inp.flat
    r = route(pg, "all_gather", sum(f.nbytes for f in flats), part=max(f.nbytes for f in flats))
    meta = _meta(dtype=inp.dtype_name, local={"input": _t(inp)})
    even = type(tensor) is np.ndarray and all(type(o) is np.ndarray and o.shape == tensor.shape for o in tensor_list)
    if even and type(tensor_list) is list and (_ALL_GATHER, tensor.dtype, tensor.shape) not in pg.hot:  # kept for _all_gather_list_now
        _keep(
            pg,
            (_ALL_GATHER, tensor.dtype, tensor.shape),
            Prepared(describe_call("all_gather", meta), r.plan, quick(pg, r.plan, mine.nbytes)),
        )

    async def body(p2p: P2P) -> None:
        await r.all_gather(p2p, flats, mine)

    return await _finish(r.issue(pg, "all_gather", body, list(tensor_list), meta=meta), asy)


def _all_gather_now(op: str) -> Callable[..., Any]:
    @_first_step_of(op)
    def first_step(output_tensor: Any, input_tensor: Any, group: GroupArg = None, async_op: bool = False) -> Any:
        """all_gather_into_tensor's first step (``_now``): a kept call by its in-call path."""
        out = output_tensor if type(output_tensor) is np.ndarray else _host(output_tensor)
        inp = input_tensor if type(input_tensor) is np.ndarray else _host(input_tensor)
        if out is None or inp is None or type(async_op) is not bool:
            return LATER
        pg = _CURRENT.get().default_pg if group is None else _now_group(group)
        if pg is None:
            return LATER
        hit = pg.hot.get((op, out.dtype, out.shape, inp.dtype, inp.shape))
        if hit is None or hit.quick is None:
            return LATER
        flags = out.flags
        if not (flags.writeable and flags.c_contiguous and inp.flags.c_contiguous):
            return LATER
        into, part = out.reshape(-1), inp.reshape(-1)
        return _now(pg, op, hit.quick.all_gather, into, part, [output_tensor], hit.described, async_op)

    return first_step


@on_world_loop_now(_all_gather_now("all_gather_into_tensor"))
async def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Every rank's ``input_tensor`` concatenated (or stacked) into ``output_tensor`` in rank order."""
    return await _all_gather_one("all_gather_into_tensor", output_tensor, input_tensor, group, async_op)


@on_world_loop_now(_all_gather_now("all_gather_single"))
async def all_gather_single(output_tensor: Any, input_tensor: Any, group: GroupArg = None, async_op: bool = False) -> Work | None:
    """The newer name of ``all_gather_into_tensor`` (concatenation and stack forms)."""
    return await _all_gather_one("all_gather_single", output_tensor, input_tensor, group, async_op)


async def _all_gather_one(op: str, output_tensor: Any, input_tensor: Any, group: GroupArg, async_op: bool) -> Work | None:
    pg = _default_or(group, op)
    if pg is None:
        return None
    asy = async_op if type(async_op) is bool else check_async_op(async_op)
    key = None  # kept for the first step of the next call like it (_all_gather_now)
    if (o := _host(output_tensor)) is not None and (i := _host(input_tensor)) is not None:
        key = (op, o.dtype, o.shape, i.dtype, i.shape)
    if (dev := device_backend(pg, input_tensor, f"{op} input_tensor")) is not None:
        return await issue_on_device(dev, pg, op, {"output_tensor": output_tensor, "input_tensor": input_tensor}, asy)
    out = buf(output_tensor, f"{op} output_tensor", writable=True)
    inp = buf(input_tensor, f"{op} input_tensor", writable=False)
    same_dtype([out], inp, f"{op} output_tensor")
    n = pg.size()
    _same_size(out, n * inp.flat.size, f"{op} output_tensor (world size x input size)")
    chunks, mine = _chunks(out.flat, n), inp.flat
    r = route(pg, "all_gather", out.flat.nbytes, part=mine.nbytes)
    described = describe_call(op, _meta(output=_t(out), input=_t(inp)))
    if key is not None and key not in pg.hot:
        _keep(pg, key, Prepared(described, r.plan, quick(pg, r.plan, mine.nbytes)))

    async def body(p2p: P2P) -> None:
        await r.all_gather(p2p, chunks, mine)

    return await _finish(r.issue(pg, op, body, [output_tensor], described=described), asy)


def _root_list(
    pg: ProcessGroup, root: int, tensors: Sequence[Any] | None, own: Buffer, op: str, name: str, role: str, *, writable: bool
) -> list[np.ndarray] | None:
    """gather's ``gather_list`` / scatter's ``scatter_list``: on the root, one tensor per rank of
    ``own``'s dtype, the root's own the size of ``own``; elsewhere absent (None or empty), as in torch."""
    if pg.rank() != root:
        if tensors:
            raise ValueError(f"{op}: {name} must NOT be specified on non-{role} ranks")
        return None
    if tensors is None:
        raise ValueError(f"{op}: {name} must be specified on the {role} rank")
    items = bufs(tensors, f"{op} {name}", pg.size(), writable=writable)
    same_dtype(items, own, f"{op} {name}")
    _same_size(items[root], own.flat.size, f"{op} {name}[{root}] (the {role}'s own slot)")
    return [b.flat for b in items]


def _root_list_now(items: object, like: np.ndarray, n: int, writable: bool) -> list[np.ndarray] | None:
    """A gather's or scatter's list on its root, for a kept call's first step: ``n`` arrays
    (numpy, or torch tensors' views: ``_host``) of ``like``'s dtype and shape, C-contiguous
    (and writable: ``writable``); None otherwise (the call's own checks take it)."""
    if type(items) is not list or len(items) != n:
        return None
    got = []
    for o in items:
        a = o if type(o) is np.ndarray else _host(o)
        if a is None or a.shape != like.shape or a.dtype != like.dtype:
            return None
        flags = a.flags
        if not flags.c_contiguous or (writable and not flags.writeable):
            return None
        got.append(a)
    return got


def _not_root_list(items: object) -> bool:
    """A root's list where a rank that is not the root has none (None or empty, as torch takes)."""
    return items is None or (type(items) is list and not items)


def _rooted_now(op: str, tensor: Any, items: Any, root_arg: Any, group: GroupArg, async_op: Any, group_root_arg: Any) -> Any:
    """gather's and scatter's first step (``_now``; ``op`` says which): a kept call of one size
    everywhere by its in-call path. gather's root list is written, scatter's tensor is."""
    arr = tensor if type(tensor) is np.ndarray else _host(tensor)
    if arr is None or type(async_op) is not bool:
        return LATER
    if not ((root_arg is None or type(root_arg) is int) and (group_root_arg is None or type(group_root_arg) is int)):
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None:
        return LATER
    gather = op is _GATHER
    flags = arr.flags
    if not flags.c_contiguous or not (gather or flags.writeable):
        return LATER
    hit = pg.hot.get((op, arr.dtype, arr.shape, root_arg, group_root_arg))
    if hit is None or hit.quick is None:
        return LATER
    root, q = hit.root, hit.quick
    if root == q.me:
        lst = _root_list_now(items, arr, len(pg.ranks), gather)
        if lst is None:
            return LATER
    elif _not_root_list(items):
        lst = None
    else:
        return LATER
    if gather:
        return _now(pg, op, q.gather, arr, (lst, root), list(items or ()), hit.described, async_op)
    return _now(pg, op, q.scatter, arr, (lst, root), [tensor], hit.described, async_op)


@_first_step_of("gather")
def _gather_now(
    tensor: Any,
    gather_list: Sequence[Any] | None = None,
    dst: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Any:
    return _rooted_now(_GATHER, tensor, gather_list, dst, group, async_op, group_dst)


@on_world_loop_now(_gather_now)
async def gather(
    tensor: Any,
    gather_list: Sequence[Any] | None = None,
    dst: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Every rank's ``tensor`` into ``gather_list`` of ``dst`` (default: global rank 0)."""
    return await _rooted(_GATHER, tensor, gather_list, dst, group, async_op, group_dst, uneven=False)


@on_world_loop
async def gather_uneven(
    tensor: Any, gather_list: Sequence[Any] | None = None, group: GroupArg = None, async_op: bool = False, group_dst: int | None = None
) -> Work | None:  # not in __all__: the object collectives' payloads
    """``gather`` whose parts differ in size per rank on purpose (pickled objects): every rank
    takes one path, whatever its own size (``plan``'s ``part``)."""
    return await _rooted(_GATHER, tensor, gather_list, None, group, async_op, group_dst, uneven=True)


@_first_step_of("scatter")
def _scatter_now(
    tensor: Any,
    scatter_list: Sequence[Any] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Any:
    return _rooted_now(_SCATTER, tensor, scatter_list, src, group, async_op, group_src)


@on_world_loop_now(_scatter_now)
async def scatter(
    tensor: Any,
    scatter_list: Sequence[Any] | None = None,
    src: int | None = None,
    group: GroupArg = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """``scatter_list[i]`` of ``src`` (default: global rank 0) into ``tensor`` of group rank i."""
    return await _rooted(_SCATTER, tensor, scatter_list, src, group, async_op, group_src, uneven=False)


@on_world_loop
async def scatter_uneven(
    tensor: Any, scatter_list: Sequence[Any] | None = None, group: GroupArg = None, async_op: bool = False, group_src: int | None = None
) -> Work | None:  # not in __all__: the object collectives' payloads
    """``scatter`` whose parts differ in size per rank on purpose (pickled objects): every rank
    takes one path, whatever its own size (``plan``'s ``part``)."""
    return await _rooted(_SCATTER, tensor, scatter_list, None, group, async_op, group_src, uneven=True)


async def _rooted(
    op: str,
    tensor: Any,
    items: Sequence[Any] | None,
    root_arg: int | None,
    group: GroupArg,
    async_op: bool,
    group_root_arg: int | None,
    *,
    uneven: bool,
) -> Work | None:
    """gather (``op``: the root's ``items`` are written) or scatter (the root's ``items`` are
    read, every rank's ``tensor`` written); ``uneven``: sizes differ per rank on purpose."""
    gather = op is _GATHER
    if not_member(group, op):
        return None
    pg = resolve_group(group, what=op)
    asy = check_async_op(async_op)
    names = ("dst", "gather_list", "destination", "input") if gather else ("src", "scatter_list", "source", "output")
    root = group_root(pg, op, names[0], root_arg, group_root_arg, default_global=0 if group_root_arg is None else None)
    if (dev := device_backend(pg, tensor, f"{op} tensor")) is not None:
        return await issue_on_device(dev, pg, op, {"tensor": tensor, names[1]: items, "root": root}, asy)
    b = buf(tensor, f"{op} tensor", writable=not gather)
    flats = _root_list(pg, root, items, b, op, names[1], names[2], writable=gather)
    mine = b.flat
    n = pg.size()
    r = route(pg, op, mine.nbytes, part=1 if uneven else 0)
    described = describe_call(op, _meta(dtype=b.dtype_name, root=pg.ranks[root], local={names[3]: _t(b)}))
    arr = _host(tensor) if not uneven else None
    if arr is not None and arr.flags.c_contiguous and (key := (op, arr.dtype, arr.shape, root_arg, group_root_arg)) not in pg.hot:
        if pg.rank() != root or _root_list_now(items, arr, n, gather) is not None:  # one size everywhere: kept for _rooted_now
            posted = max(mine.nbytes, 8 * n) if gather else n * (mine.nbytes + 8)  # the root's post: its table (and a scatter's parts)
            _keep(pg, key, Prepared(described, r.plan, quick(pg, r.plan, posted), root=root))

    if gather:

        async def body(p2p: P2P) -> None:
            await r.gather(p2p, flats, mine, root)

        return await _finish(r.issue(pg, op, body, list(items or []), described=described), asy)

    async def spread(p2p: P2P) -> None:
        await r.scatter(p2p, mine, flats, root)

    return await _finish(r.issue(pg, op, spread, [tensor], described=described), asy)


# -- reduce_scatter / all_to_all / barrier -----------------------------------------------------


@on_world_loop
async def reduce_scatter(
    output: Any, input_list: Sequence[Any], op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """``output`` of rank r = the reduction over every rank of its ``input_list[r]``."""
    if not_member(group, "reduce_scatter"):
        return None
    pg = resolve_group(group, what="reduce_scatter")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, output, "reduce_scatter output")) is not None:
        return await issue_on_device(dev, pg, "reduce_scatter", {"output": output, "input_list": input_list, "op": op}, asy)
    out = buf(output, "reduce_scatter output", writable=True)
    ins = bufs(input_list, "reduce_scatter input_list", pg.size(), writable=False)
    same_dtype(ins, out, "reduce_scatter input_list")
    _same_size(ins[pg.rank()], out.flat.size, f"reduce_scatter input_list[{pg.rank()}] (this rank's part)")
    rop, combine = _reduction(op, out.dtype_name, "reduce_scatter")
    return await _finish(_issue_reduce_scatter(pg, "reduce_scatter", out, [i.flat for i in ins], rop, combine, output), asy)


def _reduce_scatter_now(name: str) -> Callable[..., Any]:
    @_first_step_of(name)
    def first_step(output: Any, input: Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False) -> Any:
        """reduce_scatter_tensor's first step (``_now``): a kept call by its in-call path."""
        out = output if type(output) is np.ndarray else _host(output)
        inp = input if type(input) is np.ndarray else _host(input)
        if out is None or inp is None or type(op) is not _KIND or type(async_op) is not bool:
            return LATER
        pg = _CURRENT.get().default_pg if group is None else _now_group(group)
        if pg is None:
            return LATER
        hit = pg.hot.get((name, op, out.dtype, out.shape, inp.dtype, inp.shape))
        if hit is None or hit.quick is None:
            return LATER
        flags = out.flags
        if not (flags.writeable and flags.c_contiguous and inp.flags.c_contiguous):
            return LATER
        return _now(pg, name, hit.quick.reduce_scatter, out.reshape(-1), (inp.reshape(-1), hit.fold), [output], hit.described, async_op)

    return first_step


@on_world_loop_now(_reduce_scatter_now("reduce_scatter_tensor"))
async def reduce_scatter_tensor(
    output: Any, input: Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """``input`` is the concatenation (or stack) of every rank's part; ``output`` gets this rank's, reduced."""
    return await _reduce_scatter_one("reduce_scatter_tensor", output, input, op, group, async_op)


@on_world_loop_now(_reduce_scatter_now("reduce_scatter_single"))
async def reduce_scatter_single(
    output: Any, input: Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """The newer name of ``reduce_scatter_tensor``."""
    return await _reduce_scatter_one("reduce_scatter_single", output, input, op, group, async_op)


async def _reduce_scatter_one(name: str, output: Any, input: Any, op: ReduceOpLike, group: GroupArg, async_op: bool) -> Work | None:
    if not_member(group, name):
        return None
    pg = resolve_group(group, what=name)
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, output, f"{name} output")) is not None:
        return await issue_on_device(dev, pg, name, {"output": output, "input": input, "op": op}, asy)
    out = buf(output, f"{name} output", writable=True)
    inp = buf(input, f"{name} input", writable=False)
    same_dtype([inp], out, f"{name} input")
    _same_size(inp, pg.size() * out.flat.size, f"{name} input (world size x output size)")
    rop, combine = _reduction(op, out.dtype_name, name)
    kept_as = None
    if type(op) is _KIND and (o := _host(output)) is not None and (i := _host(input)) is not None:  # kept for _reduce_scatter_now
        kept_as = (name, op, o.dtype, o.shape, i.dtype, i.shape)
    return await _finish(_issue_reduce_scatter(pg, name, out, _chunks(inp.flat, pg.size()), rop, combine, output, kept_as), asy)


def _issue_reduce_scatter(
    pg: ProcessGroup,
    name: str,
    out: Buffer,
    parts: list[np.ndarray],
    rop: ReduceOp,
    combine: Any,
    output: Any,
    kept_as: tuple[Any, ...] | None = None,
) -> Work:
    """The op (its input in ``parts``, rank q's part at q); ``kept_as``: the key under which the
    call's checks are kept for its first step (``_reduce_scatter_now``)."""
    dtype, n = out.dtype_name, pg.size()
    total = sum(x.nbytes for x in parts)
    r = route(pg, "reduce_scatter", total)  # the total: the same on every rank
    described = describe_call(name, _meta(output=_t(out), op=_opname(rop)))
    if kept_as is not None and rop.op is not _PREMUL and kept_as not in pg.hot:
        q = quick(pg, r.plan, total)
        _keep(pg, kept_as, Prepared(described, r.plan, q, fold=_kept_fold(rop, dtype, n) if q is not None else None))

    async def body(p2p: P2P) -> None:
        mine = parts
        if rop.op is _PREMUL:
            mine = [p.copy() for p in parts]
            for p in mine:
                _premultiply(p, rop, dtype=dtype)
        await r.reduce_scatter(p2p, out.flat, mine, combine)
        _finalize(out.flat, rop, n, dtype=dtype)

    return r.issue(pg, name, body, [output], described=described)


@on_world_loop
async def all_to_all(
    output_tensor_list: Sequence[Any], input_tensor_list: Sequence[Any], group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """``input_tensor_list[j]`` of rank i into ``output_tensor_list[i]`` of rank j (sizes may differ)."""
    if not_member(group, "all_to_all"):
        return None
    pg = resolve_group(group, what="all_to_all")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, input_tensor_list, "all_to_all input_tensor_list")) is not None:
        args = {"output_tensor_list": output_tensor_list, "input_tensor_list": input_tensor_list}
        return await issue_on_device(dev, pg, "all_to_all", args, asy)
    ins = bufs(input_tensor_list, "all_to_all input_tensor_list", pg.size(), writable=False)
    outs = bufs(output_tensor_list, "all_to_all output_tensor_list", pg.size(), writable=True)
    same_dtype(ins, ins[0], "all_to_all input_tensor_list")
    same_dtype(outs, ins[0], "all_to_all output_tensor_list")
    r = pg.rank()
    _same_size(outs[r], ins[r].flat.size, f"all_to_all output_tensor_list[{r}] (what this rank sends itself)")
    return await _finish(_issue_all_to_all(pg, "all_to_all", [o.flat for o in outs], [i.flat for i in ins], list(output_tensor_list)), asy)


def _split_bounds(b: Buffer, sizes: Sequence[int] | None, n: int, what: str) -> tuple[list[tuple[int, int]], int]:
    if len(b.shape) == 0:
        raise ValueError(f"{what} must have at least one dimension to split")
    rows, row = b.shape[0], math.prod(b.shape[1:])
    sizes = split_sizes(rows, sizes, n, what)
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start * row, (start + s) * row))
        start += s
    return bounds, row


@_first_step_of("all_to_all_single")
def _all_to_all_single_now(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: GroupArg = None,
    async_op: bool = False,
) -> Any:
    """all_to_all_single's first step (``_now``): a kept call of even splits by its in-call path."""
    if output_split_sizes is not None or input_split_sizes is not None or type(async_op) is not bool:
        return LATER
    out = output if type(output) is np.ndarray else _host(output)
    inp = input if type(input) is np.ndarray else _host(input)
    if out is None or inp is None:
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    if pg is None:
        return LATER
    hit = pg.hot.get((_ALL_TO_ALL, out.dtype, out.shape, inp.dtype, inp.shape))
    if hit is None or hit.quick is None:
        return LATER
    flags = out.flags
    if not (flags.writeable and flags.c_contiguous and inp.flags.c_contiguous):
        return LATER
    return _now(pg, _ALL_TO_ALL, hit.quick.all_to_all, out.reshape(-1), inp.reshape(-1), [output], hit.described, async_op)


@on_world_loop_now(_all_to_all_single_now)
async def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: GroupArg = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 (``input_split_sizes`` or equally), send part j to rank j, and
    concatenate what arrives into ``output`` (``output_split_sizes`` or equally)."""
    if not_member(group, "all_to_all_single"):
        return None
    pg = resolve_group(group, what="all_to_all_single")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, input, "all_to_all_single input")) is not None:
        args = {"output": output, "input": input, "output_split_sizes": output_split_sizes, "input_split_sizes": input_split_sizes}
        return await issue_on_device(dev, pg, "all_to_all_single", args, asy)
    out = buf(output, "all_to_all_single output", writable=True)
    inp = buf(input, "all_to_all_single input", writable=False)
    same_dtype([out], inp, "all_to_all_single output")
    n = pg.size()
    ib, irow = _split_bounds(inp, input_split_sizes, n, "all_to_all_single input")
    ob, orow = _split_bounds(out, output_split_sizes, n, "all_to_all_single output")
    if irow != orow and inp.flat.size and out.flat.size:
        raise ValueError(f"all_to_all_single: input rows have {irow} elements, output rows {orow}")
    r = pg.rank()
    if ib[r][1] - ib[r][0] != ob[r][1] - ob[r][0]:
        raise ValueError(f"all_to_all_single: this rank sends itself {ib[r][1] - ib[r][0]} elements but expects {ob[r][1] - ob[r][0]}")
    ins = [inp.flat[a:b] for a, b in ib]
    outs = [out.flat[a:b] for a, b in ob]
    kept_as = None
    if output_split_sizes is None and input_split_sizes is None and (o := _host(output)) is not None and (i := _host(input)) is not None:
        if o.flags.c_contiguous and i.flags.c_contiguous and o.size == i.size:  # kept for _all_to_all_single_now
            kept_as = (_ALL_TO_ALL, o.dtype, o.shape, i.dtype, i.shape)
    return await _finish(_issue_all_to_all(pg, "all_to_all_single", outs, ins, [output], kept_as), asy)


def _issue_all_to_all(
    pg: ProcessGroup, name: str, outs: list[np.ndarray], ins: list[np.ndarray], outputs: list[Any], kept_as: tuple[Any, ...] | None = None
) -> Work:
    """The op; ``kept_as``: the key under which an even call's checks are kept for its first
    step (``_all_to_all_single_now``)."""
    total = sum(x.nbytes for x in ins)
    r = route(pg, "all_to_all", total, part=len(ins))
    described = describe_call(name, _meta(dtype=str(ins[0].dtype) if ins else "?"))
    if kept_as is not None and kept_as not in pg.hot:
        _keep(pg, kept_as, Prepared(described, r.plan, quick(pg, r.plan, total, op="all_to_all")))

    async def body(p2p: P2P) -> None:
        await r.all_to_all(p2p, outs, ins)

    return r.issue(pg, name, body, outputs, described=described)


@_first_step_of("barrier")
def _barrier_now(group: GroupArg = None, async_op: bool = False, device_ids: Any = None) -> Any:
    """barrier's first step (``_now``): a kept call by its in-call path."""
    if type(async_op) is not bool:
        return LATER
    pg = _CURRENT.get().default_pg if group is None else _now_group(group)
    hit = None if pg is None else pg.hot.get(_BARRIER)
    if pg is None or hit is None or hit.quick is None:
        return LATER
    return _now(pg, "barrier", hit.quick.barrier, None, None, [], hit.described, async_op)


@on_world_loop_now(_barrier_now)
async def barrier(group: GroupArg = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Return once every rank of the group has entered (``device_ids`` is ignored on CPU)."""
    pg = _default_or(group, "barrier")
    if pg is None:
        return None
    asy = check_async_op(async_op)
    if pg.host_refusal is not None and pg.devices:  # no CPU backend ("nccl" alone): a device barrier
        return await issue_on_device(next(iter(pg.devices.values())), pg, "barrier", {"device_ids": device_ids}, asy)
    hit = pg.hot.get(_BARRIER)
    r = route(pg, "barrier", 0)
    if hit is None:
        hit = Prepared(describe_call("barrier", _NO_META), r.plan, quick(pg, r.plan, 0))
        _keep(pg, _BARRIER, hit)

    async def body(p2p: P2P) -> None:
        await r.barrier(p2p)

    return await _finish(r.issue(pg, "barrier", body, [], described=hit.described), asy)


# -- coalesced ops ----------------------------------------------------------------------------


def _list(objs: object, what: str) -> Sequence[Any]:
    if isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
        raise TypeError(f"{what} must be a list, not {type(objs).__name__}")
    if not objs:
        raise ValueError(f"{what} is empty")
    return objs


@on_world_loop
async def all_reduce_coalesced(
    tensors: Sequence[Any] | Any, op: ReduceOpLike = ReduceOp.SUM, group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """Reduce every tensor of ``tensors`` (a list, or one tensor) across the group as one op: one
    flattened buffer per dtype, reduced in the order the dtypes first appear, the results copied
    back in place (bitwise identical on every rank). The dtypes may differ, as in torch (which
    reduces ``[float, float, cfloat]``): complex tensors under SUM, AVG and PREMUL_SUM travel as
    their real and imaginary parts, so they join the buffer of their parts' dtype."""
    if not_member(group, "all_reduce_coalesced"):
        return None
    pg = resolve_group(group, what="all_reduce_coalesced")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, tensors, "all_reduce_coalesced tensors")) is not None:
        return await issue_on_device(dev, pg, "all_reduce_coalesced", {"tensors": tensors, "op": op}, asy)
    ts = [tensors] if isinstance(tensors, np.ndarray) or is_torch_tensor(tensors) else _list(tensors, "all_reduce_coalesced tensors")
    bs = [buf(t, f"all_reduce_coalesced tensors[{i}]", writable=True) for i, t in enumerate(ts)]
    rop = to_reduce_op(op)
    by_parts = rop.op in (ReduceOp.RedOpType.SUM, ReduceOp.RedOpType.AVG, ReduceOp.RedOpType.PREMUL_SUM)
    for b in bs:  # a complex refusal first, in torch's words ("all_reduce does not support"), whatever the other tensors are
        if b.flat.dtype.kind == "c":
            check_reduce(rop, b.dtype_name, "all_reduce")
    buckets: dict[str, list[np.ndarray]] = {}  # dtype -> the flat arrays reduced in its buffer
    for b in bs:
        flat, name = b.flat, b.dtype_name
        if by_parts and flat.dtype.kind == "c":  # elementwise on the parts is the complex result
            flat = flat.view(flat.real.dtype)
            name = flat.dtype.name
        buckets.setdefault(name, []).append(flat)
    plans = [(name, flats, _reduction(rop, name, "all_reduce_coalesced")[1]) for name, flats in buckets.items()]
    n, th = pg.size(), pg.thresholds

    async def body(p2p: P2P) -> None:
        for k, (name, flats, combine) in enumerate(plans):
            joined = np.concatenate(flats) if len(flats) > 1 else flats[0]  # one tensor: reduced in place, no copies
            _premultiply(joined, rop, dtype=name)
            await alg.all_reduce(p2p if k == 0 else SubP2P(p2p, k), joined, combine, thresholds=th)
            _finalize(joined, rop, n, dtype=name)
            if len(flats) > 1:
                at = 0
                for f in flats:
                    np.copyto(f, joined[at : at + f.size])
                    at += f.size

    return await _finish(pg.issue("all_reduce_coalesced", body, list(ts), meta=_meta(tensors=[_t(b) for b in bs], op=_opname(rop))), asy)


@on_world_loop
async def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Any]], input_tensor_list: Sequence[Any], group: GroupArg = None, async_op: bool = False
) -> Work | None:
    """``all_gather`` of every tensor of ``input_tensor_list`` as one op, torch's layout:
    ``output_tensor_lists[r][i]`` receives rank r's ``input_tensor_list[i]``. The tensors may
    have different dtypes (each output's dtype must be its input's); one message per peer."""
    if not_member(group, "all_gather_coalesced"):
        return None
    pg = resolve_group(group, what="all_gather_coalesced")
    asy = check_async_op(async_op)
    if (dev := device_backend(pg, input_tensor_list, "all_gather_coalesced input_tensor_list")) is not None:
        args = {"output_tensor_lists": output_tensor_lists, "input_tensor_list": input_tensor_list}
        return await issue_on_device(dev, pg, "all_gather_coalesced", args, asy)
    ins = [
        buf(t, f"all_gather_coalesced input_tensor_list[{i}]", writable=False)
        for i, t in enumerate(_list(input_tensor_list, "all_gather_coalesced input_tensor_list"))
    ]
    lists = _list(output_tensor_lists, "all_gather_coalesced output_tensor_lists")
    n, me = pg.size(), pg.rank()
    if len(lists) != n:
        raise ValueError(f"all_gather_coalesced: output_tensor_lists has {len(lists)} lists, the group has {n} ranks (one list per rank)")
    outs = []
    for r, lst in enumerate(lists):
        row = _list(lst, f"all_gather_coalesced output_tensor_lists[{r}]")
        if len(row) != len(ins):
            raise ValueError(f"all_gather_coalesced: output_tensor_lists[{r}] has {len(row)} tensors, input_tensor_list {len(ins)}")
        outs.append([buf(t, f"all_gather_coalesced output_tensor_lists[{r}][{i}]", writable=True) for i, t in enumerate(row)])
    for r, row in enumerate(outs):
        for i, (o, inp) in enumerate(zip(row, ins, strict=True)):
            if o.dtype_name != inp.dtype_name:
                raise TypeError(
                    f"all_gather_coalesced output_tensor_lists[{r}][{i}] is {o.dtype_name}, expected {inp.dtype_name} (input_tensor_list[{i}]'s dtype)"
                )
    for i, (o, inp) in enumerate(zip(outs[me], ins, strict=True)):
        _same_size(o, inp.flat.size, f"all_gather_coalesced output_tensor_lists[{me}][{i}] (this rank's own slot)")
    in_bytes = [byte_view(b.flat) for b in ins]
    out_bytes = [[byte_view(b.flat, writable=True) for b in row] for row in outs]
    sizes = [sum(x.nbytes for x in row) for row in out_bytes]
    th = pg.thresholds

    async def body(p2p: P2P) -> None:
        mine = np.concatenate(in_bytes) if len(in_bytes) > 1 else in_bytes[0]
        chunks = [mine if r == me else np.empty(sizes[r], np.uint8) for r in range(n)]
        await alg.all_gather(p2p, chunks, mine, thresholds=th)
        for r in range(n):
            at = 0
            for dst in out_bytes[r]:
                np.copyto(dst, chunks[r][at : at + dst.size])
                at += dst.size

    return await _finish(
        pg.issue(
            "all_gather_coalesced", body, [list(row) for row in lists], meta=_meta(count=len(ins), local={"inputs": [_t(b) for b in ins]})
        ),
        asy,
    )


# -- monitored_barrier --------------------------------------------------------------------------

_ARRIVE, _RELEASE = 0, 1


def _late_verdict(late: Sequence[int], ranks: Sequence[int], seconds: float) -> str:
    """Rank 0's verdict in torch's words: ``[Rank 0]: Rank 1 failed to pass monitoredBarrier in
    2000 ms`` (``Ranks 1, 3`` for ``wait_all_ranks``; group ranks, as torch's), then the global
    ranks where they differ and the word "timeout" that user code matches."""
    who = f"Ranks {', '.join(map(str, late))}" if len(late) > 1 else f"Rank {late[0]}"
    glob = [ranks[r] for r in late]
    extra = "" if glob == list(late) else f" (global rank{'s' if len(glob) > 1 else ''} {', '.join(map(str, glob))})"
    return f"[Rank 0]: {who} failed to pass monitoredBarrier in {round(seconds * 1000)} ms{extra}; monitored_barrier timeout {seconds:g} s"


@on_world_loop
async def monitored_barrier(group: GroupArg = None, timeout: TimeoutLike | None = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive (torch's): every rank reports to group
    rank 0, which waits up to ``timeout`` (default: the group's) and then releases them all. If
    some rank did not arrive in time, rank 0 raises ``DistTimeoutError`` naming it (with
    ``wait_all_ranks=True``: naming all of them), the group breaks, and the other ranks fail at
    once with rank 0's reason (or, if rank 0 itself never came, at their own deadline, naming 0)."""
    if not_member(group, "monitored_barrier"):
        return None
    pg = resolve_group(group, what="monitored_barrier")
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"wait_all_ranks must be a bool, not {type(wait_all_ranks).__name__}")
    seconds = pg.timeout_s if timeout is None else to_seconds(timeout)
    if not seconds > 0:
        raise ValueError(f"monitored_barrier: timeout must be > 0 seconds, got {seconds!r}")
    ranks = pg.ranks

    async def body(p2p: P2P) -> None:
        p = p2p.size
        if p == 1:
            return
        token = np.zeros(1, np.uint8)
        if p2p.rank != 0:
            await p2p.send(0, token, _ARRIVE)
            await p2p.recv(0, np.empty(1, np.uint8), _RELEASE)
            return
        tasks = {asyncio.ensure_future(p2p.recv(r, np.empty(1, np.uint8), _ARRIVE)): r for r in range(1, p)}
        try:
            await asyncio.wait(tasks, timeout=seconds)
        finally:
            late = sorted(r for t, r in tasks.items() if not t.done() or t.cancelled() or t.exception() is not None)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if late:
            # the body's own ruling: the group's deadline did not fire, so the runner reports it as is
            raise DistTimeoutError(_late_verdict(late if wait_all_ranks else late[:1], ranks, seconds))
        await asyncio.gather(*(p2p.send(r, token, _RELEASE) for r in range(1, p)))

    # rank 0 decides at ``seconds``; the others wait a little longer, so that rank 0's verdict
    # (which names the late ranks) reaches them before their own deadline fires; the group's
    # deadline is the limit less the runner's grace (at most 10 %), still after ``seconds``
    limit = seconds * 1.12 + 0.1 if pg.rank() == 0 else seconds * 1.25 + 0.5
    await pg.issue("monitored_barrier", body, [], timeout_s=limit, meta=_NO_META)
