"""The collectives as a matrix, checked against numpy.

Over the SOCKET backend (``run_world(..., backend="gloo")``: real loopback connections, one
process): world sizes 1-5, every root of the rooted ops, every unrooted op on both sides of the
size thresholds that switch schedules (``aiodist.algorithms.thresholds``), bitwise identity of a
float32 all_reduce across ranks on each all_reduce path, several async ops in flight on one group
awaited out of order, and sub-groups.

Over the memory backend (fast): every dtype x every ReduceOp through all_reduce, reduce and
reduce_scatter_tensor; valid pairs against numpy, invalid pairs refused before anything is sent
(the group's sequence number does not move and the group stays usable); torch CPU tensors
(bfloat16 included) updated in place.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from functools import lru_cache, partial
from typing import Any, TypeVar

import numpy as np
import pytest

import aiodist as dist
from aiodist.algorithms.thresholds import Thresholds
from aiodist.testing import run_world

R = dist.ReduceOp
SIZES = [1, 2, 3, 4, 5]
TH = Thresholds()  # the defaults; the tests below assert each size lands on the schedule it targets
TIMEOUT = 30  # run_world watchdog, seconds


T = TypeVar("T")


async def run_gloo(n: int, fn: Callable[[int], Awaitable[T]], pg_options: Any = None) -> list[T]:
    """``run_world`` over real loopback sockets (``pg_options``: the default group's path rules).
    Ranks leave as soon as they are done: what a rank sent before leaving is still delivered
    (test_socket_message_sent_before_the_sender_leaves_is_delivered)."""
    return await run_world(n, fn, backend="gloo", timeout=TIMEOUT, pg_options=pg_options)


def issued(work: dist.Work | None) -> dist.Work:
    assert isinstance(work, dist.Work)
    return work


def world_pg() -> dist.ProcessGroup:
    pg = dist.GroupMember.WORLD
    assert isinstance(pg, dist.ProcessGroup)
    return pg


def vals(rank: int, count: int, dtype: str, salt: int = 0, lo: int = -50, hi: int = 50) -> np.ndarray:
    """Deterministic integer-valued data (exact in every dtype, so sums do not depend on order);
    a fresh copy each call (the references recompute every rank's data many times)."""
    return _vals(rank, count, dtype, salt, lo, hi).copy()


@lru_cache(maxsize=4096)
def _vals(rank: int, count: int, dtype: str, salt: int, lo: int, hi: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, salt, 7])
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if dt.kind == "u":
        lo = max(lo, 0)
    if dt.kind == "c":
        return (rng.integers(lo, hi, count) + 1j * rng.integers(lo, hi, count)).astype(dt)
    return rng.integers(lo, hi, count).astype(dt)


def fold(parts: list[np.ndarray], f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = f(acc, p)
    return acc


# -- socket backend: rooted ops, every world size, every root ----------------------------------

BCAST_CHAIN = TH.broadcast_tree_max // 8 + 1  # float64 elements: one past the binomial tree
REDUCE_BIG = 3 * TH.pipeline_piece // 8 + 5  # int64 elements: several pipeline pieces


@pytest.mark.parametrize("n", SIZES)
async def test_socket_rooted_ops_every_root(n: int) -> None:
    assert TH.broadcast(8 * (BCAST_CHAIN - 1)) == "tree" and TH.broadcast(8 * BCAST_CHAIN) == "chain"

    async def fn(rank: int) -> None:
        for root in range(n):
            # broadcast: src (global) and group_src, tree and chain sizes, sync and async
            for count in (1, 33, BCAST_CHAIN - 1, BCAST_CHAIN):
                x = vals(rank, count, "float64", salt=root)
                await dist.broadcast(x, src=root)
                np.testing.assert_array_equal(x, vals(root, count, "float64", salt=root))
            c = vals(rank, 9, "complex64", salt=root)
            w = issued(await dist.broadcast(c, group_src=root, async_op=True))
            assert await w == [c]
            np.testing.assert_array_equal(c, vals(root, 9, "complex64", salt=root))
            # reduce: the root gets the reduction, every other rank's tensor is left as it was
            for count, dtype, op, ref in (
                (7, "int64", R.SUM, np.add),
                (REDUCE_BIG, "int64", R.SUM, np.add),
                (1000, "float32", R.MAX, np.maximum),
                (100, "int16", R.MIN, np.minimum),
                (50, "uint32", R.BXOR, np.bitwise_xor),
                (64, "float64", R.PREMUL_SUM(0.5), lambda a, b: a + b),
            ):
                y = vals(rank, count, dtype, salt=root)
                before = y.copy()
                await dist.reduce(y, dst=root, op=op)
                parts = [vals(r, count, dtype, salt=root) for r in range(n)]
                if op == R.PREMUL_SUM:
                    parts = [p * 0.5 for p in parts]
                if rank == root:
                    np.testing.assert_array_equal(y, fold(parts, ref), err_msg=f"reduce {op} {dtype} {count} root {root}")
                else:
                    np.testing.assert_array_equal(y, before, err_msg=f"reduce {op} {dtype} changed a non-root input")
            z = np.full(3, rank, dtype=np.int8)
            await dist.reduce(z, group_dst=root, op=R.PRODUCT)
            if rank == root:
                assert z.tolist() == [np.prod(np.arange(n, dtype=np.int8))] * 3
            # gather
            for count in (2, 20_000):
                t = vals(rank, count, "int32", salt=root)
                gl = [np.full(count, -1, dtype=np.int32) for _ in range(n)] if rank == root else None
                await dist.gather(t, gl, dst=root)
                if gl is not None:
                    for r in range(n):
                        np.testing.assert_array_equal(gl[r], vals(r, count, "int32", salt=root))
            # scatter
            for count in (3, 20_000):
                out = np.zeros(count, dtype=np.complex128)
                sl = [vals(100 + r, count, "complex128", salt=root) for r in range(n)] if rank == root else None
                await dist.scatter(out, sl, group_src=root)
                np.testing.assert_array_equal(out, vals(100 + rank, count, "complex128", salt=root))
        await dist.barrier()

    await run_gloo(n, fn)


# -- socket backend: unrooted ops ------------------------------------------------------------------

# all_reduce cases: (count, dtype, op, reference over the stacked parts, factor for PREMUL_SUM)
RD_INT64 = TH.allreduce_rd_max // 8  # the largest recursive-doubling int64 all_reduce
ALL_REDUCE_CASES: list[tuple[int, str, Any, Callable[[list[np.ndarray], int], np.ndarray]]] = [
    (1, "int64", R.SUM, lambda p, n: fold(p, np.add)),
    (RD_INT64, "int64", R.SUM, lambda p, n: fold(p, np.add)),
    (RD_INT64 + 1, "int64", R.SUM, lambda p, n: fold(p, np.add)),  # halving/doubling
    (TH.allreduce_ring_min // 8, "int64", R.SUM, lambda p, n: fold(p, np.add)),  # ring
    (1001, "float32", R.MAX, lambda p, n: fold(p, np.maximum)),
    (1001, "int16", R.MIN, lambda p, n: fold(p, np.minimum)),
    (40_000, "float64", R.PRODUCT, lambda p, n: fold(p, np.multiply)),
    (999, "uint8", R.BXOR, lambda p, n: fold(p, np.bitwise_xor)),
    (999, "int32", R.BAND, lambda p, n: fold(p, np.bitwise_and)),
    (999, "uint64", R.BOR, lambda p, n: fold(p, np.bitwise_or)),
    (999, "bool", R.SUM, lambda p, n: fold(p, np.logical_or)),
    (20_000, "float64", R.AVG, lambda p, n: fold(p, np.add) / n),
    (20_000, "float32", R.PREMUL_SUM(0.5), lambda p, n: fold([x * np.float32(0.5) for x in p], np.add)),
    (500, "complex128", R.SUM, lambda p, n: fold(p, np.add)),
]


def sizes_uneven(n: int, scale: int) -> list[int]:
    """Per-rank sizes with zeros in them: rank r has ((3 r) % 4) * scale elements."""
    return [((3 * r) % 4) * scale for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
async def test_socket_unrooted_ops(n: int) -> None:
    assert TH.all_reduce(8 * RD_INT64) == "recursive_doubling" and TH.all_reduce(8 * RD_INT64 + 8) == "halving_doubling"
    assert TH.all_reduce(TH.allreduce_ring_min) == "ring"

    async def fn(rank: int) -> None:
        # all_reduce, every op, every schedule
        for count, dtype, op, ref in ALL_REDUCE_CASES:
            lo, hi = (-2, 3) if op == R.PRODUCT else (-50, 50)
            x = vals(rank, count, dtype, lo=lo, hi=hi)
            await dist.all_reduce(x, op=op)
            want = ref([vals(r, count, dtype, lo=lo, hi=hi) for r in range(n)], n).astype(dtype)
            np.testing.assert_array_equal(x, want, err_msg=f"all_reduce {op} {dtype} {count} n={n}")

        # all_gather, uneven sizes (zeros included), Bruck and ring totals
        for scale, dtype in ((1, "int16"), (30_000, "float32")):
            sizes = sizes_uneven(n, scale)
            mine = vals(rank, sizes[rank], dtype, salt=scale)
            outs = [np.full(s, -1, dtype=dtype) for s in sizes]
            await dist.all_gather(outs, mine)
            for r in range(n):
                np.testing.assert_array_equal(outs[r], vals(r, sizes[r], dtype, salt=scale))

        # all_gather_into_tensor / all_gather_single: concatenation and stack forms
        for k in (3, 30_000):
            mine = vals(rank, k, "float32", salt=k)
            want = np.stack([vals(r, k, "float32", salt=k) for r in range(n)])
            cat = np.full(n * k, -1, dtype=np.float32)
            await dist.all_gather_into_tensor(cat, mine)
            np.testing.assert_array_equal(cat, want.reshape(-1))
            stack = np.full((n, k), -1, dtype=np.float32)
            await dist.all_gather_into_tensor(stack, mine)
            np.testing.assert_array_equal(stack, want)
            single = np.full((n, k), -1, dtype=np.float32)
            await dist.all_gather_single(single, mine)
            np.testing.assert_array_equal(single, want)

        # reduce_scatter (list form), direct and ring totals
        for k, dtype, op, ref in (
            (5, "float64", R.SUM, np.add),
            (30_000, "int32", R.MAX, np.maximum),
            (6, "float32", R.PREMUL_SUM(0.5), lambda a, b: a + b),
            (30_000, "float64", R.PREMUL_SUM(0.25), lambda a, b: a + b),
        ):
            ins = [vals(rank, k, dtype, salt=j) for j in range(n)]
            out = np.full(k, -1, dtype=dtype)
            await dist.reduce_scatter(out, ins, op=op)
            factor: float = getattr(op, "factor", 1.0)
            np.testing.assert_array_equal(out, fold([vals(r, k, dtype, salt=rank) * np.dtype(dtype).type(factor) for r in range(n)], ref))
            for j in range(n):  # inputs are inputs: PREMUL_SUM scales a copy
                np.testing.assert_array_equal(ins[j], vals(rank, k, dtype, salt=j))

        # reduce_scatter_tensor / reduce_scatter_single: concatenation and stack forms
        for k, dtype, op in ((4, "int64", R.SUM), (30_000, "float64", R.AVG), (7, "float32", R.PREMUL_SUM(2.0))):
            full = vals(rank, n * k, dtype, salt=k)
            parts = [vals(r, n * k, dtype, salt=k)[rank * k : (rank + 1) * k] for r in range(n)]
            if op == R.PREMUL_SUM:
                parts = [p * 2 for p in parts]
            want = fold(parts, np.add)
            if op == R.AVG:
                want = want / n
            out = np.full(k, -1, dtype=dtype)
            await dist.reduce_scatter_tensor(out, full, op=op)
            np.testing.assert_array_equal(out, want.astype(dtype))
            out2 = np.full(k, -1, dtype=dtype)
            await dist.reduce_scatter_tensor(out2, full.reshape(n, k), op=op)
            np.testing.assert_array_equal(out2, want.astype(dtype))
            out3 = np.full(k, -1, dtype=dtype)
            await dist.reduce_scatter_single(out3, full.reshape(n, k), op=op)
            np.testing.assert_array_equal(out3, want.astype(dtype))
            np.testing.assert_array_equal(full, vals(rank, n * k, dtype, salt=k))  # the input is left as it was

        # all_to_all: uneven sizes (zeros included), burst and pairwise
        for scale in (1, 20_000):

            def size(i: int, j: int, scale: int = scale) -> int:  # what rank i sends rank j
                return ((i + 2 * j) % 3) * scale

            ins = [np.arange(size(rank, j), dtype=np.int64) + 1_000_000 * (10 * rank + j) for j in range(n)]
            outs = [np.full(size(i, rank), -1, dtype=np.int64) for i in range(n)]
            await dist.all_to_all(outs, ins)
            for i in range(n):
                np.testing.assert_array_equal(outs[i], np.arange(size(i, rank)) + 1_000_000 * (10 * i + rank))

        # all_to_all_single: uneven splits of 2-D rows, burst and pairwise
        for scale in (1, 10_000):

            def rows(i: int, j: int, scale: int = scale) -> int:  # rows rank i sends rank j
                return ((i + j) % 3) * scale + (1 if j == 0 else 0)

            in_splits = [rows(rank, j) for j in range(n)]
            out_splits = [rows(i, rank) for i in range(n)]
            inp = np.concatenate(
                [np.arange(3 * s, dtype=np.int64).reshape(s, 3) + 1_000_000 * (10 * rank + j) for j, s in enumerate(in_splits)]
            )
            out = np.full((sum(out_splits), 3), -1, dtype=np.int64)
            await dist.all_to_all_single(out, inp, out_splits, in_splits)
            want = np.concatenate(
                [np.arange(3 * s, dtype=np.int64).reshape(s, 3) + 1_000_000 * (10 * i + rank) for i, s in enumerate(out_splits)]
            )
            np.testing.assert_array_equal(out, want)

        # barrier, sync and async
        await dist.barrier()
        w = issued(await dist.barrier(async_op=True))
        assert await w.wait() is True and w.is_success()

    await run_gloo(n, fn)


# -- socket backend: all_reduce is bitwise identical on every rank, on every path --------------

RD_F32 = TH.allreduce_rd_max // 4
RING_F32 = TH.allreduce_ring_min // 4
PATHS = {
    "recursive_doubling": RD_F32,  # the largest recursive-doubling size
    "halving_doubling_low": RD_F32 + 1,  # the smallest above it
    "halving_doubling_high": RING_F32 - 1,  # the largest below the ring
    "ring": RING_F32,  # the smallest ring size
    "ring_odd": RING_F32 + 3,  # ring, not a multiple of the world size or of the pipeline piece
}


def _bitwise_params() -> list[Any]:
    return [pytest.param(n, name, id=f"{n}-{name}") for n in (2, 3, 4, 5) for name in PATHS]


@pytest.mark.parametrize(("n", "path"), _bitwise_params())
async def test_socket_all_reduce_bitwise_identical(n: int, path: str) -> None:
    count = PATHS[path]
    assert TH.all_reduce(4 * count) == {"recursive_doubling": "recursive_doubling", "ring": "ring", "ring_odd": "ring"}.get(
        path, "halving_doubling"
    )

    def data(rank: int) -> np.ndarray:
        return np.random.default_rng([rank, count]).standard_normal(count).astype(np.float32)

    async def fn(rank: int) -> tuple[str, np.ndarray]:
        assert world_pg().thresholds.all_reduce(4 * count) == TH.all_reduce(4 * count)
        x = data(rank)
        await dist.all_reduce(x)
        return hashlib.sha256(x.tobytes()).hexdigest(), x

    results = await run_gloo(n, fn)
    digests = {d for d, _ in results}
    assert len(digests) == 1, f"all_reduce results differ across ranks ({path}, n={n})"
    want = np.sum([data(r).astype(np.float64) for r in range(n)], axis=0)
    np.testing.assert_allclose(results[0][1], want, rtol=1e-5, atol=1e-5)


async def test_socket_message_sent_before_the_sender_leaves_is_delivered() -> None:
    """Rank 0's send returns (its bytes are handed to the transport), rank 0 returns and run_world
    destroys its World; rank 1 posts the matching recv a little later and must still get the
    message, as it would from torch's gloo (TCP delivers what was written before the close). The
    same race fails ops whose ranks finish at different times: broadcast_object_list and
    gather_object over gloo every time, and large all_reduces at 5 ranks now and then."""

    async def fn(rank: int) -> bool | None:
        if rank == 0:
            await dist.send(np.arange(4, dtype=np.float64), dst=1)
            return None
        await asyncio.sleep(0.2)  # rank 0 has sent, returned and destroyed its World
        x = np.empty(4)
        await dist.recv(x, src=0)
        return bool((x == np.arange(4)).all())

    assert await run_world(2, fn, backend="gloo", timeout=TIMEOUT) == [None, True]


# -- socket backend: every schedule forced, at awkward sizes ---------------------------------------

_BIG = 1 << 40
FORCED: dict[str, dict[str, int]] = {
    # the bandwidth schedules for every size (chain, ring, pairwise), in tiny pipeline pieces
    "bandwidth": {
        "broadcast_tree_max": -1,
        "allreduce_rd_max": -1,
        "allreduce_ring_min": 0,
        "allgather_bruck_max": -1,
        "reduce_scatter_direct_max": -1,
        "alltoall_burst_max": -1,
        "pipeline_piece": 24,
    },
    # recursive halving/doubling for every all_reduce, odd pieces
    "halving": {"allreduce_rd_max": -1, "allreduce_ring_min": _BIG, "pipeline_piece": 40},
    # the latency schedules for every size (tree, recursive doubling, Bruck, direct, burst)
    "latency": {
        "broadcast_tree_max": _BIG,
        "allreduce_rd_max": _BIG,
        "allreduce_ring_min": _BIG,
        "allgather_bruck_max": _BIG,
        "reduce_scatter_direct_max": _BIG,
        "alltoall_burst_max": _BIG,
    },
}
EXPECTED_ALL_REDUCE = {"bandwidth": "ring", "halving": "halving_doubling", "latency": "recursive_doubling"}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", list(FORCED))
async def test_socket_forced_schedules_at_awkward_sizes(variant: str, n: int) -> None:
    """Each schedule family forced through the default group's pg_options over sizes that do
    not divide evenly: empty, one element, fewer elements than ranks, n + 1, and enough for
    hundreds of pipeline pieces."""
    counts = sorted({0, 1, max(n - 1, 1), n + 1, 2 * n + 3, 301})

    async def fn(rank: int) -> list[str]:
        th = world_pg().thresholds
        assert th.all_reduce(8 * 1_000_000) == th.all_reduce(8) == EXPECTED_ALL_REDUCE[variant]
        digests = []
        for count in counts:
            for root in range(n):
                b = vals(rank, count, "float64", salt=root)
                await dist.broadcast(b, src=root)
                np.testing.assert_array_equal(b, vals(root, count, "float64", salt=root))
                r = vals(rank, count, "int64", salt=root)
                await dist.reduce(r, dst=root)
                if rank == root:
                    np.testing.assert_array_equal(r, fold([vals(q, count, "int64", salt=root) for q in range(n)], np.add))
            x = vals(rank, count, "int32")
            await dist.all_reduce(x)
            np.testing.assert_array_equal(x, fold([vals(q, count, "int32") for q in range(n)], np.add), err_msg=f"count {count}")
            m = vals(rank, count, "float64", salt=5)
            await dist.all_reduce(m, op=R.MIN)
            np.testing.assert_array_equal(m, fold([vals(q, count, "float64", salt=5) for q in range(n)], np.minimum))
            f = np.random.default_rng([rank, count]).standard_normal(count).astype(np.float32)
            await dist.all_reduce(f)
            digests.append(hashlib.sha256(f.tobytes()).hexdigest())
            # all_gather with per-rank sizes around count (zeros included)
            sizes = [(count + q) % (count + 2) for q in range(n)]
            outs = [np.full(s, -1, dtype=np.int16) for s in sizes]
            await dist.all_gather(outs, vals(rank, sizes[rank], "int16", salt=count))
            for q in range(n):
                np.testing.assert_array_equal(outs[q], vals(q, sizes[q], "int16", salt=count))
            cat = np.full((n, count), -1, dtype=np.float32)
            await dist.all_gather_into_tensor(cat, vals(rank, count, "float32", salt=9))
            np.testing.assert_array_equal(cat, np.stack([vals(q, count, "float32", salt=9) for q in range(n)]))
            rs = np.full(count, -1, dtype=np.int64)
            await dist.reduce_scatter_tensor(rs, vals(rank, n * count, "int64", salt=3))
            np.testing.assert_array_equal(
                rs, fold([vals(q, n * count, "int64", salt=3)[rank * count : (rank + 1) * count] for q in range(n)], np.add)
            )
            rl = np.full(count, -1, dtype=np.float64)
            await dist.reduce_scatter(rl, [vals(rank, count, "float64", salt=10 + j) for j in range(n)], op=R.MAX)
            np.testing.assert_array_equal(rl, fold([vals(q, count, "float64", salt=10 + rank) for q in range(n)], np.maximum))
            a2a_in = [np.full((count + i + rank) % (count + 1), 100 * rank + i, dtype=np.int64) for i in range(n)]
            a2a_out = [np.full((count + rank + i) % (count + 1), -1, dtype=np.int64) for i in range(n)]
            await dist.all_to_all(a2a_out, a2a_in)
            for i in range(n):
                assert (a2a_out[i] == 100 * i + rank).all()
            single_in = np.arange(n * count, dtype=np.int64) + 1000 * rank
            single_out = np.full(n * count, -1, dtype=np.int64)
            await dist.all_to_all_single(single_out, single_in)
            want = np.concatenate([np.arange(rank * count, (rank + 1) * count) + 1000 * q for q in range(n)]) if count else np.empty(0)
            np.testing.assert_array_equal(single_out, want)
        await dist.barrier()
        return digests

    results = await run_gloo(n, fn, pg_options=FORCED[variant])
    assert all(d == results[0] for d in results), "float32 all_reduce results differ across ranks"


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("variant", list(FORCED))
async def test_socket_all_reduce_bitwise_identical_every_float_dtype_and_op(variant: str, n: int) -> None:
    """Random data with NaNs, infinities and signed zeros, where the order of a reduction shows in
    its bits: every rank still ends with the same bits, for every floating dtype and op."""
    rules = {**FORCED[variant], "pipeline_piece": 1000}  # still several pieces per chunk, fewer messages
    count = 1001

    def data(rank: int, dtype: str) -> np.ndarray:
        rng = np.random.default_rng([rank, 99])
        x = rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)
        x[rng.integers(0, count, 20)] = np.nan
        x[rng.integers(0, count, 20)] = np.inf
        x[rng.integers(0, count, 20)] = -0.0
        x[rng.integers(0, count, 20)] = 0.0
        if dtype.startswith("complex"):
            return (x + 1j * rng.standard_normal(count)).astype(dtype)
        return x.astype(dtype)

    async def fn(rank: int) -> list[str]:
        th = world_pg().thresholds  # the group's own rules took: this variant's schedule at every size
        assert th.all_reduce(8 * count) == th.all_reduce(8) == EXPECTED_ALL_REDUCE[variant] and th.pipeline_piece == 1000
        out = []
        for dtype in ("float16", "float32", "float64", "complex64", "complex128"):
            for kind in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.PREMUL_SUM):
                if not valid(kind, dtype):
                    continue
                x = data(rank, dtype)
                with np.errstate(all="ignore"):
                    await dist.all_reduce(x, op=R.PREMUL_SUM(0.3) if kind == R.PREMUL_SUM else kind)
                out.append(f"{dtype} {kind.name} {hashlib.sha256(x.tobytes()).hexdigest()}")
        return out

    results = await run_gloo(n, fn, pg_options=rules)
    for r in range(1, n):
        assert results[r] == results[0], f"rank {r} differs from rank 0: {set(results[r]) - set(results[0])}"


# -- socket backend: several async ops in flight on one group, awaited out of order ------------


@pytest.mark.parametrize("n", [3, 4])
async def test_socket_async_ops_in_flight_awaited_out_of_order(n: int) -> None:
    async def fn(rank: int) -> None:
        pg = world_pg()
        start = pg.seq
        a = vals(rank, 1000, "int64")
        big = vals(rank, RD_INT64 * 3, "int64", salt=1)  # halving/doubling
        b = vals(rank, 50, "float64", salt=2)
        gathered = [np.full(r + 1, -1, dtype=np.int32) for r in range(n)]
        rs_in = vals(rank, 4 * n, "float32", salt=3)
        rs_out = np.full(4, -1, dtype=np.float32)
        a2a_out = np.full(2 * n, -1, dtype=np.int64)
        works = [
            issued(await dist.all_reduce(a, async_op=True)),
            issued(await dist.all_reduce(big, op=R.MAX, async_op=True)),
            issued(await dist.broadcast(b, src=n - 1, async_op=True)),
            issued(await dist.all_gather(gathered, np.full(rank + 1, rank, dtype=np.int32), async_op=True)),
            issued(await dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True)),
            issued(await dist.all_to_all_single(a2a_out, np.arange(2 * n, dtype=np.int64) + 100 * rank, async_op=True)),
            issued(await dist.barrier(async_op=True)),
        ]
        assert [w.seq for w in works] == list(range(start, start + len(works)))
        order = list(range(len(works)))
        np.random.default_rng(rank).shuffle(order)  # a different order on every rank
        for k, i in enumerate(order):
            if k % 2:
                assert await works[i].wait() is True
            else:
                await works[i]
        assert all(w.is_completed() and w.is_success() for w in works)
        np.testing.assert_array_equal(a, fold([vals(r, 1000, "int64") for r in range(n)], np.add))
        np.testing.assert_array_equal(big, fold([vals(r, RD_INT64 * 3, "int64", salt=1) for r in range(n)], np.maximum))
        np.testing.assert_array_equal(b, vals(n - 1, 50, "float64", salt=2))
        for r in range(n):
            assert (gathered[r] == r).all()
        np.testing.assert_array_equal(rs_out, fold([vals(r, 4 * n, "float32", salt=3)[4 * rank : 4 * rank + 4] for r in range(n)], np.add))
        assert a2a_out.tolist() == [100 * i + 2 * rank + k for i in range(n) for k in range(2)]
        # the group is still in step afterwards
        c = np.ones(3)
        await dist.all_reduce(c)
        assert (c == n).all()

    await run_gloo(n, fn)


# -- socket backend: sub-groups ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 5])
async def test_socket_sub_groups(n: int) -> None:
    odd_ranks = list(range(1, n, 2))
    even_ranks = list(range(0, n, 2))

    async def on_group(g: dist.ProcessGroup, members: list[int], rank: int) -> None:
        """Every collective on ``g`` (members in group-rank order), checked against numpy."""
        m, me = len(members), members.index(rank)
        assert g.rank() == me and g.size() == m and dist.get_process_group_ranks(g) == members
        x = np.full(5, rank + 1, dtype=np.int64)
        await dist.all_reduce(x, group=g)
        assert (x == sum(r + 1 for r in members)).all()
        y = np.full(3, float(rank))
        await dist.broadcast(y, src=members[-1], group=g)  # src is a global rank
        assert (y == members[-1]).all()
        z = np.full(4, rank, dtype=np.int32)
        await dist.reduce(z, group_dst=m - 1, op=R.MAX, group=g)
        if me == m - 1:
            assert (z == max(members)).all()
        gl = [np.empty(2, dtype=np.int16) for _ in range(m)] if me == 0 else None
        await dist.gather(np.full(2, rank, dtype=np.int16), gl, group_dst=0, group=g)
        if gl is not None:
            assert [int(t[0]) for t in gl] == members
        out = np.empty(2, dtype=np.float32)
        sl = [np.full(2, 10.0 * j, dtype=np.float32) for j in range(m)] if me == m - 1 else None
        await dist.scatter(out, sl, src=members[-1], group=g)
        assert (out == 10.0 * me).all()
        ag = [np.empty(j + 1, dtype=np.int64) for j in range(m)]
        await dist.all_gather(ag, np.full(me + 1, rank, dtype=np.int64), group=g)
        assert [int(t[0]) for t in ag] == members and [t.size for t in ag] == list(range(1, m + 1))
        rs = np.empty(2, dtype=np.int64)
        await dist.reduce_scatter_tensor(rs, np.arange(2 * m, dtype=np.int64) * (rank + 1), group=g)
        assert rs.tolist() == [k * sum(r + 1 for r in members) for k in (2 * me, 2 * me + 1)]
        a2a = np.empty(m, dtype=np.int64)
        await dist.all_to_all_single(a2a, np.arange(m, dtype=np.int64) + 100 * rank, group=g)
        assert a2a.tolist() == [100 * r + me for r in members]
        await dist.barrier(group=g)

    async def fn(rank: int) -> None:
        odd = await dist.new_group(odd_ranks, group_desc="odd")
        even = await dist.new_group(even_ranks, group_desc="even")
        backwards = await dist.new_group(list(range(n - 1, -1, -1)), sort_ranks=False, group_desc="backwards")
        assert isinstance(backwards, dist.ProcessGroup)
        mine, other = (odd, even) if rank % 2 else (even, odd)
        assert isinstance(mine, dist.ProcessGroup) and other == dist.NON_GROUP_MEMBER
        members = odd_ranks if rank % 2 else even_ranks
        # disjoint groups at the same time, and the default group in between
        await asyncio.gather(on_group(mine, members, rank), on_group(backwards, list(range(n - 1, -1, -1)), rank))
        # ops of a sub-group and of the default group in flight together
        s, t = np.ones(2), np.ones(2)
        w1 = issued(await dist.all_reduce(s, group=mine, async_op=True))
        w2 = issued(await dist.all_reduce(t, async_op=True))
        await w2
        await w1
        assert (s == len(members)).all() and (t == n).all()
        # a group made by its members only
        if rank in (0, n - 1):
            local = await dist.new_group([n - 1, 0], use_local_synchronization=True, sort_ranks=False)
            assert isinstance(local, dist.ProcessGroup)
            await on_group(local, [n - 1, 0], rank)
        await dist.barrier()

    await run_gloo(n, fn)


# -- socket backend: point-to-point ----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 5])
async def test_socket_p2p_batches_sub_groups_any_source_and_tags(n: int) -> None:
    async def fn(rank: int) -> None:
        # a ring both ways in one batch (receives listed before sends), small and large
        right, left = (rank + 1) % n, (rank - 1) % n
        for size in (3, 300_000):
            s1, s2 = np.full(size, rank, dtype=np.float64), np.full(size, -rank, dtype=np.float64)
            r1, r2 = np.empty(size), np.empty(size)
            reqs = await dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.irecv, r1, left),
                    dist.P2POp(dist.isend, s1, right),
                    dist.P2POp(dist.isend, s2, left),
                    dist.P2POp(dist.irecv, r2, right),
                ]
            )
            await asyncio.gather(*(r.wait() for r in reqs))
            assert (r1 == left).all() and (r2 == -right).all()
        # twenty tags, received in the reverse order of sending
        if rank < 2:
            peer = 1 - rank
            sends = [await dist.isend(np.array([100 * rank + tag]), dst=peer, tag=tag) for tag in range(20)]
            outs = [np.empty(1, dtype=np.int64) for _ in range(20)]
            recvs = [await dist.irecv(outs[tag], src=peer, tag=tag) for tag in reversed(range(20))]
            await asyncio.gather(*sends, *recvs)
            assert [int(o[0]) for o in outs] == [100 * peer + tag for tag in range(20)]
        # a sub-group in reverse order: group ranks, and any-source receives naming global ranks
        members = list(range(n - 1, -1, -2))
        g = await dist.new_group(members, sort_ranks=False)
        if rank in members:
            assert isinstance(g, dist.ProcessGroup)
            if g.rank() == 0:
                got = []
                for _ in range(len(members) - 1):
                    t = np.empty(1, dtype=np.int64)
                    got.append((await dist.recv(t, group=g), int(t[0])))
                assert sorted(got) == [(r, r) for r in sorted(members[1:])]
            else:
                await dist.send(np.array([rank]), group_dst=0, group=g)

    await run_gloo(n, fn)


# -- memory backend: every dtype x every ReduceOp ----------------------------------------------------

NUMPY_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
KINDS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.AVG, R.PREMUL_SUM]
FACTOR = 0.5


def valid(kind: Any, dtype: str) -> bool:
    """The rules, restated from torch's documentation and aiodist.types (not read from its table)."""
    kind_of = np.dtype(dtype).kind if dtype != "bfloat16" else "f"
    if kind in (R.BAND, R.BOR, R.BXOR):
        return kind_of in "biu"
    if kind in (R.MIN, R.MAX, R.PRODUCT):  # torch refuses all three on complex
        return kind_of != "c"
    if kind in (R.AVG, R.PREMUL_SUM):
        return kind_of in "fc"
    return True


def as_op(kind: Any) -> Any:
    return R.PREMUL_SUM(FACTOR) if kind == R.PREMUL_SUM else kind


def dtype_data(rank: int, dtype: str, count: int = 23) -> np.ndarray:
    """Full-range integers (SUM/PRODUCT wrap, as numpy's do), small exact values for floats."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng([rank, dt.num, 11])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if dt.kind == "c":
        return (rng.integers(-3, 4, count) + 1j * rng.integers(-3, 4, count)).astype(dt)
    return rng.integers(-3, 4, count).astype(dt)


def numpy_reduce(parts: list[np.ndarray], kind: Any, n: int) -> np.ndarray:
    dt = parts[0].dtype
    with np.errstate(all="ignore"):
        f: Any
        if dt == np.bool_:
            f = {
                R.SUM: np.logical_or,
                R.MAX: np.logical_or,
                R.BOR: np.logical_or,
                R.PRODUCT: np.logical_and,
                R.MIN: np.logical_and,
                R.BAND: np.logical_and,
                R.BXOR: np.logical_xor,
            }[kind]
            return fold(parts, f)
        if kind == R.PREMUL_SUM:
            scale = dt.type(FACTOR) if dt.kind == "f" else np.dtype(dt).type(FACTOR)
            return fold([(p * scale).astype(dt) for p in parts], np.add)
        f = {
            R.SUM: np.add,
            R.AVG: np.add,
            R.PRODUCT: np.multiply,
            R.MIN: np.minimum,
            R.MAX: np.maximum,
            R.BAND: np.bitwise_and,
            R.BOR: np.bitwise_or,
            R.BXOR: np.bitwise_xor,
        }[kind]
        acc = fold(parts, f)
        if kind == R.AVG and n > 1:
            if dt == np.float16:
                return (acc.astype(np.float32) / np.float32(n)).astype(dt)
            if dt.kind == "c":  # parts divided separately (numpy's complex division is not correctly rounded)
                return (acc.real / n + 1j * (acc.imag / n)).astype(dt)
            return (acc / n).astype(dt)
        return acc


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
async def test_memory_every_dtype_every_op(dtype: str, n: int) -> None:
    async def fn(rank: int) -> None:
        pg = world_pg()
        for kind in KINDS:
            op = as_op(kind)
            parts = [dtype_data(r, dtype) for r in range(n)]
            x = dtype_data(rank, dtype)
            y = dtype_data(rank, dtype)
            full = np.concatenate([dtype_data(rank, dtype) for _ in range(n)])
            out = np.zeros(x.size, dtype=dtype)
            if not valid(kind, dtype):
                seq = pg.seq
                for call in (
                    partial(dist.all_reduce, x, op=op),
                    partial(dist.reduce, y, dst=0, op=op),
                    partial(dist.reduce_scatter_tensor, out, full, op=op),
                    partial(dist.all_reduce, x, op=op, async_op=True),
                ):
                    with pytest.raises((TypeError, ValueError)) as info:
                        await call()
                    assert kind.name in str(info.value) and dtype in str(info.value), str(info.value)
                assert pg.seq == seq, "a refused op took a sequence number"
                np.testing.assert_array_equal(x, dtype_data(rank, dtype))
                continue
            want = numpy_reduce(parts, kind, n)
            await dist.all_reduce(x, op=op)
            np.testing.assert_array_equal(x, want, err_msg=f"all_reduce {kind.name} {dtype} n={n}")
            await dist.reduce(y, dst=n - 1, op=op)
            np.testing.assert_array_equal(y, want if rank == n - 1 else dtype_data(rank, dtype), err_msg=f"reduce {kind.name} {dtype}")
            await dist.reduce_scatter_tensor(out, full, op=op)
            np.testing.assert_array_equal(out, want, err_msg=f"reduce_scatter_tensor {kind.name} {dtype}")
        # still usable after every refusal
        z = np.ones(2, dtype=dtype)
        await dist.all_reduce(z, op=R.SUM)
        assert z.tolist() == np.full(2, n, dtype=dtype).tolist()

    await run_world(n, fn)


async def test_memory_op_forms_and_refused_ops() -> None:
    """Every way to name an op; PREMUL_SUM without a factor, and non-ops, refused before issue."""

    async def fn(rank: int) -> None:
        pg = world_pg()
        for op in (
            R.SUM,
            R(R.SUM),
            dist.ReduceOp.RedOpType.SUM,
            R.PREMUL_SUM(1),
            R.PREMUL_SUM(np.float32(1.0)),
            R.PREMUL_SUM(np.array([1.0])),
        ):
            x = np.full(3, rank + 1.0)
            await dist.all_reduce(x, op=op)
            assert (x == 3).all(), op
        seq = pg.seq
        bad: Any
        for bad in (R.PREMUL_SUM, "sum", 0, None, np.add):
            with pytest.raises((TypeError, ValueError)):
                await dist.all_reduce(np.ones(2), op=bad)
        for factor in (True, 1j, "2", np.array([1.0, 2.0])):
            with pytest.raises((TypeError, ValueError)):
                R.PREMUL_SUM(factor)
        assert pg.seq == seq
        x = np.full(2, float(rank))
        await dist.all_reduce(x, op=R.PREMUL_SUM(-2.0))
        assert (x == -2.0).all()

    await run_world(2, fn)


async def test_memory_float_specials() -> None:
    """MIN/MAX propagate NaN; overflow gives inf; integer SUM wraps; no warnings, no errors."""

    async def fn(rank: int) -> None:
        f = np.array([np.nan if rank == 0 else 1.0, 1.0, -0.0 if rank else 0.0], dtype=np.float32)
        g = f.copy()
        await dist.all_reduce(f, op=R.MIN)
        await dist.all_reduce(g, op=R.MAX)
        assert np.isnan(f[0]) and np.isnan(g[0]) and f[1] == 1 and g[1] == 1
        h = np.array([60000.0], dtype=np.float16)
        await dist.all_reduce(h)
        assert np.isinf(h[0])
        i = np.array([127], dtype=np.int8)
        await dist.all_reduce(i)
        assert i[0] == np.int8(-2)
        big = np.array([np.finfo(np.float16).max], dtype=np.float16)
        await dist.all_reduce(big, op=R.PREMUL_SUM(0.5))  # prescaled: no overflow
        assert big[0] == np.finfo(np.float16).max

    with np.errstate(all="raise"):
        await run_world(2, fn)


# -- memory backend: torch CPU tensors ---------------------------------------------------------------


TORCH_DTYPES = [*NUMPY_DTYPES, "bfloat16"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
async def test_memory_torch_tensors_every_op_in_place(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    n = 3

    def tdata(rank: int) -> Any:
        g = torch.Generator().manual_seed(rank)
        v = torch.randint(-3, 4, (2, 5), generator=g)
        if dtype == "bool":
            return v > 0
        if dtype.startswith("complex"):
            return (v + 1j * torch.randint(-3, 4, (2, 5), generator=g)).to(tdt)
        if dtype.startswith("uint"):
            v = v + 3
        return v.to(tdt)

    def tref(kind: Any) -> Any:
        if dtype != "bfloat16":  # numpy has the dtype (torch lacks most ops on uint16/32/64)
            return torch.from_numpy(numpy_reduce([tdata(r).numpy() for r in range(n)], kind, n))
        # bfloat16: torch's own arithmetic, one rounding per step, AVG divided once in float32
        f = {R.SUM: torch.add, R.AVG: torch.add, R.PREMUL_SUM: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum, R.MAX: torch.maximum}[
            kind
        ]
        parts = [tdata(r) * FACTOR if kind == R.PREMUL_SUM else tdata(r) for r in range(n)]
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = f(acc, p).to(tdt)
        if kind == R.AVG:
            acc = (acc.to(torch.float32) / n).to(tdt)
        return acc

    async def fn(rank: int) -> None:
        pg = world_pg()
        for kind in KINDS:
            t = tdata(rank)
            ptr = t.data_ptr()
            if not valid(kind, dtype):
                seq = pg.seq
                with pytest.raises((TypeError, ValueError)):
                    await dist.all_reduce(t, op=as_op(kind))
                assert pg.seq == seq and torch.equal(t, tdata(rank))
                continue
            await dist.all_reduce(t, op=as_op(kind))
            assert t.data_ptr() == ptr and t.dtype == tdt and t.shape == (2, 5)
            assert torch.equal(t, tref(kind)), f"{kind.name} {dtype}: {t} != {tref(kind)}"
            r = tdata(rank)
            await dist.reduce(r, dst=0, op=as_op(kind))
            assert torch.equal(r, tref(kind) if rank == 0 else tdata(rank)), f"reduce {kind.name} {dtype}"
        # a non-contiguous output is refused, a non-contiguous input is fine
        nc = tdata(rank).t()
        seq = pg.seq
        with pytest.raises(ValueError):
            await dist.all_reduce(nc)
        assert pg.seq == seq
        outs = [torch.zeros((5, 2), dtype=tdt) for _ in range(n)]
        await dist.all_gather(outs, nc)
        assert all(torch.equal(outs[r], tdata(r).t()) for r in range(n))

    await run_world(n, fn)


async def test_memory_torch_reduce_ops_and_factors() -> None:
    """torch's own ReduceOp objects and a tensor factor are accepted."""
    torch = pytest.importorskip("torch")
    import torch.distributed as tdist

    async def fn(rank: int) -> None:
        t = torch.full((3,), float(rank + 1))
        torch_max: Any = tdist.ReduceOp.MAX
        await dist.all_reduce(t, op=torch_max)
        assert t.tolist() == [2.0] * 3
        u = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
        await dist.all_reduce(u, op=R.PREMUL_SUM(torch.tensor(2.0)))
        assert u.dtype == torch.bfloat16 and u.tolist() == [6.0] * 3

    await run_world(2, fn)
