"""A client process for tests/faults/test_store_adds.py: CONNS TCPStore connections, each doing
ADDS ``add(KEY, 1)`` against a standalone store server, logging its progress where a SIGKILL
leaves it intact.

    python tests/helpers/store_adds_client.py --port P --proc I --log PATH --key KEY --conns C \\
        --adds A --clients N --kill-at K --victims 2,5

PROC is this process's index; LOG a file of int64 shared by every client process (mapped, so
what is written survives a SIGKILL): this process's connections own rows ``PROC * C`` to
``PROC * C + C - 1`` of ``2 + A`` values each: adds sent, adds acknowledged, then the value
each acknowledged add returned. No connection starts adding before all CLIENTS connections
(of all processes) have arrived. A process listed in VICTIMS (the test SIGKILLs it) slows to
an add per 2 ms past its first KILL_AT adds, so the kill lands mid-run. Prints ``done`` when
every connection has finished. Runs on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import numpy as np  # noqa: E402

import aiodist as dist  # noqa: E402

HOST = "127.0.0.1"


async def client(args: argparse.Namespace, row: np.ndarray, victim: bool) -> None:
    store = await dist.TCPStore(HOST, args.port, timeout=timedelta(seconds=30))
    try:
        # all 64 clients connected before any adds: they run at once
        if await store.add("arrived", 1) == args.clients:
            await store.set("go", "1")
        await store.wait(["go"])
        for i in range(args.adds):
            if victim and i >= args.kill_at:  # past the point it is killed at: slow, so the kill lands mid-run
                await asyncio.sleep(0.002)
            row[0] = i + 1  # sent (about to be)
            v = await store.add(args.key, 1)
            row[2 + i] = v
            row[1] = i + 1  # acknowledged
    finally:
        await store.close()


async def main(args: argparse.Namespace) -> None:
    slot = 2 + args.adds
    victim = args.proc in {int(v) for v in args.victims.split(",")}
    log = np.memmap(args.log, dtype=np.int64, mode="r+", offset=args.proc * args.conns * slot * 8, shape=(args.conns, slot))
    await asyncio.gather(*(client(args, log[c], victim) for c in range(args.conns)))
    print("done", flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--port", "--proc", "--conns", "--adds", "--clients", "--kill-at"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--victims", required=True, help="the victim processes' indices, comma-separated")
    return p.parse_args()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(parse()))
