"""A fresh job of worker processes for the benchmarks that measure whole processes (``debug``,
``soak``): each worker is ``python -m MODULE --worker ...`` with torchrun's variables set, and
prints one JSON line last; the job's result is every rank's line, in rank order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from aiodist.testing.ports import free_port  # the store's port: outside the ephemeral range

__all__ = ["free_port", "run_workers"]


def run_workers(
    module: str, worker_args: Sequence[str], ranks: int, *, timeout: float, env_extra: Mapping[str, str] = {}, drop: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Start ``ranks`` workers of ``module`` (rank 0 hosts the store on a free port), wait for
    them, and return their last output lines parsed as JSON, in rank order. ``drop``: variables
    of this environment the workers must not inherit. A worker that fails (or a job past
    ``timeout`` seconds, subprocess.TimeoutExpired) is a RuntimeError with its stderr's end;
    every worker is gone when this returns."""
    port = free_port()
    cmd = [sys.executable, "-m", module, "--worker", *worker_args]
    procs = []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(env_extra, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs: list[str] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"a worker failed ({dict(env_extra)}): exit {p.returncode}\n{err[-2000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]
