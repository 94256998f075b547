"""``python -m aiodist.bench store``: TCPStore throughput, aiodist against torch, in one run.

What it runs, per implementation (torch only when ``import torch.distributed`` works):
- a fresh server in its own process (aiodist: ``python -m aiodist.store --port 0``; torch: a
  master ``TCPStore`` in a small script), killed through its Popen at the end;
- for each client count C: C client processes, each doing N ``set`` (10 keys in turn, a small
  value), N ``get`` (one existing key) and N ``add`` (one counter shared by all clients).

Variants: ``torch`` (its client is synchronous: one op in flight), ``aiodist-seq`` (one op in
flight: ``await store.get(k)`` in a loop) and ``aiodist-pipelined`` (one store shared by
``--tasks`` tasks, whose requests aiodist pipelines on one connection). aiodist clients run
on uvloop.

How it is timed: the clients of one phase wait on a barrier, then each times its loop with
``time.perf_counter`` (CLOCK_MONOTONIC on Linux, so comparable across processes). A phase
ends with one ``check`` round trip, so the time covers the server applying every op: torch's
``set`` has no reply and would otherwise be timed as fast as the client can write.
Aggregate ops/s = C*N / (latest end - earliest start); latency = a client's time / N.

Correctness: the shared counter must end at C*N and every ``get`` must return the value
set; anything else aborts the run with a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from multiprocessing.context import SpawnProcess
from typing import IO, Any, TypeVar

from aiodist.bench import format_table, machine_info

__all__ = ["main"]

HOST = "127.0.0.1"
OPS = ("set", "get", "add")
NKEYS = 10
VALUE = b"v" * 16
WARMUP = 100  # ops of each kind before the barrier: connections open, code paths warm

T = TypeVar("T")


class BenchError(Exception):
    """The benchmark could not run, or a result was wrong."""


# ----------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Job:
    """What every client of one run does. Sent to the worker processes over a pipe."""

    impl: str  # "torch" | "aiodist"
    tasks: int  # concurrent tasks per client; 1 is sequential (torch is always 1)
    port: int
    clients: int
    ops: int  # per client, per kind of op
    prefix: str  # keys of this run, so runs never see each other's data
    timeout: float
    kinds: tuple[str, ...] = OPS  # the kinds of op timed, in OPS order
    cpus: tuple[int, ...] = ()  # client i runs on CPU cpus[i]; () wherever the scheduler puts it (PLACEMENTS)

    def cpu(self, index: int) -> int | None:
        return self.cpus[index] if self.cpus else None

    @property
    def variant(self) -> str:
        return "torch" if self.impl == "torch" else f"aiodist-{'seq' if self.tasks == 1 else 'pipelined'}"


# Where the server and the clients run. A round trip between two processes that share a CPU is
# a context switch; between two CPUs it is a wake-up from idle, which costs tens of
# microseconds in a VM. The scheduler picks either, run by run ("os"), so one-op-at-a-time
# rates of both implementations jump between two levels; "same" and "split" pin them (every
# thread of the server, and each client) to one CPU or to different ones, for both alike.
PLACEMENTS = ("os", "same", "split")


def _placed(placement: str, clients: int) -> tuple[int | None, tuple[int, ...]]:
    """The server's CPU (None: anywhere) and each client's (empty: anywhere) under ``placement``."""
    if placement == "os":
        return None, ()
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "same" or len(cpus) == 1:
        return cpus[0], (cpus[0],) * clients
    return cpus[0], tuple(cpus[1 + i % (len(cpus) - 1)] for i in range(clients))


def _pin_process(pid: int, cpu: int | None, allowed: set[int]) -> None:
    """Every thread of ``pid`` on ``cpu`` (None: back on ``allowed``)."""
    where = allowed if cpu is None else {cpu}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), where)
        except ProcessLookupError:  # a thread that just ended
            pass


@dataclass(frozen=True)
class Phase:
    """One client's timed loop of one kind of op."""

    start: float  # time.perf_counter()
    end: float
    cpu: float  # this client process's CPU seconds (user + system) over the loop
    seen: int  # what the loop returns (see below), checked by the coordinator


def _split(n: int, parts: int) -> list[int]:
    """``n`` ops as ``parts`` near-equal chunks."""
    q, r = divmod(n, parts)
    return [q + (i < r) for i in range(parts)]


# Each loop returns one int checked by the coordinator:
# set -> 0; get -> how many values differed from VALUE; add -> the largest counter value seen.


def _torch_ops(store: Any, op: str, count: int, keys: list[str], counter: str) -> int:
    if op == "set":
        for i in range(count):
            store.set(keys[i % NKEYS], VALUE)
        return 0
    if op == "get":
        bad = 0
        for _ in range(count):
            if store.get(keys[0]) != VALUE:
                bad += 1
        return bad
    top = 0
    for _ in range(count):
        v = store.add(counter, 1)
        if v > top:
            top = v
    return top


async def _aiodist_ops(store: Any, op: str, count: int, keys: list[str], counter: str) -> int:
    if op == "set":
        for i in range(count):
            await store.set(keys[i % NKEYS], VALUE)
        return 0
    if op == "get":
        bad = 0
        for _ in range(count):
            if await store.get(keys[0]) != VALUE:
                bad += 1
        return bad
    top = 0
    for _ in range(count):
        v = await store.add(counter, 1)
        if v > top:
            top = v
    return top


async def _aiodist_phase(store: Any, op: str, count: int, tasks: int, keys: list[str], counter: str) -> int:
    if tasks == 1:
        return await _aiodist_ops(store, op, count, keys, counter)
    got = await asyncio.gather(*(_aiodist_ops(store, op, c, keys, counter) for c in _split(count, tasks)))
    return max(got) if op == "add" else sum(got)


def _keys(job: Job) -> tuple[list[str], str, str]:
    return [f"{job.prefix}/k{i}" for i in range(NKEYS)], f"{job.prefix}/counter", f"{job.prefix}/warm"


def _torch_job(job: Job, index: int, barrier: Any) -> dict[str, Any]:
    from torch.distributed import TCPStore

    keys, counter, warm = _keys(job)
    store = TCPStore(HOST, job.port, None, False, timedelta(seconds=job.timeout))
    phases: dict[str, Phase] = {}
    if "set" not in job.kinds:
        _torch_ops(store, "set", 1, keys, warm)  # keys[0]: what the gets read
    for op in job.kinds:
        # warm-up adds go to their own key: the shared counter must count timed adds only
        _torch_ops(store, op, min(WARMUP, job.ops), keys, warm)
        barrier.wait(job.timeout)
        t0, c0 = time.perf_counter(), time.process_time()
        seen = _torch_ops(store, op, job.ops, keys, counter)
        store.check([keys[0]])  # one round trip: the server has applied every op above
        t1, c1 = time.perf_counter(), time.process_time()
        phases[op] = Phase(t0, t1, c1 - c0, seen)
    barrier.wait(job.timeout)  # every client's adds are in
    final = store.add(counter, 0) if index == 0 else None
    return {"phases": phases, "counter": final, "transport": "tcp"}


async def _aiodist_job(job: Job, index: int, barrier: Any) -> dict[str, Any]:
    import aiodist

    keys, counter, warm = _keys(job)
    store = await aiodist.TCPStore(HOST, job.port, timeout=job.timeout)
    transport = _transport_of(store)
    phases: dict[str, Phase] = {}
    try:
        if "set" not in job.kinds:
            await _aiodist_ops(store, "set", 1, keys, warm)  # keys[0]: what the gets read
        for op in job.kinds:
            await _aiodist_phase(store, op, min(WARMUP, job.ops), job.tasks, keys, warm)
            # Blocking the loop here is deliberate: nothing else runs on it, and an
            # asyncio.to_thread hop would add a thread switch between release and start.
            barrier.wait(job.timeout)
            t0, c0 = time.perf_counter(), time.process_time()
            seen = await _aiodist_phase(store, op, job.ops, job.tasks, keys, counter)
            await store.check([keys[0]])
            t1, c1 = time.perf_counter(), time.process_time()
            phases[op] = Phase(t0, t1, c1 - c0, seen)
        barrier.wait(job.timeout)
        final = await store.add(counter, 0) if index == 0 else None
    finally:
        await store.close()
    return {"phases": phases, "counter": final, "transport": transport}


def _transport_of(store: Any) -> str:
    """How the store reached its server ("unix" or "tcp"), for the report. TCPStore does not
    publish it, so it is read from a private attribute; "unknown" if that ever changes."""
    try:
        family = store._main.transport.get_extra_info("socket").family
    except Exception:
        return "unknown"
    return "unix" if family == socket.AF_UNIX else "tcp"


def _run_on_uvloop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())
    return uvloop.run(main())


def _torch_check() -> str | None:
    """None when torch.distributed can run a TCPStore here, else why not."""
    try:
        import torch.distributed as dist
    except Exception as exc:  # torch missing, or broken: either way, skip it
        return f"import torch.distributed failed: {exc!r}"
    if not dist.is_available():
        return "torch.distributed.is_available() is False"
    return None


def _worker_main(index: int, conn: multiprocessing.connection.Connection, barriers: dict[int, Any]) -> None:
    """A client process: reports whether torch works, then runs jobs until sent None (or
    until the coordinator's end of the pipe closes)."""
    # Ctrl-C reaches the whole process group; the coordinator stops its workers itself, so a
    # worker ignores it rather than dying mid-message with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Importing torch here, once, keeps its seconds of import time out of every job.
    conn.send(("hello", _torch_check()))
    allowed = os.sched_getaffinity(0)
    while True:
        try:
            job: Job | None = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        barrier = barriers[job.clients]
        try:
            _pin_process(os.getpid(), job.cpu(index), allowed)
            if job.impl == "torch":
                result = _torch_job(job, index, barrier)
            else:
                result = _run_on_uvloop(functools.partial(_aiodist_job, job, index, barrier))
            reply: tuple[str, Any] = ("ok", result)
        except Exception:
            barrier.abort()  # the other clients fail at once instead of waiting out the timeout
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:  # the coordinator is gone
            return


# ----------------------------------------------------------------------------- processes


@dataclass
class Server:
    """A store server process of one implementation."""

    impl: str
    proc: subprocess.Popen[bytes]
    port: int
    log: IO[bytes]
    stderr: str = ""

    def stop(self) -> None:
        """Terminate by the Popen (never by name); kill if it does not exit in time.
        Keeps what it wrote to stderr in ``.stderr``."""
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.seek(0)
        self.stderr = self.log.read().decode(errors="replace")[-4000:]
        self.log.close()


# The torch server: a master TCPStore (its server runs on a native thread) that prints its
# port, then waits for EOF on stdin: terminated by the coordinator, or gone with it if the
# coordinator dies. It ignores Ctrl-C so that its clients are stopped before it is.
_TORCH_SERVER = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
signal.signal(signal.SIGINT, signal.SIG_IGN)
store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
print(f"torch TCPStore server listening on 127.0.0.1:{store.port}", flush=True)
sys.stdin.read()
"""


def start_server(impl: str, timeout: float, tcp_only: bool = False) -> Server:
    if impl == "aiodist":
        # As deployed: on every interface, which also gives same-host clients its Unix socket.
        # Bound to one address it has no Unix socket, so its clients use TCP as torch's do.
        where = ["--host", HOST] if tcp_only else []
        argv = [sys.executable, "-m", "aiodist.store", *where, "--port", "0", "--log-level", "WARNING"]
    else:
        argv = [sys.executable, "-c", _TORCH_SERVER]
    log = tempfile.TemporaryFile()
    stdin = subprocess.PIPE if impl == "torch" else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=stdin)
    server = Server(impl, proc, 0, log)
    try:
        line = _read_line(proc, time.monotonic() + timeout)
        m = re.search(r"listening on \S*:(\d+)\s*$", line)
        if m is None:
            raise BenchError(f"{impl} server printed {line!r}, expected '... listening on HOST:PORT'")
        server.port = int(m.group(1))
    except BenchError as exc:
        server.stop()
        raise BenchError(f"{exc}\n--- {impl} server stderr ---\n{server.stderr}") from None
    except BaseException:
        server.stop()
        raise
    return server


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    """The first line ``proc`` prints, or BenchError when it exits or ``deadline`` passes."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"server did not print its port in time (got {buf!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise BenchError(f"server exited with {proc.wait(5)} before printing its port")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


@dataclass
class Workers:
    """The client processes, started once and reused by every run (spawning processes that
    import torch costs seconds each on a small machine)."""

    procs: list[SpawnProcess]
    conns: list[multiprocessing.connection.Connection]
    torch_problem: str | None = None

    @classmethod
    def start(cls, count: int, client_counts: Sequence[int], timeout: float) -> Workers:
        ctx = multiprocessing.get_context("spawn")
        # One barrier per client count: a run of C clients synchronises the first C workers.
        barriers = {c: ctx.Barrier(c) for c in client_counts}
        procs: list[SpawnProcess] = []
        conns: list[multiprocessing.connection.Connection] = []
        workers = cls(procs, conns)
        try:
            for i in range(count):
                here, there = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(i, there, barriers), name=f"bench-client-{i}", daemon=True)
                p.start()
                there.close()
                procs.append(p)
                conns.append(here)
            problems = [workers._recv(i, time.monotonic() + timeout, "start")[1] for i in range(count)]
        except BaseException:
            workers.stop()
            raise
        workers.torch_problem = next((p for p in problems if p), None)
        return workers

    def _recv(self, i: int, deadline: float, what: str) -> tuple[str, Any]:
        conn, proc = self.conns[i], self.procs[i]
        while not conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            if not proc.is_alive():
                raise BenchError(f"client {i} died (exit code {proc.exitcode}) during {what}")
            if time.monotonic() >= deadline:
                raise BenchError(f"client {i}: no answer within the timeout during {what}")
        try:
            return conn.recv()
        except EOFError:
            raise BenchError(f"client {i} closed its pipe during {what}") from None

    def run(self, job: Job) -> list[dict[str, Any]]:
        """Every one of the first ``job.clients`` workers runs ``job``; their results."""
        what = f"{job.variant} with {job.clients} client(s)"
        for conn in self.conns[: job.clients]:
            conn.send(job)
        # The clients time out their own ops and barriers; this is the backstop for a client
        # stuck anywhere else. A run is 3 phases plus warm-ups: a few timeouts' worth.
        deadline = time.monotonic() + 4 * job.timeout
        replies = [self._recv(i, deadline, what) for i in range(job.clients)]
        errors = [f"client {i}:\n{body}" for i, (kind, body) in enumerate(replies) if kind != "ok"]
        if errors:
            raise BenchError(f"{what} failed:\n" + "\n".join(errors))
        return [body for _, body in replies]

    def stop(self, now: bool = False) -> None:
        """Ask each worker to exit, or with ``now`` terminate it at once (mid-job); either way
        by its own Process object. Safe to call twice."""
        for conn, p in zip(self.conns, self.procs):
            if now and p.is_alive():
                p.terminate()
            elif not conn.closed:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for conn in self.conns:
            conn.close()


# ----------------------------------------------------------------------------- results


@dataclass
class Sample:
    """One phase of one run: ``op`` by ``clients`` clients of ``variant``, in round ``round``."""

    variant: str
    op: str
    clients: int
    ops_per_client: int
    round: int
    transport: str = ""  # how the clients reached the server: "tcp", "unix"
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)  # each client's CPU seconds

    @property
    def ops_per_s(self) -> float:
        return self.clients * self.ops_per_client / (max(self.ends) - min(self.starts))

    @property
    def mean_latency_us(self) -> float:
        times = [e - s for s, e in zip(self.starts, self.ends)]
        return sum(times) / len(times) / self.ops_per_client * 1e6

    @property
    def client_cpu_us(self) -> float:
        """CPU a client spends per op. Unlike wall time it barely depends on how soon the
        scheduler wakes a process blocked on a reply, so it is the steadier measure of cost."""
        return sum(self.cpus) / len(self.cpus) / self.ops_per_client * 1e6


def collect(job: Job, rnd: int, results: list[dict[str, Any]]) -> list[Sample]:
    """The samples of one run, after checking what the clients saw."""
    total = job.clients * job.ops
    samples = []
    for op in job.kinds:
        s = Sample(job.variant, op, job.clients, job.ops, rnd, "/".join(sorted({r["transport"] for r in results})))
        for r in results:
            ph: Phase = r["phases"][op]
            s.starts.append(ph.start)
            s.ends.append(ph.end)
            s.cpus.append(ph.cpu)
        samples.append(s)
    where = f"{job.variant}, {job.clients} client(s)"
    wrong_gets = sum(r["phases"]["get"].seen for r in results) if "get" in job.kinds else 0
    if wrong_gets:
        raise BenchError(f"CORRECTNESS: {where}: {wrong_gets} get(s) returned something other than the value set")
    counter = results[0]["counter"]
    top = max(r["phases"]["add"].seen for r in results) if "add" in job.kinds else 0
    if "add" in job.kinds and (counter != total or top != total):
        raise BenchError(
            f"CORRECTNESS: {where}: the shared counter reads {counter} (largest add() result {top}), "
            f"expected {total} = {job.clients} clients x {job.ops} adds"
        )
    return samples


VARIANTS = ("torch", "aiodist-seq", "aiodist-pipelined")

# (op, clients, least ratio to torch, wording) -- the targets.
TARGETS = (
    ("get", 1, 2.0, "get, 1 client"),
    ("add", 1, 1.0, "add, 1 client"),
    ("add", 4, 0.8, "add, 4 clients aggregate"),
)


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def report(
    samples: list[Sample], client_counts: Sequence[int], have_torch: bool, kinds: Sequence[str] = OPS
) -> tuple[str, list[dict[str, Any]]]:
    """The table and target lines as text, and the targets as data. Each number is the
    median over the rounds."""
    rounds: dict[tuple[str, str, int], list[Sample]] = {}
    for s in samples:
        rounds.setdefault((s.variant, s.op, s.clients), []).append(s)

    def median(v: str, op: str, c: int, measure: Callable[[Sample], float]) -> float | None:
        ss = rounds.get((v, op, c))
        return None if ss is None else statistics.median(measure(s) for s in ss)

    def rate(v: str, op: str, c: int) -> float | None:
        return median(v, op, c, lambda s: s.ops_per_s)

    def ratio(v: str, op: str, c: int) -> float | None:
        a, t = rate(v, op, c), rate("torch", op, c)
        return None if a is None or t is None else a / t

    def us(v: str, op: str, c: int, measure: Callable[[Sample], float]) -> str:
        x = median(v, op, c, measure)
        return "-" if x is None else f"{x:.1f}"

    def ratio_range(v: str, op: str, c: int) -> str:
        """min-max over rounds of (this round's v) / (this round's torch)."""
        mine = {s.round: s.ops_per_s for s in rounds.get((v, op, c), [])}
        theirs = {s.round: s.ops_per_s for s in rounds.get(("torch", op, c), [])}
        rs = [mine[r] / theirs[r] for r in mine.keys() & theirs.keys()]
        return "-" if not rs else f"{min(rs):.2f}-{max(rs):.2f}x"

    def latency(s: Sample) -> float:
        return s.mean_latency_us

    def cpu(s: Sample) -> float:
        return s.client_cpu_us

    headers = ["op", "clients", "torch ops/s", "aio seq ops/s", "aio pipe ops/s", "seq/torch", "pipe/torch", "torch us", "aio seq us"]
    rows = [
        [
            op,
            str(c),
            _fmt_rate(rate("torch", op, c)),
            _fmt_rate(rate("aiodist-seq", op, c)),
            _fmt_rate(rate("aiodist-pipelined", op, c)),
            _fmt_ratio(ratio("aiodist-seq", op, c)),
            _fmt_ratio(ratio("aiodist-pipelined", op, c)),
            us("torch", op, c, latency),
            us("aiodist-seq", op, c, latency),
        ]
        for op in kinds
        for c in client_counts
    ]
    # The noise view: per-round ratios, and client CPU per op (steadier than wall time).
    noise_headers = ["op", "clients", "seq/torch range", "pipe/torch range", "torch cpu us", "aio seq cpu us", "aio pipe cpu us"]
    noise_rows = [
        [
            op,
            str(c),
            ratio_range("aiodist-seq", op, c),
            ratio_range("aiodist-pipelined", op, c),
            us("torch", op, c, cpu),
            us("aiodist-seq", op, c, cpu),
            us("aiodist-pipelined", op, c, cpu),
        ]
        for op in kinds
        for c in client_counts
    ]
    nrounds = len({s.round for s in samples})
    transports = {v: "/".join(sorted({s.transport for s in samples if s.variant == v})) for v in VARIANTS}
    lines = [
        "client transport: " + ", ".join(f"{v} {t}" for v, t in transports.items() if t),
        "",
        format_table(headers, rows),
        "",
        f"median of {nrounds} round(s); us = mean latency per op of one client (sequential variants);",
        *(["torch's set has no reply: its loop is timed up to a check() round trip after the last set."] if "set" in kinds else []),
        "",
        format_table(noise_headers, noise_rows),
        "",
        "range = lowest and highest ratio over the rounds; cpu us = one client process's CPU per op (median).",
    ]
    lines += ["", "targets (the issue's, measured on aiodist-seq; aiodist-pipelined stated alongside):"]
    targets = []
    for op, c, least, wording in TARGETS:
        if op not in kinds:
            continue
        for variant in ("aiodist-seq", "aiodist-pipelined"):
            r = ratio(variant, op, c)
            mode = variant.removeprefix("aiodist-")
            if r is None:
                why = "torch not available" if not have_torch else f"no run with {c} client(s)"
                verdict, shown = "n/a ", f"({why})"
            else:
                verdict, shown = ("PASS" if r >= least else "MISS"), f"{r:.2f}x torch"
            lines.append(f"  {verdict}  {mode:<9}  {wording:<26} target >= {least:.1f}x   {shown}")
            targets.append(
                {"op": op, "clients": c, "variant": variant, "target": least, "ratio": r, "pass": None if r is None else r >= least}
            )
    return "\n".join(lines), targets


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench store",
        description="TCPStore set/get/add throughput: aiodist (sequential and pipelined) against torch, in one run.",
    )
    p.add_argument(
        "--ops",
        default="3000",
        help="ops of each kind per client (default 3000), or which kinds to time: a comma-separated subset of set,get,add "
        "(default all; the count is then --count)",
    )
    p.add_argument("--count", type=int, default=None, help="ops of each kind per client, when --ops names kinds (default 3000)")
    p.add_argument("--clients", default="1,4", help="client process counts, comma-separated (default 1,4)")
    p.add_argument("--tasks", type=int, default=32, help="concurrent tasks per client in aiodist-pipelined (default 32)")
    p.add_argument("--repeat", type=int, default=5, help="rounds; the table shows medians (default 5)")
    p.add_argument(
        "--tcp-only",
        action="store_true",
        help="bind the aiodist server to 127.0.0.1 only, so its clients use TCP like torch's rather than its same-host Unix socket",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="os",
        help="where the server and clients run: os = wherever the scheduler puts them (default); same = all on one CPU; "
        "split = the server on one CPU, the clients on the others (a round trip is then a wake-up from idle)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any one store op or barrier may wait before the run fails; one run of all clients gets 4x this (default 60)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the raw numbers to FILE")
    args = p.parse_args(argv)
    if args.ops.strip().isdigit():
        args.kinds, args.ops = OPS, int(args.ops)
    else:
        asked = {k.strip() for k in args.ops.split(",") if k.strip()}
        if not asked or asked - set(OPS):
            p.error(f"--ops must be a count or a comma-separated subset of {','.join(OPS)}, got {args.ops!r}")
        args.kinds, args.ops = tuple(k for k in OPS if k in asked), 3000
    if args.count is not None:
        args.ops = args.count
    try:
        args.client_counts = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    except ValueError:
        p.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    if not args.client_counts or min(args.client_counts) < 1:
        p.error("--clients needs at least one count, each >= 1")
    if args.ops < 1 or args.tasks < 1 or args.repeat < 1 or args.timeout <= 0:
        p.error("--ops, --tasks and --repeat must be >= 1, --timeout > 0")
    return args


def _run(args: argparse.Namespace) -> dict[str, Any]:
    counts: list[int] = args.client_counts
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    print(
        f"kinds: {','.join(args.kinds)}; ops per client per kind: {args.ops}; clients: {counts}; "
        f"pipelined tasks: {args.tasks}; rounds: {args.repeat}; placement: {args.placement}",
        flush=True,
    )

    started = time.monotonic()
    workers = Workers.start(max(counts), counts, timeout=max(120.0, args.timeout))
    samples: list[Sample] = []
    try:
        impls = ["aiodist"]
        if workers.torch_problem is None:
            impls.insert(0, "torch")
        else:
            print(f"note: skipping torch: {workers.torch_problem}", flush=True)
        # Rounds interleave the implementations, and alternate which goes first, so that the
        # machine's drift (other tenants, CPU frequency) lands on both rather than on one.
        for rnd in range(args.repeat):
            for impl in impls if rnd % 2 == 0 else impls[::-1]:
                server = start_server(impl, timeout=max(60.0, args.timeout), tcp_only=args.tcp_only)
                try:
                    _pin_process(server.proc.pid, _placed(args.placement, 1)[0], os.sched_getaffinity(0))
                    for c in counts:
                        for tasks in [1] if impl == "torch" else [1, args.tasks]:
                            job = Job(
                                impl,
                                tasks,
                                server.port,
                                c,
                                args.ops,
                                f"bench/{impl}/t{tasks}/c{c}",
                                args.timeout,
                                args.kinds,
                                _placed(args.placement, c)[1],
                            )
                            t = time.monotonic()
                            samples += collect(job, rnd, workers.run(job))
                            print(f"  round {rnd + 1}: {job.variant:<18} clients={c}  ({time.monotonic() - t:.1f} s)", flush=True)
                            if server.proc.poll() is not None:
                                server.stop()
                                raise BenchError(f"{impl} server exited with {server.proc.returncode}:\n{server.stderr}")
                except BaseException:
                    workers.stop(now=True)  # clients first: none should see its server vanish
                    raise
                finally:
                    server.stop()
    finally:
        workers.stop()

    text, targets = report(samples, counts, workers.torch_problem is None, args.kinds)
    print(f"\n{text}\n\nwall time {time.monotonic() - started:.1f} s", flush=True)
    return {
        "machine": info,
        "args": {
            "ops": args.ops,
            "kinds": list(args.kinds),
            "clients": counts,
            "tasks": args.tasks,
            "repeat": args.repeat,
            "tcp_only": args.tcp_only,
            "placement": args.placement,
        },
        "torch_skipped": workers.torch_problem,
        "samples": [
            {**asdict(s), "ops_per_s": s.ops_per_s, "mean_latency_us": s.mean_latency_us, "client_cpu_us": s.client_cpu_us} for s in samples
        ],
        "targets": targets,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        raw = _run(args)
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # servers and clients were stopped on the way out
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
        print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
