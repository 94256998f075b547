"""One of several processes sharing a FileStore, for tests/test_file_store.py.

    python tests/helpers/file_store_child.py PATH RANK N_ADD N_ITEMS WORLD

Opens ``FileStore(PATH, WORLD)`` (timeout 30 s) and meets the others at a barrier; then N_ADD
times ``add("counter", 1)``, the first N_ITEMS of them each followed by a ``queue_push("q",
"RANK-i")`` and a ``queue_pop("q")``; a second barrier, and the counter's final value. Prints
``{"adds": each add's result, "popped": the items it popped, "final": the counter}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from aiodist import FileStore  # noqa: E402


async def main(path: str, rank: int, n_add: int, n_items: int, world: int) -> None:
    adds, popped = [], []
    async with FileStore(path, world, timeout=30) as store:
        await store.barrier("start", world)
        for i in range(n_add):
            adds.append(await store.add("counter", 1))
            if i < n_items:
                await store.queue_push("q", f"{rank}-{i}")
                popped.append((await store.queue_pop("q")).decode())
        await store.barrier("end", world)
        final = int(await store.get("counter"))
    print(json.dumps({"adds": adds, "popped": popped, "final": final}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
