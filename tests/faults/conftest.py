"""The fault tier (tests/faults): every test here is marked ``faults``, and every test must leave
no process it started alive. The check scans /proc for descendants of this pytest process
before and after each test; a descendant born during the test and still running at its end is
SIGKILLed (our own pids only) and fails the test, so a leak is both cleaned up and reported."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a conftest's hook sees the whole session's items: mark only the ones under this folder
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.faults)


def _live_descendants(root: int) -> set[int]:
    """Pids of ``root``'s descendants that are not zombies (a zombie is dead, just unreaped)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # comm (field 2) may hold spaces and parentheses: split after its closing ')'
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] == b"Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    me = os.getpid()
    before = _live_descendants(me)
    yield
    left = _live_descendants(me) - before
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes started by this test still alive at its end (now SIGKILLed): {sorted(left)}"
