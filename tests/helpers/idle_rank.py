"""A rank for tests/faults/test_idle.py: a slow all_reduce loop (one every 20 ms) that keeps the
job alive while the test holds idle connections to its listeners and the store.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... AIODIST_HANDSHAKE_TIMEOUT=2 \\
        python tests/helpers/idle_rank.py LOOP

LOOP is ``asyncio`` or ``uvloop`` (the event loop the rank runs on). The rank raises its own
open-file limit to 4096 (or the hard limit, if lower), logs to stderr as ``LOG <level>
<logger>: <message>`` at WARNING and above, and joins an env:// group (timeout 30 s). Each
iteration all_reduces (MAX) the iteration and rank 0's stop flag; a wrong iteration prints
``WRONG ...`` and exits with 3. Prints ``running`` after the first iteration; rank 0 stops the
loop once a line (or EOF) arrives on its stdin. At the end ``done <iterations>``, then the
group is destroyed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

# before aiodist's import: with AIODIST_LOG_LEVEL set it adds a handler of its own where the root logger has none
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(name)s: %(message)s")

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

stop = threading.Event()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY and hard < 4096 else 4096, hard))


def read_stdin() -> None:
    sys.stdin.readline()
    stop.set()


async def main() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank = dist.get_rank()
    if rank == 0:
        threading.Thread(target=read_stdin, daemon=True).start()
    ctl = np.zeros(2, dtype=np.int64)
    it = 0
    while True:
        it += 1
        if rank == 0:
            ctl[:] = (it, stop.is_set())
        await dist.all_reduce(ctl, op=dist.ReduceOp.MAX)
        if ctl[0] != it:
            print(f"WRONG {ctl!r} at iteration {it}", flush=True)
            os._exit(3)
        if it == 1:
            print("running", flush=True)
        if ctl[1]:
            break
        await asyncio.sleep(0.02)
    print(f"done {it}", flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    raise_fd_limit()
    if sys.argv[1] == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
