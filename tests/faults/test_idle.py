"""Idle connections against a running job of 2 env:// ranks (rank 0 on uvloop, hosting the store;
rank 1 on asyncio's loop), with ``AIODIST_HANDSHAKE_TIMEOUT=2``:

- 1,000 TCP connections that send nothing to each rank's transport listener (2,000 in all) are
  all closed by the ranks after the handshake deadline (each of our sockets sees EOF or RST),
  and each rank's RSS and fd count come back to their level before (within 8 MiB).
- 1,000 connections to the store server (500 silent, 500 that say VALIDATE and then nothing,
  as an idle torch or aiodist client does) are kept past that deadline: torch's TCPStore
  server keeps idle clients for good, since a client legitimately idles between calls. While
  they are open a fresh client is served; once we close them, the store host's fds and RSS
  come back.

The job runs a small all_reduce every 20 ms throughout, so the ranks are live while measured.
The figures (before / peak / after RSS, how long the closes took) are printed."""

from __future__ import annotations

import asyncio
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiodist import TCPStore
from aiodist.testing.ports import free_port
from aiodist.transport._address import PeerAddress
from aiodist.wire.store import MAGIC, Op, encode

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

N = 2
IDLE = 1000  # connections per listener
HANDSHAKE_S = 2.0  # the ranks' AIODIST_HANDSHAKE_TIMEOUT
BURST_S = 3.0  # the kernel completes a loopback handshake in microseconds; a dropped SYN is retried after 1 s, 3 s
CLOSED_BY_S = HANDSHAKE_S + 10.0  # every idle connection to a rank must be closed by then
RSS_MARGIN = 8 << 20  # RSS after, over RSS before
FDS_NEEDED = 2 * IDLE + 512  # in this process; the ranks raise their own limit
START_S = 40.0
EXIT_S = 30.0
MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "default_pg/"

WORKER = ROOT / "tests" / "helpers" / "idle_rank.py"  # a slow all_reduce loop, on the loop named in argv


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def n_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Peak:
    """The highest VmRSS and fd count of some pids, sampled every 10 ms in a thread."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.rss = {p: vm_rss(p) for p in pids}
        self.fds = {p: n_fds(p) for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for p in self.pids:
                try:
                    self.rss[p] = max(self.rss[p], vm_rss(p))
                    self.fds[p] = max(self.fds[p], n_fds(p))
                except OSError:  # the test failed and killed it
                    return

    def stop(self) -> tuple[dict[int, int], dict[int, int]]:
        self._stop.set()
        self._thread.join(5)
        return self.rss, self.fds


def burst(port: int, n: int, deadline: float, say: bytes = b"") -> list[socket.socket]:
    """Open ``n`` connections to ``port`` at once (non-blocking connects), wait until each has
    completed its TCP handshake, then send ``say`` on each. Run while the listening process is
    SIGSTOPped, this measures its accept queue: the kernel completes handshakes for a stopped
    process only while its queue has room (the listen backlog), and drops the SYNs beyond it."""
    socks: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sel.register(s, selectors.EVENT_WRITE)
        done = 0
        while done < n and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                c = key.fileobj
                assert isinstance(c, socket.socket)
                err = c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                assert err == 0, f"connect to port {port} failed: {os.strerror(err)}"
                sel.unregister(c)
                done += 1
        assert done == n, (
            f"only {done} of {n} connections to port {port} completed their TCP handshake while the listener's process was "
            f"stopped: its accept queue (listen backlog) is shorter than {n}"
        )
        for s in socks:
            if say:
                s.send(say)
    except BaseException:
        for s in socks:
            s.close()
        raise
    finally:
        sel.close()
    return socks


def wait_closed(socks: list[socket.socket], deadline: float) -> list[float]:
    """Wait until the peer has closed every socket (EOF or RST); when each was (monotonic).
    Fails with the count still open at ``deadline``."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    closed: list[float] = []
    try:
        while len(closed) < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                c = key.fileobj
                assert isinstance(c, socket.socket)
                try:
                    data = c.recv(4096)
                except ConnectionResetError:
                    data = b""
                except BlockingIOError:
                    continue
                assert data == b"", f"an idle connection got bytes from the rank: {data[:40]!r}"
                sel.unregister(c)
                closed.append(time.monotonic())
    finally:
        sel.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} of {len(socks)} idle connections still open"
    return closed


def still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the peer has not closed (no EOF, no RST, nothing to read)."""
    n = 0
    for s in socks:
        try:
            s.recv(1)
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


def settle(pids: list[int], fds_before: dict[int, int], deadline: float) -> None:
    """Until every pid's fd count is back to its level before (the closes are asynchronous)."""
    while any(n_fds(p) > fds_before[p] for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let the loop finish freeing what the closes released


async def fresh_client(port: int) -> float:
    t0 = time.monotonic()
    async with TCPStore("127.0.0.1", port, is_master=False, timeout=10) as s:
        await s.set("idle/fresh", b"served")
        assert await s.get("idle/fresh") == b"served"
    return time.monotonic() - t0


async def read_addresses(port: int) -> list[PeerAddress]:
    async with TCPStore("127.0.0.1", port, is_master=False, timeout=10) as s:
        return [PeerAddress.decode(await s.get(f"{PREFIX}aiodist/transport/{r}")) for r in range(N)]


@pytest.fixture
def fd_room() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= FDS_NEEDED:
        return
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"needs {FDS_NEEDED} fds, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))


def test_idle_connections_are_closed_by_ranks_and_kept_by_the_store(tmp_path: Path, fd_room: None) -> None:
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    errs = [tmp_path / f"rank{r}.err" for r in range(N)]
    socks: list[socket.socket] = []
    stopped = False
    try:
        for r in range(N):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(N))
            env["AIODIST_HANDSHAKE_TIMEOUT"] = str(HANDSHAKE_S)
            with open(errs[r], "w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), "uvloop" if r == 0 else "asyncio"],
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        deadline = time.monotonic() + START_S
        for p in procs:
            assert p.stdout is not None
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=max(0.0, deadline - time.monotonic()))
            sel.close()
            assert ready and p.stdout.readline() == "running\n", f"a rank did not start: {[e.read_text() for e in errs]}"
        pids = [p.pid for p in procs]
        addrs = asyncio.run(read_addresses(port))
        time.sleep(0.5)  # past the first ops' allocations

        # -- the transport listeners: closed after the handshake deadline ------------------
        rss0 = {p: vm_rss(p) for p in pids}
        fds0 = {p: n_fds(p) for p in pids}
        peak = Peak(pids)
        for p in procs:  # a burst at two stopped ranks: every connection must wait in their accept queues
            p.send_signal(signal.SIGSTOP)
        stopped = True
        t_burst = time.monotonic()
        for a in addrs:
            socks += burst(a.port, IDLE, time.monotonic() + BURST_S)
        burst_s = time.monotonic() - t_burst
        for p in procs:
            p.send_signal(signal.SIGCONT)
        stopped = False
        t0 = time.monotonic()  # the ranks accept from now on: their deadlines start
        closed = wait_closed(socks, t0 + CLOSED_BY_S)
        for s in socks:
            s.close()
        socks.clear()
        settle(pids, fds0, time.monotonic() + 10)
        rss_peak, fds_peak = peak.stop()
        rss1 = {p: vm_rss(p) for p in pids}
        fds1 = {p: n_fds(p) for p in pids}
        first, last = min(closed) - t0, max(closed) - t0

        # -- the store: idle clients are kept; a new one is served; closing gives memory back --
        host = pids[0]
        srss0, sfds0 = vm_rss(host), n_fds(host)
        speak = Peak([host])
        procs[0].send_signal(signal.SIGSTOP)
        stopped = True
        t_burst = time.monotonic()
        socks += burst(port, IDLE // 2, time.monotonic() + BURST_S)
        socks += burst(port, IDLE - IDLE // 2, time.monotonic() + BURST_S, say=encode(Op.VALIDATE, number=MAGIC))
        sburst_s = time.monotonic() - t_burst
        procs[0].send_signal(signal.SIGCONT)
        stopped = False
        t1 = time.monotonic()
        served_s = asyncio.run(fresh_client(port))  # while they are open
        time.sleep(max(0.0, t1 + HANDSHAKE_S + 0.5 - time.monotonic()))  # past the ranks' handshake deadline
        kept = still_open(socks)
        for s in socks:
            s.close()
        socks.clear()
        settle([host], {host: sfds0}, time.monotonic() + 10)
        srss_peak, sfds_peak = (d[host] for d in speak.stop())
        srss1, sfds1 = vm_rss(host), n_fds(host)
        served_after_s = asyncio.run(fresh_client(port))

        stdin = procs[0].stdin  # rank 0 reads it and tells the other
        assert stdin is not None
        stdin.write("stop\n")
        stdin.flush()
        outs = [p.communicate(timeout=EXIT_S)[0] for p in procs]
    finally:
        for s in socks:
            s.close()
        for p in procs:
            if stopped and p.poll() is None:
                p.send_signal(signal.SIGCONT)
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    stderr = [e.read_text() for e in errs]
    assert [p.returncode for p in procs] == [0] * N, (outs, stderr)
    assert all("done " in o and "WRONG" not in o for o in outs), outs
    for r, text in enumerate(stderr):
        above = [line for line in text.splitlines() if not line.startswith(("LOG WARNING ", "LOG INFO ", "LOG DEBUG "))]
        assert not above, f"rank {r}'s stderr has more than warnings: {above}"

    def mib(n: int) -> str:
        return f"{n / MIB:.1f}"

    for r, pid in enumerate(pids):
        print(
            f"rank {r} transport, {IDLE} idle connections: RSS before {mib(rss0[pid])} MiB, peak {mib(rss_peak[pid])} "
            f"(+{mib(rss_peak[pid] - rss0[pid])}), after {mib(rss1[pid])} (+{mib(rss1[pid] - rss0[pid])}); fds {fds0[pid]} -> {fds_peak[pid]} -> {fds1[pid]}"
        )
    print(
        f"  {len(addrs) * IDLE} connected to the stopped ranks in {burst_s:.2f} s; closed by the ranks {first:.2f}-{last:.2f} s "
        f"after they were continued (deadline {HANDSHAKE_S:g} s)"
    )
    print(
        f"store, {IDLE} idle clients (connected to the stopped host in {sburst_s:.2f} s): {kept} still open {HANDSHAKE_S + 0.5:g} s on; "
        f"a fresh client served in {served_s:.3f} s (after: {served_after_s:.3f} s); RSS before {mib(srss0)} MiB, peak {mib(srss_peak)} "
        f"(+{mib(srss_peak - srss0)}), after {mib(srss1)} (+{mib(srss1 - srss0)}); fds {sfds0} -> {sfds_peak} -> {sfds1}"
    )
    for pid in pids:
        assert fds_peak[pid] >= fds0[pid] + IDLE, "the ranks did not accept every idle connection"
        assert fds1[pid] <= fds0[pid], (fds0, fds1)
        assert rss1[pid] - rss0[pid] <= RSS_MARGIN, f"rank RSS did not come back: {mib(rss0[pid])} -> {mib(rss1[pid])} MiB"
    assert first >= HANDSHAKE_S * 0.9, f"an idle connection was closed {first:.2f} s after the rank could accept it, before the deadline"
    assert kept == IDLE, f"the store dropped {IDLE - kept} idle clients"
    assert sfds_peak >= sfds0 + IDLE
    assert sfds1 <= sfds0
    assert srss1 - srss0 <= RSS_MARGIN, f"the store host's RSS did not come back: {mib(srss0)} -> {mib(srss1)} MiB"
