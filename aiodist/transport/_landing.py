"""Where an arriving DATA payload goes: ``decide`` is a pure function of its header, the
mailbox, the staging limits and a few facts about its group; the connection and the transport
carry the answer out (``Connection._target_for``, ``Inbox.on_header``/``on_payload``).

Rules this module keeps (checked in this order):
- A message of an aborted or closed group is DROPPED: read into scratch memory, discarded.
- A collective message whose digest is not this rank's own op's at that seq is a DESYNC: the
  group breaks on every rank (the transport's desync sentence) and the payload is dropped.
- A posted receive that accepts it (earliest first, see ``Mailbox``) gets it: LAND when the
  sizes match (zero-copy into the receive's array, or one copy when the payload was already
  read), else MISMATCH: the receive fails with ``size_error`` naming both sizes and the
  payload is dropped.
- With no receive posted, a payload already in memory (staged as it was read, or zero-length)
  is STAGED. One still to be read is STAGED when it fits the connection's staging room, else
  HELD (reading pauses, so TCP flow control makes the sender wait) until its receive is posted
  or room is freed. A big one (``GRACE_MIN_BYTES`` or more) that fits is first held for a short
  GRACE (its receive is usually about to be posted; staging would cost an allocation and two
  copies), then STAGED once the grace is over.
- The answer is a plain ``(fate, receive)`` tuple and the fates are module constants: this
  runs once per message, and a NamedTuple or an enum attribute look-up would cost more than
  the decision itself.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from typing import TypeAlias

from aiodist.transport._mailbox import Mailbox, PostedRecv
from aiodist.wire.frame import FrameHeader, FrameLimits

__all__ = ["Fate", "Landing", "decide", "GRACE_MIN_BYTES", "LAND", "STAGE", "HOLD", "GRACE", "DROP", "MISMATCH", "DESYNC"]

GRACE_MIN_BYTES = 1 << 20  # payloads this big wait a grace for their receive before being staged


class Fate(enum.Enum):
    """What happens to an arriving payload."""

    LAND = "land"  # into the receive's buffer
    STAGE = "stage"  # kept until its receive is posted
    HOLD = "hold"  # not read yet: reading pauses until a receive is posted or room is freed
    GRACE = "grace"  # a HOLD for the big-payload grace (there is staging room), then STAGE
    DROP = "drop"  # its group is aborted or closed: read and discarded
    MISMATCH = "mismatch"  # the receive is its receive, of another size: that receive fails
    DESYNC = "desync"  # its digest is not this rank's op's: the group breaks


LAND = Fate.LAND
STAGE = Fate.STAGE
HOLD = Fate.HOLD
GRACE = Fate.GRACE
DROP = Fate.DROP
MISMATCH = Fate.MISMATCH
DESYNC = Fate.DESYNC

#: ``decide``'s answer: the fate, and for LAND and MISMATCH the receive (still posted: the
#: caller claims it), else None
Landing: TypeAlias = tuple[Fate, PostedRecv | None]

_STAGE: Landing = (STAGE, None)
_HOLD: Landing = (HOLD, None)
_GRACE: Landing = (GRACE, None)
_DROP: Landing = (DROP, None)
_DESYNC: Landing = (DESYNC, None)


def decide(
    header: FrameHeader,
    mailbox: Mailbox,
    limits: FrameLimits,
    staged_bytes: int = 0,
    in_memory: bool = False,
    grace_over: bool = False,
    aborted: Container[int] = (),
    digest: int | None = None,
) -> Landing:
    """The fate of the DATA payload ``header`` announces (the transport passes everything by
    position: keywords would cost more than the rest of the call).

    ``staged_bytes``: what its connection stages already (against ``limits.max_staged_bytes``);
    ``in_memory``: the payload was read already (staged as it came, or zero-length), so it can
    no longer be held; ``grace_over``: its big-payload grace has run out; ``aborted``: the
    groups whose messages are dropped; ``digest``: this rank's own digest for the op at
    ``(header.group, header.seq)``, or None where it is not known (or not to be checked)."""
    if header.group in aborted:
        return _DROP
    if digest is not None and header.digest and header.digest != digest:
        return _DESYNC
    recv = mailbox.find((header.group, header.seq, header.tag), header.source)
    if recv is not None:
        return (LAND if recv.dst.nbytes == header.length else MISMATCH), recv
    if in_memory:
        return _STAGE
    if staged_bytes + header.length > limits.max_staged_bytes:
        return _HOLD
    if header.length >= GRACE_MIN_BYTES and not grace_over:
        return _GRACE
    return _STAGE
