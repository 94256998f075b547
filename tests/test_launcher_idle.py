"""An idle multi-node job does not poll its rendezvous store: two agents (one loop, real
processes for workers) watch their round through store waits and heartbeats, so the server
sees a few requests a second, not nodes x 10/s (the 0.1 s polling loops it replaced). And the
watch (``RoundWatch``) takes a failure record it cannot read for a remote failure."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import pytest

from aiodist.elastic.errors import ProcessFailure
from aiodist.launcher._watch import RoundWatch
from aiodist.launcher.agent import LocalAgent
from aiodist.launcher.api import LaunchConfig, _rendezvous, _worker_spec
from aiodist.launcher.rendezvous import AgentRendezvous
from aiodist.store import HashStore
from aiodist.testing.ports import free_port

WORKER = Path(__file__).resolve().parent / "helpers" / "wait_for_file.py"  # PATH: exits once PATH exists
MEASURE_S = 3.0
# Measured on a loaded 2-core machine: ~2 requests/s per node (one heartbeat look: 2 adds);
# the polling agent made ~22/s per node.
MAX_PER_NODE_S = 6.0


async def _until(cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s")
        await asyncio.sleep(0.05)


@pytest.mark.one_loop(
    reason="the launchers and ranks are child processes that run their own loops; this process waits on them and counts the store's requests"
)
@pytest.mark.subprocess
@pytest.mark.timeout(90)
async def test_idle_two_node_job_does_not_poll_the_store(tmp_path: Path) -> None:
    port, go = free_port(), tmp_path / "go"
    agents = []
    for node in (0, 1):
        config = LaunchConfig(
            min_nodes=2,
            max_nodes=2,
            nproc_per_node=1,
            run_id="idle",
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_configs={"rank": node, "join_timeout": 30},
            max_restarts=0,
        )
        spec = _worker_spec(config, sys.executable, [str(WORKER), str(go)])
        agents.append(LocalAgent(spec, _rendezvous(config), logging.getLogger("aiodist.run")))
    runs = [asyncio.ensure_future(a.run()) for a in agents]
    try:
        await _until(lambda: all(a.workers and a.workers[0].proc is not None for a in agents), 30)
        host = agents[0].rdzv.server
        assert host is not None
        # both watches armed: each agent's failure wait is parked at the server
        await _until(lambda: host.server.stats()["waiters"] >= len(agents), 30)
        r0, t0 = host.server.stats()["requests"], time.monotonic()
        await asyncio.sleep(MEASURE_S)
        r1, t1 = host.server.stats()["requests"], time.monotonic()
        rate = (r1 - r0) / (t1 - t0) / len(agents)
        print(f"idle 2-node job: {rate:.1f} store requests/s per node")
        assert rate <= MAX_PER_NODE_S, f"{rate:.1f} store requests/s per node while idle"
        go.write_text("")
        results = await asyncio.wait_for(asyncio.gather(*runs), 30)
        assert results == [{0: None}, {1: None}]
    finally:
        go.write_text("")
        for r in runs:
            if not r.done():
                r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


class _Rdzv:
    """What RoundWatch uses of an AgentRendezvous, over a HashStore; ``wait_failure`` is the
    real one (it decodes the record)."""

    heartbeat_timeout = 30.0
    wait_failure = AgentRendezvous.wait_failure

    def __init__(self) -> None:
        self.store = HashStore()

    def key(self, k: int, name: str) -> str:
        return f"round{k}/{name}"

    async def heartbeat(self, k: int) -> dict[int, float]:
        return {}


GOOD = ProcessFailure(0, 3, 1234, 1, hostname="node1", message="boom", resolve=False).to_dict()


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ("not json", "unreadable failure record (JSONDecodeError"),
        ("[1, 2]", "unreadable failure record (TypeError"),
        (json.dumps({"rank": 3}), "unreadable failure record (KeyError"),
        (json.dumps(GOOD), "boom"),
    ],
    ids=["not-json", "not-an-object", "missing-fields", "good"],
)
async def test_a_failure_record_the_watch_cannot_read_is_still_a_remote_failure(record: str, says: str) -> None:
    rdzv, wake = _Rdzv(), asyncio.Event()
    await rdzv.store.set(rdzv.key(0, "failed"), record)
    watch = RoundWatch(rdzv, 0, wake, logging.getLogger("test"))  # type: ignore[arg-type]
    try:
        await _until(lambda: watch.remote is not None, 5)
    finally:
        await watch.close()
    assert watch.remote is not None and says in watch.remote["message"], watch.remote
    ProcessFailure.from_dict(watch.remote)  # what the agent does with it
    assert not watch.watching
