"""The instrumentation layer, below c10d: debug levels, logging levels, the flight recorder,
DETAIL's desync check and the loop watchdog. Nothing here imports ``aiodist.c10d`` or aiohttp
(groups are passed in); the tools above c10d (the debug server, its handlers, the analyzer,
``breakpoint``) are in ``aiodist.debug``. tests/test_layers.py keeps it so."""

from aiodist._instrument import logs as _logs  # noqa: E402,F401 - configures logging as any part of aiodist is imported
