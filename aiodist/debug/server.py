"""The debug HTTP server: a worker on every rank (a stdlib HTTP server on its own thread, whose
handlers run on the rank's loop) and the frontend on rank 0 (aiohttp, on rank 0's loop).

``await start_debug_server()`` on every rank of an initialised World starts a *worker* server on
that rank (its URL registered in the World's store under ``aiodist/debug/worker/<rank>``); rank
0 also starts the *frontend* on ``port``. The frontend gathers from every rank's worker at once,
each fetch bounded by ``fetch_timeout``, and says plainly when some did not answer ("PARTIAL: 1/2
ranks responded; no answer from rank 1 (...)"). Routes on the frontend (each also as JSON with
``?format=json``):

- ``/``: one row per rank: its state, the op it is in or last finished (group, op, seq, state,
  age), and the stuck ranks highlighted, with the flight-recorder analysis on top;
- ``/stacks``: every asyncio task's stack (down the chain of awaits) and every thread's stack;
- ``/fr_trace``: every rank's flight recorders and the analysis (``aiodist.debug.analyze``);
- ``/tcpstore``: the store's keys and value sizes;
- ``/health``: pid, host, pending ops, broken groups, loop responsiveness per rank;
- ``/<name>`` of every extra ``DebugHandler`` given in ``handlers``.

A rank whose coroutines are stuck in a collective still answers (its loop runs the handlers); a
rank whose *loop* is blocked is answered for by its worker thread, from the loop watchdog's state:
"event loop blocked for 6.9 s at train.py:42 in step: time.sleep(60)", with the stacks and the
flight recorders as they stand (docs/debug_server.md, "A blocked loop").

The server is not secure: no authentication, stacks and store values for anyone who can connect.
It binds 127.0.0.1 unless ``host`` says otherwise; expose it only on a trusted network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import html
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from aiodist._instrument.loop_watchdog import blame, loop_stack, loop_state
from aiodist._instrument.recorder import dump_groups
from aiodist.c10d.world import World, current_world, use_world
from aiodist.debug.analyze import analyze
from aiodist.debug.handlers import DebugHandler, HealthHandler, StacksHandler, StatusHandler, default_handlers

__all__ = [
    "start_debug_server",
    "stop_debug_server",
    "frontend_url",
    "worker_url",
    "DebugServer",
    "WORKER_KEY",
    "STUCK_AFTER_S",
    "BLOCKED_ANSWER_S",
]

log = logging.getLogger("aiodist.debug.server")

WORKER_KEY = "aiodist/debug/worker/{rank}"
#: an op unfinished for longer than this is shown as waiting on the page
STUCK_AFTER_S = 3.0
#: a worker whose loop has not taken up a request for this long (or AIODIST_LOOP_BLOCKED_WARN, if
#: shorter) answers from its own thread that the loop is blocked, with the loop thread's stack
BLOCKED_ANSWER_S = 3.0
_RESERVED = {"", "dump", "status", "index"}
_SERVERS: weakref.WeakKeyDictionary[World, DebugServer] = weakref.WeakKeyDictionary()

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222;background:#fafafa}
nav a{margin-right:1.2em;font-weight:600}
table{border-collapse:collapse;margin:.6em 0 1.2em 0;font-size:14px}
th,td{border:1px solid #ccc;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#eee}
tr.stuck td{background:#ffd6d6}
tr.waiting td{background:#fff0c2}
tr.ok td{background:#e3f6e3}
tr.pending td{background:#fff0c2}
tr.failed td{background:#ffd6d6}
.banner{padding:8px 12px;border-radius:4px;font-weight:600;margin:.8em 0}
.banner.ok{background:#d9f2d9}
.banner.bad{background:#ffc9c9}
.banner.warn{background:#fff0b3}
pre{background:#f0f0f0;padding:8px;overflow-x:auto;font-size:13px}
pre.bad{background:#ffe3e3}
pre.ok{background:#e6f6e6}
.state{font-weight:700}
.tag{background:#dde;padding:0 4px;border-radius:3px;font-size:12px}
.small{color:#666;font-size:12px}
td.nw{white-space:nowrap}
"""


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


class DebugServer:
    """One rank's debug server: its worker, and on rank 0 the frontend."""

    def __init__(
        self,
        world: World,
        handlers: list[DebugHandler],
        *,
        host: str,
        fetch_timeout: float,
        dump_dir: str | None,
        dump_interval: float,
        enabled_dumps: set[str],
        stuck_after: float = STUCK_AFTER_S,
    ) -> None:
        self.world = world
        self.stuck_after = stuck_after
        self.rank = world.rank
        self.world_size = world.world_size
        self.handlers = {h.name: h for h in handlers}
        self.host = host
        self.fetch_timeout = fetch_timeout
        self.dump_dir = dump_dir
        self.dump_interval = dump_interval
        self.enabled_dumps = enabled_dumps
        self.frontend_runner: web.AppRunner | None = None
        self.worker_url: str | None = None
        self.frontend_url: str | None = None
        self.session: ClientSession | None = None
        self.dump_task: asyncio.Task[None] | None = None
        self.dumps_written = 0
        self._status = StatusHandler(tail=64)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = 0
        self.httpd: ThreadingHTTPServer | None = None
        self.worker_thread: threading.Thread | None = None
        self._stopping = False

    def __repr__(self) -> str:
        return f"<DebugServer rank {self.rank}: worker {self.worker_url}, frontend {self.frontend_url}>"

    # -- worker: served from its own thread, so that a blocked loop is still described --------

    async def _run_dump(self, handler: DebugHandler, picked: threading.Event | None = None) -> Any:
        if picked is not None:
            picked.set()  # the loop took the request up: it is not blocked, whatever dump() takes
        with use_world(self.world):
            async with asyncio.timeout(self.fetch_timeout):
                return await handler.dump()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        """One worker request (on an HTTP thread): ``/`` or ``/dump/<name>``. The dump runs on the
        rank's loop; when the loop does not take it up (the watchdog says it is blocked, or it has
        not run for ``BLOCKED_ANSWER_S``), the answer is made here, from this thread: the flight
        recorders, health and stacks as they can be read without the loop, and ``loop_blocked``
        (for how long, where)."""
        path = path.split("?", 1)[0]
        if path == "/":
            return 200, {
                "rank": self.rank,
                "handlers": sorted(self.handlers),
                "frontend": self.frontend_url,
                "loop": loop_state(self.world),
            }
        name = path[len("/dump/") :] if path.startswith("/dump/") else None
        handler = self._status if name == "status" else self.handlers.get(name or "")
        if name is None or handler is None:
            return 404, {"rank": self.rank, "error": f"no handler {name!r}" if name is not None else f"no route {path!r}"}
        picked = threading.Event()
        assert self.loop is not None  # set by start_worker, before the server answers anything
        try:
            fut = asyncio.run_coroutine_threadsafe(self._run_dump(handler, picked), self.loop)
        except RuntimeError as exc:  # the loop is closed
            return 503, {"rank": self.rank, "error": f"the rank's event loop is gone ({exc})"}
        t0 = time.monotonic()
        while True:
            done, _ = concurrent.futures.wait([fut], timeout=0.05)
            if done:
                if fut.cancelled():
                    return 503, {"rank": self.rank, "error": f"{name} was cancelled (the server is stopping)"}
                failure = fut.exception()
                if failure is None:
                    return 200, {"rank": self.rank, "name": name, "data": fut.result()}
                if isinstance(failure, TimeoutError):
                    return 504, {"rank": self.rank, "error": f"{name} took longer than {self.fetch_timeout:g} s"}
                log.error("rank %d: debug handler %s failed", self.rank, name, exc_info=failure)
                return 500, {"rank": self.rank, "error": f"{type(failure).__name__}: {failure}"}
            now = time.monotonic()
            state = loop_state(self.world)
            lag = now - t0 if state is None else max(state["lag_s"], 0.0)
            limit = BLOCKED_ANSWER_S if state is None else min(BLOCKED_ANSWER_S, state["warn_s"])
            if (state is not None and state["blocked"]) or (not picked.is_set() and lag >= limit):
                fut.cancel()
                return self._blocked_answer(name, lag, state)
            if now - t0 >= self.fetch_timeout or self._stopping:
                fut.cancel()
                return 504, {"rank": self.rank, "error": f"{name} took longer than {self.fetch_timeout:g} s"}

    def _blocked_answer(self, name: str, lag: float, state: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        at, stack = (state["at"], state["stack"]) if state is not None and state["at"] else (None, None)
        if at is None:  # no watchdog (AIODIST_LOOP_BLOCKED_WARN=0), or it has not looked yet
            frame = sys._current_frames().get(self.loop_thread)
            at, stack = blame(frame), loop_stack(frame)
            del frame
        blocked = {
            "for_s": lag,
            "at": at,
            "stack": stack,
            "since": time.time() - lag,
            "sentence": f"event loop blocked for {lag:.1f} s at {at}",
        }
        data: Any
        if name in ("status", "fr_trace"):
            data = self._thread_fr(64 if name == "status" else None)
        elif name == "health":
            data = HealthHandler.snapshot(self.world, loop_turn_ms=None)
        elif name == "stacks":
            data = StacksHandler.snapshot(self.world, self.loop, None) if self.loop is not None else {}
        else:
            return 503, {"rank": self.rank, "error": blocked["sentence"], "loop_blocked": blocked}
        if isinstance(data, dict):
            data["loop_blocked"] = blocked
        return 200, {"rank": self.rank, "name": name, "data": data, "loop_blocked": blocked}

    def _thread_fr(self, tail: int | None) -> dict[str, Any]:
        """The rank's flight recorders, read from this thread while the loop is stuck in user code
        (it is not writing them); a read that races a write is tried again."""
        w = self.world
        for _ in range(3):
            try:
                d = dump_groups(w.rank, w.world_size, list(w.groups.values()))
                break
            except RuntimeError:  # a dict changed size meanwhile: the loop ran after all
                time.sleep(0.01)
        else:
            d = dump_groups(w.rank, w.world_size, [])
        if tail is not None:
            for g in d["groups"]:
                g["entries"] = g["entries"][-tail:]
        return d

    async def start_worker(self, port: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        cls = _WorkerHTTP6 if ":" in self.host else _WorkerHTTP
        httpd = cls((self.host, port), _WorkerRequest)
        httpd.debug = self
        self.httpd = httpd
        self.worker_thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"aiodist debug worker rank {self.rank}", daemon=True
        )
        self.worker_thread.start()
        self.worker_url = _url(self.host, httpd.server_address[1])

    # -- frontend ------------------------------------------------------------------------------

    async def _url_of(self, rank: int, deadline: float) -> str:
        store = self.world.store
        if store is None:
            raise LookupError("the World has no store to find the workers in")
        key = WORKER_KEY.format(rank=rank)
        if not await store.check([key]):
            await store.wait([key], max(deadline - asyncio.get_running_loop().time(), 0.001))
        return (await store.get(key)).decode()

    async def _fetch(self, rank: int, name: str) -> tuple[int, Any, str | None, dict[str, Any] | None]:
        """(rank, its data or None, why not, its ``loop_blocked`` when its worker says so)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fetch_timeout
        url = None
        try:
            async with asyncio.timeout(self.fetch_timeout):
                try:
                    url = await self._url_of(rank, deadline)
                except TimeoutError:
                    raise  # the store's own timeout (StoreTimeoutError) or ours: reported below
                except Exception as exc:
                    return rank, None, f"no worker registered in the store ({type(exc).__name__}: {str(exc)[:200]})", None
                assert self.session is not None
                async with self.session.get(f"{url}/dump/{name}") as resp:
                    body = await resp.json(content_type=None)
                    blocked = body.get("loop_blocked") if isinstance(body, dict) else None
                    if resp.status != 200:
                        why = body.get("error") if isinstance(body, dict) else body
                        return rank, None, why if blocked else f"{url} answered HTTP {resp.status}: {why}", blocked
                    return rank, body["data"], None, blocked
        except TimeoutError:
            where = f"{url}" if url else "(its worker never registered in the store: not started, or stopped)"
            return rank, None, f"no answer within {self.fetch_timeout:g} s from {where}", None
        except (ClientError, OSError, ValueError, KeyError) as exc:
            return rank, None, f"{url}: {type(exc).__name__}: {exc}", None

    async def gather(self, name: str) -> dict[str, Any]:
        """Every rank's dump of handler ``name``: ``per_rank``, ``missing`` (rank -> why) and a
        one-line ``summary`` that starts with OK or PARTIAL."""
        handler = self._status if name == "status" else self.handlers[name]
        if handler.scope == "job":
            try:
                data = await self._run_dump(handler)
                per_rank, missing = {self.rank: data}, {}
            except Exception as exc:
                per_rank, missing = {}, {self.rank: f"{type(exc).__name__}: {exc}"}
            summary = f"OK: read on rank {self.rank}" if per_rank else f"FAILED on rank {self.rank}: {missing[self.rank]}"
            return {"per_rank": per_rank, "missing": missing, "blocked": {}, "partial": bool(missing), "summary": summary, "expected": 1}
        results = await asyncio.gather(*(self._fetch(r, name) for r in range(self.world_size)))
        per_rank = {r: d for r, d, err, _ in results if err is None}
        missing = {r: err for r, _, err, _ in results if err is not None}
        blocked = {r: b for r, _, _, b in results if b}
        n = self.world_size
        if missing:
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(missing.items()))
            summary = f"PARTIAL: {len(per_rank)}/{n} ranks responded; missing ranks {sorted(missing)} ({why})"
        else:
            summary = f"OK: {n}/{n} ranks responded"
        if blocked:  # said first: it is why the page looks the way it does
            lines = "; ".join(f"rank {r}: {b['sentence']}" for r, b in sorted(blocked.items()) if r not in missing)
            summary = f"BLOCKED: {lines}. {summary.removeprefix('OK: ')}" if lines else summary
        return {"per_rank": per_rank, "missing": missing, "blocked": blocked, "partial": bool(missing), "summary": summary, "expected": n}

    async def _handler_page(self, name: str, request: web.Request) -> web.Response:
        handler = self.handlers[name]
        g = await self.gather(name)
        try:
            extra = handler.aggregate(g["per_rank"])
        except Exception as exc:
            log.exception("debug handler %s: aggregate failed", name)
            extra = {"aggregate_error": f"{type(exc).__name__}: {exc}"}
        if _wants_json(request):
            return _json(
                {
                    "handler": name,
                    "summary": g["summary"],
                    "partial": g["partial"],
                    "responded": sorted(g["per_rank"]),
                    "missing": {str(r): e for r, e in g["missing"].items()},
                    "blocked": {str(r): b for r, b in g["blocked"].items()},
                    "ranks": {str(r): d for r, d in g["per_rank"].items()},
                    **extra,
                }
            )
        try:
            body = handler.html(g["per_rank"], extra)
        except Exception as exc:
            body = f"<pre class='bad'>{_esc(handler.name)}: html failed: {_esc(type(exc).__name__)}: {_esc(exc)}</pre>"
        return self._page(handler.title or name, g, body)

    async def _index(self, request: web.Request) -> web.Response:
        g = await self.gather("status")
        view = index_view(g["per_rank"], g["missing"], self.world_size, self.stuck_after, blocked=g["blocked"])
        g = {**g, **worst_state(view, g["summary"])}
        view["summary"] = g["summary"]
        view["partial"] = g["partial"]
        if _wants_json(request):
            return _json(view)
        return self._page("Ranks", g, _index_html(view), refresh=request.query.get("refresh"))

    def _page_for(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def page(request: web.Request) -> web.Response:
            return await self._handler_page(name, request)

        return page

    def _page(self, title: str, g: dict[str, Any], body: str, refresh: str | None = None) -> web.Response:
        nav = "".join(f"<a href='{_esc(p)}'>{_esc(p)}</a>" for p in ["/", *(r for h in self.handlers.values() for r in h.routes())])
        cls = g.get("banner") or ("bad" if g["partial"] or g.get("blocked") else "ok")
        meta = ""
        if refresh and refresh.isdigit() and int(refresh) > 0:
            meta = f"<meta http-equiv='refresh' content='{int(refresh)}'>"
        page = (
            f"<!DOCTYPE html><html><head><meta charset='utf-8'>{meta}<title>aiodist debug: {_esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<nav>{nav}</nav><h1>aiodist debug: {_esc(title)}</h1>"
            f"<div class='banner {cls}' id='summary'>{_esc(g['summary'])}</div>"
            f"<p class='small'>world size {self.world_size}, frontend on rank {self.rank}, generated {time.strftime('%H:%M:%S')}; "
            f"<a href='?format=json'>JSON</a></p>{body}</body></html>"
        )
        return web.Response(text=page, content_type="text/html")

    async def start_frontend(self, port: int) -> None:
        app = web.Application()
        app.router.add_get("/", self._index)
        for h in self.handlers.values():
            for route in h.routes():
                app.router.add_get(route, self._page_for(h.name))
        self.frontend_runner, self.frontend_url = await _serve(app, self.host, port)

    # -- periodic dumps ------------------------------------------------------------------------

    async def _dump_loop(self) -> None:
        assert self.dump_dir is not None
        while True:
            await asyncio.sleep(self.dump_interval)
            await self.write_dumps()

    async def write_dumps(self) -> list[str]:
        """Write the enabled handlers' dumps of this rank into ``dump_dir`` (job-scope handlers
        on rank 0 only); returns the paths written."""
        assert self.dump_dir is not None
        written = []
        for name in sorted(self.enabled_dumps):
            h = self.handlers[name]
            if h.scope == "job" and self.rank != 0:
                continue
            try:
                data = await self._run_dump(h)
                path = os.path.join(self.dump_dir, h.dump_filename(self.rank))
                await asyncio.to_thread(_write_json, path, data)
                written.append(path)
            except Exception as exc:  # one handler's failure must not stop the others' dumps
                log.warning("rank %d: periodic dump of %s failed: %s: %s", self.rank, name, type(exc).__name__, exc)
        self.dumps_written += 1
        return written

    # -- teardown ------------------------------------------------------------------------------

    async def stop(self) -> None:
        if self.dump_task is not None:
            self.dump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(5):
                    await self.dump_task
        store = self.world.store
        if store is not None and self.worker_url is not None:
            try:
                async with asyncio.timeout(2):
                    await store.delete_key(WORKER_KEY.format(rank=self.rank))
            except Exception as exc:  # the store may be gone already (destroyed World)
                log.debug("rank %d: could not delete the debug worker key: %s", self.rank, exc)
        if self.session is not None:
            await self.session.close()
        if self.frontend_runner is not None:
            try:
                async with asyncio.timeout(5):
                    await self.frontend_runner.cleanup()
            except TimeoutError:
                log.warning("rank %d: the debug frontend took over 5 s to shut down", self.rank)
        self._stopping = True  # requests waiting on the loop give up
        httpd = self.httpd
        if httpd is not None:
            self.httpd = None
            if self.worker_thread is not None and self.worker_thread.is_alive():
                await asyncio.to_thread(httpd.shutdown)  # returns within the 50 ms poll interval
            httpd.server_close()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


def _json(obj: Any) -> web.Response:
    return web.json_response(obj, dumps=_dumps)


def _wants_json(request: web.Request) -> bool:
    return request.query.get("format") == "json"


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


async def _serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, _url(host, runner.addresses[0][1])


def _url(host: str, bound: int) -> str:
    shown = host
    if host in ("", "0.0.0.0", "::"):
        shown = socket.gethostname()
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{bound}"


class _WorkerHTTP(ThreadingHTTPServer):
    """The worker's server: stdlib, one thread per request, none of them on the rank's loop."""

    daemon_threads = True
    debug: DebugServer


class _WorkerHTTP6(_WorkerHTTP):
    address_family = socket.AF_INET6


class _WorkerRequest(BaseHTTPRequestHandler):
    server: _WorkerHTTP

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            status, body = self.server.debug.answer(self.path)
        except Exception as exc:  # never a silent dropped connection: say what broke
            log.exception("debug worker: %s failed", self.path)
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
        raw = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("debug worker: " + format, *args)


# -- the index page ------------------------------------------------------------------------------


def index_view(
    per_rank: dict[int, Any],
    missing: dict[int, str],
    world_size: int,
    stuck_after: float = STUCK_AFTER_S,
    blocked: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The rows of ``/``: per rank its state (ok / waiting / stuck / blocked / no answer), where it
    is, and why it is highlighted; computed from the ranks' flight-recorder tails and, for a rank
    whose worker says its event loop is blocked, that (``blocked``: rank -> its ``loop_blocked``)."""
    blocked = blocked or {}
    analysis = analyze([per_rank[r] for r in sorted(per_rank)]) if per_rank else None
    blame: dict[int, list[str]] = {}
    waits: dict[int, list[str]] = {}
    idles: dict[int, list[str]] = {}
    if analysis is not None:
        for g in analysis["groups"]:
            p = g["problem"]
            if p is None:
                continue
            waited = f" for {p['waited_s']:.1f} s" if p.get("waited_s") is not None else ""
            if p["kind"] == "idle":  # idle_until_leader: waiting for the leader's next op is no fault
                for r in p["waiting_ranks"]:
                    idles.setdefault(r, []).append(
                        f"idle{waited}: waiting for rank{'s' if len(p['missing_ranks']) > 1 else ''} "
                        f"{', '.join(map(str, p['missing_ranks']))} to issue seq {p['seq']} ({p['op']}) of group '{g['desc']}'"
                    )
                continue
            if p["kind"] == "missing" and (p.get("waited_s") is None or p["waited_s"] <= stuck_after):
                continue  # not followed yet, but not for longer than the threshold: still in op
            if p["kind"] == "missing":
                for r in p["missing_ranks"]:
                    blame.setdefault(r, []).append(
                        f"never issued seq {p['seq']} ({p['op']}) of group '{g['desc']}'"
                        + (
                            f" that {'rank' if len(p['waiting_ranks']) == 1 else 'ranks'} {', '.join(map(str, p['waiting_ranks']))} {'is' if len(p['waiting_ranks']) == 1 else 'are'} waiting in"
                            if p["waiting_ranks"]
                            else ""
                        )
                    )
                for r in p["waiting_ranks"]:
                    waits.setdefault(r, []).append(
                        f"waiting on rank{'s' if len(p['missing_ranks']) > 1 else ''} {', '.join(map(str, p['missing_ranks']))} in seq {p['seq']} ({p['op']}) of group '{g['desc']}'"
                    )
            elif p["kind"] == "mismatch":
                for side in p["sides"]:
                    for r in side["ranks"]:
                        blame.setdefault(r, []).append(
                            f"called {side['call']} at seq {p['seq']} of group '{g['desc']}' (the ranks disagree)"
                        )
            elif p["kind"] == "failed":
                for r in p["failed_ranks"]:
                    blame.setdefault(r, []).append(f"seq {p['seq']} ({p['op']}) of group '{g['desc']}' failed: {p['error']}")
    positions = {p["rank"]: p for p in (analysis["rank_positions"] if analysis else [])}
    issued: dict[int, dict[str, int]] = {}  # rank -> group desc -> collectives issued
    for g in analysis["groups"] if analysis else []:
        for r, n in g["issued"].items():
            issued.setdefault(int(r), {})[g["desc"]] = n
    idle_groups = {g["desc"] for g in (analysis["groups"] if analysis else []) if (g["problem"] or {}).get("kind") == "idle"}
    newest = {desc: max(by[desc] for by in issued.values() if desc in by) for by in issued.values() for desc in by}
    rows = []
    for r in range(world_size):
        if r in missing:
            rows.append(
                {"rank": r, "state": "no answer", "class": "stuck", "where": "", "age_s": None, "issued": [], "why": missing[r], "at": []}
            )
            continue
        pos = positions.get(r)
        where, age, state, cls = "", None, "idle", "ok"
        if pos and pos["pending"]:
            e = pos["pending"][0]
            age = e["age_s"]
            where = f"{e['op']} seq {e['seq']} of group '{e['group']}' ({e['state']})"
            if len(pos["pending"]) > 1:
                where += f" +{len(pos['pending']) - 1} more"
            state = "in op"
            if e["state"] == "idle":
                state, cls = "idle", "ok"
            elif age is not None and age > stuck_after:
                state, cls = "waiting", "waiting"
        elif pos and pos["last_finished"]:
            e = pos["last_finished"]
            where = f"last finished {e['op']} seq {e['seq']} of group '{e['group']}' ({e['state']})"
        why = list(waits.get(r, []))
        if r in blame:
            state, cls = "stuck", "stuck"
            why = blame[r] + why
        elif why:
            state, cls = "waiting", "waiting"
        why += idles.get(r, [])
        if r in blocked:
            state, cls = "blocked", "stuck"
            why = [blocked[r]["sentence"], *why]
        seqs = [
            {"group": desc, "issued": n, "behind": n < newest[desc] and desc not in idle_groups}
            for desc, n in sorted(issued.get(r, {}).items())
        ]
        at = [f"{a['file']}:{a['line']} in {a['function']}: {a['code']}" for a in (per_rank.get(r) or {}).get("waiting_at") or []]
        rows.append(
            {"rank": r, "state": state, "class": cls, "where": where, "age_s": age, "issued": seqs, "why": "; ".join(why), "at": at}
        )
    stuck = [row["rank"] for row in rows if row["class"] == "stuck"]
    return {"rows": rows, "stuck_ranks": stuck, "blocked_ranks": sorted(blocked), "analysis": analysis, "stuck_after": stuck_after}


def worst_state(view: dict[str, Any], summary: str) -> dict[str, str]:
    """The front page's banner says the worst state of any rank first (stuck or blocked, then
    waiting), so that a green "OK" never sits above a stuck rank: its ``summary`` and colour."""
    rows = view["rows"]
    stuck = [r for r in rows if r["class"] == "stuck" and r["state"] != "no answer"]
    waiting = [r for r in rows if r["class"] == "waiting"]
    rest = summary.removeprefix("OK: ")
    if summary.startswith(("BLOCKED", "PARTIAL")):
        return {"summary": summary, "banner": "bad"}
    after = view.get("stuck_after", STUCK_AFTER_S)
    if stuck:
        who = "; ".join(f"rank {r['rank']}: {r['why'] or r['state']}" for r in stuck)
        rule = f" (STUCK: an op some ranks issued that others have not followed within {after:g} s)"
        return {"summary": f"STUCK: {who}. {rest}{rule}", "banner": "bad"}
    if waiting:
        who = ", ".join(str(r["rank"]) for r in waiting)
        return {"summary": f"WAITING: rank{'s' if len(waiting) > 1 else ''} {who} in an op for a while. {rest}", "banner": "warn"}
    idle = [r for r in rows if r["state"] == "idle" and r["why"]]  # (a rank in no op is "idle" too: nothing to say)
    if idle:
        who = "; ".join(f"rank {r['rank']}: {r['why']}" for r in idle)
        return {"summary": f"IDLE: {who}. {rest}", "banner": "ok"}
    return {"summary": summary, "banner": "ok"}


def _index_html(view: dict[str, Any]) -> str:
    rows = []
    for row in view["rows"]:
        age = "" if row["age_s"] is None else f"{row['age_s']:.1f} s"
        seqs = "<br>".join(f"{_esc(s['group'])}: {s['issued']}" + (" <b>(behind)</b>" if s["behind"] else "") for s in row["issued"])
        rows.append(
            f"<tr class='{row['class']}' id='rank{row['rank']}'><td>{row['rank']}</td><td class='state'>{_esc(row['state'].upper())}</td>"
            f"<td>{_esc(row['where'])}</td><td class='nw'>{age}</td><td class='nw'>{seqs}</td><td>{_esc(row['why'])}</td>"
            f"<td class='small'>{'<br>'.join(_esc(a) for a in row['at'])}</td></tr>"
        )
    out = []
    if view["stuck_ranks"]:
        out.append(
            f"<div class='banner bad' id='stuck'>Stuck: rank{'s' if len(view['stuck_ranks']) > 1 else ''} {', '.join(map(str, view['stuck_ranks']))}</div>"
        )
    else:
        out.append("<div class='banner ok' id='stuck'>No stuck rank</div>")
    out.append(
        "<table id='ranks'><tr><th>rank</th><th>state</th><th>op it is in / last finished</th><th>for</th><th>ops issued</th><th>why</th>"
        "<th>its code waits at</th></tr>" + "".join(rows) + "</table>"
    )
    a = view["analysis"]
    if a is not None:
        out.append("<h2>Flight recorders</h2><ul id='problems'>")
        items = a["problems"] or ["every group consistent"]
        out.extend(f"<li>{_esc(p)}</li>" for p in items)
        out.append("</ul><p class='small'>Details: <a href='/fr_trace'>/fr_trace</a>, stacks: <a href='/stacks'>/stacks</a></p>")
    return "".join(out)


# -- the API ---------------------------------------------------------------------------------------


async def start_debug_server(
    port: int = 25999,
    worker_port: int = 0,
    dump_dir: str | os.PathLike[str] | None = None,
    dump_interval: float = 60.0,
    enabled_dumps: Iterable[str] | None = None,
    handlers: Sequence[DebugHandler] | None = None,
    fetch_timeout: float = 60.0,
    host: str = "127.0.0.1",
    stuck_after: float = STUCK_AFTER_S,
) -> DebugServer:
    """Start this rank's worker server (and on rank 0 the frontend on ``port``; 0 picks a free
    one). Call it on every rank, after ``init_process_group``. ``handlers`` replaces the default
    handlers (``default_handlers() + [mine]`` adds to them); ``enabled_dumps`` names the handlers
    whose dumps are written to ``dump_dir`` every ``dump_interval`` seconds (None: all).
    ``stuck_after``: the page calls a rank STUCK when an op some ranks issued has not been
    followed by it for longer than this (seconds; before that the op is just running); ranks
    waiting in a group that idles for its leader (``idle_until_leader``) are IDLE, never STUCK.
    Returns the rank's ``DebugServer`` (``.frontend_url`` on rank 0, ``.worker_url``)."""
    world = current_world()
    if world.default_pg is None:
        raise RuntimeError("start_debug_server needs an initialised World: call init_process_group first")
    if world in _SERVERS:
        raise RuntimeError(f"the debug server already runs on rank {world.rank}: {_SERVERS[world]!r}; stop_debug_server() first")
    if fetch_timeout <= 0 or dump_interval <= 0:
        raise ValueError(f"fetch_timeout and dump_interval must be > 0, got {fetch_timeout!r} and {dump_interval!r}")
    if not stuck_after >= 0:
        raise ValueError(f"stuck_after must be >= 0, got {stuck_after!r}")
    hs = list(default_handlers() if handlers is None else handlers)
    seen: set[str] = set()
    for h in hs:
        if not isinstance(h, DebugHandler):
            raise TypeError(f"handlers must be DebugHandler objects, got {type(h).__name__}")
        if not h.name or h.name in _RESERVED or "/" in h.name or h.name in seen:
            raise ValueError(f"bad or duplicate debug handler name {h.name!r}")
        if h.scope not in ("rank", "job"):
            raise ValueError(f"debug handler {h.name!r}: scope must be 'rank' or 'job', not {h.scope!r}")
        seen.add(h.name)
    enabled = set(seen) if enabled_dumps is None else set(enabled_dumps)
    unknown = enabled - seen
    if unknown:
        raise ValueError(f"enabled_dumps names unknown handlers {sorted(unknown)}; known: {sorted(seen)}")
    directory = None if dump_dir is None else os.fspath(dump_dir)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    server = DebugServer(
        world,
        hs,
        host=host,
        fetch_timeout=fetch_timeout,
        dump_dir=directory,
        dump_interval=dump_interval,
        enabled_dumps=enabled,
        stuck_after=stuck_after,
    )
    _SERVERS[world] = server
    try:
        await server.start_worker(worker_port)
        if world.store is not None:
            async with asyncio.timeout(fetch_timeout):
                await world.store.set(WORKER_KEY.format(rank=world.rank), server.worker_url or "")
        if world.rank == 0:
            server.session = ClientSession(timeout=ClientTimeout(total=fetch_timeout))
            await server.start_frontend(port)
            log.info("debug server frontend on %s", server.frontend_url)
        if directory is not None:
            server.dump_task = asyncio.get_running_loop().create_task(server._dump_loop(), name=f"aiodist debug dumps rank {world.rank}")
    except BaseException:
        del _SERVERS[world]
        await server.stop()
        raise
    return server


async def stop_debug_server() -> None:
    """Stop this rank's debug server (worker, frontend, periodic dumps) and remove its store key.
    A no-op where none runs."""
    server = _SERVERS.pop(current_world(), None)
    if server is not None:
        await server.stop()


def debug_server() -> DebugServer | None:
    """This rank's running debug server, if any."""
    return _SERVERS.get(current_world())


def frontend_url() -> str | None:
    """The frontend's URL (on rank 0, while the server runs), e.g. ``http://127.0.0.1:25999``."""
    s = _SERVERS.get(current_world())
    return None if s is None else s.frontend_url


def worker_url() -> str | None:
    """This rank's worker URL while the server runs."""
    s = _SERVERS.get(current_world())
    return None if s is None else s.worker_url
