"""``python -m aiodist.bench collectives``: a quick run parses as a table, with and without torch
alongside, and a failing rank fails the run. Speeds are never asserted here (docs/benchmarks.md)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

from aiodist.bench import __main__ as bench_main
from aiodist.bench.collectives import FAIL_ENV, OPS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "collectives", "--quick", "--nproc", "2", "--timeout", "30", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def parse(out: str) -> dict[str, list[list[str]]]:
    """op -> its rows (cells split on whitespace)."""
    tables: dict[str, list[list[str]]] = {}
    op = None
    for line in out.splitlines():
        if line.startswith("# "):
            op = line[2:].strip()
            tables[op] = []
        elif op is not None and re.match(r"^\d+\s", line):
            tables[op].append(line.split())
    return tables


def check_rows(tables: dict[str, list[list[str]]], ncols: int) -> None:
    assert set(tables) == set(OPS)
    for op, rows in tables.items():
        assert rows, f"{op}: no rows"
        for cells in rows:
            assert len(cells) == ncols, cells
            size, count, dtype, t, alg, bus = cells[:6]
            assert dtype == "float32"
            assert int(size) == 4 * int(count)
            assert float(t) > 0 and float(alg) >= 0 and float(bus) >= 0
    assert [r[0] for r in tables["barrier"]] == ["0"]
    assert [int(r[0]) for r in tables["all_reduce"]] == [4, 64, 1024, 16384]


def test_quick_run_prints_a_table_per_op() -> None:
    r = run_bench()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "size(B)" in r.stdout and "busbw(GB/s)" in r.stdout and "median" in r.stdout
    check_rows(parse(r.stdout), 6)
    assert "torch(us)" not in r.stdout


def test_quick_run_against_torch() -> None:
    pytest.importorskip("torch.distributed")
    r = run_bench("--compare", "torch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "aiodist/torch" in r.stdout
    tables = parse(r.stdout)
    check_rows(tables, 9)
    for rows in tables.values():
        for cells in rows:
            assert float(cells[6]) > 0 and float(cells[8]) > 0  # torch's time, the ratio


def test_a_failing_rank_fails_the_run_with_its_traceback() -> None:
    r = run_bench("--ops", "all_reduce", env={FAIL_ENV: "1"})
    assert r.returncode == 1
    assert "BENCHMARK FAILED" in r.stderr and "aiodist rank 1 failed" in r.stderr
    assert "Traceback" in r.stderr and "failing on purpose" in r.stderr


def test_no_name_runs_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    class Fake:
        @staticmethod
        def main(argv: list[str]) -> int:
            seen.append(argv)
            return 0

    monkeypatch.setattr(bench_main.importlib, "import_module", lambda name: seen.append(name) or Fake)
    assert bench_main.main([]) == 0
    assert seen == ["aiodist.bench.collectives", []]
    seen.clear()
    assert bench_main.main(["--compare", "torch", "--nproc", "4"]) == 0  # options first: still collectives
    assert seen == ["aiodist.bench.collectives", ["--compare", "torch", "--nproc", "4"]]


def test_help_lists_both_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "collectives" in out and "store" in out
