"""The launcher across hosts when the network fails: two "hosts" (network namespaces,
aiodist.testing.netns), one ``python -m aiodist.run`` on each, and the link between them set
down in the middle of the job.

- Without restarts: every rank's collective fails within its group timeout naming the peer it
  waited for, and both launchers end (exit 1) within bounded time, each with its own failure
  report naming its own workers and what they died of; the report's root cause names the other
  host (static and c10d rendezvous).
- With ``--max-restarts 1`` and the link up again after the failure, both launchers rendezvous
  again, restart their workers, and the job completes (exit 0); ``--local-addr`` reaches the
  workers as ``AIODIST_ADVERTISE_ADDR``.
- Workers that do not communicate: the launchers find the lost link themselves (the store's and
  the heartbeats' silence) and report the workers they stopped.

Skips where namespaces cannot be made (the harness's reason). Every launcher runs under a
deadline (SIGTERM, then SIGKILL of its process group) and the Hosts' close() kills whatever is
left; a failed assertion shows every launcher's output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiodist.testing import netns

REASON = netns.unavailable_reason()
NETNS = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "helpers" / "multihost_loop_job.py")
SLEEPER = str(ROOT / "tests" / "helpers" / "launched_worker.py")
GROUP_TIMEOUT = 3.0  # the loop's group timeout (multihost_loop_job.py --timeout)
# After the link goes down, a launcher must be done within this: the group timeout, the 0.5 s
# settle, the bounded word to the store (5 s) or the gather of outcomes (3 s), and slack.
REPORT_WITHIN = 20.0
SCRUB = ("PET_", "TORCHELASTIC_", "MASTER_", "GLOO_SOCKET_IFNAME", "AIODIST_SOCKET_IFNAME", "AIODIST_ADVERTISE_ADDR")
SCRUB_EXACT = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}
PREFIXED = re.compile(r"^\[rank(\d+)\]: (.*)$")
FAILED = re.compile(r"FAILED rank (\d+) at iter \d+ after ([\d.]+) s: (.*)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB) and k not in SCRUB_EXACT}
    env["PYTHONPATH"] = str(ROOT)
    return env


class Launcher:
    """One ``aiodist-run`` in one host; its output read as it comes (with arrival times)."""

    def __init__(self, hosts: netns.Hosts, host: int, args: list[str]) -> None:
        self.host = host
        self.argv = [sys.executable, "-m", "aiodist.run", *args]
        self.lines: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}
        self._cond = threading.Condition()
        self.p = hosts.popen(host, self.argv, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ended = 0.0  # when it exited (monotonic)
        self._pumps = [
            threading.Thread(target=self._pump, args=(s, n), daemon=True) for s, n in ((self.p.stdout, "out"), (self.p.stderr, "err"))
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, stream: object, name: str) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                self.lines[name].append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()

    def text(self, name: str) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines[name])

    def wait_for(self, pattern: str, name: str = "out", timeout: float = 30.0) -> float:
        """When a line matching ``pattern`` came (waits for it)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.lines[name]:
                    if rx.search(line):
                        return t
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not any(t.is_alive() for t in self._pumps)):
                    raise AssertionError(f"host {self.host}: no line matching {pattern!r} on std{name} within {timeout:g} s")
                self._cond.wait(min(left, 0.2))

    def finish(self, timeout: float) -> int:
        """The exit status; a launcher still running after ``timeout`` is stopped (SIGTERM: it
        stops its workers; then SIGKILL of its group) and the test fails."""
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self._stop()
            raise AssertionError(f"host {self.host}: the launcher overstayed {timeout:g} s") from None
        self.ended = time.monotonic()
        for t in self._pumps:
            t.join(10)
        return rc

    def _stop(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(10)

    def ranks(self) -> set[int]:
        """The global ranks of this launcher's workers (from their prefixed output)."""
        return {int(m.group(1)) for _, line in self.lines["out"] if (m := PREFIXED.match(line))}

    def dump(self) -> str:
        return f"=== host {self.host}: {' '.join(self.argv)}\n--- stdout ---\n{self.text('out')}\n--- stderr ---\n{self.text('err')}"


def dump(launchers: list[Launcher]) -> str:
    return "\n".join(x.dump() for x in launchers)


def parse_report(err: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """torch's failure report on a launcher's stderr: (the other failures, the root cause), each
    a dict of its fields (``rank``, ``host``, ``exitcode``, ``message`` or ``traceback``)."""
    head = err.index(" FAILED\n")
    entries: list[dict[str, str]] = []
    root_at = None
    key = ""
    for line in err[head:].splitlines()[1:]:
        if line.startswith("Root Cause"):
            root_at = len(entries)
        elif line.startswith("="):
            break
        elif re.match(r"^\[\d+\]:$", line):
            entries.append({})
        elif entries and (m := re.match(r"^  (\w+)\s*: ?(.*)$", line)):
            key = m.group(1)
            entries[-1][key] = m.group(2)
        elif entries and line.startswith("    ") and key == "traceback":
            entries[-1]["traceback"] += line.strip() + "\n"
    assert root_at is not None and len(entries) == root_at + 1, err[head:]
    return entries[:root_at], entries[root_at]


def entry_rank(e: dict[str, str]) -> int:
    return int(e["rank"].split()[0])


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    yield from netns.managed(2)


def start(hosts: netns.Hosts, backend: str, extra: list[str], job: list[str], local_addr: bool = False) -> list[Launcher]:
    if backend == "static":
        rdzv = ["--master-addr", hosts.addr(0), "--master-port", "29500"]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", hosts.hostport(0, 29400), "--rdzv-id", "mh"]
    out = []
    for i in (0, 1):
        node = ["--node-rank", str(i)] if backend == "static" else []
        if local_addr:
            node += ["--local-addr", hosts.addr(i)]
        out.append(Launcher(hosts, i, ["--nnodes", "2", "--nproc-per-node", "1", *rdzv, *node, *extra, *job]))
    return out


def check_collective_failures(launchers: list[Launcher], within: float) -> dict[int, str]:
    """Every rank's collective failed within the group timeout naming its peer; {rank: the
    exception as the job printed it}."""
    died: dict[int, str] = {}
    for x in launchers:
        for _, line in x.lines["err"]:
            m = PREFIXED.match(line)
            f = FAILED.search(m.group(2)) if m else None
            if f:
                rank, took, exc = int(f.group(1)), float(f.group(2)), f.group(3)
                peer = 1 - rank
                assert took <= within, f"rank {rank} failed only after {took} s: {exc}"
                assert re.search(rf"rank {peer}\b|\[{peer}\]", exc), f"rank {rank}'s error does not name rank {peer}: {exc}"
                died[rank] = exc
    assert sorted(died) == [0, 1], dump(launchers)
    return died


@NETNS
@pytest.mark.subprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_link_down_mid_job_every_launcher_reports_its_own_workers(hosts: netns.Hosts, backend: str) -> None:
    launchers = start(hosts, backend, [], [JOB, "--timeout", str(GROUP_TIMEOUT)])
    try:
        for x in launchers:
            x.wait_for(r"iter 3 ok")
        down = time.monotonic()
        hosts.link_down(0)
        rcs = [x.finish(REPORT_WITHIN + 15) for x in launchers]
        assert rcs == [1, 1], dump(launchers)
        for x in launchers:
            assert x.ended - down < REPORT_WITHIN, f"host {x.host} took {x.ended - down:.1f} s\n{dump(launchers)}"
        died = check_collective_failures(launchers, GROUP_TIMEOUT + 1.0)
        for x in launchers:
            other = 1 - x.host
            err = x.text("err")
            assert err.count(" FAILED\n") == 1 and "Traceback (most recent call last):\n  File" not in err.split(" FAILED\n")[1], err
            assert "aiodist-run: " not in err, err  # a report, not a bare error (as "aiodist-run: StoreTimeoutError: ...")
            failures, root = parse_report(err)
            (rank,) = x.ranks()
            mine = [
                e for e in [*failures, root] if entry_rank(e) == rank and e.get("message", e.get("traceback", "")).strip() == died[rank]
            ]
            assert len(mine) == 1, f"host {x.host}'s report does not name its worker (rank {rank}) and its error\n{err}"
            assert mine[0]["exitcode"].startswith("1 (pid:") and hosts.addr(x.host) in mine[0]["host"], mine[0]
            # The root cause is the lost peer: the other host, named by its address.
            why = root.get("traceback", "")
            assert hosts.addr(other) in root["host"] and hosts.addr(other) in why, err
            assert ("rendezvous store" in why) == (x.host == 1), why  # host 1 lost the store host 0 runs
    finally:
        for x in launchers:
            if x.p.poll() is None:
                x._stop()


@NETNS
@pytest.mark.subprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["c10d"])  # (static's restart after a failure: tests/test_launcher.py; 10 s a run here)
def test_link_back_up_the_job_restarts_and_completes(hosts: netns.Hosts, backend: str) -> None:
    extra = ["--max-restarts", "1", "--rdzv-conf", "join_timeout=40"]
    launchers = start(hosts, backend, extra, [JOB, "--timeout", str(GROUP_TIMEOUT)], local_addr=True)
    try:
        for x in launchers:
            x.wait_for(r"iter 3 ok")
        hosts.link_down(0)
        for x in launchers:  # the failure is found on both hosts while the link is still down
            x.wait_for(r"worker group failed \(round 0\)(: rank \d+ exited with [^;]*)?; restarting \(1/1\)", "err", timeout=REPORT_WITHIN)
        hosts.link_up(0)
        rcs = [x.finish(40) for x in launchers]
        assert rcs == [0, 0], dump(launchers)
        check_collective_failures(launchers, GROUP_TIMEOUT + 1.0)
        per_round: dict[int, set[int]] = {0: set(), 1: set()}
        for x in launchers:
            out = x.text("out")
            # --local-addr is what the workers advertise, in both rounds. A c10d agent takes its
            # node's ranks in order of arrival, so a restart may swap them (as torchrun's may)
            for k in (0, 1):
                m = re.search(rf"(?m)start rank (\d+) of 2 restart {k} advertise={re.escape(hosts.addr(x.host))}$", out)
                assert m, dump(launchers)
                per_round[k].add(int(m.group(1)))
            assert f"DONE rank {m.group(1)} restart 1" in out and not re.search(r"DONE rank \d+ restart 0", out), dump(launchers)
            assert " FAILED\n" not in x.text("err") + "\n", x.text("err")
        assert per_round == {0: {0, 1}, 1: {0, 1}}, per_round
    finally:
        for x in launchers:
            if x.p.poll() is None:
                x._stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


@NETNS
@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_silent_link_is_found_by_the_launchers(hosts: netns.Hosts) -> None:
    """Workers that do not communicate never notice the link: the launchers do (host 1: the
    rendezvous store has not answered for heartbeat_timeout; host 0: host 1's heartbeats stopped),
    stop their workers and report them."""
    hb = 3.0
    launchers = start(hosts, "static", ["--rdzv-conf", f"heartbeat_timeout={hb:g}"], [SLEEPER, "sleep"])
    try:
        pids = []
        for x in launchers:
            x.wait_for(r'"pid"')
            pids += [int(m.group(1)) for _, line in x.lines["out"] if (m := re.search(r'"pid": (\d+)', line))]
        down = time.monotonic()
        hosts.link_down(0)
        rcs = [x.finish(hb + REPORT_WITHIN) for x in launchers]
        assert rcs == [1, 1], dump(launchers)
        for x in launchers:
            assert x.ended - down < hb + 10, f"host {x.host} took {x.ended - down:.1f} s\n{dump(launchers)}"
            failures, root = parse_report(x.text("err"))
            (rank,) = x.ranks()
            (mine,) = [e for e in failures if entry_rank(e) == rank]
            assert mine["exitcode"].endswith("(signal 15: SIGTERM)") and mine["message"].startswith("stopped by this node's launcher"), mine
            other = hosts.addr(1 - x.host)
            assert other in root["host"] and other in root["traceback"], root
        assert "has not answered for" in parse_report(launchers[1].text("err"))[1]["traceback"]
        assert "stopped answering: no heartbeat" in parse_report(launchers[0].text("err"))[1]["traceback"]
        assert not [pid for pid in pids if _alive(pid)], "workers outlived their launchers"
    finally:
        for x in launchers:
            if x.p.poll() is None:
                x._stop()


def test_local_addr_is_what_the_workers_advertise(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.launcher.api import LaunchConfig, _worker_spec

    monkeypatch.delenv("AIODIST_ADVERTISE_ADDR", raising=False)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, local_addr="10.1.2.3")
    assert _worker_spec(config, "true", []).extra_env == {"AIODIST_ADVERTISE_ADDR": "10.1.2.3"}
    assert _worker_spec(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1), "true", []).extra_env == {}
    monkeypatch.setenv("AIODIST_ADVERTISE_ADDR", "10.9.9.9")  # the user's own setting is inherited as it is
    assert _worker_spec(config, "true", []).extra_env == {}
