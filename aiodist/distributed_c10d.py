"""torch.distributed.distributed_c10d's path: the c10d API (``aiodist.c10d``) and ``record_comm``,
so that a port's ``from torch.distributed.distributed_c10d import ...`` becomes
``from aiodist.distributed_c10d import ...`` unchanged."""

from aiodist.c10d import *  # noqa: F403 - the module is a path to c10d's names
from aiodist.c10d import __all__ as _c10d_all
from aiodist.debug import record_comm

__all__ = [*_c10d_all, "record_comm"]
