"""The NCCL backend on a real GPU, with 1-rank communicators: every op of
``aiodist_cuda.SUPPORTED_OPS`` on every NCCL dtype CuPy has, every ReduceOp (the refused ones
raise TypeError before anything is enqueued), results against NumPy references; CudaWork's
semantics; the caller's stream respected; every completion mode; CuPy arrays staged through
the host on a "gloo"-only World.

At one rank a reduction is the identity (PREMUL_SUM(f) scales by f), so the references are
exact and the checks are ``array_equal``. Many ranks on one GPU: tests/gpu/multiproc.py.
Skipped, with aiodist_cuda's reason, where CuPy, NCCL or a GPU is missing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiodist as dist
import aiodist_cuda
from aiodist.c10d.work import Work
from aiodist.testing import run_world
from aiodist.types import to_reduce_op
from aiodist_cuda._tables import NCCL_DTYPES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not aiodist_cuda.is_available(), reason=f"aiodist_cuda unavailable: {aiodist_cuda.unavailable_reason()}"),
]

MIXED = "cpu:gloo,cuda:nccl"
R = dist.ReduceOp
FACTOR = 2.0  # PREMUL_SUM's factor: exact in every float type, bfloat16 included
ALL_OPS: list[Any] = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.PREMUL_SUM(FACTOR), R.BAND, R.BOR, R.BXOR]
DTYPES = sorted(NCCL_DTYPES)
Call = Callable[..., Awaitable[Any]]  # an op under test, called with its ReduceOp
SHAPE = (37, 5)  # odd sizes: nothing lines up with NCCL's chunking by accident


# -- references -----------------------------------------------------------------------------------


def np_dtype(name: str) -> Any:
    """The NumPy dtype of ``name`` (bfloat16 through ml_dtypes); skip where CuPy cannot hold it."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import cupy
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
        probe = np.arange(4, dtype=np.float32).astype(dt)
        back = cupy.asarray(probe).get()
        cupy.zeros(4, dtype=dt).get()  # the tests also make outputs of it
        if back.dtype != dt or not np.array_equal(back.astype(np.float32), probe.astype(np.float32)):
            raise TypeError(f"round trip gave {back!r}")
    except Exception as exc:  # ImportError, or CuPy refusing the dtype
        pytest.skip(f"bfloat16 does not work with CuPy here: {type(exc).__name__}: {exc}")
    return dt


def sample(name: str, seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Deterministic host data of dtype ``name`` (small integers, normal floats, complex pairs)."""
    dt = np_dtype(name)
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if name.startswith("int"):
        return rng.integers(-50, 50, shape).astype(dt)
    if name.startswith("uint"):
        return rng.integers(0, 100, shape).astype(dt)
    if name.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(np.float32).astype(dt)


def refused(name: str, op: Any) -> bool:
    """The NCCL backend's rules (as the issue states them): no bitwise ops; bool: no AVG or
    PREMUL_SUM; complex: SUM and AVG only; PREMUL_SUM on floating types only."""
    kind = to_reduce_op(op).op
    if kind in (R.BAND, R.BOR, R.BXOR):
        return True
    if name == "bool":
        return kind in (R.AVG, R.PREMUL_SUM)
    if name.startswith("complex"):
        return kind not in (R.SUM, R.AVG)
    if kind == R.PREMUL_SUM:
        return name not in ("float16", "float32", "float64", "bfloat16")
    return False


def reduced(x: np.ndarray, op: Any) -> np.ndarray:
    """What a 1-rank reduction leaves: ``x``, or ``FACTOR * x`` for PREMUL_SUM."""
    kind = to_reduce_op(op).op
    if kind == R.PREMUL_SUM:
        return (x.astype(np.float64) * FACTOR).astype(x.dtype)
    return x.copy()


def same(got: Any, want: np.ndarray) -> bool:
    g = got.get() if hasattr(got, "get") else np.asarray(got)
    if g.dtype != want.dtype or g.shape != want.shape:
        return False
    if want.dtype.name == "bfloat16":
        return bool(np.array_equal(g.astype(np.float32), want.astype(np.float32)))
    return bool(np.array_equal(g, want))


def opname(op: Any) -> str:
    return repr(op) if not isinstance(op, R.RedOpType) else op.name


async def started(call: Awaitable[Work | None]) -> Work:
    """The Work of an ``async_op=True`` call."""
    work = await call
    assert work is not None
    return work


async def one_rank(fn: Callable[[], Awaitable[Any]], backend: str = MIXED, timeout: float = 40) -> Any:
    """``fn()`` on rank 0 of a 1-rank World of ``backend`` (made and destroyed around it); a hang
    fails within ``timeout`` with the stacks of what was pending (pytest-timeout is the backstop)."""

    async def rank_fn(rank: int) -> Any:
        return await fn()

    return (await run_world(1, rank_fn, backend=backend, timeout=timeout, pg_timeout=30))[0]


# -- coverage -------------------------------------------------------------------------------------

TESTED_OPS = {
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "p2p",
    "barrier",
}


def test_every_supported_op_is_tested_here() -> None:
    assert set(aiodist_cuda.SUPPORTED_OPS) == TESTED_OPS


# -- reductions: every dtype x every ReduceOp -----------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", DTYPES)
async def test_reductions_every_op(cp: Any, name: str) -> None:
    """all_reduce, reduce, reduce_scatter(_tensor/_single), all_reduce_coalesced under every
    ReduceOp on ``name``: the refused ones raise TypeError, the others give NumPy's answer."""
    host = sample(name, 1)

    async def body() -> list[str]:
        bad: list[str] = []

        def check(what: str, got: Any, want: np.ndarray) -> None:
            if not same(got, want):
                bad.append(f"{what}: got {got.get().ravel()[:6]!r}..., want {want.ravel()[:6]!r}...")

        for op in ALL_OPS:
            tag = f"{name} {opname(op)}"
            want = host if refused(name, op) else reduced(host, op)
            calls: list[tuple[str, Call, Any]] = []
            x = cp.asarray(host)
            calls.append(("all_reduce", lambda op, x=x: dist.all_reduce(x, op=op), x))
            y = cp.asarray(host)
            calls.append(("reduce", lambda op, y=y: dist.reduce(y, dst=0, op=op), y))
            o1 = cp.zeros(SHAPE, dtype=host.dtype)
            calls.append(("reduce_scatter_tensor", lambda op, o=o1: dist.reduce_scatter_tensor(o, cp.asarray(host), op=op), o1))
            o2 = cp.zeros(SHAPE, dtype=host.dtype)
            calls.append(("reduce_scatter_single", lambda op, o=o2: dist.reduce_scatter_single(o, cp.asarray(host), op=op), o2))
            o3 = cp.zeros(SHAPE, dtype=host.dtype)
            calls.append(("reduce_scatter", lambda op, o=o3: dist.reduce_scatter(o, [cp.asarray(host)], op=op), o3))
            pair = [cp.asarray(host), cp.asarray(host[:3])]
            calls.append(("all_reduce_coalesced", lambda op, p=pair: dist.all_reduce_coalesced(p, op=op), pair))
            for what, call, out in calls:
                if refused(name, op):
                    try:
                        await call(op)
                    except TypeError:
                        continue
                    except Exception as exc:
                        bad.append(f"{what} {tag}: expected TypeError, got {type(exc).__name__}: {exc}")
                        continue
                    bad.append(f"{what} {tag}: expected TypeError, the op ran")
                    continue
                try:
                    await call(op)
                except Exception as exc:
                    bad.append(f"{what} {tag}: raised {type(exc).__name__}: {exc}")
                    continue
                if isinstance(out, list):
                    check(f"{what} {tag} [0]", out[0], want)
                    check(f"{what} {tag} [1]", out[1], want[:3])
                else:
                    check(f"{what} {tag}", out, want)
        # the refusals enqueued nothing: the group still works
        z = cp.asarray(host)
        await dist.all_reduce(z)
        check(f"{name} all_reduce after the refusals", z, host)
        return bad

    bad = await one_rank(body)
    assert not bad, "\n".join(bad)


# -- the other ops: every dtype ---------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
async def test_data_movement_every_dtype(cp: Any, name: str) -> None:
    """broadcast, all_gather (list, into_tensor in both forms, single, coalesced), gather,
    scatter, all_to_all, all_to_all_single (even and with splits), batch_isend_irecv to itself,
    on every dtype, each in its own World (a failed op breaks its group: one dtype's failure
    must not hide the others'); outputs start as garbage and must end as NumPy's answer."""
    np_dtype(name)  # skips a dtype CuPy lacks here
    i = DTYPES.index(name)

    async def body() -> list[str]:
        return await _movement(cp, name, sample(name, 10 + i), sample(name, 100 + i, (4,)))

    bad = await one_rank(body)
    assert not bad, "\n".join(bad)


async def _movement(cp: Any, name: str, host: np.ndarray, other: np.ndarray) -> list[str]:
    """The data-movement ops on ``host`` (and ``other``, for the coalesced op): what went wrong."""
    bad: list[str] = []

    def check(what: str, got: Any, want: np.ndarray) -> None:
        if not same(got, want):
            bad.append(f"{what} {name}: got {got.get().ravel()[:6]!r}..., want {want.ravel()[:6]!r}...")

    def garbage(shape: tuple[int, ...]) -> Any:
        return cp.asarray(np.resize(host[::-1].ravel(), int(np.prod(shape))).reshape(shape))

    async def run(what: str, call: Awaitable[Any]) -> bool:
        try:
            await call
            return True
        except Exception as exc:
            bad.append(f"{what} {name}: raised {type(exc).__name__}: {exc}")
            return False

    def dev() -> Any:
        return cp.asarray(host)

    x = dev()
    if await run("broadcast", dist.broadcast(x, src=0)):
        check("broadcast", x, host)
    lst = [garbage(SHAPE)]
    if await run("all_gather", dist.all_gather(lst, dev())):
        check("all_gather", lst[0], host)
    flat = garbage((SHAPE[0] * SHAPE[1],))
    if await run("all_gather_into_tensor", dist.all_gather_into_tensor(flat, dev())):
        check("all_gather_into_tensor (concatenated)", flat, host.ravel())
    stacked = garbage((1, *SHAPE))
    if await run("all_gather_into_tensor", dist.all_gather_into_tensor(stacked, dev())):
        check("all_gather_into_tensor (stacked)", stacked[0], host)
    single = garbage(SHAPE)
    if await run("all_gather_single", dist.all_gather_single(single, dev())):
        check("all_gather_single", single, host)
    co = [[garbage(SHAPE), garbage((4,))]]
    if await run("all_gather_coalesced", dist.all_gather_coalesced(co, [dev(), cp.asarray(other)])):
        check("all_gather_coalesced [0]", co[0][0], host)
        check("all_gather_coalesced [1]", co[0][1], other)
    g = [garbage(SHAPE)]
    if await run("gather", dist.gather(dev(), gather_list=g, dst=0)):
        check("gather", g[0], host)
    s = garbage(SHAPE)
    if await run("scatter", dist.scatter(s, scatter_list=[dev()], src=0)):
        check("scatter", s, host)
    a2a = [garbage(SHAPE)]
    if await run("all_to_all", dist.all_to_all(a2a, [dev()])):
        check("all_to_all", a2a[0], host)
    a2s = garbage(SHAPE)
    if await run("all_to_all_single", dist.all_to_all_single(a2s, dev())):
        check("all_to_all_single", a2s, host)
    a2u = garbage(SHAPE)
    if await run("all_to_all_single", dist.all_to_all_single(a2u, dev(), [SHAPE[0]], [SHAPE[0]])):
        check("all_to_all_single (splits)", a2u, host)
    got = garbage(SHAPE)

    async def p2p() -> None:
        works = await dist.batch_isend_irecv([dist.P2POp(dist.isend, dev(), 0), dist.P2POp(dist.irecv, got, 0)])
        for w in works:
            await w

    if await run("batch_isend_irecv", p2p()):
        check("batch_isend_irecv to itself", got, host)
    return bad


async def test_nccl_only_world_barrier_and_ops(cp: Any) -> None:
    """A World of "nccl" alone: barrier is an NCCL op; CuPy ops run; host arrays are refused."""

    async def body() -> dict[str, Any]:
        await dist.barrier()
        w = await dist.barrier(async_op=True)
        assert w is not None
        await w
        x = cp.arange(10, dtype=cp.float32)
        await dist.all_reduce(x, op=R.PREMUL_SUM(3.0))
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            await dist.all_reduce(np.ones(3))
        stats = dist.current_world().devices["cuda"].stats()
        return {"x": x.get(), "stats": stats}

    got = await one_rank(body, backend="nccl")
    assert np.array_equal(got["x"], np.arange(10, dtype=np.float32) * 3)
    assert got["stats"]["backend"] == "nccl"


# -- arguments refused before anything is enqueued ------------------------------------------------


async def test_refusals(cp: Any) -> None:
    async def body() -> None:
        x = cp.ones((4, 6), dtype=cp.float32)
        with pytest.raises(TypeError):
            await dist.all_reduce(cp.ones(4, dtype=cp.int16))  # NCCL has no 16-bit integers
        with pytest.raises(TypeError):
            await dist.all_reduce(cp.ones(4, dtype=cp.complex64), op=R.MIN)
        with pytest.raises(TypeError):
            await dist.all_reduce(cp.ones(4, dtype=cp.int32), op=R.BAND)
        with pytest.raises(ValueError):
            await dist.all_reduce(x[:, ::2])  # a strided output written in place
        with pytest.raises(ValueError):
            await dist.all_gather([x, x], x)  # two outputs for a group of one
        with pytest.raises(ValueError):
            await dist.all_gather_into_tensor(cp.zeros(5, dtype=cp.float32), x)
        y = cp.full(8, 2.0, dtype=cp.float32)
        src = y[::2]  # a strided *input* is fine: copied on the caller's stream first
        out = cp.zeros(4, dtype=cp.float32)
        await dist.all_gather_into_tensor(out, src)
        assert out.get().tolist() == [2.0] * 4
        await dist.all_reduce(x)  # the group still works
        assert float(x.sum()) == 24.0

    await one_rank(body)


# -- Work -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_work_semantics(cp: Any) -> None:
    """``await work`` resolves when the GPU is done; ``await work.wait()`` makes the current
    stream wait (the CPU does not); ``synchronize``/``block_current_stream`` too;
    ``is_completed`` is True once done; a 0-d and an empty array work."""
    from aiodist_cuda.work import CudaWork

    # 256 MiB of float32 on a GPU: long enough that ordering matters; on the simulator (host memory,
    # where nothing races) 4 MiB, so CI does not spend 10 s adding ones
    n = 1 << (20 if os.environ.get("AIODIST_TEST_GPU_SIMULATED") else 26)

    async def body() -> None:
        x = cp.ones(n, dtype=cp.float32)
        work = await started(dist.all_reduce(x, op=R.PREMUL_SUM(2.0), async_op=True))
        assert isinstance(work, CudaWork)
        assert await work.wait() is True  # the current stream now waits for the op
        assert float(x.sum()) == 2.0 * n  # a kernel on the current stream sees the result
        await work
        assert work.is_completed()
        work.synchronize()
        work.block_current_stream()
        assert await work.wait(timeout=30) is True

        y = cp.ones(n, dtype=cp.float32)
        w2 = await started(dist.all_reduce(y, op=R.PREMUL_SUM(3.0), async_op=True))
        await w2  # resolves on the loop when the GPU is done: the host sees it without a sync
        assert w2.is_completed()
        assert float(y[-1].get()) == 3.0

        # many in flight at once, awaited out of order
        xs = [cp.full(1000 + i, float(i), dtype=cp.float64) for i in range(16)]
        works = [await started(dist.all_reduce(a, op=R.PREMUL_SUM(2.0), async_op=True)) for a in xs]
        for w in reversed(works):
            await w
        for i, a in enumerate(xs):
            assert np.array_equal(a.get(), np.full(1000 + i, 2.0 * i))

        z = cp.asarray(np.float32(5.0))  # 0-d
        await dist.all_reduce(z, op=R.PREMUL_SUM(2.0))
        assert float(z.get()) == 10.0
        e = cp.zeros(0, dtype=cp.float32)  # empty
        await dist.all_reduce(e)
        await dist.broadcast(e, src=0)

    await one_rank(body)


async def test_the_callers_stream_is_respected(cp: Any) -> None:
    """An op issued under ``with stream:`` starts after what that stream queued before it (the
    fill below is still running when the op is issued), and wait() orders later work after it."""
    n = 1 << (20 if os.environ.get("AIODIST_TEST_GPU_SIMULATED") else 26)  # see test_work_semantics

    async def body() -> None:
        s = cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(n, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        with s:
            x.fill(7.0)
            x *= 1.0  # more queued work on s
            work = await started(dist.all_reduce(x, op=R.PREMUL_SUM(2.0), async_op=True))
            await work.wait()  # s waits for the op
            total = float(x.sum())  # runs on s, after the op
        assert total == 14.0 * n
        await work

    await one_rank(body)


# -- launch and completion modes --------------------------------------------------------------------

MODES = [
    ("thread", "thread", ""),
    ("loop", "thread", ""),
    ("thread", "hostfunc", ""),
    ("loop", "hostfunc", ""),
    ("thread", "thread", "1"),
]


@pytest.mark.parametrize(("launch", "completion", "spin"), MODES, ids=[f"{a}-{b}{'-spin' if c else ''}" for a, b, c in MODES])
async def test_modes(cp: Any, monkeypatch: pytest.MonkeyPatch, launch: str, completion: str, spin: str) -> None:
    """Every AIODIST_CUDA_LAUNCH x AIODIST_CUDA_COMPLETION (and SPIN) gives right results, in
    order, with sync and async ops mixed."""
    monkeypatch.setenv("AIODIST_CUDA_LAUNCH", launch)
    monkeypatch.setenv("AIODIST_CUDA_COMPLETION", completion)
    if spin:
        monkeypatch.setenv("AIODIST_CUDA_SPIN", spin)
    else:
        monkeypatch.delenv("AIODIST_CUDA_SPIN", raising=False)

    async def body() -> dict[str, Any]:
        x = cp.ones(1 << 20, dtype=cp.float32)
        for _ in range(5):
            await dist.all_reduce(x, op=R.PREMUL_SUM(2.0))  # chained on one array: order matters
        works = []
        ys = [cp.full(4096, float(i), dtype=cp.float32) for i in range(32)]
        for y in ys:
            works.append(await started(dist.all_reduce(y, op=R.PREMUL_SUM(0.5), async_op=True)))
        await asyncio.gather(*(asyncio.ensure_future(_await(w)) for w in works))
        assert all(w.is_completed() for w in works)
        b = cp.zeros(7, dtype=cp.int64)
        await dist.all_gather_into_tensor(b, cp.arange(7, dtype=cp.int64))
        return {
            "x": float(x[0].get()),
            "ys": [float(y[0].get()) for y in ys],
            "b": b.get().tolist(),
            "stats": dist.current_world().devices["cuda"].stats(),
        }

    got = await one_rank(body)
    assert got["x"] == 32.0
    assert got["ys"] == [i * 0.5 for i in range(32)]
    assert got["b"] == list(range(7))
    assert got["stats"]["launch"] == launch
    assert got["stats"]["completion"] == (completion if not spin else "spin")


async def _await(w: Any) -> None:
    await w


# -- staging through the host ("gloo" only) ------------------------------------------------------


async def test_staging_on_a_gloo_world(cp: Any) -> None:
    """A "gloo" World has no NCCL: CuPy arrays go through pinned host copies, after what the
    caller's stream queued, and the results land in the CuPy arrays."""
    n = 1 << 22

    async def body() -> None:
        s = cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(n, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        with s:
            x.fill(7.0)  # queued on s, maybe still running when the staging copies start
            await dist.all_reduce(x)
        assert float(x.sum()) == 7.0 * n
        out = cp.full(n, -1.0, dtype=cp.float32)
        inp = cp.arange(n, dtype=cp.float32)
        work = await dist.all_gather_into_tensor(out, inp, async_op=True)
        assert work is not None
        await work
        assert bool((out == inp).all())
        lst = [cp.zeros(5, dtype=cp.int64)]
        await dist.all_gather(lst, cp.arange(5, dtype=cp.int64))
        assert lst[0].get().tolist() == list(range(5))
        dst = cp.zeros(5, dtype=cp.float64)
        await dist.scatter(dst, scatter_list=[cp.arange(5, dtype=cp.float64)], src=0)
        assert dst.get().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert "nccl" not in str(dist.get_backend())

    await one_rank(body, backend="gloo")


async def test_mixed_world_dispatches_by_device(cp: Any) -> None:
    """``"cpu:gloo,cuda:nccl"``: NumPy arrays run on the CPU backend, CuPy arrays on NCCL."""

    async def body() -> dict[str, Any]:
        h = np.arange(6, dtype=np.float64)
        await dist.all_reduce(h)
        d = cp.arange(6, dtype=cp.float64)
        await dist.all_reduce(d, op=R.PREMUL_SUM(2.0))
        be = dist.current_world().devices["cuda"]
        return {"h": h.tolist(), "d": d.get().tolist(), "name": be.name, "ops": be.stats()["ops"]}

    got = await one_rank(body)
    assert got["h"] == list(map(float, range(6)))
    assert got["d"] == [2.0 * i for i in range(6)]
    assert got["name"] == "nccl"
    assert got["ops"] >= 1
