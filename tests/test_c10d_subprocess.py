"""aiodist jobs of three real processes (tests/helpers/c10d_worker.py) over the socket backend:
rendezvous through ``tcp://`` and ``env://``, collectives correct across processes, and a rank
that never joins an op makes every other rank fail within the group's timeout, with a message
that names the op, the group, the sequence number and the rank not heard from. Every wait on a
child is bounded; children still running when a test ends are killed (by pid, our own only)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.rank_procs import run_ranks

from aiodist.testing.ports import free_port

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

WORKER = Path(__file__).resolve().parent / "helpers" / "c10d_worker.py"
N = 3
WAIT_S = 60  # a bound on a whole job, far above what it needs
GROUP_TIMEOUT_S = 2.0  # c10d_worker.GROUP_TIMEOUT_S
SLACK_S = 5.0  # a loaded 2-core box


def run_job(mode: str, how: str) -> list[dict[str, Any]]:
    """Start N workers, wait for all of them (bounded), return their JSON results in rank order."""
    port = free_port()
    argvs, envs = [], []
    for rank in range(N):
        env = dict(os.environ)
        if how == "env":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(N))
            args = [mode, "env"]
        else:
            args = [mode, f"tcp://127.0.0.1:{port}", str(rank), str(N)]
        argvs.append([sys.executable, str(WORKER), *args])
        envs.append(env)
    return run_ranks(argvs, envs, WAIT_S)


@pytest.mark.parametrize("how", ["tcp", "env"])
def test_three_processes_all_reduce_broadcast_all_to_all_single(how: str) -> None:
    results = run_job("ops", how)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["world_size"] == N
        assert res["all_reduce"] == [float(k * sum(r + 1 for r in range(N))) for k in range(10)]
        assert res["all_reduce_max_ok"] is True
        assert res["broadcast"] == [[10.0 * root + 1] * 4 for root in range(N)]
        want = []
        for i in range(N):
            want += [[100 * i + rank] * 2] * ((i + rank) % 3 + 1)
        assert res["all_to_all_single"] == want


@pytest.fixture(scope="module")
def skip_job() -> tuple[float, list[dict[str, Any]]]:
    """One "skip" job (rank 2 never joins seq 1 of group "skipper"), shared by the tests below."""
    start = time.monotonic()
    results = run_job("skip", "tcp")
    return time.monotonic() - start, results


def test_a_rank_that_never_joins_fails_the_others_within_the_timeout(skip_job: tuple[float, list[dict[str, Any]]]) -> None:
    took, results = skip_job
    assert took < WAIT_S  # every process exited (run_job asserts exit status 0)
    for res in results[: N - 1]:
        assert res["error"] in ("DistTimeoutError", "DistBackendError"), res
        msg = res["message"]
        assert "all_reduce" in msg and "skipper" in msg, msg
        assert "seq 1" in msg, msg
        assert "not heard from" in msg, msg
        assert GROUP_TIMEOUT_S - 0.5 <= res["elapsed"] < GROUP_TIMEOUT_S + SLACK_S, res
        assert "unusable" in res["later_op"], res  # the group is broken afterwards
        assert res["default_group_ok"] is True  # other groups are not
    assert "[2]" in results[0]["message"], results[0]  # rank 0 waits on rank 2 directly
    assert results[N - 1] == {"rank": N - 1, "default_group_ok": True}


def test_every_other_rank_names_the_rank_that_never_joined(skip_job: tuple[float, list[dict[str, Any]]]) -> None:
    _, results = skip_job
    for res in results[: N - 1]:
        assert "ranks stuck outside this op (never reported being in it): [2]" in res["message"], res["message"]
