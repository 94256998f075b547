"""An HTTP service whose requests run collectives: aiohttp and aiodist on one event loop.

    aiodist-run --standalone --nproc-per-node 4 examples/rpc_service.py
    aiodist-run --standalone --nproc-per-node 4 examples/rpc_service.py --serve 60   # then curl it

Every rank runs an aiohttp web app on the same event loop as its collectives (no threads):

- ``GET /stats`` on every rank: how many requests this rank has worked on.
- ``POST /sum_squares`` on rank 0, JSON ``{"n": N}``: the sum of i*i for i < N, computed by all
  ranks together. The handler **broadcasts the request** to the other ranks with
  ``broadcast_object_list``, computes its own share (every world_size-th number), and collects the
  others' shares with ``all_gather_object``; then it answers with the total and the per-rank parts.
  The other ranks sit in a serve loop: receive a request by broadcast, compute, all-gather, repeat,
  until rank 0 broadcasts the stop message.

The other ranks wait in ``broadcast_object_list`` for rank 0's next request for as long as none
comes: ``dist.idle_until_leader(0)`` makes that idle rather than a timeout. Their ops start the
group's timeout (``--timeout``, 30 s) when rank 0 issues them, so a request that rank 0 sends
and a rank does not follow, a rank that calls another op, and a lost rank 0 still fail as
always.

Collectives must be issued in the same order on every rank, and an object collective is two ops,
so rank 0 runs one request's collectives at a time (an ``asyncio.Lock``); concurrent HTTP requests
wait for it, while the web server keeps accepting connections and answering ``/stats``.

The script demonstrates itself: the ranks exchange their servers' ports with
``all_gather_object``, then rank 0 sends a few concurrent requests to its own server with an
aiohttp client, checks the answers, reads every rank's ``/stats``, stops the serve loops and shuts
everything down. ``--serve SECONDS`` keeps the service up that long first, for curl::

    curl -s -X POST localhost:PORT/sum_squares -d '{"n": 1000000}'
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from typing import Any

import numpy as np
from aiohttp import ClientSession, web

import aiodist as dist

STOP = {"op": "stop"}


def my_share(n: int, rank: int, world: int) -> int:
    """Sum of i*i over this rank's numbers: rank, rank + world, rank + 2 * world, ... < n."""
    i = np.arange(rank, n, world, dtype=np.int64)
    return int(np.dot(i, i)) if i.size else 0  # exact in int64 for n up to about 2e6 (the service caps n)


class Service:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.served = 0
        self.lock = asyncio.Lock()  # rank 0: one request's collectives at a time
        self.jobs: set[asyncio.Future[list[Any]]] = set()  # requests' collectives in flight (rank 0)

    def share(self, request: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a request."""
        self.served += 1
        return {"rank": self.rank, "pid": os.getpid(), "part": my_share(request["n"], self.rank, self.world)}

    async def run_request(self, request: dict[str, Any]) -> list[Any]:
        """Rank 0: send the request to every rank, and gather every rank's share, in rank order."""
        await dist.broadcast_object_list([request], src=0)
        shares: list[Any] = [None] * self.world
        await dist.all_gather_object(shares, self.share(request))
        return shares

    async def locked_request(self, request: dict[str, Any]) -> list[Any]:
        async with self.lock:
            return await self.run_request(request)

    async def serve_loop(self) -> None:
        """Ranks other than 0: take requests from rank 0's broadcasts until the stop message."""
        while True:
            box: list[Any] = [None]
            await dist.broadcast_object_list(box, src=0)
            if box[0] == STOP:
                return
            await dist.all_gather_object([None] * self.world, self.share(box[0]))

    async def stop_all(self) -> None:
        async with self.lock:
            await dist.broadcast_object_list([STOP], src=0)

    # ---- HTTP handlers

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"rank": self.rank, "served": self.served})

    async def sum_squares(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            n = int(body["n"])
            if not 0 <= n <= 2_000_000:
                raise ValueError("n must be in [0, 2000000]")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected JSON {{'n': int}}: {exc}"}, status=400)
        t0 = time.perf_counter()
        # Shielded: if the handler is cancelled (a client that hangs up, with aiohttp's
        # handler_cancellation on), the request's collectives still run to the end on this rank,
        # as they do on the others; an object collective cut between its two ops would leave
        # rank 0 out of step with its peers.
        job = asyncio.ensure_future(self.locked_request({"op": "sum_squares", "n": n}))
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        shares = await asyncio.shield(job)
        total = sum(s["part"] for s in shares)
        return web.json_response(
            {"n": n, "sum_squares": total, "ranks": len(shares), "parts": shares, "ms": round(1e3 * (time.perf_counter() - t0), 2)}
        )


async def start_server(service: Service, host: str, port: int) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/stats", service.stats)
    if service.rank == 0:
        app.router.add_post("/sum_squares", service.sum_squares)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])  # the port actually bound (port 0: a free one)


async def demo(service: Service, addrs: list[tuple[str, int]], requests: int, serve_s: float) -> bool:
    """Rank 0: talk to its own server as a client would, then read every rank's /stats."""
    host, port = addrs[0]
    if serve_s > 0:
        print(
            f"serving on http://{host}:{port} for {serve_s:g} s: curl -s -X POST {host}:{port}/sum_squares -d '{{\"n\": 1000000}}'",
            flush=True,
        )
        await asyncio.sleep(serve_s)
    ok = True
    async with ClientSession() as http:
        ns = [1_000 * (k % 1_000 + 1) + k % 1_000 for k in range(requests)]  # all within the service's cap, for any --requests

        async def ask(n: int) -> dict[str, Any]:
            async with http.post(f"http://{host}:{port}/sum_squares", json={"n": n}) as resp:
                resp.raise_for_status()
                data: dict[str, Any] = await resp.json()
                return data

        answers = await asyncio.gather(*(ask(n) for n in ns))  # concurrent: the lock serialises the collectives
        for n, a in zip(ns, answers):
            expected = (n - 1) * n * (2 * n - 1) // 6
            good = a["sum_squares"] == expected and a["ranks"] == len(addrs)
            ok &= good
            parts = ", ".join(f"rank {p['rank']}: {p['part']}" for p in a["parts"])
            print(f"POST /sum_squares n={n}: {a['sum_squares']} ({'right' if good else 'WRONG'}; {parts}) in {a['ms']} ms", flush=True)
        async with http.post(f"http://{host}:{port}/sum_squares", data=b"not json") as resp:
            ok &= resp.status == 400
            print(f"POST /sum_squares with a bad body: HTTP {resp.status}", flush=True)
        for h, p in addrs:
            async with http.get(f"http://{h}:{p}/stats") as resp:
                s = await resp.json()
                ok &= s["served"] == service.served  # every request reached every rank
                print(f"GET http://{h}:{p}/stats: {s}", flush=True)
    return ok


async def run(args: argparse.Namespace) -> int:
    await dist.init_process_group("gloo", timeout=args.timeout)
    # The other ranks wait in a collective for rank 0's next request, for as long as none comes:
    # that is idle, not stuck. Their collectives start their timeout when rank 0 issues them.
    dist.idle_until_leader(0)
    runner: web.AppRunner | None = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        service = Service(rank, world)
        local_rank = dist.get_node_local_rank(fallback_rank=rank)
        runner, port = await start_server(service, args.host, args.port + local_rank if args.port else 0)
        addrs: list[Any] = [None] * world
        await dist.all_gather_object(addrs, (args.host if args.host != "0.0.0.0" else socket.gethostname(), port))
        if rank != 0:
            await service.serve_loop()
            ok = True
        else:
            print("servers: " + ", ".join(f"rank {r} on http://{h}:{p}" for r, (h, p) in enumerate(addrs)), flush=True)
            try:
                ok = await demo(service, addrs, args.requests, args.serve)
            finally:
                await service.stop_all()  # the other ranks leave their serve loops
        verdict = [ok]
        await dist.broadcast_object_list(verdict, src=0)
        if rank == 0:
            print("OK" if verdict[0] else "FAILED", flush=True)
        return 0 if verdict[0] else 1
    finally:
        if runner is not None:
            await runner.cleanup()
        await dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address the web servers listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="the rank of local rank r listens on PORT + r (default: any free port)")
    p.add_argument("--requests", type=int, default=3, help="requests rank 0 sends to itself (default 3)")
    p.add_argument("--serve", type=float, default=0.0, metavar="SECONDS", help="serve this long before the demo requests")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="the group's timeout (s); idle time between requests does not count (default 30)"
    )
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
