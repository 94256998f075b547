"""torch.distributed.elastic.utils.distributed's path: ``get_free_port`` (aiodist.elastic.utils)."""

from aiodist.elastic.utils import get_free_port

__all__ = ["get_free_port"]
