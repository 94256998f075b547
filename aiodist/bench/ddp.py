"""``python -m aiodist.bench ddp``: a data-parallel training step, aiodist's DistributedDataParallel
against torch's over gloo, with the compute-only baseline, in one run.

What it runs, for each rank count of ``--ranks`` (default 2 and 4) and each model of
``--models``:

- ``compute-only``: the same training loop with no communication in it (the plain module,
  ``loss.backward()``, ``optimizer.step()``), every rank running at the same time (on the
  aiodist rank processes, which meet at a barrier before the warm-up and before the timed
  steps, and at none in between), so the machine is as busy as in the data-parallel rows: the
  floor the other rows are measured against.
- ``aiodist DDP``: ``ddp = await aiodist.nn.parallel.DistributedDataParallel(model)`` over an
  aiodist "gloo" group (its socket/shared-memory transport) on uvloop, ``await ddp.backward(loss)``.
- ``torch DDP`` (``--compare torch``): ``torch.nn.parallel.DistributedDataParallel`` over a
  torch.distributed gloo group, ``loss.backward()``.

Each implementation runs on its own set of rank processes (spawned; real processes over
loopback), each with one torch thread (``torch.set_num_threads(1)``); compute-only runs on the
aiodist ones. The sets start once per rank count; the coordinator then drives them over pipes,
one row at a time (the machine is small). Per model, every row first builds the model afresh
from the same seed on every rank, wraps it and runs ``--warmup`` untimed steps; then the rows
take turns at the ``--steps`` timed steps, split into ``--rounds`` turns (each after a
barrier), the order rotating from turn to turn, so that the machine's drift lands on every
row. Every rank trains with SGD on its own data (seeded by rank; the same data in every row).

A step is ``zero_grad``, forward and loss, backward (with the gradients averaged), and
``optimizer.step()``, timed with ``time.perf_counter`` on every rank; the step time of a row is
the MEDIAN over the timed steps of the slowest rank's time for that step. Its parts (forward,
backward, optimizer) are medians of the ranks' mean. Overhead = a row's step time minus the
compute-only row's. The DDP rows also report what the DDP itself measured over the timed
steps (``_get_ddp_logging_data()``: forward, backward compute, backward communication and
their overlap; torch's with its runtime-logging sample rate set to 1, so every step counts).

Correctness: every rank of a DDP row must end with the same parameters (bit for bit), or the
run fails. With ``--compare torch`` the parameters after the last step are also compared
between aiodist's DDP and torch's at 2 ranks (same seeds, same data): torch averages as
``mul_out(grad, 1/n)`` into the bucket and then sums, and aiodist does the same, so the two
must agree bit for bit ("bit-identical: yes"); a "no" fails the run (exit code 1). At more
ranks the order in which each backend adds the ranks' buckets is its own, so the comparison
is shown but not required.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiodist.bench import format_table, machine_info
from aiodist.bench.collectives import HOST, BenchError, Plan, Side, _free_port, _next, report_to_coordinator, run_loop, side_order

__all__ = ["main", "MODELS", "ROWS"]

#: model name -> what it is (for the listing and the table titles)
MODELS: dict[str, str] = {
    "mlp": "6 x Linear(1024, 1024), ReLU between; batch 64; MSE loss",
    "small": "128 x [Linear(48, 48), LayerNorm(48), ReLU]: 512 parameter tensors of 0.2-9 KiB; batch 64; MSE loss",
    "tiny": "Linear(16, 32), ReLU, Linear(32, 8); batch 8; MSE loss (a smoke test)",
}
DEFAULT_MODELS = ("mlp", "small")
ROWS = {"compute": "compute-only", "aiodist": "aiodist DDP", "torch": "torch DDP"}
SEED = 0  # the model's initial parameters (every rank, every row)
DATA_SEED = 1000  # + rank: that rank's batches (the same in every row)


# ----------------------------------------------------------------------------- ranks


def where_backward_runs(rank_counts: list[int]) -> str:
    """The legend line saying where aiodist's DDP ran autograd at each rank count (the rule
    DistributedDataParallel applies: aiodist.nn.parallel.distributed.backward_on_thread)."""
    from aiodist.nn.parallel.distributed import ENV_BACKWARD, _usable_cores, backward_on_thread

    choice = os.environ.get(ENV_BACKWARD, "")
    cores = _usable_cores()
    where = ", ".join(f"{n} ranks: {'a worker thread' if backward_on_thread(choice, cores, n) else 'the loop thread'}" for n in rank_counts)
    return (
        f"aiodist runs loss.backward() where {ENV_BACKWARD}={choice or 'auto'} puts it on {cores} cores ({where}); "
        "each bucket's all-reduce is issued the moment the bucket is filled"
    )


def build(name: str) -> tuple[Any, int, int, int]:
    """The model (seeded: the same on every rank and in every row) and its input width,
    output width and batch size."""
    import torch

    torch.manual_seed(SEED)
    nn = torch.nn
    if name == "mlp":
        width, layers = 1024, 6
        mods: list[Any] = []
        for k in range(layers):
            mods.append(nn.Linear(width, width))
            if k < layers - 1:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods), width, width, 64
    if name == "small":
        width, blocks = 48, 128
        mods = []
        for _ in range(blocks):
            mods += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
        return nn.Sequential(*mods), width, width, 64
    if name == "tiny":
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), 16, 8, 8
    raise ValueError(f"unknown model {name!r}")


def batches(rank: int, count: int, d_in: int, d_out: int, batch: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(DATA_SEED + rank)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(count)]


def digest(params: Sequence[Any]) -> str:
    """A hash of the parameters' bytes, in order: equal hashes, bit-identical parameters."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


_PARTS = ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")


def _sums(data: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(recorded iterations, summed seconds of each part) from a DDP's logging data: its
    averages (ns) times the iterations they average over."""
    n = int(data.get("iteration", 0) or 0)
    return n, {k: float(data.get(k, 0) or 0) * n / 1e9 for k in _PARTS}


def _window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """Each part's mean (seconds) over the iterations recorded between two snapshots."""
    n0, s0 = _sums(before)
    n1, s1 = _sums(after)
    if n1 <= n0:
        return None
    return {k: (s1[k] - s0[k]) / (n1 - n0) for k in _PARTS}


class Trainer:
    """One row on this rank, kept between the coordinator's commands so that the rows can take
    turns: :meth:`setup` builds and wraps the model (``impl``: compute, aiodist, torch) and runs
    the warm-up; :meth:`steps` meets the other ranks (``sync``) and times some steps;
    :meth:`finish` gives the DDP's own figures and the parameters' hash."""

    def __init__(self, impl: str, model_name: str, rank: int, sync: Callable[[], Any]) -> None:
        self.impl, self.model_name, self.rank, self.sync = impl, model_name, rank, sync
        self.net: Any = None
        self.times: list[float] = []
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.upd: list[float] = []
        self.before: dict[str, Any] = {}

    async def setup(self, warmup: int, steps: int, lr: float) -> None:
        import torch

        self.model, d_in, d_out, batch = build(self.model_name)
        self.data = batches(self.rank, warmup + steps, d_in, d_out, batch)
        self.k = 0
        if self.impl == "aiodist":
            from aiodist.nn.parallel import DistributedDataParallel

            self.net = await DistributedDataParallel(self.model)
        elif self.impl == "torch":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
            self.net._set_ddp_runtime_logging_sample_rate(1)  # every step recorded (default: the first 10, then every 100th)
        else:
            self.net = self.model
            await self.sync()  # compute-only: every rank starts at once (a barrier, outside the timed steps)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr)
        self.loss_fn = torch.nn.MSELoss()
        await self._run(warmup, timed=False)
        self._flush()
        if self.impl != "compute":
            self.before = self.net._get_ddp_logging_data()

    def _flush(self) -> None:
        """torch's DDP records a step's figures at the next forward: an untimed forward (no
        backward follows; the parameters do not change) records the last step."""
        if self.impl == "torch":
            self.net(self.data[0][0])

    async def _run(self, count: int, timed: bool) -> None:
        clock = time.perf_counter
        net, opt, loss_fn = self.net, self.opt, self.loss_fn
        aiodist_backward = self.impl == "aiodist"
        for _ in range(count):
            x, y = self.data[self.k]
            self.k += 1
            t0 = clock()
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            t1 = clock()
            if aiodist_backward:
                await net.backward(loss)
            else:
                loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            if timed:
                self.times.append(t3 - t0)
                self.fwd.append(t1 - t0)
                self.bwd.append(t2 - t1)
                self.upd.append(t3 - t2)
            await asyncio.sleep(0)  # the loop runs between steps (untimed), as in a training loop that awaits

    async def steps(self, count: int) -> None:
        await self.sync()
        gc.collect()
        await self._run(count, timed=True)

    def finish(self) -> dict[str, Any]:
        ddp: dict[str, float] | None = None
        buckets = ""
        if self.impl != "compute":
            self._flush()
            after = self.net._get_ddp_logging_data()
            ddp = _window(self.before, after)
            buckets = str(after.get("bucket_sizes", ""))
        params = list(self.model.parameters())
        return {
            "times": self.times,
            "fwd": self.fwd,
            "bwd": self.bwd,
            "opt": self.upd,
            "ddp": ddp,
            "buckets": buckets,
            "digest": digest(params),
            "tensors": len(params),
            "numel": sum(p.numel() for p in params),
            "nbytes": sum(p.numel() * p.element_size() for p in params),
        }


async def _serve(plan: Plan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """One rank: make the group, then run the coordinator's commands, each answered with one
    message of the same kind: ("setup", impl, model, warmup, steps, lr), ("steps", impl, model,
    count), ("finish", impl, model) (a :class:`Trainer` each; impl "compute" trains the plain
    module, on the aiodist side's ranks) or ("stop",)."""
    close: Callable[[], Any]
    if plan.impl == "aiodist":
        import aiodist

        await aiodist.init_process_group(
            "gloo", init_method=f"tcp://{HOST}:{plan.port}", rank=rank, world_size=plan.nproc, timeout=plan.timeout
        )

        async def sync() -> None:
            await aiodist.barrier()

        close = aiodist.destroy_process_group
    elif plan.impl == "torch":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://{HOST}:{plan.port}", rank=rank, world_size=plan.nproc, timeout=timedelta(seconds=plan.timeout)
        )

        async def sync() -> None:
            dist.barrier()

        close = dist.destroy_process_group
    else:
        raise ValueError(f"unknown side {plan.impl!r}")

    trainers: dict[tuple[str, str], Trainer] = {}
    try:
        conn.send(("ready",))
        while True:
            cmd = await _next(conn)
            if cmd[0] == "stop":
                await sync()
                return
            key = (cmd[1], cmd[2])
            reply: Any = None
            if cmd[0] == "setup":
                trainers[key] = Trainer(cmd[1], cmd[2], rank, sync)
                await trainers[key].setup(*cmd[3:])
            elif cmd[0] == "steps":
                await trainers[key].steps(cmd[3])
            elif cmd[0] == "finish":
                reply = trainers.pop(key).finish()
                gc.collect()
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
            conn.send((cmd[0], reply))
    finally:
        res = close()
        if asyncio.iscoroutine(res):
            await res


def _prepare() -> None:
    """One torch thread; and torch's lazy imports done before any loop runs (the first
    ``optimizer.step()`` imports torch._dynamo: about 1.5 s, which would block the aiodist
    ranks' event loop in the first row)."""
    import torch

    torch.set_num_threads(1)
    import torch.nn.parallel  # noqa: F401

    import aiodist.nn.parallel  # noqa: F401

    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.zeros(1, 2)).sum().backward()
    opt.step()


def _rank_main(plan: Plan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """One rank process: serves the coordinator's commands; on failure sends ("error", traceback)."""

    def body() -> None:
        _prepare()
        run_loop(_serve(plan, rank, conn), fast=plan.impl == "aiodist")

    report_to_coordinator(conn, body)


# ----------------------------------------------------------------------------- coordinator


class DdpSide(Side):
    """The rank processes of one implementation (aiodist, torch) at one rank count."""

    rank_main = staticmethod(_rank_main)
    name = "bench-ddp"

    def command(self, kind: str, impl: str, model: str, *args: Any) -> list[Any]:
        """Send ("kind", impl, model, *args) to every rank; every rank's answer."""
        for c in self.conns:
            c.send((kind, impl, model, *args))
        return self._gather(kind, self.plan.timeout, f"{kind} of {ROWS[impl]}, {model} on {self.plan.nproc} ranks")


@dataclass
class Result:
    """One row: what every rank measured, reduced."""

    model: str
    ranks: int
    impl: str
    times: list[float]  # per timed step, the slowest rank's (seconds)
    fwd: float
    bwd: float
    opt: float
    ddp: dict[str, float] | None  # the DDP's own parts (seconds), the ranks' mean
    digest: str
    buckets: str
    tensors: int
    numel: int
    nbytes: int
    digests: list[str] = field(default_factory=list)  # every rank's

    @property
    def step(self) -> float:
        return statistics.median(self.times)


def reduce(model: str, ranks: int, impl: str, replies: list[dict[str, Any]]) -> Result:
    """The row from every rank's reply; a DDP row whose ranks ended with different parameters fails the run."""
    times = [max(ts) for ts in zip(*(r["times"] for r in replies))]

    def part(key: str) -> float:
        return statistics.median(statistics.fmean(v) for v in zip(*(r[key] for r in replies)))

    ddps = [r["ddp"] for r in replies if r["ddp"] is not None]
    ddp = {k: statistics.fmean(d[k] for d in ddps) for k in _PARTS} if ddps else None
    digests = [r["digest"] for r in replies]
    if impl != "compute" and len(set(digests)) > 1:
        raise BenchError(f"{ROWS[impl]}, {model}, {ranks} ranks: the ranks ended with different parameters ({digests})")
    first = replies[0]
    return Result(
        model,
        ranks,
        impl,
        times,
        part("fwd"),
        part("bwd"),
        part("opt"),
        ddp,
        digests[0],
        first["buckets"],
        first["tensors"],
        first["numel"],
        first["nbytes"],
        digests,
    )


Results = dict[tuple[str, int, str], Result]  # (model, ranks, impl) -> row


def chunks(steps: int, rounds: int) -> list[int]:
    """``steps`` split into ``rounds`` turns as evenly as possible (none empty)."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if c < steps % rounds else 0) for c in range(rounds)]


def run(args: argparse.Namespace) -> Results:
    """Every row. Per rank count, one set of processes per implementation (compute-only runs on
    the aiodist ones); per model, every row is set up (built, wrapped, warmed up), then the rows
    take turns at the timed steps, ``--rounds`` turns each, the order rotating from turn to
    turn, so that the machine's drift lands on all of them."""
    impls = ["compute", "aiodist", *(["torch"] if args.torch else [])]
    side_of = {"compute": "aiodist", "aiodist": "aiodist", "torch": "torch"}
    out: Results = {}
    for ri, n in enumerate(args.rank_list):
        sides = {s: DdpSide(Plan(s, n, _free_port(), args.timeout)) for s in dict.fromkeys(side_of[i] for i in impls)}
        try:
            for side in sides.values():
                side.start()
            for side in sides.values():
                side.wait_ready()
            for j, model in enumerate(args.model_list):
                for i in side_order(impls, j, ri):
                    sides[side_of[i]].command("setup", i, model, args.warmup, args.steps, args.lr)
                for c, count in enumerate(chunks(args.steps, args.rounds)):
                    for i in side_order(impls, j + c, ri):
                        if args.verbose:
                            print(f"  {n} ranks, {model}, turn {c + 1}: {ROWS[i]}, {count} steps", flush=True)
                        sides[side_of[i]].command("steps", i, model, count)
                for i in impls:
                    out[(model, n, i)] = reduce(model, n, i, sides[side_of[i]].command("finish", i, model))
            for side in sides.values():
                side.stop()
        finally:
            for side in sides.values():
                side.kill()
    return out


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f}"


def _buckets_mib(sizes: str) -> str:
    parts = [s.strip() for s in sizes.split(",") if s.strip()]
    return ", ".join(_mib(int(s)) for s in parts) + " MiB" if parts else "-"


def identical(results: Results, model: str, n: int) -> bool | None:
    """aiodist DDP's parameters after the run against torch DDP's (None: no torch row)."""
    a, t = results.get((model, n, "aiodist")), results.get((model, n, "torch"))
    if a is None or t is None:
        return None
    return a.digest == t.digest


def overheads(results: Results, model: str, n: int) -> dict[str, float | None]:
    base = results[(model, n, "compute")].step
    return {i: (results[(model, n, i)].step - base if (model, n, i) in results else None) for i in ("aiodist", "torch")}


def report(args: argparse.Namespace, results: Results) -> str:
    blocks = []
    for model in args.model_list:
        any_row = next(r for (m, _, _), r in results.items() if m == model)
        title = f"# {model}: {MODELS[model]}; {any_row.numel:,} parameters in {any_row.tensors} tensors ({_mib(any_row.nbytes)} MiB)"
        a = results.get((model, args.rank_list[0], "aiodist"))
        t = results.get((model, args.rank_list[0], "torch"))
        title += f"\n  buckets: aiodist {_buckets_mib(a.buckets) if a else '-'}; torch {_buckets_mib(t.buckets) if t else '-'}"
        headers = [
            "row",
            "ranks",
            "step(ms)",
            "overhead(ms)",
            "fwd(ms)",
            "bwd(ms)",
            "opt(ms)",
            "ddp fwd",
            "ddp bwd compute",
            "ddp bwd comm",
            "ddp overlap",
        ]
        rows = []
        for n in args.rank_list:
            over = overheads(results, model, n)
            for impl in ROWS:
                r = results.get((model, n, impl))
                if r is None:
                    continue
                d = r.ddp
                rows.append(
                    [
                        ROWS[impl],
                        str(n),
                        _ms(r.step),
                        _ms(over.get(impl)) if impl != "compute" else "-",
                        _ms(r.fwd),
                        _ms(r.bwd),
                        _ms(r.opt),
                        *([_ms(d[k]) for k in _PARTS] if d else ["-"] * 4),
                    ]
                )
        blocks.append(f"{title}\n{format_table(headers, rows)}")
    if args.torch:
        headers = [
            "model",
            "ranks",
            "compute(ms)",
            "aiodist(ms)",
            "torch(ms)",
            "step aiodist/torch",
            "overhead aiodist(ms)",
            "overhead torch(ms)",
            "overhead aiodist/torch",
            "params = torch's",
        ]
        rows = []
        for model in args.model_list:
            for n in args.rank_list:
                over = overheads(results, model, n)
                same = identical(results, model, n)
                rows.append(
                    [
                        model,
                        str(n),
                        _ms(results[(model, n, "compute")].step),
                        _ms(results[(model, n, "aiodist")].step),
                        _ms(results[(model, n, "torch")].step),
                        _ratio(results[(model, n, "aiodist")].step, results[(model, n, "torch")].step),
                        _ms(over["aiodist"]),
                        _ms(over["torch"]),
                        _ratio(over["aiodist"], over["torch"]),
                        "-" if same is None else "yes" if same else "no",
                    ]
                )
        blocks.append("# aiodist DDP against torch DDP (gloo)\n" + format_table(headers, rows))
    return "\n\n".join(blocks)


def to_json(args: argparse.Namespace, results: Results, info: dict[str, str]) -> dict[str, Any]:
    rows = []
    for (model, n, impl), r in results.items():
        over = overheads(results, model, n).get(impl) if impl != "compute" else None
        rows.append(
            {
                "model": model,
                "ranks": n,
                "row": ROWS[impl],
                "step_ms": r.step * 1e3,
                "overhead_ms": None if over is None else over * 1e3,
                "fwd_ms": r.fwd * 1e3,
                "bwd_ms": r.bwd * 1e3,
                "opt_ms": r.opt * 1e3,
                "ddp_ms": None if r.ddp is None else {k: v * 1e3 for k, v in r.ddp.items()},
                "steps_ms": [t * 1e3 for t in r.times],
                "buckets": r.buckets,
                "params_sha256": r.digest,
                "parameter_tensors": r.tensors,
                "parameters": r.numel,
            }
        )
    same = {f"{m}/{n}": identical(results, m, n) for m in args.model_list for n in args.rank_list}
    keep = ("models", "ranks", "steps", "warmup", "rounds", "lr", "compare", "timeout")
    return {"machine": info, "args": {k: getattr(args, k) for k in keep}, "rows": rows, "bit_identical": same}


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench ddp",
        description="A data-parallel training step: aiodist's DistributedDataParallel against torch's over gloo "
        "(--compare torch) and the compute-only baseline, in one run.",
    )
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default mlp,small)")
    p.add_argument("--ranks", type=_ints, default=None, help="comma-separated rank counts (default 2,4; --quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 20; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 3; --quick: 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="turns the timed steps are split into, the rows alternating between them (default 4; --quick: 1)",
    )
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--compare", default="", help="torch: also torch.distributed's DDP over gloo, with ratio columns")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a row (or the start, on top of 120) may take (default 120)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--quick", action="store_true", help="a short smoke run: 2 ranks, 1 warm-up and 3 timed steps (unless given)")
    p.add_argument("--verbose", action="store_true", help="print progress per row")
    args = p.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        p.error("the ddp benchmark trains torch modules: torch is not installed")
    wanted = [c.strip() for c in args.compare.split(",") if c.strip()]
    if any(c != "torch" for c in wanted):
        p.error(f"--compare: unknown {[c for c in wanted if c != 'torch']}; the ddp benchmark compares with torch only")
    args.torch = "torch" in wanted
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.model_list if m not in MODELS]
    if bad or not args.model_list:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    if args.ranks is None:
        args.ranks = [2] if args.quick else [2, 4]
    if args.steps is None:
        args.steps = 3 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 4
    args.rank_list = list(dict.fromkeys(args.ranks))
    if not args.rank_list or min(args.rank_list) < 2:
        p.error("--ranks: every rank count must be at least 2")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.timeout <= 0 or args.lr <= 0:
        p.error("need --steps >= 1, --warmup >= 0, --rounds >= 1, --timeout > 0, --lr > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    print(
        f"ddp: ranks {','.join(map(str, args.rank_list))}; models {', '.join(args.model_list)}; SGD lr {args.lr:g}; "
        f"{args.warmup} warm-up + {args.steps} timed steps in {len(chunks(args.steps, args.rounds))} turn(s); one torch thread per rank; "
        "step = median over timed steps of the slowest rank's time",
        flush=True,
    )
    try:
        results = run(args)
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    print()
    print(report(args, results))
    failed = []
    print()
    if args.torch:
        for model in args.model_list:
            if 2 in args.rank_list:
                same = identical(results, model, 2)
                print(
                    f"bit-identical: {'yes' if same else 'no'} ({model}, 2 ranks: aiodist DDP's parameters after "
                    f"{args.warmup + args.steps} steps against torch DDP's, same seeds and data)"
                )
                if not same:
                    failed.append(model)
    else:
        print("bit-identical: not checked (needs --compare torch)")
    notes = [
        "compute-only: the same loop with no communication (plain module, loss.backward()), every rank at once",
        "aiodist DDP: aiodist.nn.parallel.DistributedDataParallel over an aiodist 'gloo' group, on uvloop, await ddp.backward(loss)",
        "overhead = step - compute-only step; fwd/bwd/opt: the loop's own timing (bwd includes waiting for the gradients' all-reduces)",
        "ddp fwd/bwd compute/bwd comm/overlap (ms): the DDP's _get_ddp_logging_data() over the timed steps, mean over ranks "
        "(comm: first bucket issued to last bucket reduced; overlap: the part of it before backward's compute returned)",
        where_backward_runs(args.rank_list),
    ]
    if args.torch:
        notes.append("torch DDP: torch.nn.parallel.DistributedDataParallel over torch.distributed gloo (runtime-logging sample rate 1)")
        notes.append("aiodist/torch = ratio (below 1: aiodist faster); every ratio is from this one run")
        if any(n != 2 for n in args.rank_list):
            notes.append("params = torch's: required at 2 ranks; at more ranks each backend adds the ranks' buckets in its own order")
    print("\n" + "\n".join(notes) + f"\nwall time {time.monotonic() - started:.1f} s", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(to_json(args, results, info), indent=1) + "\n")
        print(f"results written to {args.json}")
    if failed:
        print(f"\nBENCHMARK FAILED: aiodist DDP's parameters differ from torch DDP's at 2 ranks ({', '.join(failed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
