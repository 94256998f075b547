"""Point-to-point through the API: any-source receives, send to oneself, P2POp and
batch_isend_irecv, MPI's non-overtaking order, timeouts that name the peer; over the memory
backend and over real loopback sockets (backend="gloo")."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world, until

BACKENDS = ["memory", "gloo"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3, 5])
async def test_any_source_recv_gets_every_sender(backend: str, n: int) -> None:
    async def fn(rank: int) -> list[int]:
        if rank == 0:
            got = []
            for _ in range(n - 1):
                x = np.empty(2, np.int64)
                src = await dist.recv(x)  # src=None: any source
                assert x.tolist() == [src, 10 * src]
                got.append(src)
            return sorted(got)
        await dist.send(np.array([rank, 10 * rank]), dst=0)
        return []

    out = await run_world(n, fn, backend=backend, timeout=20)
    assert out[0] == list(range(1, n))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_any_source_irecv_and_tags_in_a_subgroup(backend: str) -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([1, 2, 3])
        if rank == 1:
            a, b = np.empty(1), np.empty(1)
            wa = await dist.irecv(a, group=g, tag=7)  # any source, tag 7
            wb = await dist.irecv(b, group=g, tag=8)
            with pytest.raises(RuntimeError, match="not received"):
                wa.source_rank()
            await wa.wait()
            await wb.wait()
            assert wa.source_rank() == 3 and a[0] == 3.0
            assert wb.source_rank() == 2 and b[0] == 2.0
        elif rank == 2:
            await dist.send(np.array([2.0]), dst=1, group=g, tag=8)
        elif rank == 3:
            await dist.send(np.array([3.0]), group_dst=0, group=g, tag=7)

    await run_world(4, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_non_overtaking_order_with_specific_and_any_source(backend: str) -> None:
    """Many sends issued at once (on sockets: before the connection exists) arrive in issue
    order; any-source and specific receives interleave in posting order."""

    async def fn(rank: int) -> None:
        k = 40
        if rank == 0:
            works = [await dist.isend(np.array([float(i)]), dst=1, tag=3) for i in range(k)]
            await asyncio.gather(*works)
        else:
            bufs = [np.empty(1) for _ in range(k)]
            works = [await (dist.irecv(b, src=0, tag=3) if i % 2 else dist.irecv(b, tag=3)) for i, b in enumerate(bufs)]
            await asyncio.gather(*works)
            assert [b[0] for b in bufs] == [float(i) for i in range(k)]

    await run_world(2, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_send_to_self_with_isend_irecv(backend: str) -> None:
    async def fn(rank: int) -> None:
        x = np.arange(5, dtype=np.float32) + rank
        y = np.empty(5, np.float32)
        ws = await dist.isend(x, dst=rank, tag=4)
        wr = await dist.irecv(y, src=rank, tag=4)
        await ws.wait()
        await wr.wait()
        assert wr.source_rank() == rank and (y == x).all()
        # receive first, then send; and through recv
        z = np.empty(5, np.float32)
        wr2 = await dist.irecv(z, group_src=dist.get_rank(), tag=5)
        await dist.isend(x * 2, dst=rank, tag=5)
        await wr2
        assert (z == 2 * x).all()
        await dist.isend(x * 3, dst=rank)
        assert await dist.recv(z, src=rank) == rank and (z == 3 * x).all()
        with pytest.raises(ValueError, match="oneself"):
            await dist.send(x, dst=rank)  # a blocking send to oneself never returns in torch

    await run_world(2, fn, backend=backend, timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_batch_isend_irecv_ring(backend: str, n: int) -> None:
    """The reference example: every rank sends to rank+1 and receives from rank-1, in one batch."""

    async def fn(rank: int) -> list[int]:
        send_tensor = np.arange(2, dtype=np.int64) + 2 * rank
        recv_tensor = np.zeros(2, dtype=np.int64)
        send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % n)
        recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + n) % n)
        # either order in the list: receives first on odd ranks
        ops = [send_op, recv_op] if rank % 2 == 0 else [recv_op, send_op]
        reqs = await dist.batch_isend_irecv(ops)
        for req in reqs:
            await req.wait()
        return recv_tensor.tolist()

    out = await run_world(n, fn, backend=backend, timeout=20)
    assert out == [[2 * ((r - 1) % n), 2 * ((r - 1) % n) + 1] for r in range(n)]


async def test_batch_isend_irecv_large_messages_no_deadlock() -> None:
    """Both ranks send 8 MiB to each other first in their batches (bigger than the staging
    bound): no deadlock, since every op of a batch is in flight at once."""

    async def fn(rank: int) -> None:
        big = np.full(1 << 21, float(rank), np.float32)
        out = np.empty_like(big)
        other = 1 - rank
        reqs = await dist.batch_isend_irecv([dist.P2POp(dist.isend, big, other), dist.P2POp(dist.irecv, out, other)])
        await asyncio.gather(*reqs)
        assert (out == other).all()

    await run_world(2, fn, backend="gloo", timeout=30)


async def test_batch_and_p2pop_arguments_refused_before_anything_is_sent() -> None:
    async def fn(rank: int) -> None:
        x = np.ones(2)
        with pytest.raises(ValueError, match="isend or irecv"):
            dist.P2POp(dist.send, x, 1)
        with pytest.raises(ValueError, match="peer"):
            dist.P2POp(dist.isend, x)
        with pytest.raises(ValueError, match="not both"):
            dist.P2POp(dist.isend, x, 1, group_peer=1)
        with pytest.raises(TypeError, match="P2POp"):
            await dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank), "nope"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="empty"):
            await dist.batch_isend_irecv([])
        with pytest.raises(ValueError, match="not a rank"):
            await dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, x, 9)])
        # nothing of the refused batches went out: the first message each rank gets is this one
        y = np.empty(2)
        reqs = await dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, 1 - rank), dist.P2POp(dist.isend, np.full(2, 5.0 + rank), 1 - rank)])
        await asyncio.gather(*reqs)
        assert (y == 5.0 + (1 - rank)).all()
        assert dist.group.WORLD is not None and dist.group.WORLD.broken is None

    await run_world(2, fn, backend="gloo", timeout=20)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.6 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("any_source", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_p2p_timeout_names_op_group_and_peer(backend: str, any_source: bool) -> None:
    # One waiting rank per world: two ranks timing out at once race (the first to time out
    # breaks the group, and the other then fails with that instead of its own timeout).
    async def fn(rank: int) -> str:
        if rank == 1:
            with pytest.raises(dist.DistTimeoutError) as ei:
                await (dist.recv(np.empty(1)) if any_source else dist.recv(np.empty(1), src=0, tag=2))
            return str(ei.value)
        await asyncio.sleep(0.6)  # nobody sends
        return ""

    msgs = await run_world(3, fn, backend=backend, timeout=20, pg_timeout=0.3)
    assert "recv on default_pg" in msgs[1] and "p2p seq 0" in msgs[1]
    if any_source:
        assert "ranks not heard from: any of [0, 2]" in msgs[1]
    else:
        assert "ranks not heard from: [0]" in msgs[1] and "tag 2" in msgs[1]


async def test_size_mismatch_fails_the_receive() -> None:
    async def fn(rank: int) -> None:
        if rank == 0:
            await dist.send(np.ones(3), dst=1)
        else:
            with pytest.raises(dist.DistError, match="bytes"):
                await dist.recv(np.empty(2), src=0)

    await run_world(2, fn, backend="gloo", timeout=20)


async def test_sends_issued_as_the_connection_comes_up_do_not_overtake() -> None:
    """The race the transport's send line closes: later sends issued right after the connection
    is made, while earlier ones have not yet resumed from waiting for it."""

    async def fn(rank: int) -> None:
        k = 20
        if rank == 0:
            pg = dist.group.WORLD
            assert pg is not None
            transport = pg.backend.transport  # type: ignore[attr-defined]
            works = [await dist.isend(np.array([float(i)]), dst=1) for i in range(k)]
            await until(lambda: 1 in transport.dialer.send_conn, "the connection to rank 1", interval_s=0)
            works += [await dist.isend(np.array([float(i)]), dst=1) for i in range(k, 2 * k)]
            await asyncio.gather(*works)
        else:
            bufs = [np.empty(1) for _ in range(2 * k)]
            works = [await dist.irecv(b, src=0) for b in bufs]
            await asyncio.gather(*works)
            assert [b[0] for b in bufs] == [float(i) for i in range(2 * k)]

    await run_world(2, fn, backend="gloo", timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_message_for_a_cancelled_receive_goes_to_the_next_one(backend: str) -> None:
    """A receive cancelled just before its message comes must not swallow it: the message goes
    to the next matching receive (the backends' matching table skips receives already done).
    The message comes in the same step as the cancel, before the receive's task can withdraw."""

    async def fn(rank: int) -> list[float]:
        pg = dist.group.WORLD
        assert pg is not None
        lost = np.zeros(1)
        first = asyncio.ensure_future(pg.backend.p2p_recv(pg.group_id, 0, lost, 9))
        await asyncio.sleep(0)  # posted
        first.cancel()  # its future is done now; the task withdraws it only when it runs next
        await pg.backend.p2p_send(pg.group_id, 0, np.array([42.0]), 9)  # to self, matched at once
        got = np.empty(1)
        async with asyncio.timeout(5):
            await pg.backend.p2p_recv(pg.group_id, 0, got, 9)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert lost[0] == 0.0
        return got.tolist()

    assert await run_world(1, fn, backend=backend, timeout=20) == [[42.0]]
