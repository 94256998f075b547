"""A job for tests/test_multihost_launcher.py, started by ``aiodist-run`` on each "host".

    python tests/helpers/multihost_loop_job.py [--iters N] [--timeout S] [--pause S] [--restart-iters M]

Every rank joins the default group (``env://``, timeout 30 s: the hosts' workers may start
seconds apart), prints ``start rank R of W restart K advertise=<AIODIST_ADVERTISE_ADDR>``, makes
a group of every rank with timeout ``--timeout`` s (default 3) and loops ``all_reduce`` of
``[rank + 1]`` on it, checking the sum and printing one progress line per iteration::

    iter 7 ok sum=3.0 restart=0

until ``--iters`` iterations are done (default: practically forever, until a collective fails),
``--pause`` s apart. On a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) it runs ``--restart-iters``
iterations (default 5) and ends. At the end every rank prints ``DONE rank R restart K``.

A collective that fails prints ``FAILED rank R at iter I after T s: <type>: <message>`` on
stderr before the exception leaves ``main`` (``@record`` writes it to the error file, so the
launcher's report shows it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402
from aiodist.elastic import record  # noqa: E402


@record
async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10**9)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--restart-iters", type=int, default=5)
    args = p.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    iters = args.iters if restart == 0 else args.restart_iters
    await dist.init_process_group("gloo", timeout=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"start rank {rank} of {world} restart {restart} advertise={os.environ.get('AIODIST_ADVERTISE_ADDR', '')}", flush=True)
    want = world * (world + 1) / 2
    try:
        group = await dist.new_group(list(range(world)), timeout=args.timeout)
        for i in range(iters):
            x = np.array([rank + 1.0])
            start = time.monotonic()
            try:
                await dist.all_reduce(x, group=group)
            except Exception as exc:
                took = time.monotonic() - start
                print(f"FAILED rank {rank} at iter {i} after {took:.1f} s: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                raise
            if float(x[0]) != want:
                raise AssertionError(f"rank {rank} iter {i}: all_reduce gave {x[0]}, want {want}")
            print(f"iter {i} ok sum={x[0]} restart={restart}", flush=True)
            await asyncio.sleep(args.pause)
        print(f"DONE rank {rank} restart {restart}", flush=True)
    finally:
        await dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
