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
from collections.abc import Iterator
from types import FrameType
from typing import Any, TypeAlias

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


# An entry is a list (one BUILD_LIST per op, the cheapest record Python makes; the fields are
# set by index): id, op, record_comm name, seq, kind, meta, state, and the times.
Entry: TypeAlias = list[Any]  # [id, op, name, seq, kind, meta, state, t_issued, t_started, t_done, error, stack]
ID, OP, NAME, SEQ, KIND, META, STATE, T_ISSUED, T_STARTED, T_DONE, ERROR, STACK = range(12)


def entry_json(e: Entry) -> dict[str, Any]:
    t_started, t_done = e[T_STARTED], e[T_DONE]
    return {
        "id": e[ID],
        "op": e[OP],
        "record_comm": e[NAME],
        "seq": e[SEQ],
        "kind": e[KIND],
        "meta": e[META] or {},
        "state": e[STATE],
        "time_issued": e[T_ISSUED],
        "time_started": t_started,
        "time_done": t_done,
        "duration_s": None if t_done is None or t_started is None else t_done - t_started,
        "error": e[ERROR],
        "stack": e[STACK],
    }


def finished(e: Entry, work: Any) -> None:
    """The op of entry ``e`` ended: completed, or failed with its Work's error (an entry already
    marked "timed out" keeps that state)."""
    e[T_DONE] = time.time()
    if e[STATE] == "timed out" or not work.done():
        return
    exc = None if work.cancelled() else work.exception()
    if exc is None and not work.cancelled():
        e[STATE] = "completed"
    else:
        e[STATE], e[ERROR] = "failed", str(exc) if exc is not None else "cancelled"


class FlightRecorder:
    """The last ``size`` ops of one group on this rank: a ring of entries (see ``Entry``).

    Measured on a 1-float all_reduce between 2 processes (~95 us), the recorder's whole cost is
    a few microseconds per op; AIODIST_FR_BUFFER_SIZE=0 removes it (docs/debugging.md)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = buffer_size() if size is None else size
        self._ring: list[Entry] = []
        self.recorded = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    @property
    def entries(self) -> list[Entry]:
        """The entries held, oldest first."""
        if len(self._ring) < self.size or not self.size:
            return list(self._ring)
        i = self.recorded % self.size
        return self._ring[i:] + self._ring[:i]

    def issued(self, op: str, seq: int, kind: str, meta: dict[str, Any] | None, *, with_stack: bool = False) -> Entry | None:
        size = self.size
        if not size:
            return None
        n = self.recorded
        self.recorded = n + 1
        e = [n, op, _COMM_NAME.get(), seq, kind, meta, "issued", time.time(), None, None, None, user_stack() if with_stack else None]
        ring = self._ring
        if n < size:
            ring.append(e)
        else:
            ring[n % size] = e
        return e

    def to_json(self) -> list[dict[str, Any]]:
        return [entry_json(e) for e in self.entries]


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
