"""The address exchange at start-up: every rank waits until every rank has published its
address, and the ranks agree on their lanes.

Rules this module keeps:
- Every rank counts itself in under its own lane configuration (how many lanes, and with
  several the size from which messages are split), in a round of its own: a store reused by a
  later init counts afresh.
- Where every rank has one lane, that is all: a few store calls per rank, and the addresses are
  read from the store when dialing. Otherwise (or on a mismatch, to name the ranks) every rank
  reads every rank's address: striping needs each peer's host id.
- Striping needs both ends of a pair to split a message alike, so every rank must have as many
  lanes (and, with several, the same split size) as every other: a mismatch fails on every
  rank (``DistNetworkError``), naming the ranks and their interface lists.
- The wait is bounded by the caller's timeout and warns while it lasts (``aiodist._startup``);
  running past it raises ``DistTimeoutError`` naming the ranks that never published (best
  effort, within ``_DIAGNOSE_S``).
"""

from __future__ import annotations

import asyncio
import logging

from aiodist import _startup
from aiodist.errors import DistError, DistNetworkError, DistTimeoutError
from aiodist.store.base import Store
from aiodist.transport._address import PeerAddress, address_key

__all__ = ["exchange"]

log = logging.getLogger("aiodist.transport")

_DIAGNOSE_S = 5.0  # how long a failed exchange may spend finding the ranks it waited for


async def exchange(store: Store, rank: int, world: int, lanes: int, stripe_min_bytes: int, timeout: float) -> list[PeerAddress] | None:
    """Wait (up to ``timeout`` s) until each of the ``world`` ranks has published its address in
    ``store``, and agree on the lanes (the module docstring): every rank's address where
    striping needs them, None where every rank has one lane (``rank`` has ``lanes``, split
    from ``stripe_min_bytes``)."""
    mine = f"{lanes}" if lanes == 1 else f"{lanes}x{stripe_min_bytes}"
    base = "aiodist/transport/config/"
    joined = await store.add(base + "joined", 1)
    rnd = (joined - 1) // world
    await store.add(f"{base}{rnd}/lanes/{mine}", 1)
    if (await store.add(f"{base}{rnd}/counted", 1)) == world:
        await store.set(f"{base}{rnd}/all", "1")
    keys = [address_key(r) for r in range(world)]
    who, there = _startup.who(f"rank {rank}"), _startup.where(store)

    async def progress(elapsed: float) -> str:
        if world > 4096:  # too many to ask one by one every few seconds: count them
            n = await store.add(f"{base}{rnd}/counted", 0)
            return f"{who} waiting for {world - n} ranks to publish their transport addresses in {there} ({n}/{world} counted in, {_startup.waited(elapsed, timeout)})"
        have = await asyncio.gather(*(store.check([k]) for k in keys))
        missing = [r for r, ok in enumerate(have) if not ok]
        return (
            f"{who} waiting for ranks {_startup.ranks(missing)} to publish their transport addresses in {there} "
            f"({world - len(missing)}/{world} published, {_startup.waited(elapsed, timeout)})"
        )

    def unknown(elapsed: float, exc: BaseException) -> str:
        return (
            f"{who} waiting for every rank's transport address in {there} ({_startup.waited(elapsed, timeout)}; "
            f"the store did not say which ranks are missing: {exc!r})"
        )

    try:
        async with _startup.warn_while(progress, unknown, log):
            await store.wait([f"{base}{rnd}/all"], timeout)
    except TimeoutError:
        try:
            async with asyncio.timeout(_DIAGNOSE_S):  # naming the absent ranks is best effort
                missing = [r for r in range(world) if not await store.check([keys[r]])]
                counted = await store.add(f"{base}{rnd}/counted", 0)
            who = f"ranks {missing}" if missing else f"{world - counted} of {world} ranks"
        except (TimeoutError, DistError):
            who = "some ranks (the store did not say which)"
        raise DistTimeoutError(
            f"rank {rank}: timeout after {timeout:g} s waiting for the transport addresses of {who} "
            f"(have they started? is world_size={world} right?)"
        ) from None
    if lanes == 1 and await store.add(f"{base}{rnd}/lanes/{mine}", 0) == world:
        return None  # one lane everywhere: nothing to split, addresses are read when dialing
    addrs = [PeerAddress.decode(raw) for raw in await store.multi_get(keys)]
    by_count: dict[int, list[int]] = {}
    for a in addrs:
        by_count.setdefault(len(a.lanes), []).append(a.rank)
    if len(by_count) > 1:
        parts = []
        for count, ranks in sorted(by_count.items()):
            named = sorted({addrs[r].ifnames for r in ranks})
            lists = " or ".join(str(list(n)) if n else "(none named)" for n in named)
            parts.append(f"{count} ({lists}): ranks {ranks}")
        raise DistNetworkError(
            f"rank {rank}: ranks name different numbers of network interfaces (AIODIST_SOCKET_IFNAME / GLOO_SOCKET_IFNAME): "
            f"{'; '.join(parts)}. Every rank must name the same number of interfaces"
        )
    by_min: dict[int, list[int]] = {}
    for a in addrs:
        by_min.setdefault(a.stripe_min, []).append(a.rank)
    if len(by_min) > 1:
        sizes = "; ".join(f"{m} bytes: ranks {ranks}" for m, ranks in sorted(by_min.items()))
        raise DistNetworkError(
            f"rank {rank}: ranks split messages across interfaces from different sizes (AIODIST_STRIPE_MIN_BYTES): {sizes}. "
            "Every rank must use the same value"
        )
    return addrs
