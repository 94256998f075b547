"""all_reduce_coalesced, all_gather_coalesced, monitored_barrier, split_group, shrink_group,
get_backend_config, get_node_local_rank."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

import aiodist as dist
from aiodist.c10d.world import current_world
from aiodist.testing import run_world

BACKENDS = ["memory", "gloo"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_all_reduce_coalesced(backend: str, n: int) -> None:
    async def fn(rank: int) -> list[list[float]]:
        ts = [np.full(4, rank + 1.0), np.arange(3.0) * (rank + 1), np.full((2, 2), float(rank))]
        w = await dist.all_reduce_coalesced(ts, async_op=True)
        assert isinstance(w, dist.Work)
        assert (await w)[0] is ts[0]
        x = [np.array([rank + 1], np.int32), np.array([2, rank], np.int32)]
        await dist.all_reduce_coalesced(x, op=dist.ReduceOp.MAX)
        assert x[0][0] == n and x[1].tolist() == [2, n - 1]
        return [t.ravel().tolist() for t in ts]

    out = await run_world(n, fn, backend=backend, timeout=20)
    s = sum(r + 1.0 for r in range(n))
    assert out[0] == [[s] * 4, [0.0, s, 2 * s], [float(sum(range(n)))] * 4]
    assert all(o == out[0] for o in out)


async def test_all_reduce_coalesced_refuses_bad_arguments_and_stays_usable() -> None:
    async def fn(rank: int) -> None:
        mixed = [np.ones(2), np.ones(2, np.float32)]  # mixed dtypes are taken, as torch takes them
        await dist.all_reduce_coalesced(mixed)
        assert all((m == 2).all() for m in mixed) and mixed[1].dtype == np.float32
        with pytest.raises(ValueError, match="empty"):
            await dist.all_reduce_coalesced([])
        with pytest.raises(TypeError, match="list"):
            await dist.all_reduce_coalesced("ab")  # type: ignore[arg-type]
        one = np.ones(2)
        await dist.all_reduce_coalesced(one)  # a single tensor, as torch takes it
        assert (one == 2).all()
        with pytest.raises(TypeError, match="BAND"):
            await dist.all_reduce_coalesced([np.ones(2)], op=dist.ReduceOp.BAND)
        x = [np.ones(2)]
        await dist.all_reduce_coalesced(x)
        assert (x[0] == 2).all()

    await run_world(2, fn)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 4])
async def test_all_gather_coalesced_mixed_dtypes(backend: str, n: int) -> None:
    async def fn(rank: int) -> None:
        ins = [np.full(3, rank, np.int64), np.array([rank + 0.5], np.float32), np.full((2, 2), rank + 1j, np.complex64)]
        outs = [[np.empty_like(t) for t in ins] for _ in range(n)]  # torch's layout: [rank][tensor]
        await dist.all_gather_coalesced(outs, ins)
        for r in range(n):
            assert outs[r][0].tolist() == [r] * 3
            assert outs[r][1].tolist() == [r + 0.5]
            assert (outs[r][2] == r + 1j).all()
        with pytest.raises(ValueError, match="one list per rank"):
            await dist.all_gather_coalesced(outs + [outs[0]], ins)
        with pytest.raises(ValueError, match="tensors, input_tensor_list"):
            await dist.all_gather_coalesced([row[:1] for row in outs], ins)
        with pytest.raises(TypeError, match="int64"):
            await dist.all_gather_coalesced([[np.empty(3, np.int32)] for _ in range(n)], ins[:1])

    await run_world(n, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_monitored_barrier_passes(backend: str) -> None:
    async def fn(rank: int) -> None:
        await asyncio.sleep(0.05 * rank)
        await dist.monitored_barrier(timeout=5)
        await dist.monitored_barrier(wait_all_ranks=True)
        x = np.ones(1)
        await dist.all_reduce(x)
        assert x[0] == 3

    await run_world(3, fn, backend=backend, timeout=20)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.5 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("wait_all", [False, True])
async def test_monitored_barrier_names_the_ranks_that_did_not_come(wait_all: bool) -> None:
    async def fn(rank: int) -> tuple[str, float]:
        t0 = time.monotonic()
        if rank in (1, 3):
            await asyncio.sleep(1.5)  # never calls monitored_barrier
            return "", 0.0
        with pytest.raises(dist.DistError) as ei:
            await dist.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all)
        return str(ei.value), time.monotonic() - t0

    out = await run_world(4, fn, backend="gloo", timeout=20)
    msg0, t0 = out[0]
    if wait_all:
        assert "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 500 ms" in msg0  # torch's words
    else:
        assert "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 500 ms" in msg0
    assert "monitored_barrier on default_pg" in msg0 and "seq 0" in msg0
    msg2, t2 = out[2]
    assert "failed to pass monitoredBarrier" in msg2 and "timeout" in msg2  # rank 0's verdict reached rank 2
    assert t0 < 1.4 and t2 < 1.4


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.5 s a run); a second loop waits them out again for the same result")
async def test_monitored_barrier_when_rank_0_never_comes() -> None:
    async def fn(rank: int) -> str:
        if rank == 0:
            await asyncio.sleep(1.5)
            return ""
        with pytest.raises(dist.DistTimeoutError) as ei:
            await dist.monitored_barrier(timeout=0.3)
        return str(ei.value)

    out = await run_world(3, fn, backend="gloo", timeout=20)
    assert "ranks not heard from: [0]" in out[1] and "monitored_barrier" in out[1]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_split_group(backend: str) -> None:
    async def fn(rank: int) -> None:
        g = await dist.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="pairs")
        if rank == 4:
            assert g is None
        else:
            assert isinstance(g, dist.ProcessGroup)
            assert dist.get_process_group_ranks(g) == ([0, 1] if rank < 2 else [2, 3])
            x = np.array([float(rank)])
            await dist.all_reduce(x, group=g)
            assert x[0] == (1.0 if rank < 2 else 5.0)
        # split of a sub-group: split_ranks are the parent's group ranks
        sub = await dist.new_group([1, 2, 3, 4])
        if rank != 0:
            assert isinstance(sub, dist.ProcessGroup)
            h = await dist.split_group(sub, [[0, 3], [1]])  # globals {1, 4} and {2}; 3 is in none
            if rank == 3:
                assert h is None
            else:
                assert isinstance(h, dist.ProcessGroup)
                assert dist.get_process_group_ranks(h) == ([1, 4] if rank in (1, 4) else [2])
            if rank in (1, 4):
                assert h is not None
                y = np.array([rank])
                await dist.all_reduce(y, group=h)
                assert y[0] == 5
        with pytest.raises(ValueError, match="more than one split"):
            await dist.split_group(split_ranks=[[0, 1], [1, 2]])
        with pytest.raises(ValueError, match="not a group rank"):
            await dist.split_group(split_ranks=[[0, 9]])

    await run_world(5, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_shrink_group_after_a_rank_dies(backend: str) -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([0, 1, 2, 3])
        if rank == 2:
            return  # "dies": never takes part again
        assert isinstance(g, dist.ProcessGroup)
        small = await dist.shrink_group([2], group=g)
        assert dist.get_process_group_ranks(small) == [0, 1, 3]
        x = np.array([rank + 1])
        await dist.all_reduce(x, group=small)
        assert x[0] == 1 + 2 + 4
        with pytest.raises(ValueError, match="out of bounds"):
            await dist.shrink_group([7], group=g)
        with pytest.raises(ValueError, match="every rank"):
            await dist.shrink_group([0, 1, 2, 3], group=g)
        with pytest.raises(ValueError, match="empty"):
            await dist.shrink_group([], group=g)
        aborted = await dist.shrink_group([2], group=g, shrink_flags=dist.SHRINK_ABORT)
        assert g.broken is not None and aborted.broken is None

    await run_world(4, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_shrink_the_default_group(backend: str) -> None:
    """torch's rules: the survivors are renumbered in their old order, the result is the new
    default group (get_rank, get_world_size, group=None follow), every other group is destroyed
    (its use names the shrink); shrinking again works; a survivor with another list fails."""

    async def fn(rank: int) -> tuple[int, int, float, str, str]:
        old = dist.group.WORLD
        g = await dist.new_group([0, 1, 3])
        if rank == 2:
            return (-1, -1, 0.0, "", "")  # "dies": never takes part again
        new = await dist.shrink_group([2], shrink_flags=dist.SHRINK_ABORT)
        assert dist.group.WORLD is new and dist.get_process_group_ranks(new) == [0, 1, 2]
        x = np.array([dist.get_rank() + 1.0])
        await dist.all_reduce(x)  # group=None: the new default group
        with pytest.raises(dist.DistBackendError, match="destroyed by shrink_group of the default group, which excluded ranks") as e1:
            await dist.all_reduce(x.copy(), group=g)
        with pytest.raises(dist.DistBackendError, match="shrink_group"):
            await dist.barrier(group=old)
        sub = await dist.new_group([0, 2])  # new numbering: old ranks 0 and 3
        if sub is not dist.GroupMember.NON_GROUP_MEMBER:
            y = np.array([float(rank)])
            await dist.all_reduce(y, group=sub)
            assert y[0] == 0 + 3
        if dist.get_rank() == 1:  # old rank 1 "dies" too: shrink again
            return (dist.get_rank(), dist.get_world_size(), float(x[0]), str(e1.value), "")
        again = await dist.shrink_group([1])
        z = np.array([1.0])
        await dist.all_reduce(z, group=again)
        assert dist.get_world_size() == 2 and z[0] == 2
        return (dist.get_rank(), dist.get_world_size(), float(x[0]), str(e1.value), "")

    out = await run_world(4, fn, backend=backend, timeout=30)
    assert [o[:3] for o in out] == [(0, 2, 6.0), (1, 3, 6.0), (-1, -1, 0.0), (1, 2, 6.0)]
    assert "(this rank, rank 3, is now rank 2 of 3)" in out[3][3]


async def test_shrink_with_different_lists_fails_on_every_survivor() -> None:
    """Ranks 0 and 1 exclude rank 3, rank 2 excludes rank 1: each survivor reads the lists of
    the ranks it keeps, so each sees a list unlike its own and fails naming both; nothing was
    changed, and the default group still works."""

    async def fn(rank: int) -> str:
        if rank == 3:
            return ""
        with pytest.raises(dist.DistBackendError, match="disagree on whom to exclude") as e:
            await dist.shrink_group([1] if rank == 2 else [3])
        x = np.ones(1)
        await dist.all_reduce(x, group=await dist.new_group([0, 1, 2]))
        assert x[0] == 3
        return str(e.value)

    out = await run_world(4, fn, timeout=20)
    assert "this rank (rank 0) excludes group ranks [3]; rank 2 excludes [1]" in out[0]
    assert "this rank (rank 2) excludes group ranks [1]; rank 0 excludes [3]" in out[2]


async def test_shrink_refused_without_the_store_host() -> None:
    async def fn(rank: int) -> None:
        current_world().store_host = 0  # as env:// without a launcher: rank 0's process serves the store
        if rank == 0:
            return
        with pytest.raises(dist.DistBackendError, match="without rank 0: its process served the job's store"):
            await dist.shrink_group([0])

    await run_world(2, fn, timeout=20)


async def test_backend_config_and_node_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fn(rank: int) -> str:
        return dist.get_backend_config()

    assert await run_world(1, fn, backend="gloo") == ["cpu:gloo"]
    assert await run_world(1, fn, backend="memory") == ["cpu:memory"]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for v in list(os.environ):
        if v.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "MPI_LOCAL")):
            monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist.get_node_local_rank(fallback_rank=3) == 2
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert dist.get_node_local_rank() == 1  # a Slurm task, before init
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        dist.get_node_local_rank()


async def test_device_id_connects_eagerly() -> None:
    # each rank on its own World, by hand: init with device_id on a shared store
    store = dist.HashStore()

    async def rank_main(rank: int) -> int:
        with dist.use_world(dist.World(f"r{rank}")):
            await dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=10, device_id="cpu")
            try:
                pg = dist.group.WORLD
                assert pg is not None
                transport = pg.backend.transport  # type: ignore[attr-defined]
                connected = len(transport.dialer.send_conn)
                x = np.ones(1)
                await dist.all_reduce(x)
                assert x[0] == 3
                return connected
            finally:
                await dist.destroy_process_group()

    assert await asyncio.gather(*(rank_main(r) for r in range(3))) == [2, 2, 2]


async def test_the_store_host_is_rank_0_only_for_a_rendezvous_store_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """What shrink_group's refusal reads: a TCPStore that a rendezvous made is served by rank 0's
    process, unless the launcher's agent serves it (TORCHELASTIC_USE_AGENT_STORE)."""
    from aiodist.c10d.init import _store_host

    store = await dist.TCPStore("127.0.0.1", 0, 1, True, timeout=5)
    try:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        assert _store_host(store) == 0
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        assert _store_host(store) is None
        assert _store_host(dist.HashStore()) is None and _store_host(None) is None
    finally:
        await store.close()
