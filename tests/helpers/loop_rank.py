"""A rank for the fault tests tests/faults/test_kill.py and test_stop.py: all_reduce in a loop
until the group breaks (a peer killed or stopped by the test), then say when and why.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \\
        python tests/helpers/loop_rank.py TIMEOUT NBYTES THEN

env:// group with a TIMEOUT-second timeout; all_reduce of NBYTES of float32 ones, once, then
``running`` (every rank is connected and through one op), then the same all_reduce in a loop.
The loop's DistError is printed as two lines, the ranks it names (its ``culprits``' global
ranks) first::

    CULPRITS <sorted list of ranks>
    ERROR <time.time() of the error, repr> <class name>: <message on one line>

THEN says what follows: ``exit`` (``os._exit(0)``: a broken world's teardown is not what is
measured) or ``destroy`` (``destroy_process_group()``, then ``destroyed in <seconds> s``).
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


async def main(timeout: float, nbytes: int, then: str) -> None:
    if then not in ("exit", "destroy"):
        raise SystemExit(f"THEN is exit or destroy, not {then!r}")
    await dist.init_process_group("gloo", timeout=timeout)
    x = np.ones(nbytes // 4, dtype=np.float32)
    await dist.all_reduce(x)  # every rank is connected and through one op before "running"
    print("running", flush=True)
    try:
        while True:
            await dist.all_reduce(x)
    except dist.DistError as exc:
        t = time.time()
        msg = " ".join(str(exc).split())
        print(f"CULPRITS {sorted(exc.culprits)}", flush=True)
        print(f"ERROR {t!r} {type(exc).__name__}: {msg}", flush=True)
    if then == "exit":
        os._exit(0)  # a broken world's teardown is not what this test measures
    t = time.monotonic()
    await dist.destroy_process_group()
    print(f"destroyed in {time.monotonic() - t:.3f} s", flush=True)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
