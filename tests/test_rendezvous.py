"""Rendezvous (env://, tcp://, file://, custom handlers) and the elastic utils."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import pytest

import aiodist
from aiodist.elastic.utils import get_env_variable_or_raise, get_free_port, get_log_level, get_logger
from aiodist.rendezvous import RendezvousRegistry, registry
from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(30)

ENV_VARS = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    for v in list(os.environ):  # a suite run under srun or mpirun must not see its own scheduler
        if v.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "MPI_LOCAL")):
            monkeypatch.delenv(v, raising=False)


async def _close(*stores: aiodist.Store) -> None:
    for s in stores:
        under = getattr(s, "underlying_store", None)
        await s.close()
        if under is not None:
            await under.close()


async def test_tcp_two_ranks_share_one_store() -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    (s0, r0, n0), (s1, r1, n1) = await asyncio.gather(
        aiodist.rendezvous(url, rank=0, world_size=2, timeout=10),
        aiodist.rendezvous(f"{url}?rank=1&world_size=2", timeout=10),
    )
    assert (r0, n0, r1, n1) == (0, 2, 1, 2)
    assert isinstance(s0, aiodist.TCPStore) and s0.server is not None  # rank 0 hosts
    assert isinstance(s1, aiodist.TCPStore) and s1.server is None
    await s1.set("hello", "from rank 1")
    assert await s0.get("hello") == b"from rank 1"
    await _close(s1, s0)


@pytest.mark.parametrize(
    "url,match",
    [
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
        ("tcp://127.0.0.1:1234?world_size=1", "rank parameter missing"),
        ("tcp://127.0.0.1:1234?rank=0", "world_size parameter missing"),
        ("tcp://127.0.0.1:1234?rank=x&world_size=1", "not an integer"),
        ("nosuch://x", "register_rendezvous_handler"),
        ("no-scheme-here", "no scheme"),
    ],
)
async def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        await aiodist.rendezvous(url, timeout=1)


async def test_rank_given_twice() -> None:
    with pytest.raises(ValueError, match="node-specific arguments"):
        await aiodist.rendezvous("tcp://127.0.0.1:1234?rank=0&world_size=1", rank=0, timeout=1)


async def test_bad_argument_types() -> None:
    with pytest.raises(TypeError):
        await aiodist.rendezvous(b"env://", timeout=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await aiodist.rendezvous("env://", rank="0", timeout=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"])
async def test_env_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        if k != missing:
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=f"environment variable {missing} expected, but not set"):
        await aiodist.rendezvous("env://", timeout=1)


async def test_env_non_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "abc")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        await aiodist.rendezvous("env://", timeout=1)


async def test_env_rank0_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    # RANK comes from the environment for rank 0 and from the arguments for rank 1.
    monkeypatch.setenv("RANK", "0")
    (s0, r0, n0), (s1, r1, n1) = await asyncio.gather(
        aiodist.rendezvous("env://", timeout=10),
        aiodist.rendezvous("env://", rank=1, timeout=10),
    )
    assert (r0, n0, r1, n1) == (0, 2, 1, 2)
    assert isinstance(s0, aiodist.TCPStore) and s0.port == port and s0.server is not None
    await s0.set("k", "v")
    assert await s1.get("k") == b"v"
    await _close(s1, s0)


async def test_env_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun's agent every rank is a client of the agent's store (torch 2.13: no prefix)."""
    agent = await aiodist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    (s0, _, _), (s1, _, _) = await asyncio.gather(
        aiodist.rendezvous("env://", rank=0, timeout=10),
        aiodist.rendezvous("env://", rank=1, timeout=10),
    )
    for s in (s0, s1):
        assert isinstance(s, aiodist.TCPStore) and s.server is None and s.port == agent.port
    await s0.set("x", "1")
    assert await s1.get("x") == b"1"
    assert await agent.get("x") == b"1"
    await _close(s0, s1, agent)


async def test_file_rendezvous(tmp_path: object) -> None:
    path = f"{tmp_path}/rdzv"
    (s0, r0, n0), (s1, r1, n1) = await asyncio.gather(
        aiodist.rendezvous(f"file://{path}?rank=0&world_size=2", timeout=10),
        aiodist.rendezvous(f"file://{path}", rank=1, world_size=2, timeout=10),
    )
    assert (r0, n0, r1, n1) == (0, 2, 1, 2)
    assert isinstance(s0, aiodist.FileStore)
    await s0.set("a", "b")
    assert await s1.get("a") == b"b"
    await _close(s0, s1)


async def test_custom_handlers() -> None:
    reg = registry
    store = aiodist.HashStore()
    calls: list[tuple[str, dict[str, object]]] = []

    async def fn_handler(url: str, **kwargs: object) -> tuple[aiodist.Store, int, int]:
        calls.append((url, kwargs))
        return store, 0, 1

    async def gen_handler(url: str, **kwargs: object):  # type: ignore[no-untyped-def]
        yield store, 1, 2
        raise RuntimeError("Unable to perform re-rendezvous")

    async def bad_handler(url: str, **kwargs: object) -> object:
        return "nope"

    try:
        aiodist.register_rendezvous_handler("testfn", fn_handler)
        aiodist.register_rendezvous_handler("testgen", gen_handler)
        aiodist.register_rendezvous_handler("testbad", bad_handler)
        with pytest.raises(RuntimeError, match="already registered"):
            aiodist.register_rendezvous_handler("testfn", fn_handler)
        assert await aiodist.rendezvous("testfn://host/path", rank=0, world_size=1, extra=5) == (store, 0, 1)
        url, kwargs = calls[0]
        assert "rank=0" in url and "world_size=1" in url
        assert kwargs["extra"] == 5 and "timeout" in kwargs
        assert await aiodist.rendezvous("testgen://x") == (store, 1, 2)
        with pytest.raises(TypeError, match="must produce"):
            await aiodist.rendezvous("testbad://x")
    finally:
        for scheme in ("testfn", "testgen", "testbad"):
            reg._handlers.pop(scheme, None)


def test_registry_object() -> None:
    reg = RendezvousRegistry()
    with pytest.raises(ValueError, match="Did you forget"):
        reg.get("x")
    with pytest.raises(TypeError):
        reg.register("x", "not callable")  # type: ignore[arg-type]
    assert registry.schemes() == ["env", "file", "tcp"]


# -- elastic utils ------------------------------------------------------------------------


def test_get_env_variable_or_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_TEST_VAR", "v")
    assert get_env_variable_or_raise("AIODIST_TEST_VAR") == "v"
    monkeypatch.delenv("AIODIST_TEST_VAR")
    with pytest.raises(ValueError, match="AIODIST_TEST_VAR"):
        get_env_variable_or_raise("AIODIST_TEST_VAR")


def test_get_free_port_is_bindable() -> None:
    port = get_free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_log_level_and_logger(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert get_log_level() == "WARNING"
    monkeypatch.delenv("LOGLEVEL", raising=False)
    lg = get_logger()
    assert lg.name == __name__ and lg.level == logging.WARNING
    monkeypatch.setenv("LOGLEVEL", "INFO")
    lg = get_logger("aiodist.test.logger")
    assert lg.level == logging.INFO
    lg.info("hello from the test")
    assert "hello from the test" in capsys.readouterr().err
    get_logger("aiodist.test.logger")  # a second call adds no second handler
    lg.info("once")
    assert capsys.readouterr().err.count("once") == 1
