"""The launcher's console: workers' lines go to its stdout/stderr through a bounded buffer that
a writer thread drains, so a console that reads slowly, or not at all, never blocks the agent's
event loop (its signal handling, its heartbeats, the watch of its workers).

Rules it keeps: ``write`` never blocks; whole batches of lines are queued or dropped, never cut;
lines dropped because the buffer was full are counted and the count is written, as a line of
its own, once there is room again (or at ``close``); ``close`` waits for the buffer to drain only
while the console takes bytes (it gives up after ``stall`` seconds without progress).
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from typing import TextIO

__all__ = ["Console", "CONSOLE_BUFFER_BYTES"]

CONSOLE_BUFFER_BYTES = 8 << 20  # per stream: a few seconds of a very chatty job


class Console:
    """Writes bytes to ``target`` (the launcher's ``sys.stdout`` or ``sys.stderr``).

    With a file descriptor (a terminal, a pipe, a file) the bytes go out through ``os.write`` on a
    thread of their own, all of them (a partial write is continued: Python's buffered writer lost
    pieces of long lines when a slow reader met the launcher's signal handling). Without one (a
    replaced ``sys.stdout``: an in-process object) the decoded text is written at once."""

    def __init__(self, target: TextIO, limit: int = CONSOLE_BUFFER_BYTES, name: str = "aiodist-run console") -> None:
        self._target = target
        self._limit = limit
        self._name = name
        try:
            self._fd: int | None = target.fileno()
        except (OSError, ValueError, AttributeError):
            self._fd = None
        self._cond = threading.Condition()
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued = 0  # bytes in _queue
        self._busy = False  # the thread holds a chunk it is writing
        self._dropped = 0  # lines dropped since the last marker
        self._written = 0  # bytes the console took (progress, for close)
        self._broken = False  # the console is gone (closed pipe): everything is dropped, silently
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> TextIO:
        return self._target

    @property
    def dropped_total(self) -> int:
        """Lines dropped so far and not yet reported by a marker line."""
        return self._dropped

    def write(self, data: bytes) -> None:
        """Queue ``data`` (whole lines); drop it, counted, when the buffer is full. Never blocks
        on the console."""
        if self._fd is None:
            self._write_text(data)
            return
        with self._cond:
            if self._broken or self._closing:
                return
            if self._queued + len(data) > self._limit:
                self._dropped += max(1, data.count(b"\n"))
                return
            if self._dropped:
                self._put(self._marker())
            self._put(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, stall: float = 1.0, timeout: float = 30.0) -> bool:
        """Let the queued lines out, waiting while the console takes them: at most ``stall`` s
        without progress, ``timeout`` s in all. True when everything was written. Lines still
        queued then are left behind (the thread, a daemon, may stay blocked in its write)."""
        if self._fd is None:
            return True
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._dropped and not self._broken:
                self._put(self._marker())
                self._cond.notify()
            self._closing = True
            last, since = self._written, time.monotonic()
            while (self._queue or self._busy) and not self._broken and self._thread is not None:
                now = time.monotonic()
                if self._written != last:
                    last, since = self._written, now
                if now - since >= stall or now >= deadline:
                    return False
                self._cond.wait(min(0.05, stall))
            self._cond.notify_all()
            return not self._broken

    # -- the writer thread -------------------------------------------------------------------

    def _put(self, data: bytes) -> None:
        self._queue.append(data)
        self._queued += len(data)

    def _marker(self) -> bytes:
        n, self._dropped = self._dropped, 0
        return f"[aiodist-run]: {n} line(s) of worker output dropped: the console did not keep up\n".encode()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                data = self._queue.popleft()
                self._busy = True
            ok = self._write_fd(data)
            with self._cond:
                self._busy = False
                self._queued -= len(data)
                if not ok:
                    self._broken = True
                    self._queue.clear()
                    self._queued = 0
                self._cond.notify_all()
                if self._broken:
                    return

    def _write_fd(self, data: bytes) -> bool:
        fd = self._fd
        assert fd is not None
        try:
            self._target.flush()  # whatever the launcher itself printed first
        except (OSError, ValueError, RuntimeError):
            pass
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:  # someone made the descriptor non-blocking: wait for it here
                    select.select([], [fd], [], 1.0)
                    continue
                view = view[n:]
                with self._cond:
                    self._written += n
        except (OSError, ValueError):  # closed pipe or file: keep draining the workers, print nothing
            return False
        return True

    def _write_text(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self._target.write(data.decode(errors="replace"))
            self._target.flush()
        except (OSError, ValueError):
            self._broken = True
