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


def run_bench(*args: str, env: dict[str, str] | None = None, floor: bool = False) -> subprocess.CompletedProcess[str]:
    """A --quick run; without the floor probe unless ``floor`` (its two columns are checked by
    their own test)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "aiodist.bench",
            "collectives",
            "--quick",
            "--nproc",
            "2",
            "--timeout",
            "30",
            *args,
            *([] if floor else ["--no-floor"]),
        ],
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


LAG = re.compile(r"^(\d+\.\d)/(\d+\.\d)/(\d+\.\d)$")


def check_lag_and_mem(cells: list[str]) -> None:
    """Columns 7 and 8: the loop-lag probe's p50/p99/max (ms; '-' when it never woke up within
    the timed iterations) and the peak memory growth (MiB)."""
    m = LAG.match(cells[6])
    assert m or cells[6] == "-", cells
    if m:
        p50, p99, top = map(float, m.groups())
        assert 0 <= p50 <= p99 <= top
    assert float(cells[7]) >= 0


def test_the_small_rows_show_the_python_floor() -> None:
    """The floor probe (aiodist.bench.floor) runs in the same invocation: every row up to 64 KiB
    gets the floor's time and aiodist's time over it; barrier (no size) and bigger rows get '-'."""
    r = run_bench("--ops", "all_reduce,barrier", "--no-lag-probe", floor=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "floor(us)" in r.stdout and "aiodist/floor" in r.stdout and "floor = the Python floor" in r.stdout
    tables = parse(r.stdout)
    for cells in tables["all_reduce"]:
        assert len(cells) == 9, cells  # 7 of aiodist's (no lag column) + the floor's two
        t, floor, ratio = float(cells[3]), float(cells[7]), float(cells[8])
        assert floor > 0 and ratio == pytest.approx(t / floor, rel=0.05, abs=0.01)
    assert [c[7:] for c in tables["barrier"]] == [["-", "-"]]


def test_the_floor_probe_measures_an_exchange() -> None:
    from aiodist.bench.floor import measure

    for n, nbytes in ((2, 4), (3, 4096)):
        t = measure(n, nbytes, iters=200)
        assert 0 < t < 0.01, (n, nbytes, t)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        measure(1)


def test_quick_run_prints_a_table_per_op() -> None:
    r = run_bench()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "size(B)" in r.stdout and "busbw(GB/s)" in r.stdout and "median" in r.stdout
    assert "lag p50/p99/max(ms)" in r.stdout and "mem+(MiB)" in r.stdout
    assert re.search(r"loop lag with no op running .*: \d+\.\d/\d+\.\d/\d+\.\d ms", r.stdout), r.stdout
    tables = parse(r.stdout)
    check_rows(tables, 8)
    for rows in tables.values():
        for cells in rows:
            check_lag_and_mem(cells)
    assert "torch(us)" not in r.stdout and "mpi: skipped" not in r.stdout


def test_quick_run_against_torch_without_the_probe() -> None:
    pytest.importorskip("torch.distributed")
    r = run_bench("--compare", "torch", "--no-lag-probe")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "aiodist/torch" in r.stdout and "lag p50" not in r.stdout
    tables = parse(r.stdout)
    check_rows(tables, 10)
    for rows in tables.values():
        for cells in rows:
            assert float(cells[6]) >= 0  # mem+
            assert float(cells[7]) > 0 and cells[9] == "n/a"  # torch's time; no ratio from --quick's 3 iterations
    assert "n/a: no ratio from 3 timed iterations per row (--iters x --rounds; --quick runs 3: at least 10 are needed" in r.stdout


# The MPI sides (Open MPI, MPICH, Intel MPI: how each is found, the best-MPI columns, real runs
# against each library installed here, --plot without matplotlib): tests/test_bench_mpi.py.


def test_unknown_compare_is_refused() -> None:
    r = run_bench("--compare", "nccl")
    assert r.returncode == 2 and "--compare: unknown ['nccl']" in r.stderr


def test_plot_draws_a_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    r = run_bench("--ops", "all_reduce,barrier", "--no-lag-probe", "--plot", str(png))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"plot: {png}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


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


@pytest.mark.timeout(30)  # before the fix this hung in the handshake: the timeout was the failure
def test_mpi_side_drops_a_connection_that_stalls_in_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Something that connects to the coordinator's port and says nothing is dropped after the
    start-up bound (here 1.5 s), which then fails the run naming it, instead of hanging."""
    import socket
    import time

    from aiodist.bench import _mpi
    from aiodist.bench import collectives as bc

    monkeypatch.setattr(bc, "STARTUP", 1.5)
    side = bc.MpiSide(bc.Plan("openmpi", 1, 0, 0.0), _mpi.MpiLib("openmpi", "mpirun", sys.executable, None, "Open MPI", "4"))
    side._listener = socket.create_server((bc.HOST, 0))
    side.mpirun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for mpirun
    stalled = socket.create_connection(side._listener.getsockname())
    t0 = time.monotonic()
    try:
        with pytest.raises(bc.BenchError, match=r"1 rank\(s\) did not connect within 1.5 s"):
            side.wait_ready()
    finally:
        stalled.close()
        side.kill()
    assert time.monotonic() - t0 < 10
