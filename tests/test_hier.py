"""aiodist.algorithms.hier: the layout as a table; the hierarchical all_reduce over in-process
ranks (rendezvous sends, shuffled interleavings) for even, uneven and interleaved layouts, exact
and with the same bits on every rank; and the bytes each host sends across, counted on the real
schedules, against the closed forms that docs/multi_host.md tabulates past this machine."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.algorithms import collectives as alg
from aiodist.algorithms import hier
from aiodist.algorithms.p2p import local_world
from aiodist.algorithms.thresholds import Thresholds
from aiodist.shm import HOST_PART
from aiodist.testing import run_world


@pytest.mark.parametrize(
    "hosts,want",
    [
        (["a", "a", "b", "b"], ((0, 1), (2, 3))),
        (["a", "b", "a", "b"], ((0, 2), (1, 3))),
        (["a", "a", "a", "b"], ((0, 1, 2), (3,))),
        (["b", "a", "a", "b"], ((0, 3), (1, 2))),
        (["a", "b", "c"], None),  # one rank per host: nothing to save
        (["a", "a"], None),  # one host
    ],
)
def test_layout_of(hosts: list[str], want: Any) -> None:
    assert hier.layout_of(hosts) == want


def _add(a: np.ndarray, b: np.ndarray) -> None:
    np.add(a, b, out=a)


LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "b", "a", "b"],
    ["a", "a", "a", "b"],
    ["a", "a", "b", "b", "c", "c"],
    ["x", "y", "x", "y", "x", "y", "x", "y"],
    ["a", "b", "b", "b", "a"],
]


@pytest.mark.parametrize("hosts", LAYOUTS, ids=["".join(h) for h in LAYOUTS])
@pytest.mark.parametrize("n", [1, 3, 1000, 70_000])
@pytest.mark.parametrize("piece", [0, 4096], ids=["one-piece", "pieces"])
async def test_all_reduce_is_exact_and_the_same_bits_everywhere(hosts: list[str], n: int, piece: int) -> None:
    """Exact (integers) and the same bits on every rank (floats), in one piece and pipelined in
    pieces (70,000 float32 in 4 KiB pieces: ``MAX_PIECES`` of them)."""
    th = Thresholds(hier_piece=piece)
    layout = hier.layout_of(hosts)
    assert layout is not None
    size = len(hosts)
    ps = local_world(size, capacity=0, seed=n)
    rng = np.random.default_rng(n)
    ints = [rng.integers(-9, 9, n).astype(np.float32) for _ in range(size)]
    bufs = [x.copy() for x in ints]
    await asyncio.gather(*(hier.all_reduce(ps[r], bufs[r], _add, layout, thresholds=th) for r in range(size)))
    assert all(np.array_equal(b, sum(ints)) for b in bufs)
    floats = [rng.standard_normal(n).astype(np.float32) for _ in range(size)]  # rounding: the same bits everywhere
    ps = local_world(size, capacity=2, seed=n + 1)
    await asyncio.gather(*(hier.all_reduce(ps[r], floats[r], _add, layout, thresholds=th) for r in range(size)))
    assert all(f.tobytes() == floats[0].tobytes() for f in floats)


class Counting:
    """A rank's P2P that counts the bytes it sends to ranks on other hosts."""

    def __init__(self, p2p: Any, hosts: list[int]) -> None:
        self.p2p, self.hosts, self.rank, self.size, self.across, self.messages = p2p, hosts, p2p.rank, p2p.size, 0, 0

    def _count(self, peer: int, buf: np.ndarray) -> None:
        self.messages += 1
        if self.hosts[peer] != self.hosts[self.rank]:
            self.across += buf.nbytes

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        self._count(peer, buf)
        await self.p2p.send(peer, buf, tag)

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        await self.p2p.recv(peer, buf, tag)

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> Any:
        self._count(peer, buf)
        return self.p2p.send_nowait(peer, buf, tag)


# every schedule a ring, at every size, in one piece: the closed forms' schedules
RING = Thresholds(allreduce_rd_max=-1, allreduce_ring_min=0, allgather_bruck_max=-1, reduce_scatter_direct_max=-1, pipeline_piece=1 << 40)


@pytest.mark.parametrize("h,k", [(2, 1), (2, 2), (2, 4), (3, 2), (4, 2), (4, 3)])
async def test_bytes_across_match_the_closed_forms(h: int, k: int) -> None:
    """Each host's bytes across for one all_reduce of S, counted on the real schedules, are the
    closed forms hier.crossing_bytes gives (the flat ring's 2(n-1)/n S, the hierarchy's
    2(h-1)/h S), to within the rounding of the slices; and the messages each rank sends are
    hier.steps."""
    n_elems = 12 * 1024 * 5 * 7  # divides evenly by every size here
    S = n_elems * 4
    hosts = [r // k for r in range(h * k)]  # contiguous by host: the flat ring crosses once per host per lap
    for flat in (True, False):
        ps = [Counting(p, hosts) for p in local_world(h * k, capacity=4)]
        bufs = [np.ones(n_elems, np.float32) for _ in range(h * k)]
        if flat:
            await asyncio.gather(*(alg.all_reduce(ps[r], bufs[r], _add, thresholds=RING) for r in range(h * k)))
        else:
            layout = hier.layout_of([str(x) for x in hosts]) or tuple((r,) for r in range(h))
            await asyncio.gather(*(hier.all_reduce(ps[r], bufs[r], _add, layout, thresholds=RING) for r in range(h * k)))
        assert all(np.all(b == h * k) for b in bufs)
        per_host = [sum(p.across for p in ps if hosts[p.rank] == x) for x in range(h)]
        want = hier.crossing_bytes(h, k, S, flat=flat)
        assert all(abs(b - want) <= 0.01 * S for b in per_host), (flat, per_host, want / S)
        assert {p.messages for p in ps} == {hier.steps(h, k, flat=flat)}, (flat, [p.messages for p in ps])


def test_the_paper_table() -> None:
    """docs/multi_host.md's table: what each host's link carries per all_reduce of S, flat
    against the hierarchy, at 2-1,024 hosts x 1-8 ranks per host (closed forms)."""
    assert hier.crossing_bytes(2, 2, 1, flat=True) == 1.5 and hier.crossing_bytes(2, 4, 1, flat=True) == 1.75
    assert hier.crossing_bytes(2, 8, 1, flat=False) == 1.0
    assert hier.crossing_bytes(128, 8, 1, flat=True) == pytest.approx(2 * 1023 / 1024)
    assert hier.crossing_bytes(128, 8, 1, flat=False) == pytest.approx(2 * 127 / 128)
    assert hier.crossing_bytes(1, 8, 1, flat=True) == 0.0


@pytest.mark.parametrize("hosts", LAYOUTS, ids=["".join(h) for h in LAYOUTS])
@pytest.mark.parametrize("n", [1, 5, 3000])
async def test_all_gather_and_reduce_scatter_are_exact(hosts: list[str], n: int) -> None:
    """Their contracts (outputs views of one buffer, as all_gather_into_tensor's), exact, for even
    layouts by the hierarchy and for uneven ones by the flat schedules."""
    layout = hier.layout_of(hosts)
    assert layout is not None
    size = len(hosts)
    rng = np.random.default_rng(n)
    mine = [rng.integers(-5, 5, n).astype(np.float32) for _ in range(size)]
    big = [np.empty(n * size, np.float32) for _ in range(size)]
    outs = [[b[q * n : (q + 1) * n] for q in range(size)] for b in big]
    ps = local_world(size, capacity=0, seed=n)
    await asyncio.gather(*(hier.all_gather(ps[r], outs[r], mine[r], layout) for r in range(size)))
    assert all(np.array_equal(b, np.concatenate(mine)) for b in big)
    ins = [rng.integers(-5, 5, n * size).astype(np.float32) for _ in range(size)]
    got = [np.empty(n, np.float32) for _ in range(size)]
    ps = local_world(size, capacity=0, seed=n + 1)
    await asyncio.gather(
        *(hier.reduce_scatter(ps[r], got[r], [ins[r][q * n : (q + 1) * n] for q in range(size)], _add, layout) for r in range(size))
    )
    total = sum(ins)
    assert all(np.array_equal(got[r], total[r * n : (r + 1) * n]) for r in range(size))


@pytest.mark.parametrize("h,k", [(2, 2), (2, 4), (3, 2)])
async def test_all_gather_and_reduce_scatter_send_the_minimum_across(h: int, k: int) -> None:
    """Each host sends across only what the others must get: all_gather its own parts to each
    other host once ((h-1)/h of the output per host), reduce_scatter the other hosts' parts of
    its host's sum ((h-1)/h of the input); the flat ring sends (n-1)/n."""
    n = 4096
    size = h * k
    hosts = [r // k for r in range(size)]
    layout = hier.layout_of([str(x) for x in hosts])
    assert layout is not None
    ps = [Counting(p, hosts) for p in local_world(size, capacity=4)]
    big = [np.empty(n * size, np.float32) for _ in range(size)]
    await asyncio.gather(
        *(hier.all_gather(ps[r], [big[r][q * n : (q + 1) * n] for q in range(size)], np.ones(n, np.float32), layout) for r in range(size))
    )
    total = n * size * 4
    per_host = [sum(p.across for p in ps if hosts[p.rank] == x) for x in range(h)]
    assert all(b == pytest.approx((h - 1) / h * total, rel=0.01) for b in per_host), per_host
    ps = [Counting(p, hosts) for p in local_world(size, capacity=4)]
    ins = [np.ones(n * size, np.float32) for _ in range(size)]
    outs = [np.empty(n, np.float32) for _ in range(size)]
    await asyncio.gather(
        *(hier.reduce_scatter(ps[r], outs[r], [ins[r][q * n : (q + 1) * n] for q in range(size)], _add, layout) for r in range(size))
    )
    assert all(np.all(o == size) for o in outs)
    per_host = [sum(p.across for p in ps if hosts[p.rank] == x) for x in range(h)]
    assert all(b == pytest.approx((h - 1) / h * total, rel=0.01) for b in per_host), per_host


@pytest.mark.parametrize("h,k", [(2, 2), (2, 4), (3, 2), (4, 3)])
@pytest.mark.parametrize("root", [0, 1, -1])
async def test_broadcast_and_reduce_cross_to_each_remote_host_once(h: int, k: int, root: int) -> None:
    """A broadcast's bytes reach each other host once (h-1 crossings of S in all), as do a
    reduce's partial sums toward the root; right on every rank (roots that lead their host,
    and not: rank 1, the last rank)."""
    n = 4096
    size = h * k
    root %= size
    hosts = [r // k for r in range(size)]
    layout = hier.layout_of([str(x) for x in hosts])
    assert layout is not None
    ps = [Counting(p, hosts) for p in local_world(size, capacity=0, seed=root)]
    bufs = [np.full(n, r, np.float32) for r in range(size)]
    await asyncio.gather(*(hier.broadcast(ps[r], bufs[r], root, layout) for r in range(size)))
    assert all(np.all(b == root) for b in bufs)
    assert sum(p.across for p in ps) == (h - 1) * n * 4
    ps = [Counting(p, hosts) for p in local_world(size, capacity=0, seed=root + 1)]
    bufs = [np.full(n, r, np.float32) for r in range(size)]
    await asyncio.gather(*(hier.reduce(ps[r], bufs[r], root, _add, layout) for r in range(size)))
    assert np.all(bufs[root] == sum(range(size)))
    assert sum(p.across for p in ps) == (h - 1) * n * 4


@pytest.mark.parametrize("hosts", LAYOUTS, ids=["".join(h) for h in LAYOUTS])
async def test_barrier_lets_no_rank_leave_before_every_rank_entered(hosts: list[str]) -> None:
    layout = hier.layout_of(hosts)
    assert layout is not None
    ps = local_world(len(hosts), capacity=0, seed=3)
    events: list[tuple[str, int]] = []

    async def one(r: int) -> None:
        for _ in range(r % 3):
            await asyncio.sleep(0)  # ranks enter at different turns of the loop
        events.append(("in", r))
        await hier.barrier(ps[r], layout)
        events.append(("out", r))

    await asyncio.gather(*(one(r) for r in range(len(hosts))))
    last_in = max(i for i, (kind, _) in enumerate(events) if kind == "in")
    first_out = min(i for i, (kind, _) in enumerate(events) if kind == "out")
    assert last_in < first_out, events


# -- the in-host phases through shared memory (real backends, in one process) ----------------------


def _data(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n) + 7 * rank) % 13).astype(np.float32)  # integer sums: exact in float32


@pytest.mark.parametrize("n", [1, 3, 1000, 100_000, 1 << 20])
async def test_in_host_phases_go_through_the_hosts_shared_memory(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """4 ranks told they sit on 2 hosts (0, 1 | 2, 3; ``AioBackend.hosts``, which init reads
    from what every rank published): all_reduce, broadcast, reduce (roots that lead their host
    and not), all_gather_into_tensor and reduce_scatter_tensor go by the hierarchy, and its in-host phases through the shared memory of each host's ranks
    (a line of their own: ``HOST_PART``), by the lane at small sizes and single copy at big ones
    (4 MiB: single-copy ops of one seq in a host's line, whose phase words must not meet; in 8
    pipelined pieces); exact, on the default group and on an uneven layout (3 + 1)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> dict[str, Any]:
        backend = dist.group.WORLD.backend  # type: ignore[union-attr]
        backend.hosts = ("h0", "h0", "h1", "h1")
        uneven = await dist.new_group([0, 1, 3], pg_options={"hier_min": 0})  # hosts h0: 0, 1; h1: 3
        for _ in range(2):
            x = _data(rank, n)
            await dist.all_reduce(x)
            assert np.array_equal(x, sum(_data(r, n) for r in range(4))), f"rank {rank}: all_reduce of {n}"
            out = np.empty(4 * n, np.float32)
            await dist.all_gather_into_tensor(out, _data(rank, n))
            assert np.array_equal(out, np.concatenate([_data(r, n) for r in range(4)])), f"rank {rank}: all_gather of {n}"
            part = np.empty(n, np.float32)
            await dist.reduce_scatter_tensor(part, _data(rank, 4 * n))
            assert np.array_equal(part, sum(_data(r, 4 * n) for r in range(4))[rank * n : (rank + 1) * n]), f"rank {rank}: reduce_scatter"
            await dist.barrier()  # by the hierarchy: lane barriers within, one among the hosts' first ranks
            for root in (0, 3):  # a host's first rank, and not
                b = _data(rank, n)
                await dist.broadcast(b, src=root)
                assert np.array_equal(b, _data(root, n)), f"rank {rank}: broadcast from {root}, {n}"
                z = _data(rank, n)
                await dist.reduce(z, dst=root)
                if rank == root:
                    assert np.array_equal(z, sum(_data(r, n) for r in range(4))), f"rank {rank}: reduce to {root}, {n}"
            if rank != 2:
                y = _data(rank, n)
                await dist.all_reduce(y, group=uneven)
                assert np.array_equal(y, sum(_data(r, n) for r in (0, 1, 3))), f"rank {rank}: uneven all_reduce of {n}"
                await dist.broadcast(y, src=3, group=uneven)
                assert np.array_equal(y, sum(_data(r, n) for r in (0, 1, 3))), f"rank {rank}: uneven broadcast of {n}"
        stats = dict(backend.shm.stats())
        part = uneven.group_id | HOST_PART if uneven is not dist.GroupMember.NON_GROUP_MEMBER else -1
        assert (part in stats["groups"]) == (rank in (0, 1)), stats  # the uneven group's part on h0 (h1 has rank 3 alone)
        await dist.destroy_process_group(uneven)
        assert part not in backend.shm.stats()["groups"]  # its host part went with it (segments closed)
        return stats

    stats = await run_world(4, fn, "gloo", pg_options={"hier_min": 0, "hier_piece": 256 * 1024})  # 4 MiB: 8 pieces
    for rank, st in enumerate(stats):
        assert HOST_PART in st["groups"], (rank, st)  # the default group's part on this rank's host
        assert (st["cma_ops"] if n == 1 << 20 else st["lane_ops"]) > 0, (rank, st)
