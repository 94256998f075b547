"""The suite's loop plumbing (tests/conftest.py): which loop a test runs on, the one_loop opt-out
and its required reason, ``-k asyncio`` / ``-k uvloop`` selecting one loop's runs."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _conftest() -> ModuleType:
    """tests/conftest.py, loaded by its path (``import conftest`` may find tests/gpu's)."""
    spec = importlib.util.spec_from_file_location("aiodist_tests_conftest", Path(__file__).with_name("conftest.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_any_loop_names_the_running_loop(any_loop: str) -> None:
    loop = asyncio.get_running_loop()
    if any_loop == "asyncio":
        assert isinstance(loop, asyncio.BaseEventLoop)
        assert loop.get_debug(), "the asyncio variant runs in debug mode"
    else:
        uvloop = pytest.importorskip("uvloop")
        assert isinstance(loop, uvloop.Loop)


@pytest.mark.one_loop(reason="checks the opt-out itself")
async def test_an_opted_out_test_runs_once_in_debug_mode(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__name__ == "DebugEventLoop" and loop.get_debug()
    assert request.node.name == "test_an_opted_out_test_runs_once_in_debug_mode"  # no loop id


def test_one_loop_needs_a_reason() -> None:
    _one_loop_reason = _conftest()._one_loop_reason

    class Item:
        nodeid = "t"
        fixturenames = ()

        def __init__(self, mark: Any) -> None:
            self.mark = mark

        def get_closest_marker(self, name: str) -> Any:
            return self.mark

    assert _one_loop_reason(Item(None)) is None
    assert _one_loop_reason(Item(pytest.mark.one_loop(reason="why").mark)) == "why"
    for bare in (pytest.mark.one_loop.mark, pytest.mark.one_loop(reason=" ").mark):
        with pytest.raises(pytest.UsageError, match="needs a reason"):
            _one_loop_reason(Item(bare))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_k_selects_one_loops_runs(loop: str) -> None:
    # -k also matches marker names, and pytest-asyncio marks every async test "asyncio"
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-k", loop, "tests/test_hash_store.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    ids = [line for line in r.stdout.splitlines() if "::" in line and "test_k_selects_one_loops_runs" not in line]
    assert ids and all(f"[{loop}" in i for i in ids), r.stdout
