"""``spawn`` / ``start_processes``: torch.multiprocessing.spawn for aiodist (docs/spawn.md).

``fn(rank, *args)`` runs in ``nprocs`` child processes. An ``async def fn`` (anything whose call
returns an awaitable) runs on a fresh event loop in the child, uvloop's when it is installed.
A child that raises writes its formatted traceback to a file of the context's temporary
directory and exits 1; the parent's ``join`` sees the first child that failed, stops the others
(SIGTERM, then SIGKILL when they outlive the grace period) and raises
``ProcessRaisedException`` (the child's rank and traceback) or ``ProcessExitedException`` (exit
code, or the signal's name). Children get ``PR_SET_PDEATHSIG`` = SIGINT on Linux, as torch's
do, so a parent that dies leaves no orphans.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]

_DEFAULT_GRACE_S = 30.0  # torch's wait between SIGTERM and SIGKILL when no grace_period is given


class ProcessException(Exception):
    """A child process failed. ``error_index`` is its rank (index), ``pid`` its process id."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = self.error_pid = error_pid

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A child raised an exception; the message carries its formatted traceback."""


class ProcessExitedException(ProcessException):
    """A child exited with a non-zero code without raising, or was killed by a signal
    (``signal_name``, e.g. ``"SIGKILL"``)."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int, signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name)


# -- the child's side ----------------------------------------------------------------------------


def _set_pdeathsig(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - no glibc
        pass


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _run(fn: Callable[..., Any], i: int, args: tuple[Any, ...]) -> None:
    if inspect.iscoroutinefunction(fn):

        async def main() -> Any:
            return await fn(i, *args)

        with asyncio.Runner(loop_factory=_new_loop) as runner:
            runner.run(main())
        return
    result = fn(i, *args)
    if inspect.isawaitable(result):  # a partial of an async def, or a function returning a coroutine

        async def finish() -> Any:
            return await result

        with asyncio.Runner(loop_factory=_new_loop) as runner:
            runner.run(finish())


def _wrap(fn: Callable[..., Any], i: int, args: tuple[Any, ...], error_file: str) -> None:
    """The child's entry point (module level, so the spawn start method can pickle it)."""
    # SIGINT is how the parent's death (and Ctrl-C) reaches us: a parent started in the
    # background by a shell ignores SIGINT, and we would inherit that and outlive it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _set_pdeathsig(signal.SIGINT)
    try:
        _run(fn, i, args)
    except KeyboardInterrupt:
        pass  # SIGINT: the parent is stopping us (or died); nothing to report, as in torch
    except Exception:  # SystemExit passes through: its code becomes the exit code
        text = traceback.format_exc()
        tmp = error_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, error_file)  # the parent never reads half a traceback
        sys.exit(1)


# -- the parent's side ---------------------------------------------------------------------------


class ProcessContext:
    """The running children of ``start_processes``/``spawn(join=False)``.

    ``join(timeout=None, grace_period=None)`` waits for the children as torch's does: True when
    all of them have exited 0; False when ``timeout`` passed with some still running; when one
    fails, the others are stopped and the failure is raised.
    """

    def __init__(self, processes: list[Any], error_files: list[str], tmpdir: str | None = None) -> None:
        self.error_files = error_files
        self.processes = processes
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        self._tmpdir = tmpdir

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]

    def _join_procs_with_timeout(self, timeout: float) -> None:
        """Join every process, ``timeout`` seconds for all of them together."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))

    def _cleanup(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def terminate(self, grace_period: float | None = None) -> None:
        """Stop every child still alive: SIGTERM, then SIGKILL to those alive after
        ``grace_period`` (default 30 s, torch's); waits until they are gone."""
        grace = _DEFAULT_GRACE_S if grace_period is None else grace_period
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        self._join_procs_with_timeout(grace)
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(10)

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until something happens) for the children.

        Returns True when every child has exited successfully, False when some still run.
        When a child failed: waits ``grace_period`` seconds (when given) for the others to end
        by themselves, SIGTERMs those still running, SIGKILLs those alive after another grace
        period (30 s when not given), then raises ``ProcessRaisedException`` or
        ``ProcessExitedException`` for the first child that failed.
        """
        if not self.sentinels:
            self._cleanup()
            return True
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        error_index: int | None = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            if not self.sentinels:
                self._cleanup()
                return True
            return False
        try:
            if grace_period is not None:
                self._join_procs_with_timeout(grace_period)
            self.terminate(grace_period)
            self.sentinels.clear()
            raise self._failure(error_index)
        finally:
            self._cleanup()

    def _failure(self, index: int) -> ProcessException:
        process = self.processes[index]
        code = int(process.exitcode)
        path = self.error_files[index]
        if not os.path.exists(path):
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"<Unknown signal {-code}>"
                return ProcessExitedException(f"process {index:d} terminated with signal {name}", index, process.pid, code, name)
            return ProcessExitedException(f"process {index:d} terminated with exit code {code:d}", index, process.pid, code)
        with open(path, encoding="utf-8") as fh:
            original = fh.read()
        msg = f"\n\n-- Process {index:d} terminated with the following error:\n{original}"
        return ProcessRaisedException(msg, index, process.pid)


class SpawnContext(ProcessContext):
    """torch's deprecated name for the context ``spawn(join=False)`` returns."""


def start_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Start ``nprocs`` processes running ``fn(i, *args)`` with ``start_method`` ("spawn",
    "fork" or "forkserver"). With ``join`` wait for all of them (raising on the first failure,
    after stopping the others) and return None; otherwise return the ``ProcessContext``."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        args = tuple(args)
    mp: Any = multiprocessing.get_context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="aiodist-spawn-")
    error_files = [os.path.join(tmpdir, f"error-{i}.txt") for i in range(nprocs)]
    processes: list[Any] = []
    context = ProcessContext(processes, error_files, tmpdir)
    try:
        for i in range(nprocs):
            process = mp.Process(target=_wrap, args=(fn, i, args, error_files[i]), daemon=daemon)
            process.start()
            processes.append(process)
        context.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        if not join:
            return context
        while not context.join():
            pass
    except BaseException:
        # a failure to start, or the parent interrupted while waiting: leave no child behind
        if any(p.is_alive() for p in processes):
            context.terminate(grace_period=5.0)
        context._cleanup()
        raise
    return None


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Spawn ``nprocs`` processes running ``fn(i, *args)`` (torch.multiprocessing.spawn).

    ``fn`` may be an ``async def``: each child runs it on a fresh event loop (uvloop when
    installed). With ``join=True`` (default) returns None once all children exited 0, or raises
    ``ProcessRaisedException`` / ``ProcessExitedException`` naming the first child that failed
    after stopping the others. With ``join=False`` returns the ``ProcessContext``.
    """
    if start_method != "spawn":
        import warnings

        warnings.warn(
            f"This method only supports start_method=spawn (got: {start_method}).\nTo use a different start_method use:\n\t\t aiodist.multiprocessing.start_processes(...)",
            FutureWarning,
            stacklevel=2,
        )
    return start_processes(fn, args, nprocs, join, daemon, start_method=start_method)
