"""A rank for tests/faults/test_chaos.py: a differential fuzz of collectives that loses a rank.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... TORCHELASTIC_USE_AGENT_STORE=True \\
        python tests/helpers/chaos_rank.py SEED VICTIM HOW AT TIMEOUT OPS_AFTER

Every rank draws the same plan from SEED: ops (all_reduce SUM/MAX, broadcast, reduce, all_gather,
reduce_scatter, all_to_all_single, gather, scatter, barrier) with sizes from 1 to 150,000 float32
(and ``CHAOS_MORE_SIZES``),
on the default group or a group of every rank (in order, reversed, or evens then odds), a third of them left in flight
(``async_op=True``, up to 3 at once) and waited later. Each rank's input is drawn from (SEED, op,
rank) as small integers, so every rank computes every op's exact expected result itself and
compares (a differential check: a wrong element is a wrong result).

Rank VICTIM stops itself before op AT: HOW is ``kill`` (SIGKILL) or ``stop`` (SIGSTOP; the test
kills it at the end). It prints ``DYING <time.time()>`` first. Every survivor's first DistError
is printed as ``ERROR <time.time()> <sorted culprits> <message on one line>``; it then shrinks
the default group by those culprits (``SHRINK_ABORT``), runs OPS_AFTER more ops of a new plan
on the survivors (renumbered) with the same checks, and prints ``DONE rank R of N wrong W ops O``
(W: wrong results over both phases, O: ops checked) and exits 0. The store is the test's own
(TORCHELASTIC_USE_AGENT_STORE), as a launcher's agent serves it: any rank may be the victim.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

OPS = ["all_reduce", "all_reduce_max", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "barrier"]
SIZES = [1, 3, 64, 1000, 4096, 16384, 65536, 150_000]  # (150,000: 600 KB, the lane's mid sizes)
#: more sizes (float32 counts, comma-separated), drawn as often as the others: a pair's lane
#: (up to 4 MiB) and its pieces past it, where the survivors are 2
SIZES += [int(x) for x in os.environ.get("CHAOS_MORE_SIZES", "").split(",") if x]


def groups_for(world: int) -> list[list[int]]:
    """The groups every rank makes, in order: every rank, every rank in reverse order (group
    rank 0 is the last global rank), and the even ranks then the odd ones (across hosts with
    ranks contiguous by host: a layout interleaved by host). Each has every rank: a survivor
    never waits in a group that lacks the victim for a peer that has already left to shrink."""
    return [list(range(world)), list(range(world - 1, -1, -1)), list(range(0, world, 2)) + list(range(1, world, 2))]


def plan(seed: int, world: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        g = rng.randrange(4)  # 0: the default group; 1..3: groups_for(world)
        members = list(range(world)) if g == 0 else groups_for(world)[g - 1]
        size = rng.choice(SIZES)
        out.append(
            {
                "i": i,
                "op": rng.choice(OPS),
                "group": g,
                "members": members,
                "n": size,
                "root": rng.randrange(len(members)),
                "async": rng.random() < 0.33,
            }
        )
    return out


def data(seed: int, i: int, rank: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, i, rank]).integers(-8, 8, n).astype(np.float32)


class Fuzz:
    def __init__(self, seed: int, handles: list[Any]) -> None:
        self.seed = seed
        self.handles = handles  # group index -> the group (None: the default group)
        self.wrong = 0
        self.checked = 0
        self.inflight: list[tuple[Any, Any]] = []

    def check(self, got: Any, want: Any, what: str) -> None:
        self.checked += 1
        if not all(np.array_equal(g, w) for g, w in zip(got, want)):
            self.wrong += 1
            print(f"WRONG {what}", flush=True)

    async def settle(self, keep: int = 0) -> None:
        while len(self.inflight) > keep:
            work, verify = self.inflight.pop(0)
            await work.wait()
            verify()

    async def run(self, step: dict[str, Any]) -> None:
        me, members = dist.get_rank(), step["members"]
        if me not in members:
            return
        i, n, op, seed = step["i"], step["n"], step["op"], self.seed
        group = self.handles[step["group"]]
        k = len(members)
        gme = members.index(me)
        root = members[step["root"]]
        ins = {r: data(seed, i, r, n) for r in members}
        x = ins[me].copy()
        asy = step["async"]
        what = f"op {i} {op} n={n} group {members} root {root}"
        work: Any
        verify: Any
        if op in ("all_reduce", "all_reduce_max"):
            red = dist.ReduceOp.SUM if op == "all_reduce" else dist.ReduceOp.MAX
            want = sum(ins.values()) if op == "all_reduce" else np.maximum.reduce(list(ins.values()))
            work = await dist.all_reduce(x, red, group=group, async_op=asy)
            verify = lambda: self.check([x], [want], what)  # noqa: E731
        elif op == "broadcast":
            work = await dist.broadcast(x, src=root, group=group, async_op=asy)
            verify = lambda: self.check([x], [ins[root]], what)  # noqa: E731
        elif op == "reduce":
            work = await dist.reduce(x, dst=root, group=group, async_op=asy)
            verify = (lambda: self.check([x], [sum(ins.values())], what)) if me == root else (lambda: None)
        elif op == "all_gather":
            out = np.empty(n * k, np.float32)
            work = await dist.all_gather_into_tensor(out, x, group=group, async_op=asy)
            verify = lambda: self.check([out], [np.concatenate([ins[r] for r in members])], what)  # noqa: E731
        elif op == "reduce_scatter":
            big = {r: data(seed, i, r, n * k) for r in members}
            out = np.empty(n, np.float32)
            work = await dist.reduce_scatter_tensor(out, big[me].copy(), group=group, async_op=asy)
            verify = lambda: self.check([out], [sum(big.values())[gme * n : (gme + 1) * n]], what)  # noqa: E731
        elif op == "all_to_all":
            big = {r: data(seed, i, r, n * k) for r in members}
            out = np.empty(n * k, np.float32)
            work = await dist.all_to_all_single(out, big[me].copy(), group=group, async_op=asy)
            verify = lambda: self.check([out], [np.concatenate([big[r][gme * n : (gme + 1) * n] for r in members])], what)  # noqa: E731
        elif op == "gather":
            outs = [np.empty(n, np.float32) for _ in members] if me == root else None
            work = await dist.gather(x, outs, dst=root, group=group, async_op=asy)
            verify = (lambda: self.check(outs, [ins[r] for r in members], what)) if outs is not None else (lambda: None)
        elif op == "scatter":
            parts = [data(seed, i, 1000 + r, n) for r in members]
            out = np.empty(n, np.float32)
            work = await dist.scatter(out, parts if me == root else None, src=root, group=group, async_op=asy)
            verify = lambda: self.check([out], [parts[gme]], what)  # noqa: E731
        else:
            work = await dist.barrier(group=group, async_op=asy)
            verify = lambda: None  # noqa: E731
        if asy:
            self.inflight.append((work, verify))
            await self.settle(keep=3)
        else:
            verify()


async def make_groups(world: int) -> list[Any]:
    handles: list[Any] = [None]
    for ranks in groups_for(world):
        handles.append(await dist.new_group(ranks, sort_ranks=False))
    return handles


async def main(seed: int, victim: int, how: str, at: int, timeout: float, ops_after: int) -> None:
    await dist.init_process_group("gloo", timeout=timeout)
    me, world = dist.get_rank(), dist.get_world_size()
    fuzz = Fuzz(seed, await make_groups(world))
    await dist.barrier()
    print("running", flush=True)
    wrong = checked = 0
    try:
        for step in plan(seed, world, at + 200):
            if me == victim and step["i"] == at:
                print(f"DYING {time.time()!r}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                await asyncio.sleep(3600)  # (SIGSTOP: never resumed; the test kills it)
            await fuzz.run(step)
        await fuzz.settle()
        raise SystemExit(f"rank {me}: no error by op {at + 200}, though rank {victim} stopped at op {at}")
    except dist.DistError as exc:
        t = time.time()
        culprits = sorted(exc.culprits)
        print(f"ERROR {t!r} {culprits} {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
    wrong, checked = fuzz.wrong, fuzz.checked
    for work, _ in fuzz.inflight:  # the broken group's other ops: failed (or done) too, not waited
        work.exception() if work.done() else None
    await dist.shrink_group(culprits, shrink_flags=dist.SHRINK_ABORT)
    me, world = dist.get_rank(), dist.get_world_size()
    fuzz = Fuzz(seed + 1, await make_groups(world))
    for step in plan(seed + 1, world, ops_after):
        await fuzz.run(step)
    await fuzz.settle()
    print(f"DONE rank {me} of {world} wrong {wrong + fuzz.wrong} ops {checked + fuzz.checked}", flush=True)
    await dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(int(a[0]), int(a[1]), a[2], int(a[3]), float(a[4]), int(a[5])))
