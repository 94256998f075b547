"""Data parallelism: ``DistributedDataParallel`` (alias ``DDP``) for CPU torch modules, and the
``Reducer`` under it, which buckets and all-reduces the gradients of plain parameter lists
(numpy arrays or torch tensors).

- ``_buckets``: which gradients share a bucket (pure, torch's rules, tested as a table).
- ``reducer``: ``Reducer`` and ``GradBucket``; no torch import.
- ``distributed``: ``DistributedDataParallel``, a ``torch.nn.Module``; imports torch, so it is
  loaded only when one of its names is used (``import aiodist.nn.parallel`` needs no torch).
"""

from __future__ import annotations

from typing import Any

from aiodist.nn.parallel.reducer import GradBucket, Reducer

__all__ = ["DDP", "DistributedDataParallel", "GradBucket", "Reducer"]


def __getattr__(name: str) -> Any:
    if name in ("DistributedDataParallel", "DDP"):
        from aiodist.nn.parallel import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'aiodist.nn.parallel' has no attribute {name!r}")
