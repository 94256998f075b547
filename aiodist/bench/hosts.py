"""``python -m aiodist.bench hosts``: all_reduce between two "hosts" (network namespaces joined by
veth links shaped with tc tbf), on one interface and striped over two, nccl-tests style.

What it runs: :mod:`aiodist.testing.netns` makes 2 hosts with 2 links (``eth0``, ``eth1``);
with ``--rate`` (default ``1gbit``) every host device gets ``tc qdisc add dev DEV root tbf rate
RATE burst 256kb latency 50ms``. Then, for each implementation of ``--impls`` (aiodist, and torch
gloo where torch is importable) and each interface set (``eth0``, then ``eth0,eth1``), one rank
process starts in each host: rank 0 on host 0, which also hosts the store (``MASTER_ADDR`` = host
0's eth0 address, env:// rendezvous), with ``GLOO_SOCKET_IFNAME`` set to the interface set (both
implementations read it; ``AIODIST_SOCKET_IFNAME`` and ``AIODIST_ADVERTISE_ADDR`` are scrubbed so
that they cannot win; ``AIODIST_STRIPE_MIN_BYTES`` passes through).

- aiodist: ``await aiodist.init_process_group("gloo")`` on uvloop, numpy float32 buffers;
  interfaces named in GLOO_SOCKET_IFNAME each get a connection per pair of ranks, and collective
  messages of 256 KiB or more (AIODIST_STRIPE_MIN_BYTES) are split across them.
- torch: ``torch.distributed.init_process_group("gloo")`` with torch float32 tensors. gloo makes
  one device (and one context) per interface and picks a context per collective by its tag,
  round-robin: one all_reduce runs on one interface, successive ones alternate.

For each size of ``--sizes`` (default 64M) each rank checks one all_reduce's sum (every element
must be exact), runs ``--warmup`` untimed all_reduces, meets the other at a barrier and times
``--iters`` all_reduces, each on its own. time = the median over iterations of the slower rank's
time; algbw = size / time; busbw = algbw * 2(n-1)/n (n = 2: busbw = algbw). ``% link`` = busbw
as a share of ONE link's rate (a striped run can pass 100 %); ``striped/one`` = the striped
busbw over the one-interface busbw of the same implementation and size. The byte counters of
host 0's ``eth0`` and ``eth1`` (rx + tx over the whole run of a set-up, start-up included) show
which interfaces carried the traffic.

TCP congestion control: the hosts inherit this machine's ``net.ipv4.tcp_congestion_control``
unless ``--cc NAME`` sets it in both namespaces (a namespace may choose only from
``net.ipv4.tcp_allowed_congestion_control``); the one in effect is printed and in the JSON. It
matters here: BBR paces each flow at its estimate of the link rate and keeps tbf's queue near
empty, so every scheduling hiccup of a loaded machine is idle link time (tbf's 256 KB burst is
only ~2 ms at 1 Gbit/s), and two lanes suffer it more than one; a loss-based algorithm (reno,
cubic) keeps a standing queue in tbf that covers such hiccups (see docs/benchmarks.md).

Targets, checked on aiodist and stated for torch alongside: one interface busbw >= 90 %
of the link rate; striped >= 1.8x one interface. They are reported, never enforced: the exit code
says whether the benchmark ran (0, also when namespaces cannot be made here: it prints why and
skips; 1 when a rank fails, a result is wrong or ``--cc`` cannot be set; 2 for bad arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiodist.bench import format_table, machine_info
from aiodist.knobs import parse_size

__all__ = ["main", "parse_rate", "IFACE_SETS"]

HOSTS = 2
IFACE_SETS: tuple[tuple[str, ...], ...] = (("eth0",), ("eth0", "eth1"))
IMPLS = ("aiodist", "torch")
BASE_PORT = 29600
RESULT = "RESULT "  # a worker's last stdout line: RESULT {json}
SCRUB_PREFIXES = ("PET_", "TORCHELASTIC_", "MASTER_", "GLOO_", "AIODIST_SOCKET_IFNAME", "AIODIST_ADVERTISE_ADDR")
SCRUB_EXACT = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE"}
ITEMSIZE = 4  # float32
TARGET_PCT = 90.0
TARGET_RATIO = 1.8


class BenchError(Exception):
    """The benchmark could not run, or a result was wrong."""


# ----------------------------------------------------------------------------- units

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}


def parse_rate(text: str) -> float | None:
    """A tc rate (``1gbit``, ``500mbit``, ``100mbps`` = bytes/s, a bare number = bit/s, as tc
    reads them) in BITS per second; None for ``none``/``off``/``0`` (no shaping)."""
    t = text.strip().lower()
    if t in ("none", "off", "0", ""):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", t)
    if m is None or m.group(2) not in ("", *_RATE_UNITS):
        raise argparse.ArgumentTypeError(f"expected a tc rate such as 1gbit, 500mbit or 'none', got {text!r}")
    bits = float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1)
    if bits <= 0:
        return None
    return bits


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < ITEMSIZE:
        raise argparse.ArgumentTypeError(f"a size must be at least {ITEMSIZE} bytes (one float32), got {text!r}")
    return n


def _sizes(text: str) -> list[int]:
    out = [_size(s) for s in text.split(",") if s.strip()]
    if not out:
        raise argparse.ArgumentTypeError("--sizes: give at least one size")
    return out


def _human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- worker (one rank, inside a host)


def _expected(count: int) -> Any:
    import numpy as np

    world = int(os.environ["WORLD_SIZE"])
    return np.full(count, world * (world + 1) / 2, dtype=np.float32)


async def _aiodist_worker(sizes: Sequence[int], warmup: int, iters: int, timeout: float) -> dict[str, Any]:
    import numpy as np

    import aiodist

    await aiodist.init_process_group("gloo", timeout=timeout)
    try:
        rank = aiodist.get_rank()
        out: dict[str, Any] = {"rank": rank, "times": {}, "cpu": {}}
        for nbytes in sizes:
            count = nbytes // ITEMSIZE
            x = np.full(count, rank + 1, dtype=np.float32)
            await aiodist.all_reduce(x)
            if not np.array_equal(x, _expected(count)):
                raise BenchError(f"aiodist rank {rank}: all_reduce of {count} float32 gave a wrong sum")
            for _ in range(warmup):
                await aiodist.all_reduce(x)
            await aiodist.barrier()
            times, w0, c0 = [], time.perf_counter(), time.process_time()
            for _ in range(iters):
                t0 = time.perf_counter()
                await aiodist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            out["times"][str(nbytes)] = times
            out["cpu"][str(nbytes)] = (time.process_time() - c0) / (
                time.perf_counter() - w0
            )  # this process's CPU share over the timed loop
        await aiodist.barrier()
        return out
    finally:
        await aiodist.destroy_process_group()


def _torch_worker(sizes: Sequence[int], warmup: int, iters: int, timeout: float) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    try:
        rank = dist.get_rank()
        out: dict[str, Any] = {"rank": rank, "times": {}, "cpu": {}}
        for nbytes in sizes:
            count = nbytes // ITEMSIZE
            x = torch.full((count,), float(rank + 1), dtype=torch.float32)
            dist.all_reduce(x)
            if not torch.equal(x, torch.from_numpy(_expected(count))):
                raise BenchError(f"torch rank {rank}: all_reduce of {count} float32 gave a wrong sum")
            for _ in range(warmup):
                dist.all_reduce(x)
            dist.barrier()
            times, w0, c0 = [], time.perf_counter(), time.process_time()
            for _ in range(iters):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            out["times"][str(nbytes)] = times
            out["cpu"][str(nbytes)] = (time.process_time() - c0) / (
                time.perf_counter() - w0
            )  # this process's CPU share over the timed loop
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def worker_main(argv: Sequence[str]) -> int:
    """``python -m aiodist.bench.hosts --worker IMPL SIZES WARMUP ITERS TIMEOUT``: one rank (env://
    from the environment); prints ``RESULT {json}`` last, or a traceback and exit code 1."""
    impl, sizes_s, warmup_s, iters_s, timeout_s = argv
    sizes, warmup, iters, timeout = [int(s) for s in sizes_s.split(",")], int(warmup_s), int(iters_s), float(timeout_s)
    try:
        if impl == "torch":
            res = _torch_worker(sizes, warmup, iters, timeout)
        else:
            try:
                import uvloop

                res = uvloop.run(_aiodist_worker(sizes, warmup, iters, timeout))
            except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
                res = asyncio.run(_aiodist_worker(sizes, warmup, iters, timeout))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    print(RESULT + json.dumps(res), flush=True)
    return 0


# ----------------------------------------------------------------------------- coordinator


@dataclass
class Run:
    """One implementation on one interface set: the slower rank's time per iteration, per size,
    and host 0's bytes (rx + tx) per interface over the run."""

    impl: str
    ifaces: tuple[str, ...]
    times: dict[int, list[float]] = field(default_factory=dict)
    cpu: dict[int, list[float]] = field(default_factory=dict)  # per rank: CPU time / wall time over the timed loop
    traffic: dict[str, int] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)  # each host's tx bytes (every device) over the run
    wall_s: float = 0.0


def _per_host(text: str) -> tuple[int, ...]:
    """``--nproc-per-host``: ``K`` (K ranks on every host) or one count per host (``3,1``)."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of ranks, or one per host (3,1)") from None
    if len(counts) == 1:
        counts *= HOSTS
    if len(counts) != HOSTS or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 rank on each of the {HOSTS} hosts")
    return counts


def _host_ranks(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(host, local rank) of every rank, ranks contiguous by host."""
    return [(h, i) for h, c in enumerate(counts) for i in range(c)]


def _env(master: str, port: int, rank: int, ifaces: Sequence[str], counts: Sequence[int] = (1, 1)) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_EXACT}
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(
        MASTER_ADDR=master,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(_host_ranks(counts)[rank][1]),
        WORLD_SIZE=str(sum(counts)),
        LOCAL_WORLD_SIZE=str(counts[_host_ranks(counts)[rank][0]]),
        GLOO_SOCKET_IFNAME=",".join(ifaces),
    )
    return env


def _counts_json(counts: Sequence[int]) -> int | list[int]:
    """The ranks per host as the JSON gives them: one number where every host has as many."""
    return counts[0] if len(set(counts)) == 1 else list(counts)


def _counts_text(counts: Sequence[int]) -> str:
    k = _counts_json(counts)
    return f"{k} rank{'s' if k != 1 else ''}" if isinstance(k, int) else f"{' + '.join(map(str, counts))} ranks"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _sent(hosts: Any, links: int) -> list[int]:
    """Each host's tx bytes over every device."""
    return [sum(hosts.counters(i, f"eth{j}")[1] for j in range(links)) for i in range(hosts.n)]


def _traffic(hosts: Any, links: int) -> dict[str, int]:
    out = {}
    for j in range(links):
        rx, tx = hosts.counters(0, f"eth{j}")
        out[f"eth{j}"] = rx + tx
    return out


def run_one(hosts: Any, impl: str, ifaces: tuple[str, ...], port: int, args: argparse.Namespace) -> Run:
    """Start one rank per host, wait for both (``--timeout``), gather their times."""
    run = Run(impl, ifaces)
    master = hosts.addr(0, 0)
    cmd = [
        sys.executable,
        "-m",
        "aiodist.bench.hosts",
        "--worker",
        impl,
        ",".join(str(s) for s in args.sizes),
        str(args.warmup),
        str(args.iters),
        str(args.timeout),
    ]
    before = _traffic(hosts, hosts.links)
    sent0 = _sent(hosts, hosts.links)
    counts = args.nproc_per_host
    world = sum(counts)
    where = _host_ranks(counts)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aiodist_bench_hosts_") as tmp:
        procs, files = [], []
        try:
            for r in range(world):  # ranks contiguous by host
                out = open(pathlib.Path(tmp, f"{r}.out"), "wb")
                err = open(pathlib.Path(tmp, f"{r}.err"), "wb")
                files += [out, err]
                procs.append(hosts.popen(where[r][0], cmd, env=_env(master, port, r, ifaces, counts), stdout=out, stderr=err))
            deadline = t0 + args.timeout + 60.0  # start-up (imports, rendezvous) on top of the ops' timeout
            failed_at = None
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + 10.0:
                    break  # a rank failed: the other gets 10 s to fail on its own (its error says more), then is stopped
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # only our own rank processes, by handle (the harness kills their groups at close)
                    p.wait(10)
            for f in files:
                f.close()
        run.wall_s = time.monotonic() - t0
        texts = [
            (pathlib.Path(tmp, f"{r}.out").read_text(errors="replace"), pathlib.Path(tmp, f"{r}.err").read_text(errors="replace"))
            for r in range(world)
        ]
    results = []
    for r, (p, (out_s, _err)) in enumerate(zip(procs, texts)):
        lines = [line for line in out_s.splitlines() if line.startswith(RESULT)]
        if p.returncode != 0 or not lines:
            detail = "\n".join(
                f"--- rank {q} (host {q}) exit {pq.returncode} ---\nstdout:\n{_tail(o)}\nstderr:\n{_tail(e)}"
                for q, (pq, (o, e)) in enumerate(zip(procs, texts))
            )
            raise BenchError(f"{impl} on {','.join(ifaces)}: rank {r} exited {p.returncode} without a result\n{detail}")
        results.append(json.loads(lines[-1][len(RESULT) :]))
    for nbytes in args.sizes:
        per_rank = [res["times"][str(nbytes)] for res in results]
        run.times[nbytes] = [max(ts) for ts in zip(*per_rank)]
        run.cpu[nbytes] = [float(res["cpu"][str(nbytes)]) for res in results]
    after = _traffic(hosts, hosts.links)
    run.traffic = {dev: after[dev] - before[dev] for dev in after}
    run.sent = [b - a for a, b in zip(sent0, _sent(hosts, hosts.links))]
    return run


def congestion_control(hosts: Any, name: str | None) -> str:
    """Set ``net.ipv4.tcp_congestion_control`` to ``name`` in every host (new sockets there use it;
    the machine's own setting is untouched), or leave it as inherited (None); the one in effect."""
    key = "net.ipv4.tcp_congestion_control"
    for i in range(hosts.n) if name is not None else []:
        r = hosts.run(i, ["sysctl", "-q", "-w", f"{key}={name}"], timeout=10)
        if r.returncode != 0:
            allowed = hosts.run(i, ["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], timeout=10).stdout.strip()
            raise BenchError(f"--cc {name}: cannot set {key} in {hosts.names[i]}: {r.stderr.strip()} (allowed there: {allowed or '?'})")
    r = hosts.run(0, ["sysctl", "-n", key], timeout=10)
    return r.stdout.strip() or "?"


def _busbw(nbytes: int, t: float, world: int = HOSTS) -> float:
    return nbytes / t * 2 * (world - 1) / world if t > 0 else 0.0


def summarize(
    runs: Sequence[Run], sizes: Sequence[int], rate_bits: float | None, per_host: Sequence[int] = (1, 1), ops_per_size: int = 0
) -> list[dict[str, Any]]:
    """One row per (implementation, interface set, size), in bytes/s and seconds. ``ops_per_size``
    (the check, the warmups and the timed ops): with it, each host's bytes sent per op in units of
    the op's size (over every size of the run: sent / sum of the ops' sizes), beside the time
    over the link bound (size / one link's rate: what a host must send, at least, for 2 hosts)."""
    rows = []
    link_bytes = rate_bits / 8 if rate_bits else None
    one: dict[tuple[str, int], float] = {}
    for run in runs:
        for nbytes in sizes:
            ts = run.times[nbytes]
            t = statistics.median(ts)
            bus = _busbw(nbytes, t, sum(per_host))
            if len(run.ifaces) == 1:
                one[(run.impl, nbytes)] = bus
            base = one.get((run.impl, nbytes))
            total = sum(run.traffic.values())
            rows.append(
                {
                    "impl": run.impl,
                    "ifaces": list(run.ifaces),
                    "size": nbytes,
                    "count": nbytes // ITEMSIZE,
                    "times_s": ts,
                    "time_s": t,
                    "algbw_Bps": nbytes / t if t > 0 else 0.0,
                    "busbw_Bps": bus,
                    "pct_link": 100 * bus / link_bytes if link_bytes else None,
                    "striped_over_one": bus / base if len(run.ifaces) > 1 and base else None,
                    "cpu_share": run.cpu[nbytes],
                    "traffic_bytes": dict(run.traffic),
                    "traffic_share": {d: (b / total if total else 0.0) for d, b in run.traffic.items()},
                    "sent_per_host_S": (max(run.sent) / (ops_per_size * sum(sizes)) if run.sent and ops_per_size else None),
                    "over_link_bound": t / (nbytes / link_bytes) if link_bytes else None,
                    "nproc_per_host": _counts_json(per_host),
                    "wall_s": run.wall_s,
                }
            )
    return rows


def targets(rows: Sequence[dict[str, Any]], rate_bits: float | None) -> list[dict[str, Any]]:
    """The issue's two targets per implementation and size: PASS/MISS (or n/a without a rate)."""
    out = []
    for r in rows:
        if len(r["ifaces"]) == 1:
            if rate_bits is None:
                continue
            out.append({"impl": r["impl"], "size": r["size"], "what": "one interface busbw >= 90 % of the link rate",
                        "value": r["pct_link"], "target": TARGET_PCT, "pass": r["pct_link"] >= TARGET_PCT})  # fmt: skip
        elif r["striped_over_one"] is not None:
            out.append({"impl": r["impl"], "size": r["size"], "what": f"{'+'.join(r['ifaces'])} striped >= 1.8x one interface",
                        "value": r["striped_over_one"], "target": TARGET_RATIO, "pass": r["striped_over_one"] >= TARGET_RATIO})  # fmt: skip
    return out


def report(rows: Sequence[dict[str, Any]], tgts: Sequence[dict[str, Any]], links: int) -> str:
    devs = [f"eth{j}" for j in range(links)]
    headers = [
        "impl",
        "ifaces",
        "size(B)",
        "time(ms)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "% link",
        "striped/one",
        "cpu per rank",
        "sent/host (S)",
        "time/link bound",
        *(f"{d} MB" for d in devs),
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["impl"],
                ",".join(r["ifaces"]),
                str(r["size"]),
                f"{r['time_s'] * 1e3:.1f}",
                f"{r['algbw_Bps'] / 1e9:.3f}",
                f"{r['busbw_Bps'] / 1e9:.3f}",
                "-" if r["pct_link"] is None else f"{r['pct_link']:.1f}",
                "-" if r["striped_over_one"] is None else f"{r['striped_over_one']:.2f}x",
                "/".join(f"{100 * c:.0f}%" for c in r["cpu_share"]),
                "-" if r.get("sent_per_host_S") is None else f"{r['sent_per_host_S']:.2f}",
                "-" if r.get("over_link_bound") is None else f"{r['over_link_bound']:.2f}x",
                *(f"{r['traffic_bytes'].get(d, 0) / 1e6:.0f} ({100 * r['traffic_share'].get(d, 0.0):.0f}%)" for d in devs),
            ]
        )
    lines = [format_table(headers, table)]
    if tgts:
        lines += ["", "targets (aiodist's, torch's stated alongside):"]
        for t in tgts:
            val = f"{t['value']:.1f} %" if "link rate" in t["what"] else f"{t['value']:.2f}x"
            lines.append(f"  {'PASS' if t['pass'] else 'MISS'}  {t['impl']:<7}  {_human(t['size']):>4}  {t['what']:<45}  {val}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aiodist.bench hosts",
        description="all_reduce between 2 network-namespace hosts over tbf-shaped veth links: one interface vs two striped, "
        "aiodist and torch gloo side by side (needs root and iproute2; skips otherwise).",
    )
    p.add_argument("--rate", default="1gbit", metavar="RATE", help="tc tbf rate of every host device (default 1gbit; 'none': unshaped)")
    p.add_argument("--sizes", type=_sizes, default=[64 << 20], help="comma-separated all_reduce sizes, K/M/G suffixes (default 64M)")
    p.add_argument("--iters", type=int, default=5, help="timed all_reduces per size (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed all_reduces per size before the barrier (default 2)")
    p.add_argument("--impls", default=None, help="comma-separated: aiodist,torch (default: both, torch where importable)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a set-up's ops may take, plus 60 s for start-up (default 60)")
    p.add_argument(
        "--cc",
        metavar="NAME",
        help="TCP congestion control in the hosts (sysctl net.ipv4.tcp_congestion_control in both namespaces; "
        "a namespace may pick only from net.ipv4.tcp_allowed_congestion_control). Default: inherited from this machine",
    )
    p.add_argument(
        "--nproc-per-host",
        type=_per_host,
        default=(1, 1),
        metavar="K",
        help="rank processes on each host: K on every host, or one count per host for an uneven layout (3,1); default 1. "
        "More than 1 on a host: one interface only, and the bytes each host sends per op show whether the link is crossed "
        "once per byte: aiodist.algorithms.hier",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE ('-': stdout, instead of the table)")
    args = p.parse_args(argv)
    args.rate_text = args.rate.strip()
    try:
        args.rate = parse_rate(args.rate_text)  # bits/s, or None: unshaped
    except argparse.ArgumentTypeError as exc:
        p.error(f"--rate: {exc}")
    have_torch = importlib.util.find_spec("torch") is not None
    if args.impls is None:
        args.impl_list = ["aiodist", *(["torch"] if have_torch else [])]
    else:
        args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
        bad = [s for s in args.impl_list if s not in IMPLS]
        if bad or not args.impl_list:
            p.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
        if "torch" in args.impl_list and not have_torch:
            p.error("--impls torch: torch is not installed")
    if args.iters < 1 or args.warmup < 0 or args.timeout <= 0:
        p.error("need --iters >= 1, --warmup >= 0, --timeout > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    from aiodist.testing import netns

    to_stdout = args.json == "-"
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if to_stdout else print
    started = time.monotonic()
    info = machine_info()
    rate_desc = f"tbf rate {args.rate_text} burst 256kb latency 50ms" if args.rate else "unshaped"
    if (why := netns.unavailable_reason()) is not None:
        say(f"skipped: network namespaces cannot be made here ({why})", flush=True)
        if args.json:
            doc = json.dumps({"skipped": why, "machine": info}, indent=1)
            print(doc) if to_stdout else pathlib.Path(args.json).write_text(doc + "\n")
        return 0
    say("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    say(
        f"hosts: 2 network namespaces, 2 veth links (eth0, eth1), every host device {rate_desc}; "
        f"{_counts_text(args.nproc_per_host)} per host; "
        f"all_reduce float32 {','.join(_human(s) for s in args.sizes)}; {args.warmup} warmup + {args.iters} timed; "
        f"time = median over iterations of the slower rank's time; busbw = algbw * 2(n-1)/n",
        flush=True,
    )
    runs: list[Run] = []
    cc = "?"
    try:
        with netns.make_hosts(HOSTS, links=2, rate=args.rate_text if args.rate else None) as hosts:
            cc = congestion_control(hosts, args.cc)
            say(f"TCP congestion control in the hosts: {cc}{' (inherited from this machine)' if args.cc is None else ''}", flush=True)
            k = 0
            for impl in args.impl_list:
                for ifaces in IFACE_SETS if sum(args.nproc_per_host) == HOSTS else IFACE_SETS[:1]:
                    run = run_one(hosts, impl, ifaces, BASE_PORT + k, args)
                    k += 1
                    say(f"  {impl} on {','.join(ifaces)}: {run.wall_s:.1f} s", flush=True)
                    runs.append(run)
    except (BenchError, netns.NetnsError) as exc:
        say(f"\nBENCHMARK FAILED: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        say("\ninterrupted", flush=True)
        return 130
    rows = summarize(runs, args.sizes, args.rate, args.nproc_per_host, 1 + args.warmup + args.iters)
    tgts = targets(rows, args.rate)
    wall = time.monotonic() - started
    text = report(rows, tgts, 2)
    say()
    say(text)
    say(
        "\n% link = busbw / one link's rate; striped/one = busbw on eth0,eth1 over busbw on eth0 (same impl, size); "
        "cpu per rank = each rank process's CPU time over the timed loop's wall time (user+sys, all threads); "
        "sent/host (S) = the most any host sent over its links per op, in op sizes (2 hosts need 1.00); "
        "time/link bound = time over size / one link's rate; "
        "ethN MB = host 0's rx+tx bytes on ethN over the set-up's whole run (share of the total)",
        flush=True,
    )
    say(f"wall time {wall:.1f} s", flush=True)
    if args.json:
        doc = json.dumps(
            {
                "machine": info,
                "world_size": sum(args.nproc_per_host),
                "nproc_per_host": _counts_json(args.nproc_per_host),
                "rate": args.rate_text if args.rate else None,
                "rate_bits_per_s": args.rate,
                "tcp_congestion_control": cc,
                "sizes": args.sizes,
                "warmup": args.warmup,
                "iters": args.iters,
                "results": rows,
                "targets": tgts,
                "wall_s": wall,
            },
            indent=1,
        )
        if to_stdout:
            print(doc, flush=True)
        else:
            pathlib.Path(args.json).write_text(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
