"""A plain env:// job that checks the data a multi-host group moves (tests/test_multihost.py runs
it under one launcher per host; aiodist-run, torchrun, Slurm or run_env_job start it too):

    aiodist-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 tests/helpers/multihost_job.py

Every rank checks, against values it computes itself: all_reduce (SUM and MAX), all_gather,
broadcast from every root, send/recv around the ring (both directions), all_gather_object, and
optionally a big all_reduce (``--big-mib N`` or ``MULTIHOST_BIG_MIB=N``: N MiB of float32 whose
every element is checked, so a misplaced stripe or chunk shows up). Then it prints
``OK rank R of W`` (and ``BIG ...`` with the big all_reduce's time). The group timeout is
``--timeout`` or ``MULTIHOST_TIMEOUT`` seconds (default 20), so a broken peer fails fast. Any
failure raises: the traceback goes to stderr (and, through ``record``, to the launcher's error
file) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time

import numpy as np

import aiodist as dist
from aiodist.elastic import record


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


async def checks(big_mib: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()

    # all_reduce: every element differs, so a reordered or truncated message shows up
    x = np.arange(1000, dtype=np.int64) * (rank + 1)
    await dist.all_reduce(x)
    check(np.array_equal(x, np.arange(1000, dtype=np.int64) * (world * (world + 1) // 2)), f"all_reduce SUM gave {x[:5]}...")
    m = np.array([rank, -rank], dtype=np.float64)
    await dist.all_reduce(m, op=dist.ReduceOp.MAX)
    check(m.tolist() == [world - 1, 0], f"all_reduce MAX gave {m}")

    # all_gather: rank r contributes r + 1 elements of value 10 r
    mine = np.full(rank + 1, 10.0 * rank)
    outs = [np.empty(r + 1) for r in range(world)]
    await dist.all_gather(outs, mine)
    for r, o in enumerate(outs):
        check(np.array_equal(o, np.full(r + 1, 10.0 * r)), f"all_gather slot {r} gave {o}")

    # broadcast from every root
    for root in range(world):
        b = np.arange(257, dtype=np.float32) + root if rank == root else np.zeros(257, dtype=np.float32)
        await dist.broadcast(b, src=root)
        check(np.array_equal(b, np.arange(257, dtype=np.float32) + root), f"broadcast from {root} gave {b[:4]}...")

    # send/recv around the ring, both directions (isend + irecv in flight together)
    right, left = (rank + 1) % world, (rank - 1) % world
    for dst, src in ((right, left), (left, right)):
        got = np.empty(4096, dtype=np.int32)
        works = [await dist.isend(np.full(4096, rank, dtype=np.int32), dst=dst), await dist.irecv(got, src=src)]
        for w in works:
            await w.wait()
        check(bool((got == src).all()), f"recv from {src} gave {got[:4]}...")

    # an object collective: who is where
    objs: list[object] = [None] * world
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}
    await dist.all_gather_object(objs, me)
    for r, obj in enumerate(objs):
        check(isinstance(obj, dict) and obj["rank"] == r, f"all_gather_object slot {r} gave {obj!r}")

    if big_mib > 0:
        n = int(big_mib * 2**20) // 4
        pattern = (np.arange(n, dtype=np.int64) % 4096).astype(np.float32)  # exact sums in float32
        big = pattern + rank
        t0 = time.perf_counter()
        await dist.all_reduce(big)
        dt = time.perf_counter() - t0
        want = pattern * world + world * (world - 1) / 2
        bad = np.flatnonzero(big != want)
        check(bad.size == 0, f"big all_reduce: {bad.size} of {n} elements wrong, first at {bad[:1]}")
        print(f"BIG rank {rank}: all_reduce of {big_mib:g} MiB in {dt:.3f} s ({big_mib / dt:.1f} MiB/s)", flush=True)

    await dist.barrier()


@record
async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--big-mib", type=float, default=float(os.environ.get("MULTIHOST_BIG_MIB", "0")))
    p.add_argument("--timeout", type=float, default=float(os.environ.get("MULTIHOST_TIMEOUT", "20")))
    args = p.parse_args()
    await dist.init_process_group("gloo", timeout=args.timeout)
    try:
        await checks(args.big_mib)
        print(f"OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    finally:
        await dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
