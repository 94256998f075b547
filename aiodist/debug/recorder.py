"""The flight recorder, re-exported from the instrumentation layer (``aiodist._instrument.recorder``),
plus what needs the current World: ``dump_flight_recorder`` and ``dump_on_timeout``."""

from __future__ import annotations

import os
from typing import Any

from aiodist._instrument.recorder import (
    FORMAT_VERSION,
    STACK_LIMIT,
    Entry,
    FlightRecorder,
    buffer_size,
    current_comm_name,
    dump_dir_on_timeout,
    dump_groups,
    record_comm,
    user_stack,
)

__all__ = [
    "FlightRecorder",
    "Entry",
    "record_comm",
    "current_comm_name",
    "dump_flight_recorder",
    "dump_on_timeout",
    "buffer_size",
    "FORMAT_VERSION",
    "STACK_LIMIT",
    "user_stack",
]


def dump_flight_recorder(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """This rank's flight recorders (every live group of the current World) as a dict; written as
    JSON to ``path`` when given (a directory gets ``aiodist_fr_rank<N>.json`` inside it)."""
    from aiodist.c10d.world import current_world  # c10d imports this module: import it when called

    world = current_world()
    return dump_groups(world.rank, world.world_size, list(world.groups.values()), path)


def dump_on_timeout() -> None:
    """``AIODIST_FR_DUMP_ON_TIMEOUT=1``: write this rank's dump (called when an op times out)."""
    directory = dump_dir_on_timeout()
    if directory is not None:
        dump_flight_recorder(directory)
