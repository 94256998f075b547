"""A do-nothing worker for the launcher's fault tests (tests/test_launcher_faults.py,
tests/faults/test_launcher_kill.py), started by aiodist-run; it stays up until it is killed.

    python tests/helpers/sigterm_worker.py MODE DIR

It writes its pid to ``DIR/<RANK>`` (RANK from the launcher's environment; written to a
``.tmp`` file and renamed into place, so a reader never sees half of it), then loops for at
most 60 s. Modes:

``plain``       honours SIGTERM.
``deaf``        ignores SIGTERM.
``deaf-child``  ignores SIGTERM and starts a child process that ignores it too; the file holds
                "<pid> <child pid>".
``spam``        honours SIGTERM; writes 16 lines of 1,000 bytes to stdout every millisecond.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MODES = ("plain", "deaf", "deaf-child", "spam")


def main(mode: str, out: str) -> None:
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; one of {MODES}")
    pids = [os.getpid()]
    if mode in ("deaf", "deaf-child"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "deaf-child":
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); time.sleep(60)"])
        pids.append(child.pid)
    path = os.path.join(out, os.environ["RANK"])
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.rename(path + ".tmp", path)
    line = "x" * 1000 + "\n"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if mode == "spam":
            sys.stdout.write(line * 16)
            time.sleep(0.001)
        else:
            time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
