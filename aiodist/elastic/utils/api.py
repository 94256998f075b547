"""torch.distributed.elastic.utils.api's path: ``get_env_variable_or_raise`` (aiodist.elastic.utils)."""

from aiodist.elastic.utils import get_env_variable_or_raise

__all__ = ["get_env_variable_or_raise"]
