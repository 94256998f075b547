"""Logging: the level of the ``aiodist`` logger tree (every aiodist logger is named
``aiodist.<module>``) from ``AIODIST_LOG_LEVEL``, or torch's ``TORCH_CPP_LOG_LEVEL`` as an alias,
combined with the debug level as torch's matrix does:

==================  ===============  ===================
log level           debug level      effective level
==================  ===============  ===================
ERROR               ignored          ERROR
WARNING             ignored          WARNING
INFO                OFF              INFO
INFO                INFO             DEBUG
INFO                DETAIL           TRACE (everything)
==================  ===============  ===================

``FATAL`` reads as ``CRITICAL``; ``DEBUG`` and ``TRACE`` may also be given directly. With neither
variable set the ``aiodist`` logger is left alone (it inherits the root logger's level, WARNING
by default). When the variable is set and nothing handles log records yet (no handler on the
root logger or the ``aiodist`` logger), a stderr handler is added to ``aiodist`` so the chosen
level is actually seen, as torch's C++ logs are.

Where the application has configured no logging at all, Python would print aiodist's warnings
and errors through its last-resort handler, as the bare message (it reads like a ``print``).
``aiodist`` instead carries a fallback handler that, only while the root logger has no handler,
prints WARNING and above in ``logging``'s default format, ``ERROR:aiodist.c10d:...``: the level
and the logger's name, which is what to configure. Once the application configures logging
(``logging.basicConfig(...)``), the fallback stays silent and the records go there.

``configure_logging()`` runs when ``aiodist`` is imported, and again whenever
``set_debug_level`` changes the debug level (the matrix depends on it).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from aiodist._instrument.levels import DebugLevel, get_debug_level, on_level_change

__all__ = ["TRACE", "configure_logging", "effective_log_level", "LOG_LEVEL_VARS"]

TRACE = 5  # below DEBUG: per-op logs of DETAIL groups
logging.addLevelName(TRACE, "TRACE")

LOG_LEVEL_VARS = ("AIODIST_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")
_NAMES = {
    "TRACE": TRACE,
    "ALL": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
    "CRITICAL": logging.CRITICAL,
}
_HANDLER_NAME = "aiodist.debug.logs"
_applied: str | None = None  # the log level last applied: a new debug level refines it


def _parse(value: str, var: str) -> int:
    try:
        return _NAMES[value.strip().upper()]
    except KeyError:
        raise ValueError(f"{var}={value!r}: expected one of INFO, WARNING, ERROR, FATAL (or DEBUG, TRACE)") from None


def effective_log_level(log_level: str, debug_level: DebugLevel | None = None) -> int:
    """torch's matrix: ``INFO`` becomes DEBUG at debug level INFO and TRACE at DETAIL; every
    other log level is taken as it is."""
    level = _parse(log_level, "log level")
    debug = get_debug_level() if debug_level is None else DebugLevel(debug_level)
    if level == logging.INFO:
        return {DebugLevel.OFF: logging.INFO, DebugLevel.INFO: logging.DEBUG, DebugLevel.DETAIL: TRACE}[debug]
    return level


def configure_logging(log_level: str | None = None) -> int | None:
    """Set the ``aiodist`` logger's level from ``log_level`` (else ``AIODIST_LOG_LEVEL``, else
    ``TORCH_CPP_LOG_LEVEL``) and the current debug level; return the level set, or None when no
    level was given (the logger is then left as it is). A bad value is a ``ValueError``."""
    global _applied
    source = "log level"
    if log_level is None:
        for var in LOG_LEVEL_VARS:
            value = os.environ.get(var)
            if value:
                log_level, source = value, var
                break
    if log_level is None:
        _applied = None
        return None
    _parse(log_level, source)  # the variable's name in the message
    level = effective_log_level(log_level)
    _applied = log_level
    logger = logging.getLogger("aiodist")
    logger.setLevel(level)
    if not logging.getLogger().handlers and not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s pid %(process)d] %(message)s"))
        logger.addHandler(handler)
    return level


class _Fallback(logging.Handler):
    """WARNING and above of the ``aiodist`` tree, in ``logging``'s default format, to the current
    ``sys.stderr``, while the application has configured no logging (the module docstring)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or any(h.get_name() == _HANDLER_NAME for h in logging.getLogger("aiodist").handlers):
            return  # the application's handlers (or AIODIST_LOG_LEVEL's) print it
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr at shutdown: logging's own rule
            self.handleError(record)


def install_fallback() -> None:
    """Add the fallback handler to the ``aiodist`` logger (once)."""
    logger = logging.getLogger("aiodist")
    if not any(isinstance(h, _Fallback) for h in logger.handlers):
        logger.addHandler(_Fallback())


def _refresh() -> None:
    """The debug level changed: recompute the matrix for the log level last applied."""
    if _applied is not None:
        configure_logging(_applied)


def configure_logging_at_import() -> None:
    """``configure_logging()`` from the environment; a bad value warns instead of failing the
    import (``TORCH_CPP_LOG_LEVEL`` may be set for torch with values aiodist does not know)."""
    install_fallback()
    try:
        configure_logging()
    except ValueError as exc:
        warnings.warn(f"aiodist: {exc}; the aiodist loggers keep their level", RuntimeWarning, stacklevel=2)


on_level_change(_refresh)  # the matrix depends on the debug level
configure_logging_at_import()  # AIODIST_LOG_LEVEL / TORCH_CPP_LOG_LEVEL, with the debug level read
