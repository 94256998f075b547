"""aiodist.breakpoint: pdb on one rank, the other ranks await a barrier with their event loops
running (a ticker task advances on them while rank 0 sits in pdb), ``skip``, the timeout."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import aiodist as dist
from aiodist.debug.breakpoint import STDIN_ENV, breakpoint
from aiodist.testing.ports import free_port
from aiodist.testing.world import run_world

REPO = Path(__file__).resolve().parents[1]

JOB = REPO / "tests" / "helpers" / "breakpoint_job.py"


class _Reader(threading.Thread):
    """Collects a pipe's text; ``wait_for`` blocks (bounded) until a string appears."""

    def __init__(self, pipe: IO[str]) -> None:
        super().__init__(daemon=True)
        self.pipe, self.text, self.cond = pipe, "", threading.Condition()
        self.start()

    def run(self) -> None:
        for chunk in iter(lambda: self.pipe.read(1), ""):
            with self.cond:
                self.text += chunk
                self.cond.notify_all()

    def wait_for(self, needle: str, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: needle in self.text, timeout)


def test_two_process_job_other_rank_keeps_running() -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("AIODIST_DEBUG", None)
        if rank == 0:
            env[STDIN_ENV] = "/dev/stdin"  # pdb reads the pipe below instead of a terminal
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB)],
                cwd=REPO,
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    readers = [_Reader(p.stdout) for p in procs]  # type: ignore[arg-type]
    try:
        assert readers[0].wait_for("(Pdb rank 0)", 20), readers[0].text + readers[1].text
        time.sleep(0.8)  # rank 0 sits in pdb; rank 1 must keep ticking meanwhile
        stdin = procs[0].stdin
        assert stdin is not None
        stdin.write("up\np secret, i\ncontinue\n")
        stdin.flush()
        for p in procs:
            p.wait(timeout=20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
    out0, out1 = readers[0].text, readers[1].text
    for p, out in zip(procs, (out0, out1), strict=True):
        assert p.returncode == 0, out
    assert "!!! ATTENTION !!!" in out0 and "(41, 1)" in out0  # the second call stopped, in the caller's scope
    assert "await breakpoint(rank=0, skip=1, timeout_s=20)" in out0  # 'up': the coroutine that called it
    results = [json.loads(next(line for line in out.splitlines() if "RESULT " in line).split("RESULT ", 1)[1]) for out in (out0, out1)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    waits = results[1]["waits"]
    assert waits[0]["s"] < 0.5  # skipped
    assert waits[1]["s"] >= 0.7, waits  # rank 1 waited for rank 0's debugger ...
    assert waits[1]["ticks"] >= 20, waits  # ... with its event loop running
    assert "(Pdb" not in out1


async def test_in_process_continue() -> None:
    out = io.StringIO()

    async def fn(rank: int) -> float:
        secret = 7  # noqa: F841 - printed from pdb
        await breakpoint(rank=1, stdin=io.StringIO("up\np secret\nc\n"), stdout=out)
        t = np.ones(1, np.float32)
        await dist.all_reduce(t)
        return float(t[0])

    assert await run_world(2, fn, backend="memory") == [2.0, 2.0]
    assert "(Pdb rank 1) 7\n" in out.getvalue()
    assert sys.gettrace() is None or "coverage" in repr(sys.gettrace())


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.6 s a run); a second loop waits them out again for the same result")
async def test_waiting_ranks_time_out() -> None:
    async def fn(rank: int) -> str:
        if rank == 1:
            await asyncio.sleep(0.6)  # rank 1 never reaches the breakpoint in time
            return ""
        with pytest.raises(dist.DistTimeoutError) as info:
            await breakpoint(rank=1, timeout_s=0.2)
        return str(info.value) + " ".join(getattr(info.value, "__notes__", []))

    msg = (await run_world(2, fn, backend="memory", pg_timeout=10))[0]
    assert "Rank 1 failed to pass monitoredBarrier in 200 ms" in msg
    assert "aiodist.breakpoint: the ranks waited up to 0.2 s for rank 1's debugger" in msg


async def test_bad_arguments() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="out of range"):
            await breakpoint(rank=2)
        with pytest.raises(ValueError, match="skip"):
            await breakpoint(skip=-1)
        with pytest.raises(ValueError, match="timeout_s"):
            await breakpoint(timeout_s=0)
        with pytest.raises(TypeError):
            await breakpoint(rank="0")  # type: ignore[arg-type]

    await run_world(2, fn)


async def test_skip_counts_per_rank_in_one_process() -> None:
    """Ranks sharing a process (run_world) each count their own calls for ``skip``, and a new
    World starts from zero (the counts were once keyed by ``id(world)``, which a later World may
    reuse: its rank then skipped fewer calls than its peer and waited in a barrier for ever)."""
    for _ in range(4):
        out = io.StringIO()

        async def fn(rank: int) -> int:
            for i in range(3):
                await breakpoint(rank=0, skip=2, stdin=io.StringIO(f"p {i}\nc\n"), stdout=out)  # noqa: B023
            return rank

        assert await run_world(2, fn, timeout=10) == [0, 1]
        gc.collect()  # the worlds go (the next run_world's may get their ids), and their counts with them
        assert len(sys.modules["aiodist.debug.breakpoint"]._calls) <= 1  # pdb may keep rank 0's last frame
        assert out.getvalue().count("!!! ATTENTION !!!") == 1 and "(Pdb rank 0) 2\n" in out.getvalue()
