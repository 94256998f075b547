"""The launcher under faults: killed or stopped while its workers run (no process of the job may
outlive it, even workers that ignore SIGTERM), and a console nobody reads (the agent's loop
must go on). Real launchers; every process started here is killed in a ``finally`` by the pids
recorded (and the members of the workers' process groups)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[1]

WORKER = ROOT / "tests" / "helpers" / "sigterm_worker.py"  # writes its pid(s) to <dir>/<RANK>, then waits to be killed


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(tmp: Path, mode: str, stdout: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "2", str(WORKER), mode, str(tmp)]
    return subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=stdout, stderr=subprocess.PIPE)


def _wait_pids(tmp: Path, p: subprocess.Popen[bytes], n: int = 2, timeout: float = 20.0) -> list[int]:
    """The workers' pids (first of each line: the worker, which leads its process group)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [tmp / str(r) for r in range(n)]
        if all(f.exists() for f in files):
            return [int(x) for f in files for x in f.read_text().split()]
        if p.poll() is not None:
            break
        time.sleep(0.05)
    pytest.fail(f"workers did not start (launcher rc {p.poll()}): {p.stderr.read().decode() if p.poll() is not None and p.stderr else ''}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] != "Z"  # a zombie is dead for our purposes
    except OSError:
        return False


def _job(groups: set[int]) -> list[int]:
    """Live processes in these process groups (workers, their children, their watchdogs)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[-1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out.append(int(entry))
    return out


def _survivors(pids: list[int], groups: set[int]) -> list[int]:
    return sorted({p for p in pids if _alive(p)} | set(_job(groups)))


def _gone_within(pids: list[int], groups: set[int], seconds: float) -> float:
    """Seconds until no process of the job is left (fails after ``seconds``)."""
    t0 = time.monotonic()
    while _survivors(pids, groups):
        if time.monotonic() - t0 > seconds:
            pytest.fail(f"still alive {seconds:g} s later: {_survivors(pids, groups)}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _cleanup(p: subprocess.Popen[bytes], pids: list[int], groups: set[int]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait(5)
    for pid in _survivors(pids, groups):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("term_first", [False, True], ids=["sigkill", "sigterm-then-sigkill"])
def test_killed_launcher_leaves_no_process_of_the_job(tmp_path: Path, term_first: bool) -> None:
    """Workers (and a child each) that ignore SIGTERM: the launcher is SIGKILLed (or, as a
    supervisor does, sent SIGTERM and SIGKILLed before its own SIGKILL to the workers)."""
    p = _launch(tmp_path, "deaf-child", subprocess.DEVNULL)
    pids: list[int] = []
    groups: set[int] = set()
    try:
        pids = _wait_pids(tmp_path, p)
        groups = set(pids[0::2])
        assert len(_job(groups)) >= 6  # 2 workers, 2 children, 2 watchdogs
        if term_first:
            p.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        p.kill()
        p.wait(5)
        took = _gone_within(pids, groups, 5.0)
        print(f"no survivor {took:.2f} s after the launcher's SIGKILL")
    finally:
        _cleanup(p, pids, groups)


def test_sigterm_with_a_stuck_console_stops_workers_and_reports(tmp_path: Path) -> None:
    """The launcher's stdout is a pipe nobody reads while the workers print: SIGTERM still
    stops every worker within 2 s, and the report (on stderr) names them."""
    r, w = os.pipe()
    p = _launch(tmp_path, "spam", w)
    os.close(w)
    pids: list[int] = []
    groups: set[int] = set()
    try:
        pids = _wait_pids(tmp_path, p)
        groups = set(pids)
        time.sleep(0.5)  # the pipe (64 KiB) is full long before this
        p.send_signal(signal.SIGTERM)
        took = _gone_within(pids, groups, 2.0)
        print(f"workers gone {took:.2f} s after SIGTERM")
        assert p.stderr is not None
        _, err_b = p.communicate(timeout=10)
        err = err_b.decode()
        assert p.returncode == 128 + signal.SIGTERM, err
        assert "FAILED" in err and "Root Cause" in err, err
        assert "stopped by this node's launcher: it got SIGTERM" in err, err
        assert "rank      : 0 (local_rank: 0)" in err and "rank      : 1 (local_rank: 1)" in err, err
        assert "(signal 15: SIGTERM)" in err, err
    finally:
        os.close(r)
        _cleanup(p, pids, groups)


def test_console_never_blocks_the_loop_and_marks_dropped_lines() -> None:
    """A pipe nobody reads: writes return at once (the loop's ticks stay on time), lines past the
    buffer are dropped and counted; once someone reads, everything queued comes out, then the
    marker; ``close`` gives up on a console that takes nothing."""
    from aiodist.launcher._console import Console  # here: the other tests run without it

    r, w = os.pipe()
    out = os.fdopen(w, "w")
    console = Console(out, limit=1 << 20)
    line = b"y" * 1023 + b"\n"

    async def main() -> float:
        lag = 0.0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal lag
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - t - 0.01)

        tick = asyncio.ensure_future(ticker())
        for _ in range(256):  # 16 MiB in all, 16 times the buffer
            console.write(line * 64)
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        stop.set()
        await tick
        return lag

    try:
        lag = asyncio.run(main())
        assert lag < 0.1, f"loop lag {lag:.3f} s"
        assert console.dropped_total > 0
        t0 = time.monotonic()
        assert console.close(stall=0.3) is False  # nobody reads: gives up
        assert time.monotonic() - t0 < 1.0
        got = bytearray()

        def read() -> None:
            while chunk := os.read(r, 1 << 16):
                got.extend(chunk)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 5
        while b"dropped" not in got and time.monotonic() < deadline:
            time.sleep(0.02)
        text = bytes(got)
        assert text.startswith(line), text[:80]
        head, _, tail = text.partition(b"[aiodist-run]: ")
        assert len(head) % len(line) == 0 and len(head) <= (1 << 20) + (64 << 10)
        assert tail.split(b" ", 1)[0].isdigit() and b"dropped: the console did not keep up\n" in tail
    finally:
        out.close()
        os.close(r)
