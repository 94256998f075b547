"""torch.distributed.elastic.utils.log_level's path: ``get_log_level`` (aiodist.elastic.utils)."""

from aiodist.elastic.utils import get_log_level

__all__ = ["get_log_level"]
