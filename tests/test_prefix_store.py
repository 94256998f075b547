"""PrefixStore: the conformance kit over PrefixStore("p", HashStore()), where keys land in the
underlying store, what list_keys shows, nesting, and what is delegated (timeout, close)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from aiodist import HashStore, PrefixStore, Store, StoreTimeoutError
from aiodist.testing import check_store


async def make_prefix_store() -> PrefixStore:
    return PrefixStore("p", HashStore())


@pytest.mark.one_loop(reason="(a store in this process; the kit's long run is the same on every loop, and the TCPStore kits run on both)")
async def test_conformance_kit() -> None:
    await check_store(make_prefix_store)


@pytest.mark.one_loop(reason="(a store in this process; the kit's long run is the same on every loop, and the TCPStore kits run on both)")
async def test_conformance_kit_nested() -> None:
    async def make() -> Store:
        return PrefixStore("inner", PrefixStore("outer", HashStore()))

    await check_store(make)


async def test_keys_land_under_the_prefix() -> None:
    base = HashStore(timeout=1)
    store = PrefixStore("p", base)
    await store.set("k", "v")
    assert await base.get("p/k") == b"v"
    await store.add("n", 2)
    assert await base.get("p/n") == b"2"
    await store.append("s", "po")
    await base.append("p/s", "tato")
    assert await store.get("s") == b"potato"
    await store.multi_set(["a", "b"], ["1", "2"])
    assert await base.multi_get(["p/a", "p/b"]) == [b"1", b"2"]
    assert await store.compare_set("a", "1", "3") == b"3"
    assert await base.get("p/a") == b"3"
    await store.queue_push("q", "item")
    assert await base.queue_len("p/q") == 1
    assert await base.check(["p/q"]) is True
    assert await store.delete_key("k") is True
    assert await base.check(["p/k"]) is False
    await base.set("p/from-base", "x")
    assert await store.get("from-base") == b"x"
    assert await store.check(["from-base"]) is True
    await store.wait(["from-base"])
    assert await store.queue_pop("q") == b"item"
    assert sorted(await base.list_keys()) == ["p/a", "p/b", "p/from-base", "p/n", "p/s"]


async def test_barrier_keys_are_prefixed() -> None:
    base = HashStore(timeout=1)
    await PrefixStore("p", base).barrier("b", 1)
    keys = await base.list_keys()
    assert keys and all(k.startswith("p/b/") for k in keys), keys


async def test_timeout_error_names_the_full_key() -> None:
    store = PrefixStore("p", HashStore(timeout=0.05))
    with pytest.raises(StoreTimeoutError, match="p/missing"):
        await store.get("missing")


async def test_list_keys_strips_the_prefix_and_hides_other_keys() -> None:
    base = HashStore()
    p = PrefixStore("p", base)
    q = PrefixStore("q", base)
    await p.set("a", "1")
    await p.set("x/y", "2")
    await q.set("a", "3")
    await base.set("pq/x", "4")  # shares the letters, not the prefix: torch's PrefixStore shows it as "/x"
    await base.set("p", "5")
    await base.set("plain", "6")
    assert sorted(await p.list_keys()) == ["a", "x/y"]
    assert sorted(await q.list_keys()) == ["a"]
    assert await p.get("a") == b"1" and await q.get("a") == b"3"


async def test_num_keys_counts_the_underlying_store() -> None:
    base = HashStore()
    await base.set("elsewhere", "1")
    p = PrefixStore("p", base)
    await p.set("a", "1")
    assert await p.num_keys() == 2 == await base.num_keys()  # as torch's PrefixStore does


async def test_underlying_store_and_prefix() -> None:
    base = HashStore()
    p = PrefixStore("p", base)
    assert p.underlying_store is base
    assert p.prefix == "p"
    assert p.has_extended_api() is True
    assert p.stats() == {"type": "PrefixStore", "prefix": "p", "underlying": base.stats()}


async def test_nested_prefixes() -> None:
    base = HashStore()
    outer = PrefixStore("a", base)
    inner = PrefixStore("b", outer)
    assert inner.underlying_store is outer
    await inner.set("k", "v")
    assert await base.get("a/b/k") == b"v"
    assert await outer.get("b/k") == b"v"
    assert await inner.list_keys() == ["k"]
    assert await outer.list_keys() == ["b/k"]
    assert await base.list_keys() == ["a/b/k"]
    with pytest.raises(StoreTimeoutError, match="a/b/missing"):
        await base.set_timeout(0.05)
        await inner.get("missing")


async def test_timeout_is_the_underlying_stores() -> None:
    base = HashStore(timeout=7)
    p = PrefixStore("p", base)
    assert p.timeout == timedelta(seconds=7)
    await p.set_timeout(timedelta(seconds=3))
    assert base.timeout == timedelta(seconds=3) == p.timeout
    await base.set_timeout(4)
    assert p.timeout == timedelta(seconds=4)


async def test_clone_is_a_prefix_store_on_a_clone() -> None:
    base = HashStore()
    p = PrefixStore("p", base)
    c = p.clone()
    assert isinstance(c, PrefixStore) and c.prefix == "p"
    assert c.underlying_store is not base
    await c.set("k", "v")
    assert await base.get("p/k") == b"v"
    await c.close()


async def test_close_leaves_the_underlying_store_open() -> None:
    base = HashStore()
    async with PrefixStore("p", base) as p:
        await p.set("k", "v")
    await p.close()
    assert await base.get("p/k") == b"v"
    assert await p.get("k") == b"v"


async def test_constructor_checks_arguments() -> None:
    with pytest.raises(TypeError):
        PrefixStore(1, HashStore())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PrefixStore("p", object())  # type: ignore[arg-type]
