"""Where a rank's transport listens, as published in the store, and how "same host" is decided.

A rank publishes a ``PeerAddress`` (TCP host and port, abstract Unix socket name, host id) under
``aiodist/transport/<rank>``. Two ranks are on the same host exactly when their host ids are
equal: the kernel boot id plus the network namespace (abstract socket names live per namespace).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from typing import Any

from aiodist.errors import DistNetworkError

__all__ = ["KEY_PREFIX", "PeerAddress", "address_key", "host_id", "unix_name", "listen_tcp"]

KEY_PREFIX = "aiodist/transport/"


def address_key(rank: int) -> str:
    return f"{KEY_PREFIX}{rank}"


def host_id() -> str:
    """Equal on two processes exactly when they can reach each other's abstract Unix sockets:
    same kernel boot and same network namespace (Linux); elsewhere, the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        return f"{boot}/{netns}"
    except OSError:
        return f"host:{socket.gethostname()}"


def unix_name(token: bytes, rank: int) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    job = hashlib.sha256(token).hexdigest()[:16]
    return f"\0aiodist-transport-{job}-{rank}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """What a rank publishes in the store so peers can reach it."""

    rank: int
    host: str
    port: int
    unix: str | None  # abstract socket name (leading NUL included), or None
    host_id: str
    hosts: tuple[str, ...] = ()  # one address per lane (interface); () means (host,)
    ifnames: tuple[str, ...] = ()  # the interfaces named by AIODIST/GLOO_SOCKET_IFNAME, if any
    stripe_min: int = 0  # with several lanes: the size from which collective messages are split

    @property
    def lanes(self) -> tuple[str, ...]:
        """Lane j's address: one per interface named, else just ``host``."""
        return self.hosts or (self.host,)

    def describe(self, lane: int = 0) -> str:
        host = self.lanes[lane]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def encode(self) -> bytes:
        unix = None if self.unix is None else self.unix.encode().hex()
        d = {"rank": self.rank, "host": self.host, "port": self.port, "unix": unix, "host_id": self.host_id}
        if self.hosts:
            d["hosts"] = list(self.hosts)
            d["ifnames"] = list(self.ifnames)
            d["stripe_min"] = self.stripe_min
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PeerAddress:
        try:
            d = json.loads(raw)
            unix = None if d["unix"] is None else bytes.fromhex(d["unix"]).decode()
            hosts = tuple(str(h) for h in d.get("hosts", ()))
            ifnames = tuple(str(n) for n in d.get("ifnames", ()))
            stripe_min = int(d.get("stripe_min", 0))
            return cls(int(d["rank"]), str(d["host"]), int(d["port"]), unix, str(d["host_id"]), hosts, ifnames, stripe_min)
        except (ValueError, KeyError, TypeError) as exc:
            raise DistNetworkError(f"malformed transport address in the store: {raw[:200]!r}") from exc


def listen_tcp() -> socket.socket:
    """A listening socket on every interface, port 0 (dual-stack when IPv6 is there)."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        addr: tuple[Any, ...] = ("::", 0)
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        addr = ("0.0.0.0", 0)
    try:
        sock.bind(addr)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise DistNetworkError(f"could not open a transport listener on port 0: {exc}") from exc
    return sock
