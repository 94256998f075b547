"""A rank for tests/test_shm.py: every collective with a shared-memory or single-copy path, run
twice, on the default group (its path rules from argv) and on a socket-only group, and the
results compared.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... AIODIST_SHM_BYTES=1M \\
        python tests/helpers/shm_compare_rank.py RULES_JSON

RULES_JSON is the default group's ``pg_options`` (path rules, a JSON object); the second group
has the same rules with every shared-memory and single-copy path off. The ops: all_reduce of
many dtypes and ops (odd sizes, fewer elements than ranks, empty), all_gather_into_tensor,
all_gather with uneven parts, broadcast and reduce from every root, reduce_scatter_tensor,
all_to_all_single with uneven splits, gather and scatter. Prints one JSON line::

    {"digests": {case: sha256 of the default group's all_reduce result},
     "same": {case: whether both groups gave the same result},
     "shm": the backend's shm stats, "during": (maps, fds) of aiodist-shm memfds before destroy,
     "after": the same after destroy, "logs": the aiodist log messages (INFO and up)}
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402
from memfds import memfds  # noqa: E402  (tests/helpers: this script's own folder)

import aiodist as dist  # noqa: E402

logs: list[str] = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logs.append(record.getMessage())


async def main() -> None:
    logging.getLogger("aiodist").addHandler(Keep())
    logging.getLogger("aiodist").setLevel(logging.INFO)
    rules = json.loads(sys.argv[1])  # the default group's path rules
    await dist.init_process_group("gloo", timeout=30, pg_options=rules)
    rank, n = dist.get_rank(), dist.get_world_size()
    # the same rules with every shared-memory path off: this group is socket-only
    off = dict(
        allreduce_shm_min=-1,
        allgather_shm_min=-1,
        lane_max=0,
        broadcast_shm_min=-1,
        reduce_cma_min=-1,
        reduce_scatter_cma_min=-1,
        alltoall_cma=-1,
        gather_cma_min=-1,
        scatter_cma_min=-1,
    )
    sock = await dist.new_group(list(range(n)), pg_options={**rules, **off})
    rng = np.random.default_rng(1234 + rank)
    digests, same = {}, {}

    async def both(name: str, make: Callable[[], np.ndarray], op: dist.ReduceOp = dist.ReduceOp.SUM, exact: bool = True) -> None:
        a, b = make(), make()
        await dist.all_reduce(a, op=op)
        await dist.all_reduce(b, op=op, group=sock)
        digests[name] = hashlib.sha256(a.tobytes()).hexdigest()
        same[name] = bool(np.array_equal(a, b, equal_nan=True)) if exact else True

    big = 1_000_003  # odd: uneven slices and rounds (4 MB of float32 = 8 rounds of 512 KiB)
    await both("f32_random", lambda: rng.standard_normal(big).astype(np.float32), exact=False)
    r2 = np.random.default_rng(99 + rank)
    ints = r2.integers(-1000, 1000, 300_001)
    await both("f32_intvalued", lambda: ints.astype(np.float32))
    await both("f64_avg_intvalued", lambda: ints.astype(np.float64) * n, op=dist.ReduceOp.AVG)
    await both("i64_sum", lambda: ints.astype(np.int64))
    await both("i32_max", lambda: ints.astype(np.int32), op=dist.ReduceOp.MAX)
    await both("i16_min", lambda: ints.astype(np.int16), op=dist.ReduceOp.MIN)
    await both("u8_band", lambda: (ints % 256).astype(np.uint8), op=dist.ReduceOp.BAND)
    await both("c64_sum", lambda: (ints + 1j * ints[::-1]).astype(np.complex64))
    await both("f32_small", lambda: np.full(3, rank + 0.5, np.float32))  # fewer elements than ranks' slices
    await both("f32_empty", lambda: np.empty(0, np.float32))

    inp = np.arange(250_007, dtype=np.int32) * (rank + 1)
    out_s, out_k = np.empty(inp.size * n, np.int32), np.empty(inp.size * n, np.int32)
    await dist.all_gather_into_tensor(out_s, inp)
    await dist.all_gather_into_tensor(out_k, inp, group=sock)
    same["all_gather_into_tensor"] = bool(np.array_equal(out_s, out_k))
    sizes = [100_000 + 77_777 * r for r in range(n)]  # uneven parts
    mine = np.full(sizes[rank], rank - 0.25, np.float64)
    lst_s = [np.empty(s, np.float64) for s in sizes]
    lst_k = [np.empty(s, np.float64) for s in sizes]
    await dist.all_gather(lst_s, mine)
    await dist.all_gather(lst_k, mine, group=sock)
    same["all_gather_uneven"] = all(np.array_equal(x, y) for x, y in zip(lst_s, lst_k))
    same["all_gather_values"] = all(np.all(x == r - 0.25) for r, x in enumerate(lst_s))

    ok = True
    for root in range(n):  # big broadcasts: single-copy reads of the root's tensor
        a = np.arange(300_007, dtype=np.float32) * (root + 1) if rank == root else np.zeros(300_007, np.float32)
        b = a.copy()
        await dist.broadcast(a, src=root)
        await dist.broadcast(b, src=root, group=sock)
        ok = ok and bool(np.array_equal(a, b)) and bool(np.array_equal(a, np.arange(300_007, dtype=np.float32) * (root + 1)))
    same["broadcast"] = ok
    ok = True
    for root in range(n):  # reduces: single-copy reads of the peers' slices, the others' tensors left alone
        a = ints.astype(np.float32) * (rank + 1)  # integer values: exact in either order
        b, keep = a.copy(), a.copy()
        await dist.reduce(a, dst=root)
        await dist.reduce(b, dst=root, group=sock)
        ok = ok and bool(np.array_equal(a, b)) and (rank == root or bool(np.array_equal(a, keep)))
    same["reduce"] = ok
    a = np.concatenate([ints[:250_000]] * n).astype(np.float32) * (rank + 1)  # integer values: exact in any order
    o_s, o_k = np.empty(250_000, np.float32), np.empty(250_000, np.float32)
    await dist.reduce_scatter_tensor(o_s, a)
    await dist.reduce_scatter_tensor(o_k, a, group=sock)
    same["reduce_scatter_tensor"] = bool(np.array_equal(o_s, o_k))
    splits = [1000 * (rank + 1) + 7 * q for q in range(n)]  # uneven: what this rank sends each
    got = [1000 * (q + 1) + 7 * rank for q in range(n)]
    x = r2.standard_normal(sum(splits))
    t_s, t_k = np.empty(sum(got)), np.empty(sum(got))
    await dist.all_to_all_single(t_s, x, output_split_sizes=got, input_split_sizes=splits)
    await dist.all_to_all_single(t_k, x, output_split_sizes=got, input_split_sizes=splits, group=sock)
    same["all_to_all_single"] = bool(np.array_equal(t_s, t_k))
    g_s = [np.empty(1000 * (q + 1) + 7 * q) for q in range(n)] if rank == 0 else None
    g_k = [np.empty(1000 * (q + 1) + 7 * q) for q in range(n)] if rank == 0 else None
    mine = x[: 1000 * (rank + 1) + 7 * rank]
    await dist.gather(mine, g_s, dst=0)
    await dist.gather(mine, g_k, dst=0, group=sock)
    same["gather"] = g_s is None or all(np.array_equal(a, b) for a, b in zip(g_s, g_k))
    s_s, s_k = np.empty(2000 + rank), np.empty(2000 + rank)
    parts = [r2.standard_normal(2000 + q) for q in range(n)] if rank == n - 1 else None
    await dist.scatter(s_s, parts, src=n - 1)
    await dist.scatter(s_k, parts, src=n - 1, group=sock)
    same["scatter"] = bool(np.array_equal(s_s, s_k))

    shm = dist.group.WORLD.backend.stats()["shm"]
    during = memfds()
    await dist.destroy_process_group()
    print(json.dumps({"digests": digests, "same": same, "shm": shm, "during": during, "after": memfds(), "logs": logs}))


if __name__ == "__main__":
    asyncio.run(main())
