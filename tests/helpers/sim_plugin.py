"""A pytest plugin that runs the real-GPU suite (tests/gpu) on the CuPy simulator
(tests/helpers/fake_cupy.py) for the whole session, so CI proves the suite's own code runs and
is right against a CuPy 14-shaped backend before it meets a GPU (tests/test_gpu_suite_on_sim.py).

Use: ``PYTHONPATH=tests python -m pytest tests/gpu -p helpers.sim_plugin -m cuda``.

The simulator must be in place before tests/gpu/conftest.py computes ``REASON`` at import, and
pytest imports the initial conftests (those of the paths given) before ``pytest_configure``; so
it is installed in ``pytest_load_initial_conftests`` (called for ``-p`` plugins, before any
conftest), and undone at ``pytest_unconfigure``.
"""

from __future__ import annotations

import os

import pytest
from helpers import fake_cupy

_STATE: dict[str, pytest.MonkeyPatch] = {}


def _install() -> None:
    if "mp" in _STATE:
        return
    mp = pytest.MonkeyPatch()
    mp.delenv("AIODIST_CUDA_DISABLE", raising=False)  # the probe is replaced anyway; keep it honest
    # one rank per process in tests/gpu/test_nccl_ops.py, but a sub-group or a second World in
    # this process must not be refused for sharing the one simulated GPU
    mp.setenv("NCCL_MULTI_RANK_GPU_ENABLE", os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "1"))
    fake_cupy.install(mp)
    # tests whose sizes only matter on a real GPU (kernels long enough to race) shrink on host memory
    mp.setenv("AIODIST_TEST_GPU_SIMULATED", "1")
    _STATE["mp"] = mp


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    _install()


def pytest_configure(config: pytest.Config) -> None:
    _install()  # loaded some other way (after the initial conftests): still before collection
    import aiodist_cuda

    if not aiodist_cuda.is_available():  # the simulator is what this plugin is for: fail loudly
        raise pytest.UsageError(f"helpers.sim_plugin: aiodist_cuda unavailable under the simulator: {aiodist_cuda.unavailable_reason()}")


def pytest_report_header(config: pytest.Config) -> str:
    return "aiodist_cuda: CuPy and NCCL are tests/helpers/fake_cupy.py's simulator (helpers.sim_plugin)"


def pytest_unconfigure(config: pytest.Config) -> None:
    mp = _STATE.pop("mp", None)
    if mp is not None:
        fake_cupy.uninstall()
        mp.undo()
