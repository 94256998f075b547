"""A clean job's end is quiet: no WARNING or ERROR line on any rank, over many jobs (a peer's
HELLO that arrives after a rank closed its transport is the ordinary end of a job: DEBUG). Real
processes (tests/helpers/clean_job.py, 4 ranks, rank 0 serving the env:// store), and many
in-process jobs with their log records captured."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers.env_job import run_env_job

import aiodist as dist
from aiodist.testing import run_world

pytestmark = pytest.mark.timeout(120)


@pytest.mark.subprocess
def test_clean_jobs_print_no_warning_or_error() -> None:
    for _ in range(2):
        r = run_env_job("tests/helpers/clean_job.py", 4, timeout=60)
        assert r.ok and all(o.strip() == "clean" for o in r.stdouts), r.report()
        noisy = [line for e in r.stderrs for line in e.splitlines() if "WARNING" in line or "ERROR" in line]
        assert not noisy, r.report()


@pytest.mark.one_loop(reason="many short jobs: the loops' own differences are tested elsewhere")
async def test_many_clean_in_process_jobs_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def fn(rank: int) -> None:
        x = np.ones(64, np.float32)
        await dist.all_reduce(x)
        await dist.broadcast(x, src=3)
        await dist.destroy_process_group()

    with caplog.at_level(logging.WARNING, logger="aiodist"):
        for _ in range(10):
            await run_world(4, fn, backend="gloo", timeout=30)
    # aiodist's own loggers (asyncio's debug mode may warn of a slow callback on a loaded machine)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("aiodist")]
    assert not noisy, caplog.text
