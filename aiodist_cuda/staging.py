"""CuPy arrays handed to the CPU backend (``"gloo"``, ``"cpu:gloo"``, ``"cuda:gloo"``): staged
through pinned host memory, as torch's gloo does with CUDA tensors.

At issue, on the loop: every device array of the call gets a pinned host twin; a staging stream
waits on the caller's current stream (event), and the device-to-host copies are queued on it.
The CPU op is issued at once (its sequence number taken in the caller's step, like any op), with
its body wrapped (``aiodist.c10d.process_group._STAGING``): it first awaits the copies (a
completion thread waits on their event, off the loop), runs on the host twins, then queues the
host-to-device copies of the outputs and awaits them. So ``await work`` means the results are in
the device arrays, and work queued on any stream after that sees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiodist.backends.base import ProcessGroupLike
from aiodist.backends.device import DeviceBackend
from aiodist.c10d import collectives, point_to_point
from aiodist.c10d.process_group import _STAGING, ProcessGroup
from aiodist.errors import DistBackendError
from aiodist_cuda import _cupy

__all__ = ["CudaStager", "make_stager"]

#: which arguments of each op are written (copied back to the device after the op)
_OUTPUTS = {
    "all_reduce": ("tensor",),
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
    "all_gather": ("tensor_list",),
    "all_gather_into_tensor": ("output_tensor",),
    "all_gather_single": ("output_tensor",),
    "gather": ("gather_list",),
    "scatter": ("tensor",),
    "reduce_scatter": ("output",),
    "reduce_scatter_tensor": ("output",),
    "reduce_scatter_single": ("output",),
    "all_to_all": ("output_tensor_list",),
    "all_to_all_single": ("output",),
    "all_reduce_coalesced": ("tensors",),
    "all_gather_coalesced": ("output_tensor_lists",),
}

#: roots arrive as group ranks under "root"; the CPU call takes them by these names
_ROOT_NAME = {"broadcast": "group_src", "reduce": "group_dst", "gather": "group_dst", "scatter": "group_src"}


class _Staging:
    """One op's host twins: copies in at issue, awaited by ``copy_in``; ``copy_out`` writes back."""

    def __init__(self, cupy: Any, device: int, stream: Any) -> None:
        self.cupy = cupy
        self.device = device
        self.pairs: list[tuple[Any, Any, bool]] = []  # (device array, pinned host twin, written)
        self.stream = stream
        with cupy.cuda.Device(device):
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.get_current_stream())
            self.stream.wait_event(ready)
        self.copied: Any = None

    def twin(self, a: Any, written: bool) -> Any:
        cupy = self.cupy
        import cupyx

        if not isinstance(a, cupy.ndarray):
            a = cupy.asarray(a)
        if a.device.id != self.device:
            raise ValueError(f"staged arrays must be on one device: cuda:{a.device.id} and cuda:{self.device}")
        if written and not a.flags.c_contiguous:
            raise ValueError(f"an output array is not contiguous (shape {a.shape}); pass a contiguous array")
        host = cupyx.empty_pinned(a.shape, dtype=a.dtype)
        with cupy.cuda.Device(self.device):
            a.get(stream=self.stream, out=host, blocking=False)
        self.pairs.append((a, host, written))
        return host

    def start(self) -> None:
        with self.cupy.cuda.Device(self.device):
            self.copied = self.stream.record(self.cupy.cuda.Event(block=True, disable_timing=True))

    async def copy_in(self) -> None:
        await asyncio.to_thread(self.copied.synchronize)  # releases the GIL while it waits

    async def copy_out(self) -> None:
        with self.cupy.cuda.Device(self.device):
            for a, host, written in self.pairs:
                if written:
                    a.set(host, stream=self.stream)
            done = self.stream.record(self.cupy.cuda.Event(block=True, disable_timing=True))
        await asyncio.to_thread(done.synchronize)


class CudaStager(DeviceBackend):
    """Runs the CPU backend's ops on pinned host copies of CuPy arrays (see the module docstring)."""

    name = "cuda-staging"
    device_type = "cuda"

    def __init__(self, world: Any) -> None:
        super().__init__(world.rank, world.world_size)
        self.cupy, _ = _cupy.load()
        self.ops = 0
        self._streams: dict[int, Any] = {}  # one staging stream per device (copies run in issue order)

    def _staging(self, device: int) -> _Staging:
        stream = self._streams.get(device)
        if stream is None:
            with self.cupy.cuda.Device(device):
                stream = self._streams[device] = self.cupy.cuda.Stream(non_blocking=True)
        return _Staging(self.cupy, device, stream)

    def _map(self, value: Any, st: _Staging, written: bool) -> Any:
        if isinstance(value, self.cupy.ndarray) or hasattr(type(value), "__cuda_array_interface__"):
            return st.twin(value, written)
        if isinstance(value, (list, tuple)):
            return [self._map(v, st, written) for v in value]
        return value

    def _device(self, value: Any) -> int | None:
        if isinstance(value, (list, tuple)):
            for v in value:
                d = self._device(v)
                if d is not None:
                    return d
            return None
        if isinstance(value, self.cupy.ndarray):
            return int(value.device.id)
        if hasattr(type(value), "__cuda_array_interface__"):
            return int(self.cupy.asarray(value).device.id)
        return None

    async def issue(self, pg: ProcessGroupLike, op: str, args: dict[str, Any]) -> Any:
        if op == "barrier":
            raise DistBackendError("barrier takes no arrays; it is never staged")
        values: Sequence[Any] = [o["tensor"] for o in args["ops"]] if op == "p2p" else list(args.values())
        device = self._device(list(values))
        if device is None:
            raise DistBackendError(f"{op}: nothing to stage")
        assert isinstance(pg, ProcessGroup)  # a stager issues the op again on c10d's own group
        if op == "p2p":
            return await self._issue_p2p(pg, args["ops"], device)
        st = self._staging(device)
        outputs = _OUTPUTS.get(op)
        if outputs is None:
            raise DistBackendError(f"{op} cannot be staged through the host")
        call = {k: self._map(v, st, k in outputs) for k, v in args.items() if k != "root"}
        if "root" in args:
            call[_ROOT_NAME[op]] = args["root"]
        st.start()
        token = _STAGING.set(st)
        try:
            work = await getattr(collectives, op)(**call, group=pg, async_op=True)
        finally:
            _STAGING.reset(token)
        self.ops += 1
        work._outputs = [args[k] for k in outputs]
        return work

    async def _issue_p2p(self, pg: ProcessGroup, ops: list[dict[str, Any]], device: int) -> list[Any]:
        """Each op of the batch on its own host twin, issued one after another in this step (on
        the CPU backend every op of a batch is in flight at once either way)."""
        works = []
        for o in ops:
            st = self._staging(device)
            host = st.twin(o["tensor"], not o["sending"])
            st.start()
            fn = point_to_point.isend if o["sending"] else point_to_point.irecv
            key = "group_dst" if o["sending"] else "group_src"
            token = _STAGING.set(st)
            try:
                work = await fn(host, group=pg, tag=o["tag"], **{key: o["peer"]})
            finally:
                _STAGING.reset(token)
            assert work is not None  # pg is a live group of this rank
            work._outputs = [o["tensor"]]
            works.append(work)
        self.ops += 1
        return works

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["ops"] = self.ops
        return out


def make_stager(world: Any) -> CudaStager:
    """The factory registered with ``aiodist.backends.device.register_stager("cuda", ...)``."""
    return CudaStager(world)
