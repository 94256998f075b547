"""A job for tests/test_launcher_rootcause.py, started by aiodist-run (four ranks): rank 1 raises
``ValueError("rank one exploded")`` after a barrier while the others are in an all_reduce.

    python -m aiodist.run --standalone --nproc-per-node 4 tests/helpers/rank1_raises_job.py

Every rank tears its group down in ``finally`` (as torch scripts do), so rank 1's connections
close before its traceback is printed and its peers' "closed the connection" errors race it to
the exit: the launcher must still name rank 1 as the root cause. No ``@record``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


async def main() -> None:
    await dist.init_process_group("gloo")
    try:
        await dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("rank one exploded")
        await dist.all_reduce(np.ones(4))
    finally:
        await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
