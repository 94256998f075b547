"""DETAIL's desync check: before each collective, the ranks of the group compare a fingerprint
of the call (op, sequence number, and what every rank must agree on: dtype and shape where they
must match, root, reduce op). A mismatch fails the op on every rank at once, long before its
timeout, with each side in the message:

    all_reduce seq 12 on group 'default_pg': rank 0 has tensor float32[10], rank 1 has tensor float32[20]
    seq 3 on group 'default_pg': rank 0 called all_reduce, rank 1 called broadcast

The fingerprints travel on the op's own channel, one message per ordered pair of ranks with a
reserved tag, so no other op's messages can be taken by mistake.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from aiodist.algorithms.p2p import P2P, TAG_LIMIT
from aiodist.errors import DistBackendError

if TYPE_CHECKING:
    from aiodist.c10d.process_group import ProcessGroup

__all__ = ["check_fingerprint", "DesyncError", "FINGERPRINT_BYTES", "FINGERPRINT_TAG"]

FINGERPRINT_BYTES = 2048
FINGERPRINT_TAG = TAG_LIMIT - 1  # the schedules' tags stay far below


class DesyncError(DistBackendError):
    """The ranks of a group called different collectives (or the same one with different
    arguments) at the same sequence number."""


def _encode(fp: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(fp, sort_keys=True, default=str).encode()
    if len(raw) > FINGERPRINT_BYTES - 4:  # keep what must match; drop the rest
        raw = json.dumps({"op": fp["op"], "seq": fp["seq"], "same": fp.get("same", {})}, sort_keys=True, default=str).encode()[
            : FINGERPRINT_BYTES - 4
        ]
    out = np.zeros(FINGERPRINT_BYTES, np.uint8)
    out[:4] = np.frombuffer(len(raw).to_bytes(4, "little"), np.uint8)
    out[4 : 4 + len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _decode(buf: np.ndarray) -> dict[str, Any]:
    n = int.from_bytes(buf[:4].tobytes(), "little")
    try:
        value = json.loads(buf[4 : 4 + n].tobytes())
    except ValueError:
        return {"op": "?", "seq": -1, "same": {"fingerprint": "unreadable"}}
    return value if isinstance(value, dict) else {"op": "?", "seq": -1, "same": {}}


def describe_mismatch(fps: list[dict[str, Any]], ranks: list[int], desc: str) -> str | None:
    """The message for fingerprints that disagree (None when they all agree); ``ranks`` are the
    global ranks of the fingerprints' senders."""
    ops = [(fp.get("op"), fp.get("seq")) for fp in fps]
    if len(set(ops)) > 1:
        seq = fps[0].get("seq")
        parts = [f"rank {r} called {op} (seq {s})" if s != seq else f"rank {r} called {op}" for r, (op, s) in zip(ranks, ops, strict=True)]
        return f"seq {seq} on group '{desc}': " + ", ".join(parts)
    op, seq = ops[0]
    keys = sorted({k for fp in fps for k in fp.get("same", {})})
    for k in keys:
        values = [fp.get("same", {}).get(k) for fp in fps]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            parts = [f"rank {r} has {k} {v}" for r, v in zip(ranks, values, strict=True)]
            return f"{op} seq {seq} on group '{desc}': " + ", ".join(parts)
    return None


async def check_fingerprint(p2p: P2P, pg: ProcessGroup, op: str, seq: int, meta: dict[str, Any] | None) -> None:
    """Exchange this call's fingerprint with every other rank of the op; raise ``DesyncError``
    (on every rank: each sees all fingerprints) when they differ."""
    from aiodist.algorithms.collectives import _all

    n, me = p2p.size, p2p.rank
    if n == 1:
        return
    mine = {"op": op, "seq": seq, "same": (meta or {}).get("same", {})}
    out = _encode(mine)
    bufs = [out if r == me else np.empty(FINGERPRINT_BYTES, np.uint8) for r in range(n)]
    await _all(
        *(p2p.send(r, out, FINGERPRINT_TAG) for r in range(n) if r != me),
        *(p2p.recv(r, bufs[r], FINGERPRINT_TAG) for r in range(n) if r != me),
    )
    fps = [mine if r == me else _decode(bufs[r]) for r in range(n)]
    msg = describe_mismatch(fps, list(pg.ranks), pg.group_desc)
    if msg is not None:
        raise DesyncError(f"desync detected (AIODIST_DEBUG=DETAIL): {msg}")
