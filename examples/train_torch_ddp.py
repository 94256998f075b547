"""Data-parallel training of a torch MLP classifier with aiodist's DistributedDataParallel.

    aiodist-run --standalone --nproc-per-node 2 examples/train_torch_ddp.py
    python -m aiodist.run --standalone --nproc-per-node 2 examples/train_torch_ddp.py --accumulate 2 --hook fp16

Any launcher that sets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) works:
the script calls ``await aiodist.init_process_group("gloo")`` with its env:// defaults. It needs
torch (CPU is enough); without it, it exits with status 2 and says so.

A torch DDP training loop, ported by adding ``await`` in two places:

- **Data.** A synthetic classification task: Gaussian blobs in ``--features`` dimensions, two
  blobs per class, around centres drawn from the seed (the same task on every rank). Each rank
  generates only its own shard, from a generator seeded with the seed and its rank, and reshuffles
  it every epoch (seeded too); all shards have the same size, so every rank takes the same number
  of steps.
- **Model.** A ``torch.nn.Sequential`` MLP (Linear, ReLU, ..., Linear) with cross entropy and SGD
  with momentum, one torch thread per rank. Each rank initialises its model with a *different*
  seed on purpose: ``ddp = await DistributedDataParallel(model)`` checks that every rank has the
  same parameter names, shapes and dtypes and broadcasts rank 0's parameters and buffers, so the
  replicas start equal anyway.
- **A step** is torch's loop: ``opt.zero_grad(); loss = loss_fn(ddp(x), y); await
  ddp.backward(loss); opt.step()``. ``ddp.backward`` runs autograd; as each bucket of gradients
  is complete (reverse registration order, ``--bucket-cap-mb``) its all_reduce is issued, and the
  call returns when every gradient is averaged across the ranks, before the optimizer step.
- **Gradient accumulation** (``--accumulate K``): a step takes K micro-batches; the first K-1 run
  forward and backward inside ``with ddp.no_sync():`` (gradients accumulate locally, nothing is
  sent), the last one outside it, and that synced backward all-reduces the accumulated gradients
  once. The loss is divided by K, so the step sees the mean over the K micro-batches.
- **Comm hook** (``--hook fp16``): ``ddp.register_comm_hook(None, fp16_compress_hook)`` from
  ``aiodist.algorithms.ddp_comm_hooks.default_hooks`` all-reduces each bucket in float16 (half the
  bytes), as torch's hook does; ``--hook allreduce`` and ``--hook bf16`` pick the other defaults.
- **Metrics.** Per epoch, the ranks' loss/accuracy sums (training batches, and a held-out test
  set, each rank evaluating its shard) are all-reduced, and rank 0 prints them with steps/s.
- **The end.** Every rank's SHA-256 of its parameters is gathered with ``all_gather_object``.
  Rank 0 prints ``OK`` when all ranks hold identical parameters and the test accuracy is at least
  ``--min-accuracy``; otherwise every rank exits 1. ``destroy_process_group()`` closes the job.

Deterministic: the same flags and world size give the same numbers, run after run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import sys
import time
from collections.abc import Iterator
from typing import Any

try:
    import torch
except ImportError:
    print(
        "examples/train_torch_ddp.py needs torch (the CPU build is enough: pip install torch); "
        "examples/train_data_parallel.py is the numpy-only training example",
        file=sys.stderr,
    )
    sys.exit(2)

import aiodist as dist
from aiodist.algorithms.ddp_comm_hooks import default_hooks
from aiodist.nn.parallel import DistributedDataParallel

HOOKS = {
    "none": None,
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


# ---------------------------------------------------------------- data


def make_shard(n: int, features: int, classes: int, seed: int, rank: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``n`` samples: Gaussian blobs around ``2 * classes`` centres, two per class (so
    no straight line separates the classes). The centres come from ``seed`` alone (the same task
    on every rank); the samples from a generator seeded with (seed, split, rank): each rank makes
    its own shard, the same one on every run."""
    centres = torch.randn(2 * classes, features, generator=torch.Generator().manual_seed(seed)) * 2.0
    gen = torch.Generator().manual_seed(seed * 1_000_003 + split * 1009 + rank)
    blob = torch.randint(0, 2 * classes, (n,), generator=gen)
    x = centres[blob] + torch.randn(n, features, generator=gen)
    return x, blob % classes


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled mini-batches (the last partial batch dropped)."""
    order = torch.randperm(len(x), generator=gen)
    for i in range(len(x) // batch_size):
        idx = order[i * batch_size : (i + 1) * batch_size]
        yield x[idx], y[idx]


# ---------------------------------------------------------------- training


def checksum(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def evaluate(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    logits = module(x)
    return float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")), int((logits.argmax(dim=1) == y).sum())


async def train(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        return await _train(args)
    finally:
        await dist.destroy_process_group()


async def _train(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    per_rank = args.samples // world
    x, y = make_shard(per_rank, args.features, args.classes, args.seed, rank, split=0)
    xt, yt = make_shard(max(per_rank // 4, 1), args.features, args.classes, args.seed, rank, split=1)
    micro = args.batch_size // args.accumulate  # samples per micro-batch
    steps_per_epoch = per_rank // (micro * args.accumulate)
    if micro < 1 or steps_per_epoch < 1:
        raise SystemExit(f"--batch-size {args.batch_size} with --accumulate {args.accumulate} does not fit a rank's {per_rank} samples")

    torch.manual_seed(args.seed + 1 + rank)  # a different start on every rank: DDP's construction broadcasts rank 0's
    sizes = [args.features, *args.hidden, args.classes]
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)

    ddp = await DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    hook = HOOKS[args.hook]
    if hook is not None:
        ddp.register_comm_hook(None, hook)  # state None: the default group
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    n_params = sum(p.numel() for p in model.parameters())
    batch = micro * args.accumulate
    buckets = ddp.reducer.bucket_sizes
    say(
        f"{world} ranks, {per_rank} samples each, batch {batch} per rank (global {batch * world})"
        + (f" in {args.accumulate} micro-batches of {micro} (no_sync)" if args.accumulate > 1 else "")
        + f", {steps_per_epoch} steps/epoch; MLP {'-'.join(map(str, sizes))}, {n_params} parameters in "
        f"{len(buckets)} gradient bucket{'s' * (len(buckets) > 1)} ({', '.join(map(str, buckets))} B); comm hook {args.hook}"
    )

    first_loss = last_loss = test_acc = float("nan")
    steps = 0
    t_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sums = torch.zeros(6, dtype=torch.float64)  # train loss, correct, count; test loss, correct, count
        gen = torch.Generator().manual_seed(args.seed * 1000 + epoch * 10 + rank)
        it = batches(x, y, micro, gen)
        ddp.train()
        for _ in range(steps_per_epoch):
            opt.zero_grad()
            for k in range(args.accumulate):
                xb, yb = next(it)
                last = k == args.accumulate - 1
                with contextlib.nullcontext() if last else ddp.no_sync():  # only the last micro-batch's backward syncs
                    out = ddp(xb)
                    loss = loss_fn(out, yb)
                    await ddp.backward(loss / args.accumulate)
                sums[:3] += torch.tensor([loss.item() * len(yb), (out.argmax(dim=1) == yb).sum().item(), len(yb)], dtype=torch.float64)
            opt.step()
            steps += 1
        ddp.eval()
        test_loss_sum, test_correct = evaluate(model, xt, yt)
        sums[3:] = torch.tensor([test_loss_sum, test_correct, len(yt)], dtype=torch.float64)
        await dist.all_reduce(sums)
        dt = time.perf_counter() - t0
        last_loss, train_acc = float(sums[0] / sums[2]), float(sums[1] / sums[2])
        test_loss, test_acc = float(sums[3] / sums[5]), float(sums[4] / sums[5])
        if epoch == 1:
            first_loss = last_loss
        say(
            f"epoch {epoch:3d}  loss {last_loss:.4f}  acc {train_acc:.3f}  test loss {test_loss:.4f}  "
            f"test acc {test_acc:.3f}  {steps_per_epoch / dt:6.1f} steps/s"
        )
    elapsed = time.perf_counter() - t_start

    checksums: list[Any] = [None] * world
    await dist.all_gather_object(checksums, checksum(model))
    identical = len(set(checksums)) == 1
    say(
        f"{steps} steps in {elapsed:.2f} s ({steps / elapsed:.1f} steps/s); loss {first_loss:.4f} -> {last_loss:.4f}, test accuracy {test_acc:.3f}"
    )
    if identical:
        say(f"parameters identical on all {world} ranks (sha256 {checksums[0]})")
    else:
        say("parameters DIFFER across ranks: " + ", ".join(f"rank {r}: {s}" for r, s in enumerate(checksums)))
    if not identical or not test_acc >= args.min_accuracy:
        say(f"FAILED: test accuracy {test_acc:.3f} (needed {args.min_accuracy})" if identical else "FAILED")
        return 1
    say("OK")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per optimizer step (default 32)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step, all but the last under no_sync() (default 1)")
    p.add_argument("--hook", choices=sorted(HOOKS), default="none", help="DDP comm hook from default_hooks (default none)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25, torch's)")
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[64, 64], help="hidden layer widths (default 64,64)")
    p.add_argument("--features", type=int, default=8, help="input dimensions (default 8)")
    p.add_argument("--classes", type=int, default=4, help="classes (default 4)")
    p.add_argument("--samples", type=int, default=4096, help="training samples in all ranks together (default 4096)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy (default 0.9)")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.accumulate, args.features, *args.hidden) < 1 or args.classes < 2 or args.samples < 1:
        p.error("--epochs, --batch-size, --accumulate, --features, --hidden and --samples must be >= 1, --classes >= 2")
    if not args.bucket_cap_mb > 0:
        p.error("--bucket-cap-mb must be > 0")
    return args


def main() -> int:
    args = parse_args()
    # torch.optim imports torch._dynamo the first time an optimizer is made, which takes a second
    # or more: import it here, before the event loop runs, rather than block the loop with it.
    import torch._dynamo  # noqa: F401

    try:
        import uvloop
    except ImportError:
        return asyncio.run(train(args))
    return uvloop.run(train(args))


if __name__ == "__main__":
    sys.exit(main())
