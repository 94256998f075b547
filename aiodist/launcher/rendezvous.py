"""The agents' rendezvous: which nodes take part in a round, in what order, and where the
workers' store is.

One agent hosts a TCPStore server (the *rendezvous store*) at the endpoint: with the ``static``
backend the agent of node rank 0, with ``c10d`` the first agent on the endpoint's host that can
bind its port. Every agent (the host too) is a client of it. Round ``k`` (the restart count)
lives under ``rdzv/<run_id>/<k>/``:

- ``count``: how many agents joined; ``arrived/<n>``: set by the ``n``-th to join (what the
  others wait on instead of polling ``count``); ``node/<i>``: agent ``i``'s JSON (nproc, the address other
  nodes reach it at, host name, agent pid, whether it hosts the rendezvous store).
  ``static`` agents take ``i = --node-rank``; ``c10d`` agents take ``i`` in order of arrival.
- ``final``: the number of nodes of the round, written once (compare-and-set) when ``count``
  reaches the maximum, or when it reached the minimum and ``last_call_timeout`` passed. An
  agent still short of the minimum at ``join_timeout`` fails, naming how many nodes arrived.
- ``master``: ``addr:port`` of the workers' store of the round, hosted by node 0 on a fresh
  port (so no key of an earlier attempt is seen by the next one).
- ``failed`` (first failure, JSON), ``done/<i>`` and ``exit/<i>``: how agents agree on the
  outcome of the round (see ``aiodist.launcher.agent``); ``alive/<i>``: agent ``i``'s
  heartbeat counter (a node whose counter stands still for ``heartbeat_timeout`` fails the round);
  ``outcome/<i>``: the failed workers of node ``i`` (JSON list), so that every node's report
  names the job's earliest failure.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from aiodist.errors import DistError, DistNetworkError
from aiodist.launcher._decide import Close, Shortfall, close_round
from aiodist.store.server import ServerThread, TCPStoreServer
from aiodist.store.tcp import TCPStore

__all__ = ["RendezvousError", "RendezvousTimeoutError", "NodeInfo", "Assignment", "AgentRendezvous", "format_endpoint", "parse_endpoint"]

log = logging.getLogger("aiodist.run")


class RendezvousError(DistError):
    """The agents could not agree on a round (a duplicate node rank, a round closed without us)."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Too few nodes arrived within the join timeout."""


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[fd00::1]:29500``) so that
    ``parse_endpoint`` reads it back."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``host``, ``[v6]:port`` -> (host, port)."""
    endpoint = endpoint.strip()
    if not endpoint:
        raise ValueError("empty rendezvous endpoint")
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif endpoint.count(":") == 1:
        host, _, port = endpoint.partition(":")
    else:
        host, port = endpoint, ""
    try:
        p = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"port in rendezvous endpoint {endpoint!r} is not an integer") from None
    if not 0 <= p < 2**16:
        raise ValueError(f"port in rendezvous endpoint {endpoint!r} is out of range")
    return host or "localhost", p


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (an address we can bind)."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def route_source(host: str, port: int) -> str | None:
    """The local address of the route towards ``host`` (what a socket connected there gets:
    an address ``host`` can reach us at whenever we can reach it), or None. No packet is sent."""
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as s:
                s.connect(addr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class NodeInfo:
    index: int
    nproc: int
    addr: str
    host: str
    pid: int = 0
    store: bool = False  # its agent hosts the rendezvous store

    def describe(self) -> str:
        """``node 1 (vm, 10.0.0.2)``: how messages name a node."""
        return f"node {self.index} ({self.host}, {self.addr})" if self.addr != self.host else f"node {self.index} ({self.host})"


@dataclass(frozen=True)
class Assignment:
    """This agent's place in a round."""

    round: int
    node_rank: int
    nodes: tuple[NodeInfo, ...]
    master_addr: str
    master_port: int

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        return sum(n.nproc for n in self.nodes[: self.node_rank])

    def first_rank(self, node: int) -> int:
        return sum(n.nproc for n in self.nodes[:node])

    @property
    def store_node(self) -> NodeInfo | None:
        """The node whose agent hosts the rendezvous store (None: an outside server)."""
        return next((n for n in self.nodes if n.store), None)


class AgentRendezvous:
    """One agent's side of the rendezvous (see the module docstring)."""

    def __init__(
        self,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        nproc: int,
        node_rank: int | None,
        join_timeout: float,
        last_call_timeout: float,
        local_addr: str | None,
        heartbeat_timeout: float = 30.0,
    ) -> None:
        if backend not in ("static", "c10d"):
            raise ValueError(f"unknown rendezvous backend {backend!r} (aiodist has 'static' and 'c10d')")
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"nnodes must satisfy 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
        if backend == "static":
            if min_nodes != max_nodes:
                raise ValueError("the static rendezvous needs a fixed --nnodes (MIN:MAX needs --rdzv-backend c10d)")
            if node_rank is None or not 0 <= node_rank < max_nodes:
                raise ValueError(f"--node-rank must be in [0, {max_nodes}) with the static rendezvous, got {node_rank}")
        self.backend = backend
        self.host, self.port = parse_endpoint(endpoint, 29500 if backend == "static" else 29400)
        self.run_id = run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.nproc = nproc
        self.node_rank = node_rank
        self.join_timeout = join_timeout
        self.last_call_timeout = last_call_timeout
        self.local_addr = local_addr
        self.heartbeat_timeout = heartbeat_timeout
        self._hb_round = -1
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self.server: ServerThread | None = None
        self.store: TCPStore | None = None
        self.worker_server: ServerThread | None = None
        self.assignment: Assignment | None = None

    # -- connection ---------------------------------------------------------------------

    def key(self, k: int, name: str) -> str:
        return f"rdzv/{self.run_id}/{k}/{name}"

    @property
    def is_host(self) -> bool:
        return self.server is not None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Host the rendezvous store if it is ours to host, then connect to it."""
        want_host = (self.backend == "static" and self.node_rank == 0) or (self.backend == "c10d" and is_local_host(self.host))
        if self.port == 0 and not want_host:
            raise ValueError("a rendezvous endpoint with port 0 can only be hosted by this agent (use it for single-node jobs)")
        if self.port == 0 and self.max_nodes > 1:
            raise ValueError("a multi-node job needs a fixed rendezvous port (--master-port or --rdzv-endpoint host:port)")
        if want_host:
            try:
                self.server = await ServerThread(TCPStoreServer(None, self.port)).astart()
                self.port = self.server.server.port
                log.info("hosting the rendezvous store on port %d", self.port)
            except DistNetworkError as exc:
                cause = getattr(exc, "os_error", None) or exc.__cause__
                if self.backend == "static" or not (isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE):
                    raise
                log.info("rendezvous port %d is taken on this host: joining as a client", self.port)
        host = "127.0.0.1" if self.server is not None and self.host in ("localhost", "") else self.host
        try:
            self.store = await TCPStore(host, self.port, None, False, self.join_timeout, wait_for_workers=False)
        except (DistError, OSError) as exc:
            await self.close()
            raise RendezvousTimeoutError(
                f"could not reach the rendezvous store at {self.host}:{self.port} within {self.join_timeout:g} s: {exc}"
            ) from exc

    async def _reconnect(self) -> None:
        """A fresh client of the rendezvous store, after it did not answer (a lost link): the old
        connection's requests may be stuck behind TCP's retransmission backoff long after the
        link is back. The client's connect retries (with backoff, each attempt bounded) until
        ``join_timeout``."""
        old, self.store = self.store, None
        if old is not None:
            await old.close()
        host = "127.0.0.1" if self.server is not None and self.host in ("localhost", "") else self.host
        try:
            self.store = await TCPStore(host, self.port, None, False, self.join_timeout, wait_for_workers=False)
        except (DistError, OSError) as exc:
            raise RendezvousTimeoutError(
                f"could not reach the rendezvous store at {self.endpoint} again within {self.join_timeout:g} s: {exc}"
            ) from exc

    async def close(self) -> None:
        await self.stop_worker_store()
        if self.store is not None:
            store, self.store = self.store, None
            await store.close()
        if self.server is not None:
            server, self.server = self.server, None
            await server.astop()

    # -- a round --------------------------------------------------------------------------

    def _advertised_addr(self) -> str:
        """The address other nodes reach this agent (and node 0's workers' store) at:
        ``--local-addr``; else the rendezvous host as given, on the node that hosts it (the
        name the others reach it by); else the local address of the route to the rendezvous
        host. Not the host name: on many clusters it resolves to 127.0.1.1."""
        if self.local_addr:
            return self.local_addr
        if self.backend == "static" and self.node_rank == 0 or self.is_host:
            return "127.0.0.1" if self.host == "localhost" else self.host
        return route_source(self.host, self.port) or socket.getfqdn()

    async def join(self, k: int, late: tuple[int, dict[str, Any], list[dict[str, Any]]] | None = None) -> Assignment:
        """Join round ``k``; the assignment, once the round is closed and node 0 published the
        workers' store. Raises ``RendezvousTimeoutError`` naming how many nodes arrived, or
        that the store could not be reached within ``join_timeout`` (a lost link or host).

        ``late``: (round, first failure, this node's failures) of an earlier round that this
        agent could not publish then (the store did not answer); published first, so that an
        agent still watching that round learns of it."""
        try:
            if late is not None:
                await self._reconnect()
                await self.report_failure(late[0], late[1])
                await self.publish_outcome(late[0], late[2])
            return await self._join(k)
        except RendezvousError:
            raise
        except (DistError, OSError, TimeoutError) as exc:
            raise RendezvousTimeoutError(
                f"rendezvous round {k}: the rendezvous store at {self.endpoint} did not answer "
                f"within the join timeout ({self.join_timeout:g} s): {type(exc).__name__}: {exc}"
            ) from exc

    async def _join(self, k: int) -> Assignment:
        assert self.store is not None
        store = self.store
        await store.set_timeout(self.join_timeout)
        me = json.dumps(
            {"nproc": self.nproc, "addr": self._advertised_addr(), "host": socket.gethostname(), "pid": os.getpid(), "store": self.is_host}
        )
        if self.backend == "static":
            assert self.node_rank is not None
            idx = self.node_rank
            got = await store.compare_set(self.key(k, f"node/{idx}"), "", me)
            if got.decode() != me:
                raise RendezvousError(f"node rank {idx} joined round {k} twice (another agent has --node-rank {idx})")
            arrival = await store.add(self.key(k, "count"), 1)
        else:
            idx = await store.add(self.key(k, "count"), 1) - 1
            await store.set(self.key(k, f"node/{idx}"), me)
            arrival = idx + 1
        # What the others wait on (no polling of the count): the arrival of the n-th node.
        await store.set(self.key(k, f"arrived/{arrival}"), "1")
        final = await self._close_round(k)
        if idx >= final:
            raise RendezvousError(f"rendezvous round {k} closed with {final} nodes before this agent joined (arrival {idx + 1})")
        keys = [self.key(k, f"node/{i}") for i in range(final)]
        await store.wait(keys, self.join_timeout)
        nodes = tuple(NodeInfo(index=i, **json.loads(v)) for i, v in enumerate(await store.multi_get(keys)))
        if idx == 0:
            await self.stop_worker_store()
            self.worker_server = await ServerThread(TCPStoreServer(None, 0)).astart()
            await store.set(self.key(k, "master"), format_endpoint(nodes[0].addr, self.worker_server.server.port))
        await store.wait([self.key(k, "master")], self.join_timeout)
        maddr, mport = parse_endpoint((await store.get(self.key(k, "master"))).decode(), 0)
        self.assignment = Assignment(round=k, node_rank=idx, nodes=nodes, master_addr=maddr, master_port=mport)
        # From here on a store that does not answer for a heartbeat timeout is a lost host.
        await store.set_timeout(min(self.join_timeout, self.heartbeat_timeout))
        return self.assignment

    async def _close_round(self, k: int) -> int:
        """The number of nodes of round ``k``, once it is closed (by us or another agent): the
        decision is ``close_round``'s; between looks the agent waits on the store (for the
        arrival that matters, or for the close), never on a fixed sleep."""
        assert self.store is not None
        store = self.store
        deadline = time.monotonic() + self.join_timeout
        min_at: float | None = None
        final_key = self.key(k, "final")
        while True:
            if await store.check([final_key]):
                return int(await store.get(final_key))
            count = await store.add(self.key(k, "count"), 0)
            now = time.monotonic()
            if count >= self.min_nodes and min_at is None:
                min_at = now
            act = close_round(count, self.min_nodes, self.max_nodes, now, deadline, min_at, self.last_call_timeout)
            if isinstance(act, Close):
                return int(await store.compare_set(final_key, "", str(act.nodes)))
            if isinstance(act, Shortfall):
                raise RendezvousTimeoutError(await self._shortfall(k, count))
            key = final_key if act.arrival is None else self.key(k, f"arrived/{act.arrival}")
            try:
                await store.wait([key], max(0.01, act.seconds))
            except TimeoutError:
                pass  # look again: the decision knows what a passed deadline means

    async def _shortfall(self, k: int, count: int) -> str:
        assert self.store is not None
        want = f"{self.min_nodes}" if self.min_nodes == self.max_nodes else f"at least {self.min_nodes} (of up to {self.max_nodes})"
        msg = f"rendezvous timed out after {self.join_timeout:g} s: {count} of {want} nodes arrived"
        if self.backend == "static":
            missing = [i for i in range(self.max_nodes) if not await self.store.check([self.key(k, f"node/{i}")])]
            msg += f" (missing node ranks: {missing})"
        return msg + f" at {self.host}:{self.port}"

    async def stop_worker_store(self) -> None:
        if self.worker_server is not None:
            server, self.worker_server = self.worker_server, None
            await server.astop()

    # -- agreeing on the outcome ------------------------------------------------------------

    async def report_failure(self, k: int, info: dict[str, Any]) -> dict[str, Any]:
        """Publish this round's failure; the first one published (maybe another node's)."""
        assert self.store is not None
        mine = json.dumps(info)
        got = await self.store.compare_set(self.key(k, "failed"), "", mine)
        return dict(json.loads(got))

    async def failure(self, k: int) -> dict[str, Any] | None:
        assert self.store is not None
        key = self.key(k, "failed")
        if await self.store.check([key]):
            return dict(json.loads(await self.store.get(key)))
        return None

    async def mark(self, k: int, what: str) -> None:
        assert self.store is not None and self.assignment is not None
        await self.store.set(self.key(k, f"{what}/{self.assignment.node_rank}"), "1")

    async def all_marked(self, k: int, what: str) -> bool:
        assert self.store is not None and self.assignment is not None
        return await self.store.check([self.key(k, f"{what}/{i}") for i in range(self.assignment.nnodes)])

    async def wait_marked(self, k: int, what: str, timeout: float, skip: set[int] | frozenset[int] = frozenset()) -> bool:
        """Until every node of round ``k`` (but ``skip``) set ``what/<i>``, at most ``timeout`` s;
        whether they did."""
        assert self.store is not None and self.assignment is not None
        keys = [self.key(k, f"{what}/{i}") for i in range(self.assignment.nnodes) if i not in skip]
        if not keys:
            return True
        try:
            await self.store.wait(keys, timeout)
        except TimeoutError:
            return False
        return True

    async def heartbeat(self, k: int) -> dict[int, float]:
        """Count this agent's heartbeat of round ``k`` and look at the others' (one look; the
        agent calls it every ``heartbeat_interval``): for each other node, when its count was
        last seen moving (``time.monotonic()``)."""
        assert self.store is not None and self.assignment is not None
        if self._hb_round != k:
            self._hb_round, self._hb_seen = k, {}
        me = self.assignment.node_rank
        await self.store.add(self.key(k, f"alive/{me}"), 1)
        others = [i for i in range(self.assignment.nnodes) if i != me]
        counts = await asyncio.gather(*(self.store.add(self.key(k, f"alive/{i}"), 0) for i in others))
        now = time.monotonic()
        for i, v in zip(others, counts, strict=True):
            seen = self._hb_seen.get(i)
            if seen is None or seen[0] != v:
                self._hb_seen[i] = (v, now)
        return {i: t for i, (_, t) in self._hb_seen.items()}

    async def wait_failure(self, k: int, timeout: float) -> dict[str, Any]:
        """Round ``k``'s first failure, once some node published it (a store wait, at most
        ``timeout`` s: then ``TimeoutError``)."""
        assert self.store is not None
        key = self.key(k, "failed")
        await self.store.wait([key], timeout)
        return dict(json.loads(await self.store.get(key)))

    def silence(self, k: int, node: int) -> float | None:
        """Seconds since node ``node``'s heartbeat of round ``k`` was last seen moving (None: not
        watched)."""
        seen = self._hb_seen.get(node) if self._hb_round == k else None
        return None if seen is None else time.monotonic() - seen[1]

    async def publish_outcome(self, k: int, failures: list[dict[str, Any]]) -> None:
        """This node's failed workers of round ``k`` (maybe none), for the others' reports."""
        assert self.store is not None and self.assignment is not None
        await self.store.set(self.key(k, f"outcome/{self.assignment.node_rank}"), json.dumps(failures))

    async def gather_outcomes(
        self, k: int, timeout: float, skip: set[int] | frozenset[int] = frozenset()
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """Every published failure of round ``k``, waiting (at most ``timeout`` s) for every
        node but ``skip`` (known lost); and the nodes that published nothing in that time."""
        assert self.store is not None and self.assignment is not None
        keys = [self.key(k, f"outcome/{i}") for i in range(self.assignment.nnodes)]
        wanted = [key for i, key in enumerate(keys) if i not in skip]
        try:
            if wanted:
                await self.store.wait(wanted, timeout)
        except TimeoutError:
            pass  # a node that never says: its failures are not in the report
        out: list[dict[str, Any]] = []
        missing: list[int] = []
        for i, key in enumerate(keys):
            if await self.store.check([key]):
                out.extend(json.loads(await self.store.get(key)))
            else:
                missing.append(i)
        return out, missing
