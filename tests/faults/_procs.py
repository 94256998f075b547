"""The fault tests' rank processes: start one per rank (env://, loopback), read their stdout
lines against a deadline, and kill whatever is left (only the pids started here)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from aiodist.testing.ports import free_port

__all__ = ["start_ranks", "read_lines_until", "kill_all"]

Procs = dict[int, "subprocess.Popen[str]"]


def start_ranks(
    script: Path,
    n: int,
    env: Callable[[int], Mapping[str, str | None]] | None = None,
    stderr: Callable[[int], IO[Any] | int] | None = None,
    args: Sequence[object] = (),
) -> Procs:
    """``python script *args`` once per rank of an env:// world of ``n`` on a free loopback port,
    stdout a line-buffered text pipe (stderr merged into it unless ``stderr(rank)`` says where),
    with ``env(rank)`` added to the environment (None: removed from it). On any failure the ones started are killed."""
    port = str(free_port())
    procs: Procs = {}
    try:
        for rank in range(n):
            e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(n))
            for k, v in (env(rank) if env is not None else {}).items():
                if v is None:
                    e.pop(k, None)
                else:
                    e[k] = v
            err = stderr(rank) if stderr is not None else subprocess.STDOUT
            procs[rank] = subprocess.Popen(
                [sys.executable, str(script), *map(str, args)], env=e, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            )
    except BaseException:
        kill_all(procs)
        raise
    return procs


_partial: dict[int, bytes] = {}  # pid -> the start of a line read but not yet ended


def read_lines_until(procs: Mapping[int, subprocess.Popen[str]], want: str, deadline: float, outs: dict[int, list[str]]) -> set[int]:
    """Read each rank's stdout lines (into ``outs``) until every rank in ``procs`` has printed a
    line starting with ``want`` or the deadline (``time.monotonic()``) passes, whether or not a
    rank prints anything meanwhile; the ranks that did (or reached EOF: they print no more, and
    the caller's checks say what is missing). Reads the pipes' fds directly: a buffered
    readline could hold a second line where select cannot see it, or block on half a line."""
    sel = selectors.DefaultSelector()
    for rank, p in procs.items():
        assert p.stdout is not None
        sel.register(p.stdout.fileno(), selectors.EVENT_READ, (rank, p))
    done: set[int] = set()
    try:
        while len(done) < len(procs) and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                rank, p = key.data
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:  # EOF: the rank exited
                    sel.unregister(key.fd)
                    done.add(rank)
                    continue
                *lines, _partial[p.pid] = (_partial.get(p.pid, b"") + chunk).split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    outs.setdefault(rank, []).append(text)
                    if text.startswith(want) and rank not in done:
                        done.add(rank)
                        sel.unregister(key.fd)
    finally:
        sel.close()
    return done


def kill_all(procs: Mapping[int, subprocess.Popen[str]], outs: dict[int, list[str]] | None = None) -> None:
    """SIGKILL every one still running (a stopped one is continued first, so it dies now), reap
    it, and read what is left of its stdout into ``outs`` (if given) before closing it."""
    for p in procs.values():
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
    for rank, p in procs.items():
        p.wait(timeout=10)
        if p.stdout is not None and not p.stdout.closed:  # communicate() closes it
            rest = _partial.pop(p.pid, b"").decode(errors="replace") + p.stdout.read()
            if outs is not None:
                outs.setdefault(rank, []).extend(rest.splitlines())
            p.stdout.close()
