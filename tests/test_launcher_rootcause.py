"""The launcher's root cause: the worker that failed first on its own, not a peer that died of
the lost connection; a worker without ``@record`` still reported with the exception it printed.

Pure tests of the stderr scanner, one of the agent's cancel helper, then real four-rank jobs.
The four-rank job runs 5 times, 5 at once (``AIODIST_ROOTCAUSE_RUNS=20``: 20 times); every run
must name the right root cause."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aiodist.errors import DistNetworkError
from aiodist.launcher._tracebacks import TracebackScanner
from aiodist.launcher.agent import _cancel

ROOT = Path(__file__).resolve().parents[1]
RUNS = int(os.environ.get("AIODIST_ROOTCAUSE_RUNS", "5"))
CONCURRENT = 5

HELPERS = ROOT / "tests" / "helpers"
# Rank 1 raises after a barrier while the others are in an all_reduce; every rank tears its group down.
RANK1_RAISES = HELPERS / "rank1_raises_job.py"
# No aiodist, no @record: rank 0 raises at once, rank 1 a moment later, each its own error.
OWN_ERRORS = HELPERS / "own_errors_job.py"


def _scan(text: str) -> tuple[str, int] | None:
    s = TracebackScanner()
    for i, line in enumerate(textwrap.dedent(text).strip("\n").splitlines()):
        s.feed(line, i)
    return None if s.last is None else (s.last.message, s.last.time_ns)


# ---------------------------------------------------------------- the stderr scanner (pure)


def test_scanner_plain_traceback_qualified_name_and_time() -> None:
    text = """
    some output
    Traceback (most recent call last):
      File "w.py", line 3, in <module>
        main()
        ^^^^^^
    aiodist.errors.DistNetworkError: rank 3: rank 1 closed the connection without GOODBYE
    """
    assert _scan(text) == ("DistNetworkError: rank 3: rank 1 closed the connection without GOODBYE", 1)


def test_scanner_chained_keeps_the_final_exception_and_the_first_line_time() -> None:
    text = """
    Traceback (most recent call last):
      File "w.py", line 3, in f
    KeyError: 'x'

    The above exception was the direct cause of the following exception:

    Traceback (most recent call last):
      File "w.py", line 5, in <module>
    ValueError: bad
    """
    assert _scan(text) == ("ValueError: bad", 0)


def test_scanner_message_less_exception_and_multiline_message() -> None:
    assert _scan('Traceback (most recent call last):\n  File "w.py", line 1\nSystemError\n') == ("SystemError", 0)
    text = 'Traceback (most recent call last):\n  File "w.py", line 1\nValueError: one\ntwo: three\n'
    assert _scan(text) == ("ValueError: one", 0)


def test_scanner_exception_group_keeps_the_group_line() -> None:
    """Python's own layout of a group (with a chained sub-exception), as it prints it."""

    def child() -> None:
        try:
            raise KeyError("inner cause")
        except KeyError as e:
            raise ValueError("inner") from e

    try:
        try:
            child()
        except ValueError as e:
            raise ExceptionGroup("unhandled errors in a TaskGroup", [e, OSError("second")]) from None
    except ExceptionGroup as g:
        text = "".join(traceback.format_exception(g))
    assert "  | ValueError: inner" in text  # the layout this test is about
    assert _scan(text) == ("ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions)", 0)


def test_scanner_real_chained_traceback() -> None:
    try:
        try:
            {}["k"]
        except KeyError:
            raise DistNetworkError("rank 1 closed the connection without GOODBYE")  # noqa: B904
    except DistNetworkError as e:
        text = "".join(traceback.format_exception(e))
    assert "During handling of the above exception" in text
    assert _scan(text) == ("DistNetworkError: rank 1 closed the connection without GOODBYE", 0)


def test_scanner_skips_tracebacks_printed_at_shutdown() -> None:
    text = """
    Traceback (most recent call last):
      File "w.py", line 3, in <module>
    ValueError: the cause
    Exception ignored in: <function C.__del__ at 0x7f>
    Traceback (most recent call last):
      File "w.py", line 8, in __del__
    RuntimeError: noise
    Task exception was never retrieved
    future: <Task finished name='Task-3' coro=<f() done> exception=OSError('x')>
    Traceback (most recent call last):
      File "w.py", line 12, in f
    OSError: x
    """
    assert _scan(text) == ("ValueError: the cause", 0)


def test_scanner_no_traceback() -> None:
    assert _scan("ValueError: printed, not raised\nplain line\n") is None


# ---------------------------------------------------------------- the agent's cancel helper


@pytest.mark.timeout(10)
async def test_cancel_helper_lets_the_callers_own_cancellation_through() -> None:
    """``_cancel(task)`` drops ``task``'s outcome, but a cancellation of the task calling it
    (arriving while ``task`` winds down) must propagate, not be swallowed."""
    started, tearing_down = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            started.set()
            await asyncio.sleep(30)
        finally:
            tearing_down.set()
            await asyncio.sleep(0.5)  # a teardown that takes a while (cancelled again below)

    async def caller() -> str:
        task = asyncio.ensure_future(slow_to_stop())
        await started.wait()
        await _cancel(task)
        return "carried on after being cancelled"

    outer = asyncio.ensure_future(caller())
    await asyncio.wait_for(tearing_down.wait(), 5)  # caller is inside _cancel, waiting
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(outer, 5)


async def test_cancel_helper_in_a_finally_of_a_cancelled_task_finishes_its_cleanup() -> None:
    """A cancellation already under way (``finally`` after it) is not raised again by
    ``_cancel``: the rest of the cleanup runs."""
    cleaned = asyncio.Event()

    async def caller() -> None:
        poll = asyncio.ensure_future(asyncio.sleep(30))
        try:
            await asyncio.sleep(30)
        finally:
            await _cancel(poll)
            cleaned.set()

    outer = asyncio.ensure_future(caller())
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(outer, 5)
    assert cleaned.is_set()


async def test_cancel_helper_drops_the_tasks_outcome() -> None:
    async def fails() -> None:
        raise OSError("nobody waits for this")

    t = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    await _cancel(t)  # neither its error nor its cancellation reaches the caller
    await _cancel(asyncio.ensure_future(asyncio.sleep(10)))
    await _cancel(None)


# ---------------------------------------------------------------- real jobs


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(script: Path, nproc: int, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sections(err: str) -> tuple[dict[int, str], tuple[int, str]]:
    """The report's other failures {rank: message} and the root cause (rank, its text)."""
    others_text, _, root_text = err.partition("Root Cause (first observed failure):")
    others = {}
    for m in re.finditer(r"rank      : (\d+) .*?\n(?:.*\n){2}  message   : (.*)", others_text):
        others[int(m.group(1))] = m.group(2)
    m = re.search(r"rank      : (\d+)", root_text)
    assert m, err
    return others, (int(m.group(1)), root_text)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_root_cause_is_the_rank_that_raised_in_every_four_rank_run() -> None:
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(lambda _: _launch(RANK1_RAISES, 4), range(RUNS)))
    wrong = []
    for p in results:
        assert p.returncode == 1, p.stderr[-3000:]
        others, (rank, root) = _sections(p.stderr)
        ok = rank == 1 and "ValueError: rank one exploded" in root
        # The peers are reported with what they died of (read from stderr), never <N/A>.
        ok = ok and sorted(others) == [0, 2, 3] and all(re.match(r"Dist\w+Error: ", msg) for msg in others.values())
        if not ok:
            wrong.append(p.stderr[p.stderr.index("FAILED") :])
    assert not wrong, f"{len(wrong)} of {RUNS} runs named the wrong root cause; the first:\n{wrong[0]}"


@pytest.mark.subprocess
def test_worker_without_record_is_reported_with_its_exception_from_stderr() -> None:
    p = _launch(OWN_ERRORS, 2, timeout=30)
    assert p.returncode == 1, p.stderr
    others, (rank, root) = _sections(p.stderr)
    assert others == {1: "KeyError: 'late key'"}, p.stderr
    assert rank == 0 and "RuntimeError: first, without record" in root, p.stderr
    assert "message   : <N/A>" not in p.stderr
