"""``python -m aiodist.store --host H --port P``: a standalone TCPStore server process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiodist.store.server import TCPStoreServer, new_event_loop
from aiodist.wire.store import Limits

_D = Limits()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aiodist.store", description="Run a TCPStore server (torch's wire protocol).")
    p.add_argument("--host", default=None, help="address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=29500, help="port to listen on; 0 picks a free one (default 29500)")
    p.add_argument("--max-key-bytes", type=int, default=_D.max_key_bytes)
    p.add_argument("--max-value-bytes", type=int, default=_D.max_value_bytes)
    p.add_argument("--max-keys", type=int, default=_D.max_keys, help="most keys in one multi-key request")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    limits = Limits(max_key_bytes=args.max_key_bytes, max_value_bytes=args.max_value_bytes, max_keys=args.max_keys)
    server = await TCPStoreServer(args.host, args.port, limits=limits).start()
    # The port line is for people and for scripts that started us with --port 0.
    print(f"aiodist TCPStore server listening on {args.host or '*'}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(args))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
