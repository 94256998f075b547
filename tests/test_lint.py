"""ruff (with the ASYNC rules that catch blocking calls in coroutines) and mypy, as part of the
test run, so CI enforces them through README's one test command."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_ruff() -> None:
    r = run("ruff", "check", "aiodist", "aiodist_cuda", "tests", "examples")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy() -> None:
    r = run("mypy", "aiodist", "aiodist_cuda")
    assert r.returncode == 0, r.stdout + r.stderr
