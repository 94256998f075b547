"""A peer's timeout names a rank whose event loop is blocked, with where it is blocked:
the blocked rank's loop watchdog writes it to the store from its own thread (aiodist.c10d._blocked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "helpers" / "blocked_loop_job.py"


def test_a_peers_timeout_names_the_blocked_loop_and_where() -> None:
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
        procs.append(
            subprocess.Popen([sys.executable, str(JOB)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
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
    assert f"{JOB.relative_to(ROOT)}:" in msg and "in busy: time.sleep(3.5)" in msg, msg
    assert msg.index("rank 1's event loop is blocked") < msg.index("timed out after")  # the headline comes first
