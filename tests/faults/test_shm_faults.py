"""SIGKILL of one of 3 ranks while they loop on a 16 MiB all_reduce through shared memory
(aiodist.shm): the survivors, waiting on the dead rank's doorbell or reading its pages, raise a
DistError naming it within 3 s (group timeout 20 s, so a pass shows the death was noticed, not
timed out), and nothing is left in /dev/shm (the segments are memfds)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiodist.elastic.utils import get_free_port

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

N = 3
VICTIM = 1
GROUP_TIMEOUT_S = 20.0
DETECT_S = 3.0  # the bound under test (measured: tens of ms)
START_S = 40.0  # 3 interpreters importing numpy on a loaded 2-core machine
EXIT_S = GROUP_TIMEOUT_S + 10.0

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import asyncio, os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import aiodist as dist

async def main():
    await dist.init_process_group("gloo", timeout={timeout})
    x = np.ones((16 << 20) // 4, dtype=np.float32)
    await dist.all_reduce(x)
    used = dist.group.WORLD.backend.stats()["shm"]["groups"]
    print(f"running {{used}}", flush=True)
    try:
        while True:
            await dist.all_reduce(x)
    except dist.DistError as exc:
        t = time.time()
        print(f"ERROR {{t!r}} {{type(exc).__name__}}: {{' '.join(str(exc).split())}}", flush=True)
    os._exit(0)

asyncio.run(main())
"""


def _line(p: subprocess.Popen[str], want: str, deadline: float) -> str:
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            return ""
        if line.startswith(want):
            return line.rstrip("\n")
    return ""


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def test_sigkill_during_shared_memory_all_reduce_fails_the_survivors_fast(tmp_path: Path) -> None:
    before = _dev_shm()
    script = tmp_path / "rank.py"
    script.write_text(WORKER.format(root=str(ROOT), timeout=GROUP_TIMEOUT_S))
    port = str(get_free_port())
    procs: dict[int, subprocess.Popen[str]] = {}
    errs = [open(tmp_path / f"err{r}", "w") for r in range(N)]  # noqa: SIM115 - closed below
    try:
        for r in range(N):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(N), AIODIST_SHM_BYTES="8M")
            # stderr to a file: an unread pipe could fill and stall a rank
            procs[r] = subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=errs[r], text=True, bufsize=1
            )
        deadline = time.monotonic() + START_S
        running = {r: _line(p, "running", deadline) for r, p in procs.items()}
        assert all(line == "running [0]" for line in running.values()), (
            running,
            [(tmp_path / f"err{r}").read_text()[-2000:] for r in procs],
        )
        time.sleep(0.3)  # a few ops past the first
        killed_at = time.time()
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_S
        errors = {r: _line(p, "ERROR", deadline) for r, p in procs.items() if r != VICTIM}
        for p in procs.values():
            p.wait(timeout=10)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
        for f in errs:
            f.close()
    took = {}
    for r, line in errors.items():
        assert line, f"rank {r} raised no DistError after rank {VICTIM} was killed: {(tmp_path / f'err{r}').read_text()[-2000:]}"
        _, t, msg = line.split(" ", 2)
        took[r] = float(t) - killed_at
        assert re.search(rf"\brank {VICTIM}\b", msg), f"rank {r}'s error does not name rank {VICTIM}: {msg}"
    print("time to error by survivor: " + ", ".join(f"rank {r} {s:.3f} s" for r, s in took.items()))
    assert all(s < DETECT_S for s in took.values()), took
    assert _dev_shm() <= before, f"new files in /dev/shm: {_dev_shm() - before}"
