"""The OS side of shared memory: memfd segments, and the small abstract Unix socket that hands a
segment's fd to a same-host peer (SCM_RIGHTS).

Rules this module keeps:
- A segment is a ``memfd`` (no name in any filesystem: nothing is left in /dev/shm, whatever
  kills the process), sized once and mapped whole. Its pages are allocated when first touched,
  so a segment costs what its ops actually move, at most its size.
- The fd server listens on an abstract Unix socket (named from the job, the rank, the pid and a
  random nonce, like the transport's; abstract names live per network namespace and vanish
  with their socket). It answers one request per connection: the job token's hash and a group
  id in; that group's segment fd and the rank's doorbell (an eventfd) out (SCM_RIGHTS), with the
  segment's size. A peer with another uid or another token gets nothing.
- Every wait here is bounded by the caller's deadline (``fetch`` takes one); the server's
  per-connection work never suspends on a peer for longer than ``_SERVE_S``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import mmap
import os
import secrets
import socket
import struct
from typing import Any

import numpy as np

__all__ = ["Segment", "FdServer", "fetch", "token_digest"]

log = logging.getLogger("aiodist.shm")

_SERVE_S = 5.0  # a connected client must send its request this soon
_REQ = struct.Struct("<32sI")  # sha256(token), group id
_MAX_REPLY = 4096


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(b"aiodist-shm\0" + token).digest()


class Segment:
    """One mapped memfd: ``view`` is the whole segment as a flat uint8 array. A peer's segment
    also holds the peer's doorbell (``bell``, an eventfd: writing 1 wakes the peer's loop), -1
    where it has none."""

    __slots__ = ("fd", "size", "_mm", "view", "bell")

    def __init__(self, fd: int, size: int, *, own_fd: bool, bell: int = -1) -> None:
        self.size = size
        self.bell = bell
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        # the creator keeps its fd (to hand it out); a peer's fd is closed once mapped
        self.fd = fd if own_fd else -1
        if not own_fd:
            os.close(fd)  # the mapping keeps the pages

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, own_fd=True)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Unmap (and close the fd). An array still viewing the pages keeps the mapping alive
        until it is collected (mmap refuses to close under an exported buffer)."""
        self.view = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            log.debug("shared segment still viewed at close; unmapped when the view is collected")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1


class FdServer:
    """Serves this rank's segments' fds to same-host peers of the same job."""

    def __init__(self, token: bytes, rank: int, segment_for: Any, bell: int = -1) -> None:
        self._digest = token_digest(token)
        self._bell = bell  # this rank's doorbell, handed out with every segment (-1: none)
        self._segment_for = segment_for  # async: group id -> Segment, or None (see SharedMemory._segment_for)
        job = hashlib.sha256(token).hexdigest()[:16]
        self.name = f"\0aiodist-shm-{job}-{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.name)
            self._sock.listen(1024)  # every same-host rank may fetch at once (connect does not wait)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept(), name="aiodist shm fd server")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            t = loop.create_task(self._serve(conn))
            self._serving.add(t)
            t.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid != os.getuid():
                    log.warning("shm fd server: refused a connection from uid %d", uid)
                    return
                conn.setblocking(False)
                raw = b""
                async with asyncio.timeout(_SERVE_S):
                    while len(raw) < _REQ.size:
                        got = await loop.sock_recv(conn, _REQ.size - len(raw))
                        if not got:
                            return
                        raw += got
                digest, group = _REQ.unpack(raw)
                if not secrets.compare_digest(digest, self._digest):
                    log.warning("shm fd server: refused a request with another job's token")
                    return
                seg = await self._segment_for(group)
                reply: dict[str, Any]
                if seg is None:
                    reply, fds = {"error": f"no shared memory for group {group} on this rank"}, []
                else:
                    reply, fds = {"size": seg.size, "bell": self._bell >= 0}, [seg.fd, *([self._bell] if self._bell >= 0 else [])]
                # a fresh connection's send buffer is empty: this small message goes at once
                socket.send_fds(conn, [json.dumps(reply).encode()], fds)
            except (OSError, TimeoutError, ValueError, struct.error) as exc:
                log.debug("shm fd server: a request failed: %s", exc)

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._serving) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close()


async def fetch(name: str, token: bytes, group: int) -> Segment:
    """Map peer segment ``group`` served at abstract socket ``name``. Raises OSError (or
    ValueError for a refusal); the caller bounds it with its deadline."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with sock:
        sock.setblocking(False)
        sock.connect(name)  # abstract sockets connect at once or refuse at once
        await loop.sock_sendall(sock, _REQ.pack(token_digest(token), group))
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(sock.fileno(), readable)
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())
        msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REPLY, 2)
    try:
        reply = json.loads(msg) if msg else {"error": "the peer closed the connection"}
        if "error" in reply or len(fds) != 1 + bool(reply.get("bell")):
            raise ValueError(str(reply.get("error", f"{len(fds)} fds in the reply")))
        size = int(reply["size"])
        if os.fstat(fds[0]).st_size < size:
            raise ValueError(f"the peer's segment is smaller than it says ({size} bytes)")
        seg = Segment(fds[0], size, own_fd=False)
        if len(fds) == 2:
            seg.bell = fds[1]
        return seg
    except BaseException:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # Segment() closed it already
                pass
        raise
