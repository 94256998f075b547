"""``python -m aiodist.bench hosts``: a tiny run across two network-namespace hosts ends with
sane JSON (both set-ups of each implementation, positive times, busbw consistent with the
times and the rate, the striped run's bytes on both interfaces and the one-interface run's on
eth0 only). Speeds are never asserted here (docs/benchmarks.md). Skips where namespaces cannot
be made (needs root and iproute2)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from aiodist.bench.hosts import parse_rate
from aiodist.testing import netns

ROOT = pathlib.Path(__file__).resolve().parent.parent
REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
SIZE = 1 << 20  # all_reduce of 1 MiB on 2 ranks: 512 KiB messages, over the 256 KiB striping threshold


def run_bench(tmp_path: pathlib.Path, *args: str, timeout: float = 60) -> dict[str, Any]:
    out = tmp_path / "hosts.json"
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "hosts", "--sizes", "1M", "--iters", "3", "--warmup", "1", "--timeout", "20"]
        + ["--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith(("GLOO_SOCKET_IFNAME", "AIODIST_SOCKET_IFNAME"))},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "busbw(GB/s)" in r.stdout and "striped/one" in r.stdout, r.stdout
    doc: dict[str, Any] = json.loads(out.read_text())
    assert isinstance(doc["tcp_congestion_control"], str) and doc["tcp_congestion_control"] not in ("", "?")
    return doc


def check(doc: dict[str, Any], impl: str, rate_bits: float | None) -> None:
    rows = [r for r in doc["results"] if r["impl"] == impl]
    assert [r["ifaces"] for r in rows] == [["eth0"], ["eth0", "eth1"]]
    one, striped = rows
    for r in rows:
        assert r["size"] == SIZE and r["count"] == SIZE // 4
        assert len(r["times_s"]) == 3 and all(t > 0 for t in r["times_s"])
        assert min(r["times_s"]) <= r["time_s"] <= max(r["times_s"])
        assert r["busbw_Bps"] == pytest.approx(SIZE / r["time_s"])  # 2 ranks: busbw = algbw
        if rate_bits is None:
            assert r["pct_link"] is None
        else:
            assert r["pct_link"] == pytest.approx(100 * r["busbw_Bps"] / (rate_bits / 8))
    assert one["striped_over_one"] is None
    assert striped["striped_over_one"] == pytest.approx(striped["busbw_Bps"] / one["busbw_Bps"])
    # (1 check + 1 warmup + 3 timed) all_reduces of 1 MiB: each rank sends and receives 1 MiB per op
    assert sum(one["traffic_bytes"].values()) > 5 * 2 * SIZE
    assert one["traffic_share"]["eth1"] < 0.05, one["traffic_bytes"]
    if impl == "aiodist":  # every message striped: both interfaces carry about half
        assert 0.35 < striped["traffic_share"]["eth1"] < 0.65, striped["traffic_bytes"]
    else:  # gloo runs each collective on one device, round-robin: both carry some
        assert striped["traffic_share"]["eth1"] > 0.1, striped["traffic_bytes"]
        assert striped["traffic_share"]["eth0"] > 0.1, striped["traffic_bytes"]


@needs_netns
@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_aiodist_across_hosts_shaped(tmp_path: pathlib.Path) -> None:
    doc = run_bench(tmp_path, "--impls", "aiodist", "--rate", "20gbit")
    assert doc["rate"] == "20gbit" and doc["rate_bits_per_s"] == 20e9 and doc["world_size"] == 2
    check(doc, "aiodist", 20e9)
    assert {(t["impl"], "link rate" in t["what"]) for t in doc["targets"]} == {("aiodist", True), ("aiodist", False)}


@needs_netns
@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_torch_across_hosts_unshaped(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch.distributed")
    doc = run_bench(tmp_path, "--impls", "torch", "--rate", "none")
    assert doc["rate"] is None and doc["rate_bits_per_s"] is None
    check(doc, "torch", None)
    assert [t["impl"] for t in doc["targets"]] == ["torch"]  # no rate: only the striped ratio


def test_rates_read_as_tc_reads_them() -> None:
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("500mbit") == 500e6
    assert parse_rate("100mbps") == 800e6  # tc: bps is bytes per second
    assert parse_rate("1mibit") == 2**20
    assert parse_rate("1000") == 1000
    assert parse_rate("none") is None and parse_rate("0") is None
    for bad in ("fast", "1gbits", "-1gbit"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rate(bad)


def test_ranks_per_host_take_one_count_or_one_per_host() -> None:
    from aiodist.bench.hosts import _host_ranks, _per_host

    assert _per_host("2") == (2, 2) and _per_host("3,1") == (3, 1)
    assert _host_ranks((3, 1)) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    for bad in ("0", "2,0", "1,2,3", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _per_host(bad)


def test_bad_arguments_exit_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "hosts", "--rate", "fast"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 2 and "--rate" in r.stderr, r.stderr


@needs_netns
@pytest.mark.subprocess
@pytest.mark.timeout(90)
def test_an_uneven_layout_reports_the_bytes_each_host_sends(tmp_path: pathlib.Path) -> None:
    """``--nproc-per-host 2,1``: 3 ranks (2 on host 0, 1 on host 1), one interface; each host
    sends about one op's size per all_reduce (the hierarchy's leaders cross the link once per
    byte; a flat ring of 3 sends 1.33 S from each host), reported beside the link bound. (An
    even layout's bytes: tests/test_multihost.py, on the devices' counters.)"""
    doc = run_bench(tmp_path, "--impls", "aiodist", "--rate", "20gbit", "--nproc-per-host", "2,1", timeout=80)
    assert doc["world_size"] == 3 and doc["nproc_per_host"] == [2, 1]
    (row,) = doc["results"]
    assert row["ifaces"] == ["eth0"] and row["nproc_per_host"] == [2, 1]
    assert 0.95 <= row["sent_per_host_S"] <= 1.2, row  # (start-up and the barrier on top: a few KB)
    assert row["over_link_bound"] == pytest.approx(row["time_s"] / (SIZE / (20e9 / 8)))
