"""Object collectives: Python objects (anything picklable) between ranks.

    aiodist-run --standalone --nproc-per-node 4 examples/object_collectives.py

A small job coordinated entirely with objects:

1. ``broadcast_object_list``: rank 0 decides the job's configuration (a dict) and every rank
   receives it.
2. ``all_gather_object``: every rank describes itself (pid, host, its environment's LOCAL_RANK);
   every rank gets everyone's description.
3. ``scatter_object_list``: rank 0 splits a list of work items unevenly (rank r gets r + 1 items)
   and sends each rank its own list.
4. Every rank works on its items, then ``send_object_list`` sends its results to rank 0, which
   takes them with ``recv_object_list`` from **any** rank (``src=None``; the call returns the
   sender) in the order they arrive.
5. ``gather_object``: every rank's summary to rank 0, in rank order.

Rank 0 checks the results and prints ``OK``. Objects are pickled: only exchange them with ranks
you trust (unpickling runs code).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from dataclasses import dataclass

import aiodist as dist


@dataclass
class Result:
    rank: int
    items: list[str]
    lengths: dict[str, int]


async def run(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()

        def say(msg: str) -> None:
            if rank == 0:
                print(msg, flush=True)

        # 1. configuration from rank 0
        config: list[object] = [{"job": "word lengths", "world_size": world, "upper": True}] if rank == 0 else [None]
        await dist.broadcast_object_list(config, src=0)
        cfg = config[0]
        assert isinstance(cfg, dict) and cfg["world_size"] == world
        say(f"1. broadcast_object_list: every rank has the config {cfg}")

        # 2. who is who
        peers: list[dict[str, object] | None] = [None] * world
        await dist.all_gather_object(
            peers, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "local_rank": os.environ.get("LOCAL_RANK")}
        )
        assert [p["rank"] for p in peers if p is not None] == list(range(world))
        say("2. all_gather_object: " + "; ".join(f"rank {p['rank']} is pid {p['pid']} on {p['host']}" for p in peers if p is not None))

        # 3. uneven work lists from rank 0: rank r gets r + 1 words
        words = [f"word{'x' * i}" for i in range(world * (world + 1) // 2)]
        work_lists = None
        if rank == 0:
            work_lists, start = [], 0
            for r in range(world):
                work_lists.append(words[start : start + r + 1])
                start += r + 1
        mine: list[list[str] | None] = [None]
        await dist.scatter_object_list(mine, work_lists, src=0)
        items = mine[0]
        assert items is not None and len(items) == rank + 1
        say(f"3. scatter_object_list: rank 0 got {items}; rank r gets r + 1 items")

        # 4. results to rank 0 from any rank, as they finish
        await asyncio.sleep(0.01 * (world - rank))  # the highest rank finishes first
        result = Result(rank, [w.upper() if cfg["upper"] else w for w in items], {w: len(w) for w in items})
        results: dict[int, Result] = {0: result}
        if rank != 0:
            await dist.send_object_list([result], dst=0)
        else:
            arrival = []
            for _ in range(world - 1):
                box: list[Result | None] = [None]
                src = await dist.recv_object_list(box)  # src=None: from any rank; returns the sender
                assert box[0] is not None and box[0].rank == src
                results[src] = box[0]
                arrival.append(src)
            say(f"4. send_object_list / recv_object_list (any source): results arrived from ranks {arrival}")

        # 5. one summary per rank, gathered in rank order on rank 0
        gathered: list[object] | None = [None] * world if rank == 0 else None
        await dist.gather_object((rank, sum(result.lengths.values())), gathered, dst=0)

        verdict = [True]
        if rank == 0:
            assert gathered is not None
            say(f"5. gather_object: (rank, total word length) = {gathered}")
            got = [w for r in range(world) for w in results[r].items]
            verdict[0] = got == [w.upper() for w in words] and gathered == [(r, sum(results[r].lengths.values())) for r in range(world)]
        await dist.broadcast_object_list(verdict, src=0)  # everyone exits with rank 0's verdict
        say("OK" if verdict[0] else "FAILED")
        return 0 if verdict[0] else 1
    finally:
        await dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
