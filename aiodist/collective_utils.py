"""``all_gather_object_enforce_type``, as ``torch.distributed.collective_utils``'s (an ``async def``).

torch's behaviour, kept: ``all_gather_object`` first, then every gathered object is checked
against the first one (group rank 0's) with ``type_checker(first, other)``; the first failing
entry is a ``TypeError``. Every rank holds the same gathered list, so every rank fails alike, with
the same message; the group itself stays usable (the check runs after the op is done). The
default check is exact type identity: a subclass counts as different.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiodist.c10d.init import GroupArg, resolve_group
from aiodist.c10d.objects import all_gather_object

__all__ = ["all_gather_object_enforce_type"]


def _same_type(x: Any, y: Any) -> bool:
    return type(x) is type(y)


async def all_gather_object_enforce_type(
    pg: GroupArg, object_list: list[Any], obj: Any, type_checker: Callable[[Any, Any], bool] = _same_type
) -> None:
    """``all_gather_object(object_list, obj, group=pg)``, then a ``TypeError`` naming the first group
    rank whose object ``type_checker`` does not accept next to group rank 0's (``pg`` None: the
    default group)."""
    if not callable(type_checker):
        raise TypeError(f"type_checker must be callable, not {type(type_checker).__name__}")
    group = resolve_group(pg, what="all_gather_object_enforce_type")
    await all_gather_object(object_list, obj, group=group)
    first = object_list[0]
    for i in range(1, len(object_list)):
        if not type_checker(first, object_list[i]):
            raise TypeError(
                f"all_gather_object_enforce_type: the object of group rank {i} (global rank {group.ranks[i]}) is "
                f"{type(object_list[i]).__qualname__}, while group rank 0's (global rank {group.ranks[0]}) is {type(first).__qualname__}"
            )
