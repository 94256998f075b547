"""Logging levels, re-exported from the instrumentation layer (``aiodist._instrument.logs``)."""

from aiodist._instrument.logs import (
    LOG_LEVEL_VARS,
    TRACE,
    configure_logging,
    configure_logging_at_import,
    effective_log_level,
)

__all__ = ["TRACE", "configure_logging", "configure_logging_at_import", "effective_log_level", "LOG_LEVEL_VARS"]
