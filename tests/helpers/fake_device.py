"""A fake "cuda" device for tests of the device dispatch (tests/test_device_dispatch.py): no GPU,
no CuPy. ``FakeArray`` wraps a numpy array and exports ``__cuda_array_interface__`` (so
``aiodist.backends.device.device_type`` says "cuda"); ``FakeGPU`` is a ``DeviceBackend`` that runs
every op for real on the wrapped numpy arrays of all ranks of one ``run_world`` (its ranks are
tasks of one loop: they meet in a ``Hub`` shared through the World's store), through
``ProcessGroup.issue_device``, and records every call, abort and close.

Register it once per session with ``register_fakegpu()``: the backend registry is class state.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiodist.backends.device import DeviceBackend
from aiodist.c10d.backend_registry import Backend
from aiodist.c10d.work import Work
from aiodist.errors import DistBackendError
from aiodist.types import ReduceOp

__all__ = ["FakeArray", "FakeGPU", "Call", "Hub", "hub_for", "register_fakegpu", "dev", "host"]

NAME = "fakegpu"


class FakeArray:
    """A numpy array "in cuda memory"."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = np.array(data)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.data.shape, "typestr": self.data.dtype.str, "data": (self.data.ctypes.data, False), "version": 3}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    def __repr__(self) -> str:
        return f"FakeArray({self.data!r})"


def dev(values: Any, dtype: str = "float64") -> FakeArray:
    return FakeArray(np.asarray(values, dtype=dtype))


def host(x: FakeArray | list[FakeArray]) -> Any:
    """The numpy values behind fake arrays (a list stays a list)."""
    if isinstance(x, list):
        return [host(v) for v in x]
    return x.data.copy()


@dataclass
class Call:
    """One ``issue`` of the fake backend: op, group, args, and the seqs issue_device gave it."""

    op: str
    group_id: int
    group_ranks: tuple[int, ...]
    args: dict[str, Any]
    seqs: list[int] = field(default_factory=list)


class _Meeting:
    """One collective (group id, seq) of one World: each group rank's input snapshot."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inputs: dict[int, Any] = {}
        self.all_in = asyncio.Event()
        self.left = 0


class Hub:
    """The shared state of one World's fake devices: meetings of collectives and p2p messages."""

    def __init__(self) -> None:
        self.meetings: dict[tuple[int, int], _Meeting] = {}
        self.messages: list[tuple[int, int, int, int, np.ndarray]] = []  # (group, src, dst, tag, data)
        self.posted = asyncio.Condition()
        self.backends: dict[int, FakeGPU] = {}
        self.fail_connect = False  # connect() (init_process_group's eager mode) raises

    async def meet(self, group_id: int, seq: int, n: int, me: int, value: Any) -> dict[int, Any]:
        m = self.meetings.setdefault((group_id, seq), _Meeting(n))
        m.inputs[me] = value
        if len(m.inputs) == n:
            m.all_in.set()
        await m.all_in.wait()
        m.left += 1
        if m.left == n:
            del self.meetings[(group_id, seq)]
        return m.inputs


_HUBS: weakref.WeakKeyDictionary[Any, Hub] = weakref.WeakKeyDictionary()


def _combine(op: Any, parts: list[np.ndarray]) -> np.ndarray:
    kind = str(op).rsplit(".", 1)[-1].upper()
    stack = np.stack(parts)
    if "SUM" in kind:
        return stack.sum(axis=0)
    if "MAX" in kind:
        return stack.max(axis=0)
    if "MIN" in kind:
        return stack.min(axis=0)
    if "PRODUCT" in kind:
        return stack.prod(axis=0)
    raise DistBackendError(f"fakegpu: reduce op {op} is not supported")


def _d(x: Any) -> np.ndarray:
    if not isinstance(x, FakeArray):
        raise TypeError(f"fakegpu takes FakeArray, not {type(x).__name__}")
    return x.data


def _snap(x: Any) -> np.ndarray:
    return _d(x).copy()


def _put(out: Any, value: np.ndarray) -> None:
    _d(out)[...] = np.asarray(value).reshape(_d(out).shape)


# -- each op: what a rank contributes (a snapshot), and what it writes once all are in ------------


def _inputs(op: str, a: dict[str, Any], me: int) -> Any:
    if op in ("all_reduce", "reduce", "broadcast"):
        return _snap(a["tensor"])
    if op in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        return _snap(a["tensor"] if op == "all_gather" else a["input_tensor"])
    if op == "gather":
        return _snap(a["tensor"])
    if op == "scatter":
        return [_snap(t) for t in a["scatter_list"]] if a.get("scatter_list") else None
    if op == "reduce_scatter":
        return [_snap(t) for t in a["input_list"]]
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _snap(a["input"])
    if op == "all_to_all":
        return [_snap(t) for t in a["input_tensor_list"]]
    if op == "all_to_all_single":
        return _snap(a["input"])
    if op == "all_reduce_coalesced":
        ts = a["tensors"] if isinstance(a["tensors"], list) else [a["tensors"]]
        return [_snap(t) for t in ts]
    if op == "all_gather_coalesced":
        return [_snap(t) for t in a["input_tensor_list"]]
    if op == "barrier":
        return None
    raise DistBackendError(f"fakegpu: unknown op {op!r}")


def _outputs(op: str, a: dict[str, Any], me: int, n: int, got: dict[int, Any]) -> None:
    rop = a.get("op", ReduceOp.SUM)
    if op == "all_reduce":
        _put(a["tensor"], _combine(rop, [got[r] for r in range(n)]))
    elif op == "reduce":
        if me == a["root"]:
            _put(a["tensor"], _combine(rop, [got[r] for r in range(n)]))
    elif op == "broadcast":
        _put(a["tensor"], got[a["root"]])
    elif op == "all_gather":
        for r in range(n):
            _put(a["tensor_list"][r], got[r])
    elif op in ("all_gather_into_tensor", "all_gather_single"):
        _put(a["output_tensor"], np.concatenate([got[r].ravel() for r in range(n)]))
    elif op == "gather":
        if me == a["root"]:
            for r in range(n):
                _put(a["gather_list"][r], got[r])
    elif op == "scatter":
        _put(a["tensor"], got[a["root"]][me])
    elif op == "reduce_scatter":
        _put(a["output"], _combine(rop, [got[r][me] for r in range(n)]))
    elif op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        _put(a["output"], _combine(rop, [np.array_split(got[r].ravel(), n)[me] for r in range(n)]))
    elif op == "all_to_all":
        for r in range(n):
            _put(a["output_tensor_list"][r], got[r][me])
    elif op == "all_to_all_single":
        _put(a["output"], np.concatenate([np.array_split(got[r].ravel(), n)[me] for r in range(n)]))
    elif op == "all_reduce_coalesced":
        ts = a["tensors"] if isinstance(a["tensors"], list) else [a["tensors"]]
        for i, t in enumerate(ts):
            _put(t, _combine(rop, [got[r][i] for r in range(n)]))
    elif op == "all_gather_coalesced":
        for r in range(n):
            for i, t in enumerate(a["output_tensor_lists"][r]):
                _put(t, got[r][i])


class FakeGPU(DeviceBackend):
    """A device backend over ``FakeArray``s. ``hang`` holds ops whose body never finishes."""

    name = NAME
    device_type = "cuda"

    def __init__(self, rank: int, world_size: int, hub: Hub) -> None:
        super().__init__(rank, world_size)
        self.hub = hub
        self.calls: list[Call] = []
        self.aborts: list[tuple[int, str]] = []
        self.connects: list[tuple[int, Any]] = []
        self.closes = 0
        self.hang: set[str] = set()

    def calls_of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    async def issue(self, pg: Any, op: str, args: dict[str, Any]) -> Any:
        call = Call(op, pg.group_id, tuple(pg.ranks), args)
        self.calls.append(call)
        if op == "p2p":
            return [self._p2p(pg, call, one) for one in args["ops"]]
        me, n = pg.rank(), pg.size()
        mine = _inputs(op, args, me)  # checks the arrays (TypeError): nothing issued on a bad call
        seq_box: list[int] = []

        def make_work(op_: str, desc: str, seq: int) -> Work:
            seq_box.append(seq)
            call.seqs.append(seq)
            return Work(op_, desc, seq, [])

        async def body() -> None:
            if op in self.hang:
                await asyncio.Event().wait()  # never set: only the group's timeout ends it
            got = await self.hub.meet(pg.group_id, seq_box[0], n, me, mine)
            _outputs(op, args, me, n, got)

        return pg.issue_device(op, body, make_work, meta={"same": {}})

    def _p2p(self, pg: Any, call: Call, one: dict[str, Any]) -> Work:
        hub, gid, me = self.hub, pg.group_id, pg.rank()
        sending, peer, tag, tensor = one["sending"], one["peer"], one["tag"], one["tensor"]
        data = _snap(tensor) if sending else _d(tensor)
        box: list[Work] = []

        def make_work(op_: str, desc: str, seq: int) -> Work:
            call.seqs.append(seq)
            w = Work(op_, desc, seq, [], source_rank=None if sending else -1)
            box.append(w)
            return w

        async def body() -> None:
            if one["op"] in self.hang:
                await asyncio.Event().wait()
            async with hub.posted:
                if sending:
                    hub.messages.append((gid, me, peer, tag, data))
                    hub.posted.notify_all()
                    return

                def match() -> int | None:
                    for i, (g, src, dst, t, _) in enumerate(hub.messages):
                        if g == gid and dst == me and t == tag and (peer is None or src == peer):
                            return i
                    return None

                await hub.posted.wait_for(lambda: match() is not None)
                i = match()
                assert i is not None
                _, src, _, _, payload = hub.messages.pop(i)
                data[...] = payload.reshape(data.shape)
                box[0]._source_rank = pg.ranks[src]

        return pg.issue_device(one["op"], body, make_work, meta={"same": {}}, p2p=True)

    async def connect(self, pg: Any, device_id: Any = None) -> None:
        self.connects.append((pg.group_id, device_id))
        if self.hub.fail_connect:
            raise DistBackendError(f"fakegpu: rank {self.rank} cannot make the communicator of group {pg.group_id}")

    def abort_group(self, group_id: int, reason: str) -> None:
        self.aborts.append((group_id, reason))

    async def close(self) -> None:
        self.closes += 1


def hub_for(store: Any) -> Hub:
    """The Hub of the World initialised with ``store`` (made on first use)."""
    hub = _HUBS.get(store)
    if hub is None:
        hub = _HUBS[store] = Hub()
    return hub


async def _create(store: Any, rank: int, world_size: int, timeout: Any) -> FakeGPU:
    hub = hub_for(store)
    made = FakeGPU(rank, world_size, hub)
    hub.backends[rank] = made
    return made


def register_fakegpu() -> None:
    """Register backend "fakegpu" (serving "cuda") once per process."""
    if NAME not in Backend._plugins:
        Backend.register_backend(NAME, _create, devices=["cuda"])
