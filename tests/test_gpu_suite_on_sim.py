"""The real-GPU suite (tests/gpu) runs, and passes, on the CuPy simulator (tests/helpers/fake_cupy.py
through the pytest plugin tests/helpers/sim_plugin.py), in a subprocess of its own: CI proves the
suite's code is runnable and right against a CuPy 14-shaped backend, so a run on a real GPU is not
spent on bugs in the tests. In-process, tests/gpu still skips where there is no GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

#: tests/gpu/test_nccl_ops.py's tests: 26, of which test_reductions_every_op[bfloat16] needs ml_dtypes
GPU_TESTS = 26
EXPECTED_PASSED = GPU_TESTS if importlib.util.find_spec("ml_dtypes") is not None else GPU_TESTS - 1


def _count(summary: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", summary)
    return int(m.group(1)) if m else 0


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_gpu_suite_passes_on_the_simulator() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("AIODIST_CUDA_DISABLE", None)
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-p", "helpers.sim_plugin", "-m", "cuda", "-rs"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    assert proc.returncode == 0, f"tests/gpu on the simulator exited {proc.returncode}:\n{out}"
    assert _count(summary, "failed") == 0 and _count(summary, "error") == 0, out
    assert _count(summary, "passed") >= EXPECTED_PASSED, f"expected {EXPECTED_PASSED} passed, summary {summary!r}:\n{out}"
