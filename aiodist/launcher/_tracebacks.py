"""What a worker died of, read from its stderr: the last Python traceback's exception line and
when the launcher received it (for a worker that wrote no error file, i.e. no ``@record``).

Sans-I/O: the output pump feeds whole lines with the time they arrived; ``last`` is the latest
traceback seen. Rules it keeps:

- a report starts at ``Traceback (most recent call last):`` (``Exception Group Traceback``
  too); its exception line is the first line after it that is not indented;
- a chained report (``The above exception was the direct cause ...``, ``During handling ...``)
  continues the one before: its final exception is the one that ended the process, and the
  time stays the report's first line;
- in an exception group (lines prefixed ``|``/``+``) the group's own line is kept (as
  ``@record`` writes ``ExceptionGroup: ...``), not its last sub-exception's;
- a traceback under ``Exception ignored in: ...`` (an unraisable one) or asyncio's ``Task
  exception was never retrieved`` / ``future: <Task ...>`` is not a cause of death: both are
  printed at shutdown, after the real cause;
- ``aiodist.errors.DistNetworkError: text`` is given as ``DistNetworkError: text``: the words
  ``@record`` writes, so a stderr report and an error file are classified alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Cause", "TracebackScanner"]

_HEAD = "Traceback (most recent call last):"
_CHAIN = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
_IGNORED = ("Exception ignored in", "future: <", "Task exception was never retrieved", "Future exception was never retrieved")
_GROUP_PREFIX = re.compile(r"^\s*[|+](?: |$)")  # "  | ", "    | ", "  + Exception Group ..."
_EXC_LINE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::(?: (.*))?)?$")


@dataclass(frozen=True)
class Cause:
    """An exception a worker printed: ``Type: message`` and when its traceback began (ns)."""

    message: str
    time_ns: int


class TracebackScanner:
    """Feed a worker's stderr lines (``feed``); ``last`` is the last traceback's cause."""

    def __init__(self) -> None:
        self.last: Cause | None = None
        self._in_frames = False  # after a header, before its exception line
        self._start_ns = 0  # first line of the current report
        self._ignored = False  # the current report is an unraisable one
        self._group = False  # the current report is an exception group: its first line stays
        self._found = False  # the current report has its exception line
        self._prev = ""  # the last non-blank line, group prefix removed

    def feed(self, line: str, now_ns: int) -> None:
        raw = line.rstrip("\r\n")
        grouped = bool(_GROUP_PREFIX.match(raw))
        text = _GROUP_PREFIX.sub("", raw, count=1) if grouped else raw
        stripped = text.strip()
        if not stripped:
            return
        if stripped.endswith(_HEAD):
            # A new report, unless this continues one: a chained exception, or a sub-exception
            # inside the group being printed.
            continues = self._prev in _CHAIN or (grouped and self._group)
            if not continues:
                self._start_ns = now_ns
                self._ignored = self._prev.startswith(_IGNORED)
                self._group = stripped != _HEAD  # "Exception Group Traceback ..."
                self._found = False
            elif not grouped:
                self._found = False  # a chained report: its exception is the later one
            self._in_frames = True
        elif self._in_frames and not text[:1].isspace():
            self._in_frames = False
            m = _EXC_LINE.match(text)
            if m and not self._found and not self._ignored:
                self._found = True
                name = m.group(1).rsplit(".", 1)[-1]
                body = m.group(2)
                self.last = Cause(f"{name}: {body}" if body else name, self._start_ns)
        self._prev = stripped
