"""The flight recorder: every group keeps a ring buffer of its last N ops (N from
``AIODIST_FR_BUFFER_SIZE``, default 2000; 0 turns it off) with the op's name (or the
``record_comm`` name around it), sequence number, shapes/dtypes/root/reduce op, state
(issued, started, completed, failed, timed out) and timestamps; at DETAIL also the issuing
coroutine's stack (its user frames: see ``user_stack``). Format and costs: docs/debugging.md.

``dump_groups(rank, world_size, groups, path=None)`` returns (and writes, given a path) one rank's
recorders as a JSON-able dict (``aiodist.debug.dump_flight_recorder`` passes the current World's groups); ``AIODIST_FR_DUMP_ON_TIMEOUT=1`` dumps automatically when an op times out, into
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
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any, TypeAlias

from aiodist.knobs import knob, value

__all__ = [
    "FlightRecorder",
    "Entry",
    "record_comm",
    "current_comm_name",
    "dump_groups",
    "dump_dir_on_timeout",
    "buffer_size",
    "FORMAT_VERSION",
    "user_stack",
]

FORMAT_VERSION = 1
_DEFAULT_SIZE = 2000

#: the state of a slot written by ``done_now`` (an op completed in its issuing call)
_DONE_NOW = "completed in its call"

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
    return max(knob("AIODIST_FR_BUFFER_SIZE").whole(), 0)


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


# How entries are kept, and why. A recorder is on by default (OFF included), so it must cost
# next to nothing per op. Python's cyclic GC is the trap: containers kept for thousands of ops (an
# object per entry, the call's meta dict) are promoted to the oldest generation and bring on full
# collections of the whole heap; while a ring of such objects filled, a 2-process 1-float
# all_reduce loop measured ~20 us more per op (~95 us). So nothing an entry keeps is tracked by
# the GC: what is known at issue is one tuple of strings and numbers, the meta dict frozen into
# one flat tuple (CPython untracks such tuples at their first collection), and what changes
# (state, times, error) sits in parallel lists of atomic values, slot i = id % size. An op
# refers to its entry by id (an int); a slot since reused for a newer op is left alone. What is
# left is the per-op code itself, ~4 us per op on that loop (docs/debugging.md).
Entry: TypeAlias = int  # an entry's id: its number among the ops this recorder has seen
_ID, _OP, _NAME, _SEQ, _KIND, _T_ISSUED = range(6)
_GROW = 256  # slots added at once while the ring fills (appending per op was seven calls)
_LIST, _DICT = "\0list", "\0dict"  # markers in a frozen meta (no real key holds a NUL)


def _freeze(meta: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """``meta`` as one flat tuple of (key, subkey, value) triples: a tuple of strings and
    numbers only, which the GC stops tracking at its first collection (a nested one would take
    one collection per level)."""
    if not meta:
        return None
    out: list[Any] = []
    for k, v in meta.items():
        if type(v) is dict:
            if not v:
                out += (k, _DICT, None)
            for kk, vv in v.items():
                out += (k, kk, tuple(vv) if type(vv) is list else vv)
        elif type(v) is list:
            out += (k, _LIST, tuple(v))
        else:
            out += (k, None, v)
    return tuple(out)


def _thaw(frozen: tuple[Any, ...] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not frozen:
        return out
    for j in range(0, len(frozen), 3):
        k, sub, v = frozen[j : j + 3]
        if sub is None:
            out[k] = v
        elif sub == _LIST:
            out[k] = list(v)
        else:
            d = out.setdefault(k, {})
            if sub != _DICT:
                d[sub] = list(v) if type(v) is tuple else v
    return out


class FlightRecorder:
    """The last ``size`` ops of one group on this rank (a ring; see the comment above)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = buffer_size() if size is None else size
        self.recorded = 0
        self._fixed: list[tuple[Any, ...]] = []  # (id, op, name, seq, kind, t_issued)
        self._meta: list[tuple[Any, ...] | None] = []  # _freeze(meta)
        self._stack: list[tuple[str, ...] | None] = []  # DETAIL
        self._state: list[str] = []
        self._t_started: list[float | None] = []
        self._t_done: list[float | None] = []
        self._error: list[str | None] = []

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def issued(
        self, op: str, seq: int, kind: str, meta: dict[str, Any] | None, *, with_stack: bool = False, frozen: tuple[Any, ...] | None = None
    ) -> Entry | None:
        """Record an op as issued; its entry's id (None when the recorder is off). ``frozen`` is
        ``_freeze(meta)`` already made (a collective's cached description), else it is made here."""
        size = self.size
        if not size:
            return None
        n = self.recorded
        self.recorded = n + 1
        fixed = (n, op, _COMM_NAME.get(), seq, kind, time.time())
        if frozen is None and meta:
            frozen = _freeze(meta)
        stack = tuple(user_stack()) if with_stack else None
        i = n % size
        if i >= len(self._fixed):  # the ring grows in chunks while it fills: slots are then only assigned
            self._grow()
        self._fixed[i] = fixed
        self._meta[i] = frozen
        self._stack[i] = stack
        self._state[i] = "issued"
        self._t_started[i] = self._t_done[i] = self._error[i] = None
        return n

    def done_now(self, op: str, seq: int, frozen: tuple[Any, ...] | None) -> None:
        """Record a collective that completed in its issuing call: one clock read (issued,
        started and done at that time) and three slot writes, where an op that ran in a task
        pays ``issued``, ``started`` and ``ended``. Its state reads "completed" (``entry_json``:
        ``_DONE_NOW`` stands for it, with no stack, error or times of its own)."""
        size = self.size
        if not size:
            return
        n = self.recorded
        self.recorded = n + 1
        i = n % size
        if i >= len(self._fixed):
            self._grow()
        self._fixed[i] = (n, op, _COMM_NAME.get(), seq, "collective", time.time())
        self._meta[i] = frozen
        self._state[i] = _DONE_NOW

    def _grow(self) -> None:
        more = min(_GROW, self.size - len(self._fixed))
        self._fixed += [(-1,)] * more  # id -1: no op holds the slot yet
        for lst in (self._meta, self._stack, self._state, self._t_started, self._t_done, self._error):
            lst += [None] * more

    def note(
        self, op: str, kind: str, meta: dict[str, Any] | None, t_start: float, t_done: float, error: str | None = None
    ) -> Entry | None:
        """Record an event that is not an op of the group, already over (the loop watchdog's
        ``loop_blocked``: ``kind="loop"``, seq -1; the analyzer compares collectives only)."""
        n = self.issued(op, -1, kind, meta)
        if n is None:
            return None
        i = n % self.size
        self._fixed[i] = (n, op, None, -1, kind, t_start)
        self._state[i] = "completed"
        self._t_started[i], self._t_done[i], self._error[i] = t_start, t_done, error
        return n

    def _slot(self, n: Entry) -> int | None:
        i = n % self.size
        return i if self._fixed[i][_ID] == n else None  # None: the slot holds a newer op now

    def started(self, n: Entry) -> float:
        """Mark the op as started; the time recorded (``time.time()``), for the runner to reuse."""
        t = time.time()
        i = n % self.size
        if self._fixed[i][_ID] == n:
            self._state[i] = "started"
            self._t_started[i] = t
        return t

    def idle(self, n: Entry) -> None:
        """The op waits for its group's leader to issue it (``idle_until_leader``): no deadline
        runs, and the debug page calls it idle, not stuck; ``started`` follows the leader's go."""
        i = n % self.size
        if self._fixed[i][_ID] == n:
            self._state[i] = "idle"

    def timed_out(self, n: Entry, msg: str) -> None:
        i = self._slot(n)
        if i is not None:
            self._state[i], self._error[i] = "timed out", msg

    def ended(self, n: Entry, work: Any) -> None:
        """The op's task is leaving: its Work failed (recorded as failed, with the error), or it
        is about to complete (the Work is not resolved yet: completed). "timed out" stays."""
        i = n % self.size
        if self._fixed[i][_ID] != n:
            return
        self._t_done[i] = time.time()
        if not work.done():
            if self._state[i] != "timed out":
                self._state[i] = "completed"
            return
        self.finished(n, work)

    def finished(self, n: Entry, work: Any) -> None:
        """The op ended: completed, or failed with its Work's error ("timed out" stays)."""
        i = n % self.size
        if self._fixed[i][_ID] != n:
            return
        self._t_done[i] = time.time()
        if self._state[i] == "timed out" or not work.done():
            return
        exc = None if work.cancelled() else work.exception()
        if exc is None and not work.cancelled():
            self._state[i] = "completed"
        else:
            self._state[i], self._error[i] = "failed", str(exc) if exc is not None else "cancelled"

    def _order(self) -> list[int]:
        held = min(self.recorded, self.size)
        if held < self.size or not self.size:
            return list(range(held))
        start = self.recorded % self.size
        return [*range(start, held), *range(start)]

    def entry_json(self, i: int) -> dict[str, Any]:
        f, stack, state, error = self._fixed[i], self._stack[i], self._state[i], self._error[i]
        t_started, t_done = self._t_started[i], self._t_done[i]
        if state is _DONE_NOW:  # (the other lists may hold the slot's previous op)
            state, stack, error, t_started, t_done = "completed", None, None, f[_T_ISSUED], f[_T_ISSUED]
        return {
            "id": f[_ID],
            "op": f[_OP],
            "record_comm": f[_NAME],
            "seq": f[_SEQ],
            "kind": f[_KIND],
            "meta": _thaw(self._meta[i]),
            "state": state,
            "time_issued": f[_T_ISSUED],
            "time_started": t_started,
            "time_done": t_done,
            "duration_s": None if t_done is None or t_started is None else t_done - t_started,
            "error": error,
            "stack": None if stack is None else list(stack),
        }

    def to_json(self) -> list[dict[str, Any]]:
        """The entries held, oldest first, as dump_flight_recorder writes them."""
        return [self.entry_json(i) for i in self._order()]


def dump_groups(rank: int, world_size: int, groups: Iterable[Any], path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """One rank's recorders, every group of ``groups`` (c10d's ProcessGroups, passed in: this
    layer does not import c10d), as a dict; written as JSON to ``path`` when given (a directory
    gets ``aiodist_fr_rank<N>.json`` inside it). ``aiodist.debug.dump_flight_recorder`` calls it
    with the current World's groups."""
    data: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
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
            for g in groups
        ],
    }
    if path is not None:
        target = os.fspath(path)
        if os.path.isdir(target):
            target = os.path.join(target, f"aiodist_fr_rank{rank}.json")
        tmp = f"{target}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, target)
    return data


def dump_dir_on_timeout() -> str | None:
    """Where ``AIODIST_FR_DUMP_ON_TIMEOUT=1`` dumps (made if missing), or None when it is off."""
    if str(value("AIODIST_FR_DUMP_ON_TIMEOUT")) not in ("1", "true", "True", "yes"):
        return None
    directory = str(value("AIODIST_FR_DUMP_DIR")) or os.getcwd()
    os.makedirs(directory, exist_ok=True)
    return directory
