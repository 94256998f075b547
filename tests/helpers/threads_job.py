"""One rank of a job that calls aiodist's collectives from threads (tests/test_threads.py).

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; argv[1] names the scenario. Prints one
JSON line: what each step saw (values, or the error's type and message).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import aiodist as dist

GROUP_TIMEOUT_S = 3.0


def _err(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "msg": str(exc)}


def _in_thread(fn: Any) -> Any:
    """fn() on a new thread; what it returned or raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = _err(exc)

    t = threading.Thread(target=run, name="user-thread")
    t.start()
    return t, box


async def threads() -> dict[str, Any]:
    await dist.init_process_group(timeout=GROUP_TIMEOUT_S)
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}

    # the job's first op, from a thread running a loop of its own
    a = np.full(4, rank + 1.0, np.float32)
    t, box = _in_thread(lambda: asyncio.run(dist.all_reduce(a)))
    await asyncio.to_thread(t.join)
    out["first_op_thread_asyncio_run"] = box.get("error", a.tolist())

    # asyncio.to_thread: the call blocks its worker thread until the op ends, as torch's
    b = np.full(3, 10.0 * (rank + 1), np.float32)
    handle = await asyncio.to_thread(dist.all_reduce, b)
    out["to_thread"] = b.tolist()
    out["to_thread_await"] = await handle  # a finished handle: None at once

    # a thread pool of plain threads, several calls in a row (call order kept)
    c = [np.full(2, float(rank + i), np.float32) for i in range(3)]

    def pool_job() -> None:
        for arr in c:
            dist.all_reduce(arr)
        dist.barrier()

    with ThreadPoolExecutor(1) as ex:
        await asyncio.get_running_loop().run_in_executor(ex, pool_job)
    out["pool"] = [arr.tolist() for arr in c]

    # async_op=True on a thread's own loop: a Work usable there
    d = np.full(2, rank + 5.0, np.float32)

    async def work_there() -> Any:
        w = await dist.all_reduce(d, async_op=True)
        await w
        ok = await w.wait()
        return [type(w).__name__, w.is_completed(), ok, w.is_success()]

    t, box = _in_thread(lambda: asyncio.run(work_there()))
    await asyncio.to_thread(t.join)
    out["async_op_thread"] = box.get("error", box.get("value"))
    out["async_op_values"] = d.tolist()

    # an object collective from a thread
    objs: list[Any] = [None, None]
    t, box = _in_thread(lambda: dist.all_gather_object(objs, {"rank": rank}))
    await asyncio.to_thread(t.join)
    out["object_thread"] = box.get("error", objs)

    # and on the group's own loop after all that: the group is in step
    e = np.ones(2, np.float32)
    await dist.all_reduce(e)
    out["after"] = e.tolist()
    await dist.destroy_process_group()
    return out


async def blocked() -> dict[str, Any]:
    """A coroutine that blocks the group's loop on a thread that calls a collective: the thread
    gets a timeout that names the blocked loop, and the group still works afterwards."""
    await dist.init_process_group(timeout=GROUP_TIMEOUT_S)
    rank = dist.get_rank()
    x = np.full(2, rank + 1.0, np.float32)
    t0 = time.monotonic()
    t, box = _in_thread(lambda: dist.all_reduce(x))
    t.join()  # the mistake: the loop waits for the thread that waits for the loop
    out: dict[str, Any] = {"rank": rank, "blocked": box.get("error"), "blocked_s": time.monotonic() - t0, "x": x.tolist()}
    y = np.full(2, rank + 1.0, np.float32)
    await dist.all_reduce(y)
    out["after"] = y.tolist()
    await dist.destroy_process_group()
    return out


def closed() -> dict[str, Any]:
    """The job's loop is gone (asyncio.run returned): a call on a new loop is refused at once,
    before anything is sent, and so is destroy_process_group (the World went with its loop)."""
    out: dict[str, Any] = {}

    async def first() -> None:
        await dist.init_process_group(timeout=GROUP_TIMEOUT_S)
        x = np.ones(2, np.float32)
        await dist.all_reduce(x)
        out["first"] = x.tolist()

    asyncio.run(first())
    x = np.ones(2, np.float32)
    t0 = time.monotonic()
    try:
        asyncio.run(dist.all_reduce(x))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["refused"] = _err(exc)
    out["refused_s"] = time.monotonic() - t0
    try:
        asyncio.run(dist.destroy_process_group())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["destroy"] = _err(exc)
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    res = closed() if mode == "closed" else asyncio.run({"threads": threads, "blocked": blocked}[mode]())
    print(json.dumps(res), flush=True)
