"""One handle contract, every kind of handle.

Every communicating call returns a handle (``aiodist._pending``): a ``Pending`` around the call's
coroutine, or, for a TCPStore's ``get``/``add`` while its main connection is up, the store's
``_Call`` (a future the connection resolves: the store layer's one fast path). This file runs the
same checks over each kind — the contract is the module docstring of ``aiodist._pending`` — and
checks that the store's fast path equals its general path, call for call (the values, the
errors, the never-awaited ERROR's wording).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodist._pending import Pending, communicating
from aiodist.errors import DistStoreError
from aiodist.store._connection import _Call
from aiodist.store.tcp import TCPStore

HOST = "127.0.0.1"


@communicating
async def _echo(value: Any, gate: asyncio.Future[None] | None = None) -> Any:
    if gate is not None:
        await gate
    return value


@pytest.fixture
async def store() -> AsyncIterator[TCPStore]:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    c = await TCPStore(HOST, m.port, timeout=5)
    try:
        yield c
    finally:
        await c.close()
        await m.close()


# each kind: (name, make(store, key) -> a handle that will give b"v" once the key is set)
Kind = Callable[[TCPStore, str], Any]
KINDS: dict[str, Kind] = {
    "pending": lambda s, k: s._get(k),  # the general path: the call's coroutine in a Pending
    "store-call": lambda s, k: s.get(k),  # the fast path: the connection resolves the future
}


@pytest.mark.parametrize("kind", KINDS)
async def test_every_handle_keeps_the_contract(store: TCPStore, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    make = KINDS[kind]
    h = make(store, "k")  # the key is missing: the call waits
    assert isinstance(h, Pending if kind == "pending" else _Call)
    assert not h.is_completed() and not h.is_success()
    with pytest.raises(RuntimeError, match=r"store\.get\(\.\.\.\)\.result\(\): the call has not produced"):
        h.result()
    with pytest.raises(RuntimeError, match=r"source_rank\(\) is only defined for receives"):
        await store.set("k", "v")
        await h
        h.source_rank()
    assert h.is_completed() and h.is_success() and h.result() == b"v" and h.exception() is None
    assert await h.wait() is True
    # where a coroutine goes, a handle goes
    assert await asyncio.create_task(make(store, "k")) == b"v"
    assert await asyncio.gather(make(store, "k"), make(store, "k")) == [b"v", b"v"]
    assert await asyncio.wait_for(make(store, "k"), 5) == b"v"
    assert await asyncio.shield(make(store, "k")) == b"v"
    with pytest.raises(AttributeError):
        _ = h.seq
    del h
    gc.collect()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []  # each of them counts as used


@pytest.mark.parametrize("kind", KINDS)
async def test_every_handle_says_never_awaited_in_one_wording(store: TCPStore, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    await store.set("k", "v")
    with caplog.at_level(logging.ERROR):
        KINDS[kind](store, "k")  # dropped at once
        gc.collect()
        await asyncio.sleep(0.05)  # what is left of the call finishes in a task
    words = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(words) == 1, words
    assert words[0].startswith("store.get(...) called at ") and "was never awaited: " in words[0]
    assert words[0].endswith("Write `await store.get(...)`."), words[0]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_handle_answers_the_same_after_its_call_failed(kind: str) -> None:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    c = await TCPStore(HOST, m.port, timeout=0.2)
    try:
        h = KINDS[kind](c, "never-set")
        with pytest.raises(DistStoreError) as raised:
            await h
        assert h.is_completed() and not h.is_success()
        assert h.exception() is raised.value
        with pytest.raises(DistStoreError) as again:
            h.result()
        assert again.value is raised.value
        with pytest.raises(DistStoreError) as awaited_again:  # awaited again: the same error, as a Future's
            await h
        assert awaited_again.value is raised.value
    finally:
        await c.close()
        await m.close()


async def test_a_pending_cancelled_before_it_ran_is_not_awaited_again_into_a_value() -> None:
    gate = asyncio.get_running_loop().create_future()
    h = _echo(1, gate)
    task = asyncio.ensure_future(h)
    task.cancel()  # before its first step: the cancellation goes into the call
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.is_completed() and not h.is_success()
    with pytest.raises(asyncio.CancelledError):
        await h
    with pytest.raises(asyncio.CancelledError):
        h.exception()  # as a cancelled Future's


async def test_a_pending_without_a_work_answers_from_its_value() -> None:
    gate = asyncio.get_running_loop().create_future()
    h = _echo(3, gate)
    assert not h.is_completed()
    with pytest.raises(RuntimeError, match="has not produced"):
        h.exception()
    gate.set_result(None)
    assert await h == 3
    assert h.is_completed() and h.is_success() and h.result() == 3 and h.exception() is None
    assert h.source_rank() == 3  # recv's value is the sender
    with pytest.raises(AttributeError, match=r"_echo\(\.\.\.\) returned a handle.*no 'op'"):
        _ = h.op


async def _apply(call: Callable[..., Awaitable[Any]], *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", await call(*args))
    except (DistStoreError, ValueError, TypeError) as exc:
        return (type(exc).__name__, str(exc))


async def _given(handle: Awaitable[Any]) -> Any:
    return await handle


ops = st.lists(
    st.tuples(st.sampled_from(["set", "get", "add"]), st.sampled_from(["a", "b", "c"]), st.integers(-(2**62), 2**62)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops)
async def test_the_store_fast_path_equals_the_general_path(store: TCPStore, program: list[tuple[str, str, int]]) -> None:
    """The same program of set/get/add through ``get``/``add`` (the fast path, ``_Call``) and
    through ``_get``/``_add`` (the general path, a ``Pending``), on two fresh key spaces: the same
    values and the same errors, step by step. A get of a key never set is left out (it waits)."""
    run = id(program)
    fast_keys, slow_keys = f"fast{run}/", f"slow{run}/"
    seen: set[str] = set()
    for op, key, n in program:
        if op == "set":
            a = await _apply(store.set, fast_keys + key, str(n))
            b = await _apply(store.set, slow_keys + key, str(n))
            seen.add(key)
        elif op == "get":
            if key not in seen:
                continue
            fast = store.get(fast_keys + key)
            assert isinstance(fast, _Call)
            a, b = await _apply(_given, fast), await _apply(store._get, slow_keys + key)
        else:
            fast_add = store.add(fast_keys + key, n)
            assert isinstance(fast_add, _Call)
            a, b = await _apply(_given, fast_add), await _apply(store._add, slow_keys + key, n)
            seen.add(key)
        assert a[0] == b[0], (op, key, a, b)
        assert a[1] == b[1] or (a[0] != "ok" and a[1].replace(fast_keys, slow_keys) == b[1]), (op, key, a, b)
    for key in seen:
        assert await store.get(fast_keys + key) == await store._get(slow_keys + key)
