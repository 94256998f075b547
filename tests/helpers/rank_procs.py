"""Run one real process per rank and collect each one's JSON result (its last stdout line)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from typing import Any


def run_ranks(argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], seconds: float) -> list[dict[str, Any]]:
    """Start ``argvs[r]`` with ``envs[r]`` for every rank r, wait for all of them within ``seconds``
    in all (killing every one still running on any failure: only our own pids), require exit code
    0 of each, and return each rank's last stdout line parsed as JSON, in rank order."""
    procs: list[subprocess.Popen[str]] = []
    outs = []
    try:
        for argv, env in zip(argvs, envs, strict=True):
            procs.append(subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + seconds
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank} exited {code}\nstdout: {out}\nstderr: {err}"
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outs]
