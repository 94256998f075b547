"""The torch-like layer (aiodist.c10d) over the in-memory backend, through run_world: world
sizes 1-5, every root, results against numpy, Work, timeouts, validation, groups, destroy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.backends import CommBackend, create_memory_backend
from aiodist.store import HashStore
from aiodist.testing import run_world

SIZES = [1, 2, 3, 4, 5]


def issued(work: dist.Work | None) -> dist.Work:
    assert isinstance(work, dist.Work)
    return work


def data(rank: int, n: int, dtype: str = "float32", salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    if np.dtype(dtype).kind == "c":
        return (rng.integers(-8, 8, n) + 1j * rng.integers(-8, 8, n)).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 50, n).astype(dtype)
    return rng.integers(-50, 50, n).astype(dtype)


# -- World, queries ------------------------------------------------------------------------------


async def test_not_initialized_outside_a_world() -> None:
    assert not dist.is_initialized()
    assert dist.GroupMember.WORLD is None
    with pytest.raises(ValueError, match="not been initialized"):
        dist.get_rank()
    with pytest.raises(ValueError, match="not been initialized"):
        await dist.all_reduce(np.zeros(2))


@pytest.mark.parametrize("n", SIZES)
async def test_queries(n: int) -> None:
    async def fn(rank: int) -> None:
        assert dist.is_initialized()
        assert dist.get_rank() == rank and dist.get_world_size() == n
        assert dist.get_backend() == "memory"
        assert dist.get_pg_count() == 1
        assert dist.get_process_group_ranks(None) == list(range(n))
        pg = dist.GroupMember.WORLD
        assert pg is not None and pg is dist.group.WORLD
        assert pg.rank() == rank and pg.size() == n
        assert dist.get_group_rank(pg, rank) == rank and dist.get_global_rank(pg, rank) == rank
        assert dist.current_world().rank == rank

    await run_world(n, fn)
    assert not dist.is_initialized()  # the process World is untouched


def test_availability_and_backend_names() -> None:
    assert dist.is_available() and dist.is_gloo_available()
    assert not dist.is_nccl_available() and not dist.is_mpi_available()
    assert not dist.is_ucc_available() and not dist.is_xccl_available()
    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO
    assert dist.Backend("memory") == "memory"
    assert dist.is_backend_available("memory") and dist.is_backend_available("gloo")
    with pytest.raises(ValueError, match="(?i)did you forget to register"):
        dist.Backend("nope")
    assert dist.get_default_backend_for_device("cpu") == "gloo"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_gloo_over_loopback_sockets(n: int) -> None:
    """The same API over the CPU socket backend (aiodist.transport), real connections."""

    async def fn(rank: int) -> None:
        assert dist.get_backend() == "gloo"
        for root in range(n):
            b = np.full(5, float(rank))
            await dist.broadcast(b, src=root)
            assert (b == root).all()
        x = data(rank, 10_000, "float32")
        await dist.all_reduce(x)
        np.testing.assert_array_equal(x, sum(data(r, 10_000, "float32") for r in range(n)))
        outs = [np.empty(r + 1, dtype=np.int16) for r in range(n)]
        await dist.all_gather(outs, np.full(rank + 1, rank, dtype=np.int16))
        assert all((outs[r] == r).all() for r in range(n))
        out = np.empty(2 * n, dtype=np.int64)
        await dist.all_to_all_single(out, np.arange(2 * n, dtype=np.int64) + 100 * rank)
        assert out.tolist() == [100 * i + 2 * rank + k for i in range(n) for k in range(2)]
        if n > 1:
            peer = (rank + 1) % n
            w1 = await dist.isend(np.array([rank, 1]), dst=peer, tag=1)
            w2 = await dist.isend(np.array([rank, 2]), dst=peer, tag=2)
            got2, got1 = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.int64)
            await dist.recv(got2, src=(rank - 1) % n, tag=2)
            await dist.recv(got1, src=(rank - 1) % n, tag=1)
            await w1.wait()
            await w2.wait()
            assert got1.tolist() == [(rank - 1) % n, 1] and got2.tolist() == [(rank - 1) % n, 2]
        g = await dist.new_group(sorted({0, n - 1}))
        if isinstance(g, dist.ProcessGroup):
            z = np.ones(3)
            await dist.all_reduce(z, group=g)
            assert (z == g.size()).all()
        await dist.barrier()

    await run_world(n, fn, backend="gloo", timeout=5)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.6 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("backend", ["gloo", "memory"])
async def test_a_broken_group_is_aborted_on_the_peers(backend: str) -> None:
    """Rank 1 gives up on the group early (its timeout is shorter); its ABORT fails rank 2's
    pending op on the group at once, not at rank 2's own 30 s timeout (both backends)."""

    async def fn(rank: int) -> str | None:
        await dist.barrier()  # connects every pair (the transport tells connected peers)
        g = await dist.new_group(timeout=0.3 if rank == 1 else 30, group_desc="g")
        if rank == 0:
            await asyncio.sleep(1.6)  # alive, connected, never joins
            return None
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(dist.DistError) as info:
            await dist.all_reduce(np.ones(4), group=g)
        assert loop.time() - start < 1.3  # its own 0.3 s timeout (~0.3 s here), not rank 0's return at 1.6 s
        return f"{type(info.value).__name__}: {info.value}"

    msgs = await run_world(3, fn, backend=backend, timeout=10)
    assert msgs[1] is not None and msgs[1].startswith("DistTimeoutError") and "seq 0" in msgs[1]
    assert msgs[2] is not None and "rank 1" in msgs[2] and "g (id 1" in msgs[2]


@pytest.mark.parametrize("n", [2, 4])
async def test_gloo_large_all_reduce_after_broadcasts(n: int) -> None:
    """Pipelined schedules over sockets after small ops (hung in an early transport: asyncio n=4, uvloop n=2)."""

    async def fn(rank: int) -> None:
        for root in range(n):
            await dist.broadcast(np.full(5, float(rank)), src=root)
        x = np.ones(300_000, dtype=np.float32)
        await dist.all_reduce(x)
        assert (x == n).all()
        y = np.ones(2_000_000, dtype=np.float32)  # above the ring threshold
        await dist.all_reduce(y)
        assert (y == n).all()

    await run_world(n, fn, backend="gloo", timeout=10)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_gloo_rank_that_never_joins() -> None:
    async def fn(rank: int) -> str | None:
        g = await dist.new_group(timeout=0.3, group_desc="slow")
        if rank == 0:
            return None
        with pytest.raises(dist.DistTimeoutError) as info:
            await dist.all_reduce(np.ones(4), group=g)
        return str(info.value)

    msg = (await run_world(2, fn, backend="gloo", timeout=10))[1]
    assert msg is not None and "all_reduce" in msg and "slow" in msg and "seq 0" in msg and "[0]" in msg


MADE: list[int] = []


async def creator(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> CommBackend:
    MADE.append(rank)
    return await create_memory_backend(store, rank, world_size, timeout)


async def test_register_backend() -> None:
    MADE.clear()
    if not hasattr(dist.Backend, "TESTMEM"):
        dist.Backend.register_backend("testmem", creator, devices=["cpu"])
    with pytest.raises(ValueError, match="already exist"):
        dist.Backend.register_backend("testmem", creator)

    async def fn(rank: int) -> float:
        x = np.full(3, rank + 1.0)
        await dist.all_reduce(x)
        assert dist.get_backend() == "testmem"
        return float(x[0])

    assert await run_world(3, fn, backend="testmem") == [6.0, 6.0, 6.0]
    assert sorted(MADE) == [0, 1, 2]


async def test_init_twice_and_init_by_url(tmp_path: object) -> None:
    path = f"{tmp_path}/rdzv"

    async def one(rank: int) -> int:
        world = dist.World(f"r{rank}")
        with dist.use_world(world):
            await dist.init_process_group("memory", init_method=f"file://{path}", rank=rank, world_size=2)
            with pytest.raises(ValueError, match="twice"):
                await dist.init_process_group("memory", store=HashStore(), rank=rank, world_size=2)
            x = np.array([rank + 1], dtype=np.int64)
            await dist.all_reduce(x)
            await dist.destroy_process_group()
            assert not dist.is_initialized()
            return int(x[0])

    assert await asyncio.gather(one(0), one(1)) == [3, 3]


async def test_init_argument_errors() -> None:
    with dist.use_world(dist.World()):
        with pytest.raises(ValueError, match="both init_method and store"):
            await dist.init_process_group("memory", init_method="env://", store=HashStore(), rank=0, world_size=1)
        with pytest.raises(ValueError, match="world_size"):
            await dist.init_process_group("memory", store=HashStore(), rank=0)
        with pytest.raises(ValueError, match="out of range"):
            await dist.init_process_group("memory", store=HashStore(), rank=3, world_size=2)
        assert not dist.is_initialized()


# -- collectives against numpy ------------------------------------------------------------------

REDUCTIONS: list[tuple[Any, str, Callable[..., Any]]] = [
    (dist.ReduceOp.SUM, "float32", np.sum),
    (dist.ReduceOp.SUM, "int64", np.sum),
    (dist.ReduceOp.SUM, "complex64", np.sum),
    (dist.ReduceOp.MAX, "int32", np.max),
    (dist.ReduceOp.MIN, "float64", np.min),
    (dist.ReduceOp.PRODUCT, "int16", np.prod),
    (dist.ReduceOp.BXOR, "uint8", np.bitwise_xor.reduce),
    (dist.ReduceOp.AVG, "float64", np.mean),
]


@pytest.mark.parametrize("n", SIZES)
async def test_all_reduce(n: int) -> None:
    async def fn(rank: int) -> None:
        for count in (7, 40_000):
            for op, dtype, ref in REDUCTIONS:
                x = data(rank, count, dtype, salt=count)
                want = ref(np.stack([data(r, count, dtype, salt=count) for r in range(n)]), axis=0).astype(dtype)
                await dist.all_reduce(x, op=op)
                np.testing.assert_allclose(x, want, rtol=1e-6, err_msg=f"{op} {dtype} {count}")
        y = data(rank, 1000) / 7
        await dist.all_reduce(y, op=dist.ReduceOp.PREMUL_SUM(0.5))
        np.testing.assert_allclose(y, sum(data(r, 1000) / 7 * 0.5 for r in range(n)), rtol=1e-5, atol=1e-5)
        out = [np.empty_like(y) for _ in range(n)]
        await dist.all_gather(out, y)
        for o in out:  # bitwise identical on every rank
            assert o.tobytes() == y.tobytes()

    await run_world(n, fn)


@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_and_reduce_every_root(n: int) -> None:
    async def fn(rank: int) -> None:
        for root in range(n):
            x = data(rank, 33, salt=root)
            await dist.broadcast(x, src=root)
            np.testing.assert_array_equal(x, data(root, 33, salt=root))
            y = data(rank, 33, "int64", salt=root)
            before = y.copy()
            await dist.reduce(y, dst=root, op=dist.ReduceOp.SUM)
            if rank == root:
                np.testing.assert_array_equal(y, sum(data(r, 33, "int64", salt=root) for r in range(n)))
            else:
                np.testing.assert_array_equal(y, before)
            z = np.full(4, float(rank + 1))
            await dist.broadcast(z, group_src=root)
            assert (z == root + 1).all()

    await run_world(n, fn)


@pytest.mark.parametrize("n", SIZES)
async def test_gathers_and_scatter_every_root(n: int) -> None:
    async def fn(rank: int) -> None:
        # uneven all_gather: rank r contributes r + 1 elements
        mine = np.full(rank + 1, rank, dtype=np.int32)
        outs = [np.empty(r + 1, dtype=np.int32) for r in range(n)]
        await dist.all_gather(outs, mine)
        for r in range(n):
            assert (outs[r] == r).all()
        # stack form of all_gather_into_tensor
        stacked = np.empty((n, 3), dtype=np.float32)
        await dist.all_gather_into_tensor(stacked, np.full(3, rank, dtype=np.float32))
        np.testing.assert_array_equal(stacked, np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1))
        for root in range(n):
            t = np.full(2, 10 * rank + root, dtype=np.int64)
            gl = [np.empty(2, dtype=np.int64) for _ in range(n)] if rank == root else None
            await dist.gather(t, gl, dst=root)
            if gl is not None:
                assert [int(g[0]) for g in gl] == [10 * r + root for r in range(n)]
            out = np.empty(2, dtype=np.int64)
            sl = [np.full(2, 100 * root + r, dtype=np.int64) for r in range(n)] if rank == root else None
            await dist.scatter(out, sl, src=root)
            assert (out == 100 * root + rank).all()

    await run_world(n, fn)


@pytest.mark.parametrize("n", SIZES)
async def test_reduce_scatter_and_all_to_all(n: int) -> None:
    async def fn(rank: int) -> None:
        inputs = [data(rank, 5, "float64", salt=i) for i in range(n)]
        out = np.empty(5)
        await dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
        np.testing.assert_allclose(out, sum(data(r, 5, "float64", salt=rank) for r in range(n)))
        big = np.arange(n * 4, dtype=np.int64) * (rank + 1)
        out2 = np.empty(4, dtype=np.int64)
        await dist.reduce_scatter_tensor(out2, big, op=dist.ReduceOp.MAX)
        np.testing.assert_array_equal(out2, np.arange(rank * 4, rank * 4 + 4) * n)
        # uneven all_to_all: rank i sends i + j + 1 elements to rank j
        ins = [np.full(rank + j + 1, 10 * rank + j, dtype=np.int32) for j in range(n)]
        outs = [np.empty(i + rank + 1, dtype=np.int32) for i in range(n)]
        await dist.all_to_all(outs, ins)
        for i in range(n):
            assert (outs[i] == 10 * i + rank).all()
        await dist.barrier()

    await run_world(n, fn)


async def test_all_to_all_single_reference_example() -> None:
    """torch's documented uneven example at 4 ranks."""
    inputs = [list(range(0, 6)), list(range(10, 19)), list(range(20, 25)), list(range(30, 37))]
    in_splits = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
    out_splits = [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]]
    want = [[0, 1, 10, 11, 12, 20, 21, 30, 31], [2, 3, 13, 14, 22, 32, 33], [4, 15, 16, 23, 34, 35], [5, 17, 18, 24, 36]]

    async def fn(rank: int) -> list[int]:
        out = np.empty(sum(out_splits[rank]), dtype=np.int64)
        await dist.all_to_all_single(out, np.array(inputs[rank], dtype=np.int64), out_splits[rank], in_splits[rank])
        even = np.empty(4, dtype=np.int64)
        await dist.all_to_all_single(even, np.arange(4, dtype=np.int64) + 4 * rank)
        assert even.tolist() == [rank + 4 * i for i in range(4)]
        return out.tolist()

    assert await run_world(4, fn) == want


# -- point to point -------------------------------------------------------------------------------


async def test_send_recv_tags_and_order() -> None:
    async def fn(rank: int) -> None:
        if rank == 0:
            await dist.isend(np.array([1.0]), dst=1, tag=1)
            await dist.isend(np.array([2.0]), dst=1, tag=2)
            w = await dist.isend(np.array([3.0]), dst=1, tag=1)
            await w
            await dist.send(np.arange(3, dtype=np.int32), dst=2)
        elif rank == 1:
            a, b, c = np.empty(1), np.empty(1), np.empty(1)
            wb = await dist.irecv(b, src=0, tag=2)  # tag 2 first: matched by tag, not arrival
            wa = await dist.irecv(a, src=0, tag=1)
            wc = await dist.irecv(c, group_src=0, tag=1)
            for w in (wa, wb, wc):
                await w.wait()
            assert (a[0], b[0], c[0]) == (1.0, 2.0, 3.0)
            assert wb.source_rank() == 0
        else:
            x = np.empty(3, dtype=np.int32)
            assert await dist.recv(x, src=0) == 0
            assert x.tolist() == [0, 1, 2]

    await run_world(3, fn)


# -- Work, async ops, cancellation ----------------------------------------------------------------


async def test_async_ops_in_flight_and_work_api() -> None:
    async def fn(rank: int) -> None:
        xs = [np.full(100, float(rank + i)) for i in range(5)]
        works = [issued(await dist.all_reduce(x, async_op=True)) for x in xs]
        b = np.full(3, float(rank))
        works.append(issued(await dist.broadcast(b, src=2, async_op=True)))
        assert all(isinstance(w, dist.Work) and isinstance(w, asyncio.Future) for w in works)
        assert [w.seq for w in works] == list(range(6))
        assert works[0].cancel() is False
        assert await works[1].wait(timeout=5) is True
        results = await asyncio.gather(*works)
        assert results[0] == [xs[0]] and results[0][0] is xs[0]
        for i, x in enumerate(xs):
            assert (x == sum(r + i for r in range(3))).all()
        assert (b == 2.0).all()
        w = works[0]
        assert w.is_completed() and w.is_success() and w.exception() is None
        assert w.result() == [xs[0]] and w.get_future() is w
        w.synchronize()
        w.block_current_stream()
        with pytest.raises(RuntimeError, match="only defined for receives"):
            w.source_rank()
        assert await w == [xs[0]]

    await run_world(3, fn)


async def test_work_wait_timeout_leaves_op_running() -> None:
    async def fn(rank: int) -> None:
        x = np.ones(4)
        if rank == 1:
            await asyncio.sleep(0.2)
        w = issued(await dist.all_reduce(x, async_op=True))
        if rank == 0:
            with pytest.raises(dist.DistTimeoutError, match="still running"):
                await w.wait(timeout=0.01)
            assert not w.is_completed()
        await w.wait()
        assert (x == 2).all()

    await run_world(2, fn)


async def test_cancelling_the_caller_does_not_cancel_the_op() -> None:
    async def fn(rank: int) -> None:
        x = np.full(8, float(rank + 1))
        if rank == 0:
            t = asyncio.create_task(dist.all_reduce(x))
            await asyncio.sleep(0.01)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert (x == 1).all()  # rank 1 has not joined yet
        else:
            await asyncio.sleep(0.05)
            await dist.all_reduce(x)
        y = np.ones(2)
        await dist.all_reduce(y)  # the group is still in step
        assert (x == 3).all() and (y == 2).all()

    await run_world(2, fn)


# -- timeouts, broken groups, validation ----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
async def test_rank_that_never_joins_fails_the_others(n: int) -> None:
    async def fn(rank: int) -> str | None:
        g = await dist.new_group(timeout=0.3, group_desc="slow")
        assert isinstance(g, dist.ProcessGroup)
        await dist.barrier(group=g)  # seq 0 on every rank
        if rank == 0:
            await dist.all_reduce(np.ones(1))  # joins the default group's op, never the group's seq 1
            return None
        loop = asyncio.get_running_loop()
        start = loop.time()
        work = issued(await dist.all_reduce(np.ones(4), group=g, async_op=True))
        with pytest.raises(dist.DistTimeoutError) as info:
            await work
        assert loop.time() - start < 10  # the group's 0.3 s timeout, far before the default group's
        assert work.is_completed() and not work.is_success() and work.exception() is info.value
        with pytest.raises(dist.DistBackendError, match="unusable") as refused:
            await dist.broadcast(np.ones(1), src=1, group=g)
        assert (refused.value.group, refused.value.rank) == (g.group_desc, rank)  # the facts are fields
        ok = np.ones(1)
        await dist.all_reduce(ok)  # the default group is another group: still fine, but rank 0 must join it
        return str(info.value)

    results = await run_world(n, fn)
    for msg in results[1:]:
        assert msg is not None
        assert "all_reduce" in msg and "slow" in msg and "seq 1" in msg and "timed out after 0.3 s" in msg
        assert "not heard from" in msg
    assert "[0]" in str(results[1])


async def test_validation_errors_leave_the_group_usable() -> None:
    async def fn(rank: int) -> None:
        x = np.ones(4, dtype=np.float32)
        with pytest.raises(ValueError, match="not both"):
            await dist.broadcast(x, src=0, group_src=0)
        with pytest.raises(ValueError, match="not a rank"):
            await dist.broadcast(x, src=7)
        with pytest.raises(ValueError, match="out of range"):
            await dist.reduce(x, group_dst=-1)
        with pytest.raises(TypeError, match="must be an int"):
            await dist.broadcast(x, src="0")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="has 1 tensors"):
            await dist.all_gather([x], x)
        with pytest.raises(TypeError):
            await dist.all_reduce([1, 2, 3])
        with pytest.raises(TypeError, match="BAND"):
            await dist.all_reduce(x, op=dist.ReduceOp.BAND)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.ones(2)
            ro.flags.writeable = False
            await dist.all_reduce(ro)
        with pytest.raises(ValueError, match="elements"):
            await dist.all_gather_into_tensor(np.empty(5, np.float32), x)
        with pytest.raises(ValueError, match="add up"):
            await dist.all_to_all_single(np.empty(3), np.empty(3), [1, 2], [1, 1])
        with pytest.raises(ValueError, match="tag"):
            await dist.send(x, dst=1 - rank, tag=-1)
        with pytest.raises(ValueError, match="oneself"):
            await dist.send(x, dst=rank)
        with pytest.raises(TypeError, match="async_op"):
            await dist.barrier(async_op=1)  # type: ignore[arg-type]
        assert dist.GroupMember.WORLD is not None and dist.GroupMember.WORLD.seq == 0  # nothing was issued
        await dist.all_reduce(x)
        assert (x == 2).all()

    await run_world(2, fn)


async def test_a_failed_op_breaks_the_group() -> None:
    async def fn(rank: int) -> None:
        # sizes that differ across ranks cannot be seen locally: the op fails (at least on the
        # receiving rank), and the group says it is unusable
        try:
            await dist.broadcast(np.ones(2 + rank), src=0)
        except dist.DistBackendError as exc:
            assert (exc.op, exc.seq, exc.group, exc.rank) == ("broadcast", 0, "default_pg", rank), exc
        else:
            assert rank == 0
            return
        with pytest.raises(dist.DistBackendError, match="unusable"):
            await dist.barrier()

    await run_world(2, fn, pg_timeout=2)


# -- groups, destroy -------------------------------------------------------------------------------


async def test_new_group() -> None:
    async def fn(rank: int) -> None:
        odd = await dist.new_group([3, 1])
        everyone = await dist.new_group()
        if rank % 2 == 0:
            assert odd == dist.NON_GROUP_MEMBER == dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(odd) == -1 and dist.get_world_size(odd) == -1
            with pytest.warns(UserWarning, match="which does not belong to the given group"):  # as torch
                assert await dist.all_reduce(np.ones(1), group=odd) is None
        else:
            assert isinstance(odd, dist.ProcessGroup)
            assert dist.get_process_group_ranks(odd) == [1, 3]
            assert dist.get_group_rank(odd, 3) == 1 and dist.get_global_rank(odd, 1) == 3
            with pytest.raises(RuntimeError, match="not part"):  # NotInGroupError: also ValueError, as torch 2.13
                dist.get_group_rank(odd, 0)
            x = np.array([float(rank)])
            await dist.all_reduce(x, group=odd)
            assert x[0] == 4.0
            y = np.array([float(rank)])
            await dist.broadcast(y, src=3, group=odd)  # src is a global rank
            assert y[0] == 3.0
            with pytest.raises(ValueError, match="not a rank"):
                await dist.broadcast(y, src=0, group=odd)
        assert isinstance(everyone, dist.ProcessGroup) and everyone.group_id != 0
        z = np.ones(2)
        await dist.all_reduce(z, group=everyone)
        assert (z == 5).all()
        # members-only creation
        if rank in (0, 4):
            local = await dist.new_group([4, 0], use_local_synchronization=True, sort_ranks=False)
            assert isinstance(local, dist.ProcessGroup)
            assert local.ranks == (4, 0) and local.rank() == (0 if rank == 4 else 1)
            w = np.array([rank])
            await dist.all_reduce(w, group=local)
            assert w[0] == 4
        assert dist.get_pg_count() == (3 if rank in (0, 4) or rank % 2 else 2)

    await run_world(5, fn)


async def test_destroy() -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([0, 1])
        assert isinstance(g, dist.ProcessGroup)
        if rank == 0:
            pending = issued(await dist.all_reduce(np.ones(3), group=g, async_op=True))
            await asyncio.sleep(0.01)
            await dist.destroy_process_group(g)
            with pytest.raises(dist.DistBackendError, match="destroyed"):
                await pending
            with pytest.raises(ValueError, match="not a live group"):
                await dist.all_reduce(np.ones(3), group=g)
        else:
            await dist.destroy_process_group(g)
        assert dist.get_pg_count() == 1
        await dist.barrier()
        await dist.destroy_process_group()
        assert not dist.is_initialized()

    await run_world(2, fn)


# -- run_world -------------------------------------------------------------------------------------


async def test_run_world_watchdog_names_stuck_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    async def fn(rank: int) -> None:
        if rank != 1:
            await dist.barrier()

    with pytest.raises(dist.DistTimeoutError, match=r"ranks still running: \[0, 2\]"):
        await run_world(3, fn, timeout=0.3)
    err = capsys.readouterr().err
    assert "run_world rank 0" in err and "barrier" in err


async def test_run_world_raises_the_first_failure() -> None:
    async def fn(rank: int) -> None:
        if rank == 2:
            raise KeyError("boom")
        await dist.barrier()

    with pytest.raises(KeyError, match="boom") as info:
        await run_world(3, fn, timeout=5)
    assert any("rank 2" in note for note in info.value.__notes__)


async def test_torch_cpu_tensors_in_place() -> None:
    torch = pytest.importorskip("torch")

    async def fn(rank: int) -> None:
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
        await dist.all_reduce(t)
        assert torch.equal(t, (torch.arange(6, dtype=torch.float32) * 3 + 3).reshape(2, 3))
        bf = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
        await dist.all_reduce(bf, op=dist.ReduceOp.MAX)
        assert (bf == 3).all()
        outs = [torch.empty(2, dtype=torch.int64) for _ in range(3)]
        await dist.all_gather(outs, torch.tensor([rank, -rank]))
        assert [o.tolist() for o in outs] == [[r, -r] for r in range(3)]

    await run_world(3, fn)


_TWO_PROCESSES = Path(__file__).resolve().parent / "helpers" / "file_init_job.py"  # RANK PATH: gloo over file:// rendezvous


@pytest.mark.one_loop(reason="the two ranks are child processes that run their own loops; this process only waits on them")
@pytest.mark.subprocess
async def test_gloo_two_processes(tmp_path: Any) -> None:
    import sys

    path = tmp_path / "rdzv"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(_TWO_PROCESSES), str(r), str(path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        for r in range(2)
    ]
    try:
        async with asyncio.timeout(60):
            outs = [(await p.communicate())[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    for r in range(2):
        assert f"rank {r} [1.0, 3.0, 5.0, 7.0, 9.0]" in outs[r]
