"""A cut link is named in seconds, without a launcher (aiodist.transport._connection's
``_watch_link``: keepalive probes on an idle connection, ``TCP_USER_TIMEOUT`` on data sent): two
hosts (network namespaces, aiodist.testing.netns), one rank each, env:// with a 120 s group
timeout and ``AIODIST_LINK_TIMEOUT_S=3``.

- The link goes down under established connections while the ranks run small all_reduces:
  both ranks raise a DistError within 10 s naming the other, ``culprits`` == the other rank.
- No false alarm on a slow link: over a 10 Mbit/s tbf-shaped link an all_reduce of 8 MB takes
  longer than the link timeout (each rank sends 8 MB) and completes with the right sum.

Skips where namespaces cannot be made (root and iproute2); the hosts are removed after each
test, also when it fails."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aiodist.testing import netns

REASON = netns.unavailable_reason()

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.timeout(90),
    pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}"),
]

ROOT = Path(__file__).resolve().parents[1]
RANK = str(ROOT / "tests" / "helpers" / "link_rank.py")
LINK_TIMEOUT_S = 3
PORT = 29611


def _start(hosts: netns.Hosts, *args: str) -> tuple[list[subprocess.Popen[Any]], queue.Queue[tuple[int, str]]]:
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "AIODIST_", "TORCHELASTIC_", "PET_"))}
        env.update(
            RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=hosts.addr(0), MASTER_PORT=str(PORT), AIODIST_LINK_TIMEOUT_S=str(LINK_TIMEOUT_S)
        )
        p = hosts.popen(r, [sys.executable, RANK, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)

        def pump(rank: int, stream: Any) -> None:
            for line in stream:
                lines.put((rank, line.rstrip("\n")))

        threading.Thread(target=pump, args=(r, p.stdout), daemon=True).start()
    return procs, lines


def _until(
    lines: queue.Queue[tuple[int, str]], want: str, ranks: set[int], deadline: float, seen: dict[int, list[str]]
) -> dict[int, float]:
    """Read lines until each of ``ranks`` printed a line starting with ``want``; the time each did."""
    got: dict[int, float] = {}
    while set(got) != ranks:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.setdefault(rank, []).append(line)
        if line.startswith(want) and rank not in got:
            got[rank] = time.monotonic()
    return got


def test_a_link_cut_under_established_connections_is_named_in_seconds() -> None:
    seen: dict[int, list[str]] = {}
    with netns.make_hosts(2) as hosts:
        procs, lines = _start(hosts, "loop")
        try:
            running = _until(lines, "running", {0, 1}, time.monotonic() + 30, seen)
            assert set(running) == {0, 1}, seen
            time.sleep(0.5)
            cut = time.monotonic()
            hosts.link_down(0)
            errors = _until(lines, "ERROR", {0, 1}, cut + 30, seen)
        finally:
            for p in procs:
                p.kill()
    assert set(errors) == {0, 1}, f"not every rank raised after the cut: {seen}"
    for rank, at in errors.items():
        other = 1 - rank
        msg = next(line for line in seen[rank] if line.startswith("ERROR"))
        culprits = next(line for line in seen[rank] if line.startswith("CULPRITS"))
        assert culprits == f"CULPRITS [{other}]", (rank, seen[rank])
        assert f"rank {other}" in msg and "stopped answering" in msg, msg
        assert at - cut < 10, f"rank {rank} raised {at - cut:.1f} s after the cut: {msg}"
    print("after the cut: " + ", ".join(f"rank {r} {t - cut:.1f} s" for r, t in sorted(errors.items())))


def test_a_long_op_on_a_slow_link_is_not_cut() -> None:
    seen: dict[int, list[str]] = {}
    with netns.make_hosts(2, rate="10mbit") as hosts:
        procs, lines = _start(hosts, "big", str(8 << 20))
        try:
            done = _until(lines, "DONE", {0, 1}, time.monotonic() + 60, seen)
        finally:
            for p in procs:
                p.kill()
    assert set(done) == {0, 1}, seen
    for rank in (0, 1):
        line = next(x for x in seen[rank] if x.startswith("DONE"))
        _, took, ok = line.split()
        assert ok == "True", line
        assert float(took) > LINK_TIMEOUT_S, f"the op took {took} s, not longer than the link timeout: the test shows nothing"
