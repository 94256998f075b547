"""aiodist_cuda: GPU collectives through CuPy's NCCL, as aiodist's backend "nccl" for device "cuda".

aiodist never imports this package by name: it finds it through the entry points this
distribution installs (``aiodist.backends: nccl`` and ``aiodist.devices: cuda``, both
``aiodist_cuda:register``), when a program asks for the backend or hands a collective a CuPy
array. Importing it registers it too. It imports without CuPy or without a GPU;
``is_available()`` then says False and ``unavailable_reason()`` why.

- ``init_process_group("nccl")`` / ``"cpu:gloo,cuda:nccl"`` (``backend=None`` picks the latter
  where NCCL can run): ops on CuPy arrays run as NCCL calls on the group's own stream
  (``aiodist_cuda.backend``); their Work is a ``CudaWork`` (``aiodist_cuda.work``).
- A group whose World has no NCCL backend (``"gloo"``) stages CuPy arrays through pinned host
  memory (``aiodist_cuda.staging``), as torch's gloo does with CUDA tensors.
"""

from __future__ import annotations

from aiodist_cuda import _cupy
from aiodist_cuda.backend import SUPPORTED_OPS, NcclOptions

__all__ = ["register", "is_available", "unavailable_reason", "device_count", "nccl_version", "NcclOptions", "SUPPORTED_OPS"]

_registered: list[bool] = []


def is_available() -> bool:
    """Whether the NCCL backend can run here: CuPy, its NCCL library and a GPU."""
    return _cupy.reason() == ""


def device_count() -> int:
    """How many GPUs CUDA shows this process (0 where the backend cannot run): the default
    ``group_size`` of ``aiodist.new_subgroups``, as torch's ``torch.cuda.device_count()``."""
    cupy, _, why = _cupy._get()
    return int(cupy.cuda.runtime.getDeviceCount()) if cupy is not None and not why else 0


def unavailable_reason() -> str:
    """Why ``is_available()`` is False ("" when it is True)."""
    return _cupy.reason()


def nccl_version() -> int | None:
    """NCCL's runtime version code (2.32.3 -> 23203), or None where NCCL cannot be loaded."""
    return _cupy.nccl_version()


def _create(opts: object, pg_options: object = None) -> object:
    from aiodist_cuda.backend import create_nccl_backend  # CuPy is imported here, on first use

    return create_nccl_backend(opts, pg_options)  # type: ignore[arg-type]


def _stager(world: object) -> object:
    from aiodist_cuda.staging import make_stager

    return make_stager(world)


def register() -> None:
    """Register backend "nccl" for device "cuda" and the CUDA stager with aiodist (idempotent;
    imports no CuPy: that happens when a World first makes the backend)."""
    if _registered:
        return
    from aiodist.backends.device import register_stager
    from aiodist.c10d.backend_registry import Backend

    if "nccl" not in Backend._plugins:
        Backend.register_backend("nccl", _create, extended_api=True, devices=["cuda"])
    register_stager("cuda", _stager)  # type: ignore[arg-type]
    _registered.append(True)


register()
