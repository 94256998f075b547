"""Elastic-launch helpers (torch.distributed.elastic counterparts): ``record`` for workers
(``aiodist.elastic.errors``) and ``aiodist.elastic.utils``."""

from aiodist.elastic.errors import ChildFailedError, ProcessFailure, record

__all__ = ["record", "ChildFailedError", "ProcessFailure"]
