"""The NCCL backend's ops: each checks its arguments on the loop (TypeError/ValueError, nothing
enqueued) and returns a ``Plan`` whose ``launch(comm, stream)`` the launcher thread runs: the NCCL
calls (grouped send/recv where NCCL has no single call, ``aiodist_cuda._plans``) and the local
copies, on the group's stream. Also the array checks and PREMUL_SUM's NCCL op (ctypes).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodist.errors import DistBackendError
from aiodist_cuda._plans import Part, exchange_plan, split_bounds
from aiodist_cuda._tables import Wire, nccl_error_name, nccl_op, wire_dtype

__all__ = ["BUILDERS", "SUPPORTED_OPS", "Checker", "Plan", "premul"]

_D2D = 3  # cudaMemcpyDeviceToDevice

# -- arrays ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Arr:
    """A checked device array: the CuPy array, its NCCL type, pointer, and size in NCCL elements."""

    a: Any
    wire: Wire
    dtype: str
    ptr: int
    count: int  # NCCL elements
    device: int
    itemsize: int  # bytes per NCCL element


def _dtype_name(a: Any) -> str:
    return str(a.dtype.name) if hasattr(a.dtype, "name") else str(a.dtype)


class Checker:
    """Argument checks on device arrays (on the loop, at issue; nothing is enqueued on failure)."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def arr(self, obj: object, what: str, *, writable: bool) -> _Arr:
        cupy = self.cupy
        if isinstance(obj, cupy.ndarray):
            a = obj
        elif hasattr(type(obj), "__cuda_array_interface__"):
            a = cupy.asarray(obj)  # a zero-copy view of a torch CUDA tensor, numba array, ...
        else:
            raise TypeError(
                f"{what} must be a CuPy array (or export __cuda_array_interface__), not {type(obj).__module__}.{type(obj).__qualname__}"
            )
        name = _dtype_name(a)
        wire = wire_dtype(name, what)
        if not a.flags.c_contiguous:
            if writable:
                raise ValueError(
                    f"{what} is not contiguous (shape {a.shape}, strides {a.strides}), but it is an output written in place; pass a contiguous array"
                )
            a = cupy.ascontiguousarray(a)  # on the caller's stream, before the op's ready event
        itemsize = a.dtype.itemsize // wire.per_element
        return _Arr(a, wire, name, int(a.data.ptr), int(a.size) * wire.per_element, int(a.device.id), itemsize)

    def arrs(self, objs: object, what: str, n: int | None, *, writable: bool) -> list[_Arr]:
        if isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
            raise TypeError(f"{what} must be a list of arrays, not {type(objs).__name__}")
        if n is not None and len(objs) != n:
            raise ValueError(f"{what} has {len(objs)} arrays, the group has {n} ranks")
        return [self.arr(x, f"{what}[{i}]", writable=writable) for i, x in enumerate(objs)]


def _same(items: Sequence[_Arr], ref: _Arr, what: str, *, size: bool = True) -> None:
    for i, x in enumerate(items):
        if x.dtype != ref.dtype:
            raise TypeError(f"{what}[{i}] is {x.dtype}, expected {ref.dtype}")
        if size and x.count != ref.count:
            raise ValueError(f"{what}[{i}] has {x.a.size} elements, expected {ref.a.size}")


# -- PREMUL_SUM through NCCL's own op --------------------------------------------------------------


class _PreMul:
    """``ncclRedOpCreatePreMulSum`` / ``ncclRedOpDestroy`` through ctypes on the process's libnccl
    (CuPy does not wrap them). Chosen over nccl4py: no extra dependency, and the op is made on
    the very communicator CuPy holds (``NcclCommunicator.comm`` is its raw handle)."""

    def __init__(self) -> None:
        self.lib: Any = None
        self.error = ""
        for name in self._candidates():
            try:
                lib = ctypes.CDLL(name)
                lib.ncclRedOpCreatePreMulSum.restype = ctypes.c_int
                lib.ncclRedOpDestroy.restype = ctypes.c_int
                self.lib = lib
                return
            except (OSError, AttributeError) as exc:
                self.error = f"{name}: {exc}"

    @staticmethod
    def _candidates() -> list[str]:
        names = ["libnccl.so.2"]  # already loaded by CuPy: dlopen finds it by its soname
        try:
            import nvidia.nccl  # the nvidia-nccl-cu12 wheel

            for base in getattr(nvidia.nccl, "__path__", []):
                names.append(os.path.join(base, "lib", "libnccl.so.2"))
        except ImportError:
            pass
        return names

    def create(self, comm_handle: int, factor: float, arr: _Arr) -> int:
        if self.lib is None:
            raise DistBackendError(f"ReduceOp.PREMUL_SUM: NCCL's ncclRedOpCreatePreMulSum could not be loaded ({self.error})")
        if arr.dtype == "bfloat16":
            from aiodist.types import float32_to_bfloat16

            scalar = float32_to_bfloat16(np.array([factor], dtype=np.float32))
        else:
            scalar = np.array([factor], dtype=np.dtype(arr.dtype))
        op = ctypes.c_int(0)
        status = self.lib.ncclRedOpCreatePreMulSum(
            ctypes.byref(op),
            scalar.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int(arr.wire.nccl),
            ctypes.c_int(1),
            ctypes.c_void_p(comm_handle),
        )  # 1: ncclScalarHostImmediate (the value is read now)
        if status != 0:
            raise DistBackendError(f"ncclRedOpCreatePreMulSum failed: {nccl_error_name(status)}")
        return int(op.value)

    def destroy(self, op: int, comm_handle: int) -> None:
        if self.lib is not None:
            self.lib.ncclRedOpDestroy(ctypes.c_int(op), ctypes.c_void_p(comm_handle))


_PREMUL: list[_PreMul] = []


def premul() -> _PreMul:
    if not _PREMUL:
        _PREMUL.append(_PreMul())
    return _PREMUL[0]


# -- the ops: each checks its arguments on the loop and returns a plan ---------------------------------


@dataclass
class Plan:
    launch: Callable[[Any, Any], None]
    keep: list[Any]
    outputs: list[Any]
    device: int | None
    meta: dict[str, Any]
    p2p: list[tuple[str, Any, int | None]] | None = None


def _dev(arrs: Sequence[_Arr], what: str) -> int | None:
    devs = {a.device for a in arrs}
    if len(devs) > 1:
        raise ValueError(f"{what}: arrays on several devices ({sorted(devs)}); one device per rank")
    return next(iter(devs), None)


def _meta(op: str, **same: Any) -> dict[str, Any]:
    return {"same": same}


def _t(a: _Arr) -> str:
    return f"{a.dtype}{list(a.a.shape)}"


def _op_call(be: Any, op: object, ref: _Arr, what: str, call: Callable[[Any, Any, int], None]) -> Callable[[Any, Any], None]:
    """A launch that runs ``call(comm, stream, nccl_op)``, with PREMUL_SUM's op made (and
    destroyed after the call) on the communicator."""
    nop, factor = nccl_op(op, ref.dtype, what)
    if factor is None:
        return lambda comm, stream: call(comm, stream, nop)

    def launch(comm: Any, stream: Any) -> None:
        pm = premul()
        handle = int(comm.comm)
        made = pm.create(handle, factor, ref)
        try:
            call(comm, stream, made)
        finally:
            pm.destroy(made, handle)

    return launch


def _b_all_reduce(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    t = be.check.arr(args["tensor"], "all_reduce tensor", writable=True)

    def call(comm: Any, stream: Any, nop: int) -> None:
        comm.allReduce(t.ptr, t.ptr, t.count, t.wire.nccl, nop, stream.ptr)

    return Plan(_op_call(be, args["op"], t, "all_reduce", call), [t.a], [args["tensor"]], t.device, _meta("all_reduce", tensor=_t(t)))


def _b_broadcast(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    root = args["root"]
    t = be.check.arr(args["tensor"], "broadcast tensor", writable=pg.rank() != root)

    def launch(comm: Any, stream: Any) -> None:
        comm.broadcast(t.ptr, t.ptr, t.count, t.wire.nccl, root, stream.ptr)

    return Plan(launch, [t.a], [args["tensor"]], t.device, _meta("broadcast", tensor=_t(t), root=root))


def _b_reduce(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    root = args["root"]
    t = be.check.arr(args["tensor"], "reduce tensor", writable=True)

    def call(comm: Any, stream: Any, nop: int) -> None:
        comm.reduce(t.ptr, t.ptr, t.count, t.wire.nccl, nop, root, stream.ptr)

    return Plan(_op_call(be, args["op"], t, "reduce", call), [t.a], [args["tensor"]], t.device, _meta("reduce", tensor=_t(t), root=root))


def _copy(dst: _Arr, dst_off: int, src: _Arr, src_off: int, count: int, stream: Any, cupy: Any) -> None:
    """``count`` NCCL elements from ``src`` to ``dst`` on ``stream`` (a device-to-device copy)."""
    if count:
        n = count * src.itemsize
        cupy.cuda.runtime.memcpyAsync(dst.ptr + dst_off * dst.itemsize, src.ptr + src_off * src.itemsize, n, _D2D, stream.ptr)


def _grouped(
    be: Any, sends: list[tuple[_Arr, Part]], recvs: list[tuple[_Arr, Part]], copies: list[tuple[_Arr, int, _Arr, int, int]]
) -> Callable[[Any, Any], None]:
    """One grouped NCCL call of sends and receives, plus local copies on the same stream."""
    nccl, cupy = be.nccl, be.cupy

    def launch(comm: Any, stream: Any) -> None:
        for dst, doff, src, soff, cnt in copies:
            _copy(dst, doff, src, soff, cnt, stream, cupy)
        if not sends and not recvs:
            return
        nccl.groupStart()
        try:
            for a, p in sends:
                comm.send(a.ptr + p.offset * a.itemsize, p.count, a.wire.nccl, p.peer, stream.ptr)
            for a, p in recvs:
                comm.recv(a.ptr + p.offset * a.itemsize, p.count, a.wire.nccl, p.peer, stream.ptr)
        finally:
            nccl.groupEnd()

    return launch


def _b_all_gather(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me = pg.size(), pg.rank()
    inp = be.check.arr(args["tensor"], "all_gather tensor", writable=False)
    outs = be.check.arrs(args["tensor_list"], "all_gather tensor_list", n, writable=True)
    _same(outs, inp, "all_gather tensor_list", size=False)
    if outs[me].count != inp.count:
        raise ValueError(f"all_gather: tensor_list[{me}] (this rank's) has {outs[me].a.size} elements, the input has {inp.a.size}")
    # uneven sizes are fine: one grouped call, every rank's input to every other rank
    sends = [(inp, Part(j, 0, inp.count)) for j in range(n) if j != me]
    recvs = [(outs[j], Part(j, 0, outs[j].count)) for j in range(n) if j != me]
    launch = _grouped(be, sends, recvs, [(outs[me], 0, inp, 0, inp.count)])
    return Plan(
        launch,
        [inp.a] + [o.a for o in outs],
        list(args["tensor_list"]),
        _dev([inp, *outs], "all_gather"),
        _meta("all_gather", dtype=inp.dtype),
    )


def _b_all_gather_one(op: str) -> Callable[[Any, Any, dict[str, Any]], Plan]:
    def build(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
        n = pg.size()
        inp = be.check.arr(args["input_tensor"], f"{op} input_tensor", writable=False)
        out = be.check.arr(args["output_tensor"], f"{op} output_tensor", writable=True)
        _same([out], inp, f"{op} output_tensor", size=False)
        if out.count != inp.count * n:
            raise ValueError(f"{op}: output_tensor has {out.a.size} elements, expected {inp.a.size} x {n} ranks")

        def launch(comm: Any, stream: Any) -> None:
            comm.allGather(inp.ptr, out.ptr, inp.count, inp.wire.nccl, stream.ptr)

        return Plan(launch, [inp.a, out.a], [args["output_tensor"]], _dev([inp, out], op), _meta(op, input=_t(inp)))

    return build


def _b_gather(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me, root = pg.size(), pg.rank(), args["root"]
    inp = be.check.arr(args["tensor"], "gather tensor", writable=False)
    if me == root:
        if args.get("gather_list") is None:
            raise ValueError("gather: the destination rank must pass gather_list")
        outs = be.check.arrs(args["gather_list"], "gather gather_list", n, writable=True)
        _same(outs, inp, "gather gather_list")
        recvs = [(outs[j], Part(j, 0, inp.count)) for j in range(n) if j != me]
        launch = _grouped(be, [], recvs, [(outs[me], 0, inp, 0, inp.count)])
        return Plan(
            launch,
            [inp.a] + [o.a for o in outs],
            list(args["gather_list"]),
            _dev([inp, *outs], "gather"),
            _meta("gather", tensor=_t(inp), root=root),
        )
    if args.get("gather_list"):
        raise ValueError("gather: gather_list is only for the destination rank; pass None on the others")
    launch = _grouped(be, [(inp, Part(root, 0, inp.count))], [], [])
    return Plan(launch, [inp.a], [], inp.device, _meta("gather", tensor=_t(inp), root=root))


def _b_scatter(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me, root = pg.size(), pg.rank(), args["root"]
    out = be.check.arr(args["tensor"], "scatter tensor", writable=True)
    if me == root:
        if args.get("scatter_list") is None:
            raise ValueError("scatter: the source rank must pass scatter_list")
        ins = be.check.arrs(args["scatter_list"], "scatter scatter_list", n, writable=False)
        _same(ins, out, "scatter scatter_list")
        sends = [(ins[j], Part(j, 0, out.count)) for j in range(n) if j != me]
        launch = _grouped(be, sends, [], [(out, 0, ins[me], 0, out.count)])
        return Plan(
            launch,
            [out.a] + [i.a for i in ins],
            [args["tensor"]],
            _dev([out, *ins], "scatter"),
            _meta("scatter", tensor=_t(out), root=root),
        )
    if args.get("scatter_list"):
        raise ValueError("scatter: scatter_list is only for the source rank; pass None on the others")
    launch = _grouped(be, [], [(out, Part(root, 0, out.count))], [])
    return Plan(launch, [out.a], [args["tensor"]], out.device, _meta("scatter", tensor=_t(out), root=root))


def _b_reduce_scatter_one(op: str) -> Callable[[Any, Any, dict[str, Any]], Plan]:
    def build(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
        n = pg.size()
        out = be.check.arr(args["output"], f"{op} output", writable=True)
        inp = be.check.arr(args["input"], f"{op} input", writable=False)
        _same([inp], out, f"{op} input", size=False)
        if inp.count != out.count * n:
            raise ValueError(f"{op}: input has {inp.a.size} elements, expected {out.a.size} x {n} ranks")

        def call(comm: Any, stream: Any, nop: int) -> None:
            comm.reduceScatter(inp.ptr, out.ptr, out.count, out.wire.nccl, nop, stream.ptr)

        return Plan(
            _op_call(be, args["op"], out, op, call), [inp.a, out.a], [args["output"]], _dev([inp, out], op), _meta(op, output=_t(out))
        )

    return build


def _b_reduce_scatter(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n = pg.size()
    out = be.check.arr(args["output"], "reduce_scatter output", writable=True)
    ins = be.check.arrs(args["input_list"], "reduce_scatter input_list", n, writable=False)
    _same(ins, out, "reduce_scatter input_list")
    cupy = be.cupy
    with cupy.cuda.Device(out.device):
        flat = be.check.arr(cupy.empty(out.a.size * n, dtype=out.a.dtype), "reduce_scatter staging", writable=True)

    def call(comm: Any, stream: Any, nop: int) -> None:
        for j, i in enumerate(ins):  # the list into one buffer, on the group's stream
            _copy(flat, j * out.count, i, 0, out.count, stream, cupy)
        comm.reduceScatter(flat.ptr, out.ptr, out.count, out.wire.nccl, nop, stream.ptr)

    keep = [out.a, flat.a] + [i.a for i in ins]
    return Plan(
        _op_call(be, args["op"], out, "reduce_scatter", call),
        keep,
        [args["output"]],
        _dev([out, *ins], "reduce_scatter"),
        _meta("reduce_scatter", output=_t(out)),
    )


def _b_all_to_all_single(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me = pg.size(), pg.rank()
    inp = be.check.arr(args["input"], "all_to_all_single input", writable=False)
    out = be.check.arr(args["output"], "all_to_all_single output", writable=True)
    _same([out], inp, "all_to_all_single output", size=False)

    def rows(a: _Arr, what: str) -> tuple[int, int]:
        if a.a.ndim == 0:
            raise ValueError(f"all_to_all_single: {what} is 0-d; it needs a dim 0 to split")
        r = int(a.a.shape[0])
        return r, (a.count // r if r else a.wire.per_element * int(np.prod(a.a.shape[1:], dtype=np.int64)))

    in_rows, in_row = rows(inp, "input")
    out_rows, out_row = rows(out, "output")
    if in_row != out_row:
        raise ValueError(f"all_to_all_single: input rows have {in_row} elements, output rows {out_row}")
    sends = split_bounds(in_rows, in_row, args.get("input_split_sizes"), n, "all_to_all_single input_split_sizes")
    recvs = split_bounds(out_rows, out_row, args.get("output_split_sizes"), n, "all_to_all_single output_split_sizes")
    s, r, own = exchange_plan(me, sends, recvs)
    copies = [(out, own[1], inp, own[0], own[2])] if own else []
    launch = _grouped(be, [(inp, p) for p in s], [(out, p) for p in r], copies)
    return Plan(
        launch, [inp.a, out.a], [args["output"]], _dev([inp, out], "all_to_all_single"), _meta("all_to_all_single", dtype=inp.dtype)
    )


def _b_all_to_all(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me = pg.size(), pg.rank()
    outs = be.check.arrs(args["output_tensor_list"], "all_to_all output_tensor_list", n, writable=True)
    ins = be.check.arrs(args["input_tensor_list"], "all_to_all input_tensor_list", n, writable=False)
    _same(outs, ins[0], "all_to_all output_tensor_list", size=False)
    _same(ins, ins[0], "all_to_all input_tensor_list", size=False)
    if outs[me].count != ins[me].count:
        raise ValueError(
            f"all_to_all: this rank sends itself {ins[me].a.size} elements but its output_tensor_list[{me}] has {outs[me].a.size}"
        )
    sends = [(ins[j], Part(j, 0, ins[j].count)) for j in range(n) if j != me and ins[j].count]
    recvs = [(outs[j], Part(j, 0, outs[j].count)) for j in range(n) if j != me and outs[j].count]
    launch = _grouped(be, sends, recvs, [(outs[me], 0, ins[me], 0, ins[me].count)])
    keep = [o.a for o in outs] + [i.a for i in ins]
    return Plan(launch, keep, list(args["output_tensor_list"]), _dev([*outs, *ins], "all_to_all"), _meta("all_to_all", dtype=ins[0].dtype))


def _b_barrier(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    cupy = be.cupy
    ids = args.get("device_ids")
    device = int(ids[0]) if ids else None
    with cupy.cuda.Device(device if device is not None else be._current_device()):
        one = be.check.arr(cupy.zeros(1, dtype=cupy.int32), "barrier buffer", writable=True)

    def launch(comm: Any, stream: Any) -> None:
        comm.allReduce(one.ptr, one.ptr, 1, one.wire.nccl, 0, stream.ptr)

    return Plan(launch, [one.a], [], one.device, _meta("barrier"))


def _b_all_reduce_coalesced(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    ts = args["tensors"]
    items = ts if isinstance(ts, (list, tuple)) else [ts]
    arrs = be.check.arrs(items, "all_reduce_coalesced tensors", None, writable=True)
    if not arrs:
        raise ValueError("all_reduce_coalesced: tensors is empty")
    _same(arrs, arrs[0], "all_reduce_coalesced tensors", size=False)
    nccl = be.nccl

    def call(comm: Any, stream: Any, nop: int) -> None:
        nccl.groupStart()
        try:
            for a in arrs:
                comm.allReduce(a.ptr, a.ptr, a.count, a.wire.nccl, nop, stream.ptr)
        finally:
            nccl.groupEnd()

    return Plan(
        _op_call(be, args["op"], arrs[0], "all_reduce_coalesced", call),
        [a.a for a in arrs],
        list(items),
        _dev(arrs, "all_reduce_coalesced"),
        _meta("all_reduce_coalesced", tensors=[_t(a) for a in arrs]),
    )


def _b_all_gather_coalesced(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    n, me = pg.size(), pg.rank()
    ins = be.check.arrs(args["input_tensor_list"], "all_gather_coalesced input_tensor_list", None, writable=False)
    lists = args["output_tensor_lists"]
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence) or len(lists) != n:
        raise ValueError(f"all_gather_coalesced: output_tensor_lists must be a list of {n} lists (one per rank)")
    outs = [be.check.arrs(lst, f"all_gather_coalesced output_tensor_lists[{r}]", len(ins), writable=True) for r, lst in enumerate(lists)]
    for r, row in enumerate(outs):
        for i, (o, x) in enumerate(zip(row, ins, strict=True)):
            if o.dtype != x.dtype or o.count != x.count:
                raise ValueError(f"all_gather_coalesced: output_tensor_lists[{r}][{i}] is {_t(o)}, input_tensor_list[{i}] is {_t(x)}")
    sends = [(x, Part(j, 0, x.count)) for j in range(n) if j != me for x in ins]
    recvs = [(outs[j][i], Part(j, 0, x.count)) for j in range(n) if j != me for i, x in enumerate(ins)]
    copies = [(outs[me][i], 0, x, 0, x.count) for i, x in enumerate(ins)]
    keep = [x.a for x in ins] + [o.a for row in outs for o in row]
    flat_outs = [o for row in lists for o in row]
    return Plan(
        _grouped(be, sends, recvs, copies),
        keep,
        flat_outs,
        _dev([*ins, *(o for row in outs for o in row)], "all_gather_coalesced"),
        _meta("all_gather_coalesced"),
    )


def _b_p2p(be: Any, pg: Any, args: dict[str, Any]) -> Plan:
    sends: list[tuple[_Arr, Part]] = []
    recvs: list[tuple[_Arr, Part]] = []
    items: list[tuple[str, Any, int | None]] = []
    arrs: list[_Arr] = []
    for o in args["ops"]:
        name, peer = o["op"], o["peer"]
        if peer is None:
            raise DistBackendError(f"{name}: the NCCL backend cannot receive from any source; pass src")
        a = be.check.arr(o["tensor"], f"{name} tensor", writable=not o["sending"])
        arrs.append(a)
        (sends if o["sending"] else recvs).append((a, Part(peer, 0, a.count)))
        items.append((name, o["tensor"], peer))
    # NCCL's own rank is a peer like any other inside a group call: a send to oneself meets its receive
    launch = _grouped(be, sends, recvs, [])
    return Plan(launch, [a.a for a in arrs], [], _dev(arrs, "p2p"), {"same": {}}, items)


BUILDERS: dict[str, Callable[[Any, Any, dict[str, Any]], Plan]] = {
    "all_reduce": _b_all_reduce,
    "broadcast": _b_broadcast,
    "reduce": _b_reduce,
    "all_gather": _b_all_gather,
    "all_gather_into_tensor": _b_all_gather_one("all_gather_into_tensor"),
    "all_gather_single": _b_all_gather_one("all_gather_single"),
    "gather": _b_gather,
    "scatter": _b_scatter,
    "reduce_scatter": _b_reduce_scatter,
    "reduce_scatter_tensor": _b_reduce_scatter_one("reduce_scatter_tensor"),
    "reduce_scatter_single": _b_reduce_scatter_one("reduce_scatter_single"),
    "all_to_all": _b_all_to_all,
    "all_to_all_single": _b_all_to_all_single,
    "barrier": _b_barrier,
    "all_reduce_coalesced": _b_all_reduce_coalesced,
    "all_gather_coalesced": _b_all_gather_coalesced,
    "p2p": _b_p2p,
}

#: the ops this backend runs (everything the CPU backend has that NCCL can do)
SUPPORTED_OPS = frozenset(BUILDERS)
