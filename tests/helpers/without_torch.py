"""Run a script as if torch were not installed (tests/test_examples_jobs.py: an example that
needs torch must say so and exit 2).

    python tests/helpers/without_torch.py SCRIPT [ARGS...]

``import torch`` raises ImportError (``sys.modules["torch"] = None``); then SCRIPT runs as
``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``, its exit status the process's.
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.modules["torch"] = None  # type: ignore[assignment]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
