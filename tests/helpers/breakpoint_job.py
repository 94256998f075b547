"""A two-rank job for tests/test_debug_breakpoint.py: ``aiodist.breakpoint`` on rank 0 while the
other rank waits with its event loop running.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/helpers/breakpoint_job.py

env:// group (timeout 30 s). Each rank runs a ticker task (one tick per 10 ms), sets
``secret = 41 + rank`` and calls ``breakpoint(rank=0, skip=1, timeout_s=20)`` twice: the first
call returns at once on every rank (skipped), the second stops rank 0 in pdb (its stdin from
``AIODIST_BREAKPOINT_STDIN`` when the test sets it) while the others wait. Then an all_reduce of
[rank + 1] (the group still works) and one line::

    RESULT {"rank": r, "waits": [{"i": 0|1, "s": seconds waited, "ticks": ticks meanwhile}, ...],
            "sum": 3.0, "secret": 41 + r}
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402
from aiodist.debug.breakpoint import breakpoint  # noqa: E402


async def main() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank = dist.get_rank()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    secret = 41 + rank  # printed from pdb (rank 0) and in RESULT
    waits = []
    for i in range(2):  # skip=1: the first call returns at once on every rank
        t0, k0 = time.monotonic(), ticks
        await breakpoint(rank=0, skip=1, timeout_s=20)
        waits.append({"i": i, "s": time.monotonic() - t0, "ticks": ticks - k0})
    t = np.full(1, rank + 1.0, np.float32)
    await dist.all_reduce(t)  # the group is still usable
    task.cancel()
    print("RESULT " + json.dumps({"rank": rank, "waits": waits, "sum": float(t[0]), "secret": secret}), flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
