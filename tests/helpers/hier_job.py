"""A job for tests/test_multihost.py's hierarchy tests (several ranks on each of several hosts):

    aiodist-run --nnodes 2 --nproc-per-node 2 ... tests/helpers/hier_job.py MIB

Every rank checks, against values it computes itself, all_reduce over the default group, over a
group whose ranks are not contiguous by host (``new_group(sort_ranks=False)``, rank order 0, 2, 1,
3, ...), and over a group with an uneven layout (every rank but the last), small and large; the
sums are integers in float32, so every element is exact. Then it all-reduces MIB MiB of float32
twice on the default group (the bytes the test counts on the hosts' links), checks them, and
prints ``HIER rank R of W <seconds per op>``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

import aiodist as dist


def data(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n) + 7 * rank) % 13).astype(np.float32)


async def check(group: object, members: list[int], n: int, what: str) -> None:
    if dist.get_rank() not in members:
        return
    x = data(dist.get_rank(), n)
    await dist.all_reduce(x, group=group)
    want = sum(data(r, n) for r in members)
    if not np.array_equal(x, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what}, {n} elements: wrong at {np.flatnonzero(x != want)[:5]}")


async def main(mib: float) -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    order = list(range(0, world, 2)) + list(range(1, world, 2))
    mixed = await dist.new_group(order, sort_ranks=False)
    uneven = await dist.new_group(list(range(world - 1)))
    for n in (1, 3, 1000, 300_000):
        await check(None, list(range(world)), n, "default group")
        await check(mixed, order, n, "ranks not contiguous by host")
        await check(uneven, list(range(world - 1)), n, "uneven layout")
    n = int(mib * 2**20) // 4
    x = data(rank, n)
    await dist.barrier()
    t0 = time.perf_counter()
    for _ in range(2):
        x[:] = data(rank, n)
        await dist.all_reduce(x)
    took = (time.perf_counter() - t0) / 2
    if not np.array_equal(x, sum(data(r, n) for r in range(world))):
        raise AssertionError(f"rank {rank}: the big all_reduce is wrong")
    print(f"HIER rank {rank} of {world} {took:.4f}", flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
