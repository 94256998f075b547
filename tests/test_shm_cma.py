"""Single-copy reads between processes (aiodist.shm._cma): the probe that decides whether a
peer can be read, the read itself and its errors. The collectives that use it are tested in
tests/test_shm.py (real processes) and below in one process (run_world)."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.algorithms.schedule import chunk_bounds
from aiodist.errors import DistBackendError
from aiodist.shm import SharedMemory, _cma
from aiodist.testing import run_world

pytestmark = pytest.mark.skipif(not _cma.record(), reason="no process_vm_readv here")


def test_reads_its_own_probe_and_refuses_wrong_bytes_or_a_wrong_pid() -> None:
    rec = _cma.record()
    assert rec is not None and _cma.readable(os.getpid(), rec)
    assert not _cma.readable(os.getpid(), {**rec, "bytes": "00" * 16})  # the same address, other bytes
    assert not _cma.readable(os.getpid(), {"addr": "x"}) and not _cma.readable("1", rec)
    # another process at that pid (as a peer in another pid namespace would be): not its bytes
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not _cma.readable(child.pid, rec)
    finally:
        child.communicate(b"", timeout=30)


def test_a_read_of_a_process_that_is_gone_is_an_oserror() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    with pytest.raises(OSError) as info:
        _cma.read(child.pid, np.zeros(8, np.uint8), 4096)
    assert info.value.errno == errno.ESRCH


def test_a_read_of_unmapped_memory_is_an_oserror() -> None:
    with pytest.raises(OSError) as info:
        _cma.read(os.getpid(), np.zeros(8, np.uint8), 8)  # page 0 is never mapped
    assert info.value.errno == errno.EFAULT


def test_the_switch_is_0_or_1() -> None:
    assert _cma.enabled({}) and _cma.enabled({_cma.ENV: "1"}) and not _cma.enabled({_cma.ENV: " 0 "})
    with pytest.raises(ValueError, match="AIODIST_SHM_CMA='yes'"):
        _cma.enabled({_cma.ENV: "yes"})


ENV = {"AIODIST_SHM_BYTES": "1M"}
#: the default group's path rules (run_world's pg_options): all_gather through shared memory at every size
RULES: dict[str, int | str] = {"allgather_shm_min": 0, "pair_lane_max": 0}  # (a pair's lane no further than a wider group's)


def _slice_owner_sum(xs: list[np.ndarray]) -> np.ndarray:
    """The single-copy bits: the owner of slice r adds its own first, then the others in rank order."""
    n, m = len(xs), xs[0].size
    want = np.empty(m, xs[0].dtype)
    bounds = chunk_bounds(m, n)
    for r in range(n):
        lo, hi = bounds[r], bounds[r + 1]
        acc = xs[r][lo:hi].copy()
        for q in range(n):
            if q != r:
                acc += xs[q][lo:hi]
        want[lo:hi] = acc
    return want


@pytest.mark.parametrize("n", [2, 3])
async def test_all_gather_in_place_uneven_and_overlapping(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Out of place, in place (the input is the own output slice), uneven parts and an input
    that overlaps another rank's output slice (read from a copy): the bits the socket path gives."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)

    async def fn(rank: int) -> int:
        m = 300_007  # 1.2 MB: bigger than a segment's half, which single copy does not need
        x = np.arange(m, dtype=np.int32) * (rank + 1)
        out = np.empty(m * n, np.int32)
        await dist.all_gather_into_tensor(out, x)
        want = np.concatenate([np.arange(m, dtype=np.int32) * (q + 1) for q in range(n)])
        assert np.array_equal(out, want)
        buf = np.zeros(m * n, np.int32)
        buf[rank * m : (rank + 1) * m] = x
        await dist.all_gather_into_tensor(buf, buf[rank * m : (rank + 1) * m])  # in place
        assert np.array_equal(buf, want)
        sizes = [50_000 + 7_777 * q for q in range(n)]
        parts = [np.empty(s, np.float64) for s in sizes]
        await dist.all_gather(parts, np.full(sizes[rank], rank - 0.5))
        assert all(np.all(p == q - 0.5) for q, p in enumerate(parts))
        # the input is the next rank's output slice: it must be read before that slice is written
        buf2 = np.concatenate([np.arange(m, dtype=np.int32) * (rank + 1)] * n)
        nxt = (rank + 1) % n
        await dist.all_gather_into_tensor(buf2, buf2[nxt * m : (nxt + 1) * m])
        assert np.array_equal(buf2, want)
        shm = dist.group.WORLD.backend.stats()["shm"]
        return int(shm["cma_ops"])

    ops = await run_world(n, fn, backend="gloo", timeout=60, pg_options=RULES)
    # single copy for every all_gather in a group of 2; in a wider one from cma_wide_min (2 MiB):
    # the three 3.6 MB all_gather_into_tensor calls, not the 1.3 MB all_gather
    assert ops == [4 if n == 2 else 3] * n, ops


@pytest.mark.parametrize("n", [2, 3])
async def test_big_broadcast_reads_the_roots_tensor(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """From broadcast_shm_min up, every root in turn: the root's bits everywhere, and every op
    through single copy."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)

    async def fn(rank: int) -> int:
        for root in range(n):
            want = np.arange(70_001, dtype=np.float64) * (root + 1)
            t = want.copy() if rank == root else np.full(70_001, -1.0)
            await dist.broadcast(t, src=root)
            assert np.array_equal(t, want), (rank, root)
        m = np.full((400, 300), 7 if rank == 0 else 0, np.int16)  # 2-D, 240,000 bytes
        await dist.broadcast(m, src=0)
        assert np.all(m == 7)
        return int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    rules = {**RULES, "broadcast_shm_min": "64K", "broadcast_lane_max": "16K", "cma_wide_min": 0}  # (below 16 KiB: the lane)
    assert await run_world(n, fn, backend="gloo", timeout=60, pg_options=rules) == [n + 1] * n


async def test_a_broadcast_whose_sizes_differ_across_the_threshold_is_a_desync_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistake: the root passes 300 KB (single copy), the other rank 100 KB (the socket), or
    the other way round. The rank on the socket path says which op it is in, so the rank
    waiting in the lane finds the desync at once instead of waiting out its timeout."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    for sizes in ((300_000, 100_000), (100_000, 300_000)):

        async def fn(rank: int, sizes: tuple[int, int] = sizes) -> tuple[str, float]:
            await dist.all_reduce(np.ones(1, np.float32))  # the agreement
            t = np.zeros(sizes[rank], np.uint8)
            t0 = time.monotonic()
            try:
                await dist.broadcast(t, src=0)
            except dist.DistError as exc:
                return str(exc), time.monotonic() - t0
            return "ok", time.monotonic() - t0

        results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60)
        assert any("desync detected" in m for m, _ in results), results
        assert all(m == "ok" or "desync detected" in m for m, _ in results), results  # the root may finish
        assert all(dt < 5 for _, dt in results), results  # not the 20 s timeout


async def test_the_vote_keeps_single_copy_off_when_one_rank_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 finds it cannot read rank 0 (as under a one-sided ptrace policy) while rank 0 can
    read rank 1: the agreement's second byte turns single copy off on both, and the all_gather
    and broadcast take the segments and the socket, with the same results."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    real = SharedMemory._map_all

    async def one_sided(self: SharedMemory, *args: Any, **kwargs: Any) -> Any:
        state = await real(self, *args, **kwargs)
        if self.rank == 1:
            state.cma = False
        return state

    monkeypatch.setattr(SharedMemory, "_map_all", one_sided)

    async def fn(rank: int) -> dict[str, Any]:
        x = np.arange(200_000, dtype=np.int32) + rank
        out = np.empty(400_000, np.int32)
        await dist.all_gather_into_tensor(out, x)
        assert np.array_equal(out, np.concatenate([np.arange(200_000, dtype=np.int32) + q for q in range(2)]))
        b = np.arange(100_000, dtype=np.float32) if rank == 0 else np.zeros(100_000, np.float32)
        await dist.broadcast(b, src=0)
        assert np.array_equal(b, np.arange(100_000, dtype=np.float32))
        return dist.group.WORLD.backend.stats()["shm"]  # type: ignore[no-any-return]

    for shm in await run_world(2, fn, backend="gloo", timeout=60):
        assert shm["groups"] == [0] and shm["cma_groups"] == [] and shm["cma_ops"] == 0, shm


@pytest.mark.parametrize("single", [True, False], ids=["single-copy", "halves"])
@pytest.mark.parametrize("n", [2, 3])
async def test_big_all_reduce_reads_the_peers_slices(monkeypatch: pytest.MonkeyPatch, n: int, single: bool) -> None:
    """From allreduce_cma_min up: the bits of the segment path (slice r is rank r's own plus
    the others' in rank order) on every rank, for floats, ints, MAX, AVG, a 2-D tensor and odd
    lengths. (``single`` off: the halves, the same bits at 2 ranks.)"""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    rules = {"allreduce_cma_min": "64K" if single else -1, "allreduce_shm_min": "256K", "pair_lane_max": 0}

    def data(rank: int, m: int) -> np.ndarray:
        return np.random.default_rng(1000 * rank + m).standard_normal(m).astype(np.float32)

    async def fn(rank: int) -> tuple[list[np.ndarray], int]:
        got = []
        for m in (300_001, 70_001, 1_000_000):  # 1.2 MB, over a segment's half; 280 KB, just over allreduce_shm_min here; 4 MB
            x = data(rank, m)
            await dist.all_reduce(x)
            got.append(x)
        i = np.arange(400_001, dtype=np.int64) * (rank + 1) - 7
        await dist.all_reduce(i, op=dist.ReduceOp.MAX)
        assert np.array_equal(i, np.arange(400_001, dtype=np.int64) * n - 7)
        a = np.full((300, 301), float(rank), np.float64)
        await dist.all_reduce(a, op=dist.ReduceOp.AVG)
        assert np.all(a == sum(range(n)) / n)
        return got, int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    results = await run_world(n, fn, backend="gloo", timeout=60, pg_options=rules)
    for k, m in enumerate((300_001, 70_001, 1_000_000)):
        want = _slice_owner_sum([data(r, m) for r in range(n)])
        for got, _ in results:
            assert np.array_equal(got[k], results[0][0][k])  # every rank: the same bits
            if single or n == 2:
                assert np.array_equal(got[k], want), (k, m)
            else:  # the halves go in rounds of a half, each cut in n slices of its own: other roundings
                assert np.allclose(got[k], want, rtol=1e-5, atol=1e-5), (k, m)
    assert [ops for _, ops in results] == [5 if single else 0] * n


async def test_an_all_reduce_whose_sizes_differ_across_the_single_copy_threshold_is_a_desync_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mistake: one rank passes 600 KB (single copy), the other 300 KB (the halves). Both
    paths check the size at their first phase, so both ranks raise at once."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> tuple[str, float]:
        await dist.all_reduce(np.ones(1, np.float32))  # the agreement
        t = np.zeros(600_000 if rank == 0 else 300_000, np.uint8)
        t0 = time.monotonic()
        try:
            await dist.all_reduce(t)
        except dist.DistError as exc:
            return str(exc), time.monotonic() - t0
        return "ok", time.monotonic() - t0

    results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60, pg_options={"allreduce_cma_min": "512K"})
    assert all(m != "ok" for m, _ in results), results
    assert any("desync" in m or "bytes" in m for m, _ in results), results
    assert all(dt < 5 for _, dt in results), results  # not the 20 s timeout


@pytest.mark.parametrize("n", [2, 3])
async def test_big_reduce_reads_the_peers_slices_and_leaves_theirs_alone(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """From reduce_cma_min up (0 here: every size), every root in turn: the root gets the bits
    of the single-copy all_reduce, every other rank's tensor is as it was; ints with MAX, AVG
    of a 2-D tensor, and fewer elements than ranks (an empty slice) too."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    rules = {"reduce_cma_min": 0, "cma_wide_min": 0, "lane_max": 0}  # (lane_max: a group of 2 would take the lane first)
    sizes = (300_001, 70_001, 2)

    def data(rank: int, m: int) -> np.ndarray:
        return np.random.default_rng(1000 * rank + m).standard_normal(m).astype(np.float32)

    async def fn(rank: int) -> tuple[list[np.ndarray], int]:
        got = []
        for root in range(n):
            for m in sizes:
                x = data(rank, m)
                await dist.reduce(x, dst=root)
                if rank == root:
                    got.append(x)
                else:
                    assert np.array_equal(x, data(rank, m)), (rank, root, m)
            i = np.arange(100_001, dtype=np.int64) * (rank + 1) - 7
            await dist.reduce(i, dst=root, op=dist.ReduceOp.MAX)
            assert np.array_equal(i, np.arange(100_001, dtype=np.int64) * (n if rank == root else rank + 1) - 7)
            a = np.full((300, 301), float(rank), np.float64)
            await dist.reduce(a, dst=root, op=dist.ReduceOp.AVG)
            assert np.all(a == (sum(range(n)) / n if rank == root else rank))
        return got, int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    results = await run_world(n, fn, backend="gloo", timeout=60, pg_options=rules)
    for root in range(n):
        for k, m in enumerate(sizes):
            want = _slice_owner_sum([data(r, m) for r in range(n)])
            assert np.array_equal(results[root][0][k], want), (root, m)
    assert [ops for _, ops in results] == [5 * n] * n


@pytest.mark.parametrize("op", ["reduce", "reduce_scatter_tensor", "scatter"])
async def test_a_reduce_whose_sizes_differ_across_the_single_copy_threshold_is_a_desync_at_once(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A mistake: one rank passes 600 KB (single copy), the other 300 KB (the socket), with
    either as the root (reduce; and 200 KB, the lane, against 300 KB). The rank on the socket
    path says which op it is in, so the rank waiting for its peer's first phase (or its lane
    flag) finds the desync at once, not at its 20 s timeout."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    # (scatter: sizes that differ are outside torch's contract too)
    rules = {"reduce_cma_min": "512K", "reduce_scatter_cma_min": "512K", "scatter_cma_min": "512K"}
    cases = [(r, m) for r in (0, 1) for m in (600_000, 200_000)] if op == "reduce" else [(0, 600_000)]

    for root, first in cases:

        async def fn(rank: int, root: int = root, first: int = first) -> tuple[str, float]:
            await dist.all_reduce(np.ones(1, np.float32))  # the agreement
            t = np.zeros(first if rank == 0 else 300_000, np.uint8)
            t0 = time.monotonic()
            try:
                if op == "reduce":
                    await dist.reduce(t, dst=root)
                elif op == "reduce_scatter_tensor":
                    await dist.reduce_scatter_tensor(np.empty(t.size // 2, np.uint8), t)
                else:
                    await dist.scatter(t, [np.zeros(600_000, np.uint8), np.zeros(300_000, np.uint8)] if rank == 0 else None)
            except dist.DistError as exc:
                return str(exc), time.monotonic() - t0
            return "ok", time.monotonic() - t0

        results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60, pg_options=rules)
        assert any("desync detected" in m for m, _ in results), (root, first, results)
        assert all(m == "ok" or "desync" in m or "bytes" in m for m, _ in results), (root, first, results)
        assert all(dt < 5 for _, dt in results), (root, first, results)


@pytest.mark.parametrize("n", [2, 3])
async def test_reduce_scatter_reads_every_ranks_part_in_rank_order(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """reduce_scatter by single copy (every size, the default): the bits of the direct schedule
    (part r of rank 0, then + rank 1's, ...), for reduce_scatter_tensor, the list form with
    parts in separate arrays (copied into one block first), in place (the output is the own
    part of the input), an output that overlaps another rank's part, MAX on ints, and AVG."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    def data(rank: int, m: int) -> np.ndarray:
        return np.random.default_rng(77 * rank + m).standard_normal(m).astype(np.float32)

    def rank_order(parts: list[np.ndarray]) -> np.ndarray:
        acc = parts[0].copy()
        for x in parts[1:]:
            acc += x
        return acc

    m, sizes = 100_003, [30_001] * n  # (every rank's output has one shape: the desync check)

    async def fn(rank: int) -> int:
        x = data(rank, m * n)
        out = np.empty(m, np.float32)
        await dist.reduce_scatter_tensor(out, x)
        assert np.array_equal(out, rank_order([data(q, m * n)[rank * m : (rank + 1) * m] for q in range(n)]))
        parts = [data(rank, s) * (j + 1) for j, s in enumerate(sizes)]  # separate arrays
        o = np.empty(sizes[rank], np.float32)
        await dist.reduce_scatter(o, parts)
        assert np.array_equal(o, rank_order([data(q, sizes[rank]) * (rank + 1) for q in range(n)]))
        y = x.copy()
        await dist.reduce_scatter_tensor(y[rank * m : (rank + 1) * m], y)  # in place
        assert np.array_equal(y[rank * m : (rank + 1) * m], out)
        z = x.copy()
        nxt = (rank + 1) % n
        await dist.reduce_scatter_tensor(z[nxt * m : (nxt + 1) * m], z)  # the output is the next rank's part
        assert np.array_equal(z[nxt * m : (nxt + 1) * m], out)
        i = (np.arange(m * n, dtype=np.int32) % 1000) * (rank + 1)
        oi = np.empty(m, np.int32)
        await dist.reduce_scatter_tensor(oi, i, op=dist.ReduceOp.MAX)
        assert np.array_equal(oi, (np.arange(m * n, dtype=np.int32) % 1000)[rank * m : (rank + 1) * m] * n)
        a = np.full((n, 300, 7), float(rank), np.float64)
        oa = np.empty((300, 7), np.float64)
        await dist.reduce_scatter_tensor(oa, a, op=dist.ReduceOp.AVG)
        assert np.all(oa == sum(range(n)) / n)
        return int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    no_lane = {"reduce_scatter_lane_max": 0, "pair_lane_max": 0}  # (the small ones: single copy too)
    assert await run_world(n, fn, backend="gloo", timeout=60, pg_options=no_lane) == [6] * n


@pytest.mark.parametrize("n", [2, 3])
async def test_all_to_all_reads_every_ranks_part_for_it(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """all_to_all by single copy (every one, the default): even and uneven splits, empty parts,
    the list form (separate arrays), and in place (the output is the input: read from a copy)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> int:
        m = 100_001
        x = np.arange(m * n, dtype=np.float32) + 1000 * rank
        out = np.empty(m * n, np.float32)
        await dist.all_to_all_single(out, x)
        want = np.concatenate([np.arange(m * n, dtype=np.float32)[rank * m : (rank + 1) * m] + 1000 * q for q in range(n)])
        assert np.array_equal(out, want)
        await dist.all_to_all_single(x, x)  # in place
        assert np.array_equal(x, want)
        ins = [(rank + 1) * 1000 + q if q != 1 else 0 for q in range(n)]  # nothing to rank 1
        outs = [(q + 1) * 1000 + rank if rank != 1 else 0 for q in range(n)]
        y = np.repeat(np.arange(n, dtype=np.int64) + 10 * rank, ins)
        o = np.empty(sum(outs), np.int64)
        await dist.all_to_all_single(o, y, output_split_sizes=outs, input_split_sizes=ins)
        assert np.array_equal(o, np.repeat(np.arange(n, dtype=np.int64) * 10 + rank, outs))
        lst_in = [np.full((3, 5 + q), rank * 100 + q, np.int16) for q in range(n)]
        lst_out = [np.empty((3, 5 + rank), np.int16) for _ in range(n)]
        await dist.all_to_all(lst_out, lst_in)
        assert all(np.all(o == q * 100 + rank) for q, o in enumerate(lst_out))
        return int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    assert await run_world(n, fn, backend="gloo", timeout=60) == [4] * n


@pytest.mark.parametrize("n", [2, 3])
async def test_an_all_to_all_mixes_parts_in_the_lane_and_parts_read_from_memory(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Rank 0's parts fit the lane slot (inline), the others' do not (read from their memory):
    every part arrives, in both directions, and the ops after it are in step (the ranks decided
    alike on the second lane op). Then every rank inline: the same results."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> list[bool]:
        ok = []
        for big in (100_000, 10):
            each = [10 if q == 0 else big for q in range(n)]  # rank q sends each[q] elements to every rank
            x = np.arange(each[rank] * n, dtype=np.float32) + 1000 * rank
            o = np.empty(sum(each), np.float32)
            await dist.all_to_all_single(o, x, output_split_sizes=each, input_split_sizes=[each[rank]] * n)
            at = 0
            for q in range(n):
                want = np.arange(each[q] * rank, each[q] * (rank + 1), dtype=np.float32) + 1000 * q
                ok.append(bool(np.array_equal(o[at : at + each[q]], want)))
                at += each[q]
            y = np.ones(1, np.float32)
            await dist.all_reduce(y)
            ok.append(bool(y[0] == n))
        return ok

    for got in await run_world(n, fn, backend="gloo", timeout=60):
        assert all(got), got


async def test_an_all_to_all_whose_split_sizes_do_not_match_fails_on_both_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistake: rank 0 sends rank 1 10 elements, rank 1 expects 12. Rank 1 finds it in the
    table it reads and says so (the sizes and ranks); rank 0, waiting for rank 1 to finish
    reading, fails too (the group is aborted), well within the timeout."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> tuple[str, float]:
        t0 = time.monotonic()
        x = np.zeros(20, np.float32)
        o = np.empty(22 if rank == 1 else 20, np.float32)
        try:
            await dist.all_to_all_single(o, x, output_split_sizes=[12, 10] if rank == 1 else None)
        except dist.DistError as exc:
            return str(exc), time.monotonic() - t0
        return "ok", time.monotonic() - t0

    results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60)
    assert "rank 0 sends 40 bytes to rank 1, which expects 48 from it" in results[1][0], results
    assert results[0][0] != "ok", results
    assert all(dt < 5 for _, dt in results), results


@pytest.mark.parametrize("lane", [False, True], ids=["no-lane", "lane"])
@pytest.mark.parametrize("n", [2, 3])
async def test_gather_and_scatter_read_straight_from_the_other_side(monkeypatch: pytest.MonkeyPatch, n: int, lane: bool) -> None:
    """gather and scatter by single copy in groups of 2 (every size here, the lane off; 3
    ranks: the socket, the same results), every root in turn: sizes that differ per rank, 2-D
    tensors, and in place (the root's own slot is its tensor). With the lane on, the small ones
    (up to 64 KiB a rank, sizes that differ included) go through it, the same results."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> int:
        for root in range(n):
            x = np.arange(70_001 + rank, dtype=np.float64) + rank
            lst = [np.empty(70_001 + q) for q in range(n)] if rank == root else None
            await dist.gather(x, lst, dst=root)
            if lst is not None:
                assert all(np.array_equal(lst[q], np.arange(70_001 + q) + q) for q in range(n))
            m = np.full((3, 4), rank, np.int16)
            own = [np.empty((3, 4), np.int16) for _ in range(n)] if rank == root else None
            if own is not None:
                own[root] = m  # in place
            await dist.gather(m, own, dst=root)
            if own is not None:
                assert all(np.all(own[q] == q) for q in range(n))
            o = np.empty(1000 + rank, np.int32)
            sl = [np.full(1000 + q, q * 7 + root, np.int32) for q in range(n)] if rank == root else None
            await dist.scatter(o, sl, src=root)
            assert np.all(o == rank * 7 + root)
            t = np.zeros((2, 5))
            parts = [np.full((2, 5), float(q)) for q in range(n)] if rank == root else None
            if parts is not None:
                parts[root] = t  # in place
                t[:] = root
            await dist.scatter(t, parts, src=root)
            assert np.all(t == rank)
        return int(dist.group.WORLD.backend.stats()["shm"]["cma_ops"])

    rules: dict[str, object] = {"scatter_cma_min": 0} if lane else {"scatter_cma_min": 0, "gather_lane_max": 0, "scatter_lane_max": 0}
    want = (2 if lane else 8) if n == 2 else 0  # (with the lane, only the 560 KB gathers by single copy)
    assert await run_world(n, fn, backend="gloo", timeout=60, pg_options=rules) == [want] * n


@pytest.mark.parametrize(
    "op,m", [("gather", 10), ("scatter", 10), ("scatter", 1_100_000)], ids=["gather", "scatter-inline", "scatter-read"]
)
async def test_a_gather_or_scatter_whose_sizes_do_not_match_fails_the_reader(monkeypatch: pytest.MonkeyPatch, op: str, m: int) -> None:
    """A mistake: rank 1 passes m + 2 elements where the root's list holds m for it. The rank
    that reads says which ranks and sizes, well within the timeout; the other fails too (the
    group is aborted) where it waits for the reader: gather's root, and a scatter's root whose
    parts are read from its memory (a small scatter's parts travel in the lane slot, and its
    root is done once they are there, as the socket's root once it has sent)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> tuple[str, float]:
        t0 = time.monotonic()
        mine = m + 2 if rank == 1 else m
        try:
            if op == "gather":
                await dist.gather(np.zeros(mine, np.float32), [np.empty(m, np.float32)] * 2 if rank == 0 else None)
            else:
                await dist.scatter(np.empty(mine, np.float32), [np.zeros(m, np.float32)] * 2 if rank == 0 else None)
        except dist.DistError as exc:
            return str(exc), time.monotonic() - t0
        return "ok", time.monotonic() - t0

    results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60)
    reader = 0 if op == "gather" else 1
    a, b = 4 * m, 4 * (m + 2)
    want = (
        f"rank 1 sends {b} bytes to rank 0, which expects {a}" if op == "gather" else f"rank 0 sends {a} bytes to rank 1, which expects {b}"
    )
    assert want in results[reader][0], results
    if op == "gather" or m > 1000:
        assert results[1 - reader][0] != "ok", results
    assert all(dt < 5 for _, dt in results), results


@pytest.mark.parametrize("op", ["all_gather", "all_reduce", "reduce", "reduce_scatter", "all_to_all", "gather", "scatter"])
async def test_a_failed_read_names_the_op_group_seq_and_rank_and_fails_the_peer(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """One rank's read of its peer's input fails (its first one is sent to page 0, which is
    never mapped): that rank's op fails with a DistBackendError that says what and whose, and
    the peer, which read fine and waits for it, fails too (the group is broken), well within
    the timeout: no rank hangs. For all_reduce, the read is the first one (of the peer's slice,
    to reduce it)."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    rules = {**RULES, "allreduce_cma_min": "256K", "reduce_cma_min": "256K"}
    real = _cma.read
    failed: list[int] = []

    def bad(pid: int, dst: np.ndarray, addr: int) -> None:
        if dst.nbytes > 16 and not failed:  # (the probes are 16 bytes)
            failed.append(addr)
            addr = 8
        real(pid, dst, addr)

    monkeypatch.setattr(_cma, "read", bad)

    async def fn(rank: int) -> tuple[str, float]:
        t = asyncio.get_running_loop().time()
        try:
            if op == "all_gather":
                await dist.all_gather_into_tensor(np.empty(2 * 300_000, np.float32), np.ones(300_000, np.float32))
            elif op == "all_reduce":
                await dist.all_reduce(np.ones(300_000, np.float32))
            elif op == "reduce":
                try:
                    await dist.reduce(np.ones(300_000, np.float32), dst=1)
                finally:  # a failed op's scratch that the peer reads by address stays alive until the group goes
                    (turns,) = dist.group.WORLD.backend.shm._turns.values()
                    assert [a.size for a in turns.state.parked] == ([150_000] if rank == 0 else []), rank
            elif op == "reduce_scatter":
                await dist.reduce_scatter_tensor(np.empty(150_000, np.float32), np.ones(300_000, np.float32))
            elif op == "all_to_all":
                await dist.all_to_all_single(
                    np.empty(2_200_000, np.float32), np.ones(2_200_000, np.float32)
                )  # (parts past the pair's 4 MiB lane slot: read)
            elif op == "gather":
                await dist.gather(np.ones(300_000, np.float32), [np.empty(300_000, np.float32) for _ in range(2)] if rank == 0 else None)
            else:
                # (parts past the pair's 4 MiB lane slot: read)
                await dist.scatter(np.empty(1_100_000, np.float32), [np.ones(1_100_000, np.float32)] * 2 if rank == 0 else None)
        except DistBackendError as exc:
            return str(exc), asyncio.get_running_loop().time() - t
        return "ok", 0.0

    results = await run_world(2, fn, backend="gloo", pg_timeout=20, timeout=60, pg_options=rules)
    assert len(failed) == 1
    msgs = [m for m, _ in results]
    if op == "all_gather":
        # both name the read that failed; the peer learned it from the failing rank's abort
        assert all("all_gather on group 0, seq 0: reading rank" in m and "Bad address" in m for m in msgs), msgs
        assert sum("which broke group 0" in m for m in msgs) == 1, msgs  # the peer: "the failure started on rank N, which broke group 0"
    else:
        assert sum(f"{op} on group 0, seq 0: reading rank" in m and "Bad address" in m for m in msgs) >= 1, msgs
        assert all(m != "ok" for m in msgs), msgs
    assert all(dt < 10 for _, dt in results), results  # the peer learns it from the abort, not its 20 s timeout
    # the failed op's traceback still viewed the segments; once it is collected they are unmapped
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not any("memfd:aiodist-shm" in line for line in f)


@pytest.mark.parametrize("op", ["broadcast", "reduce", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter"])
async def test_a_rank_that_cannot_read_still_takes_its_turn_in_the_first_op(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """Rank 1 has no single copy of its own (its probe failed, or AIODIST_SHM_CMA=0 there) and
    the group's first op is one that only single copy would take to shared memory: both ranks
    still take their turn in line, so both vote in the group's agreement (single copy off),
    and the op runs on the socket with the right result, instead of rank 0 waiting alone in
    the agreement until its timeout."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> dict[str, Any]:
        if rank == 1:
            dist.group.WORLD.backend.shm.cma = None
        x = np.arange(2_000_000, dtype=np.float32) + rank  # 8 MB: past every single-copy threshold
        if op == "broadcast":
            await dist.broadcast(x, src=0)
            assert np.array_equal(x, np.arange(2_000_000, dtype=np.float32))
        elif op == "reduce":
            await dist.reduce(x, dst=0)
            assert rank == 1 or np.array_equal(x, 2 * np.arange(2_000_000, dtype=np.float32) + 1)
        elif op == "reduce_scatter_tensor":
            out = np.empty(1_000_000, np.float32)
            await dist.reduce_scatter_tensor(out, x)
            assert np.array_equal(out, 2 * np.arange(rank * 1_000_000, (rank + 1) * 1_000_000, dtype=np.float32) + 1)
        elif op == "all_to_all_single":
            out = np.empty(2_000_000, np.float32)
            await dist.all_to_all_single(out, x)
            half = np.arange(rank * 1_000_000, (rank + 1) * 1_000_000, dtype=np.float32)
            assert np.array_equal(out, np.concatenate([half, half + 1]))
        elif op == "gather":
            lst = [np.empty(2_000_000, np.float32) for _ in range(2)] if rank == 0 else None
            await dist.gather(x, lst)
            assert lst is None or all(np.array_equal(lst[q], np.arange(2_000_000, dtype=np.float32) + q) for q in range(2))
        else:
            await dist.scatter(x, [x + 5, x + 6] if rank == 0 else None)
            assert np.array_equal(x, np.arange(2_000_000, dtype=np.float32) + 5 + rank)
        return dist.group.WORLD.backend.stats()["shm"]  # type: ignore[no-any-return]

    for shm in await run_world(2, fn, backend="gloo", pg_timeout=10, timeout=60):
        assert shm["groups"] == [0] and shm["cma_groups"] == [] and shm["cma_ops"] == 0, shm


async def test_a_small_reduce_of_two_ranks_goes_through_the_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to lane_max at 2 ranks: the root gets rank 0's value plus rank 1's (the lane
    all_reduce's bits), the other rank's tensor is left as it was, AVG and MAX too; and every
    such op is a lane op (none on the socket)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    def data(rank: int, m: int) -> np.ndarray:
        return np.random.default_rng(31 * rank + m).standard_normal(m).astype(np.float32)

    async def fn(rank: int) -> int:
        for root in (0, 1):
            for m in (1, 1000, 60_000):
                x = data(rank, m)
                await dist.reduce(x, dst=root)
                want = data(0, m) + data(1, m) if rank == root else data(rank, m)
                assert np.array_equal(x, want), (rank, root, m)
            a = np.full((3, 4), float(rank + 1))
            await dist.reduce(a, dst=root, op=dist.ReduceOp.AVG)
            assert np.all(a == (1.5 if rank == root else rank + 1))
            i = np.arange(10, dtype=np.int32) * (1 - rank)
            await dist.reduce(i, dst=root, op=dist.ReduceOp.MAX)
            assert np.array_equal(i, np.arange(10, dtype=np.int32) * (1 if rank == root else 1 - rank))
        g = dist.group.WORLD.backend.stats()["shm"]
        return int(g["lane_ops"])

    assert await run_world(2, fn, backend="gloo", timeout=60) == [10, 10]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("single", [True, False])
async def test_all_reduce_into_writes_the_sum_into_the_outputs(monkeypatch: pytest.MonkeyPatch, n: int, single: bool) -> None:
    """aiodist.c10d.all_reduce_into (DDP's buckets): the sum lands in the outputs (uneven parts,
    one empty), with all_reduce's bits (the single-copy owner order) and without a copy of the
    whole buffer where the single-copy path read the peers straight into them; on another path
    (here the segment halves) the same bits by a copy."""
    from aiodist.c10d import all_reduce_into
    from aiodist.shm import Into

    copies: list[int] = []
    plain_copy = Into.copy_from

    def counted(self: Into, flat: np.ndarray) -> None:
        copies.append(flat.nbytes)
        plain_copy(self, flat)

    monkeypatch.setattr(Into, "copy_from", counted)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    rules = {"allreduce_cma_min": "64K" if single else -1, "allreduce_shm_min": "256K", "lane_max": 0}
    m = 150_001
    sizes = [40_000, 0, 60_000, m - 100_000]

    async def fn(rank: int) -> tuple[int, int]:
        rng = np.random.default_rng(rank)
        x = rng.standard_normal(m).astype(np.float32)
        xs = [np.random.default_rng(q).standard_normal(m).astype(np.float32) for q in range(n)]
        outs = [np.full(s, np.nan, np.float32) for s in sizes]
        work = await all_reduce_into(x.copy(), outs)
        assert work is not None
        await work
        got = np.concatenate(outs)
        want = _slice_owner_sum(xs) if single else None
        if want is not None:
            assert np.array_equal(got, want)  # the bits of the single-copy all_reduce
        ref = x.copy()
        await dist.all_reduce(ref)
        assert np.array_equal(got, ref)  # and all_reduce's, whichever path
        with pytest.raises(ValueError, match="outs hold 3 elements, tensor 4"):
            await all_reduce_into(np.zeros(4, np.float32), [np.zeros(3, np.float32)])
        with pytest.raises(ValueError, match=r"outs\[0\] is float64"):
            await all_reduce_into(np.zeros(4, np.float32), [np.zeros(4, np.float64)])
        shm = dist.group.WORLD.backend.stats()["shm"]
        return int(shm["cma_ops"]), len(copies)

    results = await run_world(n, fn, backend="gloo", timeout=60, pg_options=rules)
    for cma_ops, _ in results:
        assert (cma_ops > 0) == single
    assert (copies == []) == single, copies  # single copy: read straight into the outputs
