"""Raw client streams for tests that speak a server's protocol byte by byte."""

from __future__ import annotations

import asyncio
import socket


async def open_unix(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream over a Unix socket, an abstract name (``"\\0..."``) included. uvloop's
    ``open_unix_connection(path)`` refuses an abstract name (EINVAL), so the socket is connected
    first, as aiodist's own client does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, name)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_unix_connection(sock=sock)
