"""torch.distributed.elastic.utils' helpers: environment, free port, log level, logger.

One implementation here; torch's module paths re-export it, so a port that swaps
``torch.distributed`` for ``aiodist`` in its imports keeps them: ``aiodist.elastic.utils.api``
(``get_env_variable_or_raise``), ``.distributed`` (``get_free_port``), ``.log_level``
(``get_log_level``), ``.logging`` (``get_logger``)."""

from __future__ import annotations

import logging as _logging  # (the name `logging` is this package's submodule, torch's path)
import os
import socket
import sys

__all__ = ["get_env_variable_or_raise", "get_free_port", "get_log_level", "get_logger"]

_HANDLER_MARK = "_aiodist_stderr_handler"


def get_env_variable_or_raise(env_name: str) -> str:
    """The value of environment variable ``env_name``; ``ValueError`` naming it if unset."""
    value = os.environ.get(env_name)
    if value is None:
        raise ValueError(f"Environment variable {env_name} expected, but not set")
    return value


def get_free_port() -> int:
    """An unused TCP port on localhost, found by binding port 0 and closing the socket.

    The port is not reserved: another process may take it before you bind it. aiodist's own
    servers bind port 0 directly and report the port they got; prefer that.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def get_log_level() -> str:
    """The default log level: ``WARNING``."""
    return "WARNING"


def get_logger(name: str | None = None) -> _logging.Logger:
    """A logger that writes to stderr at the level in ``LOGLEVEL`` (default WARNING).

    With no ``name``, the calling module's name is used.
    """
    if name is None:
        name = sys._getframe(1).f_globals.get("__name__", "aiodist")
    logger = _logging.getLogger(name)
    logger.setLevel(os.environ.get("LOGLEVEL", get_log_level()).upper())
    if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        handler = _logging.StreamHandler(sys.stderr)
        handler.setFormatter(_logging.Formatter("[%(levelname)s] %(asctime)s %(name)s: %(message)s"))
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)
        logger.propagate = False
    return logger
