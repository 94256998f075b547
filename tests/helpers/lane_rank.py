"""A rank for tests/test_shm_lane.py: one scenario of the shared-memory latency lane
(aiodist.shm._lane) per run.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... AIODIST_SHM_BYTES=2M \\
        python tests/helpers/lane_rank.py SCENARIO [ARGS...]

env:// groups. Each scenario prints one JSON line on stdout at its end (``killed``: text lines):

``same``
    Small all_reduces of many dtypes and ops, broadcasts from every root, all_gathers (even and
    uneven), a big op between small ones and 7 all_reduces in flight, on the default group and
    on a group without the lane (``lane_max`` 0); prints ``{"same": {case: both agree},
    "digests": {case: sha256 of the default group's result}, "shm": the backend's shm stats}``.
``stress OPS``
    OPS 16-byte all_reduces, some ranks arriving late at random; prints ``{"ok": how many
    results were right, "shm": stats}``.
``desync A B``
    One all_reduce, then rank 0 all_reduces A float32 and the others B (a desync at seq 1);
    prints ``{"msg": the error ("<class>: <text>") or "no error", "s": seconds it took}`` and
    exits without teardown.
``missing DONE``
    Group timeout 1.5 s. After one all_reduce rank 1 never issues the next one: it waits until
    the file DONE exists (rank 0 makes it once its own all_reduce has failed), at most 30 s, and
    prints ``{"msg": "slept"}``; rank 0 prints ``{"msg": its error or "no error"}``.
``eager OP``
    200 all_reduces, then 2,000 small ops (OP: all_reduce, all_to_all_single or
    reduce_scatter_tensor) back to back with a ticker task on the loop; prints ``{"eager": ops
    that ended in their issuing call, "ticks": the ticker's turns, "s": seconds, "got": the
    result}``.
``mid``
    The lane's mid sizes (256 KiB to 1 MiB a rank: all_reduce, also folded by slices, broadcast from every root,
    reduce, all_gather_into_tensor also in place, the uneven all_gather list, reduce_scatter)
    on the default group and on a subgroup of ranks 0 and n - 1, each against the same call on
    a group of the same ranks without the lane (``lane_max`` 0: the halves, single copy or the
    socket); integer-valued floats, so every order of folding gives the same bits. Prints
    ``{"same": {case: both agree and the result is the expected one}, "lane_ops": lane ops
    this rank took}``.
``killed COUNT``
    One all_reduce, then ``running``; rank 1 sleeps (the test SIGKILLs it) while rank 0 waits in
    the next all_reduce (of COUNT float32) and prints ``ERROR <time.time()!r> <class>: <message>`` (or ``no
    error``); exits without teardown.
``barrier``
    Three barriers, rank i the last to enter barrier i (0.4 s late); prints ``{"t": the times
    each barrier was entered and left, "shm": stats}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

N_OPS = 2000  # eager: ops back to back


async def same_as_socket() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, n = dist.get_rank(), dist.get_world_size()
    # this group has no lane, and its big ops take the socket too
    no_shm = {"lane_max": 0, "allreduce_shm_min": -1, "broadcast_shm_min": -1, "reduce_scatter_cma_min": -1}
    sock = await dist.new_group(list(range(n)), pg_options=no_shm)
    rng = np.random.default_rng(7 + rank)
    same, digests = {}, {}

    async def bcast_both(name: str, count: int) -> None:
        for root in range(n):
            a = rng.standard_normal(count).astype(np.float32) if rank == root else np.zeros(count, np.float32)
            b = a.copy()
            await dist.broadcast(a, src=root)
            await dist.broadcast(b, src=root, group=sock)
            same[f"{name}_{root}"] = bool(np.array_equal(a, b)) and bool(a.any())
            digests[f"{name}_{root}"] = hashlib.sha256(a.tobytes()).hexdigest()

    async def rs_both(name: str, k: int) -> None:
        x = rng.integers(-1000, 1000, k * n).astype(np.float32)
        oa, ob = np.empty(k, np.float32), np.empty(k, np.float32)
        await dist.reduce_scatter_tensor(oa, x)
        await dist.reduce_scatter_tensor(ob, x, group=sock)
        y = x.copy()
        await dist.reduce_scatter_tensor(y[rank * k : (rank + 1) * k], y)  # in place: the output is this rank's part of the input
        same[name] = bool(np.array_equal(oa, ob)) and bool(np.array_equal(y[rank * k : (rank + 1) * k], ob))

    async def both(name: str, data: np.ndarray, op: dist.ReduceOp = dist.ReduceOp.SUM, exact: bool = True) -> None:
        a, b = data.copy(), data.copy()
        await dist.all_reduce(a, op=op)
        await dist.all_reduce(b, op=op, group=sock)
        # random floats: the lane adds in rank order, the socket schedule in its own order
        same[name] = bool(np.array_equal(a, b) if exact else np.allclose(a, b, rtol=1e-5))
        digests[name] = hashlib.sha256(a.tobytes()).hexdigest()

    for count in (1, 3, 255, 4096, 60_000):  # 60,000 float32: 240 KB, near the lane's 256 KiB
        await both(f"f32_{count}", rng.standard_normal(count).astype(np.float32), exact=False)
        await both(f"f32_int_{count}", rng.integers(-1000, 1000, count).astype(np.float32))
    await both("f64_avg", rng.integers(-1000, 1000, 100).astype(np.float64) * n, op=dist.ReduceOp.AVG)
    await both("f32_premul", rng.integers(-100, 100, 10).astype(np.float32), op=dist.ReduceOp.PREMUL_SUM(2.0))
    await both("i64_max", rng.integers(-(10**9), 10**9, 33), op=dist.ReduceOp.MAX)
    await both("u8_bor", rng.integers(0, 256, 17).astype(np.uint8), op=dist.ReduceOp.BOR)
    await both("c64", (rng.integers(-9, 9, 5) + 1j).astype(np.complex64))
    # broadcast and all_gather: every rank gets the same bytes as through the socket
    await bcast_both("bcast", 9)
    part = np.arange(1000, dtype=np.int32) + 1000 * rank
    oa, ob = np.zeros(1000 * n, np.int32), np.zeros(1000 * n, np.int32)
    await dist.all_gather_into_tensor(oa, part)
    await dist.all_gather_into_tensor(ob, part, group=sock)
    same["agt"] = bool(np.array_equal(oa, ob)) and bool(np.array_equal(oa, np.arange(1000 * n)))
    sizes = [3 + 5 * r for r in range(n)]  # uneven parts
    mine = np.full(sizes[rank], rank + 0.5)
    la, lb = [np.zeros(k) for k in sizes], [np.zeros(k) for k in sizes]
    await dist.all_gather(la, mine)
    await dist.all_gather(lb, mine, group=sock)
    same["ag_uneven"] = all(np.array_equal(x, y) and np.all(x == r + 0.5) for r, (x, y) in enumerate(zip(la, lb)))
    # a big (shared-memory halves) op between small ones, and small ones in flight together
    big = np.ones(1 << 19, np.float32)
    await dist.all_reduce(big)
    same["big"] = bool(np.all(big == n))
    xs = [np.full(8, rank * 10 + i, np.int64) for i in range(7)]
    works = [await dist.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        await w.wait()
    want = [sum(r * 10 + i for r in range(n)) for i in range(7)]
    same["in_flight"] = all(bool(np.all(x == w)) for x, w in zip(xs, want))
    # up to 4 MiB: a pair's lane (its slots hold 4 MiB), elsewhere single copy; odd lengths
    m = (4 << 20) // 4 - 3
    await both("pair_4m", rng.integers(-1000, 1000, m).astype(np.float32))
    await bcast_both("pair_bcast", 786_433)
    await rs_both("pair_rs", (4 << 20) // 4 // n - 1)
    # past 4 MiB: a pair's lane in pieces, elsewhere single copy
    m = 2_500_001
    await both("pieces_10m", rng.integers(-1000, 1000, m).astype(np.float32))
    await bcast_both("pieces_bcast", m)
    await rs_both("pieces_rs", m)
    stats = dist.group.WORLD.backend.stats()["shm"]
    await dist.destroy_process_group()
    print(json.dumps({"same": same, "digests": digests, "shm": stats}))


async def stress(ops: int) -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, n = dist.get_rank(), dist.get_world_size()
    rnd = random.Random(rank)
    x = np.zeros(2, np.int64)
    total = 0
    for i in range(ops):
        if rnd.random() < 0.3:
            await asyncio.sleep(rnd.random() * 0.002)  # arrive at random times: some waits sleep
        x[:] = (i, rank)
        await dist.all_reduce(x)
        total += int(x[0] == i * n and x[1] == n * (n - 1) // 2)
    stats = dist.group.WORLD.backend.stats()["shm"]
    await dist.destroy_process_group()
    print(json.dumps({"ok": total, "shm": stats}))


async def desync(a: int, b: int) -> None:
    await dist.init_process_group("gloo", timeout=20)
    rank = dist.get_rank()
    await dist.all_reduce(np.ones(4, np.float32))  # the group's lane is agreed
    t0 = time.monotonic()
    try:
        await dist.all_reduce(np.ones(a if rank == 0 else b, np.float32))
        msg = "no error"
    except dist.DistError as exc:
        msg = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"msg": msg, "s": time.monotonic() - t0}))
    os._exit(0)


async def missing(done: str) -> None:
    await dist.init_process_group("gloo", timeout=1.5)
    rank = dist.get_rank()
    await dist.all_reduce(np.ones(4, np.float32))
    if rank == 1:
        # never issues seq 1 while rank 0 waits (its timeout and diagnosis): until rank 0 is done
        end = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < end:  # noqa: ASYNC110 - another process makes the file
            await asyncio.sleep(0.05)
        print(json.dumps({"msg": "slept"}))
        os._exit(0)
    try:
        await dist.all_reduce(np.ones(4, np.float32))
        msg = "no error"
    except dist.DistError as exc:
        msg = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"msg": msg}))
    open(done, "w").close()
    os._exit(0)


async def eager(op: str) -> None:
    await dist.init_process_group("gloo", timeout=30)
    x = np.ones(1, np.float32)
    for _ in range(200):
        await dist.all_reduce(x)
    assert x[0] == 2.0**200
    x = np.full(1, dist.get_rank() + 1.0, np.float32)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    pg = dist.group.WORLD
    two = np.full(2, dist.get_rank() + 1.0, np.float32)
    out = np.empty(2, np.float32)
    before, ticks = pg.stats()["eager"], 0
    start = time.monotonic()
    for _ in range(N_OPS):
        if op == "all_reduce":
            await dist.all_reduce(x, op=dist.ReduceOp.MAX)
        elif op == "all_to_all_single":
            await dist.all_to_all_single(out, two)  # out = [1, 2]
        else:
            await dist.reduce_scatter_tensor(out[:1], two)  # out[0] = 1 + 2
    took = time.monotonic() - start
    t.cancel()
    got = float(x[0]) if op == "all_reduce" else float(out.sum()) if op == "all_to_all_single" else float(out[0])
    print(json.dumps({"eager": pg.stats()["eager"] - before, "ticks": ticks, "s": took, "got": got}))
    await dist.destroy_process_group()


async def mid() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank, n = dist.get_rank(), dist.get_world_size()
    pairs = [(dist.group.WORLD, await dist.new_group(list(range(n)), pg_options={"lane_max": 0}))]
    sub, sub_off = await dist.new_group([0, n - 1]), await dist.new_group([0, n - 1], pg_options={"lane_max": 0})
    if rank in (0, n - 1):
        pairs.append((sub, sub_off))
    same: dict[str, bool] = {}
    before = dist.group.WORLD.backend.stats()["shm"]["lane_ops"]

    def ints(count: int, salt: int) -> np.ndarray:
        return np.random.default_rng(1000 * salt + count).integers(-1000, 1000, count).astype(np.float32)

    for k, (lane, off) in enumerate(pairs):
        g_rank, g_n = dist.get_group_rank(lane, rank), dist.get_world_size(lane)
        # 400 KB; 1 MiB, a wide group's slot (folded by slices); odd slices; 4 MB, within a pair's slot
        for count in (100_000, 262_144, 70_001, 1_000_003):
            mine = [ints(count, q) for q in range(g_n)]
            for name, group in (("lane", lane), ("off", off)):
                x = mine[g_rank].copy()
                await dist.all_reduce(x, group=group)
                same[f"{k}_all_reduce_{count}_{name}"] = bool(np.array_equal(x, np.sum(mine, axis=0)))
        for root, count in itertools.product(range(g_n), (250_000, 1_048_575)):  # 1 MB: a wide group's slot; 4 MB, a pair's
            want = ints(count, 7 + root)
            for name, group in (("lane", lane), ("off", off)):
                b = want.copy() if g_rank == root else np.zeros(count, np.float32)
                await dist.broadcast(b, group_src=root, group=group)
                same[f"{k}_broadcast_{root}_{count}_{name}"] = bool(np.array_equal(b, want))
        parts = [ints(250_000, 20 + q) for q in range(g_n)]
        for name, group in (("lane", lane), ("off", off)):
            r = parts[g_rank].copy()
            await dist.reduce(r, group_dst=g_n - 1, group=group)
            same[f"{k}_reduce_{name}"] = g_rank != g_n - 1 or bool(np.array_equal(r, np.sum(parts, axis=0)))
        for c, (each, base) in enumerate(((200_000, 100_000), (500_001, 400_000))):  # 800 KB a rank; 2 MB (a pair's lane: 4 MB in all)
            pieces = [ints(each, 30 + q) for q in range(g_n)]
            for name, group in (("lane", lane), ("off", off)):
                out = np.zeros(each * g_n, np.float32)
                await dist.all_gather_into_tensor(out, pieces[g_rank], group=group)
                same[f"{k}_all_gather_{c}_{name}"] = bool(np.array_equal(out, np.concatenate(pieces)))
                out = np.zeros(each * g_n, np.float32)
                out[each * g_rank : each * (g_rank + 1)] = pieces[g_rank]
                await dist.all_gather_into_tensor(out, out[each * g_rank : each * (g_rank + 1)], group=group)  # in place
                same[f"{k}_all_gather_in_place_{c}_{name}"] = bool(np.array_equal(out, np.concatenate(pieces)))
                uneven = [np.zeros(base + 50_000 * q, np.float32) for q in range(g_n)]
                await dist.all_gather(uneven, ints(base + 50_000 * g_rank, 40 + g_rank), group=group)
                same[f"{k}_all_gather_uneven_{c}_{name}"] = all(
                    np.array_equal(u, ints(base + 50_000 * q, 40 + q)) for q, u in enumerate(uneven)
                )
        for m in (80_000, 500_001):  # up to 960 KB of input; 4 MB at 2 ranks (a pair's lane)
            inputs = [ints(m * g_n, 50 + q) for q in range(g_n)]
            for name, group in (("lane", lane), ("off", off)):
                o = np.zeros(m, np.float32)
                await dist.reduce_scatter_tensor(o, inputs[g_rank], group=group)
                same[f"{k}_reduce_scatter_{m}_{name}"] = bool(np.array_equal(o, np.sum(inputs, axis=0)[m * g_rank : m * (g_rank + 1)]))
    lane_ops = dist.group.WORLD.backend.stats()["shm"]["lane_ops"] - before
    await dist.destroy_process_group()
    print(json.dumps({"same": same, "lane_ops": lane_ops}))


async def killed(count: int, op: str) -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank = dist.get_rank()
    await dist.all_reduce(np.ones(4, np.float32))
    print("running", flush=True)
    if rank == 1:
        await asyncio.sleep(60)  # killed here, while rank 0 waits in the lane
    try:
        if op == "all_gather":
            await dist.all_gather_into_tensor(np.empty(2 * count, np.float32), np.ones(count, np.float32))
        else:
            await dist.all_reduce(np.ones(count, np.float32))
        print("no error", flush=True)
    except dist.DistError as exc:
        print(f"ERROR {time.time()!r} {type(exc).__name__}: {exc}", flush=True)
    os._exit(0)


async def barrier() -> None:
    await dist.init_process_group("gloo", timeout=30)
    rank = dist.get_rank()
    await dist.barrier()
    entered = []
    for i in range(3):
        if i == rank:
            await asyncio.sleep(0.4)  # the last to enter barrier i
        entered.append(time.time())
        await dist.barrier()
        entered.append(time.time())
    stats = dist.group.WORLD.backend.stats()["shm"]
    await dist.destroy_process_group()
    print(json.dumps({"t": entered, "shm": stats}))


# each scenario with how its arguments are read from argv
SCENARIOS: dict[str, tuple[Callable[..., Awaitable[None]], tuple[type, ...]]] = {
    "same": (same_as_socket, ()),
    "stress": (stress, (int,)),
    "desync": (desync, (int, int)),
    "missing": (missing, (str,)),
    "eager": (eager, (str,)),
    "mid": (mid, ()),
    "killed": (killed, (int, str)),
    "barrier": (barrier, ()),
}


if __name__ == "__main__":
    fn, types = SCENARIOS[sys.argv[1]]
    if len(sys.argv) - 2 != len(types):
        raise SystemExit(f"{sys.argv[1]} takes {len(types)} arguments, not {len(sys.argv) - 2}")
    asyncio.run(fn(*(t(a) for t, a in zip(types, sys.argv[2:]))))
