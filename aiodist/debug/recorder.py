"""The flight recorder: every group keeps a ring buffer of its last N ops (N from
``AIODIST_FR_BUFFER_SIZE``, default 2000; 0 turns it off) with the op's name (or the
``record_comm`` name around it), sequence number, shapes/dtypes/root/reduce op, state
(issued, started, completed, failed) and timestamps; at DETAIL also the issuing coroutine's stack.

``dump_flight_recorder(path=None)`` returns (and writes, given a path) one rank's recorders as a
JSON-able dict; ``AIODIST_FR_DUMP_ON_TIMEOUT=1`` dumps automatically when an op times out, into
``AIODIST_FR_DUMP_DIR`` (default: the current directory) as ``aiodist_fr_rank<N>.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import linecache
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "FlightRecorder",
    "Entry",
    "record_comm",
    "current_comm_name",
    "dump_flight_recorder",
    "buffer_size",
    "FORMAT_VERSION",
    "user_stack",
]

FORMAT_VERSION = 1
_DEFAULT_SIZE = 2000

_COMM_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("aiodist_record_comm", default=None)


_AIODIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ASYNCIO_DIR = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep
STACK_LIMIT = 16


def user_stack(limit: int = STACK_LIMIT, frame: FrameType | None = None) -> list[str]:
    """The issuing coroutine's chain of user frames, outermost first, as
    ``"file:line in func: source"``: aiodist's own frames (the API call, issue, the recorder) are
    dropped, and the walk stops at asyncio's (the task's step, the loop), which are the same for
    every op. A coroutine's frame links to the coroutine that awaits it, so this is the await
    chain of the issuing task, down from its outermost coroutine."""
    f: FrameType | None = sys._getframe(1) if frame is None else frame
    out: list[str] = []
    while f is not None and len(out) < limit:
        name = f.f_code.co_filename
        if name.startswith(_ASYNCIO_DIR):
            break  # the task boundary: the rest is the event loop
        if not name.startswith(_AIODIST_DIR):
            line = linecache.getline(name, f.f_lineno).strip()
            out.append(f"{name}:{f.f_lineno} in {f.f_code.co_name}" + (f": {line}" if line else ""))
        f = f.f_back
    task = asyncio.current_task() if _running_loop() else None
    if task is not None:
        out.append(f"task {task.get_name()!r}")
    out.reverse()
    return out


def _running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def buffer_size() -> int:
    value = os.environ.get("AIODIST_FR_BUFFER_SIZE")
    if value is None or value == "":
        return _DEFAULT_SIZE
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"AIODIST_FR_BUFFER_SIZE={value!r} is not an int") from None
    return max(n, 0)


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Name the collectives issued inside this block (in this task and the tasks it starts) in
    the flight recorder and in profiling output."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"record_comm needs a non-empty name, got {name!r}")
    token = _COMM_NAME.set(name)
    try:
        yield
    finally:
        _COMM_NAME.reset(token)


def current_comm_name() -> str | None:
    return _COMM_NAME.get()


class Entry:
    """One op in a flight recorder."""

    __slots__ = ("id", "op", "name", "seq", "kind", "meta", "state", "t_issued", "t_started", "t_done", "error", "stack")

    def __init__(self, id: int, op: str, seq: int, kind: str, meta: dict[str, Any] | None, stack: list[str] | None) -> None:
        self.id = id
        self.op = op
        self.name = _COMM_NAME.get()
        self.seq = seq
        self.kind = kind  # "collective" or "p2p"
        self.meta = meta
        self.state = "issued"
        self.t_issued = time.time()
        self.t_started: float | None = None
        self.t_done: float | None = None
        self.error: str | None = None
        self.stack = stack

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "op": self.op,
            "record_comm": self.name,
            "seq": self.seq,
            "kind": self.kind,
            "meta": self.meta or {},
            "state": self.state,
            "time_issued": self.t_issued,
            "time_started": self.t_started,
            "time_done": self.t_done,
            "duration_s": None if self.t_done is None or self.t_started is None else self.t_done - self.t_started,
            "error": self.error,
            "stack": self.stack,
        }


class FlightRecorder:
    """The last ``size`` ops of one group on this rank."""

    def __init__(self, size: int | None = None) -> None:
        self.size = buffer_size() if size is None else size
        self.entries: deque[Entry] = deque(maxlen=self.size or 1)
        self.recorded = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def issued(self, op: str, seq: int, kind: str, meta: dict[str, Any] | None, *, with_stack: bool = False) -> Entry | None:
        if not self.size:
            return None
        stack = user_stack() if with_stack else None
        e = Entry(self.recorded, op, seq, kind, meta, stack)
        self.recorded += 1
        self.entries.append(e)
        return e

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries]


def dump_flight_recorder(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """This rank's flight recorders (every live group of the current World) as a dict; written as
    JSON to ``path`` when given (a directory gets ``aiodist_fr_rank<N>.json`` inside it)."""
    from aiodist.c10d.world import current_world

    world = current_world()
    data: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "rank": world.rank,
        "world_size": world.world_size,
        "pid": os.getpid(),
        "time": time.time(),
        "groups": [
            {
                "group_id": g.group_id,
                "desc": g.group_desc,
                "ranks": list(g.ranks),
                "group_rank": g.rank(),
                "seq": g.seq,
                "p2p_seq": g.p2p_seq,
                "completed": g.completed,
                "broken": g.broken,
                "timeout_s": g.timeout_s,
                "entries": g.recorder.to_json(),
            }
            for g in world.groups.values()
        ],
    }
    if path is not None:
        target = os.fspath(path)
        if os.path.isdir(target):
            target = os.path.join(target, f"aiodist_fr_rank{world.rank}.json")
        tmp = f"{target}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, target)
    return data


def dump_on_timeout() -> None:
    """``AIODIST_FR_DUMP_ON_TIMEOUT=1``: write this rank's dump (called when an op times out)."""
    if os.environ.get("AIODIST_FR_DUMP_ON_TIMEOUT", "") not in ("1", "true", "True", "yes"):
        return
    directory = os.environ.get("AIODIST_FR_DUMP_DIR") or os.getcwd()
    os.makedirs(directory, exist_ok=True)
    dump_flight_recorder(directory)
