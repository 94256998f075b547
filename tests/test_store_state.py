"""KVState, the data model under HashStore and the TCPStore server: values, counters, queues,
and who gets woken (everyone on a write, one waiter on a queue push), across threads too."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiodist.store.state import KVState


def _done(*waiters: Any) -> list[bool]:
    return [w.fut.done() for w in waiters]


# -- data ---------------------------------------------------------------------------------------


def test_set_get_append_delete() -> None:
    s = KVState()
    assert s.get(b"k") is None
    s.set(b"k", b"v")
    assert s.get(b"k") == b"v"
    s.append(b"k", b"w")
    s.append(b"new", b"x")
    assert (s.get(b"k"), s.get(b"new")) == (b"vw", b"x")
    assert s.delete(b"k") is True
    assert s.delete(b"k") is False
    assert s.list_keys() == [b"new"] and s.num_keys() == 1


def test_add_counts_in_ascii_and_refuses_text() -> None:
    s = KVState()
    assert s.add(b"n", 1) == 1
    assert s.add(b"n", 6) == 7
    assert s.get(b"n") == b"7"
    assert s.add(b"n", -10) == -3
    s.set(b"t", b"text")
    with pytest.raises(ValueError, match="not an integer"):
        s.add(b"t", 1)
    assert s.get(b"t") == b"text"


def test_compare_set_rules() -> None:
    s = KVState()
    assert s.compare_set(b"k", b"exp", b"des") == b"exp"  # missing, expected not empty: nothing stored
    assert s.get(b"k") is None
    assert s.compare_set(b"k", b"", b"des") == b"des"  # missing, expected empty: stored
    assert s.compare_set(b"k", b"des", b"new") == b"new"  # equal: replaced
    assert s.compare_set(b"k", b"other", b"x") == b"new"  # different: unchanged
    assert s.get(b"k") == b"new"


def test_multi_set_multi_get() -> None:
    s = KVState()
    s.multi_set([b"a", b"b"], [b"1", b"2"])
    assert s.multi_get([b"b", b"a"]) == [b"2", b"1"]


def test_queues_and_presence() -> None:
    s = KVState()
    assert s.queue_pop(b"q") == (0, None)
    assert s.check([b"q"]) is False
    s.queue_push(b"q", b"1")
    s.queue_push(b"q", b"2")
    assert s.queue_len(b"q") == 2
    assert s.check([b"q"]) is True and s.missing([b"q", b"x"]) == [b"x"]
    assert s.num_keys() == 0 and s.list_keys() == [], "queues are not keys"
    assert s.queue_pop(b"q") == (2, b"1")
    assert s.queue_pop(b"q") == (1, b"2")
    assert s.check([b"q"]) is False and s.queue_len(b"q") == 0
    s.queue_push(b"q", b"3")
    assert s.delete(b"q") is False and s.queue_len(b"q") == 1  # as torch: DELETE_KEY leaves queues alone


def test_statistics() -> None:
    s = KVState()
    s.set(b"a", b"123")
    s.queue_push(b"q", b"x")
    assert s.key_count() == (1, 1, 0)
    assert s.snapshot_sizes() == {b"a": 3}


# -- waking -------------------------------------------------------------------------------------


async def test_wait_returns_none_when_every_key_exists() -> None:
    s = KVState()
    s.set(b"a", b"")
    s.queue_push(b"q", b"x")
    assert s.wait([b"a", b"q"]) is None
    assert s.wait([]) is None


async def test_set_wakes_every_waiter_on_the_key() -> None:
    s = KVState()
    w1, w2 = s.wait([b"k"]), s.wait([b"k"])
    other = s.wait([b"other"])
    s.set(b"k", b"v")
    assert _done(w1, w2, other) == [True, True, False]
    assert s.key_count()[2] == 1
    s.cancel(other)
    assert s.key_count()[2] == 0


@pytest.mark.parametrize("write", ["set", "append", "add", "multi_set", "compare_set"])
async def test_every_write_wakes(write: str) -> None:
    s = KVState()
    w = s.wait([b"k"])
    {
        "set": lambda: s.set(b"k", b"1"),
        "append": lambda: s.append(b"k", b"1"),
        "add": lambda: s.add(b"k", 1),
        "multi_set": lambda: s.multi_set([b"x", b"k"], [b"1", b"1"]),
        "compare_set": lambda: s.compare_set(b"k", b"", b"1"),
    }[write]()
    assert w.fut.done()


async def test_compare_set_that_stores_nothing_wakes_nobody() -> None:
    s = KVState()
    w = s.wait([b"k"])
    s.compare_set(b"k", b"expected", b"desired")
    assert not w.fut.done()
    s.cancel(w)


async def test_waiter_on_several_keys_needs_them_all() -> None:
    s = KVState()
    w = s.wait([b"a", b"b", b"a"])
    s.set(b"a", b"1")
    assert not w.fut.done()
    s.queue_push(b"b", b"x")  # a non-empty queue counts
    assert w.fut.done()
    assert s.key_count()[2] == 0


async def test_queue_push_wakes_one_waiter_at_a_time() -> None:
    s = KVState()
    waiters = [s.wait([b"q"]) for _ in range(3)]
    s.queue_push(b"q", b"1")
    assert _done(*waiters) == [True, False, False], "the longest waiting goes first"
    s.queue_push(b"q", b"2")
    assert _done(*waiters) == [True, True, False]
    s.cancel(waiters[2])
    assert s.key_count()[2] == 0


async def test_cancel_passes_a_queue_wake_on() -> None:
    """A waiter picked by a push that gives up before popping hands the wake to the next."""
    s = KVState()
    first, second = s.wait([b"q"]), s.wait([b"q"])
    s.queue_push(b"q", b"item")
    assert _done(first, second) == [True, False]
    s.cancel(first)  # e.g. its task timed out or was cancelled before it popped
    assert second.fut.done()


async def test_cancel_with_an_empty_queue_wakes_nobody() -> None:
    s = KVState()
    first, second = s.wait([b"q"]), s.wait([b"q"])
    s.cancel(first)
    assert first.fut.cancelled()
    assert not second.fut.done()
    s.cancel(second)
    assert s.key_count()[2] == 0


async def test_a_waiter_whose_future_was_cancelled_is_skipped() -> None:
    s = KVState()
    gone, live = s.wait([b"q"]), s.wait([b"q"])
    gone.fut.cancel()  # its owner went away without calling cancel()
    s.queue_push(b"q", b"item")
    assert live.fut.done() and not live.fut.cancelled()
    assert s.key_count()[2] == 0


async def test_wait_until_predicate() -> None:
    s = KVState()

    def at_least_3(v: bytes | None) -> bool:
        return v is not None and int(v) >= 3

    w = s.wait_until(b"n", at_least_3)
    s.add(b"n", 1)
    s.add(b"n", 1)
    assert not w.fut.done()
    s.add(b"n", 1)
    assert w.fut.done()
    assert s.wait_until(b"n", at_least_3) is None, "already true: nothing to wait for"
    w2 = s.wait_until(b"gone", lambda v: v is None)
    assert w2 is None


async def test_awaiting_the_future_is_resumed() -> None:
    s = KVState()
    w = s.wait([b"k"])
    assert w is not None
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, s.set, b"k", b"v")
    await asyncio.wait_for(w.fut, 2)


# -- threads -------------------------------------------------------------------------------------


async def test_set_here_wakes_a_waiter_on_another_threads_loop() -> None:
    s = KVState()
    registered = threading.Event()
    out: dict[str, Any] = {}

    async def waiter() -> None:
        w = s.wait([b"k"])
        registered.set()
        assert w is not None
        await asyncio.wait_for(w.fut, 5)
        out["value"] = s.get(b"k")

    def main() -> None:
        try:
            asyncio.run(waiter())
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=main, daemon=True)
    t.start()
    assert await asyncio.to_thread(registered.wait, 5)
    s.set(b"k", b"v")  # from this thread's loop: must go through call_soon_threadsafe
    await asyncio.to_thread(t.join, 5)
    assert not t.is_alive()
    assert out == {"value": b"v"}


async def test_a_thread_without_a_loop_wakes_a_waiter_here() -> None:
    s = KVState()
    w = s.wait([b"k"])
    q = s.wait([b"q"])
    assert w is not None and q is not None
    await asyncio.to_thread(s.set, b"k", b"v")
    await asyncio.to_thread(s.queue_push, b"q", b"x")
    await asyncio.wait_for(asyncio.gather(w.fut, q.fut), 5)


async def test_queue_push_here_wakes_exactly_one_thread() -> None:
    s = KVState()
    n = 3
    registered = threading.Semaphore(0)
    got: list[bytes] = []
    lock = threading.Lock()

    async def popper() -> None:
        while True:
            _, v = s.queue_pop(b"q")
            if v is not None:
                with lock:
                    got.append(v)
                return
            w = s.wait([b"q"])
            registered.release()
            if w is not None:
                try:
                    await asyncio.wait_for(w.fut, 5)
                except BaseException:
                    s.cancel(w)
                    raise

    threads = [threading.Thread(target=asyncio.run, args=(popper(),), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert await asyncio.to_thread(registered.acquire, True, 5)
    for i in range(n):
        s.queue_push(b"q", str(i).encode())
    for t in threads:
        await asyncio.to_thread(t.join, 5)
        assert not t.is_alive()
    assert sorted(got) == [b"0", b"1", b"2"]
    assert s.queue_len(b"q") == 0


async def test_waking_a_waiter_of_a_closed_loop_is_harmless() -> None:
    s = KVState()

    async def register_and_leave() -> None:
        s.wait([b"k"])

    await asyncio.to_thread(asyncio.run, register_and_leave())  # that loop is closed now
    live = s.wait([b"k"])
    s.set(b"k", b"v")
    assert live is not None and live.fut.done()


@pytest.mark.parametrize(
    "old,delta,want",
    [
        (None, 5, 5),
        (b"7", -10, -3),
        (b"  +4", 1, 5),  # leading blanks and a sign, as C's stoll
        (b"12abc", 1, 13),  # torch's server ignores what follows the number
        (b"1_000", 1, 2),
        (str(2**63 - 1).encode(), 1, -(2**63)),  # wraps in 64 bits, as torch's int64_t
        (str(-(2**63)).encode(), -1, 2**63 - 1),
    ],
)
def test_counter_add_reads_values_as_torch_does(old: bytes | None, delta: int, want: int) -> None:
    from aiodist.store.state import counter_add

    assert counter_add(b"k", old, delta) == want


@pytest.mark.parametrize("old", [b"abc", b"", b"  ", b"99999999999999999999999"])
def test_counter_add_refuses_non_counters(old: bytes) -> None:
    from aiodist.store.state import counter_add

    with pytest.raises(ValueError):
        counter_add(b"k", old, 1)
