"""FileStore: the Store API over one shared, append-only file (aiodist/store/file.py)."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import random
import struct
import sys
import threading
import time
import types
from collections import Counter
from pathlib import Path

import pytest

import aiodist
from aiodist import DistStoreError, FileStore, HashStore, QueueEmptyError, StoreTimeoutError

SHORT = 0.2  # a short store timeout, seconds


def _path(tmp_path: Path, name: str = "store") -> str:
    return str(tmp_path / name)


class Ticker:
    """Ticks every ``interval`` seconds; records the longest gap between ticks (a blocked loop
    shows as a long gap)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.ticks = 0
        self.max_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.ticks += 1

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


# -- construction, export, description --------------------------------------------------------


def test_exported() -> None:
    assert aiodist.FileStore is FileStore
    assert aiodist.store.FileStore is FileStore
    assert "FileStore" in aiodist.__all__ and "FileStore" in aiodist.store.__all__


def test_construct_is_cheap_and_validates(tmp_path: Path) -> None:
    p = _path(tmp_path)
    s = FileStore(p, 2, timeout=3)
    assert not os.path.exists(p), "constructing must not touch the file"
    assert s.path == p and s.world_size == 2 and s.timeout.total_seconds() == 3
    assert s._describe() == f"FileStore({p!r})"
    assert FileStore(tmp_path / "x").path == str(tmp_path / "x")  # a PathLike works too
    with pytest.raises(TypeError):
        FileStore(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FileStore(p, "2")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FileStore(p, True)
    with pytest.raises(ValueError):
        FileStore(p, -2)
    with pytest.raises(ValueError):
        FileStore("")
    with pytest.raises(ValueError):
        FileStore(p, timeout=-1)


async def test_stats(tmp_path: Path) -> None:
    p = _path(tmp_path)
    s = FileStore(p, 3)
    st = s.stats()
    assert st["type"] == "FileStore" and st["path"] == p and st["keys"] == 0 and st["registered"] is False
    await s.multi_set(["a", "b"], ["1", "2"])
    st = s.stats()
    assert st["keys"] == 2 and st["registered"] is True and st["users"] == 1 and st["world_size"] == 3
    assert st["offset"] == os.path.getsize(p), "the cache has read the whole file"
    await s.close()


# -- every method ------------------------------------------------------------------------------


async def test_every_method(tmp_path: Path) -> None:
    s = FileStore(_path(tmp_path), timeout=SHORT)  # lazily registered by the first call
    await s.set("k", "v")
    assert await s.get("k") == b"v"
    await s.set("k", b"\x00\xffraw")
    assert await s.get("k") == b"\x00\xffraw"
    await s.set("k", "π")
    assert await s.get("k") == "π".encode()

    assert await s.add("n", 1) == 1
    assert await s.add("n", 6) == 7
    assert await s.add("n", -10) == -3
    assert await s.get("n") == b"-3"

    assert await s.compare_set("cs", "x", "y") == b"x"  # missing key, non-empty expected
    assert not await s.check(["cs"])
    assert await s.compare_set("cs", "", "y") == b"y"  # missing key, empty expected
    assert await s.compare_set("cs", "y", "z") == b"z"
    assert await s.compare_set("cs", "nope", "w") == b"z"
    assert await s.get("cs") == b"z"

    await s.append("ap", "po")
    await s.append("ap", b"tato")
    assert await s.get("ap") == b"potato"

    await s.multi_set(["m1", "m2"], ["1", b"2"])
    assert await s.multi_get(["m1", "m2", "k"]) == [b"1", b"2", "π".encode()]

    await s.wait(["k", "m1"])
    await s.wait([])
    assert await s.check(["k", "m1"]) is True
    assert await s.check(["k", "zz"]) is False

    keys = ["k", "n", "cs", "ap", "m1", "m2"]
    # torch's FileStore counts its user counter as a key: num_keys is one more (list_keys hides it)
    assert await s.num_keys() == len(keys) + 1, "the user count counts once, as in torch"
    assert sorted(await s.list_keys()) == sorted(keys)

    await s.queue_push("q", "a")
    await s.queue_push("q", b"b")
    assert await s.queue_len("q") == 2
    assert await s.check(["q"]) is True
    assert await s.num_keys() == len(keys) + 1, "queues are not keys"
    assert "q" not in await s.list_keys()
    assert await s.queue_pop("q") == b"a"
    assert await s.queue_pop("q", block=False) == b"b"
    assert await s.queue_len("q") == 0 and await s.queue_len("never") == 0
    assert await s.check(["q"]) is False
    with pytest.raises(QueueEmptyError):
        await s.queue_pop("q", block=False)

    # as HashStore: a key naming only a queue reads as b""; a blocking pop of a key holding a
    # value is refused at once (a wait would see the key present)
    await s.queue_push("qonly", "x")
    assert await s.get("qonly") == b""
    start = time.monotonic()
    with pytest.raises(QueueEmptyError, match="holds a value"):
        await s.queue_pop("k")
    assert time.monotonic() - start < SHORT / 2
    assert await s.queue_pop("qonly") == b"x"

    assert await s.delete_key("k") is True
    assert await s.delete_key("k") is False
    assert await s.check(["k"]) is False
    await s.queue_push("q2", "x")
    assert await s.delete_key("q2") is False, "delete_key leaves a queue alone (torch's server does)"
    assert await s.queue_len("q2") == 1
    await s.set("k", "again")
    assert await s.get("k") == b"again"

    await s.barrier("bar", 1)
    assert s.has_extended_api()
    await s.set_timeout(1.5)
    assert s.timeout.total_seconds() == 1.5
    with pytest.raises(TypeError):
        await s.set(1, "v")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await s.add("n", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await s.multi_set(["a", "b"], ["1"])
    await s.close()


async def test_add_non_integer(tmp_path: Path) -> None:
    s = FileStore(_path(tmp_path), timeout=SHORT)
    await s.set("t", "not a number")
    with pytest.raises(DistStoreError, match="not an integer"):
        await s.add("t", 1)
    assert await s.get("t") == b"not a number"
    assert await s.add("c", 2) == 2, "the store stays usable"
    await s.set("t", "40")
    assert await s.add("t", 2) == 42
    await s.close()


async def test_waits_wake_on_writes(tmp_path: Path) -> None:
    p = _path(tmp_path)
    a, b = FileStore(p, timeout=5), FileStore(p, timeout=5)
    getter = asyncio.create_task(a.get("later"))
    waiter = asyncio.create_task(a.wait(["w1", "w2"]))
    multi = asyncio.create_task(a.multi_get(["w1", "w2"]))
    popper = asyncio.create_task(a.queue_pop("q"))
    await asyncio.sleep(0.1)
    assert not any(t.done() for t in (getter, waiter, multi, popper))
    start = time.monotonic()
    await b.set("later", "v")
    await b.set("w1", "1")
    await asyncio.sleep(0.1)
    assert not waiter.done() and not multi.done(), "one of two keys is not enough"
    await b.add("w2", 5)
    await b.queue_push("q", "item")
    assert await asyncio.wait_for(getter, 1) == b"v"
    await asyncio.wait_for(waiter, 1)
    assert await asyncio.wait_for(multi, 1) == [b"1", b"5"]
    assert await asyncio.wait_for(popper, 1) == b"item"
    assert time.monotonic() - start < 1.0
    await a.close()
    await b.close()


# -- timeouts ----------------------------------------------------------------------------------


async def _times_out(aw: object, *names: str, not_named: tuple[str, ...] = ()) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        await aw  # type: ignore[misc]
    took = time.monotonic() - start
    assert 0.8 * SHORT <= took <= SHORT + 0.4, took
    assert isinstance(info.value, DistStoreError) and isinstance(info.value, TimeoutError)
    missing = str(info.value).split("not set:")[1]
    for n in names:
        assert repr(n) in missing, info.value
    for n in not_named:
        assert repr(n) not in missing, info.value


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_timeouts(tmp_path: Path) -> None:
    s = FileStore(_path(tmp_path), timeout=SHORT)
    await s.set("present", "1")
    await _times_out(s.get("missing"), "missing")
    await _times_out(s.wait(["present", "gone"]), "gone", not_named=("present",))
    await _times_out(s.multi_get(["present", "gone2"]), "gone2", not_named=("present",))
    await _times_out(s.queue_pop("empty-q"), "empty-q")
    await s.set_timeout(10)
    await _times_out(s.wait(["explicit"], SHORT), "explicit")  # an explicit timeout wins
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        await s.wait(["zero"], 0)
    assert time.monotonic() - start < 0.2
    await s.close()


async def test_event_loop_not_blocked(tmp_path: Path) -> None:
    p = _path(tmp_path)
    s, other = FileStore(p, timeout=0.5), FileStore(p)
    async with Ticker() as ticker:
        writers = asyncio.gather(*(other.add("busy", 1) for _ in range(100)))
        with pytest.raises(StoreTimeoutError):
            await s.wait(["never"])
        await writers
    assert ticker.ticks >= 30, ticker.ticks
    assert ticker.max_gap < 0.25, f"the loop was blocked for {ticker.max_gap:.3f} s"
    assert await s.get("busy") == b"100"
    await s.close()
    await other.close()


async def test_file_work_runs_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every blocking file call FileStore makes (open, flock, stat, read, write, truncate,
    unlink, close) runs in a worker thread, never in the event loop's thread."""
    import aiodist.store.file as file_mod

    loop_thread = threading.get_ident()
    calls: Counter[tuple[str, bool]] = Counter()

    def spy(module: types.ModuleType, names: set[str]) -> types.SimpleNamespace:
        ns = types.SimpleNamespace(**{n: getattr(module, n) for n in dir(module) if not n.startswith("__")})
        for name in names:
            real = getattr(module, name)

            def wrapped(*args: object, _real: object = real, _name: str = name, **kwargs: object) -> object:
                calls[_name, threading.get_ident() == loop_thread] += 1
                return _real(*args, **kwargs)  # type: ignore[operator]

            setattr(ns, name, wrapped)
        return ns

    monkeypatch.setattr(file_mod, "os", spy(os, {"open", "close", "stat", "fstat", "pread", "pwrite", "ftruncate", "unlink"}))
    monkeypatch.setattr(file_mod, "fcntl", spy(fcntl, {"flock"}))
    p = _path(tmp_path)
    a, b = FileStore(p, 2, timeout=SHORT), FileStore(p, 2, timeout=SHORT)
    await a.set("k", "v")
    await b.get("k")
    await a.add("n", 1)
    await a.compare_set("k", "v", "w")
    await a.append("k", "x")
    await a.multi_set(["m"], ["1"])
    await b.multi_get(["m", "k"])
    await b.check(["k"])
    await b.num_keys()
    await b.list_keys()
    await a.queue_push("q", "1")
    await b.queue_len("q")
    await b.queue_pop("q")
    await a.delete_key("m")
    with pytest.raises(StoreTimeoutError):
        await b.get("missing")
    with pytest.raises(StoreTimeoutError):
        await b.queue_pop("q")
    popper = asyncio.create_task(b.queue_pop("q2"))
    await asyncio.sleep(0.02)
    popper.cancel()
    await asyncio.gather(popper, return_exceptions=True)
    await a.close()
    await b.close()
    assert not os.path.exists(p)
    on_loop = sorted(name for (name, here), n in calls.items() if here)
    assert on_loop == [], f"blocking calls on the event loop's thread: {on_loop}"
    done = {name for name, _ in calls}
    assert {"open", "flock", "stat", "fstat", "pread", "pwrite", "unlink", "close"} <= done, done


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.3 s a run); a second loop waits them out again for the same result")
async def test_lock_held_by_another(tmp_path: Path) -> None:
    """Another holder of the flock stalls operations in their worker threads, not the loop;
    a cancelled operation gives up at once and does nothing; the lock wait is bounded."""
    p = _path(tmp_path)
    s = await FileStore(p, timeout=5)
    fd = os.open(p, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        async with Ticker() as ticker:
            setter = asyncio.create_task(s.set("k", "v"))
            await asyncio.sleep(0.2)
            assert not setter.done()
            cancelled = asyncio.create_task(s.set("cancelled", "v"))
            await asyncio.sleep(0.05)
            cancelled.cancel()
            start = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert time.monotonic() - start < 0.5, "a cancelled lock wait must end promptly"
            fcntl.flock(fd, fcntl.LOCK_UN)
            await asyncio.wait_for(setter, 1)
        assert ticker.max_gap < 0.25 and ticker.ticks > 20
        assert await s.get("k") == b"v"
        assert await s.check(["cancelled"]) is False, "the cancelled set wrote nothing"

        fcntl.flock(fd, fcntl.LOCK_EX)
        await s.set_timeout(SHORT)
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="lock"):
            await s.set("k2", "v")
        assert 0.9 <= time.monotonic() - start < 2.0  # at least 1 s of lock wait, even with a short timeout
    finally:
        os.close(fd)
    await s.close()


# -- several objects on one file -----------------------------------------------------------------


async def test_two_objects_one_file(tmp_path: Path) -> None:
    p = _path(tmp_path)
    a, b = FileStore(p), FileStore(p)
    await a.set("from-a", "1")
    assert await b.get("from-a") == b"1"
    await b.queue_push("q", "x")
    assert await a.queue_len("q") == 1
    assert await a.queue_pop("q") == b"x"
    assert await b.queue_len("q") == 0
    assert await b.delete_key("from-a") is True
    assert await a.check(["from-a"]) is False
    c = a.clone()
    assert isinstance(c, FileStore) and c is not a and c.path == p
    results = await asyncio.gather(*(st.add("n", 1) for st in (a, b, c) for _ in range(40)))
    assert sorted(results) == list(range(1, 121)), "concurrent adds lost or repeated an increment"
    assert await c.get("n") == b"120"
    for st in (a, b, c):
        await st.check([])  # catch up with the others' registrations
        assert st.stats()["users"] == 3
    for st in (a, b, c):
        await st.close()


async def test_differential_against_hashstore(tmp_path: Path) -> None:
    """A seeded random sequence of operations gives the same results on HashStore and on
    FileStore (alternating between two objects on the file, so each replays the other's
    records)."""
    p = _path(tmp_path)
    f1, f2 = FileStore(p, timeout=SHORT), FileStore(p, timeout=SHORT)
    h = HashStore(timeout=SHORT)
    rng = random.Random(1234)
    keys = ["a", "b", "c", "num", "text", "q1", "q2"]

    def op() -> tuple[str, tuple[object, ...]]:
        k = rng.choice(keys)
        v = rng.choice(["", "x", "12", "-3", "hello", "7"])
        name = rng.choice(
            [
                "set",
                "add",
                "compare_set",
                "append",
                "delete_key",
                "check",
                "num_keys",
                "list_keys",
                "multi_set",
                "queue_push",
                "queue_pop",
                "queue_len",
                "get",
                "wait",
            ]
        )
        if name in ("set", "append", "queue_push"):
            return name, (k, v)
        if name == "add":
            return name, (k, rng.randint(-5, 5))
        if name == "compare_set":
            return name, (k, rng.choice(["", v, "12"]), rng.choice(["1", "zz", ""]))
        if name in ("delete_key", "queue_len"):
            return name, (k,)
        if name == "wait":
            return "wait_present", (k,)
        if name == "check":
            return name, (rng.sample(keys, 2),)
        if name == "multi_set":
            ks = rng.sample(keys, 2)
            return name, (ks, [v, "9"])
        if name == "queue_pop":
            return "queue_pop_no_wait", (k,)
        if name == "get":
            return rng.choice(["get_present", "multi_get_present"]), (k,)
        return name, ()

    async def apply(store: object, name: str, args: tuple[object, ...]) -> object:
        # only calls that do not wait: a missing key would cost a timeout
        try:
            if name in ("get_present", "multi_get_present"):
                if not await store.check([args[0]]):  # type: ignore[attr-defined]
                    return "absent"
                name, args = ("get", args) if name == "get_present" else ("multi_get", ([args[0]],))
            elif name == "wait_present":
                if not await store.check([args[0]]):  # type: ignore[attr-defined]
                    return "absent"
                name, args = "wait", ([args[0]],)
            elif name == "queue_pop_no_wait":
                if await store.queue_len(args[0]) or await store.check([args[0]]):  # type: ignore[attr-defined]
                    name = "queue_pop"  # blocking, but something is there, or a value refuses it
                else:
                    name, args = "queue_pop", (args[0], False)
            out = await getattr(store, name)(*args)
            if name == "num_keys" and isinstance(store, FileStore):
                out -= 1  # torch's FileStore counts its user counter; HashStore has none
            return sorted(out) if name == "list_keys" else out
        except DistStoreError as exc:
            return type(exc).__name__

    for i in range(300):
        name, args = op()
        want = await apply(h, name, args)
        got = await apply(f1 if i % 2 else f2, name, args)
        assert got == want, f"step {i}: {name}{args}: FileStore {got!r} != HashStore {want!r}"
    await f1.close()
    await f2.close()


# -- queues and cancellation -------------------------------------------------------------------


async def test_cancelled_pop_loses_nothing(tmp_path: Path) -> None:
    p = _path(tmp_path)
    s = FileStore(p, timeout=5)
    popper = asyncio.create_task(s.queue_pop("q"))
    await asyncio.sleep(0.05)
    popper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await popper
    await s.queue_push("q", "x")
    assert await s.queue_len("q") == 1

    # Stress: pops cut short by tiny timeouts at every stage while items arrive from a second
    # object; whatever the timed-out pops took must be back in the queue, in order.
    pusher = FileStore(p)
    n = 150
    pushed = ["x"] + [f"i{i}" for i in range(n)]

    async def push_all() -> None:
        for item in pushed[1:]:
            await pusher.queue_push("q", item)

    got: list[str] = []

    async def pop_some() -> None:
        rng = random.Random(7)
        while len(got) < n // 2:
            try:
                got.append((await asyncio.wait_for(s.queue_pop("q"), rng.choice([0.0005, 0.001, 0.002, 0.005]))).decode())
            except TimeoutError:
                pass

    await asyncio.wait_for(asyncio.gather(push_all(), pop_some()), 15)
    while True:
        try:
            got.append((await s.queue_pop("q", block=False)).decode())
        except QueueEmptyError:
            break
    assert got == pushed, "items were lost, duplicated or reordered"
    await s.close()
    await pusher.close()


async def test_two_poppers_one_push_each(tmp_path: Path) -> None:
    p = _path(tmp_path)
    a, b, pusher = FileStore(p, timeout=5), FileStore(p, timeout=5), FileStore(p)
    pa, pb = asyncio.create_task(a.queue_pop("q")), asyncio.create_task(b.queue_pop("q"))
    await asyncio.sleep(0.05)
    await pusher.queue_push("q", "one")
    done, _ = await asyncio.wait([pa, pb], timeout=1, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.1)
    assert len(done) == 1 and sum(t.done() for t in (pa, pb)) == 1, "one push released both poppers"
    await pusher.queue_push("q", "two")
    assert sorted(await asyncio.wait_for(asyncio.gather(pa, pb), 1)) == [b"one", b"two"]
    for st in (a, b, pusher):
        await st.close()


# -- processes ---------------------------------------------------------------------------------

CHILD = Path(__file__).resolve().parent / "helpers" / "file_store_child.py"  # PATH RANK N_ADD N_ITEMS WORLD


@pytest.mark.one_loop(reason="the three ranks are child processes that run their own loops; this process only waits on them")
@pytest.mark.subprocess
async def test_three_processes(tmp_path: Path) -> None:
    p = _path(tmp_path)
    world, n_add, n_items = 3, 200, 60
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(CHILD),
            p,
            str(rank),
            str(n_add),
            str(n_items),
            str(world),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for rank in range(world)
    ]
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(proc.communicate() for proc in procs)), 45)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{err.decode()}"
        results.append(json.loads(out))
    all_adds = [n for r in results for n in r["adds"]]
    assert sorted(all_adds) == list(range(1, world * n_add + 1)), "adds across processes lost or repeated an increment"
    assert all(r["final"] == world * n_add for r in results)
    popped = Counter(item for r in results for item in r["popped"])
    pushed = Counter(f"{rank}-{i}" for rank in range(world) for i in range(n_items))
    assert popped == pushed, "an item was lost or popped twice"
    assert not os.path.exists(p), "the last of world_size closers removes the file"


# -- lifetime ----------------------------------------------------------------------------------


async def test_file_removed_after_last_close(tmp_path: Path) -> None:
    p = _path(tmp_path)
    a = FileStore(p, 3)
    assert not os.path.exists(p)
    await a.set("k", "v")
    assert os.path.exists(p)
    b = await FileStore(p, 3)  # awaiting registers
    async with FileStore(p, 3) as c:
        assert c.stats()["users"] == 3
        assert await c.get("k") == b"v"
    assert os.path.exists(p), "1 of 3 closed"
    await a.close()
    await a.close()  # idempotent: still 2 closed
    assert os.path.exists(p), "2 of 3 closed"
    with pytest.raises(DistStoreError, match="closed"):
        await a.get("k")
    with pytest.raises(DistStoreError, match="closed"):
        await a
    assert await b.get("k") == b"v"
    await b.close()
    assert not os.path.exists(p), "3 of 3 closed and no user left"
    await b.close()
    assert not os.path.exists(p), "a second close must not recreate the file"

    # The path can be used again: a fresh, empty store.
    d = FileStore(p, 1)
    assert await d.num_keys() == 1  # only the user count, as torch's
    await d.close()
    assert not os.path.exists(p)


async def test_not_removed_while_users_remain(tmp_path: Path) -> None:
    p = _path(tmp_path)
    first = FileStore(p, 1)
    second = FileStore(p, 1)
    await first.set("k", "v")
    await second.get("k")
    await first.close()  # 1 of 1 closed, but `second` still uses it
    assert os.path.exists(p)
    assert await second.get("k") == b"v"
    await second.close()
    assert not os.path.exists(p)


async def test_world_size_minus_one_keeps_file(tmp_path: Path) -> None:
    p = _path(tmp_path)
    for _ in range(3):
        async with FileStore(p) as s:
            await s.add("n", 1)
    assert os.path.exists(p)
    async with FileStore(p) as s:
        assert await s.get("n") == b"3"


async def test_unused_object_counts_as_closed(tmp_path: Path) -> None:
    """As with torch (whose constructor registers), every object closed counts towards
    ``world_size``, used or not; closing an unused one never creates the file."""
    p = _path(tmp_path)
    await FileStore(p, 2).close()
    assert not os.path.exists(p)
    a, b = FileStore(p, 2), FileStore(p, 2)
    await a.set("k", "v")
    await a.close()
    assert os.path.exists(p)
    await b.close()
    assert not os.path.exists(p)


async def test_file_replaced_under_a_store(tmp_path: Path) -> None:
    p = _path(tmp_path)
    a = FileStore(p)
    await a.set("old", "1")
    os.unlink(p)
    b = FileStore(p)
    await b.set("new", "2")
    assert await a.check(["old"]) is False, "a store must notice its file was replaced"
    assert await a.get("new") == b"2"
    assert a.stats()["users"] == 2, "the object registered in the new file"
    await a.close()
    await b.close()


# -- bad files ---------------------------------------------------------------------------------


async def test_garbage_file(tmp_path: Path) -> None:
    p = _path(tmp_path)
    junk = b"this is not a store file\n" * 4
    Path(p).write_bytes(junk)
    s = FileStore(p, timeout=SHORT)
    with pytest.raises(DistStoreError) as info:
        await s.set("k", "v")
    assert p in str(info.value) and "offset 0" in str(info.value)
    with pytest.raises(DistStoreError, match="offset 0"):
        await s.get("k")
    assert Path(p).read_bytes() == junk, "a garbage file must be left as it was"
    await s.close()  # never registered: no error
    assert s._fd is None, "the closed store let go of the file"

    Path(p).write_bytes(b"xy")
    with pytest.raises(DistStoreError, match="offset 0"):
        await FileStore(p).num_keys()


async def test_garbage_record(tmp_path: Path) -> None:
    p = _path(tmp_path)
    async with FileStore(p) as s:
        await s.set("k", "v")
        good = os.path.getsize(p)
        with open(p, "ab") as f:
            f.write(b"\xee" + b"\x00" * 40)
        with pytest.raises(DistStoreError) as info:
            await s.get("k2")
        assert p in str(info.value) and f"offset {good}" in str(info.value) and "record type" in str(info.value)
        with pytest.raises(DistStoreError, match=f"offset {good}"):
            await FileStore(p).check(["k"])
        # a record whose length is absurd is garbage too, not a record still being written
        os.truncate(p, good)
        with open(p, "ab") as f:
            f.write(struct.pack("<BQ", 1, 2**60) + b"k")
        with pytest.raises(DistStoreError, match=f"offset {good}"):
            await FileStore(p).check(["k"])
        os.truncate(p, good)


async def test_torn_record_is_ignored_then_cut(tmp_path: Path) -> None:
    """A record cut short (a writer died mid-write) is not read, and the next writer writes
    over it."""
    p = _path(tmp_path)
    a = FileStore(p)
    await a.set("k", "v")
    good = os.path.getsize(p)
    with open(p, "ab") as f:
        f.write(struct.pack("<BQ", 1, 5) + b"ab")
    b = FileStore(p, timeout=SHORT)
    assert await b.get("k") == b"v"
    await b.set("k2", "v2")
    assert await a.multi_get(["k", "k2"]) == [b"v", b"v2"]
    assert a.stats()["offset"] == os.path.getsize(p) > good
    await a.close()
    await b.close()


@pytest.mark.torch
async def test_torch_filestore_file_is_refused(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    p = _path(tmp_path)
    t = dist.FileStore(p, 1)
    t.set("key", "value")
    with pytest.raises(DistStoreError, match="offset 0"):
        await FileStore(p).get("key")
    del t


# -- the conformance kit -----------------------------------------------------------------------


@pytest.mark.one_loop(reason="(a store in this process; the kit's long run is the same on every loop, and the TCPStore kits run on both)")
async def test_store_conformance_kit(tmp_path: Path) -> None:
    testing = pytest.importorskip("aiodist.testing")
    names = itertools.count()

    async def make() -> FileStore:
        return FileStore(_path(tmp_path, f"kit{next(names)}"), 1)

    await testing.check_store(make)
    assert os.listdir(tmp_path) == [], "every kit store removed its file on close"
