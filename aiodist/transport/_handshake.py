"""The handshake's verdict and its tallies: why a peer's HELLO is refused (``refusal``, pure),
and the accepted connections closed before their HELLO, counted and summed up (``Tallies``).

Rules this module keeps:
- A HELLO is refused, in this order, for another job's token, another world size, a rank other
  than the one dialed, this rank itself, or a closed transport. The connection closes a refused
  one and logs it at ERROR, one line per connection: it is how two crossed jobs show.
- An accepted connection closed before its HELLO, for sending none within the handshake
  timeout or for breaking the protocol (garbage, another protocol, a bad header, half a frame
  then EOF), is counted per reason (``timeouts``, ``refusals``: ``stats()``). Such closes are
  summed up in one WARNING per reason at most every ``WARN_EVERY_S`` (a flood of idle
  connections must not flood the log), each summing those within ``COALESCE_S`` of the first
  and naming a few of their addresses; at close, those not reported yet are said below WARNING.
"""

from __future__ import annotations

import asyncio
import logging

from aiodist.transport._connection import CLOSED_REFUSAL, Connection
from aiodist.transport._standing import Standing
from aiodist.wire.frame import Hello

__all__ = ["refusal", "Tallies", "WARN_EVERY_S", "COALESCE_S"]

log = logging.getLogger("aiodist.transport")

WARN_EVERY_S = 10.0  # at most one warning this often about connections closed for want of a HELLO ...
COALESCE_S = 0.5  # ... each summing up those closed within this long of the first


def refusal(mine: Hello, hello: Hello, dialed: int | None, closed: bool) -> str | None:
    """Why a peer's ``hello`` is refused by the rank that says ``mine`` (``dialed``: the rank it
    dialed, None for an accepted connection; ``closed``: its transport is closed), or None."""
    if hello.token != mine.token:
        return f"rank {hello.rank} of another job (job token mismatch): two jobs on one host must not cross"
    if hello.world_size != mine.world_size:
        return f"rank {hello.rank} says the world size is {hello.world_size}, here it is {mine.world_size}"
    if dialed is not None and hello.rank != dialed:
        return f"dialed rank {dialed}, but rank {hello.rank} answered (stale address in the store?)"
    if hello.rank == mine.rank:
        return f"a connection from this rank ({hello.rank}) itself"
    if closed:
        return CLOSED_REFUSAL
    return None


class _Unheard:
    """Accepted connections closed before their HELLO for one reason, not reported yet."""

    __slots__ = ("count", "peers", "why", "report", "said")

    def __init__(self) -> None:
        self.count = 0
        self.peers: list[str] = []  # a few of their peers' addresses, for the report
        self.why = ""  # the first reason since the last report
        self.report: asyncio.TimerHandle | None = None
        self.said = -float("inf")  # when the last report was logged (loop time)


class Tallies:
    """The accepted connections of rank ``rank`` closed before their HELLO (the module docstring)."""

    def __init__(self, rank: int, handshake_timeout: float, standing: Standing) -> None:
        self.rank = rank
        self.handshake_timeout = handshake_timeout
        self.timeouts = 0  # accepted connections closed for sending no HELLO in time
        self.refusals = 0  # ... closed for breaking the protocol before a HELLO
        self._standing = standing
        self._late = _Unheard()  # the former, not reported yet
        self._broken = _Unheard()  # the latter

    def unheard(self, conn: Connection, why: str | None) -> None:
        """Accepted ``conn`` was closed before its HELLO: for sending none in time (``why`` None)
        or for breaking the protocol (``why``). Counted, and reported with its kind soon."""
        if why is None:
            self.timeouts += 1
            self._add(self._late, conn, "")
        else:
            self.refusals += 1
            self._add(self._broken, conn, why)

    def flush(self) -> None:
        """The transport closes: the closes not reported yet are said now, below WARNING."""
        for closes in (self._late, self._broken):
            if closes.report is not None:
                closes.report.cancel()
                self._report(closes, logging.INFO)

    def _add(self, closes: _Unheard, conn: Connection, why: str) -> None:
        closes.count += 1
        closes.why = closes.why or why
        if len(closes.peers) < 3:
            closes.peers.append(f"{conn.kind} {conn.peername!r}" if conn.peername else conn.kind)
        if closes.report is None and not self._standing.closed:
            loop = asyncio.get_running_loop()
            delay = max(COALESCE_S, closes.said + WARN_EVERY_S - loop.time())
            closes.report = loop.call_later(delay, self._report, closes, logging.WARNING)

    def _report(self, closes: _Unheard, level: int) -> None:
        n, peers, why = closes.count, closes.peers, closes.why
        closes.count, closes.peers, closes.why, closes.report = 0, [], "", None
        closes.said = asyncio.get_running_loop().time()
        if not n:
            return
        if closes is self._late:
            what = f"sent no HELLO within {self.handshake_timeout:g} s (AIODIST_HANDSHAKE_TIMEOUT; not an aiodist rank of this job, or one that stalled while connecting)"
            total = self.timeouts
        else:
            what = f"broke the protocol before their HELLO (not an aiodist rank; the first: {why})"
            total = self.refusals
        log.log(
            level,
            "rank %d: closed %d connection%s to its transport listeners that %s; from %s%s; %d so far, at most one such warning every %g s",
            self.rank,
            n,
            "" if n == 1 else "s",
            what,
            ", ".join(peers),
            ", ..." if n > len(peers) else "",
            total,
            WARN_EVERY_S,
        )
