"""The stores and rendezvous behave as torch's do: the agent store under torchrun,
timeout words, a port in use, a host that does not resolve, FileStore's key count, and the
exception types of rendezvous's argument checks. Each aiodist test failed before its fix; the
``torch_`` tests check torch 2.13's own behaviour (skipped without torch).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from aiodist import FileStore, HashStore, TCPStore
from aiodist.errors import DistNetworkError, StoreTimeoutError
from aiodist.rendezvous import rendezvous
from aiodist.store import PrefixStore, Store

pytestmark = pytest.mark.timeout(30)

T = 0.3  # a short store timeout, seconds
TORCH_WORDS = re.compile(r"[Tt]imeout")  # what torch users match on a store's timeout


def _torch() -> Any:
    return pytest.importorskip("torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_agent_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    return monkeypatch


# -- 1. TORCHELASTIC_USE_AGENT_STORE: a master on the agent's port becomes a client ---------


@pytest.mark.parametrize("value", ["True", "true", "1", "yes", "T"])
async def test_master_on_the_agents_port_becomes_its_client(
    no_agent_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    async with TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False) as agent:
        no_agent_env.setenv("TORCHELASTIC_USE_AGENT_STORE", value)
        no_agent_env.setenv("MASTER_PORT", str(agent.port))
        with caplog.at_level(logging.ERROR, logger="aiodist.store"):
            async with TCPStore("127.0.0.1", agent.port, 1, True, T) as s:
                await s.set("k", "from the rank")
                assert await agent.get("k") == b"from the rank"
                assert s.port == agent.port and s.server is None
        assert (
            f"The server socket on {agent.port} has failed to bind. TORCHELASTIC_USE_AGENT_STORE is enabled so ignoring the error"
            in caplog.text
        )
        assert await agent.get("k") == b"from the rank", "closing the rank's store must leave the agent's server up"


@pytest.mark.parametrize(("value", "master_port"), [("False", "same"), ("0", "same"), ("True", "other"), ("True", None), (None, "same")])
async def test_otherwise_a_taken_port_still_fails(no_agent_env: pytest.MonkeyPatch, value: str | None, master_port: str | None) -> None:
    async with TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False) as agent:
        if value is not None:
            no_agent_env.setenv("TORCHELASTIC_USE_AGENT_STORE", value)
        if master_port is not None:
            no_agent_env.setenv("MASTER_PORT", str(agent.port if master_port == "same" else agent.port + 1))
        with pytest.raises(DistNetworkError, match="failed to listen"):
            await TCPStore("127.0.0.1", agent.port, None, True, T, wait_for_workers=False)


async def test_a_value_torch_refuses_is_refused_after_the_bind_fails(no_agent_env: pytest.MonkeyPatch) -> None:
    from aiodist.store.tcp import InvalidEnvError  # here, so the other tests run on the code before it existed

    no_agent_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "garbage")
    async with TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False) as agent:  # a free port: never read
        no_agent_env.setenv("MASTER_PORT", str(agent.port))
        with pytest.raises(InvalidEnvError, match="^Invalid value for environment variable: TORCHELASTIC_USE_AGENT_STORE") as e:
            await TCPStore("127.0.0.1", agent.port, None, True, T, wait_for_workers=False)
        assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("value", "same_port", "ok"), [("yes", True, True), ("False", True, False), ("True", False, False), ("garbage", True, None)]
)
def test_torch_master_on_the_agents_port_becomes_its_client(
    no_agent_env: pytest.MonkeyPatch, value: str, same_port: bool, ok: bool | None
) -> None:
    d = _torch()
    agent = d.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=T), wait_for_workers=False)
    no_agent_env.setenv("TORCHELASTIC_USE_AGENT_STORE", value)
    no_agent_env.setenv("MASTER_PORT", str(agent.port if same_port else agent.port + 1))
    if ok:
        d.TCPStore("127.0.0.1", agent.port, None, True, timedelta(seconds=T), wait_for_workers=False).set("k", value)
        assert agent.get("k") == value.encode()
    else:
        words = "failed to listen" if ok is False else "^Invalid value for environment variable: TORCHELASTIC_USE_AGENT_STORE"
        with pytest.raises(RuntimeError, match=words) as e:
            d.TCPStore("127.0.0.1", agent.port, None, True, timedelta(seconds=T), wait_for_workers=False)
        assert isinstance(e.value, d.DistNetworkError) == (ok is False)


async def test_aiodist_master_on_a_torch_agents_port_becomes_its_client(no_agent_env: pytest.MonkeyPatch) -> None:
    d = _torch()
    agent = d.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    no_agent_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    no_agent_env.setenv("MASTER_PORT", str(agent.port))
    async with TCPStore("127.0.0.1", agent.port, None, True, 5, wait_for_workers=False) as s:
        await s.set("k", "v")
    assert agent.get("k") == b"v"


# -- 2. every store timeout says "timeout", and adds torch's words -----------------------------


@pytest.fixture(params=["tcp", "hash", "file", "prefix"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    kind = request.param
    if kind in ("tcp", "prefix"):
        s: Store = await TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False)
        inner = s
        if kind == "prefix":
            s = PrefixStore("pre", s)
    elif kind == "hash":
        inner = s = HashStore(T)
    else:
        inner = s = await FileStore(str(tmp_path / "fs"), 1, timeout=T)
    yield s
    await inner.close()


# per store kind and call: the words torch 2.13 says there (checked in test_torch_timeout_words)
_TORCH_SAYS = {
    "tcp": {"get": "wait timeout after 300ms, keys: /bad_key", "wait": "wait timeout after 200ms, keys: /bad_key, /a"},
    "prefix": {"get": "wait timeout after 300ms, keys: /pre/bad_key", "wait": "wait timeout after 200ms, keys: /pre/bad_key, /pre/a"},
    "hash": {"get": "Wait timeout", "wait": "Wait timeout"},
    "file": {"get": "Timeout waiting for key: bad_key after 300 ms", "wait": "Wait timeout"},
}

_CALLS: dict[str, Callable[[Store], Any]] = {
    "get": lambda s: s.get("bad_key"),
    "wait": lambda s: s.wait(["bad_key", "a"], 0.2),
    "multi_get": lambda s: s.multi_get(["bad_key", "a"]),
    "queue_pop": lambda s: s.queue_pop("bad_key"),
}


@pytest.mark.parametrize("call", list(_CALLS))
async def test_every_blocking_call_times_out_with_the_word_timeout(store: Store, call: str, request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["store"]
    await store.set("a", "1")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as e:
        await _CALLS[call](store)
    assert time.monotonic() - t0 < 1.5
    msg = str(e.value)
    assert TORCH_WORDS.search(msg), msg
    assert re.search(r"timed out after [\d.]+ s; key\(s\) not set: '(pre/)?bad_key'", msg), msg  # aiodist's detail stays
    if call in _TORCH_SAYS[kind]:
        assert _TORCH_SAYS[kind][call] in msg, msg
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, RuntimeError)


async def test_a_barrier_timeout_says_timeout() -> None:
    with pytest.raises(StoreTimeoutError, match=r"barrier 'b' timed out after 0\.2 s \(barrier timeout\) with 1/2 arrived"):
        await HashStore(T).barrier("b", 2, 0.2)


async def test_the_masters_wait_for_clients_matches_what_torch_users_match() -> None:
    with pytest.raises(StoreTimeoutError) as e:
        await TCPStore("127.0.0.1", 0, 2, True, timeout=0.2)
    # torch's own words there have no "timeout": users match "timed out" (or "Timed out")
    assert re.search(r"[Tt]imeout|timed out", str(e.value), re.IGNORECASE)
    assert str(e.value).startswith("Timed out after 1 seconds waiting for clients.")


@pytest.mark.parametrize("kind", list(_TORCH_SAYS))
def test_torch_timeout_words(tmp_path: Path, kind: str) -> None:
    d = _torch()
    if kind == "hash":
        s = d.HashStore()
    elif kind == "file":
        s = d.FileStore(str(tmp_path / "fs"), 1)
    else:
        s = d.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=T), wait_for_workers=False)
        if kind == "prefix":
            s = d.PrefixStore("pre", s)
    s.set_timeout(timedelta(seconds=T))
    s.set("a", "1")
    with pytest.raises(RuntimeError) as e:
        s.get("bad_key")
    assert str(e.value) == _TORCH_SAYS[kind]["get"]
    if kind != "file":  # torch's FileStore polls once a second: 1 s per timeout
        with pytest.raises(RuntimeError) as e:
            s.wait(["bad_key", "a"], timedelta(seconds=0.2))
        assert str(e.value) == _TORCH_SAYS[kind]["wait"]


def test_torch_masters_wait_for_clients_words() -> None:
    d = _torch()
    with pytest.raises(d.DistStoreError, match=r"^Timed out after 1 seconds waiting for clients\. 1/2 clients joined\.$"):
        d.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=0.2))


# -- 3. a port in use: torch's words ----------------------------------------------------------


def _torch_listen_words(port: int) -> str:
    return (
        f"The server socket has failed to listen on any local network address. port: {port}, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"
    )


async def test_a_port_in_use_says_what_torch_says(no_agent_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DistNetworkError) as e:
            await TCPStore("127.0.0.1", port, None, True, T, wait_for_workers=False)
    assert str(e.value).startswith(_torch_listen_words(port)), str(e.value)
    assert f"could not start a TCPStore server on *:{port}: [Errno 98] Address already in use" in str(e.value)


def test_torch_port_in_use_words(no_agent_env: pytest.MonkeyPatch) -> None:
    d = _torch()
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(d.DistNetworkError) as e:
            d.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=T), wait_for_workers=False)
    assert str(e.value).splitlines()[0] == _torch_listen_words(port)


# -- 4. a client that cannot connect: torch's words, and it tries for the whole timeout ------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("host", ["dnsnotexist", "127.0.0.1"])
async def test_a_client_tries_for_its_whole_timeout_and_says_so_as_torch(host: str) -> None:
    port = 23456 if host == "dnsnotexist" else _free_port()
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError) as e:
        await TCPStore(host, port, None, False, 1.0)
    took = time.monotonic() - t0
    assert 0.9 <= took < 3.0, took  # it gave up at ~0.6 s of 1 s before
    msg = str(e.value)
    assert msg.startswith(f"The client socket has timed out after 1000ms while trying to connect to ({host}, {port})."), msg
    assert f"Could not connect to the TCPStore server at {host}:{port}" in msg and "timeout" in msg


def test_torch_client_connect_timeout_words() -> None:
    d = _torch()
    port = _free_port()
    with pytest.raises(d.DistNetworkError) as e:
        d.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=0.3))
    assert str(e.value).splitlines()[0] == f"The client socket has timed out after 300ms while trying to connect to (127.0.0.1, {port})."


# -- 5. num_keys counts as torch's does ----------------------------------------------------------


async def test_num_keys_counts_as_torch(tmp_path: Path) -> None:
    async with FileStore(str(tmp_path / "fs"), 1) as f:
        assert await f.num_keys() == 1  # torch's FileStore counts its user counter
        await f.set("k", "v")
        assert await f.num_keys() == 2
        assert await f.list_keys() == ["k"]  # torch lists the counter too, as 'efcount/': aiodist does not
    h = HashStore()
    assert await h.num_keys() == 0
    async with TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False) as t0, TCPStore("127.0.0.1", 0, 1, True, T) as t1:
        assert (await t0.num_keys(), await t1.num_keys()) == (0, 1)  # world_size: init/ counted
        await t0.set("k", "v")
        assert await PrefixStore("p", t0).num_keys() == 1  # the underlying store's count


def test_torch_num_keys(tmp_path: Path) -> None:
    d = _torch()
    f = d.FileStore(str(tmp_path / "fs"), 1)
    assert f.num_keys() == 1
    f.set("k", "v")
    assert f.num_keys() == 2
    assert d.HashStore().num_keys() == 0
    t0 = d.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=T), wait_for_workers=False)
    t1 = d.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=T))
    assert (t0.num_keys(), t1.num_keys()) == (0, 1)
    t0.set("k", "v")
    assert d.PrefixStore("p", t0).num_keys() == 1


# -- 6. rendezvous's argument checks raise torch's types too ------------------------------------

_CONFLICTS = [
    ("tcp://127.0.0.1:1234?rank=0", {"rank": 0}),
    ("tcp://127.0.0.1:1234?rank=0", {"world_size": 2}),
    ("env://?rank=0", {"rank": 1}),
]


@pytest.mark.parametrize(("url", "kw"), _CONFLICTS)
async def test_node_specific_arguments_twice_raise_torchs_assertion_error(url: str, kw: dict[str, int]) -> None:
    with pytest.raises(AssertionError, match=r"has node-specific arguments\(rank, world_size\) already") as e:
        await rendezvous(url, **kw)
    assert isinstance(e.value, ValueError)


async def test_a_tcp_url_without_a_host_raises_torchs_assertion_error() -> None:
    with pytest.raises(AssertionError, match="hostname cannot be None") as e:
        await rendezvous("tcp://:1234?rank=0&world_size=1")
    assert isinstance(e.value, ValueError)


_WRONG_TYPES: list[dict[str, Any]] = [
    {"url": 5},
    {"url": "tcp://h:1?world_size=1", "rank": "0"},
    {"url": "tcp://h:1?rank=0", "world_size": 1.0},
]


@pytest.mark.parametrize("kw", _WRONG_TYPES)
async def test_arguments_of_the_wrong_type_raise_torchs_runtime_error(kw: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="must be an? (string|integer)") as e:
        await rendezvous(**kw)
    assert isinstance(e.value, TypeError)


def test_torch_rendezvous_argument_checks() -> None:
    d = _torch()
    from torch.distributed import rendezvous as torch_rendezvous

    for url, kw in _CONFLICTS:
        with pytest.raises(AssertionError, match=r"has node-specific arguments\(rank, world_size\) already"):
            next(torch_rendezvous(url, **kw))
    with pytest.raises(AssertionError, match="hostname cannot be None"):
        next(torch_rendezvous("tcp://:1234?rank=0&world_size=1"))
    for bad in _WRONG_TYPES:
        with pytest.raises(RuntimeError, match="must be an? (string|integer)"):
            next(torch_rendezvous(**bad))
    assert d is not None
