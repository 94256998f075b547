"""``python -m aiodist.bench debug``: what the debug levels cost on a small all_reduce loop.

Each configuration runs as a fresh 2-process job (``--ranks``) over the socket backend
("gloo"), since groups read the debug level and the flight recorder's size when they are made:

- ``OFF, no FR, no digests``: also ``AIODIST_DESYNC_DIGESTS=0`` (no always-on desync digest in
  the frames: what the digests cost is the next row's ratio to this one)
- ``OFF, no FR``: ``AIODIST_DEBUG=OFF`` with ``AIODIST_FR_BUFFER_SIZE=0`` (nothing recorded:
  what aiodist cost before the debug core)
- ``OFF``: the default (the flight recorder on, 2000 entries)
- ``INFO``: ``AIODIST_DEBUG=INFO`` (per-op tallies for the end-of-group summary)
- ``DETAIL``: ``AIODIST_DEBUG=DETAIL`` (a fingerprint exchange before every collective, and the
  issuing stack in the recorder)

Every rank warms up (``--warmup``, by default past the recorder's 2000 entries: its steady
state), meets the others at a barrier, then times ``--iters`` all_reduces of
``--floats`` float32 values with ``time.perf_counter``; a job's figure is the slowest rank's
mean time per op. The configurations run in turn, ``--repeats`` rounds (so a noisy neighbour
hits them alike), and the table shows each one's median with its ratio to ``OFF, no FR, no digests``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from aiodist.bench._jobs import run_workers

__all__ = ["main", "CONFIGS"]

# name -> environment
CONFIGS: dict[str, dict[str, str]] = {
    "OFF, no FR, no digests": {"AIODIST_DEBUG": "OFF", "AIODIST_FR_BUFFER_SIZE": "0", "AIODIST_DESYNC_DIGESTS": "0"},
    "OFF, no FR": {"AIODIST_DEBUG": "OFF", "AIODIST_FR_BUFFER_SIZE": "0"},
    "OFF": {"AIODIST_DEBUG": "OFF"},
    "INFO": {"AIODIST_DEBUG": "INFO"},
    "DETAIL": {"AIODIST_DEBUG": "DETAIL"},
}
BASELINE = "OFF, no FR, no digests"
_JOB_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench debug", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=5000, help="timed all_reduces per job (default 5000)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2200,
        help="untimed all_reduces first (default 2200: past the flight recorder's 2000, so its ring is full, its steady state)",
    )
    p.add_argument("--floats", type=int, default=1, help="float32 values per all_reduce (default 1)")
    p.add_argument("--ranks", type=int, default=2, help="processes per job (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="rounds over the configurations (default 5)")
    p.add_argument("--backend", default="gloo", help="backend (default gloo: the socket transport)")
    p.add_argument("--json", help="also write the raw numbers here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.floats < 1 or args.ranks < 2 or args.repeats < 1:
        p.error("--iters, --floats, --repeats must be >= 1, --warmup >= 0, --ranks >= 2")
    return args


async def _worker(args: argparse.Namespace) -> dict[str, float]:
    import numpy as np

    import aiodist as dist

    await dist.init_process_group(args.backend, timeout=60)
    try:
        t = np.ones(args.floats, np.float32)
        for _ in range(args.warmup):
            await dist.all_reduce(t)
        await dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            await dist.all_reduce(t)
        took = time.perf_counter() - t0
        await dist.barrier()
        return {"rank": dist.get_rank(), "us_per_op": took / args.iters * 1e6}
    finally:
        await dist.destroy_process_group()


def _job(args: argparse.Namespace, env_extra: dict[str, str]) -> float:
    """One fresh job; the slowest rank's microseconds per op."""
    worker = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--floats", str(args.floats)]
    worker += ["--ranks", str(args.ranks), "--backend", args.backend]
    results = run_workers(
        "aiodist.bench.debug",
        worker,
        args.ranks,
        timeout=_JOB_TIMEOUT_S,
        env_extra=env_extra,
        drop=("AIODIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "AIODIST_FR_BUFFER_SIZE"),
    )
    return max(float(r["us_per_op"]) for r in results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(asyncio.run(_worker(args))), flush=True)
        return 0
    runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    print(
        f"all_reduce of {args.floats} float32 x {args.iters}, {args.ranks} processes, backend {args.backend}, {args.repeats} rounds",
        flush=True,
    )
    try:
        for _ in range(args.repeats):
            for name, env in CONFIGS.items():
                runs[name].append(_job(args, env))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    base = statistics.median(runs[BASELINE])
    width = max(len(n) for n in CONFIGS)
    print(f"\n{'config'.ljust(width)}  {'us/op':>8}  {'vs ' + BASELINE:>14}  runs (us/op)")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"{name.ljust(width)}  {med:8.1f}  {med / base:13.2f}x  {', '.join(f'{v:.1f}' for v in values)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "us_per_op": runs}, f, indent=2)
        print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
