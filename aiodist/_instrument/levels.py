"""Debug levels: ``DebugLevel`` OFF / INFO / DETAIL, read from ``AIODIST_DEBUG`` (or torch's
``TORCH_DISTRIBUTED_DEBUG``, an alias). The level is process-wide, as torch's is; groups read it
when they are made (so a level set later applies to groups made later)."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

__all__ = ["DebugLevel", "get_debug_level", "on_level_change", "set_debug_level", "set_debug_level_from_env"]


class DebugLevel(enum.IntEnum):
    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:  # torch's enum prints "DebugLevel.DETAIL" (an IntEnum prints "2" on 3.11+)
        return f"DebugLevel.{self.name}"


_level = DebugLevel.OFF
#: called after every change of the level (aiodist._instrument.logs: the log level follows it,
#: torch's matrix); registered by the modules above, so this one imports none of them
_LISTENERS: list[Callable[[], None]] = []


def on_level_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` after every ``set_debug_level`` from now on."""
    _LISTENERS.append(fn)


def _parse(value: str, var: str) -> DebugLevel:
    try:
        return DebugLevel[value.strip().upper()]
    except KeyError:
        raise ValueError(f"{var}={value!r}: expected OFF, INFO or DETAIL") from None


def get_debug_level() -> DebugLevel:
    return _level


def set_debug_level(level: DebugLevel | str | int) -> None:
    """Set the process-wide debug level (a ``DebugLevel``, its name, or 0-2); groups made from now
    on use it, groups that exist keep theirs. A bad value is a ``ValueError``. The ``aiodist``
    loggers' level follows where it was set from ``AIODIST_LOG_LEVEL`` (aiodist._instrument.logs)."""
    global _level
    if isinstance(level, str):
        _level = _parse(level, "debug level")
    else:
        try:
            _level = DebugLevel(level)
        except ValueError:
            raise ValueError(f"debug level {level!r}: expected OFF, INFO or DETAIL (0, 1, 2)") from None
    for fn in _LISTENERS:
        fn()


def set_debug_level_from_env() -> None:
    """``AIODIST_DEBUG``, else ``TORCH_DISTRIBUTED_DEBUG``, else OFF."""
    for var in ("AIODIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        value = os.environ.get(var)
        if value:
            set_debug_level(_parse(value, var))
            return
    set_debug_level(DebugLevel.OFF)


set_debug_level_from_env()
