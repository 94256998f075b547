"""A rank for tests/faults/test_hostile.py: collectives and point-to-point in a loop, every result
checked, while the test sends hostile bytes to the rank's listeners and the store.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... AIODIST_HANDSHAKE_TIMEOUT=1 \\
        python tests/helpers/hostile_rank.py LOOP

LOOP is ``asyncio`` or ``uvloop`` (the event loop the rank runs on). Logging goes to stderr as
``LOG <level> <logger>: <message>`` at WARNING and above. env:// group, timeout 30 s. Each
iteration: all_reduce of 56 B and of 512 KiB, broadcast from a rotating root, all_gather, an
isend/irecv ring, then a control broadcast from rank 0 (the iteration and whether to stop). A
wrong result prints ``WRONG <what>: <got> != <want>`` and exits with 3. Prints ``running`` after
the first iteration; rank 0 prints ``it <n>`` every 0.25 s and stops the loop once a line (or
EOF) arrives on its stdin. At the end ``done <iterations>``, then the group is destroyed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

# before aiodist's import: with AIODIST_LOG_LEVEL set it adds a handler of its own where the root logger has none
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(name)s: %(message)s")

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

stop = threading.Event()


def read_stdin() -> None:
    sys.stdin.readline()  # the test writes a line (or closes stdin) to end the loop
    stop.set()


def check(what: str, got: Any, want: Any) -> None:
    if not np.array_equal(got, want):
        print(f"WRONG {what}: {got!r} != {want!r}", flush=True)
        os._exit(3)


async def main() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        threading.Thread(target=read_stdin, daemon=True).start()
    ctl = np.zeros(2, dtype=np.int64)
    it = 0
    said = time.monotonic()
    while True:
        small = np.full(7, rank + it, dtype=np.float64)
        await dist.all_reduce(small)
        check("all_reduce 56 B", small, np.full(7, n * it + n * (n - 1) // 2, dtype=np.float64))
        big = np.arange(1 << 16, dtype=np.int64) * (rank + 1) + it
        await dist.all_reduce(big)
        check("all_reduce 512 KiB", big, np.arange(1 << 16, dtype=np.int64) * (n * (n + 1) // 2) + n * it)
        root = it % n
        b = np.arange(1000, dtype=np.int32) + it if rank == root else np.zeros(1000, dtype=np.int32)
        await dist.broadcast(b, src=root)
        check(f"broadcast from {root}", b, np.arange(1000, dtype=np.int32) + it)
        outs = [np.zeros(5, dtype=np.int32) for _ in range(n)]
        await dist.all_gather(outs, np.full(5, rank * 1000 + it, dtype=np.int32))
        check("all_gather", np.stack(outs), np.stack([np.full(5, r * 1000 + it, dtype=np.int32) for r in range(n)]))
        got = np.zeros(3, dtype=np.int64)
        works = [await dist.isend(np.full(3, rank * 7 + it, dtype=np.int64), (rank + 1) % n), await dist.irecv(got, (rank - 1) % n)]
        for w in works:
            await w.wait()
        check("isend/irecv", got, np.full(3, (rank - 1) % n * 7 + it, dtype=np.int64))
        it += 1
        if rank == 0:
            ctl[:] = (it, stop.is_set())
        await dist.broadcast(ctl, src=0)
        check("control broadcast", ctl[0], it)
        if it == 1:
            print("running", flush=True)
        if rank == 0 and time.monotonic() - said >= 0.25:
            said = time.monotonic()
            print(f"it {it}", flush=True)
        if ctl[1]:
            break
    print(f"done {it}", flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
