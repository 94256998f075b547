"""Debugging that explains hangs: debug levels (``AIODIST_DEBUG``), the flight recorder and
``record_comm`` (docs/debugging.md)."""

from aiodist.debug.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from aiodist.debug.recorder import FlightRecorder, current_comm_name, dump_flight_recorder, record_comm

__all__ = [
    "DebugLevel",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
    "FlightRecorder",
    "current_comm_name",
    "dump_flight_recorder",
    "record_comm",
]
