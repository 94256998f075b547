"""A second ``asyncio.run`` that calls ``init_process_group`` again after the first run's loop
closed with the default group still made: the call must be refused at once with the closed-loop
rule (aiodist._threads.closed_loop_error), not "initialized twice" or a hang. Prints the error's
type and message on one line."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import aiodist as dist  # noqa: E402
from aiodist import HashStore  # noqa: E402


def main() -> None:
    store = HashStore()
    asyncio.run(dist.init_process_group(backend="gloo", store=store, rank=0, world_size=1, timeout=10))
    try:
        asyncio.run(dist.init_process_group(backend="gloo", store=store, rank=0, world_size=1, timeout=10))
    except Exception as exc:  # noqa: BLE001 - what the test checks
        print(f"{type(exc).__name__}: {exc}")
    else:
        print("no error")


if __name__ == "__main__":
    main()
