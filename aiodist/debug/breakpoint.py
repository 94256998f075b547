"""``await aiodist.breakpoint(rank=0, skip=0, timeout_s=3600)``: pdb on one rank, the others wait.

As torch's ``torch.distributed.breakpoint``: every rank calls it with the same ``rank``; that rank
stops in pdb, reading commands from the terminal (``/dev/tty`` where the process has one: a
launched worker's own stdin is usually not the terminal), and every other rank waits in a
barrier of the default group until the debugger continues. The waiting ranks *await* that
barrier: their event loops keep running (their other tasks, heartbeats, a debug server). The
debugged rank's loop is paused while pdb has it, as any code stopped in a debugger is; ranks
that share one event loop (``aiodist.testing.run_world``) are therefore all paused.

pdb stops inside ``breakpoint`` itself: type ``up`` to get to the coroutine that called it, and
``continue`` to let every rank go on. ``skip`` skips the first ``skip`` calls from the same call
site (every rank counts them alike). The waiting ranks give up after ``timeout_s`` seconds with
``DistTimeoutError`` (the barrier is ``monitored_barrier``, which names the rank that did not come).

Where pdb reads and writes: the ``stdin`` / ``stdout`` arguments; else the file named by
``AIODIST_BREAKPOINT_STDIN`` (a path such as ``/dev/stdin``: for tests and for jobs whose stdin
is piped in on purpose); else ``/dev/tty`` (and pdb writes there too); else ``/dev/stdin``.
"""

from __future__ import annotations

import os
import pdb
import sys
import weakref
from collections import Counter
from typing import IO

__all__ = ["breakpoint", "STDIN_ENV"]

STDIN_ENV = "AIODIST_BREAKPOINT_STDIN"
# World -> call site -> calls so far (``skip``). Keyed by the World itself, weakly: ranks may share
# a process, and a World's id() is reused by the next World once it is gone.
_calls: weakref.WeakKeyDictionary[object, Counter[tuple[str, int]]] = weakref.WeakKeyDictionary()


class _DistributedPdb(pdb.Pdb):
    """pdb whose input and output are given files (it must not read the worker's own stdin)."""

    def __init__(self, stdin: IO[str], stdout: IO[str]) -> None:
        super().__init__(stdin=stdin, stdout=stdout, nosigint=True)
        self.prompt = f"(Pdb rank {_rank()}) "


def _rank() -> int:
    from aiodist.c10d.world import current_world

    return current_world().rank


def _open_terminal() -> tuple[IO[str], IO[str] | None, list[IO[str]]]:
    """(stdin, stdout or None for sys.stdout, files to close afterwards)."""
    path = os.environ.get(STDIN_ENV)
    if path:
        f = open(path)  # noqa: SIM115 - closed by the caller
        return f, None, [f]
    try:
        tty_in = open("/dev/tty")  # noqa: SIM115
        tty_out = open("/dev/tty", "w")  # noqa: SIM115
    except OSError:
        pass
    else:
        return tty_in, tty_out, [tty_in, tty_out]
    try:
        f = open("/dev/stdin")  # noqa: SIM115
    except OSError:
        return sys.stdin, None, []
    return f, None, [f]


async def breakpoint(
    rank: int = 0, skip: int = 0, timeout_s: float = 3600, *, stdin: IO[str] | None = None, stdout: IO[str] | None = None
) -> None:  # noqa: A001 - torch's name
    """Stop rank ``rank`` in pdb; every other rank of the default group awaits (for at most
    ``timeout_s`` seconds) until it continues. Call it on every rank with the same arguments."""
    from aiodist.c10d.collectives import monitored_barrier
    from aiodist.c10d.world import current_world, default_group
    from aiodist.errors import DistTimeoutError

    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"breakpoint: rank must be an int, not {type(rank).__name__}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"breakpoint: skip must be an int >= 0, got {skip!r}")
    if not timeout_s > 0:
        raise ValueError(f"breakpoint: timeout_s must be > 0, got {timeout_s!r}")
    default_group()  # raises when the World is not initialised
    world = current_world()
    if not 0 <= rank < world.world_size:
        raise ValueError(f"breakpoint: rank {rank} is out of range for world_size {world.world_size}")
    if skip:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        calls = _calls.setdefault(world, Counter())
        calls[site] += 1
        if calls[site] <= skip:
            return
    opened: list[IO[str]] = []
    if world.rank == rank:
        if stdin is None:
            stdin, tty_out, opened = _open_terminal()
            stdout = stdout or tty_out
        debugger = _DistributedPdb(stdin, stdout or sys.stdout)
        debugger.message(
            f"\n!!! ATTENTION !!!\n\naiodist.breakpoint(rank={rank}): the other ranks wait until you continue.\n"
            "Type 'up' to get to the coroutine that called it, 'continue' to go on.\n"
        )
        debugger.set_trace(sys._getframe())
        stopped = True  # pdb stops on this line; the barrier below releases the other ranks
        del stopped
    try:
        await monitored_barrier(timeout=timeout_s)
    except DistTimeoutError as exc:
        exc.add_note(f"(aiodist.breakpoint: the ranks waited up to {timeout_s:g} s for rank {rank}'s debugger)")
        raise
    finally:
        if sys.gettrace() is None:  # the debugger is done with its files (not when still stepping)
            for f in opened:
                f.close()
