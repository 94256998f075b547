"""A driver for tests/test_launcher.py: ``launch_agent`` with Python callables (three local
workers, no restarts), run as a script from the repository root.

    python tests/helpers/launch_agent_job.py

The callables are launched_worker's (this folder, on sys.path as the script's own directory),
pickled by reference. Prints one JSON line::

    {"sync": {rank: rank_times(10)}, "async": {rank: async_all_reduce(0.5)},
     "failed": [first failed rank, its message]}   # of fail_on_rank1, which raises on rank 1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import launched_worker as w  # noqa: E402

from aiodist.launcher import ChildFailedError, LaunchConfig, launch_agent  # noqa: E402


def config() -> LaunchConfig:
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=3, max_restarts=0)


def main() -> None:
    out: dict[str, Any] = {"sync": launch_agent(config(), w.rank_times, [10]), "async": launch_agent(config(), w.async_all_reduce, [0.5])}
    try:
        launch_agent(config(), w.fail_on_rank1, [])
    except ChildFailedError as e:
        rank, f = e.get_first_failure()
        out["failed"] = [rank, f.message]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
