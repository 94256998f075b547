"""``python -m aiodist.bench ddp``: a tiny run prints the compute-only, aiodist DDP and torch DDP
rows, the ratios and the bit-identity check, and writes its JSON. Speeds are never asserted
here (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # the benchmark trains torch modules: nothing of it runs without torch
pytest.importorskip("torch.distributed")

from aiodist.bench import __main__ as bench_main  # noqa: E402
from aiodist.bench.ddp import chunks  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUM = r"-?\d+\.\d"


def test_listed() -> None:
    assert "ddp" in bench_main.BENCHMARKS
    assert re.search(r"^\s+ddp\s", bench_main.usage(), re.MULTILINE)


def test_chunks_split_the_steps_evenly() -> None:
    assert chunks(20, 4) == [5, 5, 5, 5]
    assert chunks(7, 3) == [3, 2, 2]
    assert chunks(2, 4) == [1, 1]  # never an empty turn
    assert sum(chunks(23, 5)) == 23


@pytest.mark.timeout(90)
def test_tiny_run_against_torch(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ddp.json"
    args = ["--quick", "--models", "tiny", "--ranks", "2", "--steps", "2", "--compare", "torch", "--timeout", "30", "--json", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "ddp", *args],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=ROOT,
        env={**os.environ, "AIODIST_DEBUG": "OFF"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout
    assert text.startswith("machine: "), text
    assert "# tiny: " in text and "step(ms)" in text and "ddp bwd comm" in text
    # the detail rows: step, overhead, fwd/bwd/opt, then the DDP's own four parts (compute-only has none)
    assert re.search(rf"^compute-only\s+2\s+{NUM}\s+-\s+{NUM}\s+{NUM}\s+{NUM}\s+-\s+-\s+-\s+-$", text, re.MULTILINE), text
    for row in ("aiodist DDP", "torch DDP"):
        assert re.search(rf"^{row}\s+2(\s+{NUM}){{9}}$", text, re.MULTILINE), text
    # the summary: compute, aiodist, torch, step ratio, overheads, overhead ratio (or '-'), params = torch's
    m = re.search(rf"^tiny\s+2\s+({NUM})\s+({NUM})\s+({NUM})\s+(\d+\.\d\d)\s+{NUM}\s+{NUM}\s+(\S+)\s+(yes|no)$", text, re.MULTILINE)
    assert m, text
    assert m.group(6) == "yes"
    assert "bit-identical: yes (tiny, 2 ranks" in text
    doc = json.loads(out.read_text())
    rows = {(x["model"], x["ranks"], x["row"]): x for x in doc["rows"]}
    assert set(rows) == {("tiny", 2, "compute-only"), ("tiny", 2, "aiodist DDP"), ("tiny", 2, "torch DDP")}
    assert all(len(x["steps_ms"]) == 2 and x["step_ms"] > 0 for x in rows.values())
    # the printed ratio is the unrounded times' (the printed times are rounded to 0.1 ms: tiny steps)
    ratio = rows[("tiny", 2, "aiodist DDP")]["step_ms"] / rows[("tiny", 2, "torch DDP")]["step_ms"]
    assert float(m.group(4)) == pytest.approx(ratio, abs=0.006)
    assert rows[("tiny", 2, "aiodist DDP")]["params_sha256"] == rows[("tiny", 2, "torch DDP")]["params_sha256"]
    assert set(rows[("tiny", 2, "aiodist DDP")]["ddp_ms"]) == {
        "avg_forward_compute_time",
        "avg_backward_compute_time",
        "avg_backward_comm_time",
        "avg_backward_compute_comm_overlap_time",
    }
    assert doc["bit_identical"] == {"tiny/2": True}


def test_refuses_bad_arguments() -> None:
    from aiodist.bench.ddp import parse_args

    for bad in (["--models", "nope"], ["--ranks", "1"], ["--compare", "mpi"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    a = parse_args(["--quick"])
    assert (a.rank_list, a.steps, a.warmup, a.rounds, a.model_list) == ([2], 3, 1, 1, ["mlp", "small"])
    a = parse_args([])
    assert (a.rank_list, a.steps, a.warmup, a.rounds, a.torch) == ([2, 4], 20, 3, 4, False)
