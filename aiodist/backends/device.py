"""The device-backend interface: how a plugin (``aiodist_cuda``) runs whole ops on arrays that
live in device memory, and how the c10d layer finds the plugin for an array.

A CPU ``CommBackend`` is a channel factory: the c10d layer runs the schedules over it. A device
library (NCCL) runs whole collectives itself, on its own streams, so a ``DeviceBackend`` takes
the whole call instead: ``issue(pg, op, args)`` checks the arguments (``TypeError`` /
``ValueError``, nothing enqueued), takes the group's next sequence number through
``ProcessGroup.issue_device`` *before its first suspension* (ops of one group are issued in
call order on every rank, as NCCL requires), and returns the op's ``Work``.

``args`` are the public call's own arguments by torch's names (``tensor``, ``op``,
``output_tensor_list``, ...); roots are already resolved to *group ranks* under ``"root"``.

Which arrays are "on a device": ``device_type(obj)``, from duck-typed attributes only (this
module never imports a device library): a torch tensor's ``device.type``, a CuPy array (its
module), or anything exporting ``__cuda_array_interface__``.

A *stager* (``register_stager``) is the fallback for a group with no backend for an array's
device: it copies the arrays to host memory, runs the CPU op, and copies the results back.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiodist.backends.base import ProcessGroupLike

__all__ = ["DeviceBackend", "device_type", "register_stager", "stager_for", "STAGERS"]


class DeviceBackend(abc.ABC):
    """One process's end of a device backend (made once per World, shared by its groups)."""

    #: the registered name ("nccl")
    name: str = ""
    #: the device type it serves ("cuda")
    device_type: str = ""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    async def issue(self, pg: ProcessGroupLike, op: str, args: dict[str, Any]) -> Any:
        """Check ``args``, issue ``op`` on group ``pg`` (sequence number taken before the first
        suspension) and return its ``Work``. Unknown ops: ``DistBackendError`` naming the op."""

    async def connect(self, pg: ProcessGroupLike, device_id: Any = None) -> None:  # noqa: B027 - optional
        """Make ``pg``'s communicator now, on ``device_id`` where given
        (``init_process_group(device_id=...)``'s eager mode)."""

    def abort_group(self, group_id: int, reason: str) -> None:  # noqa: B027 - optional
        """``group_id`` broke on this rank (an op failed or timed out): abort what the backend
        holds for it so nothing waits on it any more. Must not block the event loop."""

    async def new_group(self, parent: ProcessGroupLike, group: ProcessGroupLike | None, group_id: int, members: Sequence[int]) -> None:  # noqa: B027 - optional
        """Called on every rank of ``parent`` when a sub-group of it is made by all of them
        (``new_group`` without local synchronisation, ``split_group``), in the same order on
        every rank; ``group`` is None on ranks not in it. A backend may split the parent's
        communicator here (NCCL's ncclCommSplit needs every rank of the parent)."""

    async def release_group(self, group_id: int) -> None:  # noqa: B027 - optional
        """``group_id`` is being destroyed (its ops have ended or been failed on this rank):
        release what the backend holds for it, gracefully where nothing is in flight."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release what the backend holds. Idempotent."""

    def stats(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.device_type, "rank": self.rank}


def device_type(obj: object) -> str:
    """``"cpu"`` for host arrays, else the device type of ``obj`` (``"cuda"``, ...)."""
    if type(obj) is np.ndarray:
        return "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return str(obj.device.type)
    if type(obj).__module__.split(".", 1)[0] == "cupy":
        return "cuda"
    if hasattr(type(obj), "__cuda_array_interface__"):  # numba, pycuda, ... (a class attribute: no property call)
        return "cuda"
    return "cpu"


def first_array(value: object) -> object:
    """The first array of an argument that may be an array or a (nested) list of arrays."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


#: device type -> a factory ``(world) -> DeviceBackend`` staging that device's arrays through host memory
STAGERS: dict[str, Callable[[Any], DeviceBackend]] = {}


def register_stager(device: str, factory: Callable[[Any], DeviceBackend]) -> None:
    """Let groups without a backend for ``device`` take its arrays by staging them through the
    host: ``factory(world)`` makes the stager (once per World)."""
    if not isinstance(device, str) or not device or device == "cpu":
        raise ValueError(f"register_stager: device must be a device type such as 'cuda', not {device!r}")
    if not callable(factory):
        raise TypeError(f"register_stager: factory must be callable, not {type(factory).__name__}")
    STAGERS[device] = factory


def stager_for(device: str) -> Callable[[Any], DeviceBackend] | None:
    return STAGERS.get(device)
