"""A job for tests/test_multihost.py's hierarchy tests (several ranks on each of several hosts):

    aiodist-run --nnodes 2 --nproc-per-node 2 ... tests/helpers/hier_job.py MIB

Every rank checks, against values it computes itself, all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast and reduce over the default group, over a group whose ranks are
not contiguous by host (``new_group(sort_ranks=False)``, rank order 0, 2, 1, 3, ...), and over a
group with an uneven layout (every rank but the last), small and large; the sums are integers in float32, so
every element is exact. Then it all-reduces MIB MiB of float32
twice on the default group, checks them, and prints ``HIER rank R of W <seconds per op>
host_shm=<whether the in-host phases went through the host's shared memory>``; each
host's local rank 0 also prints ``TX ... sent B bytes for 2 all_reduces``: its host's eth0 bytes
sent between barriers around those two ops (the bytes the test compares with S).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import aiodist as dist
from aiodist.shm import HOST_PART


def _tx() -> int | None:
    """This host's bytes sent on eth0 (a netns host's device), or None where there is none."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


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


async def check_gather_scatter(group: object, members: list[int], n: int, what: str) -> None:
    """all_gather_into_tensor and reduce_scatter_tensor over ``group`` (its ranks ``members`` in
    group-rank order), exact."""
    me = dist.get_rank()
    if me not in members:
        return
    k = len(members)
    out = np.empty(n * k, np.float32)
    await dist.all_gather_into_tensor(out, data(me, n), group=group)
    if not np.array_equal(out, np.concatenate([data(r, n) for r in members])):
        raise AssertionError(f"rank {me}: all_gather, {what}, {n} elements per rank: wrong")
    part = np.empty(n, np.float32)
    await dist.reduce_scatter_tensor(part, data(me, n * k), group=group)
    i = members.index(me)
    if not np.array_equal(part, sum(data(r, n * k) for r in members)[i * n : (i + 1) * n]):
        raise AssertionError(f"rank {me}: reduce_scatter, {what}, {n} elements per rank: wrong")


async def check_rooted(group: object, members: list[int], n: int, what: str) -> None:
    """broadcast from the group's last rank and reduce to its second (roots that lead their host
    or not, as the layout has it), exact."""
    me = dist.get_rank()
    if me not in members:
        return
    src, dst = members[-1], members[1]
    x = data(me, n)
    await dist.broadcast(x, src=src, group=group)
    if not np.array_equal(x, data(src, n)):
        raise AssertionError(f"rank {me}: broadcast from {src}, {what}, {n} elements: wrong")
    y = data(me, n)
    await dist.reduce(y, dst=dst, group=group)
    if me == dst and not np.array_equal(y, sum(data(r, n) for r in members)):
        raise AssertionError(f"rank {me}: reduce to {dst}, {what}, {n} elements: wrong")


async def main(mib: float) -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    order = list(range(0, world, 2)) + list(range(1, world, 2))
    mixed = await dist.new_group(order, sort_ranks=False)
    uneven = await dist.new_group(list(range(world - 1)))
    for n in (1, 3, 1000, 100_000):
        await check(None, list(range(world)), n, "default group")
        await check(mixed, order, n, "ranks not contiguous by host")
        await check(uneven, list(range(world - 1)), n, "uneven layout")
        await check_gather_scatter(None, list(range(world)), n, "default group")
        await check_gather_scatter(mixed, order, n, "ranks not contiguous by host")
        await check_gather_scatter(uneven, list(range(world - 1)), n, "uneven layout")
        await check_rooted(None, list(range(world)), n, "default group")
        await check_rooted(mixed, order, n, "ranks not contiguous by host")
        await check_rooted(uneven, list(range(world - 1)), n, "uneven layout")
    n = int(mib * 2**20) // 4
    x = data(rank, n)
    await dist.barrier()
    tx0 = _tx()
    await dist.barrier()  # every rank of this host has read the counter before any big op's byte
    t0 = time.perf_counter()
    for _ in range(2):
        x[:] = data(rank, n)
        await dist.all_reduce(x)
    took = (time.perf_counter() - t0) / 2
    await dist.barrier()  # every big op's byte is sent before the counter is read again
    if os.environ.get("LOCAL_RANK") == "0" and tx0 is not None:
        print(f"TX host of rank {rank} sent {_tx() - tx0} bytes for 2 all_reduces", flush=True)
    if not np.array_equal(x, sum(data(r, n) for r in range(world))):
        raise AssertionError(f"rank {rank}: the big all_reduce is wrong")
    # the in-host phases went through this host's shared memory (the default group's part here)
    shm = dist.group.WORLD.backend.stats()["shm"]  # type: ignore[union-attr]
    host_shm = HOST_PART in shm["groups"] and shm["cma_ops"] > 0
    print(f"HIER rank {rank} of {world} {took:.4f} host_shm={host_shm}", flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
