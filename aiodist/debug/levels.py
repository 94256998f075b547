"""Debug levels, re-exported: they live in the instrumentation layer below c10d
(``aiodist._instrument.levels``; docs/debugging.md, "Two layers")."""

from aiodist._instrument.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]
