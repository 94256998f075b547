"""Reachability probe for tests/test_multihost.py's harness check, run inside the network
namespaces ("hosts") of aiodist.testing.netns.

    python tests/helpers/netns_probe.py server ADDR...   (on host 0)
    python tests/helpers/netns_probe.py client ADDR...   (on hosts 1 and 2)

Both use port 5555 on every ADDR: each host is its own network namespace, so no other process
of the machine can hold that port there.

``server`` listens on every ADDR (IPv6 where it has a colon), prints ``listening``, then answers
two connections per address (one from each client host) with the peer address it sees, and
exits 0; it gives up with an error if no connection comes within 20 s.
``client`` prints ``<hostname> <the address the hostname resolves to>``, then, for each ADDR,
connects (5 s timeout) and prints ``<ADDR> <the address the server saw it at>``.
"""

from __future__ import annotations

import select
import socket
import sys

PORT = 5555


def server(addrs: list[str]) -> None:
    ss = [socket.create_server((a, PORT), family=socket.AF_INET6 if ":" in a else socket.AF_INET) for a in addrs]
    print("listening", flush=True)
    for _ in range(2 * len(ss)):  # each address answers hosts 1 and 2 with the address it sees them at
        ready, _, _ = select.select(ss, [], [], 20)
        c, peer = ready[0].accept()
        c.sendall(peer[0].encode())
        c.close()


def client(addrs: list[str]) -> None:
    print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))
    for a in addrs:
        with socket.create_connection((a, PORT), timeout=5) as c:
            print(a, c.recv(100).decode())


if __name__ == "__main__":
    {"server": server, "client": client}[sys.argv[1]](sys.argv[2:])
