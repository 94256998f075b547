"""A job for tests/test_launcher_rootcause.py, started by aiodist-run (two ranks), without aiodist
and without ``@record``: each rank fails with its own exception, which the launcher can only
read from the worker's stderr.

    python -m aiodist.run --standalone --nproc-per-node 2 tests/helpers/own_errors_job.py

RANK 0 raises ``RuntimeError("first, without record")`` at once; RANK 1 sleeps 0.3 s, then
raises ``KeyError("late key")``.
"""

from __future__ import annotations

import os
import time


def main() -> None:
    if os.environ["RANK"] == "1":
        time.sleep(0.3)
        raise KeyError("late key")
    raise RuntimeError("first, without record")


if __name__ == "__main__":
    main()
