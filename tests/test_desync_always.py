"""Always-on desync detection (aiodist._digest): every collective frame of the
socket backend carries a digest of what all ranks must agree on; a receiver whose own op at that
seq has another digest fails it at once, and the group breaks on every rank with one sentence.

Each test fails before: ranks that called different collectives at OFF waited for the group's
timeout (and blamed a rank that was not stuck), and mismatched sizes failed in internal terms
(``message from rank 0 (group 0, seq 0, tag 33554432) is 200008 bytes, the receive buffer 200000``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import aiodist as dist
from aiodist._digest import op_digest, op_of
from aiodist.testing import run_world

pytestmark = pytest.mark.timeout(30)


def test_the_digest_names_its_op_and_changes_with_the_arguments() -> None:
    a = op_digest("all_reduce", {"tensor": "float32[4]", "op": "SUM"})
    assert op_of(a) == "all_reduce" and a != 0
    assert a == op_digest("all_reduce", {"tensor": "float32[4]", "op": "SUM"})  # the same on every rank
    assert a != op_digest("all_reduce", {"tensor": "float32[5]", "op": "SUM"})
    assert op_of(op_digest("broadcast", {"tensor": "float32[4]", "root": 0})) == "broadcast"
    assert op_digest("something new", None) >> 24 == 0xFF and op_of(0xFF << 24) == "an unknown op"


async def test_ranks_calling_different_collectives_fail_at_once_on_every_rank() -> None:
    async def fn(rank: int) -> tuple[str, float]:
        x = np.ones(4, np.float32)
        await dist.all_reduce(x)  # seq 0: all agree
        t0 = time.monotonic()
        with pytest.raises(dist.DistError) as e:
            if rank == 0:
                await dist.broadcast(x, src=0)  # seq 1: rank 0 broadcasts (a root may finish: its sends are out) ...
            else:
                await dist.all_reduce(x)  # ... the others all-reduce
            await dist.barrier()  # the group is broken: rank 0 learns it here at the latest
        err = e.value
        # the facts are fields: the group, the rank; the seq of the op that failed here (1, or
        # rank 0's barrier at 2), and a culprit that called another op
        assert err.group == "default_pg" and err.rank == rank and err.seq in (1, 2) and err.culprits, (err, err.culprits)
        return str(err), time.monotonic() - t0

    out = await run_world(3, fn, backend="gloo", timeout=20, pg_timeout=20)
    for msg, took in out:
        assert "desync detected: seq 1 on group 0 ('default_pg')" in msg, msg
        # said by whichever rank saw a frame of the other call first: an all-reducer, or rank 0
        # (the root receives all_reduce frames too), each naming its own arguments
        assert "rank 0 called broadcast" in msg and "called all_reduce" in msg, msg
        assert "(tensor float32[4], op SUM)" in msg or "broadcast (tensor float32[4], root 0)" in msg, msg
        assert took < 2.0  # not the group's 20 s timeout


async def test_mismatched_shapes_are_said_in_the_users_terms() -> None:
    async def fn(rank: int) -> str:
        x = np.ones(50_000 + (2 if rank == 0 else 0), np.float32)
        with pytest.raises(dist.DistError) as e:
            await dist.all_reduce(x)
        return str(e.value)

    out = await run_world(2, fn, backend="gloo", timeout=20, pg_timeout=20)
    for msg in out:
        assert "both called all_reduce with different arguments" in msg, msg
        assert "float32[50002]" in msg or "float32[50000]" in msg
        assert "receive buffer" not in msg


async def test_agreeing_ranks_are_not_refused() -> None:
    """No false desync: concurrent ops in flight, and uneven all_gather sizes (which are not part
    of the digest: only the dtype must agree). Fails if the digest took a per-rank field."""

    async def fn(rank: int) -> None:
        works = [await dist.all_reduce(np.ones(3), async_op=True) for _ in range(5)]
        for w in works:
            await w
        out = [np.zeros(r + 1) for r in range(2)]
        await dist.all_gather(out, np.full(rank + 1, float(rank)))
        assert (out[1] == 1).all()

    await run_world(2, fn, backend="gloo", timeout=20)


def test_equal_arguments_give_equal_digests_whatever_their_python_type() -> None:
    assert op_digest("broadcast", {"root": 2}) == op_digest("broadcast", {"root": 2.0})
    assert op_digest("x", {"a": [1, 2]}) == op_digest("x", {"a": [1, 2]})  # unhashable: not cached, still equal
