"""aiodist_cuda's NCCL backend run for real on the CPU, over a simulator of CuPy and its NCCL
(tests/helpers/fake_cupy.py): communicators made from a unique id shared through the store,
launcher and completion threads, every op of SUPPORTED_OPS (grouped send/recv included) checked
against NumPy, CudaWork's semantics, ordering, sub-groups, timeouts that abort the communicator,
the two-ranks-one-GPU refusal, the launch/completion knobs, and staging through pinned memory.

The simulated arrays all live on cuda:0, so every test but the refusal sets
NCCL_MULTI_RANK_GPU_ENABLE=1 (the ranks of run_world share one "GPU")."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import fake_cupy

import aiodist as dist
import aiodist_cuda
from aiodist.c10d.world import World, set_world
from aiodist.errors import DistBackendError, DistTimeoutError
from aiodist.store import HashStore
from aiodist.testing import run_world

MIXED = ["cpu:gloo,cuda:nccl", "cpu:memory,cuda:nccl"]
GLOO = "cpu:gloo,cuda:nccl"
R = dist.ReduceOp


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_cupy.Installed]:
    """The simulator in place of CuPy for one test; ranks may share cuda:0."""
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    for knob in ("AIODIST_CUDA_LAUNCH", "AIODIST_CUDA_COMPLETION", "AIODIST_CUDA_SPIN", "AIODIST_CUDA_DISABLE"):
        monkeypatch.delenv(knob, raising=False)
    inst = fake_cupy.install(monkeypatch)
    try:
        yield inst
        assert join_nccl_threads() == [], "threads of the NCCL backend outlived destroy_process_group"
    finally:
        fake_cupy.uninstall()
    assert not inst.sim.unexpected, f"the simulator saw calls that do not match across ranks, or failed: {inst.sim.unexpected}"


def dev(sim: fake_cupy.Installed, values: Any, dtype: Any = None) -> Any:
    return sim.cupy.asarray(np.asarray(values, dtype=dtype))


def nccl_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiodist-nccl-")]


def join_nccl_threads(within: float = 1.0) -> list[str]:
    """The names of the backend's threads still alive after joining them for ``within`` seconds
    (they end shortly after destroy_process_group)."""
    end = time.monotonic() + within
    for t in nccl_threads():
        t.join(max(0.0, end - time.monotonic()))
    return [t.name for t in nccl_threads()]


async def no_nccl_threads(within: float = 1.0) -> list[str]:
    return await asyncio.to_thread(join_nccl_threads, within)


def inputs(n: int, dtype: str, shape: tuple[int, ...] = (5,)) -> list[np.ndarray]:
    """Each rank's input: small values that keep PRODUCT of ints exact."""
    rng = np.random.default_rng(7)
    out = []
    for r in range(n):
        if dtype == "bool":
            out.append(rng.integers(0, 2, shape).astype(bool))
        elif dtype.startswith("complex"):
            out.append((rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype))
        elif dtype.startswith("uint"):
            out.append(rng.integers(0, 4, shape).astype(dtype))
        else:
            out.append((rng.integers(-3, 4, shape) + r).astype(dtype))
    return out


def expect(xs: list[np.ndarray], op: Any) -> np.ndarray:
    dt = xs[0].dtype
    if dt.kind == "b":
        return np.logical_or.reduce(xs) if op in (R.SUM, R.MAX) else np.logical_and.reduce(xs)
    stack = np.stack([x.astype(np.complex128 if dt.kind == "c" else np.float64) for x in xs])
    got = {R.SUM: stack.sum(0), R.PRODUCT: stack.prod(0), R.MIN: stack.min(0), R.MAX: stack.max(0)}.get(op)
    if got is None:  # AVG
        got = stack.sum(0) / len(xs)
        if dt.kind in "iu":
            got = np.trunc(got)
    return got


OPS_BY_DTYPE = {
    "float32": [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG],
    "float64": [R.SUM, R.AVG, R.MAX],
    "float16": [R.SUM, R.MIN],
    "int64": [R.SUM, R.PRODUCT, R.MIN, R.MAX],
    "int32": [R.SUM, R.MAX],
    "int8": [R.SUM, R.MIN],
    "uint8": [R.SUM, R.MAX],
    "bool": [R.SUM, R.PRODUCT, R.MIN, R.MAX],
    "complex64": [R.SUM, R.AVG],
    "complex128": [R.SUM],
}


# -- every op, checked against NumPy ------------------------------------------------------------------


@pytest.mark.parametrize("backend", MIXED)
@pytest.mark.parametrize("n", [1, 2, 3])
async def test_all_reduce_every_dtype_and_op(sim: fake_cupy.Installed, backend: str, n: int) -> None:
    async def fn(rank: int) -> None:
        for dtype, ops in OPS_BY_DTYPE.items():
            for op in ops:
                xs = inputs(n, dtype)
                x = dev(sim, xs[rank])
                await dist.all_reduce(x, op=op)
                got, want = x.get(), expect(xs, op)
                assert got.dtype == np.dtype(dtype)
                np.testing.assert_allclose(got.astype(want.dtype), want, rtol=1e-3, err_msg=f"{dtype} {op}")

    await run_world(n, fn, backend=backend, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_premul_sum_scales_each_rank_then_sums(sim: fake_cupy.Installed, n: int) -> None:
    async def fn(rank: int) -> None:
        for dtype in ("float32", "float64", "float16"):
            x = dev(sim, np.arange(4) + rank, dtype)
            await dist.all_reduce(x, op=R.PREMUL_SUM(0.5))
            want = sum(0.5 * (np.arange(4) + r) for r in range(n))
            np.testing.assert_allclose(x.get(), want, rtol=1e-3)
            y = dev(sim, np.ones(2 * n) * (rank + 1), dtype)
            out = sim.cupy.empty(2, dtype=dtype)
            await dist.reduce_scatter_tensor(out, y, op=R.PREMUL_SUM(2.0))
            np.testing.assert_allclose(out.get(), [2.0 * sum(range(1, n + 1))] * 2)

    await run_world(n, fn, backend=GLOO, timeout=10)
    assert sim.premul.made == 6 * n and not sim.premul.live  # every op made was destroyed after its call


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_broadcast_and_reduce_from_every_root(sim: fake_cupy.Installed, n: int) -> None:
    async def fn(rank: int) -> None:
        for root in range(n):
            x = dev(sim, [rank * 10 + 1, rank * 10 + 2], "int64")
            await dist.broadcast(x, src=root)
            assert x.get().tolist() == [root * 10 + 1, root * 10 + 2]
            y = dev(sim, [rank + 1.0, 2.0 * rank], "float32")
            await dist.reduce(y, dst=root, op=R.MAX)
            if rank == root:
                assert y.get().tolist() == [float(n), 2.0 * (n - 1)]

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_all_gather_even_uneven_and_into_tensor(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        x = dev(sim, np.full(rank + 1, rank, dtype=np.float64))  # uneven: rank r has r + 1 elements
        outs = [cp.empty(r + 1, dtype=cp.float64) for r in range(n)]
        await dist.all_gather(outs, x)
        assert [o.get().tolist() for o in outs] == [[float(r)] * (r + 1) for r in range(n)]
        y = dev(sim, [[rank, -rank]], "int32")
        big = cp.empty((n, 2), dtype=cp.int32)
        await dist.all_gather_into_tensor(big, y)
        assert big.get().tolist() == [[r, -r] for r in range(n)]
        c = dev(sim, [1 + 1j * rank], "complex64")
        cs = [cp.empty(1, dtype=cp.complex64) for _ in range(n)]
        await dist.all_gather(cs, c)
        assert [complex(o.get()[0]) for o in cs] == [1 + 1j * r for r in range(n)]

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_reduce_scatter_list_and_tensor(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        parts = [dev(sim, [rank * 100 + j, 1], "int64") for j in range(n)]
        out = cp.empty(2, dtype=cp.int64)
        await dist.reduce_scatter(out, parts)
        assert out.get().tolist() == [sum(r * 100 + rank for r in range(n)), n]
        flat = dev(sim, np.arange(3 * n, dtype=np.float32) * (rank + 1))
        o = cp.empty(3, dtype=cp.float32)
        await dist.reduce_scatter_tensor(o, flat, op=R.AVG)
        tot = sum(r + 1 for r in range(n)) / n
        np.testing.assert_allclose(o.get(), np.arange(3 * rank, 3 * rank + 3) * tot, rtol=1e-6)

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_all_to_all_uneven_and_single_with_split_sizes(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        # all_to_all: rank r sends j + 1 elements to rank j, each 100 r + j (uneven, and empty ones at n = 1 never)
        ins = [dev(sim, np.full(j + 1, 100 * rank + j, dtype=np.int64)) for j in range(n)]
        outs = [cp.empty(rank + 1, dtype=cp.int64) for _ in range(n)]
        await dist.all_to_all(outs, ins)
        assert [o.get().tolist() for o in outs] == [[100 * r + rank] * (rank + 1) for r in range(n)]
        # all_to_all_single: rank r sends (r + j) % 3 rows to rank j (some empty), rows of 2
        sends = [(rank + j) % 3 for j in range(n)]
        recvs = [(r + rank) % 3 for r in range(n)]
        rows = np.concatenate([np.full((s, 2), 10 * rank + j, dtype=np.float32) for j, s in enumerate(sends)] or [np.empty((0, 2))])
        inp = dev(sim, rows.reshape(-1, 2).astype(np.float32))
        out = cp.empty((sum(recvs), 2), dtype=cp.float32)
        await dist.all_to_all_single(out, inp, output_split_sizes=recvs, input_split_sizes=sends)
        want = np.concatenate([np.full((s, 2), 10 * r + rank, dtype=np.float32) for r, s in enumerate(recvs)] or [np.empty((0, 2))])
        np.testing.assert_array_equal(out.get(), want.reshape(-1, 2))
        # even split
        e = dev(sim, np.arange(n, dtype=np.int32) + 10 * rank)
        eo = cp.empty(n, dtype=cp.int32)
        await dist.all_to_all_single(eo, e)
        assert eo.get().tolist() == [10 * r + rank for r in range(n)]

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_gather_and_scatter_from_every_root(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        for root in range(n):
            x = dev(sim, [rank, root], "int32")
            lst = [cp.empty(2, dtype=cp.int32) for _ in range(n)] if rank == root else None
            await dist.gather(x, lst, dst=root)
            if lst is not None:
                assert [o.get().tolist() for o in lst] == [[r, root] for r in range(n)]
            out = cp.empty(3, dtype=cp.float64)
            src = [dev(sim, [root, r, 0.5], "float64") for r in range(n)] if rank == root else None
            await dist.scatter(out, src, src=root)
            assert out.get().tolist() == [root, rank, 0.5]

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_coalesced_ops(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        ts = [dev(sim, [rank, 1.0], "float32"), dev(sim, np.full(3, rank + 1.0), "float32")]
        await dist.all_reduce_coalesced(ts, op=R.SUM)
        tot = sum(range(n))
        assert ts[0].get().tolist() == [tot, n] and ts[1].get().tolist() == [tot + n] * 3
        ins = [dev(sim, [rank], "int64"), dev(sim, [rank, rank * 2], "int64")]
        outs = [[cp.empty(1, dtype=cp.int64), cp.empty(2, dtype=cp.int64)] for _ in range(n)]
        await dist.all_gather_coalesced(outs, ins)
        assert [[o.get().tolist() for o in row] for row in outs] == [[[r], [r, 2 * r]] for r in range(n)]

    await run_world(n, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["groupStart"] >= n  # all_reduce_coalesced: one grouped call per rank


async def test_barrier_on_an_nccl_only_world(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        await dist.barrier()
        w = await dist.barrier(async_op=True)
        assert w is not None
        await w

    await run_world(3, fn, backend="nccl", timeout=10)
    assert sim.sim.calls["allReduce"] == 6  # the NCCL barrier: an all_reduce of one int


async def test_empty_arrays(sim: fake_cupy.Installed) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        await dist.all_reduce(cp.empty(0, dtype=cp.float32))
        outs = [cp.empty(r, dtype=cp.float32) for r in range(3)]  # rank 0 sends nothing
        await dist.all_gather(outs, dev(sim, np.full(rank, rank), "float32"))
        assert [o.get().tolist() for o in outs] == [[], [1.0], [2.0, 2.0]]
        await dist.all_gather_into_tensor(cp.empty(0, dtype=cp.int64), cp.empty(0, dtype=cp.int64))
        empty_rows = cp.empty((0, 2), dtype=cp.float32)
        await dist.all_to_all_single(empty_rows, cp.empty((0, 2), dtype=cp.float32), [0, 0, 0], [0, 0, 0])
        await dist.broadcast(cp.empty(0, dtype=cp.int8), src=1)

    await run_world(3, fn, backend=GLOO, timeout=10)


async def test_arrays_on_several_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    inst = fake_cupy.install(monkeypatch, device_count=2)
    cp = inst.cupy
    try:

        async def fn(rank: int) -> None:
            a = cp.asarray(np.ones(2))
            with cp.cuda.Device(1):
                b = cp.asarray(np.ones(2))
            with pytest.raises(ValueError, match="several devices"):
                await dist.all_gather([a, b], a)
            await dist.all_reduce(a)  # the group's communicator is on cuda:0 now
            with pytest.raises(ValueError, match="runs on cuda:0"):
                await dist.all_reduce(b)

        await run_world(2, fn, backend=GLOO, timeout=10)
    finally:
        fake_cupy.uninstall()
    assert not inst.sim.unexpected


# -- point to point ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
async def test_send_recv_isend_irecv(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        if rank == 0:
            for peer in range(1, n):
                await dist.send(dev(sim, [peer, 7.5], "float64"), dst=peer)
            got = cp.empty(2, dtype=cp.int64)
            w = await dist.irecv(got, src=n - 1)
            await w
            assert got.get().tolist() == [n - 1, 42] and w.source_rank() == n - 1
        else:
            x = cp.empty(2, dtype=cp.float64)
            assert await dist.recv(x, src=0) == 0
            assert x.get().tolist() == [rank, 7.5]
            if rank == n - 1:
                w = await dist.isend(dev(sim, [rank, 42], "int64"), dst=0)
                await w

    await run_world(n, fn, backend=GLOO, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_batch_isend_irecv_ring(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        right, left = (rank + 1) % n, (rank - 1) % n
        out = dev(sim, [rank, rank * rank], "int64")
        got = cp.empty(2, dtype=cp.int64)
        works = await dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.isend, out, right)])
        assert len(works) == 2
        for w in works:
            await w
        assert got.get().tolist() == [left, left * left]

    await run_world(n, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["send"] == n and sim.sim.calls["recv"] == n


# -- refusals ------------------------------------------------------------------------------------------


async def test_refused_ops_and_types(sim: fake_cupy.Installed) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        x = dev(sim, [1, 2], "int64")
        with pytest.raises(TypeError, match="BAND"):
            await dist.all_reduce(x, op=R.BAND)
        with pytest.raises(TypeError, match="int16"):
            await dist.all_reduce(dev(sim, [1], "int16"))
        with pytest.raises(TypeError, match="PREMUL_SUM"):
            await dist.all_reduce(x, op=R.PREMUL_SUM(2.0))  # integers: refused, as torch does
        with pytest.raises(TypeError, match="MAX"):
            await dist.all_reduce(dev(sim, [1j], "complex64"), op=R.MAX)
        with pytest.raises(TypeError, match="AVG"):
            await dist.all_reduce(dev(sim, [True], "bool"), op=R.AVG)
        with pytest.raises(DistBackendError, match="any source"):
            await dist.recv(cp.empty(1, dtype=cp.int64))
        with pytest.raises(ValueError, match="not contiguous"):
            await dist.all_reduce(dev(sim, np.arange(6.0).reshape(2, 3))[:, 1])
        # nothing was enqueued: the group still works
        await dist.all_reduce(x)
        assert x.get().tolist() == [2, 4]

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_non_contiguous_input_is_copied(sim: fake_cupy.Installed) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        x = dev(sim, np.arange(6.0).reshape(2, 3) + rank)[:, 1]  # a strided view, an input only
        outs = [cp.empty(2, dtype=cp.float64) for _ in range(2)]
        await dist.all_gather(outs, x)
        assert [o.get().tolist() for o in outs] == [[1.0, 4.0], [2.0, 5.0]]

    await run_world(2, fn, backend=GLOO, timeout=10)


# -- Work -----------------------------------------------------------------------------------------------


async def test_work_semantics(sim: fake_cupy.Installed) -> None:
    issued = asyncio.Barrier(2)

    async def fn(rank: int) -> None:
        x = dev(sim, [rank + 1.0])
        w = await dist.all_reduce(x, async_op=True)
        assert isinstance(w, aiodist_cuda.work.CudaWork)
        await w  # the GPU finished the op
        assert w.is_completed() and w.exception() is None and x.get().tolist() == [3.0]
        w = await dist.all_reduce(dev(sim, [1.0]), async_op=True)
        assert await w.wait(timeout=5) is True and w.is_completed()  # wait(timeout): waits for the GPU
        # The ranks share the loop thread, so its current stream: wait() there before every rank
        # issued the op would queue their issue behind it (a deadlock, as on a real GPU). Hence the
        # barrier, and host copies off the loop.
        y = dev(sim, [rank + 1.0])
        w = await dist.all_reduce(y, async_op=True)
        await issued.wait()
        assert await w.wait() is True  # the current stream waits for the op; the CPU does not
        assert (await asyncio.to_thread(y.get)).tolist() == [3.0]
        z = dev(sim, [rank + 1.0])
        w = await dist.all_reduce(z, async_op=True)
        await issued.wait()
        await asyncio.to_thread(w.synchronize)  # may wait for the enqueue: off the loop
        assert (await asyncio.to_thread(z.get)).tolist() == [3.0]
        await w
        assert w.is_completed()

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_synchronize_on_the_loop_before_the_enqueue_raises_instead_of_deadlocking(sim: fake_cupy.Installed) -> None:
    """A group's first op waits for its communicator, made on the loop: synchronize() on that
    loop blocked the very thread that had to enqueue the op, until the group's timeout."""

    async def fn(rank: int) -> None:
        x = dev(sim, [rank + 1.0])
        w = await dist.all_reduce(x, async_op=True)  # the first op: the communicator is being made
        if not w._record.enqueued.is_set():
            t0 = time.monotonic()
            with pytest.raises(dist.DistBackendError, match=r"is not enqueued yet .*`await work.wait\(\)` instead"):
                w.synchronize()
            assert time.monotonic() - t0 < 0.5
        await w
        assert (await asyncio.to_thread(x.get)).tolist() == [3.0]

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_wait_makes_the_stream_wait_not_the_cpu(sim: fake_cupy.Installed) -> None:
    go = asyncio.Event()

    async def fn(rank: int) -> None:
        x = dev(sim, [rank + 1.0])
        await dist.all_reduce(x)  # the communicator exists
        if rank == 1:
            await go.wait()
            # rank 0's stream now waits for this op; the ranks share the loop thread and so its
            # current stream, where this op's ready event would queue behind that wait (a deadlock,
            # as on a real GPU): issue it from another stream
            with sim.cupy.cuda.Stream(non_blocking=True):
                w1 = await dist.all_reduce(x, async_op=True)
            await w1
            return
        w = await dist.all_reduce(x, async_op=True)
        assert await w.wait() is True  # returns although rank 1 has not joined the op yet
        stream = sim.cupy.cuda.get_current_stream()
        assert not w.is_completed() and not stream.done  # the stream waits on the op
        go.set()
        await w
        assert (await asyncio.to_thread(x.get)).tolist() == [6.0]

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_many_ops_in_flight_and_cpu_ops_interleaved(sim: fake_cupy.Installed) -> None:
    n = 3

    async def fn(rank: int) -> None:
        gpu = [dev(sim, [rank * i, i], "int64") for i in range(20)]
        cpu = [np.array([rank + i], dtype=np.int64) for i in range(20)]
        works = []
        for i in range(20):
            works.append(await dist.all_reduce(gpu[i], async_op=True))
            works.append(await dist.all_reduce(cpu[i], op=R.MAX, async_op=True))
            if i % 5 == 0:
                works.append(await dist.broadcast(gpu[i], src=i % n, async_op=True))
        for w in reversed(works):
            await w
        for i in range(20):
            want = [(i % n) * i * 0 + sum(r * i for r in range(n)), n * i] if i % 5 else [sum(r * i for r in range(n)), n * i]
            assert gpu[i].get().tolist() == want
            assert cpu[i].tolist() == [n - 1 + i]

    await run_world(n, fn, backend=GLOO, timeout=10)


async def test_ops_follow_the_callers_stream_and_keep_their_arrays(sim: fake_cupy.Installed) -> None:
    """The op waits for work queued before it on the caller's stream (a slow write of its input),
    and its arrays stay alive until the GPU is done although the caller dropped them."""
    cp = sim.cupy

    async def fn(rank: int) -> None:
        stream = cp.cuda.get_current_stream()
        x = cp.empty(3, dtype=cp.float64)
        outs = [cp.empty(2, dtype=cp.int32) for _ in range(2)]
        w2 = await dist.all_gather(outs, dev(sim, [rank, 1], "int32"), async_op=True)  # its input: dropped here
        stream.enqueue(lambda: time.sleep(0.05), "a slow kernel")  # simulator API: busy stream work
        x.set(np.full(3, rank + 1.0), stream=stream)  # asynchronous: after the slow kernel
        w = await dist.all_reduce(x, async_op=True)
        await w
        assert x.get().tolist() == [3.0] * 3
        await w2
        assert [o.get().tolist() for o in outs] == [[0, 1], [1, 1]]

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_sub_groups_get_their_own_communicator(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        sub = await dist.new_group([0, 2])
        x = dev(sim, [rank + 1], "int32")
        if rank in (0, 2):
            await dist.all_reduce(x, group=sub)
            assert x.get().tolist() == [4]
        y = dev(sim, [rank + 1], "int32")
        await dist.all_reduce(y)
        assert y.get().tolist() == [6]

    await run_world(3, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["get_unique_id"] == 2 and sim.sim.calls["ncclCommInitRank"] == 5


async def test_new_subgroups_defaults_to_the_hosts_gpu_count(sim: fake_cupy.Installed) -> None:
    """torch's ``new_subgroups()`` makes one group per node of ``torch.cuda.device_count()``
    ranks; aiodist asks aiodist_cuda (2 simulated GPUs: pairs of ranks)."""
    sim.sim.device_count = 2

    async def fn(rank: int) -> None:
        mine, subs = await dist.new_subgroups()
        assert len(subs) == 2 and dist.get_process_group_ranks(mine) == [rank // 2 * 2, rank // 2 * 2 + 1]

    await run_world(4, fn, backend=GLOO, timeout=10)


async def test_sub_groups_split_from_a_parent_communicator(sim: fake_cupy.Installed) -> None:
    """Once the default group has a communicator, new_group and split_group split it
    (ncclCommSplit on every rank of the parent; ranks outside the new group with no color)."""

    async def fn(rank: int) -> None:
        warm = dev(sim, [1], "int32")
        await dist.all_reduce(warm)  # the default group's communicator exists from here
        sub = await dist.new_group([0, 2])
        x = dev(sim, [rank + 1], "int32")
        if rank in (0, 2):
            await dist.all_reduce(x, group=sub)
            assert x.get().tolist() == [4]
        else:
            assert sub == dist.GroupMember.NON_GROUP_MEMBER
        halves = await dist.split_group(split_ranks=[[0, 1], [2]])
        assert halves is not None
        y = dev(sim, [10**rank], "int32")
        await dist.all_reduce(y, group=halves)
        assert y.get().tolist() == ([11] if rank < 2 else [100])
        z = dev(sim, [rank], "int32")
        await dist.all_reduce(z)  # the parent still works after the splits
        assert z.get().tolist() == [3]

    await run_world(3, fn, backend=GLOO, timeout=10)
    calls = sim.sim.calls
    assert calls["get_unique_id"] == 1 and calls["ncclCommInitRank"] == 3  # only the default group's
    assert calls["ncclCommSplit"] == 2 + 3  # the [0, 2] group's two members, then all three of the split


async def test_no_split_without_a_parent_communicator_or_when_switched_off(
    sim: fake_cupy.Installed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_NCCL_SPLIT", "0")

    async def fn(rank: int) -> None:
        warm = dev(sim, [1], "int32")
        await dist.all_reduce(warm)
        sub = await dist.new_group([0, 1])
        x = dev(sim, [rank + 1], "int32")
        await dist.all_reduce(x, group=sub)
        assert x.get().tolist() == [3]

    await run_world(2, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["ncclCommSplit"] == 0 and sim.sim.calls["get_unique_id"] == 2


# -- failures ---------------------------------------------------------------------------------------------


KNOBS = [None, ("AIODIST_CUDA_LAUNCH", "loop"), ("AIODIST_CUDA_COMPLETION", "hostfunc")]


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.6 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("knob", KNOBS, ids=["default", "launch-loop", "hostfunc"])
async def test_a_rank_that_never_joins_times_out_and_aborts_the_communicator(
    sim: fake_cupy.Installed, monkeypatch: pytest.MonkeyPatch, knob: tuple[str, str] | None
) -> None:
    if knob is not None:
        monkeypatch.setenv(*knob)
    errors: dict[int, BaseException] = {}

    async def fn(rank: int) -> None:
        x = dev(sim, [1.0])
        await dist.all_reduce(x)  # the communicator exists
        if rank == 1:
            await asyncio.sleep(0.6)  # never joins the second op
            return
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError) as info:
            await dist.all_reduce(x)
        assert time.monotonic() - t0 < 1.5
        errors[rank] = info.value

    await run_world(3, fn, backend=GLOO, timeout=10, pg_timeout=0.3)
    assert sorted(errors) == [0, 2]
    for e in errors.values():
        msg = str(e)
        assert "all_reduce" in msg and "seq 1" in msg and "default_pg" in msg, msg
    assert sim.sim.calls["ncclCommAbort"] >= 2
    assert await no_nccl_threads() == []


async def test_ranks_that_disagree_get_nccls_error_with_a_hint(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        await dist.all_reduce(dev(sim, [1.0]))
        with pytest.raises(DistBackendError) as info:
            await dist.all_reduce(dev(sim, np.ones(rank + 1)))  # 1 element here, 2 there
        msg = str(info.value)
        assert "ncclInvalidUsage" in msg and "all_reduce on default_pg" in msg and "seq 1" in msg and "hint:" in msg, msg

    await run_world(2, fn, backend=GLOO, timeout=10)
    assert len(sim.sim.unexpected) == 2  # the simulator saw the mismatch on both ranks
    sim.sim.unexpected.clear()


async def test_hostfunc_completion_reports_an_async_error(sim: fake_cupy.Installed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_CUDA_COMPLETION", "hostfunc")

    async def fn(rank: int) -> None:
        await dist.all_reduce(dev(sim, [1.0]))
        with pytest.raises(DistBackendError, match="ncclInvalidUsage"):
            await dist.all_reduce(dev(sim, np.ones(rank + 1)))

    try:
        await run_world(2, fn, backend=GLOO, timeout=10, pg_timeout=2)
    finally:
        sim.sim.unexpected.clear()


async def test_an_async_error_of_a_stuck_kernel_fails_the_op_before_the_timeout(sim: fake_cupy.Installed) -> None:
    sim.sim.hang_on_error = True

    async def fn(rank: int) -> None:
        await dist.all_reduce(dev(sim, [1.0]))
        with pytest.raises(DistBackendError, match="ncclInvalidUsage"):
            await dist.all_reduce(dev(sim, np.ones(rank + 1)))

    try:
        await run_world(2, fn, backend=GLOO, timeout=10, pg_timeout=1)
    finally:
        sim.sim.unexpected.clear()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_a_rank_that_never_makes_the_communicator_times_out(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        if rank == 1:
            await asyncio.sleep(0.5)
            return
        with pytest.raises(DistTimeoutError, match="still being made"):
            await dist.all_reduce(dev(sim, [1.0]))

    await run_world(2, fn, backend=GLOO, timeout=10, pg_timeout=0.2)
    # rank 0 was still waiting in the store for rank 1's device and the unique id, not in
    # ncclCommInitRank: the abort ended its launcher thread
    assert sim.sim.calls["ncclCommInitRank"] == 0
    assert await no_nccl_threads() == []


async def test_foreign_cuda_array_interface_is_taken_zero_copy(sim: fake_cupy.Installed) -> None:
    class Foreign:  # a torch CUDA tensor / numba array stand-in over simulated device memory
        def __init__(self, a: Any) -> None:
            self.a = a

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return dict(self.a.__cuda_array_interface__)

    async def fn(rank: int) -> None:
        x = dev(sim, [rank + 1.0, 1.0])
        await dist.all_reduce(Foreign(x))
        assert x.get().tolist() == [3.0, 2.0]

    await run_world(2, fn, backend=GLOO, timeout=10)


async def test_two_ranks_on_one_gpu_are_refused(sim: fake_cupy.Installed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE")

    async def fn(rank: int) -> None:
        with pytest.raises(DistBackendError, match="both use cuda:0"):
            await dist.all_reduce(dev(sim, [1.0]))

    await run_world(2, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["ncclCommInitRank"] == 0
    assert await no_nccl_threads() == []


async def test_one_rank_per_device_needs_no_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    inst = fake_cupy.install(monkeypatch, device_count=2)
    try:

        async def fn(rank: int) -> None:
            with inst.cupy.cuda.Device(rank):
                x = inst.cupy.asarray(np.array([rank + 1.0]))
            await dist.all_reduce(x)
            assert x.get().tolist() == [3.0]

        await run_world(2, fn, backend=GLOO, timeout=10)
    finally:
        fake_cupy.uninstall()
    assert not inst.sim.unexpected


async def test_eager_communicator_with_device_id_and_high_priority_stream(sim: fake_cupy.Installed) -> None:
    """init_process_group(device_id=...) makes the communicator at init (run_world passes no
    device_id, so the ranks are started here the way it does)."""
    store = HashStore()

    async def rank_main(rank: int) -> tuple[int, list[float], int | None]:
        opts = aiodist_cuda.NcclOptions(is_high_priority_stream=True)
        await dist.init_process_group(GLOO, store=store, rank=rank, world_size=2, device_id=0, pg_options=opts)
        try:
            made = sim.sim.calls["ncclCommInitRank"]  # both ranks joined during init
            x = dev(sim, [rank + 1.0])
            await dist.all_reduce(x)
            priority = dist.current_world().devices["cuda"].comms[0].stream.priority
            return made, x.get().tolist(), priority
        finally:
            await dist.destroy_process_group()

    loop = asyncio.get_running_loop()
    tasks = []
    for r in range(2):
        ctx = contextvars.copy_context()
        ctx.run(set_world, World(f"rank {r}"))
        tasks.append(loop.create_task(rank_main(r), context=ctx))
    async with asyncio.timeout(10):
        got = await asyncio.gather(*tasks)
    assert got == [(2, [3.0], -100), (2, [3.0], -100)]


# -- knobs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knob", [("AIODIST_CUDA_LAUNCH", "loop"), ("AIODIST_CUDA_COMPLETION", "hostfunc"), ("AIODIST_CUDA_SPIN", "1")])
async def test_launch_and_completion_knobs(sim: fake_cupy.Installed, monkeypatch: pytest.MonkeyPatch, knob: tuple[str, str]) -> None:
    monkeypatch.setenv(*knob)

    async def fn(rank: int) -> dict[str, Any]:
        for i in range(3):
            x = dev(sim, [rank + i, 1.0])
            await dist.all_reduce(x)
            assert x.get().tolist() == [1 + 2 * i, 2.0]
        ws = [await dist.all_reduce(dev(sim, [1.0]), async_op=True) for _ in range(5)]
        for w in ws:
            await w
        stats: dict[str, Any] = dist.current_world().devices["cuda"].stats()
        return stats

    stats = await run_world(2, fn, backend=GLOO, timeout=10)
    want = {"AIODIST_CUDA_LAUNCH": ("launch", "loop"), "AIODIST_CUDA_COMPLETION": ("completion", "hostfunc")}
    want["AIODIST_CUDA_SPIN"] = ("completion", "spin")
    key, value = want[knob[0]]
    assert stats[0][key] == value


# -- staging on a CPU-only World ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "gloo"])
async def test_staging_on_a_cpu_only_world(sim: fake_cupy.Installed, backend: str) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        x = dev(sim, [rank + 1.0, 2.0])
        await dist.all_reduce(x)
        assert x.get().tolist() == [3.0, 4.0]
        outs = [cp.empty(1, dtype=cp.int64) for _ in range(2)]
        w = await dist.all_gather(outs, dev(sim, [rank], "int64"), async_op=True)
        await w
        assert [o.get().tolist() for o in outs] == [[0], [1]]
        if rank == 0:
            await dist.send(dev(sim, [5, 6], "int32"), dst=1)
        else:
            got = cp.empty(2, dtype=cp.int32)
            await dist.recv(got, src=0)
            assert got.get().tolist() == [5, 6]
        ring = dev(sim, [rank], "int64")
        got2 = cp.empty(1, dtype=cp.int64)
        other = 1 - rank
        for w in await dist.batch_isend_irecv([dist.P2POp(dist.isend, ring, other), dist.P2POp(dist.irecv, got2, other)]):
            await w
        assert got2.get().tolist() == [other]
        stager = dist.current_world().devices["cuda"]
        assert stager.name == "cuda-staging"

    await run_world(2, fn, backend=backend, timeout=10)
    assert sim.sim.calls["ncclCommInitRank"] == 0 and sim.sim.calls.get("allReduce", 0) == 0


@pytest.mark.parametrize("n", [1, 3])
async def test_staging_runs_every_op_kind(sim: fake_cupy.Installed, n: int) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        x = dev(sim, [rank, 1], "int64")
        await dist.broadcast(x, src=n - 1)
        assert x.get().tolist() == [n - 1, 1]
        y = dev(sim, [rank + 1.0])
        await dist.reduce(y, dst=0, op=R.PRODUCT)
        if rank == 0:
            assert y.get().tolist() == [float(np.prod(np.arange(1, n + 1)))]
        out = cp.empty(2, dtype=cp.float32)
        await dist.reduce_scatter(out, [dev(sim, [rank, j], "float32") for j in range(n)])
        assert out.get().tolist() == [sum(range(n)), n * rank]
        big = cp.empty(2 * n, dtype=cp.int32)
        await dist.all_gather_into_tensor(big, dev(sim, [rank, -rank], "int32"))
        assert big.get().tolist() == [v for r in range(n) for v in (r, -r)]
        a2a = cp.empty(n, dtype=cp.int64)
        await dist.all_to_all_single(a2a, dev(sim, np.arange(n) + 10 * rank, "int64"))
        assert a2a.get().tolist() == [10 * r + rank for r in range(n)]
        lst = [cp.empty(1, dtype=cp.int64) for _ in range(n)] if rank == 0 else None
        await dist.gather(dev(sim, [rank], "int64"), lst, dst=0)
        if lst is not None:
            assert [o.get().tolist() for o in lst] == [[r] for r in range(n)]
        sc = cp.empty(1, dtype=cp.int64)
        await dist.scatter(sc, [dev(sim, [5 * r], "int64") for r in range(n)] if rank == 0 else None, src=0)
        assert sc.get().tolist() == [5 * rank]
        ts = [dev(sim, [1.0]), dev(sim, [rank, 2.0])]
        await dist.all_reduce_coalesced(ts)
        assert ts[0].get().tolist() == [n] and ts[1].get().tolist() == [sum(range(n)), 2.0 * n]

    await run_world(n, fn, backend="gloo", timeout=10)
    assert sim.sim.calls["ncclCommInitRank"] == 0


# -- teardown -------------------------------------------------------------------------------------------------


async def test_clean_destroy_destroys_rather_than_aborts(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        await dist.all_reduce(dev(sim, [1.0]))

    await run_world(2, fn, backend=GLOO, timeout=10)
    assert sim.sim.calls["ncclCommDestroy"] == 2 and sim.sim.calls["ncclCommAbort"] == 0


async def test_sub_group_roots_and_peers_are_global_ranks(sim: fake_cupy.Installed) -> None:
    cp = sim.cupy

    async def fn(rank: int) -> None:
        sub = await dist.new_group([1, 2])
        if rank == 0:
            return
        x = dev(sim, [rank * 10], "int64")
        await dist.broadcast(x, src=2, group=sub)
        assert x.get().tolist() == [20]
        lst = [cp.empty(1, dtype=cp.int64) for _ in range(2)] if rank == 1 else None
        await dist.gather(dev(sim, [rank], "int64"), lst, dst=1, group=sub)
        if lst is not None:
            assert [o.get().tolist() for o in lst] == [[1], [2]]
        other = 3 - rank
        got = cp.empty(1, dtype=cp.int64)
        works = await dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, dev(sim, [rank], "int64"), other, group=sub), dist.P2POp(dist.irecv, got, other, group=sub)]
        )
        for w in works:
            await w
        assert got.get().tolist() == [other] and works[1].source_rank() == other
        if rank == 1:
            await dist.send(dev(sim, [7], "int64"), dst=2, group=sub)
        else:
            assert await dist.recv(got, src=1, group=sub) == 1
            assert got.get().tolist() == [7]

    await run_world(3, fn, backend=GLOO, timeout=10)


async def test_destroy_while_the_unique_id_exchange_waits_leaves_no_task(sim: fake_cupy.Installed) -> None:
    async def fn(rank: int) -> None:
        if rank == 0:  # rank 1 never makes the communicator: rank 0's exchange waits for it in the store
            w = await dist.all_reduce(dev(sim, [1.0]), async_op=True)
            await asyncio.sleep(0.05)
            assert w is not None and not w.is_completed()

    await run_world(2, fn, backend=GLOO, timeout=10, pg_timeout=5)
    await asyncio.sleep(0.05)
    left = [t for t in asyncio.all_tasks() if t.get_name().startswith("aiodist nccl id")]
    try:
        assert left == []
    finally:
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
