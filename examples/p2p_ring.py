"""Point-to-point: a ring all-reduce by hand, a halo exchange, and receives from any source.

    aiodist-run --standalone --nproc-per-node 4 examples/p2p_ring.py

Three parts, each checked against what it must give:

1. **Ring with isend/irecv.** Every rank passes a block of numbers to its right neighbour and
   receives its left neighbour's, ``world_size - 1`` times, adding what it receives: the
   reduce-scatter + all-gather of a ring all-reduce, written with ``await aiodist.isend(...)`` /
   ``await aiodist.irecv(...)``, whose Works are awaited after both are in flight (a blocking send
   to a neighbour that is itself sending would be fine here too, but this is how overlap is done).
2. **Halo exchange with batch_isend_irecv.** Each rank owns a slice of a 1-D field with one ghost
   cell at each end; one ``batch_isend_irecv`` of four ``P2POp`` s sends its edge cells to both
   neighbours and fills its ghosts from theirs (periodic boundary). The order of the list does not
   matter and nothing deadlocks: every op is in flight at once. Tags tell the two directions apart
   (with two ranks, the left and the right neighbour are the same peer).
3. **Any-source receive.** Every rank but 0 sends a report to rank 0 after a rank-dependent
   delay; rank 0 calls ``recv(buf)`` with no ``src`` ``world_size - 1`` times, and each call
   returns the rank the message came from (so rank 0 serves them in arrival order, not rank order).

Rank 0 prints ``OK`` when every check passed on every rank (the verdicts are all-reduced).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

import aiodist as dist


async def ring_all_reduce(data: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Sum ``data`` over all ranks with 2 * (world - 1) neighbour exchanges (a ring all-reduce)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [c.copy() for c in np.array_split(data, world)]
    # reduce-scatter: after world - 1 steps, chunk (rank + 1) % world holds the full sum
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = np.empty_like(chunks[recv_i])
        works = [await dist.isend(chunks[send_i], dst=right), await dist.irecv(incoming, src=left)]
        for w in works:
            await w
        chunks[recv_i] += incoming
    # all-gather: pass the finished chunks around
    for step in range(world - 1):
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        works = [await dist.isend(chunks[send_i], dst=right), await dist.irecv(chunks[recv_i], src=left)]
        for w in works:
            await w
    return np.concatenate(chunks)


async def halo_exchange(field: np.ndarray, rank: int, world: int) -> None:
    """``field`` is [ghost, own cells..., ghost]; fill the ghosts from the neighbours' edges."""
    right, left = (rank + 1) % world, (rank - 1) % world
    # Tags say which way a cell travels: with two ranks, left and right are the same peer.
    to_left, to_right = 0, 1
    ops = [
        dist.P2POp(dist.irecv, field[0:1], left, tag=to_right),  # left neighbour's last cell
        dist.P2POp(dist.irecv, field[-1:], right, tag=to_left),  # right neighbour's first cell
        dist.P2POp(dist.isend, field[1:2].copy(), left, tag=to_left),
        dist.P2POp(dist.isend, field[-2:-1].copy(), right, tag=to_right),
    ]
    for work in await dist.batch_isend_irecv(ops):
        await work


async def reports_to_rank0(rank: int, world: int, delay: float) -> list[int]:
    """Ranks 1.. send [rank, rank**2] after (world - rank) * delay; rank 0 takes them as they come."""
    if rank != 0:
        await asyncio.sleep((world - rank) * delay)  # the highest rank sends first
        await dist.send(np.array([rank, rank * rank], dtype=np.int64), dst=0)
        return []
    order = []
    for _ in range(world - 1):
        buf = np.zeros(2, dtype=np.int64)
        src = await dist.recv(buf)  # no src: any rank of the group; returns the sender
        assert buf.tolist() == [src, src * src], (src, buf)
        print(f"rank 0: report from rank {src}: {buf.tolist()}", flush=True)
        order.append(src)
    return order


async def run(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ok = True

        data = np.arange(args.size, dtype=np.float64) * (rank + 1)
        total = await ring_all_reduce(data, rank, world)
        expected = np.arange(args.size, dtype=np.float64) * (world * (world + 1) / 2)
        ring_ok = np.array_equal(total, expected)
        ok &= ring_ok
        if rank == 0:
            print(
                f"ring all-reduce of {args.size} float64 over {world} ranks: {'matches' if ring_ok else 'WRONG'} sum(rank + 1) * i",
                flush=True,
            )

        cells = args.cells
        field = np.full(cells + 2, -1.0)
        field[1:-1] = rank * cells + np.arange(cells)  # global cell index
        for _ in range(args.rounds):
            await halo_exchange(field, rank, world)
        n_cells = world * cells
        halo_ok = field[0] == (rank * cells - 1) % n_cells and field[-1] == ((rank + 1) * cells) % n_cells
        ok &= bool(halo_ok)
        print(f"rank {rank}: cells {field[1]:.0f}..{field[-2]:.0f}, ghosts {field[0]:.0f} and {field[-1]:.0f}", flush=True)

        order = await reports_to_rank0(rank, world, args.delay)
        if rank == 0:
            ok &= sorted(order) == list(range(1, world))
            print(f"rank 0: reports arrived from ranks {order} (any-source recv, arrival order)", flush=True)

        verdict = np.array([0 if ok else 1], dtype=np.int64)
        await dist.all_reduce(verdict)  # how many ranks saw a failure
        if rank == 0:
            print("OK" if verdict[0] == 0 else f"FAILED on {verdict[0]} rank(s)", flush=True)
        return 0 if verdict[0] == 0 else 1
    finally:
        await dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1000, help="elements of the ring all-reduce (default 1000)")
    p.add_argument("--cells", type=int, default=4, help="cells each rank owns in the halo exchange (>= 2)")
    p.add_argument("--rounds", type=int, default=3, help="halo exchanges (default 3)")
    p.add_argument("--delay", type=float, default=0.02, help="seconds between the reports to rank 0")
    args = p.parse_args()
    if args.cells < 2 or args.size < 0 or args.rounds < 1:
        p.error("--cells must be >= 2, --rounds >= 1, --size >= 0")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
