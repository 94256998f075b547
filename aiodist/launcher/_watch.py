"""What one agent sees of the other nodes during a multi-node round, gathered beside the agent's
monitor loop: the round's first failure and "every node done" arrive by store waits (one
request each, answered by the server when the key is set: no polling), heartbeats by one look
every ``heartbeat_interval``. Each change sets the loop's wake event; the loop reads the
fields into a ``View`` and ``next_action`` decides (``aiodist.launcher._decide``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiodist.elastic.errors import ProcessFailure
from aiodist.errors import DistError
from aiodist.launcher._decide import heartbeat_interval
from aiodist.launcher.rendezvous import AgentRendezvous

__all__ = ["RoundWatch"]

_STORE_ERRORS = (DistError, OSError, TimeoutError)


def _readable(record: dict[str, Any] | Exception) -> dict[str, Any]:
    """A published failure as the agent reads it (``ProcessFailure.from_dict``); one that is
    not (or that did not decode: ``record`` is the error) is still a remote failure, said as
    such: the round must end either way."""
    try:
        if isinstance(record, Exception):
            raise record
        ProcessFailure.from_dict(record)
        return dict(record)
    except (KeyError, ValueError, TypeError) as exc:
        why = f"unreadable failure record ({type(exc).__name__}: {exc})"
    return ProcessFailure(-1, -1, 0, 1, hostname="another node", message=why, resolve=False).to_dict()


class RoundWatch:
    """Round ``k``'s news from the rendezvous store (see the module docstring). ``ok_at``: when
    the store last answered a heartbeat look; ``error``: why the last look failed (None: it
    did not). Every wait is bounded: a wait that times out is armed again, one that fails is
    retried after a heartbeat interval (the store client reconnects)."""

    def __init__(self, rdzv: AgentRendezvous, k: int, wake: asyncio.Event, log: logging.Logger | Any) -> None:
        self.rdzv, self.k, self._wake, self._log = rdzv, k, wake, log
        self.remote: dict[str, Any] | None = None
        self.all_done = False
        self.peers: dict[int, float] = {}
        self.ok_at = time.monotonic()
        self.error: BaseException | None = None
        self.interval = heartbeat_interval(rdzv.heartbeat_timeout)
        # A wait's own length: when it passes with nothing set, the wait is armed again (its
        # timing out closes its waiter connection: rare enough at this length).
        self._wait_s = max(rdzv.heartbeat_timeout, 1.0)
        self._tasks = [asyncio.ensure_future(self._failure()), asyncio.ensure_future(self._beats())]
        self._done: asyncio.Task[None] | None = None

    @property
    def watching(self) -> bool:
        """Until ``close``."""
        return bool(self._tasks)

    def local_done(self) -> None:
        """This node's workers all exited 0: say so, and wait for the other nodes' word."""
        if self._done is None:
            self._done = asyncio.ensure_future(self._all_done())
            self._tasks.append(self._done)

    async def close(self) -> None:
        """Stop watching (a cancellation of the caller meanwhile propagates)."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, Exception):  # a watcher's failure nobody waits for any more
                self._log.debug("rendezvous watcher: %s", r)

    async def _retry_after(self, exc: BaseException, what: str) -> None:
        self._log.debug("rendezvous store (%s): %s: %s", what, type(exc).__name__, exc)
        await asyncio.sleep(self.interval)

    async def _failure(self) -> None:
        while True:
            start = time.monotonic()
            try:
                record: dict[str, Any] | Exception = await self.rdzv.wait_failure(self.k, self._wait_s)
            except (ValueError, TypeError) as exc:  # the record is there, but not a JSON object
                record = exc
            except _STORE_ERRORS as exc:
                if not (isinstance(exc, TimeoutError) and time.monotonic() - start >= self._wait_s / 2):
                    await self._retry_after(exc, "waiting for a failure")
                continue
            self.remote = _readable(record)
            self._wake.set()
            return

    async def _all_done(self) -> None:
        marked = False
        while True:
            try:
                if not marked:
                    await self.rdzv.mark(self.k, "done")
                    marked = True
                if await self.rdzv.wait_marked(self.k, "done", self._wait_s):
                    break
            except _STORE_ERRORS as exc:
                await self._retry_after(exc, "waiting for the other nodes to finish")
        self.all_done = True
        self._wake.set()

    async def _beats(self) -> None:
        while True:
            try:
                self.peers = await self.rdzv.heartbeat(self.k)
            except _STORE_ERRORS as exc:  # silence is judged by the decision (ok_at)
                self.error = exc
                self._log.debug("rendezvous store (heartbeat): %s: %s", type(exc).__name__, exc)
            else:
                self.ok_at, self.error = time.monotonic(), None
            self._wake.set()
            await asyncio.sleep(self.interval)
