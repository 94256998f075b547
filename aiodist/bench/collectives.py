"""``python -m aiodist.bench collectives``: collective latency and bandwidth, nccl-tests style.

What it runs: ``--nproc`` rank processes (spawned), which meet through ``tcp://127.0.0.1:PORT``
(a free port; rank 0 hosts the store) and make a "gloo" group (aiodist's socket backend, on
uvloop). For each op of ``--ops`` and each size of the sweep (float32, ``--min-bytes`` to
``--max-bytes``, times ``--step``), every rank makes its buffers, runs ``--warmup`` untimed
iterations, meets the others at a barrier, then runs ``--iters`` timed iterations back to back,
each timed on its own with ``time.perf_counter``.

With ``--compare torch`` the same rows also run, in the same invocation, on a second set of
processes that import torch (only they do, and only then) and make a torch.distributed gloo
group. Both sets start once; the coordinator then drives them row by row over pipes, one side at
a time (the machine is small), alternating which goes first from row to row, so that the
machine's drift lands on both. ``--rounds`` repeats the whole sweep.

The time reported for one (op, size) is the MEDIAN over iterations (of every round) of the
slowest rank's time for that iteration. algbw = size / time; busbw = algbw times nccl-tests' factor for the op
(all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast, reduce 1).
Sizes follow nccl-tests: all_reduce/broadcast/reduce move a buffer of ``size`` bytes;
all_gather's size is its output (n parts), reduce_scatter's its input, all_to_all's one rank's
input, gather's output and scatter's input on the root (rank 0), each rounded down to a
multiple of n elements.

Correctness, checked once per all_reduce size before timing: the sum of small integers must be
exact, and the sum of random floats must have the same bits on every rank. A wrong result, a
worker that raises or dies, or any wait past ``--timeout`` fails the run (exit code 1) with the
worker's traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any

import numpy as np

from aiodist.bench import _mpi, format_table, machine_info
from aiodist.bench import floor as _floor
from aiodist.bench._mpi_rank import _Buffers as _Layout
from aiodist.bench.probes import LagProbe, PeakRss, percentile
from aiodist.knobs import parse_size

__all__ = ["main", "OPS", "sizes"]

HOST = "127.0.0.1"
OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
#: ops whose size is that of n parts (nccl-tests' rounding: a multiple of n elements)
_PARTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter")
ITEMSIZE = 4  # float32
FAIL_ENV = "AIODIST_BENCH_FAIL_RANK"  # tests: the rank (of either side) that raises at its first row
STARTUP = 120.0  # seconds a rank may take to start (import, spawn) and join, on top of --timeout


def _is_comm(errors: dict[int, str]) -> bool:
    """Every traceback ends in an aiodist communication error (a peer's exit seen)."""
    return all(t.rstrip().rpartition("\n")[2].startswith(_COMM_ERRORS) for t in errors.values())


_COMM_ERRORS = ("aiodist.errors.DistNetworkError", "aiodist.errors.DistBackendError", "DistNetworkError", "DistBackendError")


class BenchError(Exception):
    """The benchmark could not run, or a result was wrong."""


def _busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in _PARTED:
        return (n - 1) / n
    return 1.0


def _count(op: str, nbytes: int, n: int) -> int:
    """Elements moved for a row of ``nbytes`` (nccl-tests' rounding)."""
    if op == "barrier":
        return 0
    count = nbytes // ITEMSIZE
    if op in _PARTED:
        count -= count % n
    return count


def sizes(min_bytes: int, max_bytes: int, step: int) -> list[int]:
    out, s = [], max(ITEMSIZE, min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= step
    return out


def _rows(op: str, all_sizes: Sequence[int], n: int) -> list[int]:
    """The element counts of ``op``'s rows (barrier: one row of 0); sizes that round to
    nothing, or to a count already listed, are left out."""
    if op == "barrier":
        return [0]
    out: list[int] = []
    for s in all_sizes:
        c = _count(op, s, n)
        if c and c not in out:
            out.append(c)
    return out


@dataclass(frozen=True)
class Plan:
    """How the ranks of one side start. Sent to the rank processes as an argument; what they
    run comes row by row over their pipes."""

    impl: str  # "aiodist" | "torch" | "openmpi" | "mpich" | "impi" | "before"
    nproc: int
    port: int
    timeout: float
    lag_probe: bool = False
    tree: str | None = None  # "before": the older aiodist checkout its ranks import


# ----------------------------------------------------------------------------- ranks


def _check_input(rank: int, count: int) -> np.ndarray:
    """Small integers (exact in float32 when summed over a few ranks)."""
    return ((np.arange(count, dtype=np.int64) % 7) + rank + 1).astype(np.float32)


def _check_expected(n: int, count: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int64) % 7) * n + n * (n + 1) // 2).astype(np.float32)


def _random_input(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)


class _Buffers(_Layout):
    """An op's buffers (numpy arrays; the torch side wraps them with torch.from_numpy), laid out
    as the MPI ranks' (``_mpi_rank._Buffers``, which must run without aiodist). gather's output
    and scatter's input (``parts``: their n views) are the root's (rank 0) alone."""

    def __init__(self, op: str, count: int, n: int, rank: int = 0) -> None:
        super().__init__(op, count, n, rank)
        part = count // n
        self.parts: list[np.ndarray] | None = None
        if op in ("gather", "scatter") and rank == 0:
            whole = self.out if op == "gather" else self.inp
            self.parts = [whole[i * part : (i + 1) * part] for i in range(n)]


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _next(conn: multiprocessing.connection.Connection) -> Any:
    """The coordinator's next command, waited for without blocking the loop (aiodist's loop
    watchdog would report a blocked loop while another side runs its rows)."""
    loop = asyncio.get_running_loop()
    while not conn.poll():
        ready = loop.create_future()
        loop.add_reader(conn.fileno(), _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


class _Rank:
    """One rank's side of the protocol, whatever the implementation: ``call(op, b)`` runs one
    op (a coroutine for aiodist, None for torch) and ``barrier()`` likewise."""

    def __init__(
        self, rank: int, n: int, call: Callable[[str, _Buffers], Any], barrier: Callable[[], Any], check_bits: bool, lag_probe: bool = False
    ) -> None:
        self.rank, self.n, self.call, self.barrier, self.check_bits = rank, n, call, barrier, check_bits
        self.checked: set[int] = set()
        # blocking implementations (torch, MPI) cannot run a probe: their loop does nothing during an op
        self.probe = LagProbe() if lag_probe else None

    async def _do(self, aw: Any) -> None:
        if aw is not None:
            await aw

    async def row(self, op: str, count: int, warmup: int, iters: int) -> dict[str, Any]:
        """Warm up, meet at a barrier, time ``iters`` iterations; the first time an all_reduce
        size is seen, check its result first."""
        if os.environ.get(FAIL_ENV) == str(self.rank):
            raise RuntimeError(f"rank {self.rank}: failing on purpose ({FAIL_ENV} is set)")
        b = _Buffers(op, count, self.n, self.rank)
        crc = None
        if op == "all_reduce" and count not in self.checked:
            self.checked.add(count)
            b.out[:] = _check_input(self.rank, count)
            await self._do(self.call(op, b))
            if not np.array_equal(b.out, _check_expected(self.n, count)):
                raise BenchError(f"rank {self.rank}: all_reduce of {count} elements gave a wrong sum")
            if self.check_bits:
                b.out[:] = _random_input(self.rank, count)
                await self._do(self.call(op, b))
                crc = zlib.crc32(b.out.tobytes())
            b.out.fill(0)
        mem = PeakRss()
        mem.start()  # after the checks (their inputs are the size of the buffer): the op's own extra memory
        for _ in range(warmup):
            await self._do(self.call(op, b))
        await self._do(self.barrier())
        if self.probe is not None:
            self.probe.start()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await self._do(self.call(op, b))
            times.append(time.perf_counter() - t0)
        lags = await self.probe.stop() if self.probe is not None else None
        return {"times": times, "crc": crc, "lags": lags, "mem": mem.stop()}

    async def serve(self, conn: multiprocessing.connection.Connection) -> None:
        """Run the coordinator's commands: ("row", op, count, warmup, iters) or ("stop",)."""
        conn.send(("ready",))
        while True:
            cmd = await _next(conn)
            if cmd[0] == "stop":
                await self._do(self.barrier())
                return
            if cmd[0] == "idle":  # the probe alone: the loop lag this machine gives with no op running
                lags = None
                if self.probe is not None:
                    self.probe.start()
                    await asyncio.sleep(cmd[1])
                    lags = await self.probe.stop()
                conn.send(("idle", lags))
                continue
            conn.send(("row", await self.row(*cmd[1:])))


async def _aiodist_rank(plan: Plan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    import aiodist

    n = plan.nproc
    await aiodist.init_process_group("gloo", init_method=f"tcp://{HOST}:{plan.port}", rank=rank, world_size=n, timeout=plan.timeout)
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

        await _Rank(rank, n, call, aiodist.barrier, True, plan.lag_probe).serve(conn)
    finally:
        await aiodist.destroy_process_group()


async def _torch_rank(plan: Plan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    n = plan.nproc
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. are deprecated names
    dist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{plan.port}", rank=rank, world_size=n, timeout=timedelta(seconds=plan.timeout)
    )
    try:

        def call(op: str, b: _Buffers) -> None:
            inp, out = torch.from_numpy(b.inp), torch.from_numpy(b.out)
            if op == "all_reduce":
                dist.all_reduce(out)
            elif op == "broadcast":
                dist.broadcast(out, src=0)
            elif op == "reduce":
                dist.reduce(out, dst=0)
            elif op == "all_gather_into_tensor":
                dist.all_gather_into_tensor(out, inp)
            elif op == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(out, inp)
            elif op == "all_to_all_single":
                dist.all_to_all_single(out, inp)
            elif op == "gather":
                dist.gather(inp, None if b.parts is None else [torch.from_numpy(x) for x in b.parts], dst=0)
            elif op == "scatter":
                dist.scatter(out, None if b.parts is None else [torch.from_numpy(x) for x in b.parts], src=0)
            else:
                dist.barrier()

        # torch's ops block; the coroutine wrapper only shares the timing loop with aiodist's
        await _Rank(rank, n, call, dist.barrier, False).serve(conn)
    finally:
        dist.destroy_process_group()


def run_loop(coro: Any, *, fast: bool = True) -> None:
    """Run a rank's coroutine on uvloop (``fast``, where installed) or asyncio's own loop."""
    run: Callable[[Any], Any] = asyncio.run
    if fast:
        try:
            import uvloop

            run = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            pass
    run(coro)


def report_to_coordinator(conn: multiprocessing.connection.Connection, body: Callable[[], None]) -> None:
    """Run ``body`` in a rank process and tell the coordinator how it ended: ``("done",)`` or
    ``("error", traceback)``; a coordinator that is gone is left alone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops its ranks itself
    try:
        body()
        reply: tuple[Any, ...] = ("done",)
    except EOFError:  # the coordinator is gone
        return
    except BaseException:
        reply = ("error", traceback.format_exc())
    try:
        conn.send(reply)
    except OSError:  # the coordinator is gone
        pass
    conn.close()


def _rank_main(plan: Plan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """One rank process: serves the coordinator's commands; on failure sends ("error", traceback)."""
    if plan.impl == "torch":
        report_to_coordinator(conn, lambda: run_loop(_torch_rank(plan, rank, conn), fast=False))
    else:
        report_to_coordinator(conn, lambda: run_loop(_aiodist_rank(plan, rank, conn)))


# ----------------------------------------------------------------------------- coordinator


def _free_port() -> int:
    from aiodist.testing.ports import free_port  # outside the ephemeral range: no race with outgoing connections

    return free_port()


@dataclass
class Row:
    """What one side measured for one (op, size), over every round."""

    times: list[float]  # per iteration, the slowest rank's
    lags: list[float] | None  # the loop-lag probe's wake-up delays, every rank's (None: no probe)
    mem: int  # the largest peak RSS growth of any rank over a round (bytes)

    def merge(self, other: Row) -> None:
        self.times += other.times
        if self.lags is not None and other.lags is not None:
            self.lags += other.lags
        self.mem = max(self.mem, other.mem)


Results = dict[str, dict[int, Row]]  # op -> count -> row


class Side:
    """The rank processes of one implementation, started once and driven row by row."""

    rank_main = staticmethod(_rank_main)  # what each rank process runs (a subclass names its own)
    name = "bench"  # the processes' name prefix

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.procs: list[SpawnProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for r in range(self.plan.nproc):
            here, there = ctx.Pipe()
            p = ctx.Process(target=self.rank_main, args=(self.plan, r, there), name=f"{self.name}-{self.plan.impl}-{r}", daemon=True)
            p.start()
            there.close()
            self.procs.append(p)
            self.conns.append(here)

    def wait_ready(self) -> None:
        self._gather("ready", STARTUP + self.plan.timeout, "start-up")

    def _gather(self, kind: str, limit: float, what: str) -> list[Any]:
        """One message of ``kind`` from every rank, within ``limit`` seconds; an error, a death
        or silence fails the run."""
        impl = self.plan.impl
        deadline = time.monotonic() + limit
        got: dict[int, Any] = {}
        while len(got) < len(self.conns):
            left = deadline - time.monotonic()
            waiting = [r for r in range(len(self.conns)) if r not in got]
            if left <= 0:
                raise BenchError(f"{impl}: ranks {waiting} did not answer within {limit:g} s during {what} (--timeout)")
            sentinels = list(dict.fromkeys(self.procs[r].sentinel for r in waiting))  # the MPI side's ranks share one
            waitables: list[Any] = [self.conns[r] for r in waiting] + sentinels
            multiprocessing.connection.wait(waitables, timeout=min(left, 1.0))
            for r in waiting:
                conn = self.conns[r]
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except EOFError:
                        self.procs[r].join(5)
                        raise BenchError(f"{impl} rank {r} died (exit code {self.procs[r].exitcode}) during {what}") from None
                    if msg[0] == "error":
                        raise self._root_cause(r, msg[1], what)
                    if msg[0] != kind:
                        raise BenchError(f"{impl} rank {r}: expected {kind!r}, got {msg[0]!r} during {what}")
                    got[r] = msg[1] if len(msg) > 1 else None
                elif not self.procs[r].is_alive():
                    raise BenchError(f"{impl} rank {r} died (exit code {self.procs[r].exitcode}) during {what}")
        return [got[r] for r in range(len(self.conns))]

    def _root_cause(self, r: int, tb: str, what: str) -> BenchError:
        """The run's error: rank ``r``'s, unless it is a communication error (its peer's exit)
        and another rank reports a different one within half a second (the rank that failed
        first often closes its connections before its own report arrives)."""
        errors = {r: tb}
        deadline = time.monotonic() + 0.5
        while _is_comm(errors) and time.monotonic() < deadline:
            for q, conn in enumerate(self.conns):
                if q not in errors and conn.poll(0.05):
                    try:
                        msg = conn.recv()
                    except EOFError:
                        continue
                    if msg[0] == "error":
                        errors[q] = msg[1]
        first = next((q for q, t in sorted(errors.items()) if not _is_comm({q: t})), r)
        return BenchError(f"{self.plan.impl} rank {first} failed during {what}:\n{errors[first]}")

    def row(self, op: str, count: int, warmup: int, iters: int) -> Row:
        """Run one row on every rank: the slowest rank's time of each iteration, every rank's
        loop lags (pooled) and the largest peak memory growth of any rank."""
        for c in self.conns:
            c.send(("row", op, count, warmup, iters))
        replies = self._gather("row", self.plan.timeout, f"{op} of {count * ITEMSIZE} B")
        crcs = {r: x["crc"] for r, x in enumerate(replies) if x["crc"] is not None}
        if len(set(crcs.values())) > 1:
            raise BenchError(f"{self.plan.impl}: {op} of {count} elements left different bits on different ranks: {crcs}")
        lags = None if replies[0]["lags"] is None else [lag for x in replies for lag in x["lags"]]
        return Row([max(ts) for ts in zip(*(x["times"] for x in replies))], lags, max(x["mem"] for x in replies))

    def idle_lags(self, seconds: float) -> list[float] | None:
        """Every rank's probe lags over ``seconds`` with no op running (None: no probe)."""
        for c in self.conns:
            c.send(("idle", seconds))
        got = self._gather("idle", self.plan.timeout + seconds, "the idle loop-lag probe")
        return None if got[0] is None else [lag for g in got for lag in g]

    def stop(self) -> None:
        try:
            for c in self.conns:
                c.send(("stop",))
            self._gather("done", self.plan.timeout, "shut-down")
            for p in self.procs:
                p.join(10)
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:  # only our own processes, by handle
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()


# ----------------------------------------------------------------------------- MPI sides (Open MPI, MPICH, Intel MPI)

MPI_ENV = "AIODIST_BENCH_MPI"  # host:port:authkey(hex) of the coordinator, for the MPI ranks
#: what the MPI ranks run, by path, with their library's Python (aiodist/bench/_mpi_rank.py:
#: numpy and mpi4py only, since MPICH's and Intel MPI's venvs have no aiodist)
MPI_RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_rank.py")


class _PopenProc:
    """What ``Side`` asks of a rank's process, answered for a ``subprocess.Popen`` (the MPI
    side's one mpirun that runs them all, or one "before" rank)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.sentinel = os.pidfd_open(popen.pid)  # waitable with the ranks' pipes (Linux >= 5.3)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        try:
            os.close(self.sentinel)
        except OSError:
            pass


def _io_timeouts(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO and SO_SNDTIMEO on a blocking socket (0: none): a read or write past them
    fails with an OSError (EAGAIN)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _accept_ranks(
    listener: socket.socket, key: bytes, impl: str, nproc: int, limit: float, died: Callable[[], str | None]
) -> list[multiprocessing.connection.Connection]:
    """Accept ``nproc`` ranks' connections on ``listener`` (each authenticates with ``key`` and
    says ("hello", rank) first), within ``limit`` seconds; ``died()`` says why the run cannot
    go on (a rank's launcher exited), None while it can. The connections, by rank."""
    deadline = time.monotonic() + limit
    by_rank: dict[int, multiprocessing.connection.Connection] = {}
    while len(by_rank) < nproc:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{impl}: {nproc - len(by_rank)} rank(s) did not connect within {limit:g} s")
        why = died()
        if why is not None:
            raise BenchError(f"{impl}: {why}")
        listener.settimeout(min(left, 1.0))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        # The handshake's reads and writes are bounded by the socket's own timeouts (a
        # Connection needs a blocking fd, so no settimeout): one that connects and stalls
        # is dropped after them, not waited on forever.
        sock.setblocking(True)
        _io_timeouts(sock, max(0.1, min(left, 30.0)))
        conn = multiprocessing.connection.Connection(os.dup(sock.fileno()))
        try:
            multiprocessing.connection.deliver_challenge(conn, key)
            multiprocessing.connection.answer_challenge(conn, key)
            if not conn.poll(max(0.1, min(deadline - time.monotonic(), 30.0))):
                raise EOFError
            hello = conn.recv()
            if hello[0] != "hello":
                raise ValueError(hello[0])
            rank = int(hello[1])
            if not 0 <= rank < nproc or rank in by_rank:
                raise ValueError(rank)
        except (multiprocessing.AuthenticationError, EOFError, OSError, ValueError, TypeError, IndexError):
            conn.close()  # not one of ours, stalled, or gone
            continue
        finally:
            _io_timeouts(sock, 0.0)  # the rows that follow wait with poll(), bounded there
            sock.close()
        by_rank[rank] = conn
    return [by_rank[r] for r in range(nproc)]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # nobody left in it
        pass


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux: /proc), but the caller."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # after the (command), which may hold spaces
        except OSError:  # gone meanwhile
            continue
        if len(fields) > 3 and int(fields[3]) == sid:  # state, ppid, pgrp, session
            out.append(int(entry))
    return out


def _end_session(sid: int, grace: float = 5.0) -> None:
    """Wait up to ``grace`` seconds for what is left of the launcher's session (``sid``: the
    launcher's pid, which stays reserved while any process of the session lives, so whatever
    still carries it is ours), then SIGKILL it."""
    deadline = time.monotonic() + grace
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class MpiSide(Side):
    """One MPI library's side: its ``mpirun -np N PYTHON -I aiodist/bench/_mpi_rank.py`` (see
    ``_mpi.MpiLib.command``); each rank connects back to the coordinator (an authenticated
    ``multiprocessing.connection``), says which library it loaded, then speaks the same row
    protocol as the other sides."""

    def __init__(self, plan: Plan, lib: _mpi.MpiLib) -> None:
        super().__init__(plan)
        self.lib = lib
        self.mpirun: subprocess.Popen[bytes] | None = None
        self._proc: _PopenProc | None = None
        self._listener: socket.socket | None = None
        self._key = os.urandom(16)
        self._out: Any = None  # mpirun's output (a temporary file), from start to kill

    def start(self) -> None:
        self._listener = socket.create_server((HOST, 0))
        port = self._listener.getsockname()[1]
        env = self.lib.env({**os.environ, MPI_ENV: f"{HOST}:{port}:{self._key.hex()}"})
        cmd = self.lib.command(self.plan.nproc, MPI_RANK, pass_on=[MPI_ENV, FAIL_ENV] if FAIL_ENV in env else [MPI_ENV])
        # its own session, so that a kill reaches the ranks it started too (see kill); its
        # output goes to a file, read only when it fails (a pipe nobody reads could fill)
        self._out = tempfile.TemporaryFile()
        self.mpirun = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._proc = _PopenProc(self.mpirun)
        self.procs = [self._proc] * self.plan.nproc  # type: ignore[list-item]

    def _output(self) -> str:
        if self._out is None:
            return ""
        self._out.seek(0)
        return self._out.read().decode(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        """Accept every rank's connection (each says its rank first), then wait for "ready":
        every rank must run the library that was found (a rank that loaded another fails the run)."""
        assert self._listener is not None and self.mpirun is not None
        mpirun = self.mpirun

        def died() -> str | None:
            if mpirun.poll() is None:
                return None
            return f"{os.path.basename(self.lib.mpirun)} exited ({mpirun.returncode}) before every rank connected:\n{self._output()}"

        self.conns = _accept_ranks(self._listener, self._key, self.plan.impl, self.plan.nproc, STARTUP + self.plan.timeout, died)
        self._listener.close()
        infos = self._gather("ready", STARTUP + self.plan.timeout, "start-up")
        for r, info in enumerate(infos):
            got = _mpi.short_library(str((info or {}).get("library", "")))
            if got != self.lib.library:
                raise BenchError(f"{self.plan.impl} rank {r} loaded {got!r}, not {self.lib.library!r}")

    def stop(self) -> None:
        try:
            for c in self.conns:
                c.send(("stop",))
            self._gather("done", self.plan.timeout, "shut-down")
            if self.mpirun is not None:
                self._proc.join(10)  # type: ignore[union-attr]
        finally:
            self.kill()

    def kill(self) -> None:
        if self.mpirun is not None:
            # SIGTERM to the launcher's whole process group (start_new_session: it leads its own),
            # not to the launcher alone: Intel MPI's mpirun is a sh script that runs
            # mpiexec.hydra as its child, and a SIGTERM to the script alone leaves hydra and the
            # ranks running. Each launcher passes it on to its ranks (MPICH's and Intel MPI's put
            # them in groups, or sessions, of their own).
            sid = self.mpirun.pid
            if self.mpirun.poll() is None:
                self.mpirun.terminate()
            _signal_group(sid, signal.SIGTERM)
            try:
                self.mpirun.wait(5)
            except subprocess.TimeoutExpired:
                self.mpirun.kill()
                _signal_group(sid, signal.SIGKILL)
                self.mpirun.wait(5)
            _end_session(sid)
        if self._proc is not None:
            self._proc.close()
            self._proc = None
        self.procs = []
        if self._listener is not None:
            self._listener.close()
        for c in self.conns:
            c.close()
        if self._out is not None:
            self._out.close()
            self._out = None


# ----------------------------------------------------------------------------- an older aiodist ("before")

BEFORE_ENV = "AIODIST_BENCH_BEFORE"  # host:port:authkey(hex) of the coordinator, for the before side's ranks
BEFORE_RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_before_rank.py")
_WHICH_AIODIST = "import aiodist, os; print(os.path.realpath(aiodist.__file__ or ''))"


def _tree_env(tree: str) -> dict[str, str]:
    """The environment of a process that must import aiodist from ``tree``: PYTHONPATH is that
    tree alone (this tree's aiodist is installed editable, behind PYTHONPATH's entries)."""
    return {**os.environ, "PYTHONPATH": tree}


def before_unavailable(tree: str) -> str | None:
    """Why ``--compare before=TREE`` cannot run (None: it can): TREE must be a folder whose
    ``aiodist`` package imports, from TREE itself, in this Python."""
    if not os.path.isdir(tree):
        return f"{tree} is not a folder"
    try:
        # cwd=tree: with -c, the working folder comes first on sys.path (this one could be a newer checkout)
        r = subprocess.run(
            [sys.executable, "-c", _WHICH_AIODIST], cwd=tree, env=_tree_env(tree), capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not check it ({exc})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"no importable aiodist there (import aiodist with PYTHONPATH={tree} failed: {last})"
    got, want = r.stdout.strip(), os.path.join(os.path.realpath(tree), "aiodist", "__init__.py")
    if got != want:
        return f"no aiodist package there: {want} does not exist (import aiodist with PYTHONPATH={tree} found {got})"
    return None


def tree_commit(tree: str) -> str:
    """``tree``'s commit (git), with a note if its tracked files have changes; 'unknown' and why
    when git cannot say."""
    if shutil.which("git") is None:
        return "unknown (git is not on PATH)"
    try:
        head = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(
            ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return head.stdout.strip()[:12] + (" + uncommitted changes" if dirty.stdout.strip() else "")


class BeforeSide(Side):
    """The "before" side: ``--nproc`` processes of ``python aiodist/bench/_before_rank.py`` (by
    path; it imports nothing of this tree) with ``PYTHONPATH=<tree>``, so they run an older
    aiodist through its public API. Each connects back to the coordinator like the MPI ranks,
    then says which aiodist it imported ("ready"): a file outside the tree fails the run."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        assert plan.tree is not None
        self.tree = plan.tree
        self.popens: list[subprocess.Popen[bytes]] = []
        self._listener: socket.socket | None = None
        self._key = os.urandom(16)
        self._outs: list[Any] = []  # each rank's output (temporary files), read only when it fails
        self.info: dict[str, Any] = {}

    def start(self) -> None:
        self._listener = socket.create_server((HOST, 0))
        port = self._listener.getsockname()[1]
        env = {**_tree_env(self.tree), BEFORE_ENV: f"{HOST}:{port}:{self._key.hex()}"}
        for rank in range(self.plan.nproc):
            out = tempfile.TemporaryFile()
            self._outs.append(out)
            args = [str(rank), str(self.plan.nproc), str(self.plan.port), repr(self.plan.timeout), self.tree]
            self.popens.append(
                subprocess.Popen(
                    [sys.executable, BEFORE_RANK, *args],
                    cwd=self.tree,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        self.procs = [_PopenProc(p) for p in self.popens]  # type: ignore[misc]

    def _output(self, rank: int) -> str:
        out = self._outs[rank]
        out.seek(0)
        return out.read().decode(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        assert self._listener is not None

        def died() -> str | None:
            for r, p in enumerate(self.popens):
                if p.poll() is not None:
                    return f"rank {r} exited ({p.returncode}) before every rank connected:\n{self._output(r)}"
            return None

        self.conns = _accept_ranks(self._listener, self._key, "before", self.plan.nproc, STARTUP + self.plan.timeout, died)
        self._listener.close()
        infos = self._gather("ready", STARTUP + self.plan.timeout, "start-up")
        want = os.path.join(os.path.realpath(self.tree), "aiodist", "__init__.py")
        for r, info in enumerate(infos):
            if info["file"] != want:
                raise BenchError(f"before rank {r} imported aiodist from {info['file']}, not from {want}")
            if info["outside"]:
                raise BenchError(f"before rank {r} loaded aiodist modules from outside {self.tree}: {info['outside']}")
        self.info = infos[0]

    def stop(self) -> None:
        try:
            for c in self.conns:
                c.send(("stop",))
            self._gather("done", self.plan.timeout, "shut-down")
            for p in self.popens:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.popens:  # only our own processes, by handle
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL of our own child
                    pass
        for proc in self.procs:
            proc.close()
        self.procs = []
        if self._listener is not None:
            self._listener.close()
        for c in self.conns:
            c.close()
        for out in self._outs:
            out.close()
        self._outs = []


IDLE_PROBE_SECONDS = 0.5  # how long the probe runs alone before the sweep


def side_order(impls: Sequence[str], row: int, rnd: int) -> list[str]:
    """The order the sides run row ``row`` (its index in the round) in round ``rnd``: rotated by
    one from row to row, and again from round to round, so that over ``len(impls)`` rounds every
    row has had every side first. (Rotating by a count that runs on across rounds gave a row the
    same order in every round whenever the rows per round were a multiple of the sides: 76 rows
    and 2 sides for the default sweep to 64 MiB.)"""
    k = (row + rnd) % len(impls)
    return [*impls[k:], *impls[:k]]


def floors(nproc: int, sz: Sequence[int], iters: int) -> dict[int, float]:
    """The Python floor (aiodist.bench.floor) of each size of the sweep up to
    ``FLOOR_MAX_BYTES``: seconds per op of a bare shared-memory all_reduce with a Future and a
    deadline per op, at ``nproc`` ranks."""
    return {nbytes: _floor.measure(nproc, nbytes, iters) for nbytes in sz if nbytes <= _floor.FLOOR_MAX_BYTES}


def run(args: argparse.Namespace, sz: tuple[int, ...]) -> tuple[dict[str, Results], list[float] | None]:
    """Every side's rows, interleaved: for each row, each side in turn (the order rotating
    from row to row and from round to round: ``side_order``), so the machine's drift lands on
    all of them."""
    impls = ["aiodist", *args.impls]
    sides: dict[str, Side] = {}
    for i in impls:
        plan = Plan(i, args.nproc, _free_port(), args.timeout, lag_probe=i == "aiodist" and args.lag_probe, tree=args.before)
        sides[i] = MpiSide(plan, args.mpi[i]) if i in args.mpi else BeforeSide(plan) if i == "before" else Side(plan)
    out: dict[str, Results] = {i: {op: {} for op in args.op_list} for i in impls}
    try:
        for side in sides.values():
            side.start()
        for side in sides.values():
            side.wait_ready()
        if "before" in sides:
            info = sides["before"].info  # type: ignore[attr-defined]
            print(f"before: every rank imported {info['file']} (aiodist {info['version'] or 'version unknown'})", flush=True)
        idle = sides["aiodist"].idle_lags(IDLE_PROBE_SECONDS) if args.lag_probe else None
        rows = [(op, count) for op in args.op_list for count in _rows(op, sz, args.nproc)]
        # one untimed row of every side first: a side's first row paid for the others' start-up
        # (the MPI libraries' ranks were still settling: aiodist's first row measured 168 us
        # beside them against 28 us alone)
        for i in impls:
            sides[i].row(*rows[0], args.warmup, 1)
        for rnd in range(args.rounds):
            for j, (op, count) in enumerate(rows):
                for i in side_order(impls, j, rnd):
                    got = sides[i].row(op, count, args.warmup, args.iters)
                    if count in out[i][op]:
                        out[i][op][count].merge(got)
                    else:
                        out[i][op][count] = got
                if args.verbose:
                    print(f"  round {rnd + 1}: {op} {count * ITEMSIZE} B", flush=True)
        for side in sides.values():
            side.stop()
    finally:
        for side in sides.values():
            side.kill()
    return out, idle


def _fmt_us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e6:.1f}"


def _busbw(op: str, n: int, nbytes: int, t: float) -> float:
    return nbytes / t / 1e9 * _busbw_factor(op, n) if t > 0 else 0.0


def _lag_cell(lags: list[float] | None) -> str:
    """p50/p99/max of the probe's lags, in ms."""
    if not lags:
        return "-"
    return "/".join(f"{percentile(lags, q) * 1e3:.1f}" for q in (0.5, 0.99, 1.0))


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _times(results: dict[str, Results], impl: str, op: str, count: int) -> list[float] | None:
    r = results[impl].get(op, {}).get(count)
    return r.times if r is not None and r.times else None


#: a ratio is printed only from this many timed iterations of each side (``--iters`` times
#: ``--rounds``): from fewer, back-to-back runs of the same row gave ratios from 1.48 to 0.02
MIN_RATIO_SAMPLES = 10


def ratio_cell(mine: Sequence[float], theirs: Sequence[float]) -> str:
    """aiodist's median time over the other side's, and its spread: ``0.85(0.70-1.10)`` where the
    range is aiodist's first quartile over the other's third, to aiodist's third over the
    other's first (a range that spans 1 is no difference). ``n/a`` from fewer than
    ``MIN_RATIO_SAMPLES`` timed iterations on either side: too few to compare."""
    if len(mine) < MIN_RATIO_SAMPLES or len(theirs) < MIN_RATIO_SAMPLES:
        return "n/a"
    t, tm = statistics.median(mine), statistics.median(theirs)
    qa, qb = statistics.quantiles(mine, n=4), statistics.quantiles(theirs, n=4)
    if tm <= 0 or qb[0] <= 0 or qb[2] <= 0:
        return "-"
    return f"{t / tm:.2f}({qa[0] / qb[2]:.2f}-{qa[2] / qb[0]:.2f})"


def mpi_cells(mine: Sequence[float], times: dict[str, Sequence[float] | None]) -> list[str]:
    """A row's MPI columns: each library's time (us, median), then the best of them (the least
    median), which library that is, and the ratio of aiodist's times ``mine`` to it (``ratio_cell``)."""
    medians = {name: statistics.median(ts) if ts else None for name, ts in times.items()}
    cells = [_fmt_us(tm) for tm in medians.values()]
    top = _mpi.best(medians)
    if top is None:
        return cells + ["-", "-", "-"]
    name, tm = top
    return cells + [_fmt_us(tm), name, ratio_cell(mine, times[name] or [])]


def report(ops: Sequence[str], n: int, results: dict[str, Results], floor: dict[int, float] | None = None) -> str:
    """A table per op: aiodist's time, bandwidth, loop lag and extra memory; the Python floor of
    the row's size and aiodist's time over it (``floor``: seconds by size in bytes, the small
    rows only); then each other implementation's time and busbw with the ratio of aiodist's time
    to it, except the MPI libraries, which get a time column each and then the best of them
    (``mpi_cells``)."""
    mine = results["aiodist"]
    mpis = [i for i in results if i in _mpi.LIBS]
    others = [i for i in results if i != "aiodist" and i not in mpis]
    lag = any(r.lags is not None for rows in mine.values() for r in rows.values())
    blocks = []
    for op in ops:
        headers = ["size(B)", "count", "dtype", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]
        headers += ["lag p50/p99/max(ms)"] if lag else []
        headers += ["mem+(MiB)"]
        headers += ["floor(us)", "aiodist/floor"] if floor else []
        for i in others:
            headers += [f"{i}(us)", f"{i} busbw", f"aiodist/{i}"]
        if mpis:
            headers += [f"{i}(us)" for i in mpis] + ["best MPI(us)", "best MPI", "aiodist/best-MPI"]
        rows = []
        for count, r in mine[op].items():
            nbytes = count * ITEMSIZE
            t = statistics.median(r.times)
            alg = nbytes / t / 1e9 if t > 0 else 0.0
            row = [str(nbytes), str(count), "float32", _fmt_us(t), f"{alg:.3f}", f"{_busbw(op, n, nbytes, t):.3f}"]
            row += [_lag_cell(r.lags)] if lag else []
            row += [_mib(r.mem)]
            if floor:
                f = floor.get(nbytes)
                row += ["-", "-"] if f is None else [_fmt_us(f), f"{t / f:.2f}"]
            for i in others:
                ts = _times(results, i, op, count)
                if ts is not None:
                    tm = statistics.median(ts)
                    row += [_fmt_us(tm), f"{_busbw(op, n, nbytes, tm):.3f}", ratio_cell(r.times, ts)]
                else:
                    row += ["-", "-", "-"]
            if mpis:
                row += mpi_cells(r.times, {i: _times(results, i, op, count) for i in mpis})
            rows.append(row)
        blocks.append(f"# {op}\n{format_table(headers, rows)}")
    return "\n\n".join(blocks)


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def plot(path: str, ops: Sequence[str], n: int, results: dict[str, Results]) -> None:
    """Time against size, one panel per op (barrier has no size: left out) at ``n`` ranks, a
    line per implementation (aiodist, torch, each MPI library, before); log-log; written to
    ``path`` (its suffix picks the format: .png, .svg or .pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # an .svg keeps its text as text (searchable, selectable)
    import matplotlib.pyplot as plt

    shown = [op for op in ops if op != "barrier"]
    if not shown:
        raise BenchError("--plot: no op with a size among --ops (barrier has none)")
    cols = min(3, len(shown))
    nrows = -(-len(shown) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, shown):
        for impl, res in results.items():
            pts = sorted((c * ITEMSIZE, statistics.median(r.times) * 1e6) for c, r in res.get(op, {}).items() if r.times)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op}, {n} ranks")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("time (us, median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


COMPARE = ("torch", *_mpi.LIBS, "before")  # the sides, in their order; "mpi" is every MPI library
PLOT_SKIP = "matplotlib is not installed: pip install matplotlib (or pip install 'aiodist[plot]')"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench collectives",
        description="Collective time, algbw and busbw over a size sweep (float32), nccl-tests style; optionally against torch gloo "
        "and Open MPI, MPICH and Intel MPI in the same run.",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (spawned processes; default 2)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops (default all: {','.join(OPS)})")
    p.add_argument("--min-bytes", type=_size, default=4, help="smallest size, bytes; K/M/G suffixes (default 4)")
    p.add_argument("--max-bytes", type=_size, default=16 << 20, help="largest size (default 16M)")
    p.add_argument("--step", type=int, default=4, help="size factor between rows (default 4; 2 for a finer sweep)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size before the barrier (default 5)")
    p.add_argument(
        "--rounds", type=int, default=1, help="passes over the whole sweep; a row's time is the median over all of them (default 1)"
    )
    p.add_argument(
        "--compare",
        default="",
        help="comma-separated: torch (torch.distributed gloo); mpi (every MPI library found: openmpi, mpich, impi, each its own "
        "side, plus the best of them per row), or one or more of openmpi (mpirun on PATH, mpi4py in this Python), mpich "
        f"(the venv ${_mpi.VENV_VAR['mpich']}, default {_mpi.DEFAULT_VENV['mpich']}), impi (${_mpi.VENV_VAR['impi']}, default "
        f"{_mpi.DEFAULT_VENV['impi']}); a library not found is skipped with a line saying why and how to install it; "
        "before=PATH (an older aiodist checkout, e.g. git worktree add /tmp/aiodist-before COMMIT; its ranks import aiodist "
        "from PATH); all on the same plan, with ratio columns",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw time against size, a panel per op, a line per implementation (.png, .svg or .pdf; needs matplotlib: "
        "pip install matplotlib, or the 'plot' extra; without it the run says so and goes on)",
    )
    p.add_argument("--no-lag-probe", dest="lag_probe", action="store_false", help="do not run the loop-lag probe on aiodist's ranks")
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help=f"do not measure the Python floor (aiodist.bench.floor) of the rows up to {_floor.FLOOR_MAX_BYTES >> 10} KiB",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any op, or the wait for the next size, may take (default 120)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"for tests: 4 B to 64 KiB, step 16, 3 iterations, 1 warmup; too few iterations for ratios (they print n/a; a ratio needs {MIN_RATIO_SAMPLES})",
    )
    p.add_argument("--verbose", action="store_true", help="print progress per size")
    args = p.parse_args(argv)
    wanted = [c.strip() for c in args.compare.split(",") if c.strip()]
    trees = [c[len("before=") :] for c in wanted if c.startswith("before=") and len(c) > len("before=")]
    wanted = ["before" if c.startswith("before=") and len(c) > len("before=") else c for c in wanted]
    wanted = [x for c in wanted for x in (_mpi.LIBS if c == "mpi" else (c,))]
    bad = [c for c in wanted if c not in COMPARE or c == "before" and not trees]  # bare "before": it needs its PATH
    if bad:
        p.error(f"--compare: unknown {bad}; choose from torch, mpi, {', '.join(_mpi.LIBS)}, before=PATH")
    if len(trees) > 1:
        p.error("--compare: before=PATH given more than once")
    args.before = os.path.abspath(os.path.expanduser(trees[0])) if trees else None
    if args.before is not None:
        why = before_unavailable(args.before)
        if why:
            p.error(f"--compare before={trees[0]}: refused: {why}")
    if "torch" in wanted and importlib.util.find_spec("torch") is None:
        p.error("--compare torch: torch is not installed")
    args.skipped, args.mpi = {}, {}
    for name in _mpi.LIBS:
        if name in wanted:
            found = _mpi.find(name)
            if isinstance(found, str):
                args.skipped[name] = found
            else:
                args.mpi[name] = found
    args.impls = [c for c in COMPARE if c in wanted and c not in args.skipped]
    if args.plot and os.path.splitext(args.plot)[1].lower() not in PLOT_SUFFIXES:
        p.error(f"--plot: FILE must end in {', '.join(PLOT_SUFFIXES)}, got {args.plot!r}")
    args.plot_skipped = PLOT_SKIP if args.plot and importlib.util.find_spec("matplotlib") is None else None
    if args.quick:
        args.min_bytes, args.max_bytes, args.step, args.iters, args.warmup = 4, 64 << 10, 16, 3, 1
    args.op_list = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in args.op_list if o not in OPS]
    if bad or not args.op_list:
        p.error(f"--ops: unknown {bad}; choose from {', '.join(OPS)}")
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    if args.step < 2 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.timeout <= 0 or args.min_bytes > args.max_bytes:
        p.error("need --step >= 2, --iters >= 1, --rounds >= 1, --warmup >= 0, --timeout > 0, --min-bytes <= --max-bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    sz = tuple(sizes(args.min_bytes, args.max_bytes, args.step))
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    for lib in args.mpi.values():
        print(f"{lib.name}: {lib.library}, mpi4py {lib.mpi4py}, {lib.mpirun}", flush=True)
    print(
        f"ranks: {args.nproc}; dtype float32; sizes {sz[0]}..{sz[-1]} B x{args.step}; {args.warmup} warmup + {args.iters} timed iterations; "
        f"time = median over iterations of the slowest rank's time",
        flush=True,
    )
    for impl, why in args.skipped.items():
        print(f"{impl}: skipped: {why}", flush=True)
    if args.plot_skipped:
        print(f"plot: skipped: {args.plot_skipped}", flush=True)
    if args.before is not None:
        commit = tree_commit(args.before)
        print(f"before: {args.before}, commit {commit}", flush=True)
    try:
        results, idle = run(args, sz)
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    floor, floor_failed = None, None
    if args.floor:
        try:
            floor = floors(args.nproc, sz, 200 if args.quick else 3000)
        except OSError as exc:  # the sweep's rows stand without it
            floor_failed = str(exc)
    print()
    print(report(args.op_list, args.nproc, results, floor))
    notes = ["aiodist: the 'gloo' backend (aiodist's socket transport) on uvloop"]
    if args.lag_probe:
        notes.append(f"loop lag with no op running (this machine's floor), p50/p99/max over {IDLE_PROBE_SECONDS:g} s: {_lag_cell(idle)} ms")
        notes.append(
            "lag = how late a 1 ms sleep on aiodist's rank loops woke up during the timed iterations (p50/p99/max over every wake-up of every rank; "
            "uvloop's timers have 1 ms resolution)"
        )
    if floor_failed is not None:
        notes.append(f"floor: not measured: {floor_failed}")
    if floor:
        notes.append(
            "floor = the Python floor of the row's size at these ranks, measured in this run after the sweep (aiodist/bench/floor.py: "
            "forked processes exchanging through a shared mapping, with an asyncio Future and a deadline timer per op, spinning "
            "with sched_yield); aiodist/floor = aiodist's time over it: how much of the row is aiodist's own"
        )
    notes.append(
        "mem+ = aiodist's largest peak RSS growth of any rank over warmup and timed iterations (VmHWM reset after the buffers and checks)"
    )
    if "torch" in args.impls:
        notes.append("torch: torch.distributed gloo")
    for lib in args.mpi.values():
        notes.append(lib.describe(args.nproc))
    if args.mpi:
        notes.append(
            "best MPI = the least of the MPI libraries' times in the row (and which library); aiodist/best-MPI = aiodist's time over it"
        )
    if "before" in args.impls:
        notes.append(
            f"before: the aiodist in {args.before} (commit {commit}), its 'gloo' backend on uvloop, through its public API only "
            "(init_process_group, the collectives, barrier, destroy_process_group), same rows and checks (aiodist/bench/_before_rank.py)"
        )
    if args.impls:
        notes.append(
            "aiodist/X = ratio of the median times (below 1: aiodist faster), in brackets its spread: aiodist's first quartile over "
            "X's third to aiodist's third over X's first (a range that spans 1 is no difference); every ratio is from this one run"
        )
        if args.iters * args.rounds < MIN_RATIO_SAMPLES:
            notes.append(
                f"n/a: no ratio from {args.iters * args.rounds} timed iterations per row (--iters x --rounds; "
                f"{'--quick runs 3: ' if args.quick else ''}at least {MIN_RATIO_SAMPLES} are needed for a ratio that means anything)"
            )
    if args.plot and not args.plot_skipped:
        try:
            plot(args.plot, args.op_list, args.nproc, results)
        except BenchError as exc:
            print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
            return 1
        notes.append(f"plot: {args.plot}")
    print("\n" + "\n".join(notes) + f"\nwall time {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
