"""Always-on desync detection (issue 13): the digest of what every rank must agree on for one
collective, carried by every frame of the op (bytes 28-31 of the frame header).

``op_digest(op, same)``: 32 bits, never 0 (0 means "no digest": p2p, DETAIL, old frames). The top
byte is the op's code (``OPS``), so a receiver can name the op a peer called; the low 24 bits
are a CRC of the arguments that must match (``meta["same"]``: dtype and shape, root, reduce op).
A receiver whose own op at that seq has another digest fails the op at once and breaks the group
on every rank (aiodist.transport), with ``describe_mismatch``'s sentence. DETAIL keeps its own,
fuller check (a fingerprint exchange with the peers' arguments and stacks) and sends no digest.
"""

from __future__ import annotations

import zlib
from typing import Any

__all__ = ["OPS", "op_digest", "op_of", "describe_mismatch"]

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


def describe_mismatch(group: str, seq: int, me: int, mine: tuple[int, str, dict[str, Any] | None], peer: int, theirs: int) -> str:
    """The sentence both sides of a mismatch get (torch DETAIL's kind: who called what)."""
    digest, op, same = mine
    head = f"desync detected: seq {seq} on {group}: "
    if op_of(theirs) != op:
        return (
            f"{head}rank {peer} called {op_of(theirs)}, rank {me} called {op} ({_args(same)}): the ranks issued different "
            "collectives at this point of the group (run with AIODIST_DEBUG=DETAIL for every rank's call and stack)"
        )
    return (
        f"{head}rank {peer} and rank {me} both called {op} with different arguments: rank {me} has {_args(same)}, "
        f"rank {peer}'s differ (in dtype, shape, root or reduce op; run with AIODIST_DEBUG=DETAIL to see both sides)"
    )
