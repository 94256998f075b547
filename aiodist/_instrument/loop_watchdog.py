"""The loop watchdog: one small thread per event loop that runs aiodist ranks, measuring the
loop's lag. Every 0.25 s it posts a heartbeat (``loop.call_soon_threadsafe``); when the loop has
not run one for longer than ``AIODIST_LOOP_BLOCKED_WARN`` seconds (default 2; 0 turns it off)
it logs a WARNING with the loop thread's Python stack, taken from ``sys._current_frames()``:

    rank 1: event loop blocked for 2.0 s at train.py:42 in step: time.sleep(60) ...

and publishes the same (``loop_state(owner)``, readable from any thread: the debug worker serves
it from its own thread). When the loop runs again it logs how long it was blocked and records a
``loop_blocked`` entry (kind ``loop``) in each owner's flight recorder, from the loop itself (a
recorder is not written from other threads).

Owners are opaque (c10d passes each initialised World with its default group's recorder; this
layer imports nothing from c10d). Ranks that share a loop (``aiodist.testing.run_world``) share
its watchdog; the thread stops when its last owner is unwatched (``destroy_process_group``) or
its loop is closed. Decisions and costs: docs/debugging.md, "Blocked event loops".
"""

from __future__ import annotations

import asyncio
import linecache
import logging
import os
import sys
import sysconfig
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from aiodist.knobs import knob

__all__ = [
    "watch_loop",
    "unwatch_loop",
    "loop_state",
    "watchdog_of",
    "warn_after_s",
    "LoopWatchdog",
    "frame_stack",
    "loop_stack",
    "blame",
    "WARN_ENV",
]

log = logging.getLogger("aiodist.debug.loop")

WARN_ENV = "AIODIST_LOOP_BLOCKED_WARN"
_DEFAULT_WARN_S = 2.0
_INTERVAL_S = 0.25
_STACK_LIMIT = 32

_lock = threading.Lock()
_BY_LOOP: dict[asyncio.AbstractEventLoop, LoopWatchdog] = {}
_BY_OWNER: weakref.WeakKeyDictionary[Any, LoopWatchdog] = weakref.WeakKeyDictionary()

_AIODIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def warn_after_s() -> float:
    """``AIODIST_LOOP_BLOCKED_WARN`` in seconds (default 2; 0 or less: no watchdog). A value that
    is not a number warns and reads as the default: init must not fail over a debugging knob."""
    try:
        return knob(WARN_ENV).number()
    except ValueError as exc:
        warnings.warn(f"{exc}; using {_DEFAULT_WARN_S:g}", RuntimeWarning, stacklevel=3)
        return _DEFAULT_WARN_S


def _where(path: str) -> str:
    """A file as the warning shows it: relative to the working directory when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def frame_stack(frame: FrameType | None, limit: int = _STACK_LIMIT) -> list[str]:
    """``frame``'s stack, outermost first, as ``"file:line in function: source line"`` (the
    innermost ``limit`` frames)."""
    out: list[str] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno).strip()
        out.append(f"{_where(code.co_filename)}:{frame.f_lineno} in {code.co_name}" + (f": {line}" if line else ""))
        frame = frame.f_back
    out.reverse()
    return out


_HANDLE_RUN = os.path.join(os.path.dirname(os.path.abspath(asyncio.__file__)), "events.py")


def loop_stack(frame: FrameType | None) -> list[str]:
    """The loop thread's stack from the callback or task step the loop is running, down: the
    frames above it (``run_forever``, ``_run_once``, whatever started the loop) are the same for
    every block and are left out."""
    frames: list[FrameType] = []
    f = frame
    while f is not None and len(frames) < _STACK_LIMIT:
        if frames and os.path.abspath(f.f_code.co_filename) == _HANDLE_RUN:
            break  # Handle._run, the loop's call of a callback or task step: the loop's own frames start here
        frames.append(f)
        f = f.f_back
    return [s for fr in reversed(frames) for s in frame_stack(fr, limit=1)]


def blame(frame: FrameType | None) -> str:
    """The frame to name: the innermost one outside the standard library and aiodist (the user's
    ``time.sleep(60)``, not ``selectors.py``), else the innermost one."""
    innermost = frame
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith((_STDLIB_DIR, _AIODIST_DIR)) and not frame.f_code.co_filename.startswith("<frozen"):
            break
        frame = frame.f_back
    chosen = frame if frame is not None else innermost
    return frame_stack(chosen, limit=1)[0] if chosen is not None else "(no Python frame)"


class LoopWatchdog:
    """The watchdog of one event loop (made by ``watch_loop`` on the loop's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, warn_s: float) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.warn_s = warn_s
        self.interval = min(_INTERVAL_S, warn_s / 4)
        self.owners: weakref.WeakKeyDictionary[Any, tuple[Any, str]] = weakref.WeakKeyDictionary()  # owner -> (recorder, label)
        # owner -> publish(text): tells the owner's peers (c10d: a store key, written with a
        # blocking socket from this thread) that its loop is blocked ("<since> <at>"), or "" when
        # it runs again; peers' timeout messages then name the block
        self.publishers: weakref.WeakKeyDictionary[Any, Callable[[str], None]] = weakref.WeakKeyDictionary()
        self._clear = False  # the loop ran again after a published block: publish "" (thread)
        self.beats = 0
        self.max_lag_s = 0.0
        self.last_block: dict[str, Any] | None = None  # the latest block that ended
        self._last_answer = time.monotonic()
        self._posted: float | None = None  # when the unanswered heartbeat was posted
        self._blocked: dict[str, Any] | None = None  # the block being reported (watchdog thread)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="aiodist loop watchdog", daemon=True)

    def __repr__(self) -> str:
        return f"<LoopWatchdog {self.labels()}: warn after {self.warn_s:g} s, {self.beats} beats>"

    def labels(self) -> str:
        names = sorted(label for _, label in list(self.owners.values()))
        return ", ".join(names) or "no owner"

    # -- the watchdog thread -------------------------------------------------------------------

    def _run(self) -> None:
        loop = self.loop
        while not self._stop.wait(self.interval):
            if loop.is_closed():
                break
            now = time.monotonic()
            if self._clear:
                self._clear = False
                self._publish("")
            if not loop.is_running():  # between run_until_complete calls: stopped, not blocked
                self._last_answer, self._posted = now, None
                continue
            if self._posted is None:
                self._posted = now
                try:
                    loop.call_soon_threadsafe(self._beat, now)
                except RuntimeError:  # closed meanwhile
                    break
                continue
            lag = now - self._last_answer
            if lag >= self.warn_s and self._blocked is None:
                self._report(lag)
        _forget(self)

    def _publish(self, text: str) -> None:
        for publish in list(self.publishers.values()):
            try:
                publish(text)
            except Exception as exc:  # a store that is gone: the warning above still says it
                log.debug("%s: could not publish the loop's state: %r", self.labels(), exc)

    def _report(self, lag: float) -> None:
        frame = sys._current_frames().get(self.loop_thread)
        stack, at = loop_stack(frame), blame(frame)
        del frame
        self._blocked = {"since": time.time() - lag, "since_monotonic": time.monotonic() - lag, "at": at, "stack": stack}
        log.warning(
            "%s: event loop blocked for %.1f s at %s (%s=%g); the loop thread's stack, innermost last:\n    %s",
            self.labels(),
            lag,
            at,
            WARN_ENV,
            self.warn_s,
            "\n    ".join(stack),
        )
        if self.publishers:
            self._publish(f"{self._blocked['since']:.3f} {at}")

    # -- on the loop ---------------------------------------------------------------------------

    def _beat(self, posted: float) -> None:
        now = time.monotonic()
        self.beats += 1
        self.max_lag_s = max(self.max_lag_s, now - posted)
        self._last_answer, self._posted = now, None
        b = self._blocked
        if b is not None:
            self._blocked = None
            self._clear = bool(self.publishers)
            self._woke(b, now)

    def _woke(self, b: dict[str, Any], now: float) -> None:
        took = now - b["since_monotonic"]
        done = b["since"] + took
        self.last_block = {"since": b["since"], "until": done, "blocked_s": took, "at": b["at"], "stack": b["stack"]}
        log.warning("%s: event loop ran again after %.1f s blocked at %s", self.labels(), took, b["at"])
        meta = {"local": {"blocked_s": round(took, 3), "at": b["at"]}}
        for recorder, _ in list(self.owners.values()):
            if recorder is not None:
                recorder.note("loop_blocked", "loop", meta, b["since"], done)

    # -- from any thread -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What the debug worker shows: whether the loop is blocked now (for how long, where:
        a fresh stack), the latest block that ended, the largest heartbeat lag seen."""
        posted, last = self._posted, self._last_answer
        lag = time.monotonic() - last if posted is not None and self.loop.is_running() else 0.0
        out: dict[str, Any] = {
            "watched": True,
            "warn_s": self.warn_s,
            "blocked": lag >= self.warn_s,
            "lag_s": lag,
            "at": None,
            "stack": None,
            "since": None,
            "max_lag_ms": self.max_lag_s * 1000,
            "last_block": self.last_block,
        }
        if lag > self.interval * 2:  # not answering a heartbeat: say where it is now
            frame = sys._current_frames().get(self.loop_thread)
            out.update(at=blame(frame), stack=loop_stack(frame), since=time.time() - lag)
            del frame
        return out


def _forget(dog: LoopWatchdog) -> None:
    with _lock:
        if _BY_LOOP.get(dog.loop) is dog:
            del _BY_LOOP[dog.loop]
        for owner in [o for o, d in list(_BY_OWNER.items()) if d is dog]:
            del _BY_OWNER[owner]


def watch_loop(owner: Any, recorder: Any = None, label: str = "", publish: Callable[[str], None] | None = None) -> LoopWatchdog | None:
    """Watch the running loop on behalf of ``owner`` (c10d: a World, at init), recording blocks in
    ``recorder`` (a FlightRecorder) and naming the loop ``label`` ("rank 0") in the warnings.
    Starts the loop's watchdog thread if it has none. None when ``AIODIST_LOOP_BLOCKED_WARN``
    is 0 or less, or no loop runs."""
    warn_s = warn_after_s()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    if warn_s <= 0:
        return None
    with _lock:
        dog = _BY_LOOP.get(loop)
        if dog is None or not dog.thread.is_alive():
            dog = _BY_LOOP[loop] = LoopWatchdog(loop, warn_s)
            dog.thread.start()
        dog.owners[owner] = (recorder, label or repr(owner))
        if publish is not None:
            dog.publishers[owner] = publish
        _BY_OWNER[owner] = dog
    return dog


def unwatch_loop(owner: Any) -> None:
    """``owner`` no longer needs its loop watched (destroy_process_group); the thread stops, and
    is joined, when no owner is left. A no-op for an owner that is not watched."""
    with _lock:
        dog = _BY_OWNER.pop(owner, None)
        if dog is None:
            return
        dog.owners.pop(owner, None)
        dog.publishers.pop(owner, None)
        if len(dog.owners):
            return
        if _BY_LOOP.get(dog.loop) is dog:
            del _BY_LOOP[dog.loop]
        dog._stop.set()
    if dog.thread.ident != threading.get_ident():
        dog.thread.join(timeout=1.0)


def watchdog_of(owner: Any) -> LoopWatchdog | None:
    return _BY_OWNER.get(owner)


def loop_state(owner: Any) -> dict[str, Any] | None:
    """``owner``'s loop state (``LoopWatchdog.state``), or None when its loop is not watched."""
    dog = _BY_OWNER.get(owner)
    return None if dog is None else dog.state()
