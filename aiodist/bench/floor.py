"""The Python floor of a small all_reduce on this machine, measured: what an op costs when it does
only what it must, in pure Python on asyncio (uvloop where installed), between forked processes
on one host. ``python -m aiodist.bench collectives`` runs it in the same invocation as the
sweep and prints, for each small row, aiodist's time over it: how much of the row is aiodist's own.

What one op of the probe does, per rank (``_rank``): an asyncio Future and a deadline timer
(``loop.call_later``, cancelled at the end: what a torch-like Work and a per-op timeout cost);
the rank's bytes copied into its slot of a shared anonymous mapping, then its sequence number;
for every peer, a spin on the peer's sequence number that yields the core (``os.sched_yield``:
ranks may outnumber cores); the sum of every slot in rank order into the caller's array; the
Future resolved and awaited. Two slots per rank, by the op's parity: a rank reuses a slot only
after every peer posted the next op, which each did only after reading this one.
"""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing
import os
import struct
import time
from typing import Any

import numpy as np

__all__ = ["measure", "FLOOR_MAX_BYTES"]

#: the largest row the floor is measured for (above it an op is about bytes, not calls)
FLOOR_MAX_BYTES = 64 << 10
_HEAD = 64
_SEQ = struct.Struct("q")
_WARMUP = 500


def _slot_bytes(nbytes: int) -> int:
    return _HEAD + 2 * ((nbytes + 63) // 64 * 64)


def _rank(mm: mmap.mmap, rank: int, nranks: int, nbytes: int, iters: int, out: Any) -> None:
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop = asyncio.new_event_loop()
    slot = _slot_bytes(nbytes)
    half = (slot - _HEAD) // 2
    count = max(1, nbytes // 4)
    whole = np.frombuffer(mm, np.uint8)
    views = [
        [whole[q * slot + _HEAD + k * half : q * slot + _HEAD + k * half + 4 * count].view(np.float32) for q in range(nranks)]
        for k in (0, 1)
    ]
    peers = [q for q in range(nranks) if q != rank]
    seq = [0]

    async def all_reduce(x: np.ndarray) -> None:
        fut = loop.create_future()
        deadline = loop.call_later(1800.0, fut.cancel)
        s = seq[0] = seq[0] + 1
        mine = views[s & 1]
        mine[rank][...] = x
        _SEQ.pack_into(mm, rank * slot, s)
        for q in peers:
            while _SEQ.unpack_from(mm, q * slot)[0] < s:
                os.sched_yield()
        np.add(mine[0], mine[1], out=x)
        for v in mine[2:]:
            np.add(x, v, out=x)
        deadline.cancel()
        fut.set_result(None)
        await fut

    async def main() -> float:
        x = np.ones(count, np.float32)
        for _ in range(_WARMUP):
            x[...] = 1.0
            await all_reduce(x)
        t = time.perf_counter()
        for _ in range(iters):
            x[...] = 1.0
            await all_reduce(x)
        took = (time.perf_counter() - t) / iters
        if x[0] != nranks:
            raise AssertionError(f"floor probe: {x[0]} != {nranks}")
        return took

    try:
        took = loop.run_until_complete(main())
    finally:
        loop.close()
    if out is not None:
        out.send(took)


def measure(nranks: int, nbytes: int = 4, iters: int = 5000) -> float:
    """Seconds per op of the probe's all_reduce of ``nbytes`` (float32, at least one) between
    ``nranks`` forked processes, back to back (rank 0's mean over ``iters`` ops after a warm-up).
    Needs ``fork`` (Linux, macOS); raises OSError where a rank fails or takes over a minute."""
    if nranks < 2:
        raise ValueError(f"the floor probe needs at least 2 ranks, not {nranks}")
    ctx = multiprocessing.get_context("fork")
    mm = mmap.mmap(-1, nranks * _slot_bytes(max(nbytes, 4)))
    recv, send = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_rank, args=(mm, r, nranks, max(nbytes, 4), iters, send if r == 0 else None), daemon=True) for r in range(nranks)
    ]
    try:
        for p in procs:
            p.start()
        if not recv.poll(60.0):
            raise OSError(f"the floor probe ({nranks} ranks, {nbytes} B) did not finish within 60 s")
        took: float = recv.recv()
        for p in procs:
            p.join(10.0)
        return took
    finally:
        for p in procs:  # only the probe's own processes
            if p.is_alive():
                p.kill()
                p.join(5.0)
        recv.close()
        send.close()
        mm.close()
