"""A blocked event loop, told to the peers: the loop watchdog's thread writes
``aiodist/loop_blocked/<rank>`` in the World's TCPStore while the loop is blocked ("<since>
<at>": epoch seconds and file:line in function: source), and "" once it runs again. It cannot use
the store client (that lives on the blocked loop), so it speaks the TCPStore protocol over a
blocking socket of its own, with a 1 s deadline. A peer whose op times out reads the key of a
rank it waits on (aiodist.c10d._runner) and names the block: ``rank 1's event loop is blocked
(for 6.9 s, at train.py:42 in step: time.sleep(60))``. Only TCPStore-backed Worlds publish (a
HashStore lives in one process, whose ranks share the blocked loop anyway).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from aiodist.store.base import Store
from aiodist.store.prefix import PrefixStore
from aiodist.store.tcp import TCPStore
from aiodist.wire.store import Op, encode

__all__ = ["BLOCKED_KEY", "publisher", "describe"]

BLOCKED_KEY = "aiodist/loop_blocked/"
_VALIDATE_MAGIC = 0x3C85F7CE


def publisher(store: Store | None, rank: int) -> Callable[[str], None] | None:
    """A blocking ``publish(text)`` for the watchdog thread, or None when ``store`` is not a
    TCPStore (under any PrefixStores)."""
    key = f"{BLOCKED_KEY}{rank}"
    s = store
    while isinstance(s, PrefixStore):
        key = f"{s.prefix}/{key}"
        s = s.underlying_store
    if not isinstance(s, TCPStore):
        return None
    host, port, raw = s.host, s.port, b"/" + key.encode()  # the wire key: torch's client puts "/" first

    def publish(text: str) -> None:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.settimeout(1.0)
            sock.sendall(
                encode(Op.VALIDATE, number=_VALIDATE_MAGIC)
                + encode(Op.PING, number=os.getpid() & 0xFFFFFFFF)
                + encode(Op.SET, [raw], [text.encode()])
                + encode(Op.PING, number=0)
            )
            got = b""
            while len(got) < 8:  # the two pings' echoes: the SET is in once the second comes
                chunk = sock.recv(8 - len(got))
                if not chunk:
                    raise ConnectionError("the store closed the connection")
                got += chunk

    return publish


def describe(rank: int, value: bytes, now: float | None = None) -> str | None:
    """The headline clause for a published block, or None if the loop runs (value "")."""
    text = value.decode(errors="replace").strip()
    if not text:
        return None
    since, _, at = text.partition(" ")
    try:
        took = (time.time() if now is None else now) - float(since)
    except ValueError:
        return None
    return f"rank {rank}'s event loop is blocked (for {took:.1f} s, at {at}): it cannot take part in any op until it runs again"
