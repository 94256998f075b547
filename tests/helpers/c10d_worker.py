"""One rank of a real multi-process aiodist job, for tests/test_c10d_subprocess.py.

    python tests/helpers/c10d_worker.py MODE INIT [RANK WORLD_SIZE]

INIT is a ``tcp://host:port`` URL (RANK and WORLD_SIZE given on the command line) or ``env``
(``env://``: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment). The process
prints one JSON line (its results) on stdout and exits 0, or exits non-zero with a traceback on
stderr. Modes:

``ops``
    all_reduce (a small float64 and a 100 000-element int64), broadcast from every root,
    all_to_all_single with uneven splits (rank i sends rank j ``(i + j) % 3 + 1`` rows of 2),
    then a barrier. Reports the outputs; the test computes what they must be.
``skip``
    A sub-group "skipper" with a 2 s timeout; one barrier on it (seq 0), then every rank but the
    last calls all_reduce on it (seq 1) while the last rank never does: it goes straight to a
    barrier on the default group. The others report the error they got and how long it took,
    then join that barrier, so every process exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

GROUP_TIMEOUT_S = 2.0


async def init(how: str, argv: list[str]) -> None:
    if how == "env":
        await dist.init_process_group("gloo", timeout=30)  # env:// is the default
    else:
        await dist.init_process_group("gloo", init_method=how, rank=int(argv[0]), world_size=int(argv[1]), timeout=30)


async def ops() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    small = np.arange(10, dtype=np.float64) * (rank + 1)
    await dist.all_reduce(small)
    big = np.arange(100_000, dtype=np.int64) + rank
    await dist.all_reduce(big, op=dist.ReduceOp.MAX)
    bcast = []
    for root in range(n):
        b = np.full(4, 10.0 * rank + 1)
        await dist.broadcast(b, src=root)
        bcast.append(b.tolist())
    in_splits = [(rank + j) % 3 + 1 for j in range(n)]
    out_splits = [(i + rank) % 3 + 1 for i in range(n)]
    inp = np.concatenate([np.full((s, 2), 100 * rank + j, dtype=np.int32) for j, s in enumerate(in_splits)])
    out = np.full((sum(out_splits), 2), -1, dtype=np.int32)
    await dist.all_to_all_single(out, inp, out_splits, in_splits)
    await dist.barrier()
    return {
        "rank": rank,
        "world_size": n,
        "all_reduce": small.tolist(),
        "all_reduce_max_ok": bool((big == np.arange(100_000) + n - 1).all()),
        "broadcast": bcast,
        "all_to_all_single": out.tolist(),
    }


async def skip() -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    await dist.barrier()  # every pair connected before the timing starts
    g = await dist.new_group(timeout=GROUP_TIMEOUT_S, group_desc="skipper")
    assert isinstance(g, dist.ProcessGroup)
    await dist.barrier(group=g)  # seq 0 of the group, on every rank
    result: dict[str, Any] = {"rank": rank}
    if rank != n - 1:
        start = time.monotonic()
        try:
            await dist.all_reduce(np.ones(4), group=g)  # seq 1: the last rank never joins
            result["error"] = None
        except dist.DistError as exc:
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
        result["elapsed"] = time.monotonic() - start
        try:
            await dist.barrier(group=g)
            result["later_op"] = "ran"
        except dist.DistError as exc:
            result["later_op"] = str(exc)
    await dist.barrier()  # the default group is another group: still usable
    result["default_group_ok"] = True
    return result


async def main() -> None:
    mode, how, *rest = sys.argv[1:]
    await init(how, rest)
    try:
        result = await (ops() if mode == "ops" else skip())
    finally:
        await dist.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
