"""Test-suite plumbing: event loops to run on, and "nothing passed" is a failure.

Event loops
    pytest-asyncio (1.5) builds each async test's loop through the ``pytest_asyncio_loop_factories``
    hook, implemented below; it parametrizes the test over the factories the hook returns
    (overriding the ``event_loop_policy`` fixture, the older way, is deprecated in 1.5).

    - Every async test runs once per loop in ``LOOP_FACTORIES``, with ids ``[asyncio]`` (the
      default asyncio loop in debug mode, which also reports calls into a loop from the wrong
      thread, never-retrieved exceptions and slow callbacks) and ``[uvloop]`` (where uvloop is
      installed). The ``any_loop`` fixture's value is the name of the loop the test is running
      on (``"asyncio"`` or ``"uvloop"``), for keys or messages that must differ between the two.
    - A test opts out with ``@pytest.mark.one_loop(reason="...")`` (on the test, its class, or
      the module's ``pytestmark``): it runs once, on the asyncio loop in debug mode, under no id. The
      reason is required; the opt-out is for tests where a second loop adds nothing (the test's
      process only starts and waits on child processes, which run their own loops) or costs too
      much (its run is mostly a wait on a deadline of its own, the same on every loop). See
      docs/testing.md.
    - ``-k asyncio`` / ``-k uvloop`` select one loop's runs (``-k`` also matches marker names,
      and pytest-asyncio marks every async test ``asyncio``: ``pytest_collection_modifyitems``
      below keeps that marker out of ``-k``'s sight). ``-k "not uvloop"`` runs everything that
      runs on asyncio, the opted-out tests and the tests without a loop included; ``-m
      one_loop`` selects the opted-out tests. ``--asyncio-debug`` turns debug mode on for
      uvloop too.

Compiled once for every process
    Where ``PYTHONDONTWRITEBYTECODE`` is set (this project's CI machines set it), no Python
    process writes a ``.pyc``, so each of the suite's many rank, launcher and example processes
    compiled the project's modules it imports from source (the launcher's, DDP's and the debug
    server's: 0.2-0.3 s of CPU a process). ``pytest_configure`` compiles ``aiodist``,
    ``aiodist_cuda``, ``examples`` and ``tests`` once, into their ``__pycache__`` directories
    (ignored by git), where every child process finds them. (A ``PYTHONPYCACHEPREFIX`` of the
    session's own would keep the tree clean, but a process with a prefix reads no ``.pyc`` from
    any ``__pycache__``, numpy's and the standard library's included: measured, it made the
    suite's process-heavy files 1.5x slower.)

Nothing passed
    A session in which no test passed (all skipped, xfailed or deselected; for example a
    dependency is missing and everything skips) exits with status 5, as pytest does when it
    collects nothing, instead of 0. ``--collect-only`` runs and failing runs are left alone.
"""

from __future__ import annotations

import asyncio
import compileall
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is not available on Windows
    uvloop = None  # type: ignore[assignment]


class DebugEventLoop(asyncio.SelectorEventLoop):
    """asyncio's default loop, always in debug mode. pytest-asyncio's runner calls
    ``set_debug(False)`` on every loop unless ``--asyncio-debug`` is given, so that is ignored."""

    def set_debug(self, enabled: bool) -> None:
        super().set_debug(True)

    def create_future(self) -> asyncio.Future[Any]:
        # In debug mode the C Future records the whole stack of its maker with every source line
        # (traceback.extract_stack): that alone made the heaviest asyncio-variant tests 5-10x
        # slower than on uvloop. asyncio's Python Future records the short, line-free stack that
        # handles record (format_helpers.extract_stack); every other debug check is unchanged.
        return asyncio.futures._PyFuture(loop=self)  # type: ignore[attr-defined]


# the stack a debug-mode handle or Python future records: 3 frames name where it was made
asyncio.constants.DEBUG_STACK_DEPTH = 3

LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": DebugEventLoop}
if uvloop is not None:
    LOOP_FACTORIES["uvloop"] = uvloop.new_event_loop

_ONE_LOOP: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": DebugEventLoop}


def _compile_once(config: pytest.Config) -> None:
    """See "Compiled once for every process" above."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or hasattr(config, "workerinput"):
        return
    root = pathlib.Path(__file__).resolve().parent.parent
    for name in ("aiodist", "aiodist_cuda", "examples", "tests"):
        if (root / name).is_dir():
            compileall.compile_dir(root / name, quiet=2, workers=0)


def pytest_configure(config: pytest.Config) -> None:
    _compile_once(config)
    config.addinivalue_line(
        "markers",
        "one_loop(reason): run this async test once, on the asyncio loop in debug mode, instead of on every loop of "
        "tests/conftest.py LOOP_FACTORIES; reason= says why a second loop adds nothing or costs too much",
    )


def _one_loop_reason(item: pytest.Item) -> str | None:
    """The reason of the test's ``one_loop`` marker, or None when it runs on every loop."""
    marker = item.get_closest_marker("one_loop")
    if marker is None:
        return None
    reason = marker.kwargs.get("reason", marker.args[0] if marker.args else None)
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.one_loop needs a reason: one_loop(reason='...')")
    if "any_loop" in getattr(item, "fixturenames", ()):
        raise pytest.UsageError(f"{item.nodeid}: requests the any_loop fixture but is marked one_loop")
    return reason


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    # One factory: pytest-asyncio hides the id, so an opted-out test keeps its plain name.
    return _ONE_LOOP if _one_loop_reason(item) is not None else LOOP_FACTORIES


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    # -k matches marker names too, and pytest-asyncio marks every async test "asyncio", so
    # `-k asyncio` would select the [uvloop] runs as well. While -k filters the items, that
    # marker is out of its sight; it is put back after. (Not when -m names it: -m needs it.)
    if not config.option.keyword or "asyncio" in config.option.markexpr:
        return (yield)
    hidden: list[tuple[pytest.Item, list[pytest.Mark]]] = []
    for item in items:
        marks = [m for m in item.own_markers if m.name == "asyncio"]
        if marks:
            hidden.append((item, marks))
            item.own_markers[:] = [m for m in item.own_markers if m.name != "asyncio"]
    try:
        return (yield)
    finally:
        for item, marks in hidden:
            item.own_markers.extend(marks)


@pytest.fixture
async def any_loop() -> str:
    """The name of the loop the requesting async test is running on: ``"asyncio"`` or ``"uvloop"``."""
    loop = asyncio.get_running_loop()
    if uvloop is not None and isinstance(loop, uvloop.Loop):
        return "uvloop"
    return "asyncio"


# -- a session where nothing passed fails ------------------------------------------------------


class _PassCounter:
    """Counts passed tests (reports forwarded from xdist workers included)."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed_the_session = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.passed += 1


_COUNTER = pytest.StashKey[_PassCounter]()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    counter = _PassCounter()
    session.config.stash[_COUNTER] = counter
    session.config.pluginmanager.register(counter, "aiodist-pass-counter")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    counter = config.stash.get(_COUNTER, None)
    if counter is None or hasattr(config, "workerinput") or config.option.collectonly:
        return  # an xdist worker reports to the controller, which decides
    if exitstatus == pytest.ExitCode.OK and counter.passed == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
        counter.failed_the_session = True


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    counter = config.stash.get(_COUNTER, None)
    if counter is not None and counter.failed_the_session:
        terminalreporter.write_line(
            "no test passed (all skipped, xfailed or deselected): exit status 5, see tests/conftest.py", red=True, bold=True
        )
