"""``python -m aiodist.bench collectives --compare mpi``: how each MPI library is found (or the one
line that says why not), the best-MPI columns, and real runs against each library installed here
(each skips with the reason where it is not). Speeds are never asserted (docs/benchmarks.md)."""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import stat
import subprocess
import sys
import time

import pytest

from aiodist.bench import _mpi
from aiodist.bench import collectives as bc

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ("--ops", "all_reduce,barrier", "--min-bytes", "4", "--max-bytes", "1K", "--step", "16", "--iters", "3", "--warmup", "1")


def run_bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "collectives", "--nproc", "2", "--timeout", "30", "--no-lag-probe", "--no-floor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def tables(out: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """op -> (its header line, its rows split on whitespace)."""
    got: dict[str, tuple[list[str], list[list[str]]]] = {}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# "):
            got[line[2:].strip()] = ([lines[i + 1]], [])
        elif got and re.match(r"^\d+\s", line):
            list(got.values())[-1][1].append(line.split())
    return got


# ----------------------------------------------------------------------------- discovery


def _script(path: pathlib.Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


#: what a fake interpreter answers to the probe
GOOD = {
    "mpich": "MPICH Version:      5.0.2",
    "impi": "Intel(R) MPI Library 2021.18.1 for Linux* OS",
    "openmpi": "Open MPI v4.1.4, package: x",
}
NO_MPI4PY = "echo \"ModuleNotFoundError: No module named 'mpi4py'\" >&2; exit 1"


def _answers(library: str) -> str:
    return f"echo 4.1.2; echo '{library}'"


# (library, how its venv variable is set, what lies in the venv, the expected skip line, or
# None where the library is found). {v}: the venv's path.
VENV_CASES = [
    (
        "mpich",
        "unset",
        None,
        "no MPICH venv at {v} (AIODIST_BENCH_MPICH is unset; make one: python3 -m venv {v} && {v}/bin/pip install mpich mpi4py numpy; "
        "or set AIODIST_BENCH_MPICH=/path/to/venv)",
    ),
    (
        "impi",
        "set",
        None,
        "AIODIST_BENCH_IMPI={v}: no such folder (make the Intel MPI venv there: python3 -m venv {v} && {v}/bin/pip install impi-rt mpi4py numpy)",
    ),
    (
        "mpich",
        "set",
        {},
        "AIODIST_BENCH_MPICH={v}: {v}/bin/python is missing (not a venv; make one: python3 -m venv {v} && {v}/bin/pip install mpich mpi4py numpy)",
    ),
    (
        "impi",
        "set",
        {"python": _answers(GOOD["impi"])},
        "AIODIST_BENCH_IMPI={v}: no mpirun in {v}/bin ({v}/bin/pip install impi-rt mpi4py numpy)",
    ),
    (
        "mpich",
        "set",
        {"python": NO_MPI4PY, "mpirun": "exit 0"},
        "AIODIST_BENCH_MPICH={v}: {v}/bin/python cannot load mpi4py and numpy (ModuleNotFoundError: No module named 'mpi4py'); "
        "{v}/bin/pip install mpich mpi4py numpy",
    ),
    (
        "mpich",
        "unset",
        {"python": _answers(GOOD["impi"]), "mpirun": "exit 0"},
        "{v} (AIODIST_BENCH_MPICH is unset; that is the default): its mpi4py loads 'Intel(R) MPI Library 2021.18.1', not MPICH "
        "({v}/bin/pip install mpich mpi4py numpy)",
    ),
    ("mpich", "set", {"python": _answers(GOOD["mpich"]), "mpirun": "exit 0"}, None),
    ("impi", "unset", {"python": _answers(GOOD["impi"]), "mpirun": "exit 0"}, None),
]


@pytest.mark.parametrize(("name", "var", "venv", "line"), VENV_CASES)
def test_finding_mpich_and_intel_mpi(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, name: str, var: str, venv: dict[str, str] | None, line: str | None
) -> None:
    v = tmp_path / f"{name}-venv"
    monkeypatch.setitem(_mpi.DEFAULT_VENV, name, str(v))
    if venv is not None:
        v.mkdir()
        for tool, body in venv.items():
            _script(v / "bin" / tool, body)
    environ = {"PATH": os.environ.get("PATH", "")}
    if var == "set":
        environ[_mpi.VENV_VAR[name]] = str(v)
    got = _mpi.find(name, environ)
    if line is None:
        assert isinstance(got, _mpi.MpiLib), got
        assert (got.name, got.mpirun, got.python, got.venv, got.mpi4py) == (name, f"{v}/bin/mpirun", f"{v}/bin/python", str(v), "4.1.2")
        assert got.library == {"mpich": "MPICH 5.0.2", "impi": "Intel(R) MPI Library 2021.18.1"}[name]
    else:
        assert got == line.format(v=v)


# (what mpirun on PATH answers to --version, or None for no mpirun; what this Python answers
# to the probe; the expected skip line, or None). {bin}: the folder on PATH; {py}: the Python.
OPENMPI_CASES = [
    (
        None,
        _answers(GOOD["openmpi"]),
        "mpirun is not on PATH (install Open MPI: apt-get install openmpi-bin libopenmpi-dev, then pip install mpi4py)",
    ),
    (
        "echo 'HYDRA build details:'",
        _answers(GOOD["openmpi"]),
        "the mpirun on PATH ({bin}/mpirun: HYDRA build details:) is not Open MPI's; put Open MPI's first on PATH "
        "(apt-get install openmpi-bin libopenmpi-dev, then pip install mpi4py)",
    ),
    (
        "echo 'mpirun (Open MPI) 4.1.4'",
        NO_MPI4PY,
        "mpi4py is not installed in {py} (pip install mpi4py; it builds against the Open MPI that mpicc names)",
    ),
    (
        "echo 'mpirun (Open MPI) 4.1.4'",
        _answers(GOOD["mpich"]),
        "the mpi4py in {py} loads 'MPICH 5.0.2', not Open MPI (rebuild it against Open MPI: pip install --force-reinstall --no-binary=mpi4py mpi4py)",
    ),
    ("echo 'mpirun (Open MPI) 4.1.4'", _answers(GOOD["openmpi"]), None),
]


@pytest.mark.parametrize(("mpirun", "python", "line"), OPENMPI_CASES)
def test_finding_open_mpi(tmp_path: pathlib.Path, mpirun: str | None, python: str, line: str | None) -> None:
    bin_dir, py = tmp_path / "bin", tmp_path / "py" / "python"
    bin_dir.mkdir()
    _script(py, python)
    if mpirun is not None:
        _script(bin_dir / "mpirun", mpirun)
    got = _mpi.find("openmpi", {"PATH": str(bin_dir)}, python=str(py))
    if line is None:
        assert isinstance(got, _mpi.MpiLib), got
        assert (got.mpirun, got.python, got.venv, got.library) == (str(bin_dir / "mpirun"), str(py), None, "Open MPI v4.1.4")
    else:
        assert got == line.format(bin=bin_dir, py=py)


def test_each_library_is_launched_without_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ompi = _mpi.MpiLib("openmpi", "/usr/bin/mpirun", "/p/python", None, "Open MPI v4.1.4", "4.1.2")
    flags = ["--mca", "btl", "self,vader", "--bind-to", "none"]
    assert ompi.command(2, "/r.py", pass_on=["A"]) == ["/usr/bin/mpirun", *flags, "-np", "2", "-x", "A", "/p/python", "-I", "/r.py"]
    # more ranks than cores: Open MPI refuses to start without --oversubscribe
    assert ompi.command(3, "/r.py") == ["/usr/bin/mpirun", *flags, "--oversubscribe", "-np", "3", "/p/python", "-I", "/r.py"]
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in ompi.env({})
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # as root Open MPI wants the flag and both variables
    assert ompi.command(2, "/r.py")[:2] == ["/usr/bin/mpirun", "--allow-run-as-root"]
    assert ompi.env({})["OMPI_ALLOW_RUN_AS_ROOT"] == ompi.env({})["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    mpich = _mpi.MpiLib("mpich", "/v/bin/mpirun", "/v/bin/python", "/v", "MPICH 5.0.2", "4.1.2")
    assert mpich.command(4, "/r.py", pass_on=["A"]) == ["/v/bin/mpirun", "-bind-to", "none", "-np", "4", "/v/bin/python", "-I", "/r.py"]
    assert mpich.env({"PATH": "/usr/bin"})["PATH"] == "/v/bin:/usr/bin"
    impi = _mpi.MpiLib("impi", "/i/bin/mpirun", "/i/bin/python", "/i", "Intel(R) MPI Library 2021.18.1", "4.1.2")
    assert impi.command(2, "/r.py") == ["/i/bin/mpirun", "-np", "2", "/i/bin/python", "-I", "/r.py"]
    env = impi.env({"PATH": "/usr/bin", "X": "1"})
    assert (env["PATH"], env["I_MPI_FABRICS"], env["I_MPI_PIN"], env["X"]) == ("/i/bin:/usr/bin", "shm", "0", "1")


def test_the_mpi_rank_needs_only_numpy_and_mpi4py() -> None:
    """MPICH's and Intel MPI's venvs have no aiodist: the rank file imports the standard library,
    numpy and mpi4py, nothing else."""
    tree = ast.parse((ROOT / "aiodist" / "bench" / "_mpi_rank.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    assert names - set(sys.stdlib_module_names) == {"numpy", "mpi4py"}
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]


def test_compare_mpi_means_every_library_and_each_can_be_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fake(name: str) -> _mpi.MpiLib | str:
        asked.append(name)
        return "not here" if name == "mpich" else _mpi.MpiLib(name, "/m", "/p", None, "L", "4")

    monkeypatch.setattr(_mpi, "find", fake)
    args = bc.parse_args(["--compare", "mpi"])
    assert asked == ["openmpi", "mpich", "impi"]
    assert args.impls == ["openmpi", "impi"] and args.skipped == {"mpich": "not here"} and list(args.mpi) == ["openmpi", "impi"]
    asked.clear()
    args = bc.parse_args(["--compare", "impi"])
    assert asked == ["impi"] and args.impls == ["impi"] and not args.skipped


def test_every_library_missing_is_a_line_each_and_the_run_goes_on(tmp_path: pathlib.Path) -> None:
    env = {"PATH": "/nonexistent", _mpi.VENV_VAR["mpich"]: str(tmp_path / "m"), _mpi.VENV_VAR["impi"]: str(tmp_path / "i")}
    r = run_bench("--compare", "mpi", "--ops", "barrier", "--iters", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    skips = [line for line in r.stdout.splitlines() if ": skipped: " in line]
    assert skips == [
        "openmpi: skipped: mpirun is not on PATH (install Open MPI: apt-get install openmpi-bin libopenmpi-dev, then pip install mpi4py)",
        f"mpich: skipped: AIODIST_BENCH_MPICH={tmp_path}/m: no such folder (make the MPICH venv there: python3 -m venv {tmp_path}/m && "
        f"{tmp_path}/m/bin/pip install mpich mpi4py numpy)",
        f"impi: skipped: AIODIST_BENCH_IMPI={tmp_path}/i: no such folder (make the Intel MPI venv there: python3 -m venv {tmp_path}/i && "
        f"{tmp_path}/i/bin/pip install impi-rt mpi4py numpy)",
    ]
    assert "best MPI" not in r.stdout and list(tables(r.stdout)) == ["barrier"]


# ----------------------------------------------------------------------------- best MPI


def test_best_mpi_is_the_least_time_of_the_row() -> None:
    assert _mpi.best({"openmpi": 3e-6, "mpich": 2e-6, "impi": 5e-6}) == ("mpich", 2e-6)
    assert _mpi.best({"openmpi": None, "mpich": 4e-6, "impi": 1e-6}) == ("impi", 1e-6)
    assert _mpi.best({"openmpi": 2e-6, "mpich": 2e-6}) == ("openmpi", 2e-6)  # a tie: the first
    assert _mpi.best({"openmpi": None}) is None and _mpi.best({}) is None
    ten = [1.0] * 10
    mine = [4e-6 * x for x in ten]
    assert bc.mpi_cells(mine, {"openmpi": [8e-6] * 10, "mpich": [2e-6] * 10, "impi": None}) == [
        "8.0",
        "2.0",
        "-",
        "2.0",
        "mpich",
        "2.00(2.00-2.00)",
    ]
    assert bc.mpi_cells(mine, {"openmpi": None}) == ["-", "-", "-", "-"]
    assert bc.mpi_cells(mine[:3], {"openmpi": [8e-6] * 3}) == ["8.0", "8.0", "openmpi", "n/a"]  # too few iterations


def test_a_ratio_carries_its_spread_or_is_not_printed() -> None:
    a = [float(x) for x in range(10, 20)]  # median 14.5, quartiles 11.75 and 17.25
    b = [float(x) for x in range(20, 40, 2)]  # median 29, quartiles 23.5 and 34.5
    assert bc.ratio_cell(a, b) == "0.50(0.34-0.73)"  # 14.5/29, 11.75/34.5, 17.25/23.5
    assert bc.ratio_cell(a[:9], b) == "n/a" and bc.ratio_cell(a, b[:9]) == "n/a"


def test_report_has_a_column_per_library_then_the_best() -> None:
    def res(t: float) -> bc.Results:
        return {"all_reduce": {1: bc.Row([t] * 10, None, 0)}}

    out = bc.report(
        ["all_reduce"], 2, {"aiodist": res(6e-6), "torch": res(60e-6), "openmpi": res(4e-6), "mpich": res(3e-6), "impi": res(5e-6)}
    )
    header, rows = tables(out)["all_reduce"]
    assert re.search(
        r"torch\(us\)\s+torch busbw\s+aiodist/torch\s+openmpi\(us\)\s+mpich\(us\)\s+impi\(us\)\s+best MPI\(us\)\s+best MPI\s+aiodist/best-MPI$",
        header[0],
    )
    assert rows == [
        [
            "4",
            "1",
            "float32",
            "6.0",
            "0.001",
            "0.001",
            "0.0",
            "60.0",
            "0.000",
            "0.10(0.10-0.10)",
            "4.0",
            "3.0",
            "5.0",
            "3.0",
            "mpich",
            "2.00(2.00-2.00)",
        ]
    ]


# ----------------------------------------------------------------------------- real runs


@functools.cache
def _found(name: str) -> _mpi.MpiLib | str:
    return _mpi.find(name)


def _need(name: str) -> _mpi.MpiLib:
    got = _found(name)
    if isinstance(got, str):
        pytest.skip(f"{name} cannot run here: {got}")
    return got


@pytest.mark.subprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", _mpi.LIBS)
def test_a_tiny_run_against_each_library(name: str) -> None:
    lib = _need(name)
    r = run_bench("--compare", name, *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{name}: {lib.library}, mpi4py {lib.mpi4py}" in r.stdout and f"{name}: mpi4py {lib.mpi4py} over {lib.library}" in r.stdout
    got = tables(r.stdout)
    assert list(got) == ["all_reduce", "barrier"]
    assert [int(c[0]) for c in got["all_reduce"][1]] == [4, 64, 1024]
    for header, rows in got.values():
        assert f"{name}(us)" in header[0] and "aiodist/best-MPI" in header[0]
        for cells in rows:
            assert len(cells) == 11, cells
            assert float(cells[7]) > 0 and cells[8] == cells[7] and cells[9] == name and cells[10] == "n/a"  # 3 iterations


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_a_tiny_run_against_every_library_found_with_a_plot(tmp_path: pathlib.Path) -> None:
    found = [n for n in _mpi.LIBS if not isinstance(_found(n), str)]
    if len(found) < 2:
        pytest.skip(f"fewer than two MPI libraries here: {[(n, _found(n)) for n in _mpi.LIBS if n not in found]}")
    svg = tmp_path / "times.svg"
    plot = ["--plot", str(svg)] if bc.importlib.util.find_spec("matplotlib") is not None else []
    r = run_bench(
        "--compare",
        "mpi",
        "--ops",
        "all_reduce",
        "--min-bytes",
        "4",
        "--max-bytes",
        "4K",
        "--step",
        "32",
        "--iters",
        "10",
        "--warmup",
        "1",
        *plot,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    header, rows = tables(r.stdout)["all_reduce"]
    assert header[0].split()[7 : 7 + len(found)] == [f"{n}(us)" for n in found]
    for cells in rows:
        times = dict(zip(found, map(float, cells[7 : 7 + len(found)])))
        best_t, best_name, ratio = cells[7 + len(found) :]
        assert float(best_t) == min(times.values()) and times[best_name] == float(best_t)
        m = re.fullmatch(r"(\d+\.\d\d)\((\d+\.\d\d)-(\d+\.\d\d)\)", ratio)
        assert m, ratio
        assert float(m[1]) == pytest.approx(float(cells[3]) / float(best_t), rel=0.1, abs=0.01)  # from rounded cells
        assert float(m[2]) <= float(m[1]) <= float(m[3])
    if plot:
        text = svg.read_text()
        assert "all_reduce, 2 ranks" in text and all(n in text for n in ["aiodist", *found])


def test_plot_without_matplotlib_is_a_line_and_the_run_goes_on(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = bc.importlib.util.find_spec
    monkeypatch.setattr(bc.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    png = tmp_path / "x.png"
    assert (
        bc.main(
            ["--nproc", "2", "--ops", "barrier", "--iters", "1", "--warmup", "0", "--no-lag-probe", "--timeout", "30", "--plot", str(png)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plot: skipped: matplotlib is not installed: pip install matplotlib (or pip install 'aiodist[plot]')" in out.splitlines()
    assert not png.exists() and "plot: " + str(png) not in out


def test_plot_refuses_a_suffix_it_cannot_write(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bc.parse_args(["--plot", "x.txt"])
    assert e.value.code == 2 and "--plot: FILE must end in .png, .svg, .pdf" in capsys.readouterr().err


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_a_rank_that_loaded_another_library_fails_the_run() -> None:
    """The library found before the run is checked again by every rank: one that loaded another
    fails the run, naming both."""
    found = [lib for n in _mpi.LIBS if not isinstance(lib := _found(n), str)]
    if not found:
        pytest.skip(f"no MPI library here: {[_found(n) for n in _mpi.LIBS]}")
    lib = found[0]
    wrong = _mpi.MpiLib(lib.name, lib.mpirun, lib.python, lib.venv, "Another MPI 1.0", lib.mpi4py)
    side = bc.MpiSide(bc.Plan(lib.name, 2, 0, 20.0), wrong)
    try:
        side.start()
        with pytest.raises(bc.BenchError, match=rf"{lib.name} rank 0 loaded '{re.escape(lib.library)}', not 'Another MPI 1.0'"):
            side.wait_ready()
    finally:
        side.kill()


def _carrying(marker: bytes) -> list[int]:
    """The processes whose environment holds ``marker``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in pathlib.Path(f"/proc/{entry}/environ").read_bytes():
                    out.append(int(entry))
            except OSError:
                pass
    return out


@pytest.mark.subprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", _mpi.LIBS)
def test_a_failing_mpi_rank_fails_the_run_and_leaves_no_process(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 raises at its first row while rank 0 waits in MPI_Allreduce: the run fails with
    rank 1's traceback, and the kill reaches every process the launcher started (Intel MPI's
    mpirun is a sh script whose mpiexec.hydra outlived a SIGTERM to the script alone)."""
    lib = _need(name)
    monkeypatch.setenv(bc.FAIL_ENV, "1")
    side = bc.MpiSide(bc.Plan(name, 2, 0, 20.0), lib)
    mine = f"{bc.MPI_ENV}={bc.HOST}:".encode()  # completed with the port and this side's key at start
    try:
        side.start()
        mine += f"{side._listener.getsockname()[1]}:{side._key.hex()}".encode()  # type: ignore[union-attr]
        # the launcher, at least: once it has exec'd (between fork and exec a child still has
        # this process's environment: an Intel MPI mpirun, a shell script, was caught there)
        deadline = time.monotonic() + 10
        while not _carrying(mine) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_carrying(mine)) >= 1
        side.wait_ready()
        with pytest.raises(bc.BenchError, match=rf"{name} rank 1 failed during all_reduce of 16 B:\n(.|\n)*failing on purpose"):
            side.row("all_reduce", 4, 1, 2)
    finally:
        side.kill()
    assert _carrying(mine) == []
