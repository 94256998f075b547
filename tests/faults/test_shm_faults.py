"""SIGKILL of one of 3 ranks (2 for gather and scatter) while they loop on a 16 MiB op through
shared memory (aiodist.shm: all_reduce, and the single-copy reduce, reduce_scatter,
all_to_all, gather and scatter): the survivors, waiting on the dead rank's doorbell or reading its pages, raise a
DistError naming it within 3 s (group timeout 20 s, so a pass shows the death was noticed, not
timed out). The segments are memfds: nothing of them outlives the processes, whatever kills
them (no name in /dev/shm to check)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from _procs import kill_all, read_lines_until, start_ranks  # this folder's helpers (pytest puts it on sys.path)

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

VICTIM = 1
GROUP_TIMEOUT_S = 20.0
DETECT_S = 3.0  # the bound under test (measured: tens of ms)
START_S = 40.0  # 3 interpreters importing numpy on a loaded 2-core machine
EXIT_S = GROUP_TIMEOUT_S + 10.0

ROOT = Path(__file__).resolve().parents[2]

WORKER = ROOT / "tests" / "helpers" / "shm_loop_rank.py"  # the op in a loop until the group breaks


# every op with a shared-memory path for 16 MiB (the single-copy ones read the victim's pages;
# gather and scatter take it in groups of 2 only)
OPS = [("all_reduce", 3), ("reduce", 3), ("reduce_scatter_tensor", 3), ("all_to_all_single", 3), ("gather", 2), ("scatter", 2)]


@pytest.mark.parametrize("op,N", OPS, ids=[o for o, _ in OPS])
def test_sigkill_during_a_shared_memory_op_fails_the_survivors_fast(tmp_path: Path, op: str, N: int) -> None:
    errs = [open(tmp_path / f"err{r}", "w") for r in range(N)]  # noqa: SIM115 - closed below
    outs: dict[int, list[str]] = {r: [] for r in range(N)}
    try:
        # stderr to a file: an unread pipe could fill and stall a rank
        procs = start_ranks(WORKER, N, env=lambda r: {"AIODIST_SHM_BYTES": "8M"}, stderr=lambda r: errs[r], args=(GROUP_TIMEOUT_S, op))
        try:
            read_lines_until(procs, "running", time.monotonic() + START_S, outs)
            running = {r: o[-1] if o else "" for r, o in outs.items()}
            assert all(line == "running [0]" for line in running.values()), (
                running,
                [(tmp_path / f"err{r}").read_text()[-2000:] for r in procs],
            )
            time.sleep(0.3)  # a few ops past the first
            killed_at = time.time()
            os.kill(procs[VICTIM].pid, signal.SIGKILL)
            survivors = {r: p for r, p in procs.items() if r != VICTIM}
            read_lines_until(survivors, "ERROR", time.monotonic() + EXIT_S, outs)
            for p in procs.values():
                p.wait(timeout=10)
        finally:
            kill_all(procs)
    finally:
        for f in errs:
            f.close()
    errors = {r: next((line for line in outs[r] if line.startswith("ERROR ")), "") for r in survivors}
    took = {}
    for r, line in errors.items():
        assert line, f"rank {r} raised no DistError after rank {VICTIM} was killed: {(tmp_path / f'err{r}').read_text()[-2000:]}"
        _, t, msg = line.split(" ", 2)
        took[r] = float(t) - killed_at
        assert re.search(rf"\brank {VICTIM}\b", msg), f"rank {r}'s error does not name rank {VICTIM}: {msg}"
    print("time to error by survivor: " + ", ".join(f"rank {r} {s:.3f} s" for r, s in took.items()))
    assert all(s < DETECT_S for s in took.values()), took
