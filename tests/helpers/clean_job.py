"""A job that does a little and ends cleanly, for tests/test_quiet_shutdown.py: init, an
all_reduce on every rank, a broadcast from the last rank (so that ranks dial each other late),
a barrier, destroy. Prints ``clean`` on success."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main() -> None:
    await dist.init_process_group("gloo", timeout=30)
    x = np.ones(1024, np.float32)
    await dist.all_reduce(x)
    await dist.broadcast(x, src=dist.get_world_size() - 1)
    await dist.barrier()
    await dist.destroy_process_group()
    print("clean", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
