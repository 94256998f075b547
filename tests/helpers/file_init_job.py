"""A two-rank job for tests/test_c10d.py: the gloo backend between two processes that meet
through ``file://`` rendezvous.

    python tests/helpers/file_init_job.py RANK PATH

PATH is the rendezvous file (``file://PATH``, world size 2, timeout 20 s). Each rank
all_reduces ``arange(5) + rank`` (float64), rank 0 sends ``[42]`` to rank 1 with tag 3 (rank 1
asserts it got it from rank 0), then a barrier and ``destroy_process_group``; last, the rank
prints ``rank RANK <the all_reduce's result as a list>``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main(rank: int, path: str) -> None:
    await dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2, timeout=20)
    x = np.arange(5, dtype=np.float64) + rank
    await dist.all_reduce(x)
    if rank == 0:
        await dist.send(np.array([42]), dst=1, tag=3)
    else:
        y = np.empty(1, dtype=np.int64)
        assert await dist.recv(y, src=0, tag=3) == 0 and y[0] == 42
    await dist.barrier()
    await dist.destroy_process_group()
    print("rank", rank, x.tolist())


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
