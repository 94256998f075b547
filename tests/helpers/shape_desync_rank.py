"""A rank for tests/test_torch_differences.py: two processes all_reduce tensors of different
shapes (rank 1 float32[5], the others float32[4]) and report the error.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/helpers/shape_desync_rank.py WHEN

env:// group, timeout 20 s. WHEN is ``first_op`` (the mismatched all_reduce is the group's
first op) or ``later_op`` (one all_reduce of float64[3] first, so the mismatch meets the
latency lane). Prints ``{"msg": the DistError's text, or "no error"}`` and exits without
teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main(warm: bool) -> None:
    await dist.init_process_group("gloo", timeout=20)
    rank = dist.get_rank()
    if warm:
        await dist.all_reduce(np.ones(3))
    try:
        await dist.all_reduce(np.ones(5 if rank == 1 else 4, np.float32))
        msg = "no error"
    except dist.DistError as exc:
        msg = str(exc)
    print(json.dumps({"msg": msg}))
    os._exit(0)


if __name__ == "__main__":
    when = sys.argv[1]
    if when not in ("first_op", "later_op"):
        raise SystemExit(f"WHEN is first_op or later_op, not {when!r}")
    asyncio.run(main(when == "later_op"))
