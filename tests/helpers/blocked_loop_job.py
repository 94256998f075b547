"""A two-rank job for tests/test_blocked_peer.py: rank 1 blocks its event loop while rank 0 waits
in an all_reduce that times out.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... AIODIST_LOOP_BLOCKED_WARN=0.3 \\
        python tests/helpers/blocked_loop_job.py

env:// group with a 1.5 s timeout and a barrier; then rank 1 calls ``busy()`` (``time.sleep(3.5)``
inside the coroutine: its loop cannot run) and exits, and rank 0 prints ``ERROR: <message>`` of
the DistError its all_reduce raises. The test checks that the message names rank 1's blocked
loop and this file's ``busy`` line.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


def busy() -> None:
    time.sleep(3.5)  # blocking code in a coroutine: the loop cannot run


async def main() -> None:
    await dist.init_process_group("gloo", timeout=1.5)
    rank = dist.get_rank()
    await dist.barrier()
    if rank == 1:
        busy()
        return
    try:
        await dist.all_reduce(np.ones(2))
    except dist.DistError as e:
        print("ERROR:", e, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
