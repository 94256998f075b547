"""``python -m aiodist.bench collectives --compare before=PATH``: a side that runs an older aiodist
checkout (here: this tree's HEAD, exported with git, and a tiny fake tree), refusals before the
run, and a before rank's failure failing the run. Speeds are never asserted here."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from aiodist.bench import collectives as bc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    # smaller than --quick: each side's two ranks start once, and the rows are few and small
    quick = ["--min-bytes", "4", "--max-bytes", "1K", "--step", "16", "--iters", "3", "--warmup", "1", "--no-lag-probe", "--no-floor"]
    return subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "collectives", "--nproc", "2", "--timeout", "30", *quick, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def rows(out: str, op: str) -> list[list[str]]:
    lines = out.split(f"# {op}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.split() for line in lines[2:]]


@pytest.fixture(scope="module")
def head_tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """This repository's committed aiodist package (HEAD), exported into a temporary folder
    (git archive: no worktree to clean up)."""
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    tree = tmp_path_factory.mktemp("head")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "aiodist"], capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"not a git checkout with a HEAD: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    return tree


def test_before_side_runs_the_older_tree_with_ratio_columns(head_tree: pathlib.Path) -> None:
    r = run_bench("--ops", "all_reduce,barrier", "--compare", f"before={head_tree}")  # all_reduce: the checks run too
    assert r.returncode == 0, r.stdout + r.stderr
    init = os.path.join(os.path.realpath(head_tree), "aiodist", "__init__.py")
    assert f"before: every rank imported {init} (aiodist " in r.stdout, r.stdout
    assert f"before: {head_tree}, commit unknown (not a git checkout)" in r.stdout, r.stdout
    assert "before(us)" in r.stdout and "before busbw" in r.stdout and "aiodist/before" in r.stdout
    assert [c[0] for c in rows(r.stdout, "all_reduce")] == ["4", "64", "1024"]
    for op in ("all_reduce", "barrier"):
        for cells in rows(r.stdout, op):
            assert len(cells) == 10, cells  # 7 of aiodist's (no lag column) + before's time, busbw, ratio
            assert float(cells[7]) > 0 and cells[9] == "n/a"  # too few iterations for a ratio


def test_tree_commit_names_this_checkouts_head() -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert bc.tree_commit(str(ROOT)).startswith(head[:12])


@pytest.mark.parametrize(
    "files, why",
    [
        ({}, "no aiodist package there"),  # the import finds this tree's installed aiodist instead: refused
        ({"aiodist/__init__.py": "raise ImportError('broken on purpose')\n"}, "no importable aiodist there"),
    ],
)
def test_a_tree_without_an_importable_aiodist_is_refused_before_the_run(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], why: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        bc.parse_args(["--compare", f"before={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--compare before={tmp_path}: refused: {why}" in err, err


def test_compare_before_needs_a_path_and_only_one(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit):
        bc.parse_args(["--compare", "before"])
    assert "--compare: unknown ['before']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bc.parse_args(["--compare", f"before={tmp_path},before={tmp_path}"])
    assert "more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bc.parse_args(["--compare", f"before={tmp_path / 'nothing'}"])
    assert "is not a folder" in capsys.readouterr().err


FAKE = '''"""A fake older aiodist: a group that needs no peer; all_reduce is broken."""
__version__ = "0.0.fake"


async def init_process_group(*args, **kwargs):
    pass


async def barrier(*args, **kwargs):
    pass


async def all_reduce(*args, **kwargs):
    raise RuntimeError("fake tree: all_reduce is broken")


async def destroy_process_group(*args, **kwargs):
    pass
'''


def test_a_failing_before_rank_fails_the_run_with_its_traceback(tmp_path: pathlib.Path) -> None:
    (tmp_path / "aiodist").mkdir()
    (tmp_path / "aiodist" / "__init__.py").write_text(FAKE)
    r = run_bench("--ops", "barrier,all_reduce", "--compare", f"before={tmp_path}")  # barrier's row passes, all_reduce's fails
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(aiodist 0.0.fake)" in r.stdout
    assert "BENCHMARK FAILED: before rank " in r.stderr and "failed during all_reduce of 4 B" in r.stderr, r.stderr
    assert "Traceback" in r.stderr and "fake tree: all_reduce is broken" in r.stderr


@pytest.mark.parametrize("nrows", [75, 76])  # 76: the default sweep to 64 MiB, a multiple of 2 sides
@pytest.mark.parametrize("impls", [["aiodist", "before"], ["aiodist", "torch", "before"]])
def test_every_row_has_every_side_first_over_as_many_rounds(nrows: int, impls: list[str]) -> None:
    for row in range(nrows):
        firsts = {bc.side_order(impls, row, rnd)[0] for rnd in range(len(impls))}
        assert firsts == set(impls), (row, firsts)
        assert sorted(bc.side_order(impls, row, 0)) == sorted(impls)
    assert bc.side_order(impls, 0, 0)[0] != bc.side_order(impls, 1, 0)[0]  # next rows alternate too
