"""A rank of a job that fails on purpose, for tests/test_error_volume.py: argv[1] names how.

- ``desync``: the last rank calls broadcast where the others call all_reduce.
- ``dead``: after one all_reduce, rank 1 exits (code 7) and the others call another.
- ``timeout``: after one all_reduce, rank 1 sleeps past the group's timeout instead of the next.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import aiodist as dist

GROUP_TIMEOUT_S = 2.0


async def main(how: str) -> None:
    await dist.init_process_group(timeout=GROUP_TIMEOUT_S)
    rank, n = dist.get_rank(), dist.get_world_size()
    x = np.ones(4, np.float32)
    if how == "desync":
        if rank == n - 1:
            await dist.broadcast(x, src=0)
        else:
            await dist.all_reduce(x)
    else:
        await dist.all_reduce(x)
        if rank == 1 and how == "dead":
            os._exit(7)
        if rank == 1 and how == "timeout":
            await asyncio.sleep(3 * GROUP_TIMEOUT_S)
        else:
            await dist.all_reduce(x)
    await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
