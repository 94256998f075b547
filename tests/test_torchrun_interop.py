"""An aiodist job under stock torchrun: ``python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/helpers/env_rank_worker.py``. torchrun's agent hosts a torch TCPStore
and tells the workers so (TORCHELASTIC_USE_AGENT_STORE=True); each worker's
``init_process_group("gloo")`` (env://) connects to it with aiodist's client and the two ranks
all-reduce. Skipped when torch is not installed. The launcher runs in a session of its own,
which is stopped (our own process group only) if it outlives the bound."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.run")

pytestmark = [pytest.mark.torch, pytest.mark.subprocess, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "helpers" / "env_rank_worker.py"
BOUND_S = 90
STRIP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _stop(p: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)  # the launcher's own session: torchrun and its workers
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def test_aiodist_workers_under_stock_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in STRIP and not k.startswith(("TORCHELASTIC_", "PET_", "SLURM_", "OMPI_", "PMI_"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        _stop(p)
        out, err = p.communicate(timeout=10)
        pytest.fail(f"torchrun did not finish within {BOUND_S} s\nstdout: {out}\nstderr: {err}")
    finally:
        _stop(p)
    assert p.returncode == 0, f"torchrun exited {p.returncode}\nstdout: {out}\nstderr: {err}"
    results = {}
    for text in re.findall(r"\{[^{}]*\}", out):  # the workers share torchrun's stdout: find each JSON object
        res = json.loads(text)
        results[res["rank"]] = res
    assert sorted(results) == [0, 1], f"stdout: {out}\nstderr: {err}"
    for rank, res in results.items():
        assert res == {"rank": rank, "world_size": 2, "local_rank": rank, "all_reduce": [0.0, 3.0, 6.0, 9.0], "agent_store": True}
