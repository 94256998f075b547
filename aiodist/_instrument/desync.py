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

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from aiodist._message import P2P, TAG_LIMIT
from aiodist.errors import DistBackendError

__all__ = ["check_fingerprint", "describe_mismatch", "DesyncError", "FINGERPRINT_BYTES", "FINGERPRINT_TAG"]

log = logging.getLogger("aiodist.debug.desync")  # the documented logger name (docs/debugging.md)
_TRACE = 5  # aiodist._instrument.logs.TRACE

FINGERPRINT_BYTES = 2048
FINGERPRINT_TAG = TAG_LIMIT - 1  # the schedules' tags stay far below


#: ``await exchange(*awaitables)``: run the sends and receives together, failing as one (the
#: schedules' own helper, passed in by c10d: this layer does not import the schedules)
Exchange = Callable[..., Awaitable[None]]


class _Group(Protocol):
    """What the check reads of a group (c10d's ProcessGroup; this layer does not import c10d)."""

    @property
    def ranks(self) -> Sequence[int]: ...
    @property
    def group_desc(self) -> str: ...


class DesyncError(DistBackendError):
    """The ranks of a group called different collectives (or the same one with different
    arguments) at the same sequence number."""


_SHOWN = 200  # characters of one value the message shows (the digest compares all of it)


def fingerprint(op: str, seq: int, same: dict[str, Any]) -> dict[str, Any]:
    """What a rank sends: the op, the seq, a digest of everything that must match (compared), and
    each value cut to ``_SHOWN`` characters (shown in the message)."""
    full = json.dumps(same, sort_keys=True, default=str)
    shown = {}
    for k, v in same.items():
        text = json.dumps(v, sort_keys=True, default=str)
        shown[k] = v if len(text) <= _SHOWN else text[:_SHOWN] + "..."
    return {"op": op, "seq": seq, "digest": hashlib.blake2b(full.encode(), digest_size=16).hexdigest(), "same": shown}


def _encode(fp: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(fp, sort_keys=True, default=str).encode()
    if len(raw) > FINGERPRINT_BYTES - 4:  # too many values to show: the digest still compares them
        raw = json.dumps({"op": fp["op"], "seq": fp["seq"], "digest": fp.get("digest"), "same": {}}, sort_keys=True, default=str).encode()
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


def _sides(ranks: list[int], values: list[str], verb: str) -> str:
    """``rank 0 has X, rank 1 has Y``; ranks that agree are listed together (``ranks [0, 2] has
    X`` reads badly, so the verb is given in both numbers: "has"/"have", "called"/"called")."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        groups.setdefault(v, []).append(r)
    if len(groups) == len(values):
        return ", ".join(f"rank {r} {verb} {v}" for r, v in zip(ranks, values, strict=True))
    plural = {"has": "have"}.get(verb, verb)
    return ", ".join(f"rank {rs[0]} {verb} {v}" if len(rs) == 1 else f"ranks {rs} {plural} {v}" for v, rs in groups.items())


def describe_mismatch(fps: list[dict[str, Any]], ranks: list[int], desc: str) -> str | None:
    """The message for fingerprints that disagree (None when they all agree); ``ranks`` are the
    global ranks of the fingerprints' senders. Ranks that agree with each other are grouped
    (``ranks [0, 1, 2] called all_reduce, rank 3 called broadcast``)."""
    ops = [(fp.get("op"), fp.get("seq")) for fp in fps]
    if len(set(ops)) > 1:
        seq = fps[0].get("seq")
        values = [f"{op} (seq {s})" if s != seq else str(op) for op, s in ops]
        return f"seq {seq} on group '{desc}': " + _sides(ranks, values, "called")
    op, seq = ops[0]
    digests = {fp.get("digest") for fp in fps}
    if len(digests) == 1 and None not in digests:
        return None
    keys = sorted({k for fp in fps for k in fp.get("same", {})})
    for k in keys:
        values = [fp.get("same", {}).get(k) for fp in fps]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            shown = [f"{k} {v}" for v in values]
            return f"{op} seq {seq} on group '{desc}': " + _sides(ranks, shown, "has")
    if None in digests:
        return None  # fingerprints without digests (hand-made) that agree on every shown value
    shown_digests = [f"arguments digest {str(fp.get('digest'))[:12]}" for fp in fps]  # they differ past what can be shown
    return f"{op} seq {seq} on group '{desc}': " + _sides(ranks, shown_digests, "has")


async def check_fingerprint(p2p: P2P, pg: _Group, op: str, seq: int, meta: dict[str, Any] | None, exchange: Exchange) -> None:
    """Exchange this call's fingerprint with every other rank of the op (``exchange``: how the
    sends and receives run together, passed in); raise ``DesyncError`` (on every rank: each sees
    all fingerprints) when they differ."""
    n, me = p2p.size, p2p.rank
    if n == 1:
        return
    mine = fingerprint(op, seq, (meta or {}).get("same", {}))
    out = _encode(mine)
    bufs = [out if r == me else np.empty(FINGERPRINT_BYTES, np.uint8) for r in range(n)]
    await exchange(
        *(p2p.send(r, out, FINGERPRINT_TAG) for r in range(n) if r != me),
        *(p2p.recv(r, bufs[r], FINGERPRINT_TAG) for r in range(n) if r != me),
    )
    fps = [mine if r == me else _decode(bufs[r]) for r in range(n)]
    msg = describe_mismatch(fps, list(pg.ranks), pg.group_desc)
    if msg is not None:
        raise DesyncError(f"desync detected (AIODIST_DEBUG=DETAIL): {msg}")
    if log.isEnabledFor(_TRACE):
        log.log(_TRACE, "rank %d: %s seq %d on group '%s': %d ranks agree on %s", pg.ranks[me], op, seq, pg.group_desc, n, mine["same"])
