"""A peer's timeout names a rank whose event loop is blocked, with where it is blocked (issue 13):
the blocked rank's loop watchdog writes it to the store from its own thread (aiodist.c10d._blocked).

Fails before: rank 0 said ``rank 1 never issued all_reduce seq 0`` (or "stuck outside this op"),
not that rank 1's loop was blocked, nor where."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import asyncio, sys, time
import numpy as np
import aiodist as dist

def busy():
    time.sleep(3.5)  # blocking code in a coroutine: the loop cannot run

async def main():
    await dist.init_process_group("gloo", timeout=1.5)
    rank = dist.get_rank()
    await dist.barrier()
    if rank == 1:
        busy()
        return
    try:
        await dist.all_reduce(np.ones(2))
    except dist.DistError as e:
        print("ERROR:", e, flush=True)

asyncio.run(main())
"""


def test_a_peers_timeout_names_the_blocked_loop_and_where(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            AIODIST_LOOP_BLOCKED_WARN="0.3",
        )
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=40)
        procs[1].communicate(timeout=40)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "ERROR:" in out0, err0[-3000:]
    msg = out0.split("ERROR:", 1)[1]
    assert "rank 1's event loop is blocked" in msg, msg
    assert f"{script}:" in msg and "in busy: time.sleep(3.5)" in msg, msg
    assert msg.index("rank 1's event loop is blocked") < msg.index("timed out after")  # the headline comes first
