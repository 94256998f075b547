"""One rank of the real-path call count (tests/test_hot_path.py): env:// over the socket backend
with shared memory, OPS back-to-back 4 B all_reduces (or another small op: argv[1]) counted with
``sys.setprofile`` on every rank, after a warm-up; prints the counts as one JSON line."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
from typing import Any

import numpy as np
import uvloop

import aiodist as dist

OPS = 2000
_PKG = os.path.dirname(dist.__file__) + os.sep
#: the loop's own Python (asyncio.sleep(0) when an op lets the loop run, uvloop's wrappers): it
#: runs by the clock, not per op
_LOOP = (os.path.dirname(asyncio.__file__) + os.sep, os.path.dirname(uvloop.__file__) + os.sep)


async def main(op: str) -> None:
    await dist.init_process_group("gloo")
    x = np.zeros(1, dtype=np.float32)  # 4 bytes (zeros: a sum stays put over any number of ops)
    out = np.zeros(dist.get_world_size(), dtype=np.float32)
    parts = [np.zeros(1, dtype=np.float32) for _ in range(dist.get_world_size())]
    whole = np.zeros(dist.get_world_size(), dtype=np.float32)
    root_list = parts if dist.get_rank() == 0 else None
    call = {
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, src=0),
        "reduce": lambda: dist.reduce(x, dst=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "all_gather": lambda: dist.all_gather(parts, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, whole),
        "gather": lambda: dist.gather(x, root_list, dst=0),
        "scatter": lambda: dist.scatter(x, root_list, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(out, whole),
        "barrier": lambda: dist.barrier(),
    }[op]
    for _ in range(200):  # warm: the agreement, the kept calls, the recorder's slots
        await call()
    await dist.barrier()
    counts: collections.Counter[str] = collections.Counter()
    me = sys._getframe(0).f_code

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if code is me or code.co_name == "<lambda>" or name.startswith(_LOOP):
                return
            counts["py"] += 1
            where = os.path.relpath(name, _PKG) if name.startswith(_PKG) else os.path.basename(name)
            counts[f"{where}:{code.co_name}"] += 1
        elif event == "c_call":
            counts["c"] += 1

    sys.setprofile(prof)
    try:
        for _ in range(OPS):
            await call()
    finally:
        sys.setprofile(None)
    stats = dist.group.WORLD.stats()
    await dist.barrier()
    await dist.destroy_process_group()
    print(json.dumps({"ops": OPS, "counts": dict(counts), "eager": stats["eager"]}))


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1] if len(sys.argv) > 1 else "all_reduce"))
