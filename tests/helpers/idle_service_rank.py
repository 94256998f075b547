"""A rank for tests/faults/test_idle_service.py: a service group that idles until its leader.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/helpers/idle_service_rank.py TIMEOUT

env:// group with a TIMEOUT-second timeout and ``idle_until_leader(0)``; every rank serves: rank
0 broadcasts 3 requests (0.2 s apart), the others take part in each; then every rank prints
``running`` and the others wait for the next request, which never comes: the test SIGKILLs rank
0. Their error is printed as ``ERROR <time.time()> <sorted culprits> <message on one line>``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main(timeout: float) -> None:
    await dist.init_process_group("gloo", timeout=timeout)
    dist.idle_until_leader(0)
    x = np.zeros(8, np.float32)
    for i in range(3):
        if dist.get_rank() == 0:
            await asyncio.sleep(0.2)
            x[:] = i
        await dist.broadcast(x, src=0)
    print("running", flush=True)
    if dist.get_rank() == 0:
        await asyncio.sleep(3600)  # the test kills it
    try:
        await dist.broadcast(x, src=0)
    except dist.DistError as exc:
        print(f"ERROR {time.time()!r} {sorted(exc.culprits)} {' '.join(str(exc).split())}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
