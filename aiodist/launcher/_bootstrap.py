"""A worker process of ``launch_agent`` with a Python callable as the entrypoint.

    python -m aiodist.launcher._bootstrap PAYLOAD RESULT

PAYLOAD holds two pickles, the parent's ``sys.path`` and ``{"fn", "args"}``, written by the agent. The function runs
under ``aiodist.elastic.record`` (so an exception lands in TORCHELASTIC_ERROR_FILE); an
``async def`` runs on a fresh event loop (uvloop when installed). Its return value is pickled
to RESULT (written to a temporary name and renamed, so the agent never reads half a file).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import runpy
import sys
from typing import Any

from aiodist.elastic.errors import record


def run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run ``script`` as ``__main__`` in this interpreter with ``args`` as argv."""
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _call(fn: Any, args: tuple[Any, ...]) -> Any:
    if inspect.iscoroutinefunction(fn):
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            runner = asyncio.Runner()
        with runner:
            return runner.run(fn(*args))
    result = fn(*args)
    if inspect.iscoroutine(result):
        return asyncio.run(result)
    return result


def main(argv: list[str] | None = None) -> None:
    payload_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(payload_path, "rb") as f:
        # Two pickles: the parent's import path first, so that the function (second) unpickles
        # here as it was pickled there.
        parent_path = pickle.load(f)
        for p in reversed(parent_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        payload = pickle.load(f)
    value = record(_call)(payload["fn"], tuple(payload["args"]))
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main()
