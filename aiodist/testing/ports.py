"""Ports for servers a test starts in other processes, with less of ``get_free_port``'s race.

``aiodist.elastic.utils.get_free_port`` binds port 0 and closes the socket: the kernel picked
the port from its ephemeral range, and hands the same range out again to every outgoing
connection, so on a machine busy with connections (a test suite's) another socket may take the
port before the server binds it. ``free_port()`` picks a port *outside* the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel never hands out on its own,
checks that it binds, and never gives the same port twice in one process. Only another process
choosing explicitly can still take it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_GIVEN: set[int] = set()
_RANDOM = random.Random()


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port on this host that binds now, outside the kernel's ephemeral range, not given out
    before by this process."""
    lo, hi = _ephemeral()
    ranges = [(r0, r1) for r0, r1 in ((10000, lo - 1), (hi + 1, 65535)) if r1 - r0 > 1000]
    for _ in range(200):
        r0, r1 = _RANDOM.choice(ranges) if ranges else (1024, 65535)
        port = _RANDOM.randint(r0, r1)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise OSError("free_port: no bindable port found outside the ephemeral range")
