"""The bucketing under DDP, without torch: the pure bucket assignment (a table, and torch's own
function where torch is installed) and ``Reducer`` over numpy parameter lists."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from aiodist.algorithms.ddp_comm_hooks import default_hooks
from aiodist.nn.parallel import GradBucket, Reducer
from aiodist.nn.parallel._buckets import DEFAULT_FIRST_BUCKET_BYTES, assign_buckets, bucket_limits, reverse_order
from aiodist.testing import run_world

MiB = 1024 * 1024

# (sizes in bytes, keys, limits, order) -> buckets
TABLE: list[tuple[list[int], list[str], list[int], list[int], list[list[int]]]] = [
    # rule 1 + 3: everything fits: one bucket, in the order walked
    ([4, 4, 4], ["f"] * 3, [100], [2, 1, 0], [[2, 1, 0]]),
    # rule 2: a bucket closes when it reaches the limit (>=), counting the parameter just added
    ([60, 40, 10, 90], ["f"] * 4, [100], [0, 1, 2, 3], [[0, 1], [2, 3]]),
    # rule 2: the first limit, then the next, then the last one stays
    ([50, 50, 50, 50, 50], ["f"] * 5, [50, 100], [0, 1, 2, 3, 4], [[0], [1, 2], [3, 4]]),
    # one open bucket per key; keys close independently; leftovers in the order they opened
    ([30, 80, 30, 30], ["a", "b", "a", "b"], [60], [0, 1, 2, 3], [[1], [0, 2], [3]]),
    ([10, 10, 10], ["b", "a", "b"], [100], [0, 1, 2], [[0, 2], [1]]),
    # rule 4: members in walk order
    ([10, 10, 10], ["f"] * 3, [100], [1, 2, 0], [[1, 2, 0]]),
]


@pytest.mark.parametrize(("nbytes", "keys", "limits", "order", "want"), TABLE)
def test_assign_buckets_table(nbytes: list[int], keys: list[str], limits: list[int], order: list[int], want: list[list[int]]) -> None:
    assert assign_buckets(nbytes, keys, limits, order) == want


def test_bucket_limits_are_torchs() -> None:
    assert bucket_limits(None) == [DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB]
    assert bucket_limits(25) == [DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB]
    assert bucket_limits(4) == [4 * MiB]
    assert bucket_limits(0.5) == [MiB // 2]
    for bad in (0, -1, "25", True):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            bucket_limits(bad)  # type: ignore[arg-type]
    assert reverse_order(3) == [2, 1, 0]


def test_assign_buckets_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="every parameter index"):
        assign_buckets([1, 2], ["f", "f"], [10], [0, 0])
    with pytest.raises(ValueError, match="limits"):
        assign_buckets([1], ["f"], [], [0])
    with pytest.raises(ValueError, match="keys"):
        assign_buckets([1], [], [10], [0])


def test_assign_buckets_is_torchs_function() -> None:
    torch = pytest.importorskip("torch")
    from torch._C._distributed_c10d import _compute_bucket_assignment_by_size as torch_assign

    rng = random.Random(1)
    for _ in range(400):
        n = rng.randint(1, 12)
        dtypes = [torch.float32] if rng.random() < 0.5 else [torch.float32, torch.float64]
        ts = [torch.empty(rng.choice([1, 10, 1000, 100_000, 300_000]), dtype=rng.choice(dtypes)) for _ in range(n)]
        limits = rng.choice([[MiB, 25 * MiB], [4000], [MiB, 2 * MiB], [100, MiB]])
        order = reverse_order(n) if rng.random() < 0.5 else rng.sample(range(n), n)
        # torch takes the tensors in walk order with their indices alongside
        theirs, _ = torch_assign([ts[i] for i in order], limits, [False] * n, order)
        mine = assign_buckets([t.numel() * t.element_size() for t in ts], [t.dtype for t in ts], limits, order)
        if len(dtypes) == 1:
            assert [list(b) for b in theirs] == mine
        else:  # torch lists the buckets left open in its hash map's order
            assert sorted(map(list, theirs)) == sorted(mine)


def mlp_params(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in [(5, 7), (7,), (7, 3), (3,)]]


async def test_reducer_averages_numpy_gradients_bucket_by_bucket() -> None:
    async def fn(rank: int) -> list[np.ndarray]:
        params = mlp_params()
        reducer = Reducer(params, bucket_cap_mb=40 / MiB)  # a few buckets
        assert len(reducer.buckets) >= 2
        first = reducer.buckets[0].members
        for i in reversed(range(len(params))):
            reducer.ready(i, np.full(params[i].shape, float(rank + 1 + i), np.float32))
            # the first bucket is on the wire as soon as its own gradients are in, before the rest
            assert reducer.buckets[0].issued == (i <= min(first)), i
        assert await reducer.finish() == []
        return [reducer.grad_view(i).copy() for i in range(len(params))]

    got = await run_world(3, fn)
    for i in range(4):
        want = sum(np.float32(r + 1 + i) * np.float32(1 / 3) for r in range(3))
        for rank in range(3):
            np.testing.assert_array_equal(got[rank][i], np.full(got[rank][i].shape, want, np.float32))


async def test_reducer_zero_fills_what_got_no_gradient_and_says_which() -> None:
    async def fn(rank: int) -> tuple[list[int], np.ndarray]:
        reducer = Reducer(mlp_params(), names=["w0", "b0", "w1", "b1"])
        reducer.ready(3, np.ones(3, np.float32))
        if rank == 0:
            reducer.ready(2, np.ones((7, 3), np.float32))
        missing = await reducer.finish()
        return missing, reducer.grad_view(2).copy()

    (m0, g0), (m1, g1) = await run_world(2, fn)
    assert m0 == [0, 1] and m1 == [0, 1, 2]
    np.testing.assert_array_equal(g0, np.full((7, 3), 0.5, np.float32))
    np.testing.assert_array_equal(g0, g1)


async def test_reducer_find_unused_reports_what_no_rank_used() -> None:
    async def fn(rank: int) -> set[int]:
        reducer = Reducer(mlp_params(), find_unused_parameters=True)
        reducer.ready(3, np.ones(3, np.float32))
        if rank == 1:
            reducer.ready(1, np.ones(7, np.float32))
        await reducer.finish()
        return reducer.globally_unused

    assert await run_world(2, fn) == [{0, 2}, {0, 2}]


async def test_reducer_refuses_a_second_gradient_and_mixed_parameters() -> None:
    with pytest.raises(TypeError, match="all numpy arrays or all torch tensors"):
        Reducer([np.zeros(2), [1.0, 2.0]])
    with pytest.raises(ValueError, match="at least one"):
        Reducer([])
    with pytest.raises(ValueError, match="2 names for 1 parameters"):
        Reducer([np.zeros(2)], names=["a", "b"])

    async def fn(rank: int) -> None:
        reducer = Reducer(mlp_params(), names=["w0", "b0", "w1", "b1"])
        reducer.ready(1, np.zeros(7, np.float32))
        with pytest.raises(RuntimeError, match=r"parameter b0 \(index 1\) got a second gradient"):
            reducer.ready(1, np.zeros(7, np.float32))
        await reducer.finish()

    await run_world(1, fn)


async def test_reducer_comm_hooks_on_numpy_buffers() -> None:
    calls: list[GradBucket] = []

    async def fn(rank: int) -> list[np.ndarray]:
        reducer = Reducer(mlp_params())
        reducer.register_comm_hook(None, default_hooks.fp16_compress_hook)
        for i, p in enumerate(reducer.params):
            reducer.ready(i, np.full(p.shape, 1.0 + rank, np.float32))
        await reducer.finish()
        return [reducer.grad_view(i).copy() for i in range(4)]

    got = await run_world(2, fn)
    for g in got[0]:
        np.testing.assert_array_equal(g, np.full(g.shape, 1.5, np.float32))

    async def bad_size(state: Any, bucket: GradBucket) -> Any:
        calls.append(bucket)
        return bucket.buffer()[:1]

    async def fn2(rank: int) -> None:
        reducer = Reducer(mlp_params())
        reducer.register_comm_hook(None, bad_size)
        for i, p in enumerate(reducer.params):
            reducer.ready(i, np.ones(p.shape, np.float32))
        with pytest.raises(ValueError, match="comm hook gave 1 elements for bucket 0"):
            await reducer.finish()

    await run_world(1, fn2)
    assert calls and calls[0].index() == 0 and calls[0].is_last()


async def test_bf16_hook_needs_torch_buffers() -> None:
    async def fn(rank: int) -> None:
        reducer = Reducer([np.zeros(2, np.float32)])
        reducer.register_comm_hook(None, default_hooks.bf16_compress_hook)
        with pytest.raises(TypeError, match="numpy has no bfloat16"):
            reducer.ready(0, np.ones(2, np.float32))
        reducer.abandon()

    await run_world(1, fn)


def test_import_aiodist_nn_parallel_needs_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, aiodist.nn.parallel, aiodist.algorithms.ddp_comm_hooks.default_hooks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


async def test_a_bucket_is_not_issued_while_it_is_being_filled() -> None:
    """The loop's thread may run ``_issue_ready`` (a callback posted for an earlier bucket) while
    the backward thread still writes a later bucket whose gradients have all arrived: that bucket
    must wait until it is filled."""
    seen: list[bool] = []

    async def fn(rank: int) -> None:
        reducer = Reducer(mlp_params(), bucket_cap_mb=40 / MiB)
        fill = reducer._fill

        def fill_with_the_loop_running(bucket: Any) -> None:
            reducer._issue_ready()  # as if the loop ran now, mid-fill
            seen.append(bucket.issued)
            fill(bucket)

        reducer._fill = fill_with_the_loop_running  # type: ignore[method-assign]
        for i in reversed(range(len(reducer.params))):
            reducer.ready(i, np.ones(reducer.params[i].shape, np.float32))
        await reducer.finish()

    await run_world(1, fn)
    assert seen and not any(seen)


async def test_direct_buckets_reduce_into_the_gradients_and_an_abandoned_ones_write_is_waited_for() -> None:
    """``reducer.direct`` on numpy gradients: a bucket of few gradients is reduced straight into
    them (``written``), the averages as the bucket path gives them. A step abandoned while its
    direct all_reduce is still on the wire: ``settle_late`` returns only once that op has written
    the gradients, so it cannot write into the next step's."""
    import asyncio

    async def fn(rank: int) -> tuple[set[int], list[np.ndarray], list[np.ndarray]]:
        params = mlp_params()
        reducer = Reducer(params)
        reducer.direct = True
        grads = [np.full(p.shape, float(rank + 1 + i), np.float32) for i, p in enumerate(params)]
        for i in reversed(range(len(params))):
            reducer.ready(i, grads[i])
        assert await reducer.finish() == []
        written = set(reducer.written)
        # a step abandoned on rank 0 while rank 1 is late: the op is on the wire, and writes later
        late = [np.full(p.shape, float(10 * (rank + 1)), np.float32) for p in params]
        if rank == 1:
            await asyncio.sleep(0.05)
        for i in reversed(range(len(params))):
            reducer.ready(i, late[i])
        if rank == 0:
            reducer.abandon()
            await reducer.settle_late()
        else:
            await reducer.finish()
        return written, grads, [x.copy() for x in late]  # as they are now, on rank 0 right after settle_late

    (w0, g0, l0), (w1, g1, l1) = await run_world(2, fn, timeout=20)
    assert w0 == w1 == set(range(4))
    for i in range(4):
        want = np.float32(i + 1) * np.float32(0.5) + np.float32(i + 2) * np.float32(0.5)
        assert np.array_equal(g0[i], g1[i]) and np.allclose(g0[i], want), i
        assert np.array_equal(l0[i], l1[i]) and np.allclose(l0[i], 15.0), i  # rank 0's too: settled
