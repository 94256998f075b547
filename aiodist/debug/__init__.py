"""Debugging that explains hangs: debug levels (``AIODIST_DEBUG``), the flight recorder and
``record_comm`` (docs/debugging.md); the debug HTTP server and the flight-recorder analyzer
(docs/debug_server.md)."""

from aiodist.debug.analyze import analyze, format_report
from aiodist.debug.breakpoint import breakpoint
from aiodist.debug.desync import DesyncError
from aiodist.debug.handlers import DebugHandler, default_handlers
from aiodist.debug.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from aiodist.debug.logs import TRACE, configure_logging
from aiodist.debug.recorder import FlightRecorder, current_comm_name, dump_flight_recorder, record_comm
from aiodist.debug.server import frontend_url, start_debug_server, stop_debug_server

__all__ = [
    "breakpoint",
    "DesyncError",
    "TRACE",
    "configure_logging",
    "analyze",
    "format_report",
    "DebugHandler",
    "default_handlers",
    "frontend_url",
    "start_debug_server",
    "stop_debug_server",
    "DebugLevel",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
    "FlightRecorder",
    "current_comm_name",
    "dump_flight_recorder",
    "record_comm",
]
