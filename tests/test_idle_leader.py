"""``aiodist.idle_until_leader``: a service's ranks idle in a collective for the leader's next
request longer than the group's timeout, and every real failure still fails within it: a leader
op nobody follows (the leader's timeout names the rank), a rank that calls another op (the
desync check, at once), a bad leader argument. A lost leader: tests/faults/test_idle_service.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world


@pytest.mark.parametrize("backend", ["gloo"])  # (the go is the backend's own message: the socket's path is the real one)
async def test_followers_idle_past_the_timeout_and_the_leader_is_still_followed(backend: str) -> None:
    async def fn(rank: int) -> list[object]:
        g = await dist.new_group([0, 1, 2])
        dist.idle_until_leader(0, group=g)
        out: list[object] = []
        x = np.zeros(4, np.float32)
        for i in range(2):
            if rank == 0:
                await asyncio.sleep(0.5)  # no request for longer than the group's timeout (0.3 s)
                x[:] = i + 1
            await dist.broadcast(x, src=0, group=g)
            y = np.ones(1, np.float32)
            await dist.all_reduce(y, group=g)
            out.append((float(x[0]), float(y[0])))
        if rank == 0:  # the leader issues; rank 2 does not follow within the timeout
            t = time.monotonic()
            with pytest.raises(dist.DistTimeoutError) as e:
                await dist.all_reduce(y, group=g)
            out.append((round(time.monotonic() - t, 1), sorted(e.value.culprits)))
        elif rank == 1:
            with pytest.raises(dist.DistError):
                await dist.all_reduce(y, group=g)
        else:
            await asyncio.sleep(0.9)
        return out

    got = await run_world(3, fn, backend=backend, pg_timeout=0.3, timeout=30)
    assert got[1] == got[2] == [(1.0, 3.0), (2.0, 3.0)]
    assert got[0][:2] == got[1] and got[0][2][1] == [2] and got[0][2][0] <= 0.8, got[0]


async def test_a_follower_that_calls_another_op_is_named_at_once() -> None:
    """(The socket backend: its frames carry each op's digest; the memory backend has no desync check.)"""

    async def fn(rank: int) -> str:
        dist.idle_until_leader(0)
        x = np.ones(2, np.float32)
        t = time.monotonic()
        with pytest.raises(dist.DistError) as e:
            if rank == 0:
                await dist.all_reduce(x)
            else:
                await dist.broadcast(x, src=0)
        assert time.monotonic() - t < 5
        return str(e.value)

    got = await run_world(2, fn, backend="gloo", pg_timeout=30, timeout=20)
    assert any("broadcast" in m and "all_reduce" in m for m in got), got


async def test_bad_arguments() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="not a rank of"):
            dist.idle_until_leader(5)
        with pytest.raises(TypeError):
            dist.idle_until_leader("0")  # type: ignore[arg-type]

    await run_world(2, fn)
