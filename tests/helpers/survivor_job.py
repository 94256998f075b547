"""A job for tests/test_launcher_survivors.py (under ``aiodist-run --keep-survivors``): 3 ranks
all_reduce over a group of all of them; rank VICTIM (argv[1]) then dies (``os._exit(3)``, as a
crash would); the survivors' next all_reduce fails naming it (``culprits``), they shrink the
group by those culprits (``SHRINK_ABORT``), all_reduce over the shrunk group for 2 s and print
``OK rank R excluded [..] sum S``, then exit 0 without tearing down (a broken world's teardown is not what
is shown)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main(victim: int) -> None:
    await dist.init_process_group("gloo", timeout=60)
    rank = dist.get_rank()
    g = await dist.new_group(list(range(dist.get_world_size())))
    x = np.ones(4, np.float32)
    await dist.all_reduce(x, group=g)
    await dist.barrier(group=g)
    if rank == victim:
        os._exit(3)
    try:
        while True:
            await dist.all_reduce(x, group=g)
            await asyncio.sleep(0.01)
    except dist.DistError as exc:
        culprits = sorted(exc.culprits)
    survivors = await dist.shrink_group(culprits, group=g, shrink_flags=dist.SHRINK_ABORT)
    y = np.ones(1, np.float32)
    for _ in range(20):  # the survivors go on for a while (2 s: past the launcher's settle time)
        y[0] = 1.0
        await dist.all_reduce(y, group=survivors)
        await asyncio.sleep(0.1)
    print(f"OK rank {rank} excluded {culprits} sum {y[0]:g}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
