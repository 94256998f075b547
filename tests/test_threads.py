"""Collectives called from threads that are not the job's event loop (aiodist._threads), in
real two-rank jobs (tests/helpers/threads_job.py): the first op of a job from a thread's own
loop, ``asyncio.to_thread``, a plain thread pool, ``async_op=True`` on a thread's loop and an
object collective all run on the World's loop and give the right values; a loop blocked on the
calling thread gives that thread a timeout naming the mistake and leaves the group in step; a
call after the job's loop closed is refused at once, destroy included."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.rank_procs import run_ranks

from aiodist.testing.ports import free_port

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

JOB = Path(__file__).resolve().parent / "helpers" / "threads_job.py"


def job(mode: str) -> list[dict[str, Any]]:
    port = free_port()
    envs = [dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(2)]
    return run_ranks([[sys.executable, str(JOB), mode]] * 2, envs, 90)


def test_collectives_from_threads_run_on_the_worlds_loop() -> None:
    for rank, res in enumerate(job("threads")):
        assert res["rank"] == rank
        assert res["first_op_thread_asyncio_run"] == [3.0] * 4  # the job's first op, from a thread
        assert res["to_thread"] == [30.0] * 3 and res["to_thread_await"] is None
        assert res["pool"] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]
        assert res["async_op_thread"] == ["ForeignWork", True, True, True]
        assert res["async_op_values"] == [11.0, 11.0]
        assert res["object_thread"] == [{"rank": 0}, {"rank": 1}]
        assert res["after"] == [2.0, 2.0]  # the default group is alive and in step


def test_a_loop_blocked_on_the_calling_thread_is_named_and_the_group_stays_in_step() -> None:
    for rank, res in enumerate(job("blocked")):
        err = res["blocked"]
        assert err is not None and err["type"] == "DistTimeoutError", res
        assert "all_reduce(...) called at" in err["msg"] and "threads_job.py" in err["msg"]
        assert "is blocked" in err["msg"] and "thread.join()" in err["msg"] and "was not started" in err["msg"]
        assert 2.5 <= res["blocked_s"] < 20  # the group's timeout (3 s), not forever
        assert res["x"] == [rank + 1.0] * 2  # never started: nothing written
        assert res["after"] == [3.0, 3.0]  # no sequence number was taken: the next op matches


def test_calls_after_the_jobs_loop_closed_are_refused_at_once() -> None:
    for res in job("closed"):
        assert res["first"] == [2.0, 2.0]
        for key in ("refused", "destroy"):
            err = res[key]
            assert err["type"] == "DistError", res
            assert "loop is closed" in err["msg"] and "one asyncio.run(main())" in err["msg"]
        assert "all_reduce(...) called at" in res["refused"]["msg"]
        assert res["refused_s"] < 1.0


def test_init_again_after_the_jobs_loop_closed_is_refused_with_the_rule() -> None:
    import subprocess
    import sys

    helper = Path(__file__).resolve().parent / "helpers" / "init_after_loop_closed.py"
    out = subprocess.run([sys.executable, str(helper)], capture_output=True, text=True, timeout=60).stdout.strip()
    assert out.startswith("DistError: init_process_group(...): the default group exists: "), out
    assert "that loop is closed (asyncio.run returned)" in out, out
