"""One rank of a job that initialises through ``env://`` alone, for tests/test_schedulers.py
(ranks given only Slurm's variables) and tests/test_torchrun_interop.py (ranks started by stock
torchrun, whose agent hosts a torch TCPStore).

    python tests/helpers/env_rank_worker.py

Calls ``await aiodist.init_process_group("gloo")`` (no init_method: env://), all-reduces
``arange(4) * (rank + 1)``, then prints one JSON line: rank, world size, node-local rank,
the sum, and whether torchrun's agent store was used.
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


async def main() -> None:
    await dist.init_process_group("gloo", timeout=30)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        x = np.arange(4, dtype=np.float64) * (rank + 1)
        await dist.all_reduce(x)
        result = {
            "rank": rank,
            "world_size": n,
            "local_rank": dist.get_node_local_rank(fallback_rank=-1),
            "all_reduce": x.tolist(),
            "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        }
        await dist.barrier()
    finally:
        await dist.destroy_process_group()
    sys.stdout.write(json.dumps(result) + "\n")  # one write: lines of ranks sharing a pipe stay whole
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
