"""Parameter averaging across a group, as ``torch.distributed.algorithms.model_averaging.utils``:
``average_parameters``, ``average_parameters_or_parameter_groups`` (both ``async def``: they
communicate) and ``get_params_to_average``.

Parameters are numpy arrays or torch tensors (torch is imported only if the caller passed a
tensor, through ``sys.modules``; aiodist never imports it itself). One call is one ``all_reduce``
of one flat buffer: every parameter is flattened into it (in their common dtype, numpy's /
torch's type promotion), divided by the group size first (torch's order: the sum of the
quotients, which keeps a float16 sum from overflowing), summed, and written back into each
parameter in place, cast back to its own dtype. A parameter's storage is updated, never
replaced (torch rebinds ``p.data``; here views and optimizer state that share the storage see
the average).

Which parameters count (``get_params_to_average``): a torch tensor whose ``.grad`` is None is
left out, as in torch; a numpy array has no gradient and always counts. A dict is an optimizer
parameter group: its ``"params"`` are filtered the same way. See docs/objects.md.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from aiodist.c10d.collectives import all_reduce
from aiodist.c10d.init import GroupArg, resolve_group
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.world import NON_GROUP_MEMBER
from aiodist.types import is_torch_tensor

__all__ = ["average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average"]


def _not_member(process_group: GroupArg) -> bool:
    return isinstance(process_group, int) and not isinstance(process_group, bool) and process_group == NON_GROUP_MEMBER


def get_params_to_average(params: Iterable[Any]) -> list[Any]:
    """The parameters of ``params`` (a model's parameters, or an optimizer's parameter groups:
    dicts with ``"params"``) that take part in averaging: torch tensors with a gradient, and
    every numpy array. Anything else is a TypeError (torch: NotImplementedError)."""
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of parameters or parameter groups, not {type(params).__name__}")
    out: list[Any] = []
    for item in params:
        if isinstance(item, Mapping):
            if "params" not in item:
                raise TypeError("a parameter group (dict) must have a 'params' entry")
            group_params = item["params"]
            members = [group_params] if isinstance(group_params, np.ndarray) or is_torch_tensor(group_params) else list(group_params)
            out.extend(p for p in members if _counts(p, "a parameter group's params"))
        elif _counts(item, "params"):
            out.append(item)
    return out


def _counts(p: object, where: str) -> bool:
    if isinstance(p, np.ndarray):
        return True
    if is_torch_tensor(p):
        return getattr(p, "grad", None) is not None
    raise TypeError(
        f"{where}: parameter input of type {type(p).__name__} is not supported (numpy arrays, torch tensors, or dicts with 'params')"
    )


async def average_parameters(params: Iterable[Any], process_group: GroupArg) -> None:
    """Average ``params`` (numpy arrays or torch tensors, all of one kind) across
    ``process_group`` (None: the default group), in place, with one all_reduce of one flat
    buffer. On a rank outside the group (``NON_GROUP_MEMBER``) it does nothing, as torch's.
    Every rank of the group must pass parameters of the same sizes and dtypes, in the same order."""
    if _not_member(process_group):
        return
    pg = resolve_group(process_group, what="average_parameters")
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of numpy arrays or torch tensors, not {type(params).__name__}")
    plist = list(params)
    if not plist:
        raise ValueError("average_parameters: no parameters to average (torch fails on an empty list too)")
    n = pg.size()
    if all(isinstance(p, np.ndarray) for p in plist):
        await _average_numpy(plist, pg, n)
    elif all(is_torch_tensor(p) for p in plist):
        await _average_torch(plist, pg, n)
    else:
        kinds = sorted({type(p).__name__ for p in plist})
        raise TypeError(f"average_parameters: params must be all numpy arrays or all torch tensors, got {kinds}")


async def _average_numpy(plist: list[np.ndarray], pg: ProcessGroup, n: int) -> None:
    for i, p in enumerate(plist):
        if p.dtype.kind not in "fc":
            raise TypeError(f"average_parameters: params[{i}] is {p.dtype}; only floating and complex parameters can be averaged")
        if not p.flags.writeable:
            raise ValueError(f"average_parameters: params[{i}] is read-only")
    dtype = np.result_type(*plist)
    flat = np.concatenate([p.reshape(-1) for p in plist], dtype=dtype)
    flat /= n
    await all_reduce(flat, group=pg)
    start = 0
    for p in plist:
        part = flat[start : start + p.size].reshape(p.shape)
        start += p.size
        np.copyto(p, part.real if p.dtype.kind != "c" and part.dtype.kind == "c" else part, casting="unsafe")


async def _average_torch(plist: list[Any], pg: ProcessGroup, n: int) -> None:
    for i, p in enumerate(plist):
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"average_parameters: params[{i}] is {p.dtype}; only floating and complex parameters can be averaged")
    torch = sys.modules["torch"]
    # Detached views: nothing here is recorded by autograd. (No torch.no_grad() block: grad mode
    # is per thread, and other tasks of this loop run while the all_reduce is awaited.)
    flat = torch.cat([p.detach().reshape(-1) for p in plist])
    flat /= n
    await all_reduce(flat, group=pg)
    start = 0
    for p in plist:
        k = p.numel()
        part = flat[start : start + k].view_as(p)
        start += k
        # .data: the storage is updated as torch's ``p.data = ...`` would, without touching autograd
        p.data.copy_(part.real if not p.is_complex() and part.is_complex() else part)


async def average_parameters_or_parameter_groups(params: Iterable[Any], process_group: GroupArg) -> None:
    """Average the parameters of a model, or of an optimizer's parameter groups, that
    ``get_params_to_average`` selects."""
    if _not_member(process_group):
        return
    await average_parameters(get_params_to_average(params), process_group)
