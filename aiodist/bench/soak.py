"""``python -m aiodist.bench soak``: memory and file descriptors over a long run of mixed ops
with group churn.

One fresh job of ``--ranks`` processes over the socket backend ("gloo"). Every rank runs steps
of mixed ops on the default group (all_reduce, broadcast, all_gather_into_tensor, barrier, with
``--floats`` float32 values); every ``--churn`` steps it also makes a group of every rank
(``new_group``), runs an all_reduce and a broadcast on it and destroys it. After ``--warmup``
group lifecycles (default 1200: what a live group keeps up to a bound fills first: the flight
recorder's ring of 2000 ops, the transport's last 4096 op digests of the default group, the
allocator's arenas) it
samples its RSS (``VmRSS``) and open file descriptors, runs until ``--groups`` more lifecycles
are done, and samples again. The table shows each rank's growth over the measured part, and
bytes per group lifecycle; ``--max-growth SIZE`` makes the run fail (exit 1) when a rank's RSS
grew by more than that, which is how the fault tier uses it.

What a group leaves behind is anything a destroyed group's id still keys: the transport's
per-op digests, shared memory's bookkeeping, the World's registries. A healthy run's growth is
flat after warm-up: a few KiB of allocator noise, not a figure per group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from aiodist.bench._jobs import run_workers
from aiodist.knobs import parse_size as _parse_size

__all__ = ["main", "parse_size"]

_JOB_TIMEOUT_S = 600.0


def parse_size(text: str) -> int:
    """``--max-growth``: a byte count with an optional K/M/G suffix (aiodist's one size parser;
    no minus sign)."""
    try:
        return _parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--groups", type=int, default=5000, help="group lifecycles measured after the warm-up (default 5000)")
    p.add_argument(
        "--warmup", type=int, default=1200, help="group lifecycles before the first sample (default 1200: past the bounded caches)"
    )
    p.add_argument("--churn", type=int, default=1, help="steps of mixed ops per group lifecycle (default 1)")
    p.add_argument("--floats", type=int, default=256, help="float32 values per op (default 256)")
    p.add_argument("--backend", default="gloo", help="backend (default gloo: the socket transport)")
    p.add_argument("--max-growth", type=parse_size, default=None, help="fail when a rank's RSS grew by more than this (e.g. 1M)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.groups < 1 or args.warmup < 0 or args.churn < 1 or args.floats < 1:
        p.error("--ranks must be >= 2, --groups, --churn and --floats >= 1, --warmup >= 0")
    return args


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _worker(args: argparse.Namespace) -> dict[str, float]:
    import gc

    import numpy as np

    import aiodist as dist

    await dist.init_process_group(args.backend, timeout=120)
    try:
        n = dist.get_world_size()
        x = np.ones(args.floats, np.float32)
        out = np.empty(args.floats * n, np.float32)
        everyone = list(range(n))

        async def lifecycle() -> None:
            for _ in range(args.churn):
                await dist.all_reduce(x)
                await dist.broadcast(x, 0)
                await dist.all_gather_into_tensor(out, x)
                await dist.barrier()
            g = await dist.new_group(everyone)
            await dist.all_reduce(x, group=g)
            await dist.broadcast(x, 0, group=g)
            await dist.destroy_process_group(g)

        for _ in range(args.warmup):
            await lifecycle()
        gc.collect()
        rss0, fds0, t0 = _rss_kib(), _fds(), time.perf_counter()
        for _ in range(args.groups):
            await lifecycle()
        gc.collect()
        took = time.perf_counter() - t0
        rss1, fds1 = _rss_kib(), _fds()
        await dist.barrier()
        return {"rank": dist.get_rank(), "rss0_kib": rss0, "rss1_kib": rss1, "fds0": fds0, "fds1": fds1, "seconds": took}
    finally:
        await dist.destroy_process_group()


def _job(args: argparse.Namespace) -> list[dict[str, Any]]:
    worker = ["--groups", str(args.groups), "--warmup", str(args.warmup), "--churn", str(args.churn)]
    worker += ["--floats", str(args.floats), "--ranks", str(args.ranks), "--backend", args.backend]
    return run_workers("aiodist.bench.soak", worker, args.ranks, timeout=_JOB_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(asyncio.run(_worker(args))), flush=True)
        return 0
    print(
        f"{args.ranks} processes, backend {args.backend}: {args.warmup} group lifecycles of warm-up, then {args.groups} measured; "
        f"each: {args.churn} step(s) of all_reduce, broadcast, all_gather_into_tensor, barrier ({args.floats} float32) on the "
        "default group, then new_group, all_reduce, broadcast, destroy_process_group",
        flush=True,
    )
    try:
        results = _job(args)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"\n{'rank':>4}  {'RSS before':>10}  {'RSS after':>10}  {'growth':>9}  {'B/group':>8}  {'fds':>7}  {'groups/s':>8}")
    worst = 0
    for r in results:
        grew = int(r["rss1_kib"] - r["rss0_kib"]) << 10
        worst = max(worst, grew)
        print(
            f"{int(r['rank']):>4}  {int(r['rss0_kib']):>7} KiB  {int(r['rss1_kib']):>7} KiB  {grew >> 10:>5} KiB  "
            f"{grew / args.groups:>8.0f}  {int(r['fds0']):>3}->{int(r['fds1']):<3}  {args.groups / r['seconds']:>8.0f}"
        )
    print("RSS: VmRSS after gc.collect(); growth over the measured lifecycles only; fds: /proc/self/fd")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "ranks": results}, f, indent=2)
        print(f"results written to {args.json}")
    if args.max_growth is not None and worst > args.max_growth:
        print(
            f"\nSOAK FAILED: a rank's RSS grew by {worst >> 10} KiB over {args.groups} group lifecycles (limit {args.max_growth >> 10} KiB)",
            file=sys.stderr,
        )
        return 1
    if any(r["fds1"] > r["fds0"] for r in results):
        print("\nSOAK FAILED: file descriptors grew", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
