"""The store conformance kit: checks every ``Store`` implementation must pass.

``await check_store(make_store)`` runs each check of ``STORE_CHECKS`` on a fresh store made by
``make_store`` (an async callable returning a new, empty store), with the store's default
timeout set short, and raises ``AssertionError`` naming the checks that failed. The rules are
torch.distributed's documented store semantics (add 1 then 6 gives 7, append "po" + "tato" is
b"potato", compare_set's three cases, queues wake one waiter, ...) plus aiodist's own: every
method is a coroutine, values come back as ``bytes``, waits end with ``StoreTimeoutError``
naming the key, bad arguments raise ``TypeError``/``ValueError`` at once.

A check is ``async def check(store) -> None``; it may read ``store.timeout`` (the kit's
``timeout``) and must close every clone it makes. The kit closes the store itself. Every time
bound in the checks scales with ``timeout``: give a slow store a larger one.

Usage, in a store's tests::

    async def test_conformance():
        await check_store(lambda: make_my_store(), timeout=0.3, skip={"queue_two_poppers"})
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Coroutine, Iterable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

from aiodist.errors import DistStoreError, QueueEmptyError, StoreTimeoutError
from aiodist.store.base import Store

__all__ = ["check_store", "STORE_CHECKS", "StoreCheck"]

StoreCheck = Callable[[Store], Awaitable[None]]

STORE_CHECKS: dict[str, StoreCheck] = {}
"""Every check, by name, in the order the kit runs them."""

_F = TypeVar("_F", bound=StoreCheck)
_T = TypeVar("_T")

# How long a store may take beyond its timeout to report it, and how long "a moment" is when a
# check shows that something is still waiting. Generous: a TCPStore answers over loopback.
_SLACK_S = 0.5
_MOMENT_S = 0.05


def _check(fn: _F) -> _F:
    name = fn.__name__.removeprefix("check_")
    assert name not in STORE_CHECKS, name
    STORE_CHECKS[name] = fn
    return fn


async def check_store(
    make_store: Callable[[], Awaitable[Store]],
    *,
    timeout: float = 0.3,
    skip: Container[str] = (),
) -> None:
    """Run every check in ``STORE_CHECKS`` not named in ``skip``, each on a fresh store from
    ``make_store()`` whose default timeout is set to ``timeout`` seconds; close each store
    afterwards. Raises ``AssertionError`` naming every failing check (chained to the first
    failure). A check that hangs fails after ``max(5, 10 * timeout)`` seconds."""
    if isinstance(skip, Iterable) and not isinstance(skip, str):
        unknown = sorted(set(skip) - set(STORE_CHECKS))
        if unknown:
            raise ValueError(f"check_store: unknown check name(s) in skip: {unknown}; known: {list(STORE_CHECKS)}")
    guard_s = max(5.0, 10 * timeout)
    failures: list[tuple[str, BaseException]] = []
    for name, check in STORE_CHECKS.items():
        if name in skip:
            continue
        store = await make_store()
        guard = asyncio.timeout(guard_s)
        try:
            await store.set_timeout(timeout)
            assert store.timeout == timedelta(seconds=timeout), f"after set_timeout({timeout:g}) the timeout property is {store.timeout!r}"
            async with guard:
                await check(store)
        except Exception as exc:
            if guard.expired():
                err: BaseException = AssertionError(f"hung for more than {guard_s:g} s")
                err.__cause__ = exc
            elif type(exc) is TimeoutError and not str(exc):  # asyncio.wait_for in a check ran out
                err = AssertionError("a store call did not finish in the time the check allows")
                err.__cause__ = exc
            else:
                err = exc
            failures.append((name, err))
        finally:
            try:
                await store.close()
            except Exception as exc:
                if not failures or failures[-1][0] != name:
                    err = AssertionError(f"close() after the check raised {type(exc).__name__}: {exc}")
                    err.__cause__ = exc
                    failures.append((name, err))
    if failures:
        lines = [f"  {name}: {type(exc).__name__}: {exc}" for name, exc in failures]
        names = ", ".join(name for name, _ in failures)
        raise AssertionError(f"store check(s) failed: {names}\n" + "\n".join(lines)) from failures[0][1]


# -- helpers ---------------------------------------------------------------------------------


@asynccontextmanager
async def _tasks() -> AsyncIterator[Callable[[Coroutine[Any, Any, _T]], asyncio.Task[_T]]]:
    """Start tasks; on exit cancel and reap the ones still running, so a failing check leaves
    nothing pending (unlike a TaskGroup, the body's own exception comes out unwrapped)."""
    started: list[asyncio.Task[Any]] = []

    def start(coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.ensure_future(coro)
        started.append(task)
        return task

    try:
        yield start
    finally:
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)


async def _clone(store: Store) -> Store:
    c = store.clone()
    if inspect.isawaitable(c):  # a store whose clone must connect may return an awaitable
        c = await c
    assert isinstance(c, Store), f"clone() returned {type(c).__name__}, not a Store"
    assert c is not store, "clone() returned the store itself"
    return c


def _timeout_s(store: Store) -> float:
    return store.timeout.total_seconds()


async def _expect_timeout(aw: Awaitable[Any], what: str, key: str, at_least: float, at_most: float) -> StoreTimeoutError:
    """Await ``aw``; it must raise StoreTimeoutError naming ``key`` after ``at_least`` .. ``at_most`` s."""
    start = time.monotonic()
    try:
        result = await aw
    except StoreTimeoutError as exc:
        took = time.monotonic() - start
        assert isinstance(exc, DistStoreError) and isinstance(exc, TimeoutError), (
            f"{what}: {type(exc).__name__} must be a DistStoreError and a TimeoutError"
        )
        assert key in str(exc), f"{what}: timeout message does not name {key!r}: {exc}"
        assert took >= at_least, f"{what}: timed out after {took:.3f} s, sooner than {at_least:.3f} s"
        assert took <= at_most, f"{what}: timed out after {took:.3f} s, later than {at_most:.3f} s"
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}) instead of StoreTimeoutError") from exc
    raise AssertionError(f"{what}: returned {result!r} instead of raising StoreTimeoutError")


def _outcome(task: asyncio.Task[Any]) -> str:
    if not task.done():
        return "still running"
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return f"raised {type(exc).__name__}: {exc}" if exc is not None else f"returned {task.result()!r}"


async def _still_waiting(task: asyncio.Task[Any], what: str) -> None:
    await asyncio.sleep(_MOMENT_S)
    assert not task.done(), f"{what} ended before it should have: {_outcome(task)}"


def _eq(actual: object, expected: object, what: str) -> None:
    assert actual == expected, f"{what}: got {actual!r}, expected {expected!r}"


def _is(actual: object, expected: object, what: str) -> None:
    assert actual is expected, f"{what}: got {actual!r}, expected {expected!r}"


def _is_bytes(v: object, what: str) -> None:
    assert type(v) is bytes, f"{what} returned {type(v).__name__} ({v!r}), not bytes"


# -- set / get -------------------------------------------------------------------------------


@_check
async def check_set_get_roundtrip(store: Store) -> None:
    await store.set("kit/str", "first_value")
    _eq(await store.get("kit/str"), b"first_value", 'get("kit/str")')
    await store.set("kit/bytes", b"\x00\xff raw \x80")
    _eq(await store.get("kit/bytes"), b"\x00\xff raw \x80", 'get("kit/bytes")')
    await store.set("kit/utf8", "π≈3.14")
    _eq(await store.get("kit/utf8"), "π≈3.14".encode(), 'get("kit/utf8")')


@_check
async def check_bytes_out(store: Store) -> None:
    await store.set("kit/a", "x")
    _is_bytes(await store.get("kit/a"), "get")
    await store.add("kit/n", 3)
    _is_bytes(await store.get("kit/n"), "get of a counter")
    _eq(await store.get("kit/n"), b"3", "a counter must read back as ASCII decimal")
    _is_bytes(await store.compare_set("kit/a", "x", "y"), "compare_set")
    for i, v in enumerate(await store.multi_get(["kit/a", "kit/n"])):
        _is_bytes(v, f"multi_get item {i}")
    await store.queue_push("kit/q", "z")
    _is_bytes(await store.queue_pop("kit/q"), "queue_pop")


@_check
async def check_overwrite(store: Store) -> None:
    await store.set("kit/k", "old")
    await store.set("kit/k", "new")
    _eq(await store.get("kit/k"), b"new", 'get("kit/k")')
    await store.set("kit/k", "n")
    _eq(await store.get("kit/k"), b"n", "a shorter value must replace a longer one whole")


@_check
async def check_get_waits_for_set(store: Store) -> None:
    async with _tasks() as start:
        getter = start(store.get("kit/later"))
        await _still_waiting(getter, "get of a key not yet set")
        await store.set("kit/later", "value")
        _eq(await asyncio.wait_for(getter, _timeout_s(store) + _SLACK_S), b"value", "the waiting call")


@_check
async def check_get_missing_times_out(store: Store) -> None:
    t = _timeout_s(store)
    await _expect_timeout(store.get("kit/missing-key"), "get", "kit/missing-key", 0.8 * t, t + _SLACK_S + t)


# -- add / compare_set -----------------------------------------------------------------------


@_check
async def check_add(store: Store) -> None:
    n = await store.add("kit/first_key", 1)
    assert type(n) is int and n == 1, f"add creating a counter returned {n!r}, not 1"
    _eq(await store.add("kit/first_key", 6), 7, 'add("kit/first_key", 6)')
    _eq(await store.get("kit/first_key"), b"7", 'get("kit/first_key")')
    _eq(await store.add("kit/first_key", -10), -3, 'add("kit/first_key", -10)')
    _eq(await store.get("kit/first_key"), b"-3", 'get("kit/first_key")')
    _eq(await store.add("kit/first_key", 0), -3, 'add("kit/first_key", 0)')
    _eq(await store.add("kit/neg", -5), -5, "add must create a counter at a negative amount")
    await store.set("kit/preset", "40")
    _eq(await store.add("kit/preset", 2), 42, "add must continue from an integer value written by set")
    big = 2**62
    _eq(await store.add("kit/big", big), big, 'add("kit/big", big)')


@_check
async def check_add_non_integer(store: Store) -> None:
    await store.set("kit/text", "not a number")
    try:
        await store.add("kit/text", 1)
    except DistStoreError:
        pass
    else:
        raise AssertionError("add on a non-integer value did not raise DistStoreError")
    _eq(await store.get("kit/text"), b"not a number", "a refused add changed the value")
    await store.set("kit/after", "ok")
    _eq(await store.get("kit/after"), b"ok", "the store is unusable after a refused add")
    _eq(await store.add("kit/counter", 2), 2, 'add("kit/counter", 2)')


@_check
async def check_compare_set_missing_key(store: Store) -> None:
    # Missing key, non-empty expected: nothing is stored and the expected value comes back.
    _eq(await store.compare_set("kit/k1", "expected", "desired"), b"expected", 'compare_set("kit/k1", "expected", "desired")')
    assert not await store.check(["kit/k1"]), "compare_set stored a value though the key was missing"
    # Missing key, empty expected: the desired value is stored and returned.
    _eq(await store.compare_set("kit/k2", "", "desired"), b"desired", 'compare_set("kit/k2", "", "desired")')
    _eq(await store.get("kit/k2"), b"desired", 'get("kit/k2")')


@_check
async def check_compare_set_present_key(store: Store) -> None:
    await store.set("kit/key", "first_value")
    _eq(
        await store.compare_set("kit/key", "first_value", "second_value"),
        b"second_value",
        'compare_set("kit/key", "first_value", "second_value")',
    )
    _eq(await store.get("kit/key"), b"second_value", 'get("kit/key")')
    # A mismatch returns the current value and changes nothing.
    _eq(
        await store.compare_set("kit/key", "first_value", "third_value"),
        b"second_value",
        'compare_set("kit/key", "first_value", "third_value")',
    )
    _eq(await store.get("kit/key"), b"second_value", 'get("kit/key")')
    # An empty expected value does not match a present non-empty value.
    _eq(await store.compare_set("kit/key", "", "fourth_value"), b"second_value", 'compare_set("kit/key", "", "fourth_value")')
    _eq(await store.get("kit/key"), b"second_value", 'get("kit/key")')
    _eq(await store.compare_set("kit/key", b"second_value", b"fifth"), b"fifth", "bytes arguments")


# -- wait / check / delete / num_keys / list_keys --------------------------------------------


@_check
async def check_wait_all_keys(store: Store) -> None:
    await store.wait([])  # nothing to wait for
    keys = ["kit/w1", "kit/w2", "kit/w3"]
    async with _tasks() as start:
        waiter = start(store.wait(keys))
        await store.set("kit/w1", "1")
        await _still_waiting(waiter, "wait with 2 of 3 keys missing")
        await store.add("kit/w2", 1)
        await _still_waiting(waiter, "wait with 1 of 3 keys missing")
        await store.append("kit/w3", "x")
        await asyncio.wait_for(waiter, _timeout_s(store) + _SLACK_S)
    await store.wait(keys)  # all present: returns at once


@_check
async def check_wait_timeout_arg(store: Store) -> None:
    t = _timeout_s(store)
    # A shorter explicit timeout is honoured (as a timedelta, torch's type) ...
    short = t / 4
    await _expect_timeout(store.wait(["kit/never"], timedelta(seconds=short)), "wait(timeout=short)", "kit/never", 0.8 * short, 0.9 * t)
    # ... and so is a longer one: the key comes after the default timeout, within the explicit one.
    async with _tasks() as start:
        waiter = start(store.wait(["kit/late"], 3 * t + _SLACK_S))
        await asyncio.sleep(1.5 * t)
        assert not waiter.done(), f"wait(timeout={3 * t + _SLACK_S:g}) ended early, by the store's default timeout? {_outcome(waiter)}"
        await store.set("kit/late", "1")
        await asyncio.wait_for(waiter, t + _SLACK_S)


@_check
async def check_timeout_in_another_task(store: Store) -> None:
    # A call starts in the caller's task and finishes in whichever task awaits it (gather wraps
    # it in one): its deadline must end the call, not cancel the caller (or what runs beside it).
    t = _timeout_s(store)
    start = time.monotonic()
    try:
        got = await asyncio.gather(
            store.wait(["kit/never"], timedelta(seconds=t / 2)), store.get("kit/nokey"), asyncio.sleep(1.5 * t), return_exceptions=True
        )
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or time.monotonic() - start > 1.5 * t + 5.0:
            raise
        task.uncancel()  # the stray cancellation a call's deadline sent to its caller
        raise AssertionError(
            "a store call's deadline cancelled the task that made the call "
            "(asyncio.timeout entered in the call's first step? use aiodist._time.within)"
        ) from None
    took = time.monotonic() - start
    for what, r in zip(("wait(timeout=t/2)", "get of a missing key"), got[:2]):
        assert isinstance(r, StoreTimeoutError), f"gather({what}, ...): {type(r).__name__} ({r!r}) instead of StoreTimeoutError"
    assert got[2] is None, f"the sleep gathered beside two store calls ended with {got[2]!r}: the calls' deadlines cancelled it"
    assert took < 1.5 * t + 5.0, f"gather took {took:.2f} s"


@_check
async def check_check(store: Store) -> None:
    _is(await store.check([]), True, "check([])")
    _is(await store.check(["kit/a"]), False, "check of a missing key")
    await store.set("kit/a", "1")
    _is(await store.check(["kit/a"]), True, "check of a key just set")
    _is(await store.check(["kit/a", "kit/b"]), False, "check must need every key")
    await store.add("kit/b", 1)
    _is(await store.check(["kit/a", "kit/b"]), True, "check once every key is set")
    # A non-empty queue counts as present; an emptied one does not.
    _is(await store.check(["kit/q"]), False, "check of a queue never pushed")
    await store.queue_push("kit/q", "item")
    _is(await store.check(["kit/q"]), True, "check must count a non-empty queue as present")
    await store.queue_pop("kit/q")
    _is(await store.check(["kit/q"]), False, "check must not count an emptied queue")


@_check
async def check_delete_key(store: Store) -> None:
    await store.set("kit/first_key", "v")
    _is(await store.delete_key("kit/first_key"), True, "delete_key of a present key")
    _is(await store.check(["kit/first_key"]), False, "the key is still there after delete_key")
    _is(await store.delete_key("kit/first_key"), False, "delete_key of a key already deleted")
    _is(await store.delete_key("kit/bad_key"), False, "delete_key of a key never set")
    await store.set("kit/first_key", "again")
    _eq(await store.get("kit/first_key"), b"again", "a deleted key cannot be set again")


@_check
async def check_num_keys(store: Store) -> None:
    base = await store.num_keys()  # a TCPStore counts an internal key
    assert type(base) is int and base >= 0, f"num_keys() of an empty store returned {base!r}"
    await store.set("kit/a", "1")
    await store.set("kit/b", "2")
    _eq(await store.num_keys(), base + 2, "num_keys()")
    await store.set("kit/a", "overwritten")
    _eq(await store.num_keys(), base + 2, "overwriting a key changed num_keys")
    await store.add("kit/c", 1)
    await store.append("kit/d", "x")
    _eq(await store.num_keys(), base + 4, "num_keys()")
    await store.queue_push("kit/q", "item")
    _eq(await store.num_keys(), base + 4, "num_keys must not count queues")
    await store.delete_key("kit/a")
    _eq(await store.num_keys(), base + 3, "num_keys()")


@_check
async def check_list_keys(store: Store) -> None:
    base = set(await store.list_keys())
    await store.set("kit/a", "1")
    await store.add("kit/b", 1)
    await store.multi_set(["kit/c", "kit/d"], ["3", "4"])
    await store.queue_push("kit/q", "item")
    keys = await store.list_keys()
    assert all(type(k) is str for k in keys), f"list_keys must return str keys: {keys!r}"
    assert set(keys) - base == {"kit/a", "kit/b", "kit/c", "kit/d"}, f"list_keys gave {sorted(set(keys) - base)}"
    assert len(keys) == len(set(keys)), f"list_keys repeats keys: {keys!r}"
    await store.delete_key("kit/a")
    assert "kit/a" not in await store.list_keys(), "list_keys still lists a deleted key"


# -- append / multi ---------------------------------------------------------------------------


@_check
async def check_append(store: Store) -> None:
    await store.append("kit/first_key", "po")
    _eq(await store.get("kit/first_key"), b"po", "append must create a missing key")
    await store.append("kit/first_key", "tato")
    _eq(await store.get("kit/first_key"), b"potato", 'get("kit/first_key")')
    await store.append("kit/first_key", b"\x00!")
    _eq(await store.get("kit/first_key"), b"potato\x00!", 'get("kit/first_key")')
    await store.set("kit/s", "a")
    await store.append("kit/s", "")
    _eq(await store.get("kit/s"), b"a", 'get("kit/s")')


@_check
async def check_multi_set_multi_get(store: Store) -> None:
    await store.multi_set(["kit/first_key", "kit/second_key"], ["po", b"tato"])
    _eq(await store.get("kit/first_key"), b"po", 'get("kit/first_key")')
    _eq(await store.get("kit/second_key"), b"tato", 'get("kit/second_key")')
    _eq(await store.multi_get(["kit/first_key", "kit/second_key"]), [b"po", b"tato"], 'multi_get(["kit/first_key", "kit/second_key"])')
    _eq(
        await store.multi_get(["kit/second_key", "kit/first_key", "kit/second_key"]),
        [b"tato", b"po", b"tato"],
        'multi_get(["kit/second_key", "kit/first_key", "kit/second_key"])',
    )
    _eq(await store.multi_get([]), [], "multi_get([])")
    await store.multi_set([], [])
    await store.multi_set(["kit/first_key"], ["new"])
    _eq(await store.multi_get(["kit/first_key"]), [b"new"], "multi_set must overwrite")


@_check
async def check_multi_get_waits(store: Store) -> None:
    await store.set("kit/here", "1")
    async with _tasks() as start:
        getter = start(store.multi_get(["kit/here", "kit/later"]))
        await _still_waiting(getter, "multi_get with a key missing")
        await store.set("kit/later", "2")
        _eq(await asyncio.wait_for(getter, _timeout_s(store) + _SLACK_S), [b"1", b"2"], "the waiting call")


@_check
async def check_multi_get_timeout(store: Store) -> None:
    t = _timeout_s(store)
    await store.set("kit/here", "1")
    await _expect_timeout(store.multi_get(["kit/here", "kit/absent"]), "multi_get", "kit/absent", 0.8 * t, t + _SLACK_S + t)


# -- queues ----------------------------------------------------------------------------------


@_check
async def check_queue_fifo(store: Store) -> None:
    for v in ("a", b"b", "c"):
        await store.queue_push("kit/q", v)
    _eq([await store.queue_pop("kit/q") for _ in range(3)], [b"a", b"b", b"c"], "three pops after pushing a, b, c")
    await store.queue_push("kit/q", "d")
    await store.queue_push("kit/q", "e")
    _eq(await store.queue_pop("kit/q", block=False), b"d", 'queue_pop("kit/q", block=False)')
    await store.queue_push("kit/q", "f")
    _eq(await store.queue_pop("kit/q"), b"e", 'queue_pop("kit/q")')
    _eq(await store.queue_pop("kit/q"), b"f", 'queue_pop("kit/q")')


@_check
async def check_queue_len(store: Store) -> None:
    n = await store.queue_len("kit/none")
    assert type(n) is int and n == 0, f"queue_len of a missing queue is {n!r}, not 0"
    for i in range(3):
        await store.queue_push("kit/q", str(i))
        _eq(await store.queue_len("kit/q"), i + 1, 'queue_len("kit/q")')
    await store.queue_pop("kit/q")
    _eq(await store.queue_len("kit/q"), 2, 'queue_len("kit/q")')
    await store.queue_pop("kit/q")
    await store.queue_pop("kit/q")
    _eq(await store.queue_len("kit/q"), 0, 'queue_len("kit/q")')


@_check
async def check_queue_pop_nonblocking_empty(store: Store) -> None:
    for when in ("never pushed", "drained"):
        start = time.monotonic()
        try:
            v = await store.queue_pop("kit/q", block=False)
        except QueueEmptyError as exc:
            assert isinstance(exc, DistStoreError), "QueueEmptyError must be a DistStoreError"
        else:
            raise AssertionError(f"queue_pop(block=False) on a {when} queue returned {v!r} instead of raising QueueEmptyError")
        assert time.monotonic() - start < _timeout_s(store) / 2, "queue_pop(block=False) waited"
        await store.queue_push("kit/q", "x")
        _eq(await store.queue_pop("kit/q", block=False), b"x", 'queue_pop("kit/q", block=False)')


@_check
async def check_queue_pop_waits(store: Store) -> None:
    async with _tasks() as start:
        popper = start(store.queue_pop("kit/q"))
        await _still_waiting(popper, "blocking queue_pop on an empty queue")
        await store.queue_push("kit/q", "item")
        _eq(await asyncio.wait_for(popper, _timeout_s(store) + _SLACK_S), b"item", "the waiting queue_pop")
    _eq(await store.queue_len("kit/q"), 0, 'queue_len("kit/q")')


@_check
async def check_queue_pop_timeout(store: Store) -> None:
    t = _timeout_s(store)
    await _expect_timeout(store.queue_pop("kit/empty-q"), "blocking queue_pop", "kit/empty-q", 0.8 * t, t + _SLACK_S + t)


@_check
async def check_queue_two_poppers(store: Store) -> None:
    async with _tasks() as start:
        poppers = [start(store.queue_pop("kit/q")), start(store.queue_pop("kit/q"))]
        await asyncio.sleep(_MOMENT_S)
        await store.queue_push("kit/q", "one")
        done, pending = await asyncio.wait(poppers, timeout=_timeout_s(store) / 2, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, f"one push released {len(done)} poppers"
        await asyncio.sleep(_MOMENT_S)
        assert sum(p.done() for p in poppers) == 1, "one push released both poppers"
        await store.queue_push("kit/q", "two")
        got = await asyncio.wait_for(asyncio.gather(*poppers), _timeout_s(store) + _SLACK_S)
    assert sorted(got) == [b"one", b"two"], f"the poppers got {got!r}"
    _eq(await store.queue_len("kit/q"), 0, 'queue_len("kit/q")')


# -- barrier / timeout -----------------------------------------------------------------------


@_check
async def check_barrier(store: Store) -> None:
    await asyncio.wait_for(store.barrier("kit/solo", 1), _SLACK_S)
    n = 5
    async with _tasks() as start:
        early = [start(store.barrier("kit/b", n)) for _ in range(n - 1)]
        await asyncio.sleep(_MOMENT_S)
        assert not any(t.done() for t in early), f"barrier released with {n - 1} of {n} arrived"
        last = start(store.barrier("kit/b", n))
        await asyncio.wait_for(asyncio.gather(*early, last), _timeout_s(store) + _SLACK_S)


@_check
async def check_barrier_timeout(store: Store) -> None:
    t = _timeout_s(store)
    await _expect_timeout(store.barrier("kit/lonely", 2), "barrier (default timeout)", "kit/lonely", 0.8 * t, t + _SLACK_S + t)
    short = t / 4
    await _expect_timeout(
        store.barrier("kit/lonely2", 2, timedelta(seconds=short)), "barrier(timeout=short)", "kit/lonely2", 0.8 * short, 0.9 * t
    )


@_check
async def check_set_timeout(store: Store) -> None:
    t = _timeout_s(store)
    assert isinstance(store.timeout, timedelta), f"timeout is a {type(store.timeout).__name__}, not a timedelta"
    await store.set_timeout(timedelta(seconds=t / 4))
    assert store.timeout == timedelta(seconds=t / 4), f"after set_timeout({t / 4:g} s) timeout is {store.timeout!r}"
    await _expect_timeout(store.wait(["kit/bad_key"]), "wait after set_timeout", "kit/bad_key", 0.8 * t / 4, 0.9 * t)
    await store.set_timeout(t)  # seconds work too
    _eq(store.timeout, timedelta(seconds=t), f"timeout after set_timeout({t:g})")


# -- arguments, concurrency, clones, odd values ------------------------------------------------


@_check
async def check_bad_arguments(store: Store) -> None:
    base = await store.num_keys()
    bad: list[tuple[str, type[Exception], Callable[[], Awaitable[Any]]]] = [
        ("set(1, 'v')", TypeError, lambda: store.set(1, "v")),  # type: ignore[arg-type]
        ("set('k', 1)", TypeError, lambda: store.set("kit/k", 1)),  # type: ignore[arg-type]
        ("set('k', None)", TypeError, lambda: store.set("kit/k", None)),  # type: ignore[arg-type]
        ("get(b'k')", TypeError, lambda: store.get(b"kit/k")),  # type: ignore[arg-type]
        ("add('k', '1')", TypeError, lambda: store.add("kit/k", "1")),  # type: ignore[arg-type]
        ("add('k', 1.5)", TypeError, lambda: store.add("kit/k", 1.5)),  # type: ignore[arg-type]
        ("append('k', 1)", TypeError, lambda: store.append("kit/k", 1)),  # type: ignore[arg-type]
        ("compare_set('k', 1, 'v')", TypeError, lambda: store.compare_set("kit/k", 1, "v")),  # type: ignore[arg-type]
        ("wait('kit/k')", TypeError, lambda: store.wait("kit/k")),
        ("check('kit/k')", TypeError, lambda: store.check("kit/k")),
        ("multi_get('kit/k')", TypeError, lambda: store.multi_get("kit/k")),
        ("multi_get([1])", TypeError, lambda: store.multi_get([1])),  # type: ignore[list-item]
        ("multi_set('ab', ['1', '2'])", TypeError, lambda: store.multi_set("ab", ["1", "2"])),
        ("multi_set(['a', 'b'], ['1'])", ValueError, lambda: store.multi_set(["kit/a", "kit/b"], ["1"])),
        ("multi_set(['a'], [2])", TypeError, lambda: store.multi_set(["kit/a"], [2])),  # type: ignore[list-item]
        ("queue_push('q', 1)", TypeError, lambda: store.queue_push("kit/q", 1)),  # type: ignore[arg-type]
        ("queue_pop(1)", TypeError, lambda: store.queue_pop(1)),  # type: ignore[arg-type]
        ("delete_key(1)", TypeError, lambda: store.delete_key(1)),  # type: ignore[arg-type]
        ("barrier('b', 0)", ValueError, lambda: store.barrier("kit/b", 0)),
    ]
    for what, exc_type, call in bad:
        start = time.monotonic()
        try:
            await call()
        except exc_type:
            pass
        except Exception as exc:
            raise AssertionError(f"{what} raised {type(exc).__name__} ({exc}), not {exc_type.__name__}") from exc
        else:
            raise AssertionError(f"{what} did not raise {exc_type.__name__}")
        assert time.monotonic() - start < _timeout_s(store) / 2, f"{what} waited before refusing its arguments"
    _eq(await store.num_keys(), base, "a refused call stored something")
    _eq(await store.queue_len("kit/q"), 0, "a refused queue_push pushed something")


@_check
async def check_concurrent_add(store: Store) -> None:
    n = 100
    async with _tasks() as start:
        tasks = [start(store.add("kit/counter", 1)) for _ in range(n)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), 4 * _timeout_s(store) + _SLACK_S)
    assert sorted(results) == list(range(1, n + 1)), "concurrent adds lost or repeated an increment"
    _eq(await store.get("kit/counter"), str(n).encode(), 'get("kit/counter")')


@_check
async def check_clone_shares_data(store: Store) -> None:
    clone = await _clone(store)
    try:
        assert clone.timeout == store.timeout, f"clone timeout {clone.timeout} != {store.timeout}"
        await store.set("kit/from-original", "1")
        _eq(await clone.get("kit/from-original"), b"1", 'clone.get("kit/from-original")')
        await clone.set("kit/from-clone", "2")
        _eq(await store.get("kit/from-clone"), b"2", 'get("kit/from-clone")')
        _eq(await clone.add("kit/n", 1), 1, 'clone.add("kit/n", 1)')
        _eq(await store.add("kit/n", 1), 2, 'add("kit/n", 1)')
        # A wait on one handle is ended by a write through the other.
        async with _tasks() as start:
            getter = start(clone.get("kit/cross"))
            await _still_waiting(getter, "get on the clone of a key not yet set")
            await store.set("kit/cross", "3")
            _eq(await asyncio.wait_for(getter, _timeout_s(store) + _SLACK_S), b"3", "the waiting call")
        await clone.queue_push("kit/q", "item")
        _eq(await store.queue_pop("kit/q"), b"item", 'queue_pop("kit/q")')
    finally:
        await clone.close()
    _eq(await store.get("kit/from-clone"), b"2", "closing a clone broke the original")


@_check
async def check_has_extended_api(store: Store) -> None:
    _is(store.has_extended_api(), True, "has_extended_api()")


@_check
async def check_empty_value(store: Store) -> None:
    await store.set("kit/empty", b"")
    _eq(await store.get("kit/empty"), b"", 'get("kit/empty")')
    _is(await store.check(["kit/empty"]), True, "a key holding b'' must exist")
    await store.set("kit/empty-str", "")
    _eq(await store.multi_get(["kit/empty", "kit/empty-str"]), [b"", b""], 'multi_get(["kit/empty", "kit/empty-str"])')
    await store.append("kit/empty", "x")
    _eq(await store.get("kit/empty"), b"x", 'get("kit/empty")')
    await store.queue_push("kit/q", b"")
    _eq(await store.queue_len("kit/q"), 1, 'queue_len("kit/q")')
    _eq(await store.queue_pop("kit/q"), b"", 'queue_pop("kit/q")')


@_check
async def check_unicode_and_slash_keys(store: Store) -> None:
    keys = ["kit/ключ-🔑", "kit/a/b/c", "kit/ü/", "kit/with space"]
    for i, k in enumerate(keys):
        await store.set(k, str(i))
    _eq(await store.multi_get(keys), [str(i).encode() for i in range(len(keys))], "multi_get(keys)")
    _is(await store.check(keys), True, "check(keys)")
    assert set(keys) <= set(await store.list_keys()), f"list_keys lacks some of {keys}"
    _is(await store.check(["kit/a/b"]), False, "'kit/a/b' must not exist because 'kit/a/b/c' does")
    _eq(await store.add("kit/ключ-n", 5), 5, 'add("kit/ключ-n", 5)')


@_check
async def check_close_idempotent(store: Store) -> None:
    await store.close()
    await store.close()
