"""init/destroy over a real rendezvous store (tcp://), twice in a row: destroy releases the
store it made (rank 0's server thread stops, no socket left open) and a second init works."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)


def _server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiodist-store-server")]


async def test_destroy_releases_the_rendezvous_store_and_reinit_works() -> None:
    port = free_port()
    before = _server_threads()

    # As torch's docs say for reinitialisation, ranks must synchronise by other means between
    # destroy and the next init (else a rank may reach the old server while it shuts down).
    between_rounds = asyncio.Barrier(2)

    async def rank_fn(rank: int) -> list[float]:
        got = []
        with dist.use_world(dist.World(f"lifecycle-{rank}")):
            for _ in range(2):
                await dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=20)
                x = np.full(3, rank + 1.0)
                await dist.all_reduce(x)
                got.append(float(x[0]))
                await dist.destroy_process_group()
                assert not dist.is_initialized()
                await between_rounds.wait()
        return got

    results = await asyncio.wait_for(asyncio.gather(rank_fn(0), rank_fn(1)), 40)
    assert results == [[3.0, 3.0], [3.0, 3.0]]
    assert _server_threads() == before  # rank 0's store server stopped with its group


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.5 s a run); a second loop waits them out again for the same result")
async def test_a_sub_group_timeout_longer_than_the_default_is_honoured() -> None:
    """The transport must not cut an op short at the default group's timeout."""
    from aiodist.testing import run_world

    async def fn(rank: int) -> float:
        g = await dist.new_group(timeout=20)
        x = np.ones(2)
        if rank == 1:
            await asyncio.sleep(1.5)  # later than the default group's 0.5 s, well within the group's 20 s
        await dist.all_reduce(x, group=g)
        return float(x[0])

    assert await run_world(2, fn, backend="gloo", timeout=30, pg_timeout=0.5) == [2.0, 2.0]
