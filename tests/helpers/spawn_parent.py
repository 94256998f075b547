"""A parent process for tests/test_spawn.py: ``aiodist.multiprocessing.spawn`` of two children
running ``test_spawn.sleep_then_return`` (each writes its pid to ``PID_DIR/<rank>.pid``, then
sleeps 60 s), and then a fault of the parent's own.

    python tests/helpers/spawn_parent.py MODE PID_DIR

Modes:

``orphan``
    ``join=False``; once both children have written their pid files, print the children's pids
    on one line and SIGKILL itself (the children must die with it: PR_SET_PDEATHSIG).
``orphan-ignoring-sigint``
    As ``orphan``, but the parent ignores SIGINT first, as a job a shell started in the
    background does (the children inherit that disposition; SIGINT is their death signal).
``interrupted``
    SIGINT raises KeyboardInterrupt in the parent (even where the test runner ignores it); spawn
    joins, the test sends SIGINT; on KeyboardInterrupt the parent prints ``interrupted`` and, per
    child, 1 if it is gone (0 if not), and exits 0. Exits 3 if spawn returns.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # test_spawn: the children's function, pickled by name
sys.path.insert(0, str(TESTS.parent))  # run from a checkout without install

from aiodist.multiprocessing import spawn  # noqa: E402

MODES = ("orphan", "orphan-ignoring-sigint", "interrupted")


def orphan(pid_dir: str) -> None:
    import test_spawn

    ctx = spawn(test_spawn.sleep_then_return, args=(pid_dir, 60.0), nprocs=2, join=False)
    for r in range(2):
        test_spawn._wait_for(Path(pid_dir, f"{r}.pid"))
    print(" ".join(map(str, ctx.pids())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def interrupted(pid_dir: str) -> None:
    import test_spawn

    try:
        spawn(test_spawn.sleep_then_return, args=(pid_dir, 60.0), nprocs=2)
    except KeyboardInterrupt:
        pids = [int(Path(pid_dir, f"{r}.pid").read_text()) for r in range(2)]
        print("interrupted", *[int(test_spawn._dead(p)) for p in pids], flush=True)
        sys.exit(0)
    sys.exit(3)


if __name__ == "__main__":
    mode, pid_dir = sys.argv[1], sys.argv[2]
    if mode == "orphan":
        orphan(pid_dir)
    elif mode == "orphan-ignoring-sigint":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job
        orphan(pid_dir)
    elif mode == "interrupted":
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a supervisor's SIGINT, even if pytest runs with it ignored
        interrupted(pid_dir)
    else:
        raise SystemExit(f"unknown mode {mode!r}; one of {MODES}")
