"""Tier 3: the store demo, README's API-in-brief job under the launcher, and a smoke run of the benchmark,
as real processes with hard timeouts."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(180)]


def test_store_demo_runs_and_checks_its_totals() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "store_demo.py"), "--workers", "3", "--tasks", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "[coordinator] OK" in out
    assert "tasks_done counter = 9" in out
    for w in (1, 2, 3):
        assert f"[worker {w}] finished after" in out


def test_store_demo_fails_cleanly_when_a_worker_dies(tmp_path: pathlib.Path) -> None:
    """A worker that cannot join (no such port) fails the job with a message, not a hang."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "store_demo.py"), "--worker", "1", "--port", "1", "--world-size", "2", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode != 0
    assert "DistNetworkError" in r.stderr and "127.0.0.1:1" in r.stderr


def test_store_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "store", "--ops", "50", "--repeat", "1", "--clients", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    variants = {s["variant"] for s in data["samples"]}
    assert {"aiodist-seq", "aiodist-pipelined"} <= variants
    assert all(s["ops_per_s"] > 0 for s in data["samples"])
    assert "targets" in r.stdout


def test_bench_help_lists_benchmarks() -> None:
    # without arguments it runs the collectives benchmark (tests/test_bench_collectives.py)
    r = subprocess.run([sys.executable, "-m", "aiodist.bench", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "store" in r.stdout and "collectives" in r.stdout


def test_readme_api_snippet_runs_under_the_launcher(tmp_path: pathlib.Path) -> None:
    """README's "API in brief" job, exactly as printed there, under aiodist-run with 3 ranks."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"## API in brief\n\n```python\n(.*?)```", readme, re.S)
    assert m is not None, "README lost its API-in-brief job"
    job = tmp_path / "job.py"
    job.write_text(m.group(1) + "\nprint('snippet done', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "3", str(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.endswith("snippet done")) == [f"[rank{i}]: snippet done" for i in range(3)]
