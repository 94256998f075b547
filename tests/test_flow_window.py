"""Pipelined schedules with pieces big enough (``_AHEAD_MIN_BYTES``) that ``_flow`` posts
receives ahead (aiodist/algorithms/collectives.py), over real transports: results right, and
all_reduce's bits equal on every rank. Ops run back to back and several at once, so pieces of
one op often arrive before their receives are posted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from aiodist import HashStore
from aiodist.algorithms import Thresholds, all_gather, all_reduce, broadcast, reduce, reduce_scatter
from aiodist.algorithms.collectives import _AHEAD_MIN_BYTES
from aiodist.transport import Transport

PIECE = 2 * _AHEAD_MIN_BYTES  # bytes: the schedules split evenly, so pieces come out a little under this
HUGE = 1 << 62
RING = Thresholds(  # as bandwidth_bound(PIECE), but all_to_all keeps its default (burst for small totals)
    broadcast_tree_max=-1,
    allreduce_rd_max=-1,
    allreduce_ring_min=0,
    allgather_bruck_max=-1,
    reduce_scatter_direct_max=-1,
    pipeline_piece=PIECE,
)
HALVING = Thresholds.halving(PIECE)
TREE = Thresholds(broadcast_tree_max=HUGE, pipeline_piece=PIECE)
M = 5 * PIECE // 4 * 3 + 7  # float32 elements: several pieces per chunk, uneven


def add(d: np.ndarray, s: np.ndarray) -> None:
    np.add(d, s, out=d)


@asynccontextmanager
async def world(n: int) -> AsyncIterator[list[Transport]]:
    store = HashStore()
    ts = list(await asyncio.gather(*(Transport.start(store, r, n, token="window", timeout=20) for r in range(n))))
    try:
        yield ts
    finally:
        await asyncio.gather(*(t.close() for t in ts))


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_windowed_schedules_over_sockets(n: int) -> None:
    rng = np.random.default_rng(n)
    parts = [rng.standard_normal(M).astype(np.float32) for _ in range(n)]
    want = np.sum(np.stack(parts).astype(np.float64), axis=0)
    async with world(n) as ts:
        out: dict[str, list[np.ndarray]] = {}

        async def rank(t: Transport) -> None:
            r = t.rank
            ch = lambda seq: t.channel(0, seq, range(n))  # noqa: E731
            ring, halving = parts[r].copy(), parts[r].copy()
            bcast = parts[0].copy() if r == 0 else np.zeros(M, np.float32)
            red_chain, red_tree = parts[r].copy(), parts[r].copy()
            gathered = [np.zeros(M, np.float32) for _ in range(n)]
            rs_in = [np.full(M, r + 1, np.float32) + parts[r] for _ in range(n)]
            rs_out = np.zeros(M, np.float32)
            for _ in range(2):  # back to back: the second round's pieces come early
                ring[:], halving[:] = parts[r], parts[r]
                await asyncio.gather(
                    all_reduce(ch(1), ring, add, thresholds=RING),
                    all_reduce(ch(2), halving, add, thresholds=HALVING),
                    broadcast(ch(3), bcast, 0, thresholds=RING),
                    reduce(ch(4), red_chain, 0, add, thresholds=RING),
                    reduce(ch(5), red_tree, n - 1, add, thresholds=TREE),
                    all_gather(ch(6), gathered, parts[r], thresholds=RING),
                    reduce_scatter(ch(7), rs_out, rs_in, add, thresholds=RING),
                )
                red_chain[:], red_tree[:] = parts[r], parts[r]
                await asyncio.gather(
                    reduce(ch(8), red_chain, 0, add, thresholds=RING), reduce(ch(9), red_tree, n - 1, add, thresholds=TREE)
                )
            out.setdefault("ring", []).append(ring)
            out.setdefault("halving", []).append(halving)
            out.setdefault("bcast", []).append(bcast)
            out.setdefault("rs", []).append(rs_out)
            if r == 0:
                out["red_chain"] = [red_chain]
            if r == n - 1:
                out["red_tree"] = [red_tree]
            out.setdefault("gathered", []).append(np.concatenate(gathered))

        async with asyncio.timeout(60):
            await asyncio.gather(*(rank(t) for t in ts))
        for name in ("ring", "halving"):
            np.testing.assert_allclose(out[name][0], want, rtol=1e-4, atol=1e-4)
            for got in out[name][1:]:
                assert got.tobytes() == out[name][0].tobytes(), f"{name}: ranks differ"
        for name in ("red_chain", "red_tree"):
            np.testing.assert_allclose(out[name][0], want, rtol=1e-4, atol=1e-4)
        for got in out["bcast"]:
            np.testing.assert_array_equal(got, parts[0])
        for got in out["gathered"]:
            np.testing.assert_array_equal(got, np.concatenate(parts))
        rs_want = np.sum(np.stack([np.full(M, r + 1, np.float64) + parts[r] for r in range(n)]), axis=0)
        for got in out["rs"]:
            np.testing.assert_allclose(got, rs_want, rtol=1e-4, atol=1e-4)
        assert all(t.staged_total < 1000 for t in ts)  # sanity: the run did not degenerate into staging everything
