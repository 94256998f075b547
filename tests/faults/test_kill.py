"""SIGKILL of one of 4 ranks in the middle of an all_reduce loop (4 B and 16 MiB): every survivor
raises a DistError that names the dead rank, within 2 s of the kill, for every victim including
rank 0 (which hosts the env:// store), and whose ``culprits`` are exactly the dead rank, also on
a survivor that learned of it from a peer's ABORT: every survivor knows whom to exclude. The group timeout is 20 s, so a pass shows the death was
detected, not timed out. The victim is killed by pid once every rank has printed "running";
each survivor prints the wall-clock time of its error, which the test compares with the kill's."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from _procs import kill_all, read_lines_until, start_ranks  # this folder's helpers (pytest puts it on sys.path)

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]

N = 4
GROUP_TIMEOUT_S = 20.0
DETECT_S = 2.0  # the bound under test
START_S = 30.0  # a bound on start-up (4 interpreters importing numpy on 2 cores)
EXIT_S = GROUP_TIMEOUT_S + 5.0  # survivors that never notice are caught by this

ROOT = Path(__file__).resolve().parents[2]

WORKER = ROOT / "tests" / "helpers" / "loop_rank.py"  # all_reduce in a loop until the group breaks


CASES = [pytest.param(v, 4, id=f"victim{v}-4B") for v in range(N)] + [pytest.param(v, 16 << 20, id=f"victim{v}-16MiB") for v in range(N)]


@pytest.mark.parametrize("victim,nbytes", CASES)
def test_sigkill_of_one_rank_fails_every_survivor_within_2s(victim: int, nbytes: int) -> None:
    outs: dict[int, list[str]] = {r: [] for r in range(N)}
    procs = start_ranks(WORKER, N, args=(GROUP_TIMEOUT_S, nbytes, "exit"))
    try:
        running = read_lines_until(procs, "running", time.monotonic() + START_S, outs)
        assert running == set(range(N)) and all(o and o[-1] == "running" for o in outs.values()), outs
        time.sleep(0.2)  # let the loop run a few ops past the first
        killed_at = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivors = {r: p for r, p in procs.items() if r != victim}
        read_lines_until(survivors, "ERROR", time.monotonic() + EXIT_S, outs)
        for p in procs.values():
            p.wait(timeout=5)
    finally:
        kill_all(procs)
    took: dict[int, float] = {}
    for rank in survivors:
        errors = [line for line in outs[rank] if line.startswith("ERROR ")]
        assert errors, f"rank {rank} raised no DistError after rank {victim} was killed: {outs[rank]}"
        _, t, msg = errors[0].split(" ", 2)
        took[rank] = float(t) - killed_at
        assert re.search(rf"\brank {victim}\b", msg), f"rank {rank}'s error does not name rank {victim}: {msg}"
        named = [line for line in outs[rank] if line.startswith("CULPRITS ")]
        assert named and named[0] == f"CULPRITS [{victim}]", f"rank {rank}'s error names {named} as its culprits, not [{victim}]: {msg}"
    print(f"victim {victim}, {nbytes} B: time to error by survivor: " + ", ".join(f"rank {r} {s:.3f} s" for r, s in took.items()))
    print(f"  e.g. {errors[0]}")
    assert all(s < DETECT_S for s in took.values()), took
