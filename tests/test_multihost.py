"""Jobs across hosts for real: every "host" is a network namespace (aiodist.testing.netns) with
its own addresses and ``eth{j}`` devices, every host has the same hostname and it resolves to
127.0.1.1 (as on Debian), and each host runs one launcher (``python -m aiodist.run``) whose
workers run tests/helpers/multihost_job.py (every collective's data checked, ``OK rank R of W``).

- static and c10d rendezvous on 2 and 3 hosts, one or two workers per host (two mixes same-host
  and cross-host peers);
- ``GLOO_SOCKET_IFNAME``/``AIODIST_SOCKET_IFNAME``: a big all_reduce striped over eth0 and eth1
  (each carries a real share of the bytes, by the devices' counters), a rank naming fewer
  interfaces than another and an interface that does not exist refused on every rank at once,
  and AIODIST_SOCKET_IFNAME wins over GLOO_SOCKET_IFNAME;
- IPv6-only hosts.

The module skips where namespaces cannot be made (needs root and iproute2: the harness's
reason). Launchers start concurrently, each under a deadline (SIGTERM, then SIGKILL of its
process group); the Hosts' close() kills whatever is left and deletes the namespaces, also when
a test fails or times out. A failure shows every launcher's output.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiodist.testing import netns

REASON = netns.unavailable_reason()

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.timeout(90),
    pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}"),
]

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "helpers" / "multihost_job.py")
PORT = 29500
OK = re.compile(r"OK rank (\d+) of (\d+)")
GROUP_TIMEOUT = 20  # the workers' process-group timeout: a broken peer fails the job in seconds
DEADLINE = 60.0  # a launcher still running after this is stopped and the test fails
SCRUB = ("PET_", "TORCHELASTIC_", "MASTER_", "GLOO_SOCKET_IFNAME", "AIODIST_SOCKET_IFNAME", "MULTIHOST_")
SCRUB_EXACT = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}


@dataclass
class Launch:
    host: int
    argv: list[str]
    rc: int | None
    out: str
    err: str
    elapsed: float
    stopped: bool  # overstayed the deadline and was stopped here

    @property
    def text(self) -> str:
        return self.out + self.err


def report(launches: Sequence[Launch]) -> str:
    parts = []
    for x in launches:
        stop = f", STOPPED after the {DEADLINE:g} s deadline" if x.stopped else ""
        parts.append(
            f"=== host {x.host}: exit {x.rc} after {x.elapsed:.1f} s{stop}\n$ {' '.join(x.argv)}\n"
            f"--- stdout ---\n{x.out.rstrip()}\n--- stderr ---\n{x.err.rstrip()}"
        )
    return "\n".join(parts)


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB) and k not in SCRUB_EXACT}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["MULTIHOST_TIMEOUT"] = str(GROUP_TIMEOUT)
    env.update(extra or {})
    return env


def static_args(hosts: netns.Hosts, i: int, nproc: int, master: str) -> list[str]:
    return [
        "--nnodes",
        str(hosts.n),
        "--node-rank",
        str(i),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        master,
        "--master-port",
        str(PORT),
        "--rdzv-conf",
        "join_timeout=20",
    ]


def launch_all(
    hosts: netns.Hosts,
    args: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]] | None = None,
    job_args: Sequence[str] = (),
    deadline: float = DEADLINE,
    job: str = JOB,
) -> list[Launch]:
    """One launcher per host (``args[i]`` its flags, ``envs[i]`` its environment) running ``job``,
    started together; waits for all of them, stops those past ``deadline``; their output."""
    envs = envs if envs is not None else [job_env()] * hosts.n
    with tempfile.TemporaryDirectory(prefix="multihost_") as tmp:
        procs, files, argvs = [], [], []
        t0 = time.monotonic()
        try:
            for i in range(hosts.n):
                argv = [sys.executable, "-m", "aiodist.run", *args[i], job, *job_args]
                out, err = open(Path(tmp, f"{i}.out"), "wb"), open(Path(tmp, f"{i}.err"), "wb")
                files += [out, err]
                argvs.append(argv)
                procs.append(hosts.popen(i, argv, env=envs[i], stdout=out, stderr=err, cwd=ROOT))
            ends: list[float | None] = [None] * hosts.n
            stopped = [False] * hosts.n
            while any(e is None for e in ends):
                now = time.monotonic()
                for i, p in enumerate(procs):
                    if ends[i] is None and p.poll() is not None:
                        ends[i] = now
                if now - t0 > deadline:
                    for i, p in enumerate(procs):
                        if ends[i] is None:
                            stopped[i] = True
                            stop(p)
                            ends[i] = time.monotonic()
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    stop(p)
            for f in files:
                f.close()

        def read(i: int, ext: str) -> str:
            return Path(tmp, f"{i}.{ext}").read_text(errors="replace")

        return [
            Launch(i, argvs[i], procs[i].returncode, read(i, "out"), read(i, "err"), (ends[i] or t0) - t0, stopped[i])
            for i in range(hosts.n)
        ]


def stop(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it stops its workers), SIGKILL its process group after 5 s."""
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def assert_all_ok(launches: Sequence[Launch], world: int) -> None:
    assert all(x.rc == 0 for x in launches), "a launcher failed:\n" + report(launches)
    seen = [(int(r), int(w)) for x in launches for r, w in OK.findall(x.out)]
    assert sorted(seen) == [(r, world) for r in range(world)], f"expected 'OK rank r of {world}' once per rank, got {seen}\n" + report(
        launches
    )


@pytest.fixture
def two_hosts() -> Iterator[netns.Hosts]:
    yield from netns.managed(2, prefix="aiodist-mh")


# --- the harness itself --------------------------------------------------------------------------


PROBE = Path(__file__).resolve().parent / "helpers" / "netns_probe.py"  # server ADDR... / client ADDR...: who reaches whom


def test_harness_hosts_share_a_loopback_hostname_and_reach_each_other() -> None:
    """3 hosts on 2 bridged segments, IPv4 and IPv6: each of hosts 1 and 2 reaches host 0 on
    every address, from its own address on that segment; the hostname is the same everywhere and
    maps to 127.0.1.1; the counters move; close() leaves no namespace, entry or process."""
    with netns.make_hosts(3, links=2, ipv6=True, prefix="aiodist-mh") as hosts:
        names = list(hosts.names)
        fams: tuple[netns.Family, ...] = ("ipv4", "ipv6")
        where = [(j, f) for j in range(2) for f in fams]
        addrs = [hosts.addr(0, j, f) for j, f in where]
        srv = hosts.popen(0, [sys.executable, str(PROBE), "server", *addrs], stdout=subprocess.PIPE, text=True)
        assert srv.stdout is not None and srv.stdout.readline() == "listening\n"
        before = hosts.counters(0, "eth1")
        for i in (1, 2):
            r = hosts.run(i, [sys.executable, str(PROBE), "client", *addrs], timeout=20)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0] == f"{socket.gethostname()} 127.0.1.1", lines
            assert lines[1:] == [f"{a} {hosts.addr(i, j, f)}" for a, (j, f) in zip(addrs, where)]
        assert srv.wait(timeout=10) == 0
        after = hosts.counters(0, "eth1")
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        sleeper = hosts.popen(1, ["sleep", "300"])
    assert sleeper.returncode is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
    assert not any(Path(f"/etc/netns/{n}").exists() for n in names)


# --- rendezvous across hosts ---------------------------------------------------------------------


@pytest.mark.parametrize(("n", "nproc"), [(2, 1), (3, 1), (2, 2)], ids=["2hosts", "3hosts", "2hosts-2procs"])
def test_static_rendezvous_hosts_sharing_a_loopback_hostname(n: int, nproc: int) -> None:
    with netns.make_hosts(n, prefix="aiodist-mh") as hosts:
        master = hosts.addr(0)
        launches = launch_all(hosts, [static_args(hosts, i, nproc, master) for i in range(n)])
        assert_all_ok(launches, n * nproc)


def c10d_args(hosts: netns.Hosts, i: int, local_addr: bool) -> list[str]:
    args = ["--nnodes", str(hosts.n), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", hosts.hostport(0, 29400)]
    args += ["--rdzv-id", "multihost-c10d", "--rdzv-conf", "join_timeout=20,last_call_timeout=1"]
    return args + (["--local-addr", hosts.addr(i)] if local_addr else [])


@pytest.mark.parametrize("local_addr", [True, False], ids=["local-addr", "no-local-addr"])
def test_c10d_rendezvous_hosts_sharing_a_loopback_hostname(two_hosts: netns.Hosts, local_addr: bool) -> None:
    """Node ranks go by arrival: whichever agent is node 0 hosts the workers' store and must
    advertise an address the others reach (its --local-addr, else not its hostname)."""
    hosts = two_hosts
    assert_all_ok(launch_all(hosts, [c10d_args(hosts, i, local_addr) for i in range(2)]), 2)


# --- interfaces ----------------------------------------------------------------------------------


def _bytes(c: tuple[int, int], d: tuple[int, int]) -> int:
    return (d[0] - c[0]) + (d[1] - c[1])


def test_big_all_reduce_striped_over_two_interfaces() -> None:
    with netns.make_hosts(2, links=2, prefix="aiodist-mh") as hosts:
        before = {dev: hosts.counters(0, dev) for dev in hosts.ifnames}
        env = job_env({"GLOO_SOCKET_IFNAME": "eth0,eth1", "MULTIHOST_BIG_MIB": "64"})
        launches = launch_all(hosts, [static_args(hosts, i, 1, hosts.addr(0)) for i in range(2)], [env, env])
        assert_all_ok(launches, 2)
        moved = {dev: _bytes(before[dev], hosts.counters(0, dev)) for dev in hosts.ifnames}
        total = sum(moved.values())
        assert total >= 64 * 2**20, f"host 0 moved only {moved} bytes for a 64 MiB all_reduce\n" + report(launches)
        for dev, b in moved.items():
            assert b >= 0.25 * total, f"{dev} carried {b} of {total} bytes ({moved}): not striped\n" + report(launches)


def rank_lines(x: Launch, rank: int, *words: str) -> list[str]:
    """Rank ``rank``'s output lines (the launcher prefixes them ``[rankR]: ``) holding every word."""
    return [ln for ln in x.text.splitlines() if ln.startswith(f"[rank{rank}]: ") and all(w in ln for w in words)]


def heard_of_other(x: Launch, *words: str) -> list[str]:
    """Where the other host's rank was refused first, this host's agent stops its own rank
    before that rank reaches the refusal: its failure report then carries the other rank's
    DistNetworkError (the report's lines, which hold every word)."""
    if "stopping this node's workers" not in x.text:
        return []
    return [ln for ln in x.text.splitlines() if "DistNetworkError" in ln and all(w in ln for w in words)]


def test_different_numbers_of_interfaces_refused_on_every_rank() -> None:
    envs = [job_env({"GLOO_SOCKET_IFNAME": "eth0,eth1"}), job_env({"GLOO_SOCKET_IFNAME": "eth0"})]
    with netns.make_hosts(2, links=2, prefix="aiodist-mh") as hosts:  # both hosts have eth1: only the counts differ
        launches = launch_all(hosts, [static_args(hosts, i, 1, hosts.addr(0)) for i in range(2)], envs)
    for x in launches:
        assert x.rc not in (0, None), "a launcher succeeded with mismatched interface lists:\n" + report(launches)
        lines = rank_lines(x, x.host, "DistNetworkError", "different numbers of network interfaces") or heard_of_other(
            x, "different numbers of network interfaces"
        )
        assert lines, f"rank {x.host} (host {x.host}) did not refuse the mismatch with a DistNetworkError:\n" + report(launches)
        assert any("eth1" in ln for ln in lines), "the message does not list each rank's interfaces:\n" + "\n".join(lines)


def test_unknown_interface_refused_at_once(two_hosts: netns.Hosts) -> None:
    hosts = two_hosts
    env = job_env({"GLOO_SOCKET_IFNAME": "eth9", "MULTIHOST_TIMEOUT": "60"})  # a timeout would take 60 s
    launches = launch_all(hosts, [static_args(hosts, i, 1, hosts.addr(0)) for i in range(2)], [env, env], deadline=40)
    for x in launches:
        assert x.rc not in (0, None) and not x.stopped, "expected a refusal:\n" + report(launches)
        lines = rank_lines(x, x.host, "DistNetworkError", "eth9", "does not exist") or heard_of_other(x, "eth9", "does not exist")
        assert lines, f"rank {x.host} (host {x.host}) did not refuse eth9 with a DistNetworkError:\n" + report(launches)
        assert any("eth0" in ln for ln in lines), "the message does not list the existing interfaces:\n" + "\n".join(lines)
        assert x.elapsed < 15, f"host {x.host} took {x.elapsed:.1f} s to refuse eth9 (group timeout 60 s)\n" + report(launches)


def test_aiodist_socket_ifname_wins_over_gloo_socket_ifname(two_hosts: netns.Hosts) -> None:
    hosts = two_hosts
    env = job_env({"GLOO_SOCKET_IFNAME": "eth9", "AIODIST_SOCKET_IFNAME": "eth0"})
    assert_all_ok(launch_all(hosts, [static_args(hosts, i, 1, hosts.addr(0)) for i in range(2)], [env, env]), 2)


# --- IPv6 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_ipv6_only_hosts(rdzv: str) -> None:
    with netns.make_hosts(2, ipv4=False, ipv6=True, prefix="aiodist-mh") as hosts:
        master = hosts.addr(0)
        assert ":" in master
        args = [static_args(hosts, i, 1, master) if rdzv == "static" else c10d_args(hosts, i, False) for i in range(2)]
        assert_all_ok(launch_all(hosts, args), 2)


HIER_JOB = str(ROOT / "tests" / "helpers" / "hier_job.py")


@pytest.mark.parametrize("per_host", [3])  # (2 per host: tests/test_bench_hosts.py, and by hand in docs/multi_host.md)
def test_several_ranks_per_host_cross_the_link_once_per_byte(per_host: int) -> None:
    """2 hosts x k ranks: all_reduce goes by the hierarchy (aiodist.algorithms.hier): right on the
    default group, on ranks not contiguous by host and on an uneven layout, its in-host phases
    through each host's shared memory; and a 16 MiB
    all_reduce sends about S over each host's link (the flat ring sent 2(n-1)/n S: 1.5 S at
    2 per host, 1.67 S at 3), by the devices' counters."""
    mib = 16
    with netns.make_hosts(2, links=1, prefix="aiodist-mh") as hosts:
        args = [static_args(hosts, i, per_host, hosts.addr(0)) for i in range(2)]
        env = job_env({"AIODIST_ALGO_HIER_MIN": "0"})  # the hierarchy at every size: the small checks too
        procs_out = launch_all(hosts, args, [env, env], [str(mib)], job=HIER_JOB)
        assert all(x.rc == 0 for x in procs_out), report(procs_out)
        seen = sorted(int(m) for x in procs_out for m in re.findall(r"HIER rank (\d+) of", x.out))
        assert seen == list(range(2 * per_host)), report(procs_out)
        shm = [m for x in procs_out for m in re.findall(r"HIER rank \d+ of \d+ \S+ host_shm=(\w+)", x.out)]
        assert shm == ["True"] * (2 * per_host), "the in-host phases did not use the host's shared memory\n" + report(procs_out)
    sent = [int(b) for x in procs_out for b in re.findall(r"TX host of rank \d+ sent (\d+) bytes", x.out)]
    assert len(sent) == 2, report(procs_out)
    s = mib * 2**20
    for b in sent:  # each host's eth0 bytes between barriers around the two ops (headers: a few %)
        assert b <= 2 * 1.05 * s, f"a host sent {b / s:.2f} S for two all_reduces of S\n" + report(procs_out)


CHAOS = ROOT / "tests" / "helpers" / "chaos_rank.py"
STORE_PORT = 29510


@pytest.mark.parametrize("how", ["kill"])  # (SIGSTOP on one host: tests/faults/test_chaos.py)
def test_a_rank_lost_on_either_host_mid_fuzz(how: str) -> None:
    """The chaos fuzz (tests/helpers/chaos_rank.py) on 2 netns hosts x 2 ranks, every all_reduce by
    the hierarchy (AIODIST_ALGO_HIER_MIN=0, in 64 KiB pieces from 128 KiB; groups in order,
    reversed and interleaved by host; in-host phases through each host's shared memory): a
    rank on host 1 SIGKILLs itself at a random op (SIGSTOP too, run by hand: the same); every rank of both hosts names it,
    the survivors shrink the default group (an uneven layout: 2 + 1) and finish the fuzz with 0
    wrong results. The store is served by its own process on host 0, as a launcher's agent does."""
    seed, victim, at = {"kill": (21, 3, 17), "stop": (22, 2, 11)}[how]
    with netns.make_hosts(2, links=1, prefix="aiodist-mh") as hosts:
        store = hosts.popen(0, [sys.executable, "-m", "aiodist.store", "--port", str(STORE_PORT)], env=job_env(), cwd=ROOT)
        with tempfile.TemporaryDirectory(prefix="chaos_") as tmp:
            procs, files = [], []
            try:
                for r in range(4):
                    env = job_env(
                        {
                            "MASTER_ADDR": hosts.addr(0),
                            "MASTER_PORT": str(STORE_PORT),
                            "TORCHELASTIC_USE_AGENT_STORE": "True",
                            "RANK": str(r),
                            "WORLD_SIZE": "4",
                            "AIODIST_ALGO_HIER_MIN": "0",
                            "AIODIST_ALGO_HIER_PIECE": "64K",  # the bigger all_reduces in pipelined pieces
                        }
                    )
                    out = open(Path(tmp, f"{r}.out"), "wb")
                    files.append(out)
                    argv = [sys.executable, str(CHAOS), str(seed), str(victim), how, str(at), "4", "30"]
                    procs.append(hosts.popen(r // 2, argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
                end = time.monotonic() + 60
                survivors = [p for r, p in enumerate(procs) if r != victim]
                while any(p.poll() is None for p in survivors) and time.monotonic() < end:
                    time.sleep(0.05)
            finally:
                for p in [*procs, store]:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                for f in files:
                    f.close()
            outs = {r: Path(tmp, f"{r}.out").read_text(errors="replace") for r in range(4)}
    everything = "\n".join(f"--- rank {r} ---\n{o}" for r, o in outs.items())
    assert "DYING" in outs[victim], everything
    for new, old in enumerate(r for r in range(4) if r != victim):
        assert procs[old].returncode == 0, everything
        err = re.search(r"^ERROR [\d.]+ (\[[\d, ]*\])", outs[old], re.M)
        assert err and err[1] == f"[{victim}]", everything
        assert f"DONE rank {new} of 3 wrong 0 ops " in outs[old] and "WRONG" not in outs[old], everything
