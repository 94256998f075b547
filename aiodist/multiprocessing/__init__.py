"""torch.multiprocessing's process launching for aiodist: ``spawn``, ``start_processes`` and
their ``ProcessContext`` and exceptions (docs/spawn.md). ``fn`` may be an ``async def``."""

from aiodist.multiprocessing.spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
    start_processes,
)

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]
