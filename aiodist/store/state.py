"""The in-memory data model of a store: keys, values, queues and the waiters on them.

Shared by ``HashStore`` and the TCPStore server, so both keep the same rules:
- a key "exists" when it holds a value or names a non-empty queue (torch's CHECK/WAIT);
- writing a value wakes every waiter whose keys now all exist; pushing to a queue wakes one;
- ADD stores its counter as ASCII decimal; a non-integer value refuses the ADD.
Thread-safe: one lock guards the data, and a waiter's future is resolved on its own loop
(directly when that loop runs in this thread, else through ``call_soon_threadsafe``), so
tasks on several threads' loops can share one state.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import deque
from collections.abc import Callable

from aiodist._time import within

__all__ = ["KVState", "Waiter", "counter_add"]


class Waiter:
    """A pending wait: resolved (result None) once ``ready`` holds."""

    __slots__ = ("keys", "fut", "predicate")

    def __init__(self, keys: tuple[bytes, ...], fut: asyncio.Future[None], predicate: Callable[[bytes | None], bool] | None) -> None:
        self.keys = keys
        self.fut = fut
        self.predicate = predicate


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class KVState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: dict[bytes, list[Waiter]] = {}

    # -- queries -------------------------------------------------------------------------

    def _present(self, key: bytes) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def check(self, keys: tuple[bytes, ...] | list[bytes]) -> bool:
        data, queues = self._data, self._queues
        if len(keys) == 1:  # the common case (a client's get): one lookup needs no lock
            k = keys[0]
            return k in data or bool(queues.get(k))
        with self._lock:
            for k in keys:
                if k not in data and not queues.get(k):
                    return False
            return True

    def missing(self, keys: tuple[bytes, ...] | list[bytes]) -> list[bytes]:
        with self._lock:
            return [k for k in keys if not self._present(k)]

    def multi_get(self, keys: tuple[bytes, ...] | list[bytes]) -> list[bytes]:
        with self._lock:
            return [self._data.get(k, b"") for k in keys]

    def num_keys(self) -> int:
        return len(self._data)

    def list_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def queue_len(self, key: bytes) -> int:
        q = self._queues.get(key)
        return len(q) if q else 0

    def key_count(self) -> tuple[int, int, int]:
        """(keys, queues, waiters): for statistics."""
        with self._lock:
            return len(self._data), len(self._queues), len({id(w) for ws in self._waiters.values() for w in ws})

    def snapshot_sizes(self) -> dict[bytes, int]:
        with self._lock:
            return {k: len(v) for k, v in self._data.items()}

    # -- updates -------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._data[key] = value
            wake = self._ready_waiters(key, one=False) if key in self._waiters else None
        if wake:
            _wake(wake)

    def append(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._data[key] = self._data.get(key, b"") + value
            wake = self._ready_waiters(key, one=False)
        _wake(wake)

    def multi_set(self, keys: tuple[bytes, ...] | list[bytes], values: tuple[bytes, ...] | list[bytes]) -> None:
        with self._lock:
            wake: list[Waiter] = []
            for k, v in zip(keys, values):
                self._data[k] = v
            for k in dict.fromkeys(keys):
                wake += self._ready_waiters(k, one=False)
        _wake(wake)

    def add(self, key: bytes, delta: int) -> int:
        """Add ``delta`` to the counter at ``key`` (created at 0) and return the new value.

        As torch's server: the stored value is read like C's ``stoll`` (leading blanks, a sign,
        then digits; anything after them is ignored), the sum wraps around in 64 bits, and a
        value with no leading integer or one outside the signed 64-bit range is refused with
        ``ValueError``.
        """
        with self._lock:
            old = self._data.get(key)
            if old is not None and old.isdigit() and len(old) < 19:  # what ADD stores, and the sum fits: counter_add's first case
                n = int(old) + delta
                if not -_I64_HALF <= n < _I64_HALF:
                    n = counter_add(key, old, delta)
            else:
                n = counter_add(key, old, delta)
            self._data[key] = b"%d" % n
            wake = self._ready_waiters(key, one=False) if key in self._waiters else None
        if wake:
            _wake(wake)
        return n

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            cur = self._data.get(key)
            if cur is None:
                if expected:
                    return expected
                self._data[key] = desired
            elif cur == expected:
                self._data[key] = desired
            else:
                return cur
            wake = self._ready_waiters(key, one=False)
        _wake(wake)
        return desired

    def delete(self, key: bytes) -> bool:
        """Delete the value at ``key``; a queue of the same name is left alone (torch's server)."""
        with self._lock:
            return self._data.pop(key, None) is not None

    def queue_push(self, key: bytes, value: bytes) -> None:
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = deque()
            q.append(value)
            wake = self._ready_waiters(key, one=True)
        _wake(wake)

    def queue_pop(self, key: bytes) -> tuple[int, bytes | None]:
        """(length before the pop, the popped value or None when the queue was empty)."""
        with self._lock:
            q = self._queues.get(key)
            if not q:
                return 0, None
            n = len(q)
            v = q.popleft()
            if not q:
                del self._queues[key]
            return n, v

    # -- waiting -------------------------------------------------------------------------

    def wait(self, keys: tuple[bytes, ...] | list[bytes]) -> Waiter | None:
        """None when every key exists now; else a Waiter whose ``fut`` (on the running loop)
        resolves when they all do. The caller must ``cancel`` it if it stops waiting."""
        return self._register(tuple(keys), None)

    def wait_until(self, key: bytes, predicate: Callable[[bytes | None], bool]) -> Waiter | None:
        """Like ``wait`` for one key, until ``predicate(value or None)`` holds."""
        return self._register((key,), predicate)

    def _register(self, keys: tuple[bytes, ...], predicate: Callable[[bytes | None], bool] | None) -> Waiter | None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._is_ready(keys, predicate):
                return None
            w = Waiter(keys, loop.create_future(), predicate)
            for k in dict.fromkeys(keys):
                self._waiters.setdefault(k, []).append(w)
            return w

    async def settle(self, w: Waiter, seconds: float) -> bool:
        """Await ``w`` for at most ``seconds``: True once woken, False on timeout. On timeout or
        cancellation the waiter is unregistered (and a queue wake it held is passed on)."""
        try:
            await within(w.fut, seconds)  # not asyncio.timeout: this runs in a call's first step
        except TimeoutError:
            self.cancel(w)
            return False
        except BaseException:
            self.cancel(w)
            raise
        return True

    def cancel(self, w: Waiter) -> None:
        """Forget ``w``. If it had been picked as the one waiter a queue push wakes, pass the
        wake on, so a timed-out waiter never swallows another waiter's item."""
        with self._lock:
            self._unregister(w)
            wake: list[Waiter] = []
            for k in dict.fromkeys(w.keys):
                if self._queues.get(k):
                    wake += self._ready_waiters(k, one=True)
        if not w.fut.done():
            w.fut.cancel()
        _wake(wake)

    def _is_ready(self, keys: tuple[bytes, ...], predicate: Callable[[bytes | None], bool] | None) -> bool:
        if predicate is not None:
            return predicate(self._data.get(keys[0]))
        return all(self._present(k) for k in keys)

    def _unregister(self, w: Waiter) -> None:
        for k in dict.fromkeys(w.keys):
            lst = self._waiters.get(k)
            if lst is not None:
                try:
                    lst.remove(w)
                except ValueError:
                    pass
                if not lst:
                    del self._waiters[k]

    def _ready_waiters(self, key: bytes, one: bool) -> list[Waiter]:
        """Called with the lock held after ``key`` changed: unregister and return the waiters
        to wake (at most one with ``one``)."""
        lst = self._waiters.get(key)
        if not lst:
            return []
        out: list[Waiter] = []
        for w in list(lst):
            if w.fut.done():  # cancelled by its owner; drop it
                self._unregister(w)
                continue
            if self._is_ready(w.keys, w.predicate):
                self._unregister(w)
                out.append(w)
                if one:
                    break
        return out


_I64_HALF = 2**63
_I64_SPAN = 2**64
_LEADING_INT = re.compile(rb"\s*([+-]?\d+)")


def _stoll(key: bytes, value: bytes) -> int:
    m = _LEADING_INT.match(value)
    if m is None:
        raise ValueError(f"value of key {key!r} is not an integer: {value[:64]!r}")
    n = int(m.group(1))
    if not -_I64_HALF <= n < _I64_HALF:
        raise ValueError(f"value of key {key!r} is outside the signed 64-bit range: {value[:64]!r}")
    return n


def counter_add(key: bytes, old: bytes | None, delta: int) -> int:
    """What ADD stores: ``old`` read as torch's server reads it, plus ``delta``, wrapped to 64
    bits. Every store uses this, so they agree. ValueError if ``old`` is not a counter."""
    if old is None:
        n = delta
    elif old.isdigit() and len(old) < 19:  # what ADD itself stores (fewer than 19 digits fit in 63 bits)
        n = int(old) + delta
    else:
        n = _stoll(key, old) + delta
    if -_I64_HALF <= n < _I64_HALF:
        return n
    return ((n + _I64_HALF) % _I64_SPAN) - _I64_HALF


def _wake(waiters: list[Waiter]) -> None:
    if not waiters:
        return
    here = _running_loop()
    for w in waiters:
        loop = w.fut.get_loop()
        if loop is here:
            _resolve(w.fut)
        else:
            try:
                loop.call_soon_threadsafe(_resolve, w.fut)
            except RuntimeError:  # that loop is closed; nobody is waiting any more
                pass
