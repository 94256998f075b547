"""A service group that idles until its leader (``idle_until_leader``) still names a lost leader
at once: 3 ranks serve 3 requests, then the followers idle for the next; the test SIGKILLs the
leader (rank 0, which also serves the env:// store), and each follower's error names rank 0
within 2 s, though the group's timeout is 60 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _procs import kill_all, read_lines_until, start_ranks  # this folder's helpers (pytest puts it on sys.path)

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "idle_service_rank.py"


def test_a_lost_leader_is_named_at_once_by_idle_followers() -> None:
    outs: dict[int, list[str]] = {r: [] for r in range(3)}
    procs = start_ranks(WORKER, 3, args=(60,))
    try:
        assert read_lines_until(procs, "running", time.monotonic() + 30, outs) == {0, 1, 2}, outs
        time.sleep(0.5)  # the followers idle in the next broadcast
        killed = time.time()
        os.kill(procs[0].pid, signal.SIGKILL)
        followers = {r: procs[r] for r in (1, 2)}
        read_lines_until(followers, "ERROR", time.monotonic() + 10, outs)
    finally:
        kill_all(procs)
    for r in (1, 2):
        err = next((line for line in outs[r] if line.startswith("ERROR ")), None)
        assert err is not None, (r, outs[r])
        _, t, rest = err.split(" ", 2)
        assert rest.startswith("[0] "), err
        assert float(t) - killed < 2.0, err
