"""One rank of the benchmark's MPI sides: ``mpirun ... PYTHON -I .../aiodist/bench/_mpi_rank.py``
(started by ``aiodist.bench.collectives.MpiSide``, never by hand).

PYTHON is the interpreter that has mpi4py built for the MPI library being measured: this
Python for Open MPI, and the Python of an MPI library's own venv for MPICH and Intel MPI. That
venv has no aiodist, so this file stands alone on purpose: it imports only the standard library,
numpy and mpi4py (tests/test_bench_mpi.py checks), and is run by path with ``-I`` (isolated: the
folder it lies in is not put on sys.path, PYTHONPATH is ignored). Its rows, timing loop and
check are those of ``collectives._Rank``; it speaks the same row protocol over an authenticated
``multiprocessing.connection`` to the coordinator, whose address and key come in
``AIODIST_BENCH_MPI`` (``host:port:key-hex``).

The ops are blocking mpi4py calls on numpy buffers, in place where MPI allows it, so the rank
has no event loop: it reads the coordinator's next command with a blocking ``recv`` (asleep in
the kernel while the other sides run their rows).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from typing import Any

import numpy as np

ENV = "AIODIST_BENCH_MPI"  # same as collectives.MPI_ENV
FAIL_ENV = "AIODIST_BENCH_FAIL_RANK"  # same as collectives.FAIL_ENV: the rank (of any side) that raises at its first row


def _check_input(rank: int, count: int) -> np.ndarray:
    """Small integers (exact in float32 when summed over a few ranks)."""
    return ((np.arange(count, dtype=np.int64) % 7) + rank + 1).astype(np.float32)


def _check_expected(n: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) % 7) * n + n * (n + 1) // 2).astype(np.float32)


class _Buffers:
    """An op's buffers, as ``collectives._Buffers`` makes them."""

    def __init__(self, op: str, count: int, n: int, rank: int) -> None:
        part = count // n if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter") else count
        if op in ("all_gather_into_tensor", "gather"):
            self.inp, self.out = np.zeros(part, np.float32), np.zeros(count if op != "gather" or rank == 0 else 0, np.float32)
        elif op in ("reduce_scatter_tensor", "scatter"):
            self.inp, self.out = np.zeros(count if op != "scatter" or rank == 0 else 0, np.float32), np.zeros(part, np.float32)
        elif op == "all_to_all_single":
            self.inp, self.out = np.zeros(count, np.float32), np.zeros(count, np.float32)
        else:  # in place (barrier: an empty one, unused)
            self.inp = self.out = np.zeros(count, np.float32)


def library() -> str:
    """The MPI library mpi4py loaded (the first line of MPI_Get_library_version)."""
    from mpi4py import MPI

    lines = MPI.Get_library_version().strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def serve(conn: multiprocessing.connection.Connection) -> None:
    """Say which rank this is and which library it runs, then run the coordinator's commands:
    ("row", op, count, warmup, iters), ("idle", seconds) or ("stop",)."""
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    SUM, IN_PLACE = MPI.SUM, MPI.IN_PLACE

    def call(op: str, b: _Buffers) -> None:
        if op == "all_reduce":
            comm.Allreduce(IN_PLACE, b.out, op=SUM)
        elif op == "broadcast":
            comm.Bcast(b.out, root=0)
        elif op == "reduce":
            if rank == 0:
                comm.Reduce(IN_PLACE, b.out, op=SUM, root=0)
            else:
                comm.Reduce(b.out, None, op=SUM, root=0)
        elif op == "all_gather_into_tensor":
            comm.Allgather(b.inp, b.out)
        elif op == "reduce_scatter_tensor":
            comm.Reduce_scatter_block(b.inp, b.out, op=SUM)
        elif op == "all_to_all_single":
            comm.Alltoall(b.inp, b.out)
        elif op == "gather":
            comm.Gather(b.inp, b.out if rank == 0 else None, root=0)
        elif op == "scatter":
            comm.Scatter(b.inp if rank == 0 else None, b.out, root=0)
        else:
            comm.Barrier()

    checked: set[int] = set()

    def row(op: str, count: int, warmup: int, iters: int) -> dict[str, Any]:
        if os.environ.get(FAIL_ENV) == str(rank):
            raise RuntimeError(f"rank {rank}: failing on purpose ({FAIL_ENV} is set)")
        b = _Buffers(op, count, n, rank)
        if op == "all_reduce" and count not in checked:
            checked.add(count)
            b.out[:] = _check_input(rank, count)
            call(op, b)
            if not np.array_equal(b.out, _check_expected(n, count)):
                raise RuntimeError(f"rank {rank}: all_reduce of {count} elements gave a wrong sum")
            b.out.fill(0)
        for _ in range(warmup):
            call(op, b)
        comm.Barrier()
        clock, times = time.perf_counter, []
        for _ in range(iters):
            t0 = clock()
            call(op, b)
            times.append(clock() - t0)
        # no bit check (MPI may reduce in a different order on each rank), no probe (no loop), no memory figure
        return {"times": times, "crc": None, "lags": None, "mem": 0}

    conn.send(("hello", rank))
    conn.send(("ready", {"library": library(), "mpi4py": mpi4py.__version__, "python": sys.executable}))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            comm.Barrier()
            return
        if cmd[0] == "idle":
            conn.send(("idle", None))
            continue
        conn.send(("row", row(*cmd[1:])))


def main() -> int:
    host, port, key = os.environ[ENV].rsplit(":", 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops its ranks itself
    # MPI_Init (at this import) waits for every rank: before the coordinator, which takes one rank at a time
    from mpi4py import MPI  # noqa: F401

    conn = multiprocessing.connection.Client((host, int(port)), authkey=bytes.fromhex(key))
    try:
        serve(conn)
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
    sys.exit(main())
