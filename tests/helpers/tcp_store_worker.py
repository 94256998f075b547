"""A TCPStore client process for tests/test_tcp_multiprocess.py.

    python tests/helpers/tcp_store_worker.py MODE PORT [ARGS...]

Every mode prints one JSON line (its results) on stdout and exits 0, or exits non-zero with a
traceback on stderr. Modes:

``team RANK WORLD_SIZE``
    Joins the store with ``world_size=WORLD_SIZE`` (the init/ protocol), adds 1 to ``counter``
    200 times, then enters barrier ``b1`` (WORLD_SIZE members: this process and its peers and
    the test's master) and reads ``counter``. Ranks 0 and 1 then push 50 items each onto queue
    ``jobs``; rank 2 pops 100 items (blocking). Everybody enters barrier ``b2``.
``adder INDEX STORES ADDS``
    Opens STORES TCPStore objects (one connection each); each adds 1 to ``counter`` ADDS/2
    times; the process then sets ``half/INDEX`` and waits for ``go``; then each store adds the
    other ADDS/2. Reports the last value each store saw.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from aiodist.store.tcp import TCPStore  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 20.0


async def team(port: int, rank: int, world_size: int) -> dict[str, object]:
    async with TCPStore(HOST, port, world_size=world_size, timeout=TIMEOUT_S) as store:
        for _ in range(200):
            await store.add("counter", 1)
        await store.add(f"rank/{rank}", rank + 1)
        await store.barrier("b1", world_size)
        counter_after_barrier = int(await store.get("counter"))
        popped: list[str] = []
        if rank in (0, 1):
            for i in range(50):
                await store.queue_push("jobs", f"{rank}:{i}")
        elif rank == 2:
            for _ in range(100):
                popped.append((await store.queue_pop("jobs")).decode())
        await store.barrier("b2", world_size)
        return {"rank": rank, "counter_after_barrier": counter_after_barrier, "popped": popped}


async def adder(port: int, index: int, stores: int, adds: int) -> dict[str, object]:
    clients = await asyncio.gather(*(TCPStore(HOST, port, timeout=TIMEOUT_S) for _ in range(stores)))
    try:

        async def run(store: TCPStore, n: int) -> int:
            last = 0
            for _ in range(n):
                v = await store.add("counter", 1)
                assert v > last, (v, last)  # one connection's adds are ordered
                last = v
            return last

        await asyncio.gather(*(run(s, adds // 2) for s in clients))
        await clients[0].set(f"half/{index}", "1")
        await clients[0].wait(["go"])
        lasts = await asyncio.gather(*(run(s, adds - adds // 2) for s in clients))
        return {"index": index, "last": lasts}
    finally:
        for s in clients:
            await s.close()


async def main(argv: list[str]) -> None:
    mode, port = argv[0], int(argv[1])
    args = [int(a) for a in argv[2:]]
    if mode == "team":
        out = await team(port, *args)
    elif mode == "adder":
        out = await adder(port, *args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
