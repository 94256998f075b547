"""Data-parallel training of a small numpy MLP on three interleaved spirals.

    aiodist-run --standalone --nproc-per-node 4 examples/train_data_parallel.py
    python -m aiodist.run --standalone --nproc-per-node 4 examples/train_data_parallel.py --epochs 20

Any launcher that sets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) works:
the script calls ``await aiodist.init_process_group("gloo")`` with its env:// defaults.

What each rank does, as PyTorch's DistributedDataParallel would:

- **Data.** Every rank makes the same seeded dataset (three spirals in the plane, 2-D points,
  3 classes) and keeps its own shard of it (a seeded permutation, every N-th sample). An **async
  data loader** feeds it: ``async for x, y in loader`` consumes a bounded ``asyncio.Queue`` that a
  producer task fills with shuffled, augmented (jittered) batches. The producer runs whenever the
  training step awaits communication, so the next batches are ready before they are asked for
  (the script reports how often the step found a batch waiting).
- **Model.** A multi-layer perceptron written out in numpy (ReLU hidden layer(s), softmax cross
  entropy, manual backprop), SGD with momentum. Every rank starts from the same seeded weights.
- **Gradients.** ``aiodist.nn.parallel.Reducer`` (the reducer under aiodist's
  ``DistributedDataParallel``; it takes numpy parameters too) groups the parameters into flat
  buckets in the order backward produces their gradients (last layer first, DDP's order, up to
  ``--bucket-bytes`` each). Backward is a generator that yields each gradient as soon as it
  exists; ``reducer.ready(i, grad)`` writes it into its bucket divided by the world size, and the
  moment a bucket is complete issues its ``all_reduce`` (a sum of the quotients: DDP's averaging)
  with ``async_op=True``; backward gives the event loop one turn, so the bytes move while it goes
  on with the earlier layers. ``await reducer.finish()`` awaits every bucket just before the
  optimizer step, and ``reducer.grad_view(i)`` is then parameter ``i``'s averaged gradient. Every
  rank applies the same averaged gradient, so the replicas stay identical.
- **Metrics.** Per epoch, the ranks' loss/accuracy sums (train and a held-out test set, each rank
  evaluating its shard) are all-reduced, and rank 0 prints them with steps/s.
- **The end.** ``aiodist.model_averaging.average_parameters`` averages the parameters once more
  (one flat all_reduce; a no-op numerically here, as the replicas agree, but it is how local SGD /
  periodic averaging would end), then every rank's parameter checksum is gathered with
  ``all_gather_object`` and compared. Rank 0 prints ``OK`` when all ranks hold identical
  parameters and the test accuracy is at least ``--min-accuracy``; otherwise every rank exits 1.
  ``destroy_process_group()`` closes the job.

Deterministic: the same ``--seed`` and world size give the same numbers, run after run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

import aiodist as dist
from aiodist.model_averaging import average_parameters
from aiodist.nn.parallel import Reducer

Batch = tuple[np.ndarray, np.ndarray]


# ---------------------------------------------------------------- data


def make_spirals(n: int, classes: int, seed: int, noise: float = 0.25) -> Batch:
    """``n`` points of ``classes`` interleaved spirals (float32 ``x`` of shape (n, 2), int64 labels)."""
    rng = np.random.default_rng(seed)
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, per)
        t = np.linspace(c * 4.0, (c + 1) * 4.0, per) + rng.normal(0.0, noise, per)
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], axis=1))
        ys.append(np.full(per, c, dtype=np.int64))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


def shard(x: np.ndarray, y: np.ndarray, rank: int, world_size: int, seed: int) -> Batch:
    """This rank's shard: every rank draws the same permutation and keeps every world_size-th
    sample from its offset; all shards have the same size (the remainder is dropped), so every
    rank runs the same number of steps and issues the same collectives."""
    order = np.random.default_rng(seed).permutation(len(x))
    per_rank = len(x) // world_size
    mine = order[rank::world_size][:per_rank]
    return x[mine], y[mine]


class AsyncLoader:
    """``async for x, y in loader``: one epoch of shuffled, augmented mini-batches.

    Each iteration starts a producer task that puts batches into a bounded ``asyncio.Queue``
    (``prefetch`` deep): it works ahead while the consumer awaits something else (here: the
    gradient all-reduces) and blocks on ``put`` when it is ``prefetch`` batches ahead. Batches are
    ``batch_size`` samples (the last partial batch is dropped: every rank takes the same number of
    steps). ``ready``/``asked`` count how often a batch was already waiting when the step asked."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int, prefetch: int = 4, jitter: float = 0.02) -> None:
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.seed = seed
        self.prefetch = prefetch
        self.jitter = jitter
        self.epoch = 0
        self.ready = 0
        self.asked = 0

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def __aiter__(self) -> AsyncIterator[Batch]:
        self.epoch += 1
        return self._iterate(np.random.default_rng([self.seed, self.epoch]))

    async def _produce(self, queue: asyncio.Queue[Batch | Exception | None], rng: np.random.Generator) -> None:
        try:
            order = rng.permutation(len(self.x))
            for i in range(len(self)):
                idx = order[i * self.batch_size : (i + 1) * self.batch_size]
                x = self.x[idx] + rng.normal(0.0, self.jitter, (len(idx), self.x.shape[1])).astype(np.float32)  # augmentation
                await queue.put((x, self.y[idx]))
        except Exception as exc:  # handed to the consumer, which raises it: a broken loader fails the step, never hangs it
            await queue.put(exc)
        else:
            await queue.put(None)

    async def _iterate(self, rng: np.random.Generator) -> AsyncIterator[Batch]:
        queue: asyncio.Queue[Batch | Exception | None] = asyncio.Queue(maxsize=self.prefetch)
        producer = asyncio.create_task(self._produce(queue, rng), name="data-loader")
        try:
            while True:
                self.asked += 1
                self.ready += not queue.empty()
                item = await queue.get()
                if item is None:
                    self.asked -= 1
                    return
                if isinstance(item, Exception):
                    raise RuntimeError("the data loader failed") from item
                yield item
        finally:
            producer.cancel()


# ---------------------------------------------------------------- model


class MLP:
    """Dense layers with ReLU between them and softmax cross entropy on top; parameters are
    float32 arrays ``[W0, b0, W1, b1, ...]`` updated in place."""

    def __init__(self, sizes: list[int], rng: np.random.Generator) -> None:
        self.params: list[np.ndarray] = []
        self.names: list[str] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            scale = np.sqrt((2.0 if i < len(sizes) - 2 else 1.0) / fan_in)  # He init, then LeCun for the logits
            self.params += [(rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32), np.zeros(fan_out, np.float32)]
            self.names += [f"W{i}", f"b{i}"]

    @property
    def layers(self) -> int:
        return len(self.params) // 2

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits, and the activations backward needs (each layer's input)."""
        inputs = []
        a = x
        for i in range(self.layers):
            inputs.append(a)
            a = a @ self.params[2 * i] + self.params[2 * i + 1]
            if i < self.layers - 1:
                a = np.maximum(a, 0.0)
        return a, inputs

    @staticmethod
    def loss(logits: np.ndarray, y: np.ndarray) -> tuple[float, int, np.ndarray]:
        """Summed cross entropy, number correct, and d(mean loss)/d(logits)."""
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        rows = np.arange(len(y))
        grad = np.exp(logp)
        grad[rows, y] -= 1.0
        return float(-logp[rows, y].sum()), int((logits.argmax(axis=1) == y).sum()), grad / len(y)

    def backward(self, inputs: list[np.ndarray], dlogits: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(parameter index, gradient)`` layer by layer, last layer first: the order in
        which a real backward pass makes gradients available."""
        d = dlogits
        for i in reversed(range(self.layers)):
            a = inputs[i]
            yield 2 * i + 1, d.sum(axis=0)
            yield 2 * i, a.T @ d
            if i:
                d = d @ self.params[2 * i].T
                d *= a > 0  # ReLU of the layer below (its output is this layer's input)


# ---------------------------------------------------------------- training


def checksum(params: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


def evaluate(model: MLP, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    logits, _ = model.forward(x)
    loss, correct, _ = model.loss(logits, y)
    return loss, correct


async def train(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        return await _train(args)
    finally:
        await dist.destroy_process_group()


async def _train(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    x_all, y_all = make_spirals(args.samples, 3, args.seed)
    xt_all, yt_all = make_spirals(max(args.samples // 4, 3 * world), 3, args.seed + 1)
    x, y = shard(x_all, y_all, rank, world, args.seed)
    xt, yt = shard(xt_all, yt_all, rank, world, args.seed + 1)
    loader = AsyncLoader(x, y, args.batch_size, seed=args.seed * 1000 + rank, prefetch=args.prefetch)
    if len(loader) == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than a rank's shard ({len(x)} samples of {args.samples})")
    model = MLP([2, *args.hidden, 3], np.random.default_rng(args.seed))  # same seed: every replica starts equal
    velocity = [np.zeros_like(p) for p in model.params]
    reducer = Reducer(model.params, names=model.names, bucket_cap_mb=args.bucket_bytes / 2**20)
    layout = ", ".join(
        "+".join(model.names[i] for i in b.members) + f" ({size} B)" for b, size in zip(reducer.buckets, reducer.bucket_sizes)
    )
    say(
        f"{world} ranks, {len(x)} samples each ({len(x_all)} in all), batch {args.batch_size} per rank "
        f"(global {args.batch_size * world}), {len(loader)} steps/epoch; MLP 2-{'-'.join(map(str, args.hidden))}-3, "
        f"{sum(p.size for p in model.params)} parameters in {len(reducer.buckets)} gradient buckets: {layout}"
    )

    first_loss = last_loss = test_acc = float("nan")
    steps = 0
    wait_s = 0.0  # time spent waiting for the all-reduces after backward ended
    t_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sums = np.zeros(6, np.float64)  # train loss, correct, count; test loss, correct, count
        async for xb, yb in loader:
            logits, inputs = model.forward(xb)
            loss, correct, dlogits = model.loss(logits, yb)
            sums[:3] += (loss, correct, len(yb))
            for i, grad in model.backward(inputs, dlogits):
                if reducer.ready(i, grad):  # into its bucket; a complete bucket's all_reduce is issued here
                    await asyncio.sleep(0)  # one turn of the loop: that all_reduce starts sending while backward goes on
            t_wait = time.perf_counter()
            await reducer.finish()  # every bucket reduced: the averaged gradients are in the buckets
            wait_s += time.perf_counter() - t_wait
            for i, (p, v) in enumerate(zip(model.params, velocity)):
                v *= args.momentum
                v += reducer.grad_view(i)
                p -= args.lr * v
            steps += 1
        sums[3:5] = evaluate(model, xt, yt)
        sums[5] = len(yt)
        await dist.all_reduce(sums)
        dt = time.perf_counter() - t0
        last_loss, train_acc = sums[0] / sums[2], sums[1] / sums[2]
        test_loss, test_acc = sums[3] / sums[5], sums[4] / sums[5]
        if epoch == 1:
            first_loss = last_loss
        say(
            f"epoch {epoch:3d}  loss {last_loss:.4f}  acc {train_acc:.3f}  test loss {test_loss:.4f}  "
            f"test acc {test_acc:.3f}  {len(loader) / dt:6.1f} steps/s"
        )
    elapsed = time.perf_counter() - t_start

    await average_parameters(model.params, None)
    checksums: list[str | None] = [None] * world
    await dist.all_gather_object(checksums, checksum(model.params))
    identical = len(set(checksums)) == 1
    say(
        f"{steps} steps in {elapsed:.2f} s ({steps / elapsed:.1f} steps/s); waited {wait_s / elapsed:.0%} of the time "
        f"for gradients after backward; {loader.ready}/{loader.asked} batches were prefetched before the step asked"
    )
    say(f"loss {first_loss:.4f} -> {last_loss:.4f}, test accuracy {test_acc:.3f}")
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
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[64], help="hidden layer width(s), e.g. 64 or 64,32")
    p.add_argument("--samples", type=int, default=3000, help="training samples in all ranks together (default 3000)")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-bytes", type=int, default=512, help="gradient bucket size cap in bytes (DDP's bucket_cap_mb = this / 2**20; default 512)"
    )
    p.add_argument("--prefetch", type=int, default=4, help="batches the data loader may work ahead")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy (default 0.9)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 3 or args.prefetch < 1 or min(args.hidden) < 1 or args.bucket_bytes < 1:
        p.error("--epochs, --batch-size, --prefetch, --hidden and --bucket-bytes must be >= 1, --samples >= 3")
    return args


def main() -> int:
    args = parse_args()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(train(args))
    return uvloop.run(train(args))


if __name__ == "__main__":
    sys.exit(main())
