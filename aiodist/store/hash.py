"""HashStore: an in-process store, for tasks of one process and for threads (each with its
own event loop, or none through ``asyncio.run_coroutine_threadsafe``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from aiodist._time import TimeoutLike
from aiodist.errors import DistStoreError, QueueEmptyError
from aiodist.store.base import (
    DEFAULT_STORE_TIMEOUT,
    VALUE_NOT_QUEUE,
    Store,
    ValueLike,
    check_key,
    check_keys,
    pair_up,
    store_timeout,
    to_amount,
    to_value,
)
from aiodist.store.state import KVState

__all__ = ["HashStore"]


def _b(key: str) -> bytes:
    return key.encode()


class HashStore(Store):
    """A thread-safe store backed by a dict. ``clone()`` shares the data."""

    def __init__(self, timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT, *, _state: KVState | None = None) -> None:
        super().__init__(timeout)
        self._state = _state if _state is not None else KVState()

    async def _wait(self, keys: list[str], seconds: float, op: str) -> None:
        bkeys = [_b(k) for k in keys]
        w = self._state.wait(bkeys)
        if w is None:
            return
        start = time.monotonic()
        if not await self._state.settle(w, seconds):
            missing = [k.decode() for k in self._state.missing(bkeys)]
            raise store_timeout(self._describe(), op, missing or keys, time.monotonic() - start, "Wait timeout")  # torch's words

    async def set(self, key: str, value: ValueLike) -> None:
        self._state.set(_b(check_key(key)), to_value(value))

    async def get(self, key: str) -> bytes:
        k = _b(check_key(key))
        deadline = time.monotonic() + self._timeout_s
        while True:
            await self._wait([key], max(0.0, deadline - time.monotonic()), f"get({key!r})")
            v = self._state.get(k)
            if v is not None:
                return v
            if self._state.check([k]):
                return b""  # as torch's TCPStore: a key that only names a queue reads as empty
            # deleted between the wake and now: wait on

    async def add(self, key: str, amount: int) -> int:
        k, n = _b(check_key(key)), to_amount(amount)
        try:
            return self._state.add(k, n)
        except ValueError as exc:
            raise DistStoreError(f"HashStore: add({key!r}, {n}): {exc}") from None

    async def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        return self._state.compare_set(
            _b(check_key(key)), to_value(expected_value, "expected_value"), to_value(desired_value, "desired_value")
        )

    async def wait(self, keys: Sequence[str], timeout: TimeoutLike | None = None) -> None:
        ks = check_keys(keys)
        await self._wait(ks, self._wait_seconds(timeout), f"wait({ks!r})")

    async def check(self, keys: Sequence[str]) -> bool:
        return self._state.check([_b(k) for k in check_keys(keys)])

    async def delete_key(self, key: str) -> bool:
        return self._state.delete(_b(check_key(key)))

    async def num_keys(self) -> int:
        return self._state.num_keys()

    async def list_keys(self) -> list[str]:
        return [k.decode(errors="replace") for k in self._state.list_keys()]

    async def append(self, key: str, value: ValueLike) -> None:
        self._state.append(_b(check_key(key)), to_value(value))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        await self._wait(ks, self._timeout_s, f"multi_get({ks!r})")
        return self._state.multi_get([_b(k) for k in ks])

    async def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        ks, vs = pair_up(keys, values)
        self._state.multi_set([_b(k) for k in ks], vs)

    async def queue_push(self, key: str, value: ValueLike) -> None:
        self._state.queue_push(_b(check_key(key)), to_value(value))

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        k = _b(check_key(key))
        deadline = time.monotonic() + self._timeout_s
        while True:
            n, v = self._state.queue_pop(k)
            if v is not None:
                return v
            if not block:
                raise QueueEmptyError(f"HashStore: queue_pop({key!r}, block=False): queue is empty")
            if self._state.get(k) is not None:
                raise QueueEmptyError(VALUE_NOT_QUEUE.format(store="HashStore", key=key))
            await self._wait([key], max(0.0, deadline - time.monotonic()), f"queue_pop({key!r})")

    async def queue_len(self, key: str) -> int:
        return self._state.queue_len(_b(check_key(key)))

    def clone(self) -> HashStore:
        return HashStore(self._timeout_s, _state=self._state)

    def stats(self) -> dict[str, object]:
        keys, queues, waiters = self._state.key_count()
        return {**super().stats(), "keys": keys, "queues": queues, "waiters": waiters}
