"""The launcher killed or stopped under its workers: a SIGKILLed launcher whose
workers ignore SIGTERM leaves no process of the job alive 5 s later (its workers' watchdogs
end them); a SIGTERMed one stops its workers within 2 s and prints the failure report.

The job's processes are the launcher's descendants, recorded before the kill, plus every
member of the workers' process groups (the watchdogs are double-forked, so no descendants);
every one of them is SIGKILLed at the end by pid, whatever happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Writes its pid to <dir>/<RANK>, then waits to be killed (modes "deaf": ignores SIGTERM, "plain").
WORKER = ROOT / "tests" / "helpers" / "sigterm_worker.py"


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the comm field (state first), None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].decode().split()
    return None if fields[0] in ("Z", "X") else fields


def _scan() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent, process group)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            out[int(entry)] = (int(st[1]), int(st[2]))
    return out


def _job(launcher: int, groups: set[int]) -> set[int]:
    """The launcher's live descendants, and the members of ``groups``."""
    procs = _scan()
    found = {p for p, (_, g) in procs.items() if g in groups}
    todo = [launcher]
    while todo:
        parent = todo.pop()
        for p, (pp, _) in procs.items():
            if pp == parent and p not in found:
                found.add(p)
                todo.append(p)
    return found


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if _stat(p) is not None}


def _start(tmp: Path, mode: str, n: int) -> tuple[subprocess.Popen[bytes], list[int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", str(n), str(WORKER), mode, str(tmp)]
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    files = [tmp / str(r) for r in range(n)]
    while not all(f.exists() for f in files):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            _, err = p.communicate(timeout=10)
            pytest.fail(f"workers did not start (launcher rc {p.returncode}): {err.decode()[-2000:]}")
        time.sleep(0.05)
    return p, [int(f.read_text()) for f in files]


def _gone_within(pids: set[int], seconds: float) -> float:
    t0 = time.monotonic()
    while left := _alive(pids):
        if time.monotonic() - t0 > seconds:
            pytest.fail(f"processes of the job still alive {seconds:g} s later: {sorted(left)}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _cleanup(p: subprocess.Popen[bytes], pids: set[int]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
def test_sigkilled_launcher_leaves_no_deaf_worker(tmp_path: Path, n: int) -> None:
    p, workers = _start(tmp_path, "deaf", n)
    job = set(workers)
    try:
        job = _job(p.pid, set(workers)) | job
        # the workers and one watchdog each (the trampoline's double fork, in the worker's group)
        assert len(job) >= 2 * n, f"job processes {sorted(job)} for {n} workers"
        p.kill()
        p.wait(10)
        took = _gone_within(job, 5.0)
        print(f"SIGKILLed launcher, {n} workers ignoring SIGTERM: all {len(job)} job processes gone in {took:.2f} s")
    finally:
        _cleanup(p, job)


@pytest.mark.timeout(60)
def test_sigtermed_launcher_stops_its_workers_and_reports(tmp_path: Path) -> None:
    p, workers = _start(tmp_path, "plain", 2)
    job = set(workers)
    try:
        job = _job(p.pid, set(workers)) | job
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        took = _gone_within(job, 2.0)
        _, err = p.communicate(timeout=10)
        text = err.decode()
        print(f"SIGTERMed launcher: its {len(job)} job processes gone in {took:.2f} s, launcher exit {time.monotonic() - t0:.2f} s")
        assert p.returncode == 128 + signal.SIGTERM, text[-2000:]
        assert "Root Cause" in text and "got SIGTERM" in text, text[-2000:]
        for rank in (0, 1):
            assert f"rank      : {rank} (local_rank: {rank})" in text, text[-2000:]  # both workers named
    finally:
        _cleanup(p, job)
