"""The debug server's handlers: each one knows how to take one kind of snapshot of a rank (its
``dump``), how to combine the ranks' snapshots on the frontend (``aggregate``) and how to show
them (``html``). The built-ins: ``health``, ``stacks``, ``fr_trace`` (flight recorders plus the
analyzer's verdict) and ``tcpstore`` (the store's keys and value sizes, read once, on rank 0).

A handler's ``dump`` runs inside the rank's World (``aiodist.c10d.world.current_world()`` is that
rank's), on the rank's own event loop; it must be quick and must not wait on other ranks.
"""

from __future__ import annotations

import asyncio
import html
import linecache
import os
import sys
import threading
import time
import traceback
from typing import Any

from aiodist._instrument.loop_watchdog import loop_state
from aiodist.c10d.world import current_world, world_of
from aiodist.debug.analyze import analyze, format_report
from aiodist.knobs import effective

__all__ = [
    "DebugHandler",
    "HealthHandler",
    "StacksHandler",
    "FlightRecorderHandler",
    "StatusHandler",
    "StoreHandler",
    "default_handlers",
    "task_stack",
    "waiting_at",
]

#: a task stack walks at most this many awaits
_MAX_DEPTH = 64
#: the store handler lists at most this many keys
MAX_KEYS = 2000


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


class DebugHandler:
    """A pluggable piece of the debug server.

    ``name`` names the handler, its frontend route (``/<name>``) and its periodic dump file
    (``<name>_rank<N>.json`` in ``dump_dir``). ``scope`` is ``"rank"`` (``dump`` runs on every
    rank's worker and the frontend gathers them) or ``"job"`` (``dump`` runs once, on rank 0: for
    what every rank would see alike, such as the store). Override ``dump`` (required), and
    optionally ``aggregate`` and ``html``.
    """

    name: str = ""
    title: str = ""
    scope: str = "rank"

    def routes(self) -> list[str]:
        """The frontend paths that show this handler (``?format=json`` gives JSON)."""
        return [f"/{self.name}"]

    async def dump(self) -> Any:
        """This rank's snapshot, JSON-able."""
        raise NotImplementedError

    def dump_filename(self, rank: int) -> str:
        return f"{self.name}_rank{rank}.json"

    def aggregate(self, per_rank: dict[int, Any]) -> dict[str, Any]:
        """Extra fields computed from every answering rank's dump (frontend side)."""
        return {}

    def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
        """The body of the handler's HTML page (escaped by the handler)."""
        parts = []
        for r in sorted(per_rank):
            import json

            parts.append(f"<h2>rank {r}</h2><pre>{_esc(json.dumps(per_rank[r], indent=1, default=str))}</pre>")
        return "\n".join(parts)


class HealthHandler(DebugHandler):
    name = "health"
    title = "Health"

    def __init__(self) -> None:
        self.started = time.time()

    async def dump(self) -> Any:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(0)
        return self.snapshot(current_world(), loop_turn_ms=(loop.time() - t0) * 1000, started=self.started)

    @staticmethod
    def snapshot(w: Any, loop_turn_ms: float | None, started: float | None = None) -> dict[str, Any]:
        """The health record of World ``w``; from any thread (the worker calls it from its own when
        the loop is blocked: then ``loop_turn_ms`` is None and ``tasks`` is not counted)."""
        groups = [g.stats() for g in list(w.groups.values())]
        return {
            "rank": w.rank,
            "world_size": w.world_size,
            "backend": w.backend_name,
            "address": w.stats()["address"],
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "time": time.time(),
            "uptime_s": None if started is None else time.time() - started,
            "loop_turn_ms": loop_turn_ms,
            "loop": loop_state(w),
            "tasks": len(asyncio.all_tasks()) if loop_turn_ms is not None else None,
            "threads": threading.active_count(),
            "pending_ops": sum(g["pending"] for g in groups),
            "broken_groups": [g["desc"] for g in groups if g["broken"]],
            "groups": groups,
            # the AIODIST_* variables this rank has set, as it reads them (aiodist.knobs)
            "knobs": [k for k in effective() if k["set"] is not None],
        }

    def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
        rows = []
        for r in sorted(per_rank):
            d = per_rank[r]
            broken = ", ".join(d["broken_groups"]) or "-"
            turn = _esc(d["loop_blocked"]["sentence"]) if d.get("loop_blocked") else _num(d["loop_turn_ms"], "{:.2f}")
            loop = d.get("loop") or {}
            rows.append(
                f"<tr><td>{r}</td><td>{_esc(d['host'])}</td><td>{d['pid']}</td><td>{_esc(d['backend'])}</td>"
                f"<td>{d['pending_ops']}</td><td>{len(d['groups'])}</td><td>{_num(d['tasks'], '{}')}</td><td>{d['threads']}</td>"
                f"<td>{turn}</td><td>{_num(loop.get('max_lag_ms'), '{:.1f}')}</td><td>{_num(d['uptime_s'], '{:.0f}')}</td><td>{_esc(broken)}</td></tr>"
            )
        knobs = [
            f"<tr><td>{r}</td><td>{_esc(k['name'])}</td><td>{_esc(k['set'])}</td><td>{_esc(k['value'])}</td><td>{_esc(k['default'])}</td></tr>"
            for r in sorted(per_rank)
            for k in per_rank[r].get("knobs") or []
        ]
        return (
            "<table><tr><th>rank</th><th>host</th><th>pid</th><th>backend</th><th>pending ops</th><th>groups</th>"
            "<th>tasks</th><th>threads</th><th>loop turn (ms)</th><th>max loop lag (ms)</th><th>uptime (s)</th><th>broken groups</th></tr>"
            + "".join(rows)
            + "</table><h2>AIODIST_* variables set</h2>"
            + (
                "<table id='knobs'><tr><th>rank</th><th>variable</th><th>set to</th><th>read as</th><th>default</th></tr>"
                + "".join(knobs)
                + "</table>"
                if knobs
                else "<p class='small' id='knobs'>none: every rank runs on the defaults (docs/environment.md lists them)</p>"
            )
        )


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def task_stack(task: asyncio.Task[Any]) -> list[dict[str, Any]]:
    """Where ``task`` is suspended: the chain of awaits from its coroutine down to the innermost
    one (outermost first), as file/line/function/code."""
    frames: list[dict[str, Any]] = []
    coro: Any = task.get_coro()
    for _ in range(_MAX_DEPTH):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            frames.append(
                {
                    "file": code.co_filename,
                    "line": frame.f_lineno,
                    "function": code.co_name,
                    "code": linecache.getline(code.co_filename, frame.f_lineno).strip(),
                }
            )
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        if nxt is not None and not any(hasattr(nxt, a) for a in ("cr_frame", "gi_frame", "ag_frame")):
            frames.append({"file": "", "line": 0, "function": "", "code": f"awaiting {nxt!r}"[:300]})
            break
        coro = nxt
    return frames


def _task_world(task: asyncio.Task[Any]) -> Any:
    get_context = getattr(task, "get_context", None)  # Python 3.12+
    if get_context is None:
        return None
    # read, not run: the loop's thread may be inside this very Context (a blocked loop's task,
    # read from the debug worker's thread), and a Context cannot be entered twice
    return world_of(get_context())  # the World the task's own Context points at


_AIODIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ASYNCIO_DIR = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep
_DEBUG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # aiodist/debug/: serving a debug request


def _rank_tasks(w: Any, loop: asyncio.AbstractEventLoop, me: asyncio.Task[Any] | None) -> tuple[list[asyncio.Task[Any]], bool]:
    """The live tasks of World ``w`` on ``loop`` but ``me``, and whether they could be told
    apart from other Worlds' (Python 3.12+: a task's Context); from any thread."""
    op_tasks = {t for g in list(w.groups.values()) for t in g.pending()}
    filtered = hasattr(asyncio.Task, "get_context")
    for _ in range(3):
        try:
            every = list(asyncio.all_tasks(loop))
            break
        except RuntimeError:  # the task set changed while it was copied
            time.sleep(0.01)
    else:
        every = []
    keep = [t for t in every if t is not me and not t.done() and not (filtered and t not in op_tasks and _task_world(t) is not w)]
    return keep, filtered


def waiting_at(w: Any, loop: asyncio.AbstractEventLoop, me: asyncio.Task[Any] | None) -> list[dict[str, Any]]:
    """Where the rank's code waits on aiodist: for each task suspended in an aiodist call, the
    innermost frame of its stack outside aiodist and asyncio (the user's line), and the call it
    waits in. aiodist's own tasks (ops, servers) are left out: their outermost frame is aiodist's;
    so is a task serving a debug request (a frame in aiodist/debug: the page asking)."""
    out = []
    tasks, _ = _rank_tasks(w, loop, me)
    for t in tasks:
        stack = task_stack(t)
        if not stack or stack[0]["file"].startswith(_AIODIST_DIR):
            continue
        if any(f["file"].startswith(_DEBUG_DIR) for f in stack):
            continue  # the debug server's own request (aiohttp's handler task): not the rank's code
        k = next(
            (
                i
                for i, f in enumerate(stack)
                if f["file"].startswith(_AIODIST_DIR) or (not f["file"] and f["code"].startswith(("awaiting <Pending", "awaiting <Work")))
            ),
            None,
        )
        if k is None:
            continue
        user = [f for f in stack[:k] if f["file"] and not f["file"].startswith(_ASYNCIO_DIR)]
        if not user:
            continue
        f = user[-1]
        inner = stack[k]
        call = inner["code"].removeprefix("awaiting ") if not inner["file"] else f"{inner['function']} ({os.path.basename(inner['file'])})"
        out.append({"task": t.get_name(), "file": f["file"], "line": f["line"], "function": f["function"], "code": f["code"], "in": call})
    return out


class StacksHandler(DebugHandler):
    """Every asyncio task's stack (the awaits it is suspended in) and every thread's stack."""

    name = "stacks"
    title = "Stacks"

    async def dump(self) -> Any:
        return self.snapshot(current_world(), asyncio.get_running_loop(), asyncio.current_task())

    @staticmethod
    def snapshot(w: Any, loop: asyncio.AbstractEventLoop, me: asyncio.Task[Any] | None) -> dict[str, Any]:
        """World ``w``'s tasks on ``loop`` and the process's threads; from any thread (the worker
        calls it from its own when the loop is blocked: the loop is not changing its tasks then)."""
        op_tasks = {t: g.describe() for g in list(w.groups.values()) for t in g.pending()}
        tasks = []
        every, filtered = _rank_tasks(w, loop, me)
        for t in every:
            tasks.append({"name": t.get_name(), "op_of_group": op_tasks.get(t), "coro": repr(t.get_coro())[:200], "stack": task_stack(t)})
        tasks.sort(key=lambda x: (x["op_of_group"] is None, x["name"]))
        names = {th.ident: th.name for th in threading.enumerate()}
        threads = []
        for ident, frame in sys._current_frames().items():
            stack = [
                {"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": (fs.line or "").strip()}
                for fs in traceback.extract_stack(frame, limit=_MAX_DEPTH)
            ]
            threads.append({"name": names.get(ident, f"thread {ident}"), "ident": ident, "stack": stack})
        return {
            "rank": w.rank,
            "pid": os.getpid(),
            "tasks_of_this_rank_only": filtered,
            "tasks": tasks,
            "threads": threads,
        }

    def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
        out = []
        for r in sorted(per_rank):
            d = per_rank[r]
            out.append(f"<h2 id='rank{r}'>rank {r} (pid {d['pid']}): {len(d['tasks'])} tasks, {len(d['threads'])} threads</h2>")
            if d.get("loop_blocked"):
                b = d["loop_blocked"]
                out.append(
                    f"<pre class='bad' id='blocked{r}'>rank {r}: {_esc(b['sentence'])}\n\nthe loop thread, innermost last:\n{_esc(chr(10).join(b['stack'] or []))}</pre>"
                )
            if not d["tasks_of_this_rank_only"]:
                out.append(
                    "<p class='small'>Every task of the process (Python &lt; 3.12 cannot tell apart the tasks of ranks that share a process); the rank's own ops come first.</p>"
                )
            for t in d["tasks"]:
                tag = f" <span class='tag'>op of {_esc(t['op_of_group'])}</span>" if t["op_of_group"] else ""
                out.append(
                    f"<details open><summary>task {_esc(t['name'])}{tag}</summary><pre>{_esc(_fmt_stack(t['stack']))}</pre></details>"
                )
            for th in d["threads"]:
                out.append(f"<details><summary>thread {_esc(th['name'])}</summary><pre>{_esc(_fmt_stack(th['stack']))}</pre></details>")
        return "\n".join(out)


def _fmt_stack(stack: list[dict[str, Any]]) -> str:
    lines = []
    for f in stack:
        if f["file"]:
            lines.append(f'File "{f["file"]}", line {f["line"]}, in {f["function"]}')
            if f["code"]:
                lines.append(f"    {f['code']}")
        else:
            lines.append(f["code"])
    return "\n".join(lines)


class FlightRecorderHandler(DebugHandler):
    """Every rank's flight recorders (``dump_flight_recorder``'s format) and the analysis."""

    name = "fr_trace"
    title = "Flight recorders"

    def __init__(self, tail: int | None = None) -> None:
        self.tail = tail  # keep only the last ``tail`` entries per group (None: all)

    async def dump(self) -> Any:
        from aiodist.debug.recorder import dump_flight_recorder

        d = dump_flight_recorder()
        if self.tail is not None:
            for g in d["groups"]:
                g["entries"] = g["entries"][-self.tail :]
        return d

    def dump_filename(self, rank: int) -> str:
        return f"aiodist_fr_rank{rank}.json"  # what python -m aiodist.debug.analyze DIR reads

    def aggregate(self, per_rank: dict[int, Any]) -> dict[str, Any]:
        if not per_rank:
            return {"analysis": None, "report": "no rank answered"}
        result = analyze([per_rank[r] for r in sorted(per_rank)])
        return {"analysis": result, "report": format_report(result)}

    def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
        out = []
        result = extra.get("analysis")
        if result is not None:
            cls = "ok" if result["ok"] else "bad"
            out.append(f"<h2>Analysis</h2><pre class='{cls}' id='analysis'>{_esc(extra['report'])}</pre>")
        for r in sorted(per_rank):
            d = per_rank[r]
            out.append(f"<h2>rank {r}</h2>")
            for g in d["groups"]:
                rows = []
                for e in reversed(g["entries"][-200:]):
                    dur = f"{e['duration_s'] * 1000:.2f} ms" if e.get("duration_s") is not None else ""
                    cls = (
                        ""
                        if e["state"] == "completed"
                        else " class='pending'"
                        if e["state"] in ("issued", "started")
                        else " class='failed'"
                    )
                    same = (e.get("meta") or {}).get("same") or {}
                    rows.append(
                        f"<tr{cls}><td>{e['seq']}</td><td>{_esc(e['kind'])}</td><td>{_esc(e['op'])}</td><td>{_esc(e.get('record_comm') or '')}</td>"
                        f"<td>{_esc(', '.join(f'{k}={v}' for k, v in same.items()))}</td><td>{_esc(e['state'])}</td><td>{dur}</td><td>{_esc(e.get('error') or '')}</td></tr>"
                    )
                shown = "" if len(g["entries"]) <= 200 else " (newest 200 shown)"
                out.append(
                    f"<h3>group '{_esc(g['desc'])}' (id {g['group_id']}, ranks {g['ranks']}): {g['seq']} issued, {g['completed']} completed{shown}</h3>"
                    "<table><tr><th>seq</th><th>kind</th><th>op</th><th>record_comm</th><th>must match</th><th>state</th><th>duration</th><th>error</th></tr>"
                    + "".join(rows)
                    + "</table>"
                )
        return "\n".join(out)


class StatusHandler(FlightRecorderHandler):
    """What the front page (``/``) reads from each rank: the flight recorders' tails, and where
    the rank's code waits on aiodist (``waiting_at``)."""

    name = "status"

    async def dump(self) -> Any:
        d = await super().dump()
        d["waiting_at"] = waiting_at(current_world(), asyncio.get_running_loop(), asyncio.current_task())
        return d


class StoreHandler(DebugHandler):
    """The World's store: its keys and the size of each value (read on rank 0 only). Values are
    not shown (the store holds the backend's connection token) unless ``show_values`` is set: then
    the first 64 bytes of each."""

    name = "tcpstore"
    title = "Store"
    scope = "job"

    def __init__(self, timeout: float = 5.0, show_values: bool = False) -> None:
        self.timeout = timeout
        self.show_values = show_values

    async def dump(self) -> Any:
        store = current_world().store
        if store is None:
            return {"store": None, "keys": [], "error": "this World has no store"}
        out: dict[str, Any] = {"store": store.stats(), "keys": [], "error": None, "truncated": False}
        try:
            async with asyncio.timeout(self.timeout):
                keys = sorted(await store.list_keys())
        except (TimeoutError, NotImplementedError, OSError) as exc:
            out["error"] = f"list_keys failed: {type(exc).__name__}: {exc}"
            return out
        except Exception as exc:  # a store's own error (DistStoreError): say so, do not fail the page
            out["error"] = f"list_keys failed: {type(exc).__name__}: {exc}"
            return out
        if len(keys) > MAX_KEYS:
            keys, out["truncated"] = keys[:MAX_KEYS], True
        values: list[bytes | None]
        try:
            async with asyncio.timeout(self.timeout / 2):
                values = list(await store.multi_get(keys)) if keys else []
        except Exception:  # a key deleted since list_keys: read them one by one, each bounded
            values = []
            for k in keys:
                try:
                    async with asyncio.timeout(0.2):
                        values.append(await store.get(k) if await store.check([k]) else None)
                except Exception:
                    values.append(None)
        for k, v in zip(keys, values, strict=True):
            preview = None if v is None or not self.show_values else v[:64].decode("utf-8", "replace")
            out["keys"].append({"key": k, "size": None if v is None else len(v), "preview": preview})
        return out

    def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
        d = next(iter(per_rank.values()), None)
        if d is None:
            return "<p>no answer</p>"
        head = f"<p>{len(d['keys'])} keys{' (truncated)' if d.get('truncated') else ''}; store: {_esc(d['store'])}</p>"
        if d.get("error"):
            head += f"<p class='bad'>{_esc(d['error'])}</p>"
        shown = self.show_values
        rows = "".join(
            f"<tr><td>{_esc(k['key'])}</td><td>{'' if k['size'] is None else k['size']}</td>"
            + (f"<td><code>{_esc(k['preview'] or '')}</code></td>" if shown else "")
            + "</tr>"
            for k in d["keys"]
        )
        value = "<th>value (first 64 bytes)</th>" if shown else ""
        return head + f"<table><tr><th>key</th><th>bytes</th>{value}</tr>{rows}</table>"


def default_handlers() -> list[DebugHandler]:
    return [HealthHandler(), StacksHandler(), FlightRecorderHandler(), StoreHandler()]
