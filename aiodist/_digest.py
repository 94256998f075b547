"""Always-on desync detection: the digest of what every rank must agree on for one
collective, carried by every frame of the op (bytes 28-31 of the frame header).

``op_digest(op, same)``: 32 bits, never 0 (0 means "no digest": p2p, DETAIL, old frames). The top
byte is the op's code (``OPS``), so a receiver can name the op a peer called; the low 24 bits
are a CRC of the arguments that must match (``meta["same"]``: dtype and shape, root, reduce op).
A receiver whose own op at that seq has another digest fails the op at once and breaks the group
on every rank (aiodist.transport), with ``describe_mismatch``'s sentence, which names the peer's
arguments too where the size of its message tells them (``their_arguments``: guesses checked
against the peer's digest, so a named shape is never a guess). DETAIL keeps its own,
fuller check (a fingerprint exchange with the peers' arguments and stacks) and sends no digest.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

__all__ = ["OPS", "op_digest", "op_of", "describe_mismatch", "their_arguments"]

# The codes are wire values (a frame's top digest byte): append new ops, never reorder. It is
# not derived from aiodist.c10d.collectives.__all__ for that reason (and this module sits below
# c10d: the transport reads it).
OPS: tuple[str, ...] = (
    "?",
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
)
_CODE = {name: i for i, name in enumerate(OPS)}


_CACHE: dict[tuple[Any, ...], int] = {}
_CACHE_MAX = 4096


def op_digest(op: str, same: dict[str, Any] | None) -> int:
    """The op's digest (see the module docstring). A training loop repeats a few calls, so the
    digests are cached by (op, arguments): a lookup instead of a CRC on the hot path."""
    key = (op, *same.values()) if same else (op,)
    try:
        hit = _CACHE.get(key)
    except TypeError:  # an unhashable argument (a list): no cache
        return _compute(op, same)
    if hit is None:
        hit = _compute(op, same)
        if len(_CACHE) < _CACHE_MAX:
            _CACHE[key] = hit
    return hit


def _canon(v: Any) -> str:
    """One text per value that compares equal (2 == 2.0 on every rank, as DETAIL compares)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _compute(op: str, same: dict[str, Any] | None) -> int:
    code = _CODE.get(op, 0) or 0xFF
    args = "\x1f".join(map(_canon, same.values())) if same else ""
    return (code << 24) | (zlib.crc32(args.encode()) & 0xFFFFFF) or 1


def op_of(digest: int) -> str:
    """The op a digest names ("an unknown op" for a code this side does not know)."""
    code = digest >> 24
    return OPS[code] if 0 < code < len(OPS) else "an unknown op"


def _args(same: dict[str, Any] | None) -> str:
    if not same:
        return "no arguments to compare"
    return ", ".join(f"{k} {v}" for k, v in same.items())


#: bytes per element of each logical dtype (aiodist.types.DTYPES), to read a message's size as a count
_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4,
    "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip
_TENSOR = re.compile(r"^([a-z0-9]+)\[([0-9, ]*)\]$")  # "float32[4, 2]", as the collectives describe a tensor
_MAX_GUESSES = 4096


def _counts(chunk: int, size: int) -> list[int]:
    """The element counts a message of ``chunk`` elements may come from: the whole tensor, or one
    of ``k`` near-equal parts (``k`` a power of two up to the group's size, or the size itself:
    the schedules' splits), whose sizes differ by at most one."""
    parts, k = {size}, 2
    while k <= size:
        parts.add(k)
        k *= 2
    out = [chunk]
    for k in sorted(parts - {0, 1}):
        out.extend(range(max(1, k * (chunk - 1) + 1), k * (chunk + 1)))
    return out


def _shapes(dims: list[int], n: int) -> list[list[int]]:
    """Shapes of ``n`` elements close to ``dims``: flat, or ``dims`` with its first or last size changed."""
    out = [[n]]
    if len(dims) > 1:
        rest, head = math.prod(dims[1:]), math.prod(dims[:-1])
        if rest and n % rest == 0:
            out.append([n // rest, *dims[1:]])
        if head and n % head == 0:
            out.append([*dims[:-1], n // head])
    elif not dims and n == 1:
        out.append([])
    return out


def their_arguments(op: str, same: dict[str, Any] | None, theirs: int, nbytes: int, size: int) -> dict[str, Any] | None:
    """The arguments a peer called ``op`` with, where its message tells them: the peer's digest
    is ``theirs`` and one of its messages was ``nbytes`` long, in a group of ``size`` ranks. The
    tensor argument is tried at the counts that size allows (``_counts``) in this rank's dtype,
    and as the whole message in every other dtype; an answer is one whose digest is the peer's
    (a 24-bit check, so a wrong guess is about one in 16 million a try). None if no try fits, or
    the op has no single tensor argument to vary."""
    if not same or nbytes <= 0:
        return None
    keys = [k for k, v in same.items() if isinstance(v, str) and _TENSOR.match(v)]
    if len(keys) != 1:
        return None
    key = keys[0]
    m = _TENSOR.match(same[key])
    assert m is not None
    dtype, dims = m[1], [int(d) for d in m[2].split(",") if d.strip()]
    tries = 0
    for dt, whole_only in ((dtype, False), *((d, True) for d in _ITEMSIZE if d != dtype)):
        item = _ITEMSIZE.get(dt)
        if item is None or nbytes % item:
            continue
        chunk = nbytes // item
        for n in [chunk] if whole_only else _counts(chunk, size):
            for shape in _shapes(dims, n):
                guess = {**same, key: f"{dt}{shape}"}
                if _compute(op, guess) == theirs:
                    return guess
                tries += 1
                if tries >= _MAX_GUESSES:
                    return None
    return None


def mismatch_culprit(seq: int, mine: tuple[int, str, dict[str, Any] | None], theirs: int) -> str:
    """What the peer of a mismatch did, for an error's ``culprits``: ``"called broadcast at seq 3"``,
    or ``"called all_reduce at seq 3 with other arguments"``."""
    other = op_of(theirs)
    if other != mine[1]:
        return f"called {other} at seq {seq}"
    return f"called {other} at seq {seq} with other arguments"


def describe_mismatch(
    group: str,
    seq: int,
    me: int,
    mine: tuple[int, str, dict[str, Any] | None],
    peer: int,
    theirs: int,
    nbytes: int = -1,
    size: int = 0,
) -> str:
    """The sentence both sides of a mismatch get (torch DETAIL's kind: who called what).
    ``nbytes``: the size of a message of the peer's in this op (negative: none seen), from which
    its arguments are named where they can be (``their_arguments``); ``size``: the group's size."""
    digest, op, same = mine
    head = f"desync detected: seq {seq} on {group}: "
    if op_of(theirs) != op:
        return (
            f"{head}rank {peer} called {op_of(theirs)}, rank {me} called {op} ({_args(same)}): the ranks issued different "
            "collectives at this point of the group (run with AIODIST_DEBUG=DETAIL for every rank's call and stack)"
        )
    found = their_arguments(op, same, theirs, nbytes, size)
    if found is not None:
        return (
            f"{head}rank {peer} and rank {me} both called {op} with different arguments: rank {me} has {_args(same)}; "
            f"rank {peer} has {_args(found)} (every rank must pass the same dtype, shape, root and reduce op)"
        )
    return (
        f"{head}rank {peer} and rank {me} both called {op} with different arguments: rank {me} has {_args(same)}, "
        f"rank {peer}'s differ (in dtype, shape, root or reduce op; run with AIODIST_DEBUG=DETAIL to see both sides)"
    )
