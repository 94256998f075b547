"""``aiodist-run --keep-survivors``: a worker's death stops no other worker. Three workers under
one launcher, the victim dies after a first all_reduce; the survivors learn whom to exclude from
their error's ``culprits`` (every survivor names the same rank), shrink their group, all_reduce
over it and exit 0; the launcher waits for them, exits 1 and its report names the dead rank and
says the others went on. The same with the default group shrunk and DDP rebuilt
(examples/train_survive_rank_loss.py), rank 0 the victim. Without the option the launcher stops
the survivors (the control)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.survive import check_survived

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "helpers" / "survivor_job.py"
EXAMPLE = ROOT / "examples" / "train_survive_rank_loss.py"


def _run(victim: int, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "3", *flags, str(JOB), str(victim)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)


def test_the_survivors_go_on_and_the_report_names_the_dead() -> None:
    """A group of all ranks, shrunk by the survivors when rank 1 dies (tests/helpers/survivor_job.py)."""
    victim = 1
    r = _run(victim, "--keep-survivors")
    out = r.stdout + r.stderr
    survivors = [q for q in range(3) if q != victim]
    for q in survivors:
        assert f"OK rank {q} excluded [{victim}] sum 2" in out, out
    assert r.returncode == 1, out
    assert "the other workers went on (--keep-survivors)" in r.stderr, r.stderr
    assert re.search(rf"rank\s*:\s*{victim} \(local_rank", r.stderr.split("Root Cause")[-1]), r.stderr


def test_rank_0_dies_and_the_survivors_shrink_the_default_group_and_train_on() -> None:
    """examples/train_survive_rank_loss.py under the option, 4 workers, rank 0 SIGKILLs itself at
    step 15: the other three shrink the default group (the agent serves the store, so rank 0's
    death leaves it), rebuild DDP, finish the 40 steps with identical parameters and exit 0,
    within 10 s of the kill; the launcher exits 1 naming rank 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "aiodist.run", "--standalone", "--keep-survivors", "--nproc-per-node", "4"]
    r = subprocess.run([*argv, str(EXAMPLE), "--kill-rank", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    out = r.stdout + r.stderr
    check_survived(out, victim=0, size=4)
    assert r.returncode == 1, out
    assert (
        "worker(s) rank 0 failed; the other workers went on (--keep-survivors) and ended: rank 1 exit 0, rank 2 exit 0, rank 3 exit 0"
        in r.stderr
    )
    assert re.search(r"rank\s*:\s*0 \(local_rank", r.stderr.split("Root Cause")[-1]), r.stderr


def test_without_the_option_the_launcher_stops_the_survivors() -> None:
    r = _run(1)
    assert r.returncode == 1
    assert "OK rank" not in r.stdout + r.stderr, r.stdout + r.stderr
