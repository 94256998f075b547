"""env:// under schedulers (aiodist/_schedulers.py, docs/schedulers.md): Slurm host-list
expansion, the order of precedence (arguments > torchrun's RANK/WORLD_SIZE > MPI > Slurm),
MASTER_ADDR/MASTER_PORT derived inside a Slurm job, errors that name the missing variables, all
through environment variables; and real 2-rank jobs whose processes get only Slurm's (or Open
MPI's) variables and do an all_reduce (tests/helpers/env_rank_worker.py)."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.rank_procs import run_ranks

import aiodist
from aiodist._schedulers import SCHEDULERS, detect_scheduler, expand_hostlist, node_local_rank, resolve_env, slurm_master_port
from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

WORKER = Path(__file__).resolve().parent / "helpers" / "env_rank_worker.py"

TORCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"]
SLURM_VARS = [
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
]
ALL_VARS = TORCH_VARS + SLURM_VARS + sorted({v for s in SCHEDULERS for v in (s.rank_var, s.size_var, *s.local_rank_vars)})


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ALL_VARS:
        monkeypatch.setenv(v, "x")  # so that monkeypatch restores the variable even when code sets it
        monkeypatch.delenv(v)


def setenv(monkeypatch: pytest.MonkeyPatch, **values: Any) -> None:
    for k, v in values.items():
        monkeypatch.setenv(k, str(v))


# -- host lists ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("n[008-010],login", ["n008", "n009", "n010", "login"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("cn[5],x[1-2].cluster", ["cn5", "x1.cluster", "x2.cluster"]),
        ("", []),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[3-1]", "node[a-b]", "n[[1]]"])
def test_expand_hostlist_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(bad)


# -- precedence and derivation --------------------------------------------------------------------


def test_slurm_alone_gives_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, SLURM_PROCID=5, SLURM_NTASKS=8, SLURM_LOCALID=1, SLURM_JOB_NODELIST="node[03-05]", SLURM_JOB_ID=123456)
    r = resolve_env()
    assert (r.rank, r.world_size, r.local_rank, r.scheduler) == (5, 8, 1, "Slurm")
    assert r.master_addr == "node03"
    assert r.master_port == 10000 + 123456 % 20000 == 13456
    assert r.sources["rank"] == "SLURM_PROCID" and r.sources["master_addr"] == "first host of SLURM_JOB_NODELIST"


def test_slurm_step_nodelist_first_and_given_master_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_JOB_NODELIST="a[1-4]", SLURM_STEP_NODELIST="a[3-4]", SLURM_JOB_ID=7)
    assert (resolve_env().master_addr, resolve_env().master_port) == ("a3", 10007)
    setenv(monkeypatch, SLURM_NODELIST="z1")
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    assert resolve_env().master_addr == "z1"
    setenv(monkeypatch, MASTER_ADDR="head", MASTER_PORT=29500)
    r = resolve_env()
    assert (r.master_addr, r.master_port, r.sources["master_port"]) == ("head", 29500, "MASTER_PORT")


def test_slurm_port_is_deterministic_and_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    for job in (0, 1, 19999, 20000, 987654321):
        port = slurm_master_port({"SLURM_JOB_ID": str(job)})
        assert port is not None and 10000 <= port < 30000 and port == 10000 + job % 20000
    assert slurm_master_port({}) is None


def test_explicit_rank_and_world_size_win(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_JOB_NODELIST="n1", SLURM_JOB_ID=1, RANK=1, WORLD_SIZE=2)
    r = resolve_env()
    assert (r.rank, r.world_size, r.scheduler) == (1, 2, None)
    r = resolve_env(rank=0, world_size=1)
    assert (r.rank, r.world_size, r.sources["rank"], r.sources["world_size"]) == (0, 1, "argument", "argument")
    monkeypatch.delenv("WORLD_SIZE")  # RANK from torchrun's variable, the size from Slurm's
    r = resolve_env()
    assert (r.rank, r.world_size, r.sources["world_size"]) == (1, 4, "SLURM_NTASKS")


def test_open_mpi_needs_master_and_wins_over_an_inherited_slurm_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_SIZE=3, OMPI_COMM_WORLD_LOCAL_RANK=0)
    with pytest.raises(
        ValueError,
        match=r"environment variable MASTER_ADDR expected, but not set; also missing: MASTER_PORT \(rank and world size came from Open MPI",
    ):
        resolve_env()
    setenv(monkeypatch, MASTER_ADDR="10.0.0.1", MASTER_PORT=1234)
    # mpirun inside an sbatch script: the batch step's SLURM_PROCID=0 is inherited by every process
    setenv(monkeypatch, SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0)
    r = resolve_env()
    assert (r.rank, r.world_size, r.local_rank, r.scheduler, r.master_addr, r.master_port) == (2, 3, 0, "Open MPI", "10.0.0.1", 1234)


def test_pmi_and_mvapich(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=1, MASTER_ADDR="h", MASTER_PORT=1)
    r = resolve_env()
    assert (r.rank, r.world_size, r.local_rank, r.sources["rank"]) == (1, 2, 1, "PMI_RANK")
    setenv(monkeypatch, MV2_COMM_WORLD_RANK=0, MV2_COMM_WORLD_SIZE=4, MV2_COMM_WORLD_LOCAL_RANK=0)
    assert detect_scheduler() is not None and detect_scheduler().name == "MVAPICH2"  # type: ignore[union-attr]
    assert (resolve_env().rank, resolve_env().world_size) == (0, 4)


def test_node_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert node_local_rank() is None
    setenv(monkeypatch, SLURM_PROCID=0, SLURM_LOCALID=3)
    assert node_local_rank() == 3
    setenv(monkeypatch, LOCAL_RANK=1)
    assert node_local_rank() == 1


def test_errors_name_the_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="environment variable RANK expected, but not set") as info:
        resolve_env()
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        assert name in str(info.value)
    setenv(monkeypatch, SLURM_PROCID=0)
    with pytest.raises(ValueError, match="WORLD_SIZE expected, but not set, and Slurm was detected .* its SLURM_NTASKS is not set"):
        resolve_env()
    setenv(monkeypatch, SLURM_NTASKS=2)
    with pytest.raises(ValueError, match="MASTER_ADDR expected, but not set; also missing: MASTER_PORT .*SLURM_JOB_NODELIST.*SLURM_JOB_ID"):
        resolve_env()
    setenv(monkeypatch, SLURM_NTASKS="two")
    with pytest.raises(ValueError, match="SLURM_NTASKS must be an integer, got 'two'"):
        resolve_env()


async def test_rendezvous_env_under_slurm_sets_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0, SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=free_port())
    store, rank, world_size = await aiodist.rendezvous("env://", timeout=10)
    try:
        assert (rank, world_size) == (0, 1)
        assert os.environ["LOCAL_RANK"] == "0" and aiodist.get_node_local_rank() == 0
        await store.set("k", "v")
        assert await store.get("k") == b"v"
    finally:
        await store.close()


# -- real jobs ----------------------------------------------------------------------------------


def _scheduler_env(kind: str, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ALL_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_"))}
    if kind.startswith("slurm"):
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242")
    else:
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    if kind == "slurm-derived-port":  # SLURM_JOB_ID chosen so that 10000 + id % 20000 is a free port
        env["SLURM_JOB_ID"] = str(port - 10000 + 20000 * 12345)
    else:
        env["MASTER_PORT"] = str(port)
    return env


def _free_port_in_slurm_range() -> int:
    for candidate in random.sample(range(10000, 30000), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", candidate))
            except OSError:
                continue
            return candidate
    pytest.skip("no free port in 10000-29999")


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["slurm", "slurm-derived-port", "ompi"])
def test_two_ranks_with_only_scheduler_variables(kind: str) -> None:
    port = _free_port_in_slurm_range() if kind == "slurm-derived-port" else free_port()
    results = run_ranks([[sys.executable, str(WORKER)]] * 2, [_scheduler_env(kind, rank, port) for rank in range(2)], 40)
    for rank, res in enumerate(results):
        assert res == {"rank": rank, "world_size": 2, "local_rank": rank, "all_reduce": [0.0, 3.0, 6.0, 9.0], "agent_store": False}
