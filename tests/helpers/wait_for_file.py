"""A worker that does nothing until a file exists (tests/test_launcher_idle.py: an idle job).

    python tests/helpers/wait_for_file.py PATH

Checks every 50 ms whether PATH exists and exits 0 once it does, or after 60 s.
"""

from __future__ import annotations

import os
import sys
import time


def main(path: str) -> None:
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
