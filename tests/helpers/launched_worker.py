"""A worker for tests/test_launcher.py, started by aiodist-run / aiodist.launch.

    python tests/helpers/launched_worker.py MODE [--local-rank=N]

Modes:
``ok``      init_process_group() through env://, all_reduce of [rank + 1], print one JSON line
            (the launcher's environment and the sum), destroy the group, exit 0.
``raise1``  as ``ok`` until after the all_reduce; then rank 1 raises ``ValueError("rank one
            exploded")`` (written to TORCHELASTIC_ERROR_FILE through @record), the others wait
            in a barrier (which fails once rank 1 is gone, or the launcher stops them).
``flaky``   fail (exit 3, nothing recorded) on every rank while TORCHELASTIC_RESTART_COUNT is 0,
            else run ``ok``.
``sleep``   print the pid, then sleep (the SIGTERM test kills the launcher).
``legacy``  print LOCAL_RANK and the ``--local-rank`` argument (legacy launch), no process group.
``plain``   print the environment JSON on stdout and a line on stderr, exit 0, no process group.

Also entrypoints for ``launch_agent`` with a callable: ``rank_times``, ``async_all_reduce``,
``fail_on_rank1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402
from aiodist.elastic import record  # noqa: E402

ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
)


def env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ENV_NAMES}


async def collective(mode: str) -> None:
    await dist.init_process_group("gloo", timeout=20)
    try:
        rank = dist.get_rank()
        x = np.array([rank + 1.0])
        await dist.all_reduce(x)
        print(json.dumps({"env": env(), "sum": float(x[0])}), flush=True)
        if mode == "raise1":
            if rank == 1:
                raise ValueError("rank one exploded")
            await dist.barrier()
            await asyncio.sleep(30)  # not reached: the barrier fails or the launcher stops us
    finally:
        await dist.destroy_process_group()


@record
async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None)
    args, rest = p.parse_known_args()
    mode = args.mode
    if mode == "flaky":
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            print("failing the first attempt", file=sys.stderr, flush=True)
            os._exit(3)
        mode = "ok"
    if mode in ("ok", "raise1"):
        await collective(mode)
    elif mode == "sleep":
        print(json.dumps({"pid": os.getpid()}), flush=True)
        await asyncio.sleep(120)
    elif mode == "legacy":
        print(json.dumps({"LOCAL_RANK": os.environ.get("LOCAL_RANK"), "arg": args.local_rank, "rest": rest}), flush=True)
    elif mode == "plain":
        print(json.dumps({"env": env(), "stderr_line": True}), flush=True)
        print(f"err from {os.environ['RANK']}", file=sys.stderr, flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    asyncio.run(main())


# -- entrypoints for launch_agent with a Python callable (pickled by reference) ------------


def rank_times(k: int) -> int:
    """RANK * k."""
    return int(os.environ["RANK"]) * k


async def async_all_reduce(k: float) -> float:
    """all_reduce of k * (rank + 1) over env://: the same sum on every rank."""
    await dist.init_process_group("gloo", timeout=20)
    try:
        x = np.array([k * (dist.get_rank() + 1)])
        await dist.all_reduce(x)
        return float(x[0])
    finally:
        await dist.destroy_process_group()


def fail_on_rank1() -> str:
    if os.environ["RANK"] == "1":
        raise RuntimeError("callable failed on rank 1")
    return "ok"
