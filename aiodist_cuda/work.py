"""``CudaWork``: the Work of a GPU op, with torch's CUDA semantics on top of aiodist's Work.

- ``await work`` (and ``await op(...)`` without ``async_op``) resolves when the GPU has finished
  the op: the event loop is told by a completion thread (or a stream host function), never by
  polling, and nothing blocks the loop meanwhile.
- ``await work.wait()``: torch's meaning: the caller's *current stream* waits for the op; the
  CPU does not (it returns once the op is enqueued). ``wait(timeout)`` instead waits for the GPU
  to finish, at most ``timeout`` (torch: a timeout makes ``wait`` block the CPU).
- ``synchronize()`` / ``block_current_stream()``: make the current stream wait; they return at
  once where the op is enqueued (the usual case). Before the enqueue (the group's communicator
  is still being made: see docs/cuda.md) they wait for it, bounded by the group's timeout, from
  another thread; on the Work's own loop thread, which must run the enqueue, they raise at once
  instead of blocking it (a deadlock until the group's timeout before, issue 14).
- ``is_completed()``: True once the GPU has finished the op (the completion event has fired).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiodist._time import TimeoutLike
from aiodist.c10d.work import Work
from aiodist.errors import DistBackendError

__all__ = ["CudaWork", "OpRecord"]


class OpRecord:
    """One GPU op as the launcher thread and the loop share it."""

    __slots__ = ("launch", "ready", "done_event", "enqueued", "future", "keep", "what", "device_id", "timeout_s", "on_end")

    def __init__(self, launch: Any, ready: Any, keep: list[Any], what: str, device_id: int, timeout_s: float) -> None:
        self.launch = launch  # launch(comm, stream): the NCCL calls (runs on the launcher thread)
        self.ready = ready  # event recorded on the caller's stream at issue
        self.done_event: Any = None  # event recorded on the group's stream after the op
        self.enqueued = threading.Event()
        self.future: asyncio.Future[None] | None = None  # resolved on the loop when the GPU is done
        self.keep = keep  # arrays the GPU uses: alive until the op is done (CuPy has no recordStream)
        self.what = what
        self.device_id = device_id
        self.timeout_s = timeout_s
        self.on_end: Any = None  # called on the loop when the op has ended on the GPU (or failed)

    def _ended(self) -> None:
        self.keep = []
        if self.on_end is not None:
            self.on_end(self)
            self.on_end = None

    def resolve(self) -> None:
        """On the loop: the GPU finished the op."""
        self._ended()
        fut = self.future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """On the loop: the op could not be enqueued or failed."""
        self._ended()
        fut = self.future
        if fut is not None and not fut.done():
            fut.set_exception(exc)


class CudaWork(Work):
    """A GPU op's Work (see the module docstring)."""

    def __init__(self, op: str, group_desc: str, seq: int, outputs: list[Any], record: OpRecord, cupy: Any) -> None:
        super().__init__(op, group_desc, seq, outputs)
        self._record = record
        self._cupy = cupy

    def _stream_wait(self) -> None:
        rec = self._record
        if not rec.enqueued.is_set():
            if self.done():  # failed before it was enqueued: nothing for a stream to wait on
                self.result()
                return
            if self._on_its_loop():  # the enqueue needs this very loop (the communicator's id exchange): never block it
                raise DistBackendError(
                    f"{self.op} on {self.group_desc} ({self.label}) is not enqueued yet (its group's NCCL communicator is still "
                    "being made, on this event loop): synchronize()/block_current_stream() would block the loop that must "
                    "enqueue it; `await work.wait()` instead, or call them from another thread"
                )
            if not rec.enqueued.wait(rec.timeout_s):
                raise DistBackendError(f"{self.op} on {self.group_desc} ({self.label}) was not enqueued within {rec.timeout_s:g} s")
        if rec.done_event is None:  # enqueue failed: the Work carries the error
            self.result()
            return
        with self._cupy.cuda.Device(rec.device_id):
            self._cupy.cuda.get_current_stream().wait_event(rec.done_event)

    def _on_its_loop(self) -> bool:
        """Called on the thread running the loop this Work belongs to."""
        try:
            return asyncio.get_running_loop() is self.get_loop()
        except RuntimeError:
            return False

    async def wait(self, timeout: TimeoutLike | None = None) -> bool:
        """The current stream waits for the op (the CPU does not); ``timeout``: wait for the GPU."""
        if timeout is not None:
            return await super().wait(timeout)
        rec = self._record
        if not rec.enqueued.is_set() and not self.done():
            await asyncio.to_thread(rec.enqueued.wait, rec.timeout_s)
        if self.done() and self.exception() is not None:
            self.result()
        self._stream_wait()
        return True

    def synchronize(self) -> None:
        """The current stream waits for the op (torch's ``Work.synchronize`` for NCCL)."""
        self._stream_wait()

    def block_current_stream(self) -> None:
        """The current stream waits for the op; returns at once."""
        self._stream_wait()

    def is_completed(self) -> bool:
        if self.done():
            return True
        ev = self._record.done_event
        return bool(ev is not None and ev.done)
