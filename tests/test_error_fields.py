"""An op's error carries its facts as fields, not only in its message (aiodist.errors): the op,
the group, the sequence number, the rank that raised it and the culprits (rank -> what it did),
for a desync, a timeout whose explanation names a rank, an op aborted with its group, and
through pickling."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

import aiodist as dist
from aiodist.errors import DistBackendError, DistError, DistTimeoutError, StoreTimeoutError
from aiodist.testing import run_world

pytestmark = pytest.mark.timeout(60)


async def _error_of(aw: object) -> DistError:
    try:
        await aw  # type: ignore[misc]
    except DistError as exc:
        return exc
    raise AssertionError("the op completed")


async def test_a_desync_names_the_op_and_the_rank_that_called_another() -> None:
    async def fn(rank: int) -> DistError:
        x = np.ones(4, np.float32)
        await dist.all_reduce(x)  # seq 0 agrees
        return await _error_of(dist.all_reduce(x) if rank == 0 else dist.broadcast(x, src=0))

    e0, e1 = await run_world(2, fn, backend="gloo", pg_timeout=10)
    assert isinstance(e0, DistBackendError) and isinstance(e1, DistBackendError)
    assert (e0.op, e0.group, e0.seq, e0.rank) == ("all_reduce", "default_pg", 1, 0)
    assert (e1.op, e1.group, e1.seq, e1.rank) == ("broadcast", "default_pg", 1, 1)
    blamed = {**e0.culprits, **e1.culprits}
    assert blamed.get(1) == "called broadcast at seq 1" or blamed.get(0) == "called all_reduce at seq 1", (e0.culprits, e1.culprits)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
async def test_a_timeout_names_the_rank_that_never_issued_the_op() -> None:
    done = asyncio.Event()

    async def fn(rank: int) -> DistError | None:
        if rank == 2:  # alive, never calls it
            await asyncio.wait_for(done.wait(), 20)
            return None
        try:
            return await _error_of(dist.all_reduce(np.ones(4, np.float32)))
        finally:
            if rank == 1:
                done.set()

    errors = await run_world(3, fn, backend="gloo", pg_timeout=1.0, timeout=30)
    for rank in (0, 1):
        e = errors[rank]
        assert isinstance(e, DistTimeoutError), e
        assert (e.op, e.group, e.seq, e.rank) == ("all_reduce", "default_pg", 0, rank)
        assert e.culprits == {2: "never issued all_reduce seq 0"}, e.culprits


async def test_the_ops_a_broken_group_aborts_carry_their_own_facts() -> None:
    async def fn(rank: int) -> list[DistError] | None:
        if rank == 1:
            return None
        pg = dist.group.WORLD
        a = await dist.all_reduce(np.ones(2, np.float32), async_op=True)  # seq 0: rank 1 never comes
        b = await dist.broadcast(np.ones(2, np.float32), src=0, async_op=True)  # seq 1
        await asyncio.sleep(0.05)
        pg.abort("stopped by the test")
        return [await _error_of(a.wait()), await _error_of(b.wait())]

    got = await run_world(2, fn, backend="gloo", pg_timeout=10)
    ea, eb = got[0]
    assert (ea.op, ea.seq, ea.rank, ea.group) == ("all_reduce", 0, 0, "default_pg")
    assert (eb.op, eb.seq, eb.rank, eb.group) == ("broadcast", 1, 0, "default_pg")


def test_the_fields_survive_pickling_and_default_to_nothing() -> None:
    e = DistTimeoutError(
        "all_reduce timed out", op="all_reduce", group="default_pg", seq=3, rank=1, culprits={2: "never issued all_reduce seq 3"}
    )
    f = pickle.loads(pickle.dumps(e))
    assert type(f) is DistTimeoutError and str(f) == str(e)
    assert (f.op, f.group, f.seq, f.rank, f.culprits) == ("all_reduce", "default_pg", 3, 1, {2: "never issued all_reduce seq 3"})
    s = StoreTimeoutError("wait for key 'x'")
    assert (s.op, s.group, s.seq, s.rank, s.culprits) == (None, None, None, None, {})
