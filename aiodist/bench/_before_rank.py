"""One rank of the benchmark's "before" side: an OLDER aiodist tree, run by path
(``python .../aiodist/bench/_before_rank.py RANK NPROC STORE_PORT TIMEOUT TREE`` with
``PYTHONPATH=<the older tree>``; started by ``aiodist.bench.collectives.BeforeSide``, never by
hand).

This file stands alone on purpose: it imports nothing from the tree it lives in (that tree's
``aiodist.bench`` may not exist in the older one, or differ), only the older tree's public API
(``init_process_group``, the collectives, ``barrier``, ``destroy_process_group``: what every
aiodist has had). Its timing loop and checks are the same as ``collectives._Rank``'s, and it
speaks the same row protocol over an authenticated ``multiprocessing.connection`` to the
coordinator (address and key in ``AIODIST_BENCH_BEFORE``, as ``host:port:key-hex``).
"""

from __future__ import annotations

import os
import sys

# Run by path, Python puts this file's folder (the NEW tree's aiodist/bench) first on sys.path:
# take it off before anything is imported, so nothing there can shadow a module.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import asyncio  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import multiprocessing.connection  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ENV = "AIODIST_BENCH_BEFORE"
FAIL_ENV = "AIODIST_BENCH_FAIL_RANK"  # same as collectives.FAIL_ENV: the rank (of any side) that raises at its first row
HOST = "127.0.0.1"


def _check_input(rank: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) % 7) + rank + 1).astype(np.float32)


def _check_expected(n: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) % 7) * n + n * (n + 1) // 2).astype(np.float32)


def _random_input(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)


class _Buffers:
    def __init__(self, op: str, count: int, n: int, rank: int = 0) -> None:
        part = count // n if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter") else count
        self.parts: list[np.ndarray] | None = None
        if op in ("all_gather_into_tensor", "gather"):
            self.inp, self.out = np.zeros(part, np.float32), np.zeros(count if op != "gather" or rank == 0 else 0, np.float32)
        elif op in ("reduce_scatter_tensor", "scatter"):
            self.inp, self.out = np.zeros(count if op != "scatter" or rank == 0 else 0, np.float32), np.zeros(part, np.float32)
        elif op == "all_to_all_single":
            self.inp, self.out = np.zeros(count, np.float32), np.zeros(count, np.float32)
        else:
            self.inp = self.out = np.zeros(count, np.float32)
        if op in ("gather", "scatter") and rank == 0:
            whole = self.out if op == "gather" else self.inp
            self.parts = [whole[i * part : (i + 1) * part] for i in range(n)]


def _trim() -> None:
    """What the new side's memory probe does before a row's warmup (collect, malloc_trim), so
    both sides start their rows from the same allocator state."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _next(conn: multiprocessing.connection.Connection) -> Any:
    loop = asyncio.get_running_loop()
    while not conn.poll():
        ready = loop.create_future()
        loop.add_reader(conn.fileno(), _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


def _tree_info(tree: str) -> dict[str, Any]:
    """Which aiodist this process runs: its file, version, and every loaded aiodist module
    that does not come from ``tree`` (there must be none)."""
    import aiodist

    root = os.path.realpath(tree) + os.sep
    outside = []
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if (name == "aiodist" or name.startswith("aiodist.")) and file and not os.path.realpath(file).startswith(root):
            outside.append(name)
    outside.sort()
    return {"file": os.path.realpath(aiodist.__file__ or ""), "version": getattr(aiodist, "__version__", None), "outside": outside}


async def _serve(rank: int, n: int, port: int, timeout: float, tree: str, conn: multiprocessing.connection.Connection) -> None:
    import aiodist

    await aiodist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=n, timeout=timeout)
    try:

        def call(op: str, b: _Buffers) -> Any:
            if op == "all_reduce":
                return aiodist.all_reduce(b.out)
            if op == "broadcast":
                return aiodist.broadcast(b.out, src=0)
            if op == "reduce":
                return aiodist.reduce(b.out, dst=0)
            if op == "all_gather_into_tensor":
                return aiodist.all_gather_into_tensor(b.out, b.inp)
            if op == "reduce_scatter_tensor":
                return aiodist.reduce_scatter_tensor(b.out, b.inp)
            if op == "all_to_all_single":
                return aiodist.all_to_all_single(b.out, b.inp)
            if op == "gather":
                return aiodist.gather(b.inp, b.parts, dst=0)
            if op == "scatter":
                return aiodist.scatter(b.out, b.parts, src=0)
            return aiodist.barrier()

        async def do(aw: Any) -> None:
            if aw is not None:
                await aw

        checked: set[int] = set()

        async def row(op: str, count: int, warmup: int, iters: int) -> dict[str, Any]:
            if os.environ.get(FAIL_ENV) == str(rank):
                raise RuntimeError(f"rank {rank}: failing on purpose ({FAIL_ENV} is set)")
            b = _Buffers(op, count, n, rank)
            crc = None
            if op == "all_reduce" and count not in checked:
                checked.add(count)
                b.out[:] = _check_input(rank, count)
                await do(call(op, b))
                if not np.array_equal(b.out, _check_expected(n, count)):
                    raise RuntimeError(f"rank {rank}: all_reduce of {count} elements gave a wrong sum")
                b.out[:] = _random_input(rank, count)
                await do(call(op, b))
                crc = zlib.crc32(b.out.tobytes())
                b.out.fill(0)
            _trim()
            for _ in range(warmup):
                await do(call(op, b))
            await do(aiodist.barrier())
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                await do(call(op, b))
                times.append(time.perf_counter() - t0)
            return {"times": times, "crc": crc, "lags": None, "mem": 0}

        conn.send(("ready", _tree_info(tree)))
        while True:
            cmd = await _next(conn)
            if cmd[0] == "stop":
                await do(aiodist.barrier())
                return
            if cmd[0] == "idle":
                conn.send(("idle", None))
                continue
            conn.send(("row", await row(*cmd[1:])))
    finally:
        await aiodist.destroy_process_group()


def main(argv: list[str]) -> int:
    rank, n, port, timeout, tree = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3]), argv[4]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops its ranks itself
    host, cport, key = os.environ[ENV].rsplit(":", 2)
    conn = multiprocessing.connection.Client((host, int(cport)), authkey=bytes.fromhex(key))
    conn.send(("hello", rank))
    try:
        import uvloop  # the new side's loop too

        run: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    try:
        run(_serve(rank, n, port, timeout, tree, conn))
        reply: tuple[Any, ...] = ("done",)
    except EOFError:  # the coordinator is gone
        return 1
    except BaseException:
        reply = ("error", traceback.format_exc())
    try:
        conn.send(reply)
    except OSError:
        pass
    conn.close()
    return 0 if reply[0] == "done" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
