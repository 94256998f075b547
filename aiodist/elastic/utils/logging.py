"""torch.distributed.elastic.utils.logging's path: ``get_logger`` (aiodist.elastic.utils)."""

from aiodist.elastic.utils import get_logger

__all__ = ["get_logger"]
