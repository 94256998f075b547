"""Which backend an op's arrays go to: the group's device backend for arrays in device memory
(``aiodist.backends.device``), the World's stager where the group has none for that device but
has a CPU backend (the arrays are copied through host memory), else a clear refusal."""

from __future__ import annotations

from typing import Any

import numpy as np

from aiodist.backends.base import ProcessGroupLike
from aiodist.backends.device import DeviceBackend, device_type, first_array, stager_for
from aiodist.c10d.backend_registry import load_plugin
from aiodist.c10d.work import Work
from aiodist.c10d.world import current_world

__all__ = ["device_backend", "issue_on_device"]


def device_backend(pg: ProcessGroupLike, value: object, what: str) -> DeviceBackend | None:
    """None for host arrays (the CPU path); else the backend that takes ``value``'s device."""
    x = first_array(value)
    if type(x) is np.ndarray:  # the hot path: one type check
        return None
    kind = device_type(x)
    if kind == "cpu":
        return None
    found: DeviceBackend | None = pg.devices.get(kind)
    if found is not None:
        return found
    return _stager(pg, kind, what)


def _stager(pg: ProcessGroupLike, kind: str, what: str) -> DeviceBackend:
    if pg.host_refusal is None:
        factory = stager_for(kind)
        if factory is None and load_plugin("aiodist.devices", kind):
            factory = stager_for(kind)
        if factory is not None:
            made = factory(current_world())
            pg.devices[kind] = made  # the World's dict: every group of the World sees it
            return made
    served = ", ".join(sorted(set(pg.devices) | ({"cpu"} if pg.host_refusal is None else set()))) or "none"
    raise TypeError(
        f"{what} is in {kind} memory, but {pg.describe()} has no backend for {kind} (it serves: {served}) "
        f"and no installed plugin stages {kind} arrays through the host; "
        f"use init_process_group('cpu:gloo,{kind}:nccl') with aiodist[{kind}] installed, or pass host arrays"
    )


async def issue_on_device(dev: DeviceBackend, pg: ProcessGroupLike, op: str, args: dict[str, Any], async_op: bool) -> Work | None:
    """Issue ``op`` through ``dev`` and finish it as the public call does (Work or None)."""
    work: Work = await dev.issue(pg, op, args)
    if async_op:
        return work
    await work
    return None
