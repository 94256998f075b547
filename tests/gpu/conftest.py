"""GPU tests (tests/gpu): every test here carries the ``cuda`` marker and skips, with
``aiodist_cuda.unavailable_reason()``, where NCCL cannot run (no CuPy, no NCCL, no GPU).

Importing ``aiodist_cuda`` never fails: it only *tries* CuPy (see ``aiodist_cuda._cupy``), so
collection works on CI machines without CuPy. Tests reach CuPy through the ``cp`` fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import aiodist_cuda

HERE = Path(__file__).resolve().parent

#: why the GPU tests skip here ("" where they run)
REASON = aiodist_cuda.unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # every test of this folder is a GPU test, so `-m cuda` selects them and `-m "not cuda"` leaves them out
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def cp() -> Any:
    """The CuPy module (only requested by tests that run: the skip comes first)."""
    if REASON:
        pytest.skip(f"aiodist_cuda unavailable: {REASON}")
    import cupy

    return cupy
