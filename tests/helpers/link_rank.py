"""A rank for tests/test_link_cut.py: env:// (static), small all_reduces in a loop with a short
pause between them (the connections are idle part of the time), or one big all_reduce::

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/helpers/link_rank.py MODE

MODE ``loop``: ``running`` once every rank is through one op, then all_reduces until one fails,
then ``CULPRITS <sorted ranks>`` and ``ERROR <time.time()!r> <class>: <message on one line>``.
MODE ``big NBYTES``: ``running``, one all_reduce of NBYTES, then ``DONE <seconds> <sum ok>``
(or the ERROR lines), and a barrier before it exits. The group timeout is 120 s: an error before it is the link's detection.
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


async def main(mode: str, nbytes: int) -> None:
    await dist.init_process_group("gloo", timeout=120)
    x = np.ones(1, np.float32)
    await dist.all_reduce(x)
    print("running", flush=True)
    try:
        if mode == "loop":
            while True:
                await dist.all_reduce(x)
                await asyncio.sleep(0.05)
        big = np.ones(nbytes // 4, np.float32)
        t = time.monotonic()
        await dist.all_reduce(big)
        print(f"DONE {time.monotonic() - t:.2f} {bool((big == 2).all())}", flush=True)
        await dist.barrier()  # neither exits while the other still reads: an exit would cut its last bytes
        await asyncio.sleep(0.5)
    except dist.DistError as exc:
        t = time.time()
        print(f"CULPRITS {sorted(exc.culprits)}", flush=True)
        print(f"ERROR {t!r} {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
    os._exit(0)  # a broken world's teardown is not what is measured


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
