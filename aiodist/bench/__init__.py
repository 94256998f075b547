"""Benchmarks: aiodist against torch.distributed, side by side in one run.

Run ``python -m aiodist.bench`` for the list; ``python -m aiodist.bench store --help`` for one.

These are measurements, not tests: nothing here asserts a speed. Every benchmark runs both
implementations in the same invocation and reports ratios, because absolute numbers on a
small shared machine drift by tens of percent between runs; only ratios taken within one run
are worth comparing. Correctness checks (a counter that must add up) do fail loudly.

This module holds the helpers the benchmarks share: a description of the machine and a plain
text table.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

__all__ = ["machine_info", "package_version", "format_table"]


def package_version(name: str) -> str:
    """The installed version of ``name``, or ``"not installed"`` (without importing it)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, str]:
    """What a reader needs to judge the numbers: cores, interpreter, the libraries measured."""
    return {
        "cpus": str(os.cpu_count()),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "uvloop": package_version("uvloop"),
        "torch": package_version("torch"),
        "aiodist": package_version("aiodist"),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``rows`` under ``headers``; the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
