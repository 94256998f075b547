"""Finding CuPy, its NCCL and a GPU, once per process, without failing the import of aiodist_cuda.

``load()`` returns the CuPy module (with ``cupy.cuda.nccl`` loaded) or raises ``DistBackendError``
with the reason; ``reason()`` is that reason, or "" where the backend can run.
"""

from __future__ import annotations

from typing import Any

from aiodist.errors import DistBackendError
from aiodist.knobs import value

__all__ = ["load", "reason", "nccl_version"]

_state: dict[str, Any] = {}

_NCCL_PIP = "pip install nvidia-nccl-cu12 (nvidia-nccl-cu13 with cupy-cuda13x)"


def _probe() -> tuple[Any, Any, str]:
    if value("AIODIST_CUDA_DISABLE") == "1":
        return None, None, "AIODIST_CUDA_DISABLE=1 is set"
    try:
        import cupy
    except ImportError as exc:
        return None, None, f"CuPy is not installed ({exc}); pip install 'aiodist[cuda]'"
    except Exception as exc:  # a broken CuPy install (wrong CUDA major, missing libraries)
        return None, None, f"CuPy failed to import: {type(exc).__name__}: {exc}"
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return cupy, None, f"CuPy's NCCL bindings did not load ({type(exc).__name__}: {exc}); {_NCCL_PIP}"
    if not getattr(nccl, "available", False):
        return cupy, None, f"CuPy was built without NCCL; {_NCCL_PIP} (CuPy 14 does not bundle NCCL)"
    try:
        nccl.get_version()
    except Exception as exc:
        return cupy, None, f"the NCCL library could not be loaded ({type(exc).__name__}: {exc}); {_NCCL_PIP}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: cudaErrorInsufficientDriver / cudaErrorNoDevice
        return cupy, nccl, f"no usable GPU: {exc}"
    if count < 1:
        return cupy, nccl, "no GPU is visible (CUDA reports 0 devices; check CUDA_VISIBLE_DEVICES)"
    return cupy, nccl, ""


def _get() -> tuple[Any, Any, str]:
    if "probe" not in _state:
        _state["probe"] = _probe()
    got: tuple[Any, Any, str] = _state["probe"]
    return got


def reason() -> str:
    """Why the NCCL backend cannot run here ("" when it can)."""
    return _get()[2]


def load() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``; DistBackendError with the reason where they cannot run."""
    cupy, nccl, why = _get()
    if why:
        raise DistBackendError(f"backend 'nccl' is not available: {why}")
    return cupy, nccl


def nccl_version() -> int | None:
    """NCCL's runtime version code (e.g. 23203 for 2.32.3), None where NCCL is not loaded."""
    nccl = _get()[1]
    if nccl is None:
        return None
    try:
        return int(nccl.get_version())
    except Exception:
        return None


def reset_probe() -> None:
    """Forget the probe (tests that change the environment)."""
    _state.clear()
