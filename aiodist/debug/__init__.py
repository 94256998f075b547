"""Debugging that explains hangs: debug levels (``AIODIST_DEBUG``), the flight recorder and
``record_comm``, the loop watchdog (docs/debugging.md); the debug HTTP server and the
flight-recorder analyzer (docs/debug_server.md).

Two layers: the instrumentation (levels, recorder, desync, loop watchdog) lives below c10d in
``aiodist._instrument`` and is re-exported here; the tools above c10d (server, handlers,
analyze, breakpoint) are here. The server and its handlers load on first use, so ``import
aiodist`` does not import aiohttp."""

from typing import TYPE_CHECKING, Any

from aiodist._instrument.desync import DesyncError
from aiodist._instrument.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from aiodist._instrument.logs import TRACE, configure_logging
from aiodist.debug.analyze import analyze, format_report
from aiodist.debug.breakpoint import breakpoint
from aiodist.debug.recorder import FlightRecorder, current_comm_name, dump_flight_recorder, record_comm

if TYPE_CHECKING:
    from aiodist.debug.handlers import DebugHandler, default_handlers
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

_LAZY = {
    "DebugHandler": "aiodist.debug.handlers",
    "default_handlers": "aiodist.debug.handlers",
    "frontend_url": "aiodist.debug.server",
    "start_debug_server": "aiodist.debug.server",
    "stop_debug_server": "aiodist.debug.server",
}


def __getattr__(name: str) -> Any:  # PEP 562: the aiohttp-based tools load when first named
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiodist.debug' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
