"""A rank for tests/faults/test_shm_faults.py: one 16 MiB op through shared memory in a loop
until the group breaks (a peer SIGKILLed by the test), then say when and why.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... AIODIST_SHM_BYTES=8M \\
        python tests/helpers/shm_loop_rank.py TIMEOUT OP

env:// group with a TIMEOUT-second timeout. OP is one of all_reduce, reduce (to rank 0),
reduce_scatter_tensor, all_to_all_single, gather and scatter (rank 0 the root) over float32
ones of 16 MiB (rounded down to n equal parts). After the first op it prints ``running <the
backend's shm groups>``, then loops; the loop's DistError is printed as one line::

    ERROR <time.time() of the error, repr> <class name>: <message on one line>

and the rank exits with ``os._exit(0)``.
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

OPS = ("all_reduce", "reduce", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter")


async def main(timeout: float, name: str) -> None:
    if name not in OPS:
        raise SystemExit(f"OP is one of {OPS}, not {name!r}")
    await dist.init_process_group("gloo", timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    x = np.ones((16 << 20) // 4 // n * n, dtype=np.float32)  # (n equal parts)
    out = np.empty_like(x)
    parts = [np.empty(x.size // n, np.float32) for _ in range(n)]

    async def op() -> None:
        if name == "all_reduce":
            await dist.all_reduce(x)
        elif name == "reduce":
            await dist.reduce(x, dst=0)
        elif name == "reduce_scatter_tensor":
            await dist.reduce_scatter_tensor(out[: x.size // n], x)
        elif name == "all_to_all_single":
            await dist.all_to_all_single(out, x)
        elif name == "gather":
            await dist.gather(x[: x.size // n], parts if rank == 0 else None)
        else:
            await dist.scatter(x[: x.size // n], parts if rank == 0 else None)

    await op()
    used = dist.group.WORLD.backend.stats()["shm"]["groups"]
    print(f"running {used}", flush=True)
    try:
        while True:
            await op()
    except dist.DistError as exc:
        t = time.time()
        print(f"ERROR {t!r} {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), sys.argv[2]))
