"""The collectives of aiodist/algorithms over the in-memory LocalP2P: every collective for world
sizes 1..9, 16 and 17, every root, uneven sizes, float64/float32/int64 against numpy, on the
latency-bound and the bandwidth-bound schedules (forced through Thresholds); all_reduce's
bitwise identity; ops in flight at once; no deadlock on a transport that holds nothing
(capacity 0: every send waits for its receive). Plus LocalP2P's own contract and the
thresholds table."""

# The per-rank lambdas below close over loop variables on purpose: each is awaited to completion
# in the iteration that makes it, so late binding cannot bite.
# ruff: noqa: B023

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from aiodist.algorithms import (
    P2P,
    LocalP2P,
    SubP2P,
    Thresholds,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    local_world,
    reduce,
    reduce_scatter,
    scatter,
)
from aiodist.algorithms import thresholds as thr

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17]
DTYPES = [np.float64, np.float32, np.int64]

# Every latency-bound schedule / every bandwidth-bound one, the latter in tiny pieces (so even
# small arrays travel as many pipelined messages) / all_reduce's middle path.
SMALL = Thresholds.latency_bound()
LARGE = Thresholds.bandwidth_bound(24)
MIDDLE = Thresholds.halving(24)
PATHS = {"small": SMALL, "large": LARGE}
ALLREDUCE_PATHS = {"rd": SMALL, "halving": MIDDLE, "ring": LARGE}


def add(d: np.ndarray, s: np.ndarray) -> None:
    np.add(d, s, out=d)


def minimum(d: np.ndarray, s: np.ndarray) -> None:
    np.minimum(d, s, out=d)


async def run(
    n: int, fn: Callable[[LocalP2P], Coroutine[Any, Any, Any]], *, capacity: int = 4, seed: int | None = None, timeout: float = 10
) -> tuple[list[LocalP2P], list[Any]]:
    """Run ``fn`` on every rank of a fresh world; then nothing may be left unmatched."""
    ws = local_world(n, capacity=capacity, seed=seed)
    async with asyncio.timeout(timeout):
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(fn(w)) for w in ws]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
    assert ws[0].world.unmatched() == []
    return ws, [t.result() for t in tasks]


def data(rng: np.random.Generator, n: int, dtype: Any) -> np.ndarray:
    """Values over many magnitudes, so a float sum depends on its order."""
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def assert_sum(got: np.ndarray, parts: list[np.ndarray]) -> None:
    ref = np.sum(parts, axis=0, dtype=got.dtype)
    if got.dtype.kind != "f":
        np.testing.assert_array_equal(got, ref)
        return
    # any summation order is within n * eps * sum|x| of any other
    bound = 4 * len(parts) * np.finfo(got.dtype).eps * np.sum(np.abs(parts), axis=0, dtype=np.float64)
    assert np.all(np.abs(got.astype(np.float64) - ref.astype(np.float64)) <= bound + np.finfo(got.dtype).tiny)


def sizes(rng: np.random.Generator, n: int, hi: int = 12) -> list[int]:
    s = rng.integers(0, hi, n).tolist()
    if n > 2:
        s[int(rng.integers(n))] = 0  # always one empty part
    return s


# -- every collective, every size, every root --------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_broadcast(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        for root in range(n):
            src = data(rng, int(rng.integers(1, 40)), dtype)
            bufs = [src.copy() if r == root else np.zeros_like(src) for r in range(n)]
            await run(n, lambda w: broadcast(w, bufs[w.rank], root, thresholds=PATHS[path]))
            for b in bufs:
                np.testing.assert_array_equal(b, src)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_reduce(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        for root in range(n):
            m = int(rng.integers(1, 40))
            parts = [data(rng, m, dtype) for _ in range(n)]
            bufs = [p.copy() for p in parts]
            await run(n, lambda w: reduce(w, bufs[w.rank], root, add, thresholds=PATHS[path]))
            assert_sum(bufs[root], parts)
            for r in range(n):
                if r != root:
                    np.testing.assert_array_equal(bufs[r], parts[r])  # untouched


@pytest.mark.parametrize("path", ALLREDUCE_PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_all_reduce(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        for m in (1, n - 1, n, 3 * n + 1, 50):
            parts = [data(rng, max(m, 0), dtype) for _ in range(n)]
            bufs = [p.copy() for p in parts]
            await run(n, lambda w: all_reduce(w, bufs[w.rank], add, thresholds=ALLREDUCE_PATHS[path]))
            assert_sum(bufs[0], parts)
            for b in bufs:
                assert b.tobytes() == bufs[0].tobytes()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_all_gather_uneven(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        sz = sizes(rng, n)
        mine = [data(rng, sz[r], dtype) for r in range(n)]

        # half the ranks gather into views of one buffer (all_gather_into_tensor), half into separate arrays
        def outs_for(r: int) -> list[np.ndarray]:
            if r % 2:
                return [np.full(s, -1, dtype) for s in sz]
            flat = np.full(sum(sz), -1, dtype)
            b = np.cumsum([0, *sz])
            return [flat[b[i] : b[i + 1]] for i in range(n)]

        outs = [outs_for(r) for r in range(n)]
        await run(n, lambda w: all_gather(w, outs[w.rank], mine[w.rank], thresholds=PATHS[path]))
        for r in range(n):
            for i in range(n):
                np.testing.assert_array_equal(outs[r][i], mine[i])


@pytest.mark.parametrize("n", SIZES)
async def test_gather_and_scatter_uneven(n: int) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        for root in range(n):
            sz = sizes(rng, n)
            mine = [data(rng, sz[r], dtype) for r in range(n)]
            outs = [np.full(s, -1, dtype) for s in sz]
            await run(n, lambda w: gather(w, outs if w.rank == root else None, mine[w.rank], root))
            for i in range(n):
                np.testing.assert_array_equal(outs[i], mine[i])
            got = [np.full(s, -1, dtype) for s in sz]
            await run(n, lambda w: scatter(w, got[w.rank], mine if w.rank == root else None, root))
            for i in range(n):
                np.testing.assert_array_equal(got[i], mine[i])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_reduce_scatter_uneven(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        sz = sizes(rng, n)
        inputs = [[data(rng, s, dtype) for s in sz] for _ in range(n)]  # inputs[rank][part]
        before = [[x.copy() for x in row] for row in inputs]
        outs = [np.full(sz[r], -1, dtype) for r in range(n)]
        await run(n, lambda w: reduce_scatter(w, outs[w.rank], inputs[w.rank], add, thresholds=PATHS[path]))
        for r in range(n):
            assert_sum(outs[r], [inputs[k][r] for k in range(n)])
            for x, y in zip(inputs[r], before[r]):
                np.testing.assert_array_equal(x, y)  # inputs are not written


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
async def test_all_to_all_uneven(n: int, path: str) -> None:
    rng = np.random.default_rng(n)
    for dtype in DTYPES:
        sz = rng.integers(0, 6, (n, n))  # sz[i][j]: elements rank i sends to rank j
        ins = [[data(rng, int(sz[i][j]), dtype) for j in range(n)] for i in range(n)]
        outs = [[np.full(int(sz[i][j]), -1, dtype) for i in range(n)] for j in range(n)]
        await run(n, lambda w: all_to_all(w, outs[w.rank], ins[w.rank], thresholds=PATHS[path]))
        for i in range(n):
            for j in range(n):
                np.testing.assert_array_equal(outs[j][i], ins[i][j])


async def test_all_to_all_ranks_may_choose_differently() -> None:
    # burst on some ranks, pairwise on others: the same messages and tags, so it still completes
    n = 6
    ins = [[np.full(3, 10 * i + j) for j in range(n)] for i in range(n)]
    outs = [[np.empty(3, np.int64) for _ in range(n)] for _ in range(n)]
    await run(n, lambda w: all_to_all(w, outs[w.rank], ins[w.rank], thresholds=SMALL if w.rank % 2 else LARGE), capacity=0)
    assert all((outs[j][i] == 10 * i + j).all() for i in range(n) for j in range(n))


@pytest.mark.parametrize("n", SIZES)
async def test_barrier_waits_for_everyone(n: int) -> None:
    entered: set[int] = set()
    seen: list[set[int]] = []

    async def rank(w: LocalP2P) -> None:
        for _ in range(3 * w.rank):  # arrive at different times
            await asyncio.sleep(0)
        entered.add(w.rank)
        await barrier(w)
        seen.append(set(entered))

    ws, _ = await run(n, rank)
    assert all(s == set(range(n)) for s in seen)
    assert all(w.sent_messages == (n - 1).bit_length() for w in ws)


# -- all_reduce: the same bits on every rank -----------------------------------------------------


def signed_zeros(rng: np.random.Generator, m: int, dtype: Any) -> np.ndarray:
    return np.where(rng.random(m) < 0.5, -0.0, 0.0).astype(dtype)


def nans(rng: np.random.Generator, m: int, dtype: Any) -> np.ndarray:
    # quiet NaNs with different payloads: x86 keeps the first operand's payload in a + b
    uint, quiet = (np.uint64, 0x7FF8000000000000) if dtype == np.float64 else (np.uint32, 0x7FC00000)
    out = np.bitwise_or(rng.integers(1, 1000, m).astype(uint), quiet, dtype=uint).view(dtype)
    out[rng.random(m) < 0.3] = 1.0
    return out


@pytest.mark.parametrize("path", ALLREDUCE_PATHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_all_reduce_is_bitwise_identical(dtype: Any, path: str) -> None:
    # sums whose value depends on order, MIN of +0.0/-0.0 (np.minimum returns its second operand
    # on a tie), sums of NaNs with different payloads, and a combine that is neither commutative
    # nor associative: every rank must still hold the same bytes.
    def skew(d: np.ndarray, s: np.ndarray) -> None:
        d *= 3
        d -= s

    rng = np.random.default_rng(7)
    cases: list[tuple[Callable[[np.ndarray, np.ndarray], None], Callable[[np.random.Generator, int, Any], np.ndarray]]] = [
        (add, data),
        (minimum, signed_zeros),
        (add, nans),
        (skew, lambda r, m, dt: r.integers(-3, 4, m).astype(dt)),
    ]
    for n in (2, 3, 5, 6, 7, 8, 9, 12, 16, 17):
        for combine, make in cases:
            m = int(rng.integers(n, 70))
            parts = [make(rng, m, dtype) for _ in range(n)]
            bufs = [p.copy() for p in parts]
            await run(n, lambda w: all_reduce(w, bufs[w.rank], combine, thresholds=ALLREDUCE_PATHS[path]), seed=n)
            assert len({b.tobytes() for b in bufs}) == 1, (n, combine.__name__)


def test_lower_rank_first_matters() -> None:
    # why recursive doubling orders its operands: these combines are not bitwise commutative
    z, nz = np.array([0.0]), np.array([-0.0])
    assert np.minimum(z, nz).tobytes() != np.minimum(nz, z).tobytes()
    a, b = np.array([0x7FF8000000000001, 0x7FF8000000000002], np.uint64).view(np.float64)
    assert np.float64(a + b).tobytes() != np.float64(b + a).tobytes()


# -- size 1, empty arrays, message counts ----------------------------------------------------


async def test_size_one_sends_nothing() -> None:
    x = np.arange(5.0)
    (w,) = local_world(1)
    await broadcast(w, x.copy(), 0)
    await reduce(w, y := x.copy(), 0, add)
    np.testing.assert_array_equal(y, x)
    await all_reduce(w, y, add)
    np.testing.assert_array_equal(y, x)
    out = [np.empty(5)]
    await all_gather(w, out, x)
    await gather(w, out, x, 0)
    await scatter(w, out[0], [x], 0)
    await reduce_scatter(w, out[0], [x], add)
    await all_to_all(w, out, [x])
    await barrier(w)
    np.testing.assert_array_equal(out[0], x)
    assert w.sent_messages == 0


@pytest.mark.parametrize("th", [SMALL, LARGE, MIDDLE], ids=["small", "large", "middle"])
async def test_empty_arrays_send_nothing(th: Thresholds) -> None:
    e = np.empty(0)

    async def rank(w: LocalP2P) -> None:
        await broadcast(w, e, 1, thresholds=th)
        await reduce(w, e, 2, add, thresholds=th)
        await all_reduce(w, e, add, thresholds=th)
        await all_gather(w, [e] * 4, e, thresholds=th)
        await reduce_scatter(w, e, [e] * 4, add, thresholds=th)
        await all_to_all(w, [e] * 4, [e] * 4, thresholds=th)

    ws, _ = await run(4, rank)
    assert sum(w.sent_messages for w in ws) == 0


async def test_message_counts_follow_the_schedule() -> None:
    x = [np.ones(8) for _ in range(8)]
    ws, _ = await run(8, lambda w: all_reduce(w, x[w.rank], add, thresholds=SMALL))
    assert [w.sent_messages for w in ws] == [3] * 8  # recursive doubling: log2 p exchanges
    ws, _ = await run(8, lambda w: all_reduce(w, x[w.rank], add, thresholds=Thresholds(allreduce_rd_max=-1, allreduce_ring_min=0)))
    assert [w.sent_messages for w in ws] == [14] * 8  # ring: 2(p-1) chunks of 1 element
    ws, _ = await run(5, lambda w: all_reduce(w, x[w.rank], add, thresholds=SMALL))
    assert [w.sent_messages for w in ws] == [3, 1, 2, 2, 2]  # rank 1 folds into 0 and waits
    ws, _ = await run(8, lambda w: broadcast(w, x[w.rank], 3, thresholds=SMALL))
    assert sum(w.sent_messages for w in ws) == 7 and ws[3].sent_messages == 3  # a tree: p-1 messages
    ws, _ = await run(8, lambda w: all_gather(w, [np.empty(8) for _ in range(8)], x[w.rank], thresholds=SMALL))
    assert [w.sent_messages for w in ws] == [3] * 8  # Bruck: log2 p steps


async def test_thresholds_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # env-based on purpose: its subject is the AIODIST_ALGO_* fallback of an op given no thresholds
    x = [np.ones(8) for _ in range(4)]
    ws, _ = await run(4, lambda w: all_reduce(w, x[w.rank], add))
    assert [w.sent_messages for w in ws] == [2] * 4
    monkeypatch.setenv("AIODIST_ALGO_ALLREDUCE_RD_MAX", "-1")
    monkeypatch.setenv("AIODIST_ALGO_ALLREDUCE_RING_MIN", "0")
    ws, _ = await run(4, lambda w: all_reduce(w, x[w.rank], add))
    assert [w.sent_messages for w in ws] == [6] * 4
    assert (x[0] == 16).all()


# -- ops in flight at once, no deadlock --------------------------------------------------------


async def test_several_ops_in_flight_at_once() -> None:
    n = 5
    rng = np.random.default_rng(3)
    worlds = [local_world(n, capacity=1, seed=s) for s in range(5)]
    a = [data(rng, 40, np.float64) for _ in range(n)]
    b = [np.arange(30.0) if r == 2 else np.zeros(30) for r in range(n)]
    c = [np.full(r + 1, r, np.int64) for r in range(n)]
    c_out = [[np.empty(i + 1, np.int64) for i in range(n)] for _ in range(n)]
    d = [data(rng, 33, np.float32) for _ in range(n)]
    a_ref, d_ref = list(a), list(d)
    a, d = [x.copy() for x in a], [x.copy() for x in d]

    async def rank(r: int) -> None:
        # issued together, awaited together: each op has its own P2P, so their messages never meet
        await asyncio.gather(
            all_reduce(worlds[0][r], a[r], add, thresholds=LARGE),
            broadcast(worlds[1][r], b[r], 2, thresholds=LARGE),
            all_gather(worlds[2][r], c_out[r], c[r], thresholds=SMALL),
            barrier(worlds[3][r]),
            all_reduce(worlds[4][r], d[r], add, thresholds=MIDDLE),
        )

    async with asyncio.timeout(10):
        await asyncio.gather(*(rank(r) for r in range(n)))
    assert_sum(a[0], a_ref)
    assert_sum(d[0], d_ref)
    assert len({x.tobytes() for x in a}) == 1 and len({x.tobytes() for x in d}) == 1
    assert all((x == np.arange(30.0)).all() for x in b)
    assert all((c_out[r][i] == i).all() for r in range(n) for i in range(n))
    assert all(w[0].world.unmatched() == [] for w in worlds)


@pytest.mark.parametrize("capacity", [0, 1])
async def test_no_deadlock_on_a_transport_that_holds_nothing(capacity: int) -> None:
    # capacity 0: a send completes only once its receive is posted (a rendezvous); pieces of 8
    # bytes make every pipelined schedule send many messages down each channel
    tiny = Thresholds.bandwidth_bound(8)
    middle = Thresholds.halving(8)
    for n in (2, 3, 5, 8):
        m = 3 * n + 2
        xs = [np.arange(m, dtype=np.float64) + r for r in range(n)]
        for seed, th in enumerate((SMALL, tiny, middle)):
            ops: list[Callable[[LocalP2P], Coroutine[Any, Any, None]]] = [
                lambda w: broadcast(w, xs[w.rank].copy(), n - 1, thresholds=th),
                lambda w: reduce(w, xs[w.rank].copy(), n // 2, add, thresholds=th),
                lambda w: all_reduce(w, xs[w.rank].copy(), add, thresholds=th),
                lambda w: all_gather(w, [np.empty(m) for _ in range(n)], xs[w.rank], thresholds=th),
                lambda w: gather(w, [np.empty(m) for _ in range(n)] if w.rank == 0 else None, xs[w.rank], 0),
                lambda w: scatter(w, np.empty(m), [xs[0]] * n if w.rank == n - 1 else None, n - 1),
                lambda w: reduce_scatter(w, np.empty(m), [xs[w.rank]] * n, add, thresholds=th),
                lambda w: all_to_all(w, [np.empty(m) for _ in range(n)], [xs[w.rank]] * n, thresholds=th),
                barrier,
            ]
            for op in ops:  # one world per op, as the P2P contract has it
                await run(n, op, capacity=capacity, seed=seed)


# -- failures --------------------------------------------------------------------------------


async def test_a_size_mismatch_between_ranks_is_an_error_not_a_hang() -> None:
    outs = [[np.empty(3), np.empty(3), np.empty(3)] for _ in range(3)]
    outs[2][0] = np.empty(4)  # rank 2 believes rank 0 contributes 4 elements
    with pytest.raises(ValueError, match="bytes"):
        await run(3, lambda w: all_gather(w, outs[w.rank], np.ones(3), thresholds=LARGE), capacity=0)


async def test_bad_arguments_are_refused_before_anything_is_sent() -> None:
    ws = local_world(3)
    w = ws[0]
    two_d = np.zeros((2, 2))
    ro = np.zeros(3)
    ro.flags.writeable = False
    cases: list[tuple[type[Exception], Awaitable[None]]] = [
        (ValueError, all_reduce(w, two_d, add)),
        (ValueError, all_reduce(w, np.zeros(6)[::2], add)),
        (ValueError, all_reduce(w, ro, add)),
        (TypeError, all_reduce(w, [1.0, 2.0], add)),  # type: ignore[arg-type]
        (ValueError, broadcast(w, np.zeros(3), 3)),
        (ValueError, reduce(w, np.zeros(3), -1, add)),
        (ValueError, all_gather(w, [np.zeros(3)] * 2, np.zeros(3))),
        (TypeError, all_gather(w, [np.zeros(3), np.zeros(3, np.float32), np.zeros(3)], np.zeros(3))),
        (ValueError, all_gather(w, [np.zeros(2), np.zeros(3), np.zeros(3)], np.zeros(3))),
        (ValueError, gather(w, None, np.zeros(3), 0)),
        (ValueError, scatter(w, np.zeros(3), None, 0)),
        (ValueError, reduce_scatter(w, np.zeros(2), [np.zeros(3)] * 3, add)),
        (ValueError, all_to_all(w, [np.zeros(3)] * 3, [np.zeros(3)] * 2)),
        (ValueError, all_to_all(w, [ro] * 3, [np.zeros(3)] * 3)),
    ]
    for exc, coro in cases:
        with pytest.raises(exc):
            await coro
    assert w.sent_messages == 0 and w.world.unmatched() == []


# -- LocalP2P ----------------------------------------------------------------------------------


def test_local_p2p_is_a_p2p() -> None:
    assert isinstance(local_world(2)[0], P2P)


async def test_local_p2p_matches_by_tag_and_copies_on_handover() -> None:
    a, b = local_world(2)
    x = np.arange(4.0)
    await a.send(1, x, 7)
    await a.send(1, x * 2, 3)
    x[:] = -1  # the transport holds a copy once send returned
    got = np.empty(4)
    await b.recv(0, got, 3)
    np.testing.assert_array_equal(got, np.arange(4.0) * 2)
    await b.recv(0, got, 7)
    np.testing.assert_array_equal(got, np.arange(4.0))
    assert a.sent_messages == 2 and a.sent_bytes == 64
    # raw bytes: any dtype in, any dtype of the same size out
    await a.send(1, np.arange(2, dtype=np.int32), 9)
    raw = np.empty(8, np.uint8)
    await b.recv(0, raw, 9)
    assert raw.view(np.int32).tolist() == [0, 1]


async def test_local_p2p_is_bounded() -> None:
    a, b = local_world(2, capacity=1)
    await a.send(1, np.zeros(1), 0)
    blocked = asyncio.ensure_future(a.send(1, np.ones(1), 1))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not blocked.done()  # the channel holds one message
    got = np.empty(1)
    await b.recv(0, got, 1)  # posting its receive lets the blocked send through
    await asyncio.wait_for(blocked, 1)
    assert got[0] == 1
    await b.recv(0, got, 0)
    assert got[0] == 0 and a.world.unmatched() == []


async def test_local_p2p_rendezvous() -> None:
    a, b = local_world(2, capacity=0)
    send = asyncio.ensure_future(a.send(1, np.ones(2), 5))
    await asyncio.sleep(0)
    assert not send.done()
    got = np.zeros(2)
    await b.recv(0, got, 5)
    await send
    assert (got == 1).all()


async def test_local_p2p_size_mismatch() -> None:
    a, b = local_world(2)
    await a.send(1, np.ones(3), 0)  # staged: the receiver finds out
    with pytest.raises(ValueError, match="24 bytes, the receive buffer 16"):
        await b.recv(0, np.empty(2), 0)
    recv = asyncio.ensure_future(b.recv(0, np.empty(2), 1))  # posted: both ends find out
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="receive buffer 16"):
        await a.send(1, np.ones(3), 1)
    with pytest.raises(ValueError, match="receive buffer 16"):
        await recv


async def test_local_p2p_refuses_misuse() -> None:
    a, b = local_world(2)
    with pytest.raises(ValueError):
        await a.send(0, np.ones(1), 0)  # to itself
    with pytest.raises(ValueError):
        await a.send(2, np.ones(1), 0)
    with pytest.raises(ValueError):
        await a.send(1, np.ones(1), -1)
    with pytest.raises(ValueError):
        await a.send(1, np.ones(1), 1 << 36)  # CHANNEL_TAG_LIMIT (sub-ops of an op live in [2**31, 2**36))
    with pytest.raises(ValueError):
        await SubP2P(a, 0).send(1, np.ones(1), 1 << 31)  # a sub-op's own tags are the algorithms'
    with pytest.raises(ValueError):
        await a.send(1, np.ones((4, 4))[:, 0], 0)  # not contiguous
    with pytest.raises(TypeError):
        await a.send(1, np.array([object()]), 0)
    ro = np.ones(1)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        await b.recv(0, ro, 0)
    await a.send(1, np.ones(1), 4)
    with pytest.raises(ValueError, match="twice"):
        await a.send(1, np.ones(1), 4)
    await b.recv(0, np.empty(1), 4)
    with pytest.raises(ValueError):
        local_world(0)
    with pytest.raises(ValueError):
        local_world(2, capacity=-1)


async def test_local_p2p_cancelled_receive_leaves_nothing_behind() -> None:
    a, b = local_world(2)
    recv = asyncio.ensure_future(b.recv(0, np.empty(1), 0))
    await asyncio.sleep(0)
    assert b.world.unmatched() == [(0, 1, 0)]
    recv.cancel()
    with pytest.raises(asyncio.CancelledError):
        await recv
    assert b.world.unmatched() == []


# -- thresholds ------------------------------------------------------------------------------


def test_thresholds_from_env() -> None:
    # env-based on purpose: its subject is from_env, the AIODIST_ALGO_* variables' parsing and refusals
    assert thr.from_env({}) == Thresholds()
    t = thr.from_env(
        {
            "AIODIST_ALGO_ALLREDUCE_RD_MAX": "32K",
            "AIODIST_ALGO_PIPELINE_PIECE": "1MiB",
            "AIODIST_ALGO_BROADCAST_TREE_MAX": " 100 ",
            "PATH": "/bin",
        }
    )
    assert (t.allreduce_rd_max, t.pipeline_piece, t.broadcast_tree_max) == (32 << 10, 1 << 20, 100)
    assert t.allreduce_ring_min == Thresholds().allreduce_ring_min
    with pytest.raises(ValueError, match="AIODIST_ALGO_ALLREDUCE_RD_MAX"):
        thr.from_env({"AIODIST_ALGO_ALLREDUCE_RD_MAX": "lots"})
    with pytest.raises(ValueError, match="unknown AIODIST_ALGO_ALLREDUCE_MAX"):
        thr.from_env({"AIODIST_ALGO_ALLREDUCE_MAX": "1"})
    with pytest.raises(ValueError, match="pipeline_piece"):
        thr.from_env({"AIODIST_ALGO_PIPELINE_PIECE": "0"})


async def test_run_world_gives_every_ranks_default_group_its_pg_options() -> None:
    """run_world's pg_options reach every rank's init_process_group: a mapping is applied over
    the process's table, a Thresholds is used as it is, none leaves the process's table; a
    group made later takes its own (here none: the process's table); a bad one is refused."""
    import aiodist as dist
    from aiodist.testing import run_world

    async def tables(rank: int) -> tuple[Thresholds, Thresholds, float]:
        world = dist.GroupMember.WORLD
        assert isinstance(world, dist.ProcessGroup)
        sub = await dist.new_group([0, 1])
        x = np.full(300, rank + 1.0)
        await dist.all_reduce(x)  # the rules leave the results alone
        return world.thresholds, sub.thresholds, float(x[0])

    process = thr.current()
    rules = {"lane_max": 0, "allreduce_rd_max": -1, "allreduce_ring_min": "1K"}
    want = dataclasses.replace(process, lane_max=0, allreduce_rd_max=-1, allreduce_ring_min=1024)
    assert want != process and want.all_reduce(2400) == "ring" != process.all_reduce(2400)
    assert await run_world(2, tables, pg_options=rules) == [(want, process, 3.0)] * 2
    table = Thresholds.latency_bound()
    for world_th, sub_th, value in await run_world(2, tables, "gloo", pg_options=table):
        assert world_th is table and sub_th == process and value == 3.0
    assert await run_world(2, tables) == [(process, process, 3.0)] * 2
    with pytest.raises(ValueError, match="pg_options: unknown threshold 'lane'"):
        await run_world(2, tables, pg_options={"lane": 0})


def test_thresholds_choose_by_size() -> None:
    t = Thresholds()
    assert t.all_reduce(8) == "recursive_doubling"
    assert t.all_reduce(t.allreduce_rd_max + 1) == "halving_doubling"
    assert t.all_reduce(t.allreduce_ring_min) == "ring"
    assert t.broadcast(t.broadcast_tree_max) == "tree" and t.broadcast(t.broadcast_tree_max + 1) == "chain"
    assert t.all_gather(1) == "bruck" and t.all_gather(1 << 30) == "ring"
    assert t.reduce_scatter(1) == "direct" and t.reduce_scatter(1 << 30) == "ring"
    assert t.all_to_all(1) == "burst" and t.all_to_all(1 << 30) == "pairwise"
    assert t.piece_elems(8) == t.pipeline_piece // 8 and Thresholds(pipeline_piece=3).piece_elems(8) == 1


# -- reduce_scatter into an output that overlaps this rank's own input ---------------------------

RING_RS = Thresholds(reduce_scatter_direct_max=0)  # the ring path, in its default pieces


@pytest.mark.parametrize("offset", [0, 7])
async def test_reduce_scatter_out_overlapping_its_own_input(offset: int) -> None:
    """``out`` laid over ``inputs_per_rank[rank]`` itself (offset 0: the in-place form) or 7
    elements further on, with parts bigger than the 1 MiB copy step: a piecewise forward copy of
    the input into ``out`` would overwrite input elements before reading them (it did: that case
    took the in-place path). Every rank's other parts are separate arrays."""
    n, m = 2, (1 << 20) // 4 + 1000  # float32: just over one copy step per part
    rng = np.random.default_rng(offset)
    values = [[rng.integers(-1000, 1000, m).astype(np.float32) for _ in range(n)] for _ in range(n)]  # [rank][part]
    want = [np.sum([values[k][r] for k in range(n)], axis=0, dtype=np.float32) for r in range(n)]
    outs: list[np.ndarray] = []
    inputs: list[list[np.ndarray]] = []
    for r in range(n):
        own = np.zeros(m + offset, np.float32)
        own[:m] = values[r][r]
        inputs.append([own[:m] if i == r else values[r][i].copy() for i in range(n)])
        outs.append(own[offset : offset + m])  # a view of its own: never the input object itself
    await run(n, lambda w: reduce_scatter(w, outs[w.rank], inputs[w.rank], add, thresholds=RING_RS))
    for r in range(n):
        np.testing.assert_array_equal(outs[r], want[r])


# -- the scratch pool ---------------------------------------------------------------------------------


class _Watched:
    """The scratch pool's take/give, watched: which arrays are out, and none handed out twice."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from aiodist.algorithms import collectives as colls

        pool = colls._POOL
        pool.clear()
        self.out: list[np.ndarray] = []
        self.taken: list[np.ndarray] = []
        self.given: list[np.ndarray] = []
        self.most_out = 0
        take, give = pool.take, pool.give

        def watched_take(dtype: Any, k: int) -> np.ndarray:
            a = take(dtype, k)
            assert not any(np.shares_memory(a, b) for b in self.out), "a scratch array held by one op was handed to another"
            self.out.append(a)
            self.taken.append(a)
            self.most_out = max(self.most_out, len(self.out))
            return a

        def watched_give(a: np.ndarray) -> None:
            self.out = [b for b in self.out if b is not a]
            self.given.append(a)
            give(a)

        monkeypatch.setattr(pool, "take", watched_take)
        monkeypatch.setattr(pool, "give", watched_give)
        self.pool = pool


async def test_scratch_pool_ops_in_flight_get_their_own_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two all_reduces of the same dtype and size in flight at once (ring, in small pieces, so
    they interleave) each hold their own scratch, taken from the pool (one array is waiting
    there, given back by an op before them), and leave the same bits as one alone."""
    watched = _Watched(monkeypatch)
    n, m = 2, 3000
    rng = np.random.default_rng(5)
    xs = [data(rng, m, np.float32) for _ in range(n)]
    ref = [x.copy() for x in xs]
    await run(n, lambda w: all_reduce(w, ref[w.rank], add, thresholds=LARGE))  # alone; its scratch goes back
    assert watched.given and watched.out == []
    a, b = [x.copy() for x in xs], [x.copy() for x in xs]
    ws1, ws2 = local_world(n, capacity=1), local_world(n, capacity=1)

    async def rank(r: int) -> None:
        await asyncio.gather(all_reduce(ws1[r], a[r], add, thresholds=LARGE), all_reduce(ws2[r], b[r], add, thresholds=LARGE))

    async with asyncio.timeout(10):
        await asyncio.gather(*(rank(r) for r in range(n)))
    assert watched.most_out >= 2 * n, "the ops did not hold scratch at the same time: the test proves nothing"
    assert any(t is g for t in watched.taken[n:] for g in watched.given[:n]), "no op reused the pool's array"
    for r in range(n):
        assert a[r].tobytes() == ref[0].tobytes() and b[r].tobytes() == ref[0].tobytes()
    assert watched.out == []


async def test_scratch_pool_keeps_no_scratch_of_a_failed_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed op's scratch is not given back (a cancelled receive may still land in it)."""
    watched = _Watched(monkeypatch)
    n, m = 2, 3000
    rng = np.random.default_rng(6)
    xs = [data(rng, m, np.float32) for _ in range(n)]

    def broken(d: np.ndarray, s: np.ndarray) -> None:
        raise RuntimeError("combine failed")

    with pytest.raises(RuntimeError, match="combine failed"):
        await run(n, lambda w: all_reduce(w, xs[w.rank], broken if w.rank == 0 else add, thresholds=LARGE))
    assert watched.taken, "the op took no scratch: the test proves nothing"
    assert watched.given == [] and watched.pool.cached_bytes == 0
