"""PrefixStore: a view of another store with ``<prefix>/`` in front of every key."""

from __future__ import annotations

from collections.abc import Sequence

from aiodist._pending import Pending
from aiodist._time import TimeoutLike
from aiodist.store.base import Store, ValueLike, check_key, check_keys

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key ``k`` goes to ``underlying_store`` as ``f"{prefix}/{k}"``. Timeouts are the
    underlying store's; ``num_keys`` counts the underlying store's keys, as torch's does."""

    def __init__(self, prefix: str, store: Store, *, _owns_store: bool = False) -> None:
        check_key(prefix, "prefix")
        if store is None:
            raise ValueError("store argument cannot be None")  # torch's type and words
        if not isinstance(store, Store):
            if isinstance(store, Pending):  # store = dist.rendezvous(...)-style calls without their await
                raise store.not_awaited("PrefixStore: store")
            raise TypeError(f"PrefixStore needs an aiodist Store, not {type(store).__name__}")
        self._prefix = prefix
        self._store = store
        self._owns_store = _owns_store  # a clone owns the underlying clone it made

    @property
    def underlying_store(self) -> Store:
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{check_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [f"{self._prefix}/{k}" for k in check_keys(keys)]

    @property
    def _timeout_s(self) -> float:  # type: ignore[override]
        return self._store._timeout_s

    async def set_timeout(self, timeout: TimeoutLike) -> None:
        await self._store.set_timeout(timeout)

    async def set(self, key: str, value: ValueLike) -> None:
        await self._store.set(self._k(key), value)

    async def get(self, key: str) -> bytes:
        return await self._store.get(self._k(key))

    async def add(self, key: str, amount: int) -> int:
        return await self._store.add(self._k(key), amount)

    async def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        return await self._store.compare_set(self._k(key), expected_value, desired_value)

    async def wait(self, keys: Sequence[str], timeout: TimeoutLike | None = None) -> None:
        await self._store.wait(self._ks(keys), timeout)

    async def check(self, keys: Sequence[str]) -> bool:
        return await self._store.check(self._ks(keys))

    async def delete_key(self, key: str) -> bool:
        return await self._store.delete_key(self._k(key))

    async def num_keys(self) -> int:
        return await self._store.num_keys()

    async def list_keys(self) -> list[str]:
        head = self._prefix + "/"
        return [k[len(head) :] for k in await self._store.list_keys() if k.startswith(head)]

    async def append(self, key: str, value: ValueLike) -> None:
        await self._store.append(self._k(key), value)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return await self._store.multi_get(self._ks(keys))

    async def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        await self._store.multi_set(self._ks(keys), values)

    async def queue_push(self, key: str, value: ValueLike) -> None:
        await self._store.queue_push(self._k(key), value)

    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        return await self._store.queue_pop(self._k(key), block)

    async def queue_len(self, key: str) -> int:
        return await self._store.queue_len(self._k(key))

    async def barrier(self, key: str, world_size: int, timeout: TimeoutLike | None = None) -> None:
        await self._store.barrier(self._k(key), world_size, timeout)

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def clone(self) -> PrefixStore:
        return PrefixStore(self._prefix, self._store.clone(), _owns_store=True)

    async def close(self) -> None:
        """Closing a view leaves the underlying store open (it may have other users), except
        for a view made by ``clone()``, which closes the underlying clone it made."""
        if self._owns_store:
            await self._store.close()

    def stats(self) -> dict[str, object]:
        return {"type": "PrefixStore", "prefix": self._prefix, "underlying": self._store.stats()}

    def _describe(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store._describe()})"
