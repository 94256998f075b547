"""``Work``: the handle of an issued op. It *is* an ``asyncio.Future`` whose result is the list
of the op's output arrays, with torch's ``Work`` methods on top.

Cancellation: the op belongs to its group, not to whoever awaits it (docs/architecture.md, "The rules of the API").
``work.cancel()`` refuses (returns False). Awaiting a Work (``await work``, ``await
work.wait()``) waits on a future of the awaiting task's own (a shield, without its cost), so
cancelling the awaiting task cancels that task at once and leaves the op running to
completion, or to its group's timeout. Such a wait given up while the op runs on (an asyncio
timeout, a cancelled task) is logged once per op, as a WARNING of ``aiodist.c10d``: the op's
outputs change when it completes, which must not come as a surprise.

asyncio's helpers (``wait_for``, ``wait``, ``gather``, ``shield``, ``ensure_future``) take a
Work for an awaitable, not for a future of their own to cancel (``asyncio.isfuture(work)`` is
False): they wrap it in a task that awaits it, as they wrap a coroutine. That is what makes
``asyncio.wait_for(work, t)`` raise ``TimeoutError`` at ``t`` on every Python: on 3.11 it
cancels the future it was given and then waits for it to finish, and a Work does not finish on
cancel. Its Future methods (``done``, ``result``, ``add_done_callback``, ...) are all there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator
from typing import Any

from aiodist._time import TimeoutLike, to_seconds
from aiodist.errors import DistError, DistTimeoutError

__all__ = ["Work"]

log = logging.getLogger("aiodist.c10d")


class Work(asyncio.Future[list[Any]]):
    """An issued op: ``await work`` (or ``await work.wait(timeout)``) for its outputs."""

    #: not a future to asyncio's helpers (``asyncio.isfuture``), which then await the Work in a
    #: task of their own instead of cancelling it (module docstring). A Work is never yielded
    #: to a task (``__await__`` yields its waiter), so nothing reads the flag.
    _asyncio_future_blocking = None  # type: ignore[assignment]
    _left_running = False  # a wait on it was given up while it ran (logged once)

    def __init__(self, op: str, group_desc: str, seq: int, outputs: list[Any], *, source_rank: int | None = None) -> None:
        super().__init__()
        self.op = op
        self.group_desc = group_desc
        self.seq = seq
        self._label: str | None = None  # "seq n" unless set (made when read: errors and reprs only)
        self._outputs = outputs
        self._source_rank = source_rank
        self._waiters: list[asyncio.Future[None]] | None = None  # the awaiting tasks' futures (__await__)

    @property
    def label(self) -> str:
        """How errors name the op: ``"seq n"``, ``"p2p seq n"`` for point-to-point."""
        return f"seq {self.seq}" if self._label is None else self._label

    @label.setter
    def label(self, value: str) -> None:
        self._label = value

    def __repr__(self) -> str:
        # not exception(): that marks a failure as retrieved, and asyncio would no longer warn
        # about a failed Work nobody awaited (a repr is taken by loggers and debuggers)
        state = "pending" if not self.done() else ("completed" if self.is_success_unseen() else "failed")
        return f"<Work {self.op} {self.group_desc} {self.label} {state}>"

    # -- cancellation refuses ----------------------------------------------------------------

    def cancel(self, msg: Any | None = None) -> bool:
        """Refuse: an op cannot be cancelled on one rank without the others falling out of step.
        Destroy (or ``abort()``) its group to tear it down."""
        return False

    # -- awaiting without cancelling the op ---------------------------------------------------------

    def __await__(self) -> Generator[Any, None, list[Any]]:
        # Not a shield (an outer future, two callbacks and one more loop turn per await): the
        # awaiting task waits on a plain future of its own, which the Work resolves the moment
        # it completes (``_wake``). Cancelling the task cancels that future only, at once.
        if not self.done():
            waiter = self._waiter()
            try:
                yield from waiter
            except BaseException as exc:  # cancelled (or closed): this waiter is no longer wanted
                ws = self._waiters
                if ws is not None and waiter in ws:
                    ws.remove(waiter)
                if isinstance(exc, asyncio.CancelledError):
                    self._given_up()
                raise
        try:
            return self.result()
        except DistError as exc:  # without the runner's frames: the sentence says it (_pending._trim)
            exc.__traceback__ = None
            raise

    __iter__ = __await__

    def _waiter(self) -> asyncio.Future[None]:
        """A future of the caller's own, resolved when the Work is (what ``__await__`` waits on;
        the blocking collectives await it directly, one generator fewer per op)."""
        waiter: asyncio.Future[None] = self.get_loop().create_future()
        ws = self._waiters
        if ws is None:
            self._waiters = [waiter]
        else:
            ws.append(waiter)
        return waiter

    def _given_up(self) -> None:
        """A wait on this Work was cancelled (an asyncio timeout, a cancelled task): where the op
        still runs, say so once, since it goes on and writes its outputs when it completes."""
        if self.done() or self._left_running:
            return
        self._left_running = True
        log.warning(
            "%s on %s (%s): a wait for it was cancelled (an asyncio timeout or a cancelled task) while the op "
            "is still running; it goes on in its group and will write its outputs when it completes "
            "(or fail at the group's timeout)",
            self.op,
            self.group_desc,
            self.label,
        )

    def _wake(self) -> None:
        ws = self._waiters
        if ws is not None:
            self._waiters = None
            for w in ws:
                if not w.done():
                    w.set_result(None)

    # -- torch's Work API ----------------------------------------------------------------------

    async def wait(self, timeout: TimeoutLike | None = None) -> bool:
        """Wait for the op; True once it completed; its error if it failed. ``timeout``
        (a timedelta or seconds) bounds this wait only: on expiry ``DistTimeoutError`` is raised
        and the op keeps running (it ends by itself or by its group's timeout)."""
        if timeout is None:
            await self
            return True
        seconds = to_seconds(timeout)
        try:
            async with asyncio.timeout(seconds):
                await asyncio.shield(self)
        except TimeoutError:
            if self.done():  # pragma: no cover - finished as the deadline passed
                self.result()
                return True
            raise DistTimeoutError(
                f"Work.wait: {self.op} on {self.group_desc} (seq {self.seq}) not done after {seconds:g} s; the op is still running"
            ) from None
        self.result()
        return True

    def is_completed(self) -> bool:
        """True once the op has finished, successfully or not."""
        return self.done()

    def is_success_unseen(self) -> bool:
        """``is_success()`` without marking a failure as retrieved (asyncio still warns about a
        failed Work nobody awaited)."""
        return self.done() and not self.cancelled() and getattr(self, "_exception", None) is None

    def is_success(self) -> bool:
        """True once the op has finished without an error."""
        return self.done() and self.exception() is None

    def source_rank(self) -> int:
        """The global rank a receive got its message from."""
        if self._source_rank is None:
            raise RuntimeError(f"source_rank() is only defined for receives, not for {self.op}")
        if self._source_rank < 0:
            raise RuntimeError(f"source_rank(): {self.op} ({self.label}) has not received its message yet")
        return self._source_rank

    def get_future(self) -> Work:
        """The future of the op's outputs: the Work itself."""
        return self

    def synchronize(self) -> None:
        """Stream semantics: a no-op for CPU ops."""

    def block_current_stream(self) -> None:
        """Stream semantics: a no-op for CPU ops."""

    # -- for the group -------------------------------------------------------------------------

    def _complete(self) -> None:
        if not self.done():
            super().set_result(self._outputs)
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.done():
            super().set_exception(exc)
            self._wake()

    # whoever else resolves a Work (a device backend's) wakes its awaiters too
    def set_result(self, result: list[Any]) -> None:
        super().set_result(result)
        self._wake()

    def set_exception(self, exception: type | BaseException) -> None:
        super().set_exception(exception)
        self._wake()
