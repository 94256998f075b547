"""Worker errors for the launcher: ``record`` and the failure report (torch.distributed.elastic.multiprocessing.errors).

A worker started by ``aiodist-run`` (or ``launch_agent``) gets ``TORCHELASTIC_ERROR_FILE`` in
its environment. ``@record`` on the worker's main function (sync or ``async def``) writes the
uncaught exception there as JSON, in torch's layout::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000",
                               "timestamp_ns": "1700000000123456789", "rank": "1"}}}

and re-raises it, so the process still exits non-zero. The launcher reads the file to name the
root cause of a failed job; a worker that wrote none is reported with the tail of its stderr.
Outside a launcher (no ``TORCHELASTIC_ERROR_FILE``) ``record`` only re-raises.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast

__all__ = ["record", "ChildFailedError", "ProcessFailure", "write_error_file", "read_error_file", "ERROR_FILE_ENV"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NOT_AVAILABLE = "<N/A>"
_COMM_ERRORS = frozenset({"DistNetworkError", "DistBackendError", "DistStoreError", "StoreTimeoutError", "DistTimeoutError"})

F = TypeVar("F", bound=Callable[..., Any])


def write_error_file(exc: BaseException, path: str | None = None) -> str | None:
    """Write ``exc`` (with its traceback) to ``path`` or ``$TORCHELASTIC_ERROR_FILE``; the path
    written, or None when there is nowhere to write. An existing file is overwritten: the last
    uncaught exception of the process is its cause of death."""
    path = path or os.environ.get(ERROR_FILE_ENV)
    if not path:
        return None
    now = time.time_ns()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(now // 1_000_000_000),
                "timestamp_ns": str(now),
                "rank": os.environ.get("RANK", ""),
            },
        }
    }
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_error_file(path: str) -> dict[str, Any] | None:
    """The JSON a worker wrote, or None when the file is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _failed(e: BaseException) -> None:
    """What ``record`` does with an exception leaving the main function: a clean ``SystemExit``
    (code None or 0) is not a failure; anything else is written to the error file."""
    if isinstance(e, SystemExit) and e.code in (None, 0):
        return
    write_error_file(e)


def record(fn: F, error_handler: object = None) -> F:
    """Decorate a worker's main function: an uncaught exception is written to
    ``TORCHELASTIC_ERROR_FILE`` and re-raised. Works on plain and ``async def`` functions
    (``error_handler`` is accepted for torch's signature and ignored)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except BaseException as e:
                _failed(e)
                raise

        return cast(F, awrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            _failed(e)
            raise

    return cast(F, wrapper)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class ProcessFailure:
    """One worker that exited non-zero: its ranks, pid, exit code (negative: killed by that
    signal), the error file it wrote (if any) and what the report shows as its traceback."""

    local_rank: int
    rank: int
    pid: int
    exitcode: int
    error_file: str = ""
    stderr_tail: str = ""
    observed_ns: int = field(default_factory=time.time_ns)
    hostname: str = field(default_factory=socket.getfqdn)
    message: str = ""
    traceback: str = ""
    timestamp_ns: int = 0
    resolve: bool = field(default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.resolve:  # built from another node's description: nothing to read here
            return
        data = read_error_file(self.error_file) if self.error_file else None
        msg = data.get("message") if data else None
        if isinstance(msg, dict):
            self.message = str(msg.get("message", ""))
            extra = msg.get("extraInfo") or {}
            self.traceback = str(extra.get("py_callstack", "")) or self.message
            try:
                self.timestamp_ns = int(extra.get("timestamp_ns") or int(extra.get("timestamp", 0)) * 1_000_000_000)
            except (TypeError, ValueError):
                self.timestamp_ns = 0
        elif isinstance(msg, str):
            self.message = self.traceback = msg
        else:
            self.error_file = ""
        if not self.timestamp_ns:
            self.timestamp_ns = self.observed_ns
        if not self.traceback:
            if self.message and self.stderr_tail:  # its traceback is in the rank's own output already
                self.traceback = f"{self.message} (no error file: the traceback is in rank {self.rank}'s output above)"
            elif self.stderr_tail:
                self.traceback = f"(no error file; last lines of stderr)\n{self.stderr_tail}"
            elif self.exitcode < 0:
                self.traceback = f"Signal {-self.exitcode} ({_signal_name(-self.exitcode)}) received by PID {self.pid}"
            else:
                self.traceback = (
                    f"To enable traceback see: decorate the worker's main with @aiodist.elastic.record (exit code {self.exitcode})"
                )

    @property
    def is_comm_error(self) -> bool:
        """Whether the worker died of a communication error (likely a consequence of another
        worker's failure): aiodist's DistNetworkError, DistBackendError or DistStoreError."""
        return self.message.split(":", 1)[0] in _COMM_ERRORS

    @property
    def signal_name(self) -> str:
        return _signal_name(-self.exitcode) if self.exitcode < 0 else ""

    def exit_text(self) -> str:
        if self.exitcode < 0:
            return f"{self.exitcode} (pid: {self.pid}) (signal {-self.exitcode}: {self.signal_name})"
        return f"{self.exitcode} (pid: {self.pid})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "rank": self.rank,
            "pid": self.pid,
            "exitcode": self.exitcode,
            "error_file": self.error_file,
            "hostname": self.hostname,
            "message": self.message,
            "traceback": self.traceback,
            "timestamp_ns": self.timestamp_ns,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessFailure:
        """A failure described by another node (its error file is not readable here)."""
        return cls(
            local_rank=int(d["local_rank"]),
            rank=int(d["rank"]),
            pid=int(d["pid"]),
            exitcode=int(d["exitcode"]),
            error_file=str(d.get("error_file", "")),
            hostname=str(d.get("hostname", "")),
            message=str(d.get("message", "")),
            traceback=str(d.get("traceback", "")),
            timestamp_ns=int(d.get("timestamp_ns", 0)),
            resolve=False,
        )


class ChildFailedError(Exception):
    """Raised by ``launch_agent`` when workers failed and no restarts remain. ``failures`` maps
    global rank to ``ProcessFailure``; the root cause is the one that failed first (by the
    time in its error file, else when the launcher saw it exit), preferring a failure that is
    not a communication error (see ``get_first_failure``)."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: the earliest failure, communication errors last. A worker that
        raises often tears down its process group (``finally: destroy_process_group()``)
        before its exception reaches ``@record``, so its peers' "connection lost" errors can be
        written first; a failure that is not one of aiodist's communication errors wins."""
        rank = min(self.failures, key=lambda r: (self.failures[r].is_comm_error, self.failures[r].timestamp_ns, r))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        width = 60
        root_rank, root = self.get_first_failure()
        others = [f for r, f in sorted(self.failures.items()) if r != root_rank]
        lines = [boarder_delim * width, f"{self.name} FAILED", section_delim * width, "Failures:"]
        if others:
            for i, f in enumerate(others, 1):
                lines += _format_failure(i, f, brief=True)
        else:
            lines.append("  <NO_OTHER_FAILURES>")
        lines += [section_delim * width, "Root Cause (first observed failure):"]
        lines += _format_failure(0, root, brief=False)
        lines.append(boarder_delim * width)
        return "\n".join(lines)


def _format_failure(idx: int, f: ProcessFailure, brief: bool) -> list[str]:
    when = datetime.fromtimestamp(f.timestamp_ns / 1e9).strftime("%Y-%m-%d_%H:%M:%S") if f.timestamp_ns else _NOT_AVAILABLE
    out = [
        f"[{idx}]:",
        f"  time      : {when}",
        f"  host      : {f.hostname}",
        f"  rank      : {f.rank} (local_rank: {f.local_rank})",
        f"  exitcode  : {f.exit_text()}",
        f"  error_file: {f.error_file or _NOT_AVAILABLE}",
    ]
    if brief:
        out.append(f"  message   : {f.message or _NOT_AVAILABLE}")
    else:
        out.append("  traceback :")
        out += ["    " + line for line in f.traceback.rstrip("\n").splitlines()]
    return out
