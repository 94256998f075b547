"""Interop with torch's own TCPStore (same wire protocol), both ways.

(a) torch clients against an aiodist server (a master ``TCPStore`` or a ``ServerThread``);
(b) aiodist clients against torch's server; plus byte-for-byte parity of the two servers on one
raw transcript.

torch calls block, so they run in a thread (``asyncio.to_thread``) while the test's loop stays
free. Exceptions: torch's ``list_keys`` and ``queue_len`` keep the GIL while they wait for the
reply (torch 2.13), which starves aiodist's server thread in this process for good (a deadlock no
timeout ends), so those two run in a process of their own (``tests/helpers/torch_store_client.py``).
Against torch's own server (native threads) they are fine in-process.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from aiodist.errors import DistStoreError, QueueEmptyError, StoreTimeoutError  # noqa: E402
from aiodist.store.server import ServerThread, TCPStoreServer  # noqa: E402
from aiodist.store.tcp import TCPStore  # noqa: E402
from aiodist.testing import until  # noqa: E402

pytestmark = pytest.mark.torch

HOST = "127.0.0.1"
SLACK_S = 1.5
T = TypeVar("T")


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


async def in_thread(fn: Callable[[], T], deadline_s: float = 20.0) -> T:
    return await asyncio.wait_for(asyncio.to_thread(fn), deadline_s)


def torch_client(port: int, timeout_s: float = 30.0, **kw: Any) -> Any:
    return dist.TCPStore(HOST, port, is_master=False, timeout=td(timeout_s), **kw)


def bound_socket() -> tuple[int, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    return s.detach(), port


@pytest.fixture
async def master() -> AsyncIterator[TCPStore]:
    m = await TCPStore(HOST, 0, is_master=True, timeout=5)
    try:
        yield m
    finally:
        await m.close()


def waiters(m: TCPStore) -> int:
    assert m.server is not None
    return int(m.server.stats()["waiters"])


# == (a) torch clients, aiodist server ============================================================


async def test_torch_client_all_methods_against_aiodist_master(master: TCPStore) -> None:
    await master.set("from_aiodist", b"\x00bin\xff")
    await master.queue_push("aq", "1")

    def torch_side() -> dict[str, Any]:
        s = torch_client(master.port)
        out: dict[str, Any] = {}
        out["get_aiodist"] = s.get("from_aiodist")
        s.set("a", "1")
        out["get"] = s.get("a")
        out["add"] = [s.add("n", 5), s.add("n", -2), s.add("n", 0)]
        out["cas"] = [
            s.compare_set("a", "1", "2"),  # present, matching
            s.compare_set("a", "x", "3"),  # present, not matching
            s.compare_set("fresh", "", "new"),  # missing, empty expected
            s.compare_set("ghost", "exp", "des"),  # missing, non-empty expected
        ]
        out["check"] = [s.check(["a", "n"]), s.check(["a", "ghost"]), s.check(["aq"])]
        s.append("ap", "po")
        s.append("ap", "tato")
        out["append"] = s.get("ap")
        s.multi_set(["m1", "m2"], ["v1", b"v2"])
        out["multi_get"] = s.multi_get(["m1", "m2", "a"])
        s.queue_push("q", "x")
        s.queue_push("q", "y")
        out["queue"] = [s.queue_pop("q"), s.queue_pop("q")]  # queue_len: see test_torch_list_keys_and_queue_len_...
        out["queue_aiodist"] = s.queue_pop("aq")
        try:
            s.queue_pop("q", block=False)
            out["pop_empty"] = "returned"
        except dist.QueueEmptyError:
            out["pop_empty"] = "QueueEmptyError"
        out["delete"] = [s.delete_key("m1"), s.delete_key("m1")]
        out["num_keys"] = s.num_keys()
        s.wait(["a", "n"])  # present: returns at once
        s.wait(["a"], td(1))
        return out

    out = await in_thread(torch_side)
    assert out == {
        "get_aiodist": b"\x00bin\xff",
        "get": b"1",
        "add": [5, 3, 3],
        "cas": [b"2", b"2", b"new", b"exp"],
        "check": [True, False, True],
        "append": b"potato",
        "multi_get": [b"v1", b"v2", b"2"],
        "queue": [b"x", b"y"],
        "queue_aiodist": b"1",
        "pop_empty": "QueueEmptyError",
        "delete": [True, False],
        "num_keys": 6,  # from_aiodist a n fresh ap m2 (m1 deleted, ghost never stored, queues not counted)
    }
    # the aiodist side sees torch's writes
    assert await master.get("a") == b"2"
    assert await master.get("n") == b"3"
    assert await master.get("ap") == b"potato"
    assert not await master.check(["ghost", "m1"])
    expected_keys = {"from_aiodist", "a", "n", "fresh", "ap", "m2"}
    assert set(await master.list_keys()) == expected_keys
    assert out["num_keys"] == await master.num_keys() == len(expected_keys)


async def test_torch_wait_timeout_then_client_still_works(master: TCPStore) -> None:
    """torch's client sends CANCEL_WAIT after its own timeout and expects WAIT_CANCELED."""

    def torch_side() -> tuple[str, float, bytes, bytes]:
        s = torch_client(master.port)
        t = time.monotonic()
        try:
            s.wait(["never"], td(0.3))
            err = "returned"
        except dist.DistStoreError as exc:
            err = str(exc)
        waited = time.monotonic() - t
        s.set("after", "x")  # the connection is in step again after CANCEL_WAIT
        got = s.get("after")
        s.set("never", "late")  # a STOP_WAITING for the cancelled wait must not confuse it
        return err, waited, got, s.get("never")

    err, waited, got, late = await in_thread(torch_side)
    assert "never" in err and "timeout" in err.lower()
    assert 0.25 <= waited < 0.3 + SLACK_S
    assert got == b"x" and late == b"late"
    await until(lambda: waiters(master) == 0, "the cancelled waits to be dropped")


async def test_torch_blocking_get_woken_by_aiodist_set(master: TCPStore) -> None:
    getter = asyncio.ensure_future(in_thread(lambda: torch_client(master.port, 10).get("later")))
    await until(lambda: waiters(master) == 1, "torch's get to WAIT")
    assert not getter.done()
    await master.set("later", "L")
    assert await asyncio.wait_for(getter, 20) == b"L"


async def test_torch_blocking_wait_on_several_keys(master: TCPStore) -> None:
    waiter = asyncio.ensure_future(in_thread(lambda: torch_client(master.port, 10).wait(["k1", "k2"])))
    await until(lambda: waiters(master) == 1, "torch's wait to WAIT")
    await master.set("k1", "1")
    await master.add("k2", 1)
    assert await asyncio.wait_for(waiter, 20) is None


async def test_torch_blocking_queue_pop_woken_by_aiodist_push(master: TCPStore) -> None:
    popper = asyncio.ensure_future(in_thread(lambda: torch_client(master.port, 10).queue_pop("jobs")))
    await until(lambda: waiters(master) == 1, "torch's queue_pop to WAIT")
    await master.queue_push("jobs", "job-1")
    assert await asyncio.wait_for(popper, 20) == b"job-1"
    assert await master.queue_len("jobs") == 0


async def test_torch_get_timeout_against_aiodist(master: TCPStore) -> None:
    def torch_side() -> tuple[type, float]:
        s = torch_client(master.port, 0.3)
        t = time.monotonic()
        try:
            s.get("absent")
        except Exception as exc:
            return type(exc), time.monotonic() - t
        return type(None), 0.0

    kind, waited = await in_thread(torch_side)
    assert issubclass(kind, dist.DistStoreError)
    assert 0.25 <= waited < 0.3 + SLACK_S


@pytest.mark.one_loop(
    reason="its time is a child process importing torch; the aiodist master's side runs on both loops in the other tests here"
)
async def test_torch_list_keys_and_queue_len_against_aiodist_master(master: TCPStore) -> None:
    await master.set("x", "1")
    await master.queue_push("q", "not a key")
    await master.queue_push("q", "nor this")
    helper = str(Path(__file__).parent / "helpers" / "torch_store_client.py")
    p = await asyncio.create_subprocess_exec(
        sys.executable, helper, str(master.port), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(p.communicate(), 40)
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
    assert p.returncode == 0, err.decode(errors="replace")
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got == {"list_keys": ["from_torch", "x"], "num_keys": 2, "queue_len": {"q": 2, "tq": 1, "none": 0}}
    assert sorted(await master.list_keys()) == ["from_torch", "x"]
    assert await master.queue_pop("tq") == b"t"


async def test_world_size_join_aiodist_master_torch_client() -> None:
    fd, port = bound_socket()
    m_task = asyncio.ensure_future(TCPStore(HOST, port, world_size=2, is_master=True, timeout=10, master_listen_fd=fd))
    try:
        tc = await in_thread(lambda: torch_client(port, 10, world_size=2))
        m = await asyncio.wait_for(m_task, 10)  # the torch client's ADD init/ 1 completed the join
        try:
            assert m.server is not None and m.server.state.get(b"init/") == b"2"
            await in_thread(lambda: tc.set("t", "1"))
            assert await m.get("t") == b"1"
            assert await m.num_keys() == 2 and await m.list_keys() == ["t"]
        finally:
            await m.close()
    finally:
        m_task.cancel()
        await asyncio.gather(m_task, return_exceptions=True)


async def test_world_size_join_torch_master_aiodist_client() -> None:
    fd, port = bound_socket()
    t_task = asyncio.ensure_future(
        in_thread(lambda: dist.TCPStore(HOST, port, world_size=2, is_master=True, timeout=td(10), master_listen_fd=fd))
    )
    c = await TCPStore(HOST, port, world_size=2, timeout=10)
    try:
        ts = await asyncio.wait_for(t_task, 10)  # torch's master returns once we joined
        await c.set("x", "1")
        assert ts.get("x") == b"1"
        assert await c.num_keys() == ts.num_keys() == 2  # init/ counted by both ...
        assert await c.list_keys() == ts.list_keys() == ["x"]  # ... listed by neither
        del ts
    finally:
        await c.close()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_torch_master_times_out_when_aiodist_client_missing() -> None:
    """The message format aiodist copies: 'k/N clients joined'."""
    fd, port = bound_socket()
    c_done = asyncio.ensure_future(TCPStore(HOST, port, world_size=3, timeout=5))

    def torch_master() -> str:
        try:
            dist.TCPStore(HOST, port, world_size=3, is_master=True, timeout=td(0.5), master_listen_fd=fd)
        except dist.DistStoreError as exc:
            return str(exc)
        return "returned"

    msg = await in_thread(torch_master)
    c = await asyncio.wait_for(c_done, 20)
    await c.close()
    assert "2/3 clients joined" in msg


# == (b) aiodist clients, torch server ============================================================


@pytest.fixture
def torch_server() -> Iterator[Any]:
    ts = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=td(10))
    yield ts
    del ts


@pytest.fixture
async def client(torch_server: Any) -> AsyncIterator[TCPStore]:
    c = await TCPStore(HOST, torch_server.port, timeout=5)
    try:
        yield c
    finally:
        await c.close()


async def test_aiodist_client_all_methods_against_torch_server(torch_server: Any, client: TCPStore) -> None:
    ts, c = torch_server, client
    await c.set("a", "1")
    assert await c.get("a") == b"1"
    assert ts.get("a") == b"1"
    assert [await c.add("n", 3), await c.add("n", 4), await c.add("n", -7)] == [3, 7, 0]
    assert await c.compare_set("a", "1", "2") == b"2"
    assert await c.compare_set("a", "x", "3") == b"2"
    assert await c.compare_set("fresh", "", "new") == b"new"
    assert await c.compare_set("ghost", "exp", "des") == b"exp"
    assert await c.check(["a", "n"]) and not await c.check(["a", "ghost"])
    assert await c.check([])
    await c.append("ap", "po")
    await c.append("ap", "tato")
    assert await c.get("ap") == b"potato"
    await c.multi_set(["x", "y"], ["1", b"\x00\xff"])
    assert await c.multi_get(["x", "y", "a"]) == [b"1", b"\x00\xff", b"2"]
    assert await c.multi_get([]) == []
    await c.queue_push("q", "a")
    await c.queue_push("q", "b")
    assert await c.queue_len("q") == 2
    assert await c.check(["q"])  # a non-empty queue counts, on torch's server too
    assert await c.queue_pop("q") == b"a"
    assert await c.queue_pop("q", block=False) == b"b"
    with pytest.raises(QueueEmptyError):
        await c.queue_pop("q", block=False)
    assert await c.queue_len("q") == 0
    assert await c.delete_key("x") is True
    assert await c.delete_key("x") is False
    await c.wait(["a", "n"])
    await c.wait(["a"], 1)
    assert await c.ping() < 1
    keys = {"a", "n", "fresh", "ap", "y"}
    assert set(await c.list_keys()) == keys == set(ts.list_keys())
    assert await c.num_keys() == ts.num_keys() == len(keys)


async def test_aiodist_blocking_get_woken_by_torch_set(torch_server: Any, client: TCPStore) -> None:
    getter = asyncio.create_task(client.get("later"))
    await until(lambda: client.stats()["waits"] == 1, "the get to start its WAIT")
    await asyncio.wait_for(client.set("other", "1"), 2)  # the same store is not blocked
    assert not getter.done()
    await in_thread(lambda: torch_server.set("later", "L"))
    assert await asyncio.wait_for(getter, 20) == b"L"


async def test_aiodist_blocking_queue_pop_woken_by_torch_push(torch_server: Any, client: TCPStore) -> None:
    popper = asyncio.create_task(client.queue_pop("jobs"))
    await until(lambda: client.stats()["waits"] == 1, "the pop to start its WAIT")
    assert not popper.done()
    await in_thread(lambda: torch_server.queue_push("jobs", "j1"))
    assert await asyncio.wait_for(popper, 20) == b"j1"


async def test_aiodist_multi_get_waits_for_torch_writes(torch_server: Any, client: TCPStore) -> None:
    mg = asyncio.create_task(client.multi_get(["p", "q"]))
    await until(lambda: client.stats()["waits"] == 1, "multi_get to WAIT")
    await in_thread(lambda: torch_server.set("p", "1"))
    await in_thread(lambda: torch_server.set("q", "2"))
    assert await asyncio.wait_for(mg, 20) == [b"1", b"2"]


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.1 s a run); a second loop waits them out again for the same result")
async def test_aiodist_timeouts_against_torch_server(torch_server: Any) -> None:
    c = await TCPStore(HOST, torch_server.port, timeout=10)  # connect with room to spare on a busy box
    await c.set_timeout(0.3)
    try:
        for call, key in ((lambda: c.get("g"), "g"), (lambda: c.queue_pop("qq"), "qq"), (lambda: c.multi_get(["m"]), "m")):
            t = time.monotonic()
            with pytest.raises(StoreTimeoutError, match=repr(key)):
                await call()
            assert 0.25 <= time.monotonic() - t < 0.3 + SLACK_S
        t = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="'w2'"):
            await c.wait(["w1", "w2"], 0.2) if await c.add("w1", 1) else None
        assert time.monotonic() - t < 0.2 + SLACK_S
        # after all those timeouts the store works, and a fresh wait succeeds
        getter = asyncio.create_task(c.get("g"))
        await in_thread(lambda: torch_server.set("g", "ok"))
        assert await asyncio.wait_for(getter, 2) == b"ok"
    finally:
        await c.close()


async def test_aiodist_add_on_non_integer_against_torch_server(torch_server: Any, client: TCPStore) -> None:
    await client.set("txt", "abc")
    with pytest.raises(DistStoreError):
        await client.add("txt", 1)  # torch's server closes the connection
    assert await client.get("txt") == b"abc"  # and the client reconnects
    assert await client.add("n", 1) == 1


async def test_aiodist_concurrent_pipelined_requests_against_torch_server(torch_server: Any, client: TCPStore) -> None:
    """Many tasks share one connection (pipelined requests): torch's server answers in order."""
    results = await asyncio.gather(*(client.add("c", 1) for _ in range(300)))
    assert sorted(results) == list(range(1, 301))
    await asyncio.gather(*(client.set(f"k{i}", str(i)) for i in range(100)))
    assert await asyncio.gather(*(client.get(f"k{i}") for i in range(100))) == [str(i).encode() for i in range(100)]
    assert ts_get(torch_server, "c") == b"300"


def ts_get(ts: Any, key: str) -> bytes:
    return ts.get(key)  # type: ignore[no-any-return]


async def test_list_and_num_keys_semantics_match_torch(torch_server: Any) -> None:
    """A torch master with world_size=1 holds init/: counted by num_keys, not listed."""
    fd, port = bound_socket()
    ts = await in_thread(lambda: dist.TCPStore(HOST, port, world_size=1, is_master=True, timeout=td(5), master_listen_fd=fd))
    async with TCPStore(HOST, port, timeout=5) as c:
        await c.set("a", "1")
        await c.queue_push("q", "x")  # queues are neither counted nor listed
        await in_thread(functools.partial(ts.set, "b", "2"))
        assert sorted(await c.list_keys()) == sorted(await in_thread(ts.list_keys)) == ["a", "b"]
        assert await c.num_keys() == await in_thread(ts.num_keys) == 3
    del ts


async def test_torch_client_and_aiodist_client_see_each_other(torch_server: Any, client: TCPStore) -> None:
    def torch_side() -> list[Any]:
        s = torch_client(torch_server.port)
        got = [s.get("from_aiodist")]
        s.set("from_torch", "t")
        got.append(s.add("shared", 10))
        got.append(s.get("late_from_aiodist"))  # blocks until the aiodist side sets it
        return got

    await client.set("from_aiodist", "a")
    th = asyncio.ensure_future(in_thread(torch_side))
    assert await asyncio.wait_for(client.get("from_torch"), 5) == b"t"
    await client.set("late_from_aiodist", "z")
    got = await asyncio.wait_for(th, 20)
    assert got[0] == b"a" and got[2] == b"z"
    assert await client.add("shared", 1) == 11


@pytest.mark.one_loop(
    reason="mostly waits out the kit's deadlines (~8.4 s a run); the client's kit runs on both loops against aiodist's servers (test_tcp_store.py)"
)
async def test_conformance_kit_on_client_of_torch_server() -> None:
    from aiodist.testing import check_store

    servers: list[Any] = []

    async def make() -> TCPStore:
        ts = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=td(5))  # fresh per check
        servers.append(ts)
        return await TCPStore(HOST, ts.port, timeout=5)

    try:
        await check_store(make, timeout=1.0)  # torch's server shares this process's CPU: more headroom
    finally:
        servers.clear()


# == byte parity of the two servers ==============================================================


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _keys(*ks: bytes) -> bytes:
    return struct.pack("<Q", len(ks)) + b"".join(_s(k) for k in ks)


HELLO = b"\x00" + struct.pack("<I", 0x3C85F7CE)

# (request, reply length) in order, on one connection
TRANSCRIPT: list[tuple[bytes, int]] = [
    (b"\x0d" + struct.pack("<I", 0xABCDEF01), 4),  # PING
    (b"\x01" + _s(b"/k") + _s(b"v\x00"), 0),  # SET
    (b"\x03" + _s(b"/k"), 10),  # GET
    (b"\x04" + _s(b"/n") + struct.pack("<q", 5), 8),  # ADD
    (b"\x04" + _s(b"/n") + struct.pack("<q", -9), 8),  # ADD
    (b"\x03" + _s(b"/n"), 10),  # GET: ASCII "-4"
    (b"\x02" + _s(b"/c") + _s(b"") + _s(b"new"), 11),  # COMPARE_SET missing, empty expected
    (b"\x02" + _s(b"/d") + _s(b"exp") + _s(b"des"), 11),  # COMPARE_SET missing, expected given
    (b"\x02" + _s(b"/c") + _s(b"new") + _s(b"nu"), 10),  # COMPARE_SET match
    (b"\x02" + _s(b"/c") + _s(b"zzz") + _s(b"no"), 10),  # COMPARE_SET mismatch
    (b"\x05" + _keys(b"/k", b"/n"), 1),  # CHECK ready
    (b"\x05" + _keys(b"/k", b"/zz"), 1),  # CHECK not ready
    (b"\x06" + _keys(b"/k"), 1),  # WAIT on present keys: at once
    (b"\x07", 8),  # GETNUMKEYS
    (b"\x09" + _s(b"/ap") + _s(b"po"), 0),  # APPEND creates
    (b"\x09" + _s(b"/ap") + _s(b"tato"), 0),  # APPEND
    (b"\x03" + _s(b"/ap"), 14),
    (b"\x0b" + struct.pack("<Q", 2) + _s(b"/x") + _s(b"1") + _s(b"/y") + _s(b"22"), 0),  # MULTI_SET
    (b"\x0a" + _keys(b"/x", b"/y"), 9 + 10),  # MULTI_GET
    (b"\x08" + _s(b"/x"), 8),  # DELETE_KEY present
    (b"\x08" + _s(b"/x"), 8),  # DELETE_KEY absent
    (b"\x0f" + _s(b"/q"), 8),  # QUEUE_POP empty
    (b"\x0e" + _s(b"/q") + _s(b"a"), 0),  # QUEUE_PUSH
    (b"\x0e" + _s(b"/q") + _s(b"bc"), 0),
    (b"\x10" + _s(b"/q"), 8),  # QUEUE_LEN
    (b"\x05" + _keys(b"/q"), 1),  # CHECK counts a non-empty queue
    (b"\x07", 8),  # GETNUMKEYS: queues not counted
    (b"\x0f" + _s(b"/q"), 8 + 9),  # QUEUE_POP
    (b"\x0f" + _s(b"/q"), 8 + 10),
    (b"\x10" + _s(b"/q"), 8),
    (b"\x0c", 1),  # CANCEL_WAIT with nothing pending
    (b"\x04" + _s(b"/big") + struct.pack("<q", 2**63 - 2), 8),  # ADD near the top of i64
    (b"\x04" + _s(b"/big") + struct.pack("<q", 1), 8),  # ADD to exactly 2**63 - 1
    (b"\x0d" + struct.pack("<I", 7), 4),
]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def run_transcript(port: int) -> dict[str, Any]:
    """The transcript's replies, then LIST (decoded, sorted: the order is the server's), then a
    WAIT on a missing key pipelined with a GET, woken from a second connection."""
    with socket.create_connection((HOST, port), timeout=5) as a, socket.create_connection((HOST, port), timeout=5) as b:
        a.sendall(HELLO)
        b.sendall(HELLO)
        replies = []
        for req, n in TRANSCRIPT:
            a.sendall(req)
            replies.append(_recv_exactly(a, n) if n else b"")
        a.sendall(b"\x11")  # LIST
        (count,) = struct.unpack("<q", _recv_exactly(a, 8))
        listed = []
        for _ in range(count):
            (ln,) = struct.unpack("<Q", _recv_exactly(a, 8))
            listed.append(_recv_exactly(a, ln))
        a.sendall(b"\x06" + _keys(b"/w") + b"\x03" + _s(b"/k"))  # WAIT (missing) + GET
        pipelined = _recv_exactly(a, 10)  # the GET is answered while the WAIT is pending
        b.sendall(b"\x01" + _s(b"/w") + _s(b"1") + b"\x0d" + struct.pack("<I", 3))
        _recv_exactly(b, 4)
        stop = _recv_exactly(a, 1)
        return {"replies": replies, "list": sorted(listed), "pipelined": pipelined, "stop": stop}


async def test_byte_parity_with_torch_server(torch_server: Any) -> None:
    st = await ServerThread(TCPStoreServer(HOST, 0)).astart()
    try:
        ours = await in_thread(lambda: run_transcript(st.server.port))
    finally:
        await st.astop()
    theirs = await in_thread(lambda: run_transcript(torch_server.port))
    for i, ((req, _), a, b) in enumerate(zip(TRANSCRIPT, ours["replies"], theirs["replies"])):
        assert a == b, f"reply {i} to opcode {req[0]}: aiodist {a!r} != torch {b!r}"
    assert ours == theirs
    assert ours["pipelined"] == _s(b"v\x00") and ours["stop"] == b"\x00"
    assert ours["list"] == [b"/ap", b"/big", b"/c", b"/k", b"/n", b"/y"]


def _add_twice(port: int, first: int, second: int) -> bytes:
    """ADD ``first`` then ``second`` to one key on a fresh connection, then PING: every byte back
    (b"" if the server closed the connection without a reply)."""
    with socket.create_connection((HOST, port), timeout=5) as a:
        key = b"/ovf%d" % (first & 0xFFFF)
        a.sendall(
            HELLO
            + b"\x04"
            + _s(key)
            + struct.pack("<q", first)
            + b"\x04"
            + _s(key)
            + struct.pack("<q", second)
            + b"\x0d"
            + struct.pack("<I", 5)
        )
        got = b""
        try:
            while len(got) < 20 and (chunk := a.recv(64)):
                got += chunk
        except ConnectionResetError:
            pass
        return got


async def test_add_overflow_parity_with_torch_server(torch_server: Any) -> None:
    theirs = await in_thread(lambda: _add_twice(torch_server.port, 2**63 - 1, 1))
    assert theirs == struct.pack("<q", 2**63 - 1) + struct.pack("<q", -(2**63)) + struct.pack("<I", 5)  # torch wraps
    st = await ServerThread(TCPStoreServer(HOST, 0)).astart()
    try:
        ours = await in_thread(lambda: _add_twice(st.server.port, 2**63 - 1, 1))
    finally:
        await st.astop()
    assert ours == theirs


async def test_delete_key_leaves_a_queue_alone_like_torch(torch_server: Any, client: TCPStore) -> None:
    """torch's server deletes only values: a queue of the same name survives DELETE_KEY."""
    await client.queue_push("dq", "1")
    assert await client.delete_key("dq") is False
    assert await client.queue_len("dq") == 1
    m = await TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    try:
        await m.queue_push("dq", "1")
        assert await m.delete_key("dq") is False
        assert await m.queue_len("dq") == 1 and await m.check(["dq"])
    finally:
        await m.close()
