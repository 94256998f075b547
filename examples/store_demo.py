"""A TCPStore server and several worker processes coordinating through it.

    python examples/store_demo.py [--workers 3] [--tasks 12] [--port 0]

The coordinator (this process) hosts the store (``is_master=True``, port 0 unless told) and
starts the workers as separate processes. Everyone joins (the store's ``init/`` counter),
meets at a barrier, then the coordinator hands out tasks through a queue; workers pop tasks,
compute, push results to another queue and count their work with ``add``; a last barrier
ends the job and the coordinator checks the totals. Every wait has a timeout: a worker that
dies makes the job fail with a message, never hang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiodist

TIMEOUT = 30.0


def say(who: str, msg: str) -> None:
    print(f"[{who}] {msg}", flush=True)


async def worker(rank: int, port: int, world_size: int, timeout: float) -> None:
    me = f"worker {rank}"
    async with aiodist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout) as store:
        n = await store.add("workers_ready", 1)
        say(me, f"connected to the store at 127.0.0.1:{port} ({n} worker(s) ready so far)")
        await store.barrier("start", world_size)
        done = 0
        while True:
            task = json.loads(await store.queue_pop("tasks"))
            if task is None:  # the coordinator's stop signal
                break
            lo, hi = task["range"]
            result = sum(i * i for i in range(lo, hi))
            await store.queue_push("results", json.dumps({"task": task["id"], "worker": rank, "result": result}))
            total = await store.add("tasks_done", 1)
            done += 1
            say(me, f"task {task['id']:>2}: sum of squares of [{lo}, {hi}) = {result} ({total} done in all)")
        await store.set(f"worker/{rank}/done", str(done))
        await store.barrier("end", world_size)
        say(me, f"finished after {done} task(s)")


async def run_job(store: aiodist.TCPStore, workers: int, tasks: int, world_size: int) -> bool:
    me = "coordinator"
    await store.barrier("start", world_size)
    say(me, f"all {workers} workers arrived at the start barrier; pushing {tasks} tasks")
    for i in range(tasks):
        await store.queue_push("tasks", json.dumps({"id": i, "range": [i * 100, (i + 1) * 100]}))
    results = [json.loads(await store.queue_pop("results")) for _ in range(tasks)]
    for _ in range(workers):
        await store.queue_push("tasks", json.dumps(None))
    await store.barrier("end", world_size)
    per_worker = await store.multi_get([f"worker/{r}/done" for r in range(1, workers + 1)])
    expected = sum(i * i for i in range(tasks * 100))
    got = sum(r["result"] for r in results)
    counted = int(await store.get("tasks_done")) if tasks else 0
    say(me, "tasks per worker: " + ", ".join(f"worker {r}: {int(v)}" for r, v in enumerate(per_worker, 1)))
    say(me, f"sum of all results = {got} (expected {expected}); tasks_done counter = {counted}")
    say(me, f"store keys: {sorted(await store.list_keys())}")
    return got == expected and counted == tasks == len({r["task"] for r in results})


async def coordinator(workers: int, tasks: int, port: int, timeout: float) -> int:
    me = "coordinator"
    world_size = workers + 1
    t0 = time.perf_counter()
    store = aiodist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    await store
    say(me, f"TCPStore server listening on port {store.port}; starting {workers} worker process(es)")
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--worker",
            str(r),
            "--port",
            str(store.port),
            "--world-size",
            str(world_size),
            "--timeout",
            str(timeout),
        )
        for r in range(1, workers + 1)
    ]

    async def watch_workers() -> None:
        # A worker that dies fails the job at once instead of leaving everyone at a barrier.
        for fut in asyncio.as_completed([p.wait() for p in procs]):
            code = await fut
            if code != 0:
                raise aiodist.DistError(f"a worker process exited with code {code}")

    watcher: asyncio.Task[None] | None = None
    try:
        job = asyncio.create_task(run_job(store, workers, tasks, world_size))
        watcher = asyncio.create_task(watch_workers())
        done, _ = await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_EXCEPTION)
        if job not in done:
            job.cancel()
            watcher.result()
        ok = job.result()
        await asyncio.wait_for(watcher, timeout)
        say(me, f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.2f} s")
        return 0 if ok else 1
    except aiodist.DistError as exc:
        say(me, f"FAILED: {exc}")
        return 1
    finally:
        if watcher is not None:
            watcher.cancel()
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--tasks", type=int, default=12)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="every wait's deadline, in seconds (default 30)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    run = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        pass
    if args.worker is not None:
        run(worker(args.worker, args.port, args.world_size, args.timeout))
        return 0
    if args.workers < 1 or args.tasks < 0:
        p.error("--workers must be >= 1 and --tasks >= 0")
    return run(coordinator(args.workers, args.tasks, args.port, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
