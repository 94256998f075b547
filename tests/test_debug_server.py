"""The debug HTTP server on a 2-rank job (run_world, gloo) where rank 1 never issues the
all_reduce rank 0 is waiting in: every route as HTML and JSON, PARTIAL answers, periodic dumps,
a custom handler."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientSession, ClientTimeout

import aiodist as dist
from aiodist.c10d.world import current_world
from aiodist.debug.analyze import analyze
from aiodist.debug.handlers import DebugHandler, default_handlers
from aiodist.debug.server import WORKER_KEY, debug_server, frontend_url, start_debug_server, stop_debug_server, worker_url
from aiodist.testing import run_world

Probe = Callable[[str, ClientSession], Awaitable[Any]]


async def stuck_job(probe: Probe, **server_kw: Any) -> Any:
    """Rank 0 is in all_reduce seq 1 (async_op) while rank 1 waits on an event instead of
    issuing it; ``probe(frontend_url, session)`` runs on rank 0 meanwhile; then rank 1 catches up
    and the job ends cleanly. Returns what probe returned."""
    release = asyncio.Event()
    out: dict[str, Any] = {}
    kw = {"port": 0, "fetch_timeout": 5.0, "stuck_after": 0.0, **server_kw}  # STUCK as soon as rank 1 is behind

    async def fn(rank: int) -> None:
        t = np.ones(4, dtype=np.float32)
        await dist.all_reduce(t)  # seq 0 on both ranks
        server = await start_debug_server(**kw)
        assert server.worker_url is not None and worker_url() == server.worker_url
        try:
            if rank == 0:
                work = await dist.all_reduce(t, async_op=True)  # seq 1: rank 1 is not coming yet
                assert work is not None
                await asyncio.sleep(0.05)
                url = frontend_url()
                assert url is not None and url.startswith("http://127.0.0.1:")
                try:
                    async with ClientSession(timeout=ClientTimeout(total=20)) as s:
                        out["result"] = await probe(url, s)
                finally:
                    release.set()
                await work.wait()
            else:
                assert frontend_url() is None
                await release.wait()
                await dist.all_reduce(t)
            np.testing.assert_array_equal(t, np.full(4, 4, dtype=np.float32))
        finally:
            await stop_debug_server()
        assert debug_server() is None

    await run_world(2, fn, backend="gloo", timeout=30)
    return out.get("result")


async def get(s: ClientSession, url: str) -> tuple[int, str]:
    async with s.get(url) as r:
        return r.status, await r.text()


async def get_json(s: ClientSession, url: str) -> Any:
    async with s.get(url, params={"format": "json"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_routes_name_the_stuck_rank() -> None:
    async def probe(url: str, s: ClientSession) -> dict[str, Any]:
        pages: dict[str, Any] = {}
        for route in ["/", "/stacks", "/fr_trace", "/tcpstore", "/health"]:
            status, text = await get(s, url + route)
            assert status == 200, (route, text)
            assert "<html>" in text and "2/2 ranks responded" in text or route == "/tcpstore", (route, text[:500])
            pages[route] = (text, await get_json(s, url + route))
        status, text = await get(s, url + "/?refresh=5")
        assert status == 200 and "<meta http-equiv='refresh' content='5'>" in text
        store = current_world().store
        assert store is not None
        pages["urls"] = [(await store.get(WORKER_KEY.format(rank=r))).decode() for r in (0, 1)]
        return pages

    pages = await stuck_job(probe)

    html, index = pages["/"]
    assert index["stuck_ranks"] == [1]
    # the banner says the worst state first: never a green OK above a stuck rank
    assert index["summary"].startswith("STUCK: rank 1: never issued seq 1 (all_reduce) of group 'default_pg'"), index["summary"]
    assert ". 2/2 ranks responded" in index["summary"] and not index["partial"]
    assert index["summary"].endswith("(STUCK: an op some ranks issued that others have not followed within 0 s)")  # the rule, stated
    assert "<div class='banner bad' id='summary'>STUCK: rank 1" in html
    row0, row1 = index["rows"]
    assert row0["class"] == "waiting" and "all_reduce seq 1 of group 'default_pg'" in row0["where"]
    assert "waiting on rank 1 in seq 1 (all_reduce)" in row0["why"]
    assert row1["class"] == "stuck" and row1["state"] == "stuck"
    assert "never issued seq 1 (all_reduce) of group 'default_pg' that rank 0 is waiting in" in row1["why"]
    assert "last finished all_reduce seq 0" in row1["where"]
    assert row0["issued"] == [{"group": "default_pg", "issued": 2, "behind": False}]
    assert row1["issued"] == [{"group": "default_pg", "issued": 1, "behind": True}]
    assert "Stuck: rank 1" in html and "<tr class='stuck' id='rank1'>" in html
    assert "rank 1 never issued seq 1 (all_reduce) of group &#x27;default_pg&#x27;" in html

    html, fr = pages["/fr_trace"]
    assert fr["responded"] == [0, 1] and fr["missing"] == {}
    assert fr["analysis"]["ok"] is False
    assert fr["analysis"]["problems"][0].startswith("rank 1 never issued seq 1 (all_reduce) of group 'default_pg'; rank 0 is waiting in it")
    assert fr["ranks"]["0"]["groups"][0]["entries"][-1]["state"] == "started"
    assert [e["seq"] for e in fr["ranks"]["1"]["groups"][0]["entries"]] == [0]
    assert "PROBLEM FOUND" in html and "rank 1 never issued seq 1" in html

    html, stacks = pages["/stacks"]
    tasks0 = stacks["ranks"]["0"]["tasks"]
    op_tasks = [t for t in tasks0 if t["op_of_group"]]
    assert op_tasks and "all_reduce" in op_tasks[0]["name"]
    assert any("fn" == f["function"] for t in stacks["ranks"]["1"]["tasks"] for f in t["stack"])  # rank 1 waits in fn
    assert any(th["name"] == "MainThread" for th in stacks["ranks"]["0"]["threads"])
    assert "test_debug_server.py" in html and "release.wait()" in html

    html, store = pages["/tcpstore"]
    keys = {k["key"]: k for k in store["ranks"]["0"]["keys"]}
    for r in (0, 1):
        k = keys[WORKER_KEY.format(rank=r)]
        assert k["preview"] is None and k["size"] == len(pages["urls"][r])  # sizes, not values
    assert WORKER_KEY.format(rank=1) in html and "first 64 bytes" not in html

    html, health = pages["/health"]
    assert health["ranks"]["0"]["pending_ops"] == 1 and health["ranks"]["1"]["pending_ops"] == 0
    assert health["ranks"]["1"]["pid"] == os.getpid()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~2.6 s a run); a second loop waits them out again for the same result")
async def test_partial_when_a_worker_is_gone_or_hangs() -> None:
    unblock, stopped = asyncio.Event(), asyncio.Event()

    class Slow(DebugHandler):
        name = "slow"

        async def dump(self) -> Any:
            if current_world().rank == 1:
                await asyncio.wait_for(unblock.wait(), 10)  # not within the fetch timeout
            return {"rank": current_world().rank}

    async def fn(rank: int) -> dict[str, Any]:
        await start_debug_server(port=0, fetch_timeout=0.5, handlers=[*default_handlers(), Slow()])
        out: dict[str, Any] = {}
        if rank == 0:
            url = frontend_url()
            assert url is not None
            async with ClientSession(timeout=ClientTimeout(total=10)) as s:
                out["slow"] = await get_json(s, url + "/slow")
                out["slow_html"] = (await get(s, url + "/slow"))[1]
                unblock.set()
                await asyncio.wait_for(stopped.wait(), 5)
                out["health"] = await get_json(s, url + "/health")
                out["index"] = await get_json(s, url + "/")
                out["index_html"] = (await get(s, url + "/"))[1]
        else:
            await asyncio.wait_for(unblock.wait(), 10)
            await stop_debug_server()  # rank 1's worker is gone (and its store key with it)
            stopped.set()
        await dist.barrier()
        await stop_debug_server()
        return out

    out = (await run_world(2, fn, backend="gloo", timeout=30))[0]
    slow = out["slow"]
    assert slow["partial"] and slow["responded"] == [0] and list(slow["missing"]) == ["1"]
    assert slow["summary"].startswith("PARTIAL: 1/2 ranks responded; missing ranks [1] (rank 1: ")
    assert "took longer than 0.5 s" in slow["missing"]["1"] or "no answer within 0.5 s" in slow["missing"]["1"]
    assert "PARTIAL: 1/2 ranks responded" in out["slow_html"] and "banner bad" in out["slow_html"]
    h = out["health"]
    assert h["partial"] and "never registered in the store" in h["missing"]["1"]
    idx = out["index"]
    assert idx["rows"][1]["state"] == "no answer" and idx["stuck_ranks"] == [1]
    assert "PARTIAL: 1/2 ranks responded" in out["index_html"]


async def test_periodic_dumps_and_custom_handler(tmp_path: Any) -> None:
    class Queue(DebugHandler):
        name = "queue"
        title = "Work queue"

        async def dump(self) -> Any:
            return {"rank": current_world().rank, "depth": 3 + current_world().rank}

        def aggregate(self, per_rank: dict[int, Any]) -> dict[str, Any]:
            return {"total_depth": sum(d["depth"] for d in per_rank.values())}

        def html(self, per_rank: dict[int, Any], extra: dict[str, Any]) -> str:
            return f"<p id='total'>total depth {extra['total_depth']}</p>"

    handlers = [*default_handlers(), Queue()]

    async def probe(url: str, s: ClientSession) -> Any:
        q = await get_json(s, url + "/queue")
        status, text = await get(s, url + "/queue")
        assert status == 200 and "total depth 7" in text and "Work queue" in text
        status, _ = await get(s, url + "/nope")
        assert status == 404
        for _ in range(100):  # the dump task writes every 0.1 s
            if all(
                os.path.exists(tmp_path / f)
                for f in ("aiodist_fr_rank0.json", "aiodist_fr_rank1.json", "queue_rank1.json", "tcpstore_rank0.json")
            ):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.25)  # let both ranks write the state of seq 1 at least once
        return q

    q = await stuck_job(probe, handlers=handlers, dump_dir=tmp_path, dump_interval=0.1, enabled_dumps={"fr_trace", "queue", "tcpstore"})
    assert q["total_depth"] == 7 and q["ranks"]["1"] == {"rank": 1, "depth": 4}
    names = sorted(os.listdir(tmp_path))
    assert names == ["aiodist_fr_rank0.json", "aiodist_fr_rank1.json", "queue_rank0.json", "queue_rank1.json", "tcpstore_rank0.json"]
    # the fr dumps are what the analyzer reads; the last ones may show the job after it caught up
    dumps = [json.loads((tmp_path / f"aiodist_fr_rank{r}.json").read_text()) for r in (0, 1)]
    assert [d["rank"] for d in dumps] == [0, 1]
    assert analyze(dumps)["world_size"] == 2


async def test_argument_errors_and_restart() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="enabled_dumps names unknown handlers"):
            await start_debug_server(port=0, enabled_dumps={"nope"})
        with pytest.raises(ValueError, match="duplicate"):
            await start_debug_server(port=0, handlers=[*default_handlers(), *default_handlers()])
        assert debug_server() is None
        s = await start_debug_server(port=0)
        with pytest.raises(RuntimeError, match="already runs"):
            await start_debug_server(port=0)
        store = current_world().store
        assert store is not None
        assert (await store.get(WORKER_KEY.format(rank=rank))).decode() == s.worker_url
        await stop_debug_server()
        await stop_debug_server()  # idempotent
        assert not await store.check([WORKER_KEY.format(rank=rank)])

    await run_world(2, fn, backend="gloo", timeout=20)
    with pytest.raises(RuntimeError, match="init_process_group first"):
        await start_debug_server(port=0)


async def test_store_values_only_when_asked() -> None:
    from aiodist.debug.handlers import StoreHandler

    async def fn(rank: int) -> Any:
        store = current_world().store
        assert store is not None
        await store.set("visible/key", b"hello world")
        with_values = await StoreHandler(show_values=True).dump()
        without = await StoreHandler().dump()
        return with_values, without

    with_values, without = (await run_world(1, fn, backend="gloo", timeout=20))[0]
    assert {"key": "visible/key", "size": 11, "preview": "hello world"} in with_values["keys"]
    assert {"key": "visible/key", "size": 11, "preview": None} in without["keys"]


async def test_page_when_rank_1_waits_in_another_group() -> None:
    """Rank 0 in all_reduce seq 1 of the default group, rank 1 in a barrier on group 'side' that
    rank 0 never entered: a cross-group deadlock; the page shows where each one is and blames
    both."""
    both_in = asyncio.Barrier(2)

    async def fn(rank: int) -> Any:
        t = np.ones(4, dtype=np.float32)
        await dist.all_reduce(t)
        side = await dist.new_group([0, 1], group_desc="side")
        await start_debug_server(port=0, fetch_timeout=5, stuck_after=0)
        if rank == 0:
            work = await dist.all_reduce(t, async_op=True)
        else:
            work = await dist.barrier(group=side, async_op=True)
        assert work is not None
        await asyncio.wait_for(both_in.wait(), 10)
        out = None
        if rank == 0:
            url = frontend_url()
            assert url is not None
            async with ClientSession(timeout=ClientTimeout(total=20)) as s:
                out = await get_json(s, url + "/")
            await dist.barrier(group=side)  # untangle: rank 0 enters the barrier, then rank 1 the all_reduce
        else:
            await work.wait()
            await dist.all_reduce(t)
        await both_in.wait()
        if rank == 0:
            await work.wait()
        await stop_debug_server()
        return out

    index = (await run_world(2, fn, backend="gloo", timeout=30))[0]
    assert index["stuck_ranks"] == [0, 1]
    row0, row1 = index["rows"]
    assert row0["where"].startswith("all_reduce seq 1 of group 'default_pg'")
    assert row1["where"].startswith("barrier seq 0 of group 'side'")
    assert "never issued seq 0 (barrier) of group 'side' that rank 1 is waiting in" in row0["why"]
    assert "never issued seq 1 (all_reduce) of group 'default_pg' that rank 0 is waiting in" in row1["why"]


async def blocked_job(probe: Probe) -> tuple[Any, float]:
    """A 2-rank gloo job on two event loops (rank 1's in a thread, as two processes would have):
    rank 1 blocks its loop in ``step`` (``time.sleep`` until the probe is done, at most 20 s);
    ``probe(frontend_url, session)`` runs on rank 0 meanwhile. Returns what probe returned and how
    long it took. AIODIST_LOOP_BLOCKED_WARN is what the caller set (default 2 s)."""
    import threading
    import time

    from aiodist.c10d.world import World, use_world

    master = await dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=10)
    ready, go, done, released = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    failure: list[BaseException] = []

    async def step() -> None:
        end = time.monotonic() + 20
        while not released.is_set() and time.monotonic() < end:  # the loop does not run meanwhile
            time.sleep(0.05)  # noqa: ASYNC251 - the blocked loop under test  (rank-1-blocks-here)

    async def rank1() -> None:
        with use_world(World("rank 1")):
            store = await dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=10)
            await dist.init_process_group("gloo", store=store, rank=1, world_size=2)
            await start_debug_server(port=0, fetch_timeout=10, stuck_after=0)
            await dist.all_reduce(np.ones(2, np.float32))
            ready.set()
            await asyncio.to_thread(go.wait, 10)
            await step()
            await stop_debug_server()
            await dist.destroy_process_group()
            await store.close()

    def thread_main() -> None:
        try:
            asyncio.run(rank1())
        except BaseException as exc:  # reported by the test
            failure.append(exc)
            ready.set()
        finally:
            done.set()

    t = threading.Thread(target=thread_main, name="rank 1 loop")
    t.start()
    try:
        with use_world(World("rank 0")):
            await dist.init_process_group("gloo", store=master, rank=0, world_size=2)
            await start_debug_server(port=0, fetch_timeout=10, stuck_after=0)
            await dist.all_reduce(np.ones(2, np.float32))
            assert await asyncio.to_thread(ready.wait, 10) and not failure, failure
            url = frontend_url()
            assert url is not None
            go.set()
            await asyncio.sleep(0.2)  # rank 1 is in time.sleep now
            async with ClientSession(timeout=ClientTimeout(total=20)) as s:
                t0 = time.monotonic()
                try:
                    result = await probe(url, s)
                finally:
                    took = time.monotonic() - t0
                    released.set()
            await asyncio.to_thread(done.wait, 15)
            await stop_debug_server()
            await dist.destroy_process_group()
    finally:
        go.set()
        released.set()
        await asyncio.to_thread(t.join, 15)
        await master.close()
    assert not failure, failure
    return result, took


def blocked_line() -> str:
    lines = open(__file__).read().splitlines()  # noqa: SIM115 - a test reading its own source
    n = 1 + next(i for i, line in enumerate(lines) if "(rank-1-blocks-here)" in line and "lines" not in line)
    return f"tests/test_debug_server.py:{n} in step: time.sleep(0.05)"


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~2.3 s a run); a second loop waits them out again for the same result")
async def test_page_names_a_blocked_loop_within_5_s() -> None:
    async def probe(url: str, s: ClientSession) -> dict[str, Any]:
        out = {"index": await get_json(s, url + "/")}
        out["html"] = (await get(s, url + "/"))[1]
        out["stacks"] = await get_json(s, url + "/stacks")
        out["health"] = await get_json(s, url + "/health")
        return out

    pages, took = await blocked_job(probe)
    where = blocked_line()
    index = pages["index"]
    assert took < 5.0, took  # four pages, each answered without rank 1's loop
    print(f"four pages with rank 1's loop blocked: {took:.2f} s")
    assert index["summary"].startswith("BLOCKED: rank 1: event loop blocked for "), index["summary"]
    assert f"at {where}" in index["summary"] and index["summary"].endswith(". 2/2 ranks responded"), index["summary"]
    row1 = index["rows"][1]
    assert row1["state"] == "blocked" and row1["why"].startswith("event loop blocked for ") and where in row1["why"]
    assert index["rows"][0]["state"] != "blocked" and index["stuck_ranks"] == [1] and index["blocked_ranks"] == [1]
    assert "rank 1: event loop blocked for" in pages["html"] and where in html_unescape(pages["html"])
    blocked = pages["stacks"]["blocked"]["1"]
    assert where in blocked["at"] and any("in rank1: await step()" in f for f in blocked["stack"])
    threads = pages["stacks"]["ranks"]["1"]["threads"]
    assert any(th["name"] == "rank 1 loop" and any(f["function"] == "step" for f in th["stack"]) for th in threads)
    health1 = pages["health"]["ranks"]["1"]
    assert health1["loop_turn_ms"] is None and health1["loop_blocked"]["at"].startswith(where)
    assert pages["health"]["ranks"]["0"]["loop"]["blocked"] is False


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)


def test_a_tasks_world_is_read_without_entering_its_context() -> None:
    """The debug worker reads a blocked loop's task's World from another thread, while the loop's
    thread is inside that task's Context: entering it again raises on 3.12+ (it did, /stacks
    failed on a blocked loop). world_of reads it from inside the entered Context too."""
    import contextvars

    from aiodist.c10d.world import World, set_world, world_of

    w = World("the task's")
    ctx = contextvars.copy_context()
    ctx.run(set_world, w)
    assert ctx.run(lambda: world_of(ctx)) is w  # while ctx is entered
    assert world_of(contextvars.Context()) is not w  # a Context that never set one: the process's World


async def test_the_front_page_names_the_line_a_waiting_rank_waits_at() -> None:
    """Rank 0's code waits in a blocking all_reduce that rank 1 has not issued: the front page's
    row for rank 0 names that line of the user's code (the innermost frame outside aiodist and
    asyncio) and the call, and the banner says WAITING/STUCK, not OK."""
    release = asyncio.Event()
    out: dict[str, Any] = {}

    async def fn(rank: int) -> None:
        t = np.ones(4, dtype=np.float32)
        await dist.all_reduce(t)
        await start_debug_server(port=0, fetch_timeout=5.0, stuck_after=0)
        try:
            if rank == 0:

                async def train_step() -> None:
                    await dist.all_reduce(t)  # the line the page names

                step = asyncio.create_task(train_step())
                await asyncio.sleep(0.05)
                url = frontend_url()
                assert url is not None
                try:
                    async with ClientSession(timeout=ClientTimeout(total=20)) as s:
                        out["index"] = await get_json(s, url + "/")
                        out["html"] = (await get(s, url + "/"))[1]
                finally:
                    release.set()
                await step
            else:
                await release.wait()
                await dist.all_reduce(t)
        finally:
            await stop_debug_server()

    await run_world(2, fn, backend="gloo", timeout=30)
    row0, row1 = out["index"]["rows"]
    mine = [a for a in row0["at"] if "in train_step: await dist.all_reduce(t)  # the line the page names" in a]
    assert len(mine) == 1 and "test_debug_server.py:" in mine[0], row0
    assert "the line the page names" in out["html"]
    assert not out["index"]["summary"].startswith("OK"), out["index"]["summary"]
    if sys.version_info >= (3, 12):  # tasks told apart by World: rank 1 waits on an Event, not in aiodist
        assert row1["at"] == [], row1


async def test_health_shows_the_aiodist_variables_each_rank_has_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """/health lists, per rank, the AIODIST_* variables set and how the rank read them
    (aiodist.knobs), a bad value as what is wrong with it."""
    monkeypatch.setenv("AIODIST_STORE_SPIN_US", "250")
    monkeypatch.setenv("AIODIST_DDP_BACKWARD", "gpu")  # read by DDP only: shown as it would be read

    async def probe(url: str, s: ClientSession) -> Any:
        return await get_json(s, url + "/health"), (await get(s, url + "/health"))[1]

    health, html = await stuck_job(probe)
    for r in ("0", "1"):
        knobs = {k["name"]: k for k in health["ranks"][r]["knobs"]}
        assert knobs["AIODIST_STORE_SPIN_US"]["set"] == "250" and knobs["AIODIST_STORE_SPIN_US"]["value"] == 250.0
        assert str(knobs["AIODIST_DDP_BACKWARD"]["value"]).startswith("invalid: AIODIST_DDP_BACKWARD='gpu'")
    assert "<table id='knobs'>" in html and "AIODIST_STORE_SPIN_US" in html


async def idle_service_job(probe: Probe) -> tuple[Any, Any]:
    """A 2-rank service group (``idle_until_leader(0)``): rank 1 waits in broadcast seq 1 for rank
    0's next request, and ``probe`` (on rank 0) reads the page: IDLE. Rank 0 then serves that
    request and issues an all_reduce (seq 2) that rank 1 does not follow (it waits on an event)
    for longer than the page's threshold (0.3 s): ``probe`` reads STUCK. Then rank 1 follows and
    the job ends cleanly. Returns both probes' results."""
    release = asyncio.Event()
    out: dict[str, Any] = {}

    async def fn(rank: int) -> None:
        dist.idle_until_leader(0)
        t = np.ones(4, dtype=np.float32)
        await dist.broadcast(t, src=0)  # seq 0: one request served
        await start_debug_server(port=0, fetch_timeout=5.0, stuck_after=0.3)
        try:
            if rank == 0:
                await asyncio.sleep(0.5)  # rank 1 idles in seq 1 meanwhile (for longer than the threshold)
                url = frontend_url()
                assert url is not None
                async with ClientSession(timeout=ClientTimeout(total=20)) as s:
                    out["idle"] = await probe(url, s)
                    await dist.broadcast(t, src=0)  # seq 1: the request rank 1 waited for
                    work = await dist.all_reduce(t, async_op=True)  # seq 2: rank 1 does not follow yet
                    await asyncio.sleep(0.6)
                    out["stuck"] = await probe(url, s)
                release.set()
                await work.wait()
            else:
                await dist.broadcast(t, src=0)
                await release.wait()
                await dist.all_reduce(t)
        finally:
            await stop_debug_server()

    await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=30)
    return out["idle"], out["stuck"]


async def test_the_page_says_idle_for_an_idle_service_and_stuck_for_a_hang_in_it() -> None:
    async def probe(url: str, s: ClientSession) -> Any:
        return await get_json(s, url + "/")

    idle, stuck = await idle_service_job(probe)
    assert idle["summary"].startswith("IDLE: rank 1: idle for "), idle["summary"]
    assert "waiting for rank 0 to issue seq 1 (broadcast) of group 'default_pg'" in idle["summary"]
    assert idle["stuck_ranks"] == [] and idle["rows"][1]["state"] == "idle"
    assert not [a for row in idle["rows"] for a in row["at"] if "aiohttp" in a], idle["rows"]  # not the page's own request
    assert stuck["summary"].startswith("STUCK: rank 1: never issued seq 2 (all_reduce)"), stuck["summary"]
    assert "within 0.3 s" in stuck["summary"] and stuck["stuck_ranks"] == [1]
