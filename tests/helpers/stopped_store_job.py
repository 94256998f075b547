"""A three-rank job for tests/test_timeout_diagnosis.py: rank 0 hosts the store and is stopped
(SIGSTOP, by the test); ranks 1 and 2 then time out in an all_reduce and print what they raised.

    python tests/helpers/stopped_store_job.py PORT RANK

tcp://127.0.0.1:PORT, world size 3. Every rank does one all_reduce on the default group (all
connected), makes a group with a 0.6 s timeout and prints ``ready``. Rank 0 then sleeps (the
test stops it); ranks 1 and 2 wait for a line on stdin (the test writes one to each once rank 0
is stopped), run an all_reduce on the new group, print one JSON line ``{"error": null}`` or
``{"error": <DistError class name>, "message": <its text>}`` and exit without teardown.
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


async def main(port: int, rank: int) -> None:
    await dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    await dist.all_reduce(np.ones(4, np.float32))  # everyone connected, in step (the default group's 30 min)
    g = await dist.new_group(timeout=0.6)
    print("ready", flush=True)
    if rank == 0:  # the store's host: the test stops this process now
        await asyncio.sleep(60)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # rank 0 is stopped
    try:
        await dist.all_reduce(np.ones(4, np.float32), group=g)
        out: dict[str, str | None] = {"error": None}
    except dist.DistError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
    os._exit(0)  # no teardown: the store's host is stopped


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
