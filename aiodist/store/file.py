"""FileStore: a store shared through one file, by the tasks of one process and by processes
on one machine (or on a shared filesystem whose ``flock`` works), as torch's FileStore.

There is no server: the file is the only channel. It is an append-only log of records, and
every store object keeps the state it has replayed from the log (keys, queues, user counts)
and the offset it has read up to, so each operation only reads the bytes appended since its
last one. Every read-modify-append happens under an exclusive ``flock`` of the file; reads of
new bytes under a shared one. All file work runs in a worker thread (``asyncio.to_thread``),
never on the event loop.

File format (little-endian)::

    header:  b"AIODFS\\x01\\n"  (8 bytes: magic, format version 1)
             16 random bytes   (the file's nonce: tells a recreated file from the old one)
    record:  u8 type | u64 key length | key | u64 value length | value

Record types: SET (the whole resulting value: set, add, append, compare_set and multi_set all
write one), DELETE (the key's value; a queue of that name stays), QUEUE_PUSH, QUEUE_POP (pops the head),
QUEUE_PUSH_FRONT (returns an item popped by a cancelled ``queue_pop``) and USERS (empty key;
value: i64 change of the number of live users, i64 change of the number of closed users).
The user counts live outside the key space: ``list_keys`` never shows them; ``num_keys`` adds
one for them, because torch's FileStore keeps its user count as a key and counts it.
A transaction's records go out in one write; a torn record at the end (a writer died in the
middle of a write) is ignored by readers and cut off by the next writer. Anything else that is
not this format raises ``DistStoreError`` naming the path and the offset.

Semantics are HashStore's: a key that names only a queue reads as ``b""``; a blocking
``queue_pop`` of an empty queue whose key holds a value is refused at once (``QueueEmptyError``).

Lifetime, as torch's: each object registers as a user on first use (or ``await store`` /
``async with``); ``close()`` unregisters it and counts it as closed. When ``world_size >= 0``,
at least ``world_size`` users have closed and none remain, the closer deletes the file. Note
that a ``clone()`` is a user of its own, so it counts towards ``world_size`` when closed.
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from aiodist._time import TimeoutLike
from aiodist.errors import DistStoreError, QueueEmptyError, StoreTimeoutError
from aiodist.store.base import (
    DEFAULT_STORE_TIMEOUT,
    VALUE_NOT_QUEUE,
    Store,
    ValueLike,
    check_key,
    check_keys,
    ms,
    pair_up,
    store_timeout,
    to_amount,
    to_value,
)
from aiodist.store.state import counter_add

__all__ = ["FileStore"]

T = TypeVar("T")

_MAGIC = b"AIODFS\x01\n"
_NONCE_LEN = 16
_HEADER_LEN = len(_MAGIC) + _NONCE_LEN
_REC = struct.Struct("<BQ")  # record type, key length
_LEN = struct.Struct("<Q")  # value length
_COUNTS = struct.Struct("<qq")  # USERS: change of live users, change of closed users
_MAX_LEN = 1 << 48  # a longer key or value is garbage, not a record still being written

_SET, _DELETE, _QPUSH, _QPOP, _QPUSH_FRONT, _USERS = 1, 2, 3, 4, 5, 6
_KINDS = {_SET: "SET", _DELETE: "DELETE", _QPUSH: "QUEUE_PUSH", _QPOP: "QUEUE_POP", _QPUSH_FRONT: "QUEUE_PUSH_FRONT", _USERS: "USERS"}

# Waits poll the file: there is no server to notify a waiter, the file is the only channel
# between processes. A poll is one os.stat (in a worker thread) comparing the file's size to
# the offset already read, so it is cheap; the delay between polls doubles from 1 ms (a key
# set right after the wait began is seen at once) to 50 ms (an idle wait costs ~20 stats a
# second), and falls back to 1 ms whenever the file grew (others are busy: an answer may be near).
_POLL_MIN = 0.001
_POLL_MAX = 0.05
# The lock of the file is taken by polling too (a blocked flock() could not be abandoned when
# the caller is cancelled); bounded by the store timeout, but never less than this.
_MIN_LOCK_WAIT = 1.0


def _b(key: str) -> bytes:
    return key.encode()


def _rec(kind: int, key: bytes = b"", value: bytes = b"") -> bytes:
    return b"".join((_REC.pack(kind, len(key)), key, _LEN.pack(len(value)), value))


class _Abandoned(Exception):
    """Raised in the worker thread when the awaiting task was cancelled before the operation
    took the lock: nothing was done."""


class _Cache:
    """The state replayed from the file up to ``offset``."""

    __slots__ = ("data", "queues", "users", "closed", "nonce", "ino", "offset")

    def __init__(self) -> None:
        self.reset(None, None)

    def reset(self, nonce: bytes | None, ino: tuple[int, int] | None) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.users = 0
        self.closed = 0
        self.nonce = nonce
        self.ino = ino
        self.offset = _HEADER_LEN if nonce is not None else 0

    def present(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    parts = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            break
        parts.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


class FileStore(Store):
    """A store whose data lives in the file ``file_name``, shared by every FileStore object
    (in this process or others) opened on it.

    Constructing does no I/O; the object registers as a user of the file on first use, or
    explicitly with ``store = await FileStore(...)`` or ``async with FileStore(...) as store``.
    ``close()`` unregisters; the file is deleted once ``world_size`` users have closed and no
    user remains (never with ``world_size=-1``).
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int = -1, timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        if fcntl is None:  # pragma: no cover
            raise DistStoreError("FileStore needs fcntl.flock (a POSIX system)")
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"file_name must be a str, not {type(file_name).__name__}")
        path = os.fspath(file_name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"file_name must be a non-empty str path, got {file_name!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, not {type(world_size).__name__}")
        if world_size < -1:
            raise ValueError(f"world_size must be >= -1 (-1: unknown), got {world_size}")
        self._path = path
        self._world_size = world_size
        self._cache = _Cache()
        self._mutex = threading.Lock()  # guards _cache and the flags below, held by the worker thread
        self._registered = False
        self._closing = False  # close() was called: new operations are refused
        self._close_done = False  # the close was written to the file (or there was nothing to write)
        self._fd: int | None = None  # kept open on the file once used; closed by close()

    # -- properties ---------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The path of the store's file."""
        return self._path

    @property
    def world_size(self) -> int:
        return self._world_size

    def _describe(self) -> str:
        return f"FileStore({self._path!r})"

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    def stats(self) -> dict[str, Any]:
        c = self._cache
        return {
            **super().stats(),
            "path": self._path,
            "world_size": self._world_size,
            "keys": len(c.data),
            "queues": len(c.queues),
            "offset": c.offset,
            "users": c.users,
            "closed_users": c.closed,
            "registered": self._registered,
            "closed": self._close_done,
        }

    # -- lifetime -----------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, FileStore]:
        return self._open().__await__()

    async def __aenter__(self) -> FileStore:
        return await self._open()

    async def _open(self) -> FileStore:
        self._check_open()
        await self._run(self._txn, lambda fd: None, False)
        return self

    def clone(self) -> FileStore:
        """A new FileStore object on the same file (a user of its own once used)."""
        return FileStore(self._path, self._world_size, self._timeout_s)

    async def close(self) -> None:
        """Unregister from the file and delete it if this was the last of ``world_size``
        users. Idempotent; operations after ``close()`` raise ``DistStoreError``."""
        if self._close_done:
            return
        self._closing = True
        registered = self._registered
        try:
            await self._run(self._txn, self._close_body, True, register=False, create=False)
        except DistStoreError:
            if registered:
                raise
            # never used: counting its close is best effort (torch's destructor is too)
            self._close_done = True

    def _close_body(self, fd: int | None) -> None:
        if self._close_done:
            return
        if fd is None:  # no file: never used, or already removed
            self._close_done = True
            return
        c = self._cache
        self._commit(fd, _rec(_USERS, b"", _COUNTS.pack(-1 if self._registered else 0, 1)))
        self._registered = False
        self._close_done = True
        if self._world_size >= 0 and c.closed >= self._world_size and c.users <= 0:
            try:
                os.unlink(self._path)  # still holding the lock: waiters on it see st_nlink == 0
            except FileNotFoundError:
                pass
        # the descriptor is closed at the end of _txn, after the lock is released

    def _check_open(self) -> None:
        if self._closing:
            raise DistStoreError(f"{self._describe()} is closed")

    # -- running file work off the loop ---------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any, undo: Callable[[T], Awaitable[None]] | None = None, **kwargs: Any) -> T:
        """Run ``fn(*args, cancel=event, **kwargs)`` in a worker thread. If the caller is
        cancelled, the event tells the worker to give up waiting for locks; an operation that
        already took the lock completes, ``undo(result)`` (if given) reverts it for the caller
        that is gone, and the cancellation is re-raised after that."""
        cancel = threading.Event()
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args, cancel=cancel, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            cancel.set()
            await self._finish(task)
            if undo is not None and not task.cancelled() and task.exception() is None:
                await undo(task.result())
            raise

    @staticmethod
    async def _finish(task: asyncio.Future[Any]) -> None:
        """Wait for ``task`` to end, through further cancellations, keeping its outcome."""
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if not task.cancelled():
            task.exception()  # retrieved: the caller raises its own CancelledError

    def _txn(
        self,
        body: Callable[[int | None], T],
        write: bool,
        *,
        cancel: threading.Event,
        register: bool = True,
        create: bool = True,
        fast: Callable[[], tuple[bool, T]] | None = None,
    ) -> T:
        """In a worker thread: lock the file (exclusively to ``write``), read what is new,
        register this object if needed, and return ``body(fd)``. ``fast``, when the file has
        not changed since the last read, may answer from the cache without locking."""
        deadline = time.monotonic() + max(self._timeout_s, _MIN_LOCK_WAIT)
        self._take_mutex(deadline, cancel)
        try:
            if register and self._close_done:
                raise DistStoreError(f"{self._describe()} is closed")
            if fast is not None and (self._registered or not register):
                c = self._cache
                try:
                    st = os.stat(self._path)
                except FileNotFoundError:
                    st = None
                if st is not None and (st.st_dev, st.st_ino) == c.ino and st.st_size == c.offset:
                    done, result = fast()
                    if done:
                        return result
            exclusive = write or (register and not self._registered)
            while True:
                fd = self._lock_file(exclusive, deadline, cancel, create)
                if fd is None:
                    return body(None)
                try:
                    self._catch_up(fd, exclusive)
                    if register and not self._registered:
                        if not exclusive:  # the file was replaced under us: register in the new one
                            exclusive = True
                            continue
                        self._commit(fd, _rec(_USERS, b"", _COUNTS.pack(1, 0)))
                        self._registered = True
                    return body(fd)
                finally:
                    self._unlock_file(fd)
        except (DistStoreError, _Abandoned):  # StoreTimeoutError is an OSError (a TimeoutError) too
            raise
        except OSError as exc:
            raise DistStoreError(f"{self._describe()}: I/O error on {self._path}: {exc}") from exc
        finally:
            if self._closing and not self._registered:  # closed (or never used): let the file go
                self._drop_fd()
            self._mutex.release()

    def _take_mutex(self, deadline: float, cancel: threading.Event) -> None:
        while not self._mutex.acquire(timeout=0.005):
            if cancel.is_set():
                raise _Abandoned
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"{self._describe()}: timed out waiting for this object's other operations (store timeout "
                    f"{max(self._timeout_s, _MIN_LOCK_WAIT):g} s)"
                )

    def _lock_file(self, exclusive: bool, deadline: float, cancel: threading.Event, create: bool) -> int | None:
        """Flock the file (opening it first if this object has no descriptor on it yet) and
        return the descriptor; None when it does not exist and ``create`` is false.

        The object keeps its descriptor between operations (flock locks belong to the open
        file, so other objects, in this process too, are still excluded). Holding it also
        keeps the file's inode from being reused, so the poll's "same inode, same size" test
        cannot mistake a recreated file for the one already read."""
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        while True:
            if self._fd is None:
                try:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o666)
                except FileNotFoundError:
                    if create:
                        raise
                    return None
            fd = self._fd
            delay = 0.0001
            while True:
                try:
                    fcntl.flock(fd, op)
                    break
                except BlockingIOError:
                    pass
                if cancel.is_set():
                    raise _Abandoned
                if time.monotonic() >= deadline:
                    raise StoreTimeoutError(
                        f"{self._describe()}: timed out waiting for the lock of {self._path} (another process holds it; "
                        f"store timeout {max(self._timeout_s, _MIN_LOCK_WAIT):g} s)"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.005)
            if os.fstat(fd).st_nlink == 0:
                # removed (by the last user's close) since we opened it: use the file now there
                self._drop_fd()
                continue
            return fd

    def _unlock_file(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:  # pragma: no cover - nothing sensible to do; closing releases it
            self._drop_fd()

    def _drop_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._fd = None
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the log --------------------------------------------------------------------------

    def _corrupt(self, offset: int, why: str) -> DistStoreError:
        return DistStoreError(f"{self._describe()}: {self._path} is not a valid FileStore file (or is corrupt): {why} at offset {offset}")

    def _catch_up(self, fd: int, exclusive: bool) -> None:
        """Read and apply the records appended since the last read (the lock is held)."""
        c = self._cache
        st = os.fstat(fd)
        size = st.st_size
        if size < _HEADER_LEN:
            head = os.pread(fd, size, 0) if size else b""
            if not _MAGIC.startswith(head[: len(_MAGIC)]):
                raise self._corrupt(0, f"bad header {head[:16]!r}")
            # empty, or a header cut short by a crash: a fresh file
            if c.nonce is not None:
                self._registered = False
            if exclusive:
                nonce = os.urandom(_NONCE_LEN)
                os.ftruncate(fd, 0)
                _pwrite_all(fd, _MAGIC + nonce, 0)
                c.reset(nonce, (st.st_dev, st.st_ino))
            else:
                c.reset(None, (st.st_dev, st.st_ino))
            return
        head = os.pread(fd, _HEADER_LEN, 0)
        if head[: len(_MAGIC)] != _MAGIC:
            raise self._corrupt(0, f"bad header {head[:16]!r}")
        nonce = head[len(_MAGIC) :]
        if nonce != c.nonce or (st.st_dev, st.st_ino) != c.ino or size < c.offset:
            # another file than the one cached (removed and created again): start over
            if c.nonce is not None:
                self._registered = False
            c.reset(nonce, (st.st_dev, st.st_ino))
        if size > c.offset:
            self._apply(_pread_all(fd, size - c.offset, c.offset), c.offset)
        if exclusive and size > c.offset:
            os.ftruncate(fd, c.offset)  # a torn record: a writer died mid-write

    def _apply(self, buf: bytes, base: int) -> int:
        """Apply the whole records of ``buf`` (read at file offset ``base``); return the bytes
        used. Stops at a torn record; raises on anything that is not a record."""
        c = self._cache
        mv = memoryview(buf)
        n = len(mv)
        pos = 0
        while n - pos >= _REC.size:
            at = base + pos
            kind, klen = _REC.unpack_from(mv, pos)
            if kind not in _KINDS:
                raise self._corrupt(at, f"unknown record type {kind:#04x}")
            if klen > _MAX_LEN:
                raise self._corrupt(at, f"key length {klen} is absurd")
            p = pos + _REC.size
            if n - p < klen + _LEN.size:
                break
            key = bytes(mv[p : p + klen])
            p += klen
            (vlen,) = _LEN.unpack_from(mv, p)
            p += _LEN.size
            if vlen > _MAX_LEN:
                raise self._corrupt(at, f"value length {vlen} is absurd")
            if n - p < vlen:
                break
            value = bytes(mv[p : p + vlen])
            p += vlen
            self._apply_one(kind, key, value, at)
            pos = p
            c.offset = base + pos
        return pos

    def _apply_one(self, kind: int, key: bytes, value: bytes, at: int) -> None:
        c = self._cache
        if kind == _SET:
            c.data[key] = value
        elif kind == _DELETE:
            c.data.pop(key, None)  # as torch's server: a queue of the same name is left alone
        elif kind == _QPUSH or kind == _QPUSH_FRONT:
            q = c.queues.get(key)
            if q is None:
                q = c.queues[key] = deque()
            if kind == _QPUSH:
                q.append(value)
            else:
                q.appendleft(value)
        elif kind == _QPOP:
            q = c.queues.get(key)
            if not q:
                raise self._corrupt(at, f"QUEUE_POP of the empty queue {key[:64]!r}")
            q.popleft()
            if not q:
                del c.queues[key]
        else:  # _USERS
            if key or len(value) != _COUNTS.size:
                raise self._corrupt(at, "malformed USERS record")
            du, dc = _COUNTS.unpack(value)
            c.users += du
            c.closed += dc

    def _commit(self, fd: int, records: bytes) -> None:
        """Append ``records`` (the exclusive lock is held and the cache is up to date) and
        apply them to the cache, through the same code that replays the file."""
        c = self._cache
        base = c.offset
        _pwrite_all(fd, records, base)
        used = self._apply(records, base)
        assert used == len(records), "FileStore wrote a malformed record"

    # -- helpers for the operations -------------------------------------------------------

    async def _write(self, body: Callable[[int | None], T]) -> T:
        self._check_open()
        return await self._run(self._txn, body, True)

    async def _read(self, probe: Callable[[], T]) -> T:
        self._check_open()
        return await self._run(self._txn, lambda fd: probe(), False, fast=lambda: (True, probe()))

    async def _poll(self, attempt: Callable[[], Any], seconds: float, op: str, per_key: bool = False) -> Any:
        """Repeat ``await attempt()`` -> (done, value or missing keys) until done or the
        timeout; see _POLL_MIN for the pacing. The timeout error adds torch's FileStore words:
        ``Timeout waiting for key: k after 300 ms`` for reads (``per_key``), else ``Wait timeout``."""
        start = time.monotonic()
        deadline = start + seconds
        delay = _POLL_MIN
        seen = self._cache.offset
        while True:
            done, value = await attempt()
            if done:
                return value
            now = time.monotonic()
            if now >= deadline:
                words = f"Timeout waiting for key: {value[0]} after {ms(seconds)} ms" if per_key and value else "Wait timeout"
                raise store_timeout(self._describe(), op, value, now - start, words)
            if self._cache.offset != seen:
                seen = self._cache.offset
                delay = _POLL_MIN
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _POLL_MAX)

    def _missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self._cache.present(_b(k))]

    # -- the API --------------------------------------------------------------------------

    async def set(self, key: str, value: ValueLike) -> None:
        k, v = _b(check_key(key)), to_value(value)
        await self._write(lambda fd: self._commit(fd, _rec(_SET, k, v)))  # type: ignore[arg-type]

    async def get(self, key: str) -> bytes:
        k = _b(check_key(key))

        def probe() -> tuple[bool, Any]:
            if not self._cache.present(k):
                return False, [key]
            return True, self._cache.data.get(k, b"")  # as torch: a key naming only a queue reads as empty

        return await self._poll(lambda: self._read(probe), self._timeout_s, f"get({key!r})", per_key=True)

    async def add(self, key: str, amount: int) -> int:
        k, n = _b(check_key(key)), to_amount(amount)

        def body(fd: int | None) -> int:
            try:
                new = counter_add(k, self._cache.data.get(k), n)
            except ValueError as exc:
                raise DistStoreError(f"{self._describe()}: add({key!r}, {n}): {exc}") from None
            self._commit(fd, _rec(_SET, k, str(new).encode()))  # type: ignore[arg-type]
            return new

        return await self._write(body)

    async def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        k = _b(check_key(key))
        expected, desired = to_value(expected_value, "expected_value"), to_value(desired_value, "desired_value")

        def body(fd: int | None) -> bytes:
            cur = self._cache.data.get(k)
            if cur is None:
                if expected:
                    return expected
            elif cur != expected:
                return cur
            self._commit(fd, _rec(_SET, k, desired))  # type: ignore[arg-type]
            return desired

        return await self._write(body)

    async def wait(self, keys: Sequence[str], timeout: TimeoutLike | None = None) -> None:
        ks = check_keys(keys)
        seconds = self._wait_seconds(timeout)

        def probe() -> tuple[bool, Any]:
            missing = self._missing(ks)
            return (not missing, missing)

        await self._poll(lambda: self._read(probe), seconds, f"wait({ks!r})")

    async def check(self, keys: Sequence[str]) -> bool:
        ks = [_b(k) for k in check_keys(keys)]
        return await self._read(lambda: all(self._cache.present(k) for k in ks))

    async def delete_key(self, key: str) -> bool:
        k = _b(check_key(key))

        def body(fd: int | None) -> bool:
            if k not in self._cache.data:
                return False
            self._commit(fd, _rec(_DELETE, k))  # type: ignore[arg-type]
            return True

        return await self._write(body)

    async def num_keys(self) -> int:
        """The keys, plus one, as torch's FileStore counts: its file always holds its user
        counter as a key (torch lists it too, as ``efcount/``; aiodist's ``list_keys`` does not)."""
        return await self._read(lambda: len(self._cache.data) + 1)

    async def list_keys(self) -> list[str]:
        return await self._read(lambda: [k.decode(errors="replace") for k in self._cache.data])

    async def append(self, key: str, value: ValueLike) -> None:
        k, v = _b(check_key(key)), to_value(value)
        await self._write(lambda fd: self._commit(fd, _rec(_SET, k, self._cache.data.get(k, b"") + v)))  # type: ignore[arg-type]

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)

        def probe() -> tuple[bool, Any]:
            missing = self._missing(ks)
            if missing:
                return False, missing
            return True, [self._cache.data.get(_b(k), b"") for k in ks]

        return await self._poll(lambda: self._read(probe), self._timeout_s, f"multi_get({ks!r})", per_key=True)

    async def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        ks, vs = pair_up(keys, values)
        records = b"".join(_rec(_SET, _b(k), v) for k, v in zip(ks, vs))
        await self._write(lambda fd: self._commit(fd, records) if records else None)  # type: ignore[arg-type]

    async def queue_push(self, key: str, value: ValueLike) -> None:
        k, v = _b(check_key(key)), to_value(value)
        await self._write(lambda fd: self._commit(fd, _rec(_QPUSH, k, v)))  # type: ignore[arg-type]

    async def _pop_once(self, k: bytes) -> bytes | None:
        """One attempt at popping the queue ``k``: the head, or None if it is empty. Decided
        under the exclusive lock, so two poppers never get the same item."""
        self._check_open()
        c = self._cache

        def body(fd: int | None, cancel: threading.Event) -> bytes | None:
            q = c.queues.get(k)
            if not q:
                return None
            if cancel.is_set():  # the caller is gone: leave the item for someone else
                raise _Abandoned
            v = q[0]
            self._commit(fd, _rec(_QPOP, k))  # type: ignore[arg-type]
            return v

        def run(cancel: threading.Event) -> bytes | None:
            # unchanged file and an empty cached queue: nothing to pop, no lock needed
            return self._txn(lambda fd: body(fd, cancel), True, cancel=cancel, fast=lambda: (not c.queues.get(k), None))

        async def put_back(v: bytes | None) -> None:
            if v is None:
                return

            # popped after all, for a caller that is gone: put it back at the head
            def requeue(fd: int | None) -> None:
                if fd is not None:  # None: the file is gone, every user has closed
                    self._commit(fd, _rec(_QPUSH_FRONT, k, v))

            back = asyncio.ensure_future(
                asyncio.to_thread(self._txn, requeue, True, cancel=threading.Event(), register=False, create=False)
            )
            await self._finish(back)

        return await self._run(run, undo=put_back)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        k = _b(check_key(key))
        if not block:
            v = await self._pop_once(k)
            if v is None:
                raise QueueEmptyError(f"{self._describe()}: queue_pop({key!r}, block=False): queue is empty")
            return v

        async def attempt() -> tuple[bool, Any]:
            v = await self._pop_once(k)
            if v is not None:
                return True, v
            if k in self._cache.data:  # as HashStore: a wait would see the key present at once
                raise QueueEmptyError(VALUE_NOT_QUEUE.format(store=self._describe(), key=key))
            return False, [key]

        return await self._poll(attempt, self._timeout_s, f"queue_pop({key!r})")

    async def queue_len(self, key: str) -> int:
        k = _b(check_key(key))
        return await self._read(lambda: len(self._cache.queues.get(k) or ()))
