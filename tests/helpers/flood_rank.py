"""A rank for tests/faults/test_flood.py: rank 0 isends K messages of SIZE bytes at once to rank
1, which posts no receive for HOLD seconds; rank 0 reports its memory, rank 1 checks every byte.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... \\
        python tests/helpers/flood_rank.py K SIZE HOLD LOOP

LOOP is ``asyncio`` or ``uvloop`` (the event loop the rank runs on). A TCPStore on
MASTER_ADDR:MASTER_PORT (rank 0 hosts it) and a group on it, timeouts 60 s. Message i holds
``arange(SIZE // 8) + i * 2**32`` as uint64, so a message delivered twice, out of order or torn
is caught.

Rank 0 resets its RSS high-water mark (``/proc/self/clear_refs``), allocates the K buffers,
isends them all, sets ``issued`` in the store, waits for every send and prints::

    RESULT {"before": RSS, "issued": RSS after issuing, "peak": VmHWM, "after": RSS at the end,
            "sent_s": sends done after issue, "issue_s": allocate and issue, "up_s": start-up}

Rank 1 waits for ``issued``, sleeps HOLD seconds, receives the K messages in order and prints
``CHECKED [indices of wrong messages]``.
"""

from __future__ import annotations

import time

T_UP = time.monotonic()  # before the imports: start-up is part of what RESULT reports

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out


async def main(k: int, size: int, hold_s: float) -> None:
    n = size // 8
    rank = int(os.environ["RANK"])
    store = await dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=60))
    await dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=60)
    base = np.arange(n, dtype=np.uint64)  # allocated before the baseline: not part of the flood
    await dist.barrier()
    if rank == 0:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS: the peak from here on is the flood's
        except OSError:
            pass  # then VmHWM may hold an older, higher peak: the bound is only stricter
        before = status()["VmRSS"]
        t_start = time.monotonic()
        bufs = []
        for i in range(k):
            b = np.empty(n, dtype=np.uint64)
            np.add(base, np.uint64(i << 32), out=b)
            bufs.append(b)
        works = [await dist.isend(b, dst=1) for b in bufs]
        issued = status()["VmRSS"]
        t0 = time.monotonic()
        issue_s = t0 - t_start
        await store.set("issued", "1")
        for w in works:
            await w.wait()
        sent_s = time.monotonic() - t0
        s = status()
        result = dict(before=before, issued=issued, peak=s["VmHWM"], after=s["VmRSS"], sent_s=sent_s, issue_s=issue_s, up_s=t_start - T_UP)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        await store.wait(["issued"])
        await asyncio.sleep(hold_s)  # nothing posted: the sender's isends wait
        buf = np.empty(n, dtype=np.uint64)
        bad = []
        for i in range(k):
            buf.fill(0)
            await dist.recv(buf, src=0)
            np.subtract(buf, np.uint64(i << 32), out=buf)
            if not np.array_equal(buf, base):
                bad.append(i)
        print("CHECKED " + json.dumps(bad), flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    run = main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
    if sys.argv[4] == "uvloop":
        import uvloop

        uvloop.run(run)
    else:
        asyncio.run(run)
