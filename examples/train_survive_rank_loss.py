"""Lose a rank, keep training: the survivors shrink the default group and go on.

    aiodist-run --standalone --keep-survivors --nproc-per-node 4 examples/train_survive_rank_loss.py --kill-rank 0

``--kill-rank R`` makes rank R SIGKILL itself at step ``--kill-step`` (a crash, as the OOM killer
would do it). Under ``--keep-survivors`` the launcher lets the other workers run on, and its agent
serves the store, so any rank may die, rank 0 included. Without a launcher (torchrun's variables
set by hand, env://) rank 0's process serves the store: any rank but 0 may die.

A torch DDP loop (``opt.zero_grad(); loss = loss_fn(ddp(x), y); await ddp.backward(loss);
opt.step()``) with the three things a job that survives adds:

- **The failure.** ``await ddp.backward(loss)`` fails on every survivor with a ``DistError`` whose
  ``culprits`` names the dead rank(s) (the same ranks on every survivor).
- **The shrink.** ``await dist.shrink_group(sorted(e.culprits), shrink_flags=dist.SHRINK_ABORT)``
  makes the survivors the new default group, renumbered 0..n-1 in their old order
  (``get_rank()``, ``get_world_size()`` and ``group=None`` follow). Then ``ddp = await
  DistributedDataParallel(model)`` on the same module takes it over from the old DDP and
  broadcasts the new rank 0's parameters.
- **The redo.** The interrupted step may have reduced some buckets and not others, and one
  survivor may have finished it where another did not: its gradients are thrown away
  (``zero_grad``), the step counter is the new rank 0's, and the step is done again on the
  survivors. Each rank's data shard follows its new rank and the new world size.

At the end every rank's SHA-256 of its parameters is gathered; each rank prints
``OK rank R (launched as L) of N: S steps, parameters identical (sha256 ...)`` and exits 0, or
exits 1 when they differ. Deterministic: the same flags give the same parameters.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
import time

try:
    import torch
except ImportError:  # pragma: no cover - the example needs torch
    print("this example needs torch (pip install torch)", file=sys.stderr)
    sys.exit(2)

import aiodist as dist
from aiodist.nn.parallel import DistributedDataParallel


def batch(step: int, rank: int, world_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the step's global batch: a regression task, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randn(size * world_size, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(size * world_size, 1, generator=g)
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


async def main(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo", timeout=args.timeout)
    launched_as = dist.get_rank()
    torch.manual_seed(launched_as)  # different on purpose: DDP broadcasts rank 0's parameters
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = await DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.MSELoss()
    step, lost = 0, []
    while step < args.steps:
        if launched_as == args.kill_rank and step == args.kill_step:
            print(f"rank {launched_as}: SIGKILL at step {step} (unix time {time.time():.3f})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, dist.get_rank(), dist.get_world_size(), args.batch)
        opt.zero_grad()
        try:
            loss = loss_fn(ddp(x), y)
            await ddp.backward(loss)
        except dist.DistError as e:
            t0 = time.perf_counter()
            dead = sorted(e.culprits)
            if not dead:
                raise
            await dist.shrink_group(dead, shrink_flags=dist.SHRINK_ABORT)
            ddp = await DistributedDataParallel(model)  # takes the module over; the new rank 0's parameters
            agreed = [step]
            await dist.broadcast_object_list(agreed, src=0)
            step = agreed[0]
            lost.append(dead)
            print(
                f"rank {dist.get_rank()} (launched as {launched_as}): step {step}: lost rank(s) {dead}, "
                f"now {dist.get_world_size()} ranks (shrink and DDP rebuilt in {(time.perf_counter() - t0) * 1e3:.0f} ms)",
                flush=True,
            )
            continue
        opt.step()
        step += 1
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    everyone: list[object] = [None] * dist.get_world_size()
    await dist.all_gather_object(everyone, digest)
    same = len(set(everyone)) == 1
    print(
        f"{'OK' if same else 'FAILED'} (unix time {time.time():.3f}) rank {dist.get_rank()} (launched as {launched_as}) of {dist.get_world_size()}: "
        f"{step} steps, loss {loss.item():.4f}, lost {lost}, parameters {'identical' if same else 'DIFFER'} "
        f"(sha256 {digest[:16]})",
        flush=True,
    )
    await dist.destroy_process_group()
    return 0 if same else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--kill-rank", type=int, default=-1, help="the rank (as launched) that SIGKILLs itself")
    p.add_argument("--kill-step", type=int, default=15)
    p.add_argument("--timeout", type=float, default=60.0, help="the default group's timeout (s)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
