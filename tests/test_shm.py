"""Shared memory between ranks on one host (aiodist.shm), in real processes (env://, one per rank).

Each world runs the same ops twice, on the default group (shared memory from 0 bytes) and on a
second group of the same ranks made with shared memory off (the socket path): results must be
the same bits on every rank, and exact sums/extrema (integers, integer-valued floats) must equal
the socket path's. Segments are 1 MiB (512 KiB rounds), so the big payloads go in many rounds;
sizes are odd, so slices and rounds are uneven. Plus: shared memory off on one rank sends the
whole group to the socket path and says so at INFO; no memfd stays mapped after
destroy_process_group and nothing appears in /dev/shm.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.rank_procs import run_ranks

from aiodist.elastic.utils import get_free_port

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
START_S = 60.0  # 4 interpreters importing numpy on a loaded 2-core machine, plus the ops

WORKER = r"""
import asyncio, hashlib, json, logging, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import aiodist as dist

logs = []

class Keep(logging.Handler):
    def emit(self, record):
        logs.append(record.getMessage())

logging.getLogger("aiodist").addHandler(Keep())
logging.getLogger("aiodist").setLevel(logging.INFO)

def memfds():
    with open("/proc/self/maps") as f:
        maps = sum("memfd:aiodist-shm" in line for line in f)
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:aiodist-shm" in os.readlink(f"/proc/self/fd/{{name}}")
        except OSError:
            pass
    return maps, fds

async def main():
    await dist.init_process_group("gloo", timeout=30)
    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ["AIODIST_ALGO_ALLREDUCE_SHM_MIN"] = "-1"  # read when a group is made: this one is socket-only
    os.environ["AIODIST_ALGO_ALLGATHER_SHM_MIN"] = "-1"
    sock = await dist.new_group(list(range(n)))
    rng = np.random.default_rng(1234 + rank)
    digests, same = {{}}, {{}}

    async def both(name, make, op=dist.ReduceOp.SUM, exact=True):
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

    inp = (np.arange(250_007, dtype=np.int32) * (rank + 1))
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

    shm = dist.group.WORLD.backend.stats()["shm"]
    during = memfds()
    await dist.destroy_process_group()
    print(json.dumps({{"digests": digests, "same": same, "shm": shm, "during": during, "after": memfds(), "logs": logs}}))

asyncio.run(main())
"""


def _world(tmp_path: Path, n: int, extra: dict[int, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    script = tmp_path / "rank.py"
    script.write_text(WORKER.format(root=str(ROOT)))
    port = str(get_free_port())
    envs = []
    for r in range(n):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(n))
        env.update(AIODIST_SHM_BYTES="1M", AIODIST_ALGO_ALLREDUCE_SHM_MIN="0", AIODIST_ALGO_ALLGATHER_SHM_MIN="0")
        env.update((extra or {}).get(r, {}))
        envs.append(env)
    return run_ranks([[sys.executable, str(script)]] * n, envs, START_S)


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_path_matches_the_socket_path(tmp_path: Path, n: int) -> None:
    before = _dev_shm()
    res = _world(tmp_path, n)
    for r, out in enumerate(res):
        assert out["shm"]["groups"] == [0], f"rank {r}: the default group did not use shared memory: {out['shm']}"
        assert all(out["same"].values()), f"rank {r}: shared memory and socket results differ: {out['same']}"
        assert out["digests"] == res[0]["digests"], f"rank {r}'s results are not rank 0's bits"
        assert out["during"][0] >= n, f"rank {r}: expected {n} memfd mappings during the run, saw {out['during']}"
        assert out["after"] == [0, 0], f"rank {r}: memfd mappings/fds left after destroy_process_group: {out['after']}"
    assert _dev_shm() <= before, f"new files in /dev/shm: {_dev_shm() - before}"


def test_shared_memory_off_on_one_rank_uses_the_socket_and_says_so(tmp_path: Path) -> None:
    res = _world(tmp_path, 2, {1: {"AIODIST_SHM_BYTES": "0"}})
    for r, out in enumerate(res):
        assert out["shm"]["groups"] == [], f"rank {r}: a group used shared memory with it off on rank 1: {out['shm']}"
        assert all(out["same"].values()), out["same"]
        assert out["digests"] == res[0]["digests"]
        assert out["during"] == [0, 0] and out["after"] == [0, 0], (out["during"], out["after"])
    assert any("shared memory off (AIODIST_SHM_BYTES=0)" in m for m in res[1]["logs"]), res[1]["logs"]
    assert any("group 0 does not use shared memory" in m for m in res[0]["logs"]), res[0]["logs"]
