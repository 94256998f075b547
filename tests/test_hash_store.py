"""HashStore: the conformance kit (on every event loop), use from other threads, clones,
stats, and the kit's own tests (a broken HashStore for each check, which that check must catch)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from aiodist import DistStoreError, HashStore, QueueEmptyError, Store, StoreTimeoutError
from aiodist.store.base import to_value
from aiodist.testing import STORE_CHECKS, check_store

ROOT = Path(__file__).resolve().parent.parent


async def make_hash_store() -> HashStore:
    return HashStore()


@pytest.mark.one_loop(reason="(a store in this process; the kit's long run is the same on every loop, and the TCPStore kits run on both)")
async def test_conformance_kit() -> None:
    await check_store(make_hash_store)


# -- construction, stats, clones ---------------------------------------------------------------


async def test_constructor_timeout() -> None:
    assert HashStore().timeout == timedelta(seconds=300)
    assert HashStore(timedelta(seconds=5)).timeout == timedelta(seconds=5)
    assert HashStore(2.5).timeout == timedelta(seconds=2.5)
    with pytest.raises(ValueError):
        HashStore(-1)
    with pytest.raises(TypeError):
        HashStore("10")  # type: ignore[arg-type]


async def test_stats_counts_keys_queues_and_waiters() -> None:
    store = HashStore(timeout=5)
    assert store.stats() == {"type": "HashStore", "timeout_s": 5.0, "keys": 0, "queues": 0, "waiters": 0}
    await store.set("a", "1")
    await store.add("b", 1)
    await store.queue_push("q", "x")
    getter = asyncio.create_task(store.get("later"))
    await asyncio.sleep(0.01)
    assert store.stats() == {"type": "HashStore", "timeout_s": 5.0, "keys": 2, "queues": 1, "waiters": 1}
    await store.set("later", "v")
    assert await getter == b"v"
    assert store.stats()["waiters"] == 0
    assert store.stats()["keys"] == 3


async def test_timed_out_and_cancelled_waits_leave_no_waiter() -> None:
    store = HashStore(timeout=0.05)
    with pytest.raises(StoreTimeoutError):
        await store.get("missing")
    with pytest.raises(StoreTimeoutError):
        await store.queue_pop("q")
    assert store.stats()["waiters"] == 0
    await store.set_timeout(5)
    task = asyncio.create_task(store.wait(["x", "y"]))
    await asyncio.sleep(0.01)
    assert store.stats()["waiters"] >= 1  # (counted once per key it waits on)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.stats()["waiters"] == 0
    await store.set("x", "1")
    assert await store.get("x") == b"1"


async def test_clone_shares_data() -> None:
    store = HashStore(timeout=3)
    clone = store.clone()
    assert isinstance(clone, HashStore) and clone is not store
    assert clone.timeout == store.timeout
    grandchild = clone.clone()
    await grandchild.set("k", "v")
    assert await store.get("k") == b"v"
    await store.queue_push("q", "item")
    assert await clone.queue_len("q") == 1
    assert await grandchild.queue_pop("q") == b"item"
    assert await store.queue_len("q") == 0
    # Separate stores do not share.
    assert await HashStore().check(["k"]) is False


async def test_async_context_manager() -> None:
    async with HashStore() as store:
        await store.set("k", "v")
        assert await store.get("k") == b"v"


async def test_cancelled_popper_passes_its_item_on() -> None:
    """A popper picked by a push but cancelled before it popped must not swallow the item."""
    store = HashStore(timeout=5)
    first = asyncio.create_task(store.queue_pop("q"))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(store.queue_pop("q"))
    await asyncio.sleep(0.01)
    await store.queue_push("q", "item")  # wakes `first` (registered first) ...
    first.cancel()  # ... which is cancelled before it runs
    assert await asyncio.wait_for(second, 2) == b"item"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await store.queue_len("q") == 0
    assert store.stats()["waiters"] == 0


# -- threads -------------------------------------------------------------------------------------


class _Thread:
    """Runs ``asyncio.run(coro_fn())`` in a thread and keeps its result or exception."""

    def __init__(self, coro_fn: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(coro_fn,), daemon=True)
        self._thread.start()

    def _main(self, coro_fn: Any) -> None:
        try:
            self.result = asyncio.run(coro_fn())
        except BaseException as exc:
            self.error = exc

    async def join(self, timeout: float = 5.0) -> Any:
        await asyncio.to_thread(self._thread.join, timeout)
        assert not self._thread.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


async def _until_waiters(store: HashStore, n: int, limit_s: float = 5.0) -> None:
    async with asyncio.timeout(limit_s):
        while store.stats()["waiters"] != n:  # noqa: ASYNC110 - another thread registers the waiter; no event to await
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("handle", ["same", "clone"])
async def test_get_in_another_thread_is_woken_by_set_here(handle: str) -> None:
    store = HashStore(timeout=5)
    other = store if handle == "same" else store.clone()
    thread = _Thread(lambda: other.get("k"))
    await _until_waiters(store, 1)
    await store.set("k", "from the main loop")
    assert await thread.join() == b"from the main loop"


async def test_get_here_is_woken_by_set_in_another_thread() -> None:
    store = HashStore(timeout=5)
    getter = asyncio.create_task(store.get("k"))
    await _until_waiters(store, 1)
    clone = store.clone()
    await _Thread(lambda: clone.set("k", "from a thread")).join()
    assert await asyncio.wait_for(getter, 5) == b"from a thread"


async def test_queue_pop_in_threads_each_item_once() -> None:
    store = HashStore(timeout=5)
    threads = [_Thread(lambda: store.clone().queue_pop("q")) for _ in range(3)]
    await _until_waiters(store, 3)
    for i in range(3):
        await store.queue_push("q", str(i))
    got = [await t.join() for t in threads]
    assert sorted(got) == [b"0", b"1", b"2"]


async def test_concurrent_adds_from_threads() -> None:
    store = HashStore(timeout=5)

    async def add_many() -> None:
        for _ in range(200):
            await store.add("n", 1)

    threads = [_Thread(add_many) for _ in range(4)]
    for t in threads:
        await t.join()
    assert await store.get("n") == b"800"


# -- a key used both as a value and as a queue (fixed busy loops) -----------------------------


def _fail_on_busy_loop(store: HashStore, limit: int = 1000) -> None:
    """Make the store's state raise when asked to register a wait ``limit`` times: the sign of
    a wait that returns at once, forever, so the call spins without yielding to the loop."""
    state = store._state
    real_wait = state.wait
    calls = 0

    def wait(keys: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > limit:
            raise RuntimeError(f"busy loop: state.wait called {calls} times")
        return real_wait(keys)

    state.wait = wait  # type: ignore[method-assign]


async def test_get_on_a_key_that_only_names_a_queue_reads_empty() -> None:
    store = HashStore(timeout=0.1)
    _fail_on_busy_loop(store)
    await store.queue_push("k", "item")
    assert await asyncio.wait_for(store.get("k"), 1) == b""  # as torch's TCPStore
    assert await store.queue_pop("k") == b"item"


async def test_blocking_queue_pop_on_a_value_key_raises_queue_empty() -> None:
    store = HashStore(timeout=0.1)
    _fail_on_busy_loop(store)
    await store.set("k", "value")
    with pytest.raises(QueueEmptyError):  # as torch
        await asyncio.wait_for(store.queue_pop("k"), 1)
    assert await store.get("k") == b"value"


# -- the kit's own tests: a broken store for each check ----------------------------------------


class _Mutant(HashStore):
    """A HashStore with one behaviour broken; ``clone()`` keeps the breakage."""

    def clone(self) -> HashStore:
        return type(self)(self._timeout_s, _state=self._state)


async def _set_upper(self: HashStore, key: str, value: Any) -> None:
    await HashStore.set(self, key, to_value(value).upper())


async def _get_bytearray(self: HashStore, key: str) -> Any:
    return bytearray(await HashStore.get(self, key))


async def _set_no_overwrite(self: HashStore, key: str, value: Any) -> None:
    if not await self.check([key]):
        await HashStore.set(self, key, value)


async def _get_no_wait(self: HashStore, key: str) -> bytes:
    if not await self.check([key]):
        raise StoreTimeoutError(f"get({key!r}) timed out")
    return await HashStore.get(self, key)


async def _get_untyped_timeout(self: HashStore, key: str) -> bytes:
    try:
        return await HashStore.get(self, key)
    except StoreTimeoutError:
        raise DistStoreError("Wait timeout") from None


async def _add_returns_amount(self: HashStore, key: str, amount: int) -> int:
    await HashStore.add(self, key, amount)
    return amount


async def _add_overwrites_text(self: HashStore, key: str, amount: int) -> int:
    try:
        return await HashStore.add(self, key, amount)
    except DistStoreError:
        await HashStore.set(self, key, str(amount))
        return amount


async def _compare_set_missing_sets(self: HashStore, key: str, expected: Any, desired: Any) -> bytes:
    if not await self.check([key]):
        await HashStore.set(self, key, desired)
        return to_value(desired)
    return await HashStore.compare_set(self, key, expected, desired)


async def _compare_set_always_sets(self: HashStore, key: str, expected: Any, desired: Any) -> bytes:
    if await self.check([key]):
        await HashStore.set(self, key, desired)
        return to_value(desired)
    return await HashStore.compare_set(self, key, expected, desired)


async def _wait_first_key(self: HashStore, keys: Any, timeout: Any = None) -> None:
    await HashStore.wait(self, list(keys)[:1], timeout)


async def _wait_ignores_timeout(self: HashStore, keys: Any, timeout: Any = None) -> None:
    await HashStore.wait(self, keys)


async def _check_ignores_queues(self: HashStore, keys: Any) -> bool:
    await HashStore.check(self, keys)
    return all(self._state.get(k.encode()) is not None for k in keys)


async def _delete_always_true(self: HashStore, key: str) -> bool:
    await HashStore.delete_key(self, key)
    return True


async def _num_keys_counts_queues(self: HashStore) -> int:
    return await HashStore.num_keys(self) + len(self._state._queues)


async def _list_keys_empty(self: HashStore) -> list[str]:
    return []


async def _append_replaces(self: HashStore, key: str, value: Any) -> None:
    await HashStore.set(self, key, value)


async def _multi_get_reversed(self: HashStore, keys: Any) -> list[bytes]:
    return list(reversed(await HashStore.multi_get(self, keys)))


async def _multi_get_no_wait(self: HashStore, keys: Any) -> list[bytes]:
    return [self._state.get(k.encode()) or b"" for k in keys]


async def _multi_get_partial_on_timeout(self: HashStore, keys: Any) -> list[bytes]:
    try:
        return await HashStore.multi_get(self, keys)
    except StoreTimeoutError:
        return [self._state.get(k.encode()) or b"" for k in keys]


async def _queue_pop_lifo(self: HashStore, key: str, block: bool = True) -> bytes:
    q = self._state._queues.get(key.encode())
    if q and len(q) > 1:
        q.rotate(1)
    return await HashStore.queue_pop(self, key, block)


async def _queue_len_zero(self: HashStore, key: str) -> int:
    return 0


async def _queue_pop_empty_bytes(self: HashStore, key: str, block: bool = True) -> bytes:
    if not block and not await HashStore.queue_len(self, key):
        return b""
    return await HashStore.queue_pop(self, key, block)


async def _queue_pop_never_blocks(self: HashStore, key: str, block: bool = True) -> bytes:
    return await HashStore.queue_pop(self, key, False)


async def _queue_pop_timeout_is_empty(self: HashStore, key: str, block: bool = True) -> bytes:
    try:
        return await HashStore.queue_pop(self, key, block)
    except StoreTimeoutError:
        raise QueueEmptyError("queue is empty") from None


async def _queue_pop_peeks(self: HashStore, key: str, block: bool = True) -> bytes:
    v = await HashStore.queue_pop(self, key, block)
    self._state._queues.setdefault(key.encode(), deque()).appendleft(v)
    return v


async def _barrier_no_wait(self: HashStore, key: str, world_size: int, timeout: Any = None) -> None:
    await self.add(f"{key}/num_members", 1)


async def _barrier_swallows_timeout(self: HashStore, key: str, world_size: int, timeout: Any = None) -> None:
    try:
        await HashStore.barrier(self, key, world_size, timeout)
    except StoreTimeoutError:
        pass


async def _set_timeout_noop(self: HashStore, timeout: Any) -> None:
    pass


async def _set_converts(self: HashStore, key: Any, value: Any) -> None:
    await HashStore.set(self, str(key), str(value) if isinstance(value, int) else value)


async def _add_not_atomic(self: HashStore, key: str, amount: int) -> int:
    old = self._state.get(key.encode())
    await asyncio.sleep(0)
    n = int(old or 0) + amount
    await HashStore.set(self, key, str(n))
    return n


def _clone_fresh(self: HashStore) -> HashStore:
    return HashStore(self._timeout_s)


def _no_extended_api(self: HashStore) -> bool:
    return False


async def _set_empty_deletes(self: HashStore, key: str, value: Any) -> None:
    if not to_value(value):
        await HashStore.delete_key(self, key)
    else:
        await HashStore.set(self, key, value)


async def _list_keys_ascii_only(self: HashStore) -> list[str]:
    return [k for k in await HashStore.list_keys(self) if k.isascii()]


async def _close_once(self: HashStore) -> None:
    if getattr(self, "_closed", False):
        raise RuntimeError("already closed")
    self._closed = True


async def _wait_task_bound_timeout(self: HashStore, keys: Any, timeout: Any = None) -> None:
    # the bug aiodist._time.within fixed: asyncio.timeout entered in the call's first step
    # belongs to the caller's task, so it cancels the caller, not the call
    ks = [k.encode() for k in keys]
    try:
        async with asyncio.timeout(self._wait_seconds(timeout)):
            while not self._state.check(ks):  # noqa: ASYNC110 - a deliberately plain poll
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise StoreTimeoutError(f"wait({keys!r}) timed out") from None


MUTANTS: dict[str, dict[str, Any]] = {
    "set_get_roundtrip": {"set": _set_upper},
    "bytes_out": {"get": _get_bytearray},
    "overwrite": {"set": _set_no_overwrite},
    "get_waits_for_set": {"get": _get_no_wait},
    "get_missing_times_out": {"get": _get_untyped_timeout},
    "add": {"add": _add_returns_amount},
    "add_non_integer": {"add": _add_overwrites_text},
    "compare_set_missing_key": {"compare_set": _compare_set_missing_sets},
    "compare_set_present_key": {"compare_set": _compare_set_always_sets},
    "wait_all_keys": {"wait": _wait_first_key},
    "wait_timeout_arg": {"wait": _wait_ignores_timeout},
    "timeout_in_another_task": {"wait": _wait_task_bound_timeout},
    "check": {"check": _check_ignores_queues},
    "delete_key": {"delete_key": _delete_always_true},
    "num_keys": {"num_keys": _num_keys_counts_queues},
    "list_keys": {"list_keys": _list_keys_empty},
    "append": {"append": _append_replaces},
    "multi_set_multi_get": {"multi_get": _multi_get_reversed},
    "multi_get_waits": {"multi_get": _multi_get_no_wait},
    "multi_get_timeout": {"multi_get": _multi_get_partial_on_timeout},
    "queue_fifo": {"queue_pop": _queue_pop_lifo},
    "queue_len": {"queue_len": _queue_len_zero},
    "queue_pop_nonblocking_empty": {"queue_pop": _queue_pop_empty_bytes},
    "queue_pop_waits": {"queue_pop": _queue_pop_never_blocks},
    "queue_pop_timeout": {"queue_pop": _queue_pop_timeout_is_empty},
    "queue_two_poppers": {"queue_pop": _queue_pop_peeks},
    "barrier": {"barrier": _barrier_no_wait},
    "barrier_timeout": {"barrier": _barrier_swallows_timeout},
    "set_timeout": {"set_timeout": _set_timeout_noop},
    "bad_arguments": {"set": _set_converts},
    "concurrent_add": {"add": _add_not_atomic},
    "clone_shares_data": {"clone": _clone_fresh},
    "has_extended_api": {"has_extended_api": _no_extended_api},
    "empty_value": {"set": _set_empty_deletes},
    "unicode_and_slash_keys": {"list_keys": _list_keys_ascii_only},
    "close_idempotent": {"close": _close_once},
}


def test_every_check_has_a_mutant() -> None:
    assert list(MUTANTS) == list(STORE_CHECKS)


@pytest.mark.parametrize("name", list(MUTANTS))
async def test_check_catches_its_mutant(name: str) -> None:
    cls = type(f"Mutant_{name}", (_Mutant,), MUTANTS[name])

    async def make() -> Store:
        return cls()

    others = set(STORE_CHECKS) - {name}
    with pytest.raises(AssertionError, match=rf"store check\(s\) failed: {name}\n"):
        await check_store(make, timeout=0.2, skip=others)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.9 s a run); a second loop waits them out again for the same result")
async def test_kit_uses_a_fresh_store_per_check_and_closes_it() -> None:
    made: list[HashStore] = []
    closed: list[HashStore] = []

    class Counted(HashStore):
        async def close(self) -> None:
            closed.append(self)

    async def make() -> Store:
        made.append(Counted())
        return made[-1]

    await check_store(
        make, skip={"get_missing_times_out", "wait_timeout_arg", "multi_get_timeout", "queue_pop_timeout", "barrier_timeout", "set_timeout"}
    )
    assert len(made) == len(STORE_CHECKS) - 6
    assert len({id(s) for s in made}) == len(made)
    assert all(s in closed for s in made)
    assert all(s.timeout == timedelta(seconds=0.3) for s in made), "the kit sets the timeout"


async def test_kit_names_every_failing_check() -> None:
    class Broken(_Mutant):
        has_extended_api = _no_extended_api
        list_keys = _list_keys_empty

    async def make() -> Store:
        return Broken()

    with pytest.raises(AssertionError) as info:
        await check_store(make, skip={n for n in STORE_CHECKS if n not in ("has_extended_api", "list_keys", "append")})
    msg = str(info.value)
    assert "has_extended_api" in msg and "list_keys" in msg
    assert "append" not in msg.split("\n")[0]


async def test_kit_refuses_unknown_skip_names() -> None:
    with pytest.raises(ValueError, match="no_such_check"):
        await check_store(make_hash_store, skip={"no_such_check"})
