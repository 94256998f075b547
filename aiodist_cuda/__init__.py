"""aiodist_cuda: GPU collectives through CuPy's NCCL, as a backend of aiodist.

Not built yet. This placeholder exists so the distribution's layout is final; it registers no
backend and never pretends to have one. ``is_available()`` says False and
``unavailable_reason()`` says why.
"""

from __future__ import annotations

__all__ = ["is_available", "unavailable_reason"]


def is_available() -> bool:
    """Whether the NCCL backend can run here. Always False until GPU support is built."""
    return False


def unavailable_reason() -> str:
    return "aiodist_cuda is a placeholder: GPU support (NCCL through CuPy) is not built yet"
