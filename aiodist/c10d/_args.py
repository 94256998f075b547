"""Argument checks shared by the collectives and p2p: everything here raises TypeError or
ValueError on the calling rank, before anything is sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiodist.c10d.process_group import ProcessGroup
from aiodist.types import Buffer, as_array

__all__ = ["group_root", "buf", "bufs", "same_dtype", "check_async_op", "split_sizes"]


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return value


def group_root(
    pg: ProcessGroup, op: str, global_name: str, global_rank: int | None, group_rank: int | None, *, default_global: int | None = None
) -> int:
    """The group rank named by ``src``/``dst`` (a global rank) or ``group_src``/``group_dst``."""
    group_name = f"group_{global_name}"
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"Can't specify both group_rank and global_rank: {op} takes {global_name} or {group_name}, not both")
    if group_rank is not None:
        g = _int(group_rank, f"{op}: {group_name}")
        if not 0 <= g < pg.size():
            raise ValueError(f"{op}: {group_name}={g} is out of range for {pg.describe()} of size {pg.size()}")
        return g
    if global_rank is None:
        if default_global is None:
            raise ValueError(f"Must specify global_rank or group_rank ({op}: must specify {global_name} or {group_name})")
        global_rank = default_global
    r = _int(global_rank, f"{op}: {global_name}")
    if r not in pg.ranks:
        raise ValueError(f"{op}: {global_name}={r} is not a rank of {pg.describe()}")
    return pg.ranks.index(r)


def buf(obj: object, what: str, *, writable: bool) -> Buffer:
    return as_array(obj, what=what, writable=writable)


def bufs(objs: object, what: str, n: int, *, writable: bool) -> list[Buffer]:
    if isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
        raise TypeError(f"{what} must be a list of tensors, not {type(objs).__name__}")
    if len(objs) != n:
        raise ValueError(f"{what} has {len(objs)} tensors, the group has {n} ranks")
    return [as_array(x, what=f"{what}[{i}]", writable=writable) for i, x in enumerate(objs)]


def same_dtype(items: Sequence[Buffer], ref: Buffer, what: str) -> None:
    for i, b in enumerate(items):
        if b.dtype_name != ref.dtype_name:
            raise TypeError(f"{what}[{i}] is {b.dtype_name}, expected {ref.dtype_name} (the input's dtype)")


def check_async_op(async_op: Any) -> bool:
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, not {type(async_op).__name__}")
    return async_op


def split_sizes(rows: int, sizes: Sequence[int] | None, n: int, what: str) -> list[int]:
    """The rows of dim 0 each of ``n`` ranks gets: ``sizes``, or equal parts where it is None or
    empty (torch's rule). ValueError naming ``what`` for a wrong length, a negative or non-int
    size, sizes that do not add up to ``rows``, or rows that do not divide equally."""
    if not sizes:
        if rows % n:
            raise ValueError(f"{what}: dim 0 ({rows}) must divide equally by the world size ({n}) when no split sizes are given")
        return [rows // n] * n
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) != n:
        raise ValueError(f"{what} split sizes must be a list of {n} ints, got {sizes!r}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"{what} split sizes must be non-negative ints, got {sizes!r}")
    if sum(sizes) != rows:
        raise ValueError(f"{what} split sizes {list(sizes)} add up to {sum(sizes)}, but dim 0 is {rows}")
    return list(sizes)
