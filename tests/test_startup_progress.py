"""Start-up mistakes explain themselves: while init waits it says what for.

A MASTER_ADDR that does not resolve is warned about at once; a rank that never starts is named,
with the count joined, every AIODIST_INIT_WARN_INTERVAL seconds; rank/world_size passed in code
that differ from the launcher's RANK/WORLD_SIZE are warned about at once, naming both values; a
normal init says nothing. The interval is cut to 0.3 s and the timeouts to about a second.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

import aiodist as dist
from aiodist import _startup
from aiodist.errors import DistError, DistNetworkError
from aiodist.store.hash import HashStore
from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(20)

_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(_startup.INTERVAL_ENV, "0.3")
    return monkeypatch


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
async def test_a_master_addr_that_does_not_resolve_is_warned_about_at_once(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = "no-such-host.invalid", free_port()
    try:
        await asyncio.to_thread(socket.getaddrinfo, host, port)
        pytest.skip(f"{host} resolves here")
    except socket.gaierror as exc:
        resolver_says = str(exc)
    env.setenv("MASTER_ADDR", host)
    env.setenv("MASTER_PORT", str(port))
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    caplog.set_level(logging.WARNING, logger="aiodist")
    start = time.time()
    with dist.use_world(dist.World("unresolved")), pytest.raises(DistNetworkError):
        await dist.init_process_group("gloo", timeout=1)
    first = _warnings(caplog, "cannot resolve")
    assert len(first) == 1, [r.getMessage() for r in caplog.records]  # at once, and once
    assert first[0].created - start < 0.5  # the first failure, not after an interval
    assert first[0].getMessage() == (
        f"init_process_group: rank 1 cannot resolve '{host}', the host of rank 0's TCPStore server at {host}:{port} "
        f"(from MASTER_ADDR): {resolver_says}; is the name right? Still trying, until the timeout (1.0 s)"
    )
    periodic = _warnings(
        caplog, f"init_process_group: rank 1 waiting for rank 0's TCPStore server at {host}:{port} to accept a connection ("
    )
    assert 1 <= len(periodic) <= 4, [r.getMessage() for r in caplog.records]
    assert " of 1.0 s; last error: " in periodic[0].getMessage()


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
async def test_a_rank_that_never_starts_is_named_with_the_count_joined(env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="aiodist")
    with dist.use_world(dist.World("alone")), pytest.raises(TimeoutError, match="1/2 clients joined"):
        await dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=1.2)
    got = _warnings(caplog, "to join the store")
    assert 2 <= len(got) <= 5, [r.getMessage() for r in caplog.records]  # every 0.3 s, not once per retry
    for r in got:
        assert r.getMessage().startswith(
            f"init_process_group: rank 0 waiting for ranks [1] to join the store at 127.0.0.1:{port} (1/2 joined, "
        )
        assert r.getMessage().endswith(" of 1.2 s)")
        assert r.name == "aiodist.store"


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
async def test_with_three_ranks_the_missing_one_is_named_by_the_master_and_by_the_others(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="aiodist")

    async def rank_fn(rank: int) -> None:
        with dist.use_world(dist.World(f"three-{rank}")):
            await dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=1.2)

    results = await asyncio.gather(rank_fn(0), rank_fn(1), return_exceptions=True)  # rank 2 never starts
    assert all(isinstance(r, (TimeoutError, DistError)) for r in results), results
    master = _warnings(caplog, "init_process_group: rank 0 waiting for ranks [2] to join the store at ")
    assert master and "(2/3 joined, " in master[0].getMessage(), [r.getMessage() for r in caplog.records]
    # rank 1 joined the store and waits in the transport's address exchange: for rank 2, and
    # for rank 0, which is still waiting for rank 2 to join
    other = _warnings(
        caplog,
        f"init_process_group: rank 1 waiting for ranks [0, 2] to publish their transport addresses in the store at 127.0.0.1:{port} (1/3 published, ",
    )
    assert other, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    ("launcher", "given", "expected"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, {"world_size": 1}, "world_size=1 was passed in code, but the launcher's WORLD_SIZE is 2"),
        ({"WORLD_SIZE": "1", "RANK": "1"}, {"rank": 0}, "rank=0 was passed in code, but the launcher's RANK is 1"),
    ],
)
async def test_rank_or_world_size_in_code_that_differ_from_the_launchers_are_warned_about_at_once(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, launcher: dict[str, str], given: dict[str, int], expected: str
) -> None:
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", str(free_port()))
    for k, v in launcher.items():
        env.setenv(k, v)
    caplog.set_level(logging.WARNING, logger="aiodist")
    with dist.use_world(dist.World("differs")):
        await dist.init_process_group("gloo", timeout=5, **given)  # a world of one: init succeeds
        await dist.destroy_process_group()
    got = _warnings(caplog, expected)
    assert len(got) == 1, [r.getMessage() for r in caplog.records]
    assert got[0].getMessage().startswith(f"init_process_group: {expected} (in the environment): ")


async def test_world_size_with_a_store_that_differs_from_the_launchers_is_warned_about(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env.setenv("WORLD_SIZE", "2")
    caplog.set_level(logging.WARNING, logger="aiodist")
    with dist.use_world(dist.World("differs-store")):
        await dist.init_process_group("memory", store=HashStore(), rank=0, world_size=1)
        await dist.destroy_process_group()
    assert _warnings(caplog, "init_process_group: world_size=1 was passed in code, but the launcher's WORLD_SIZE is 2")


async def test_a_normal_quick_init_says_nothing(env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    env.delenv(_startup.INTERVAL_ENV)  # the default, 10 s
    env.setenv("WORLD_SIZE", "2")  # as a launcher sets it, agreeing with the code
    port = free_port()
    caplog.set_level(logging.WARNING, logger="aiodist")

    async def rank_fn(rank: int) -> None:
        if rank == 0:
            await asyncio.sleep(0.2)  # the client retries a refused connect meanwhile: normal, not worth a word
        with dist.use_world(dist.World(f"quiet-{rank}")):
            await dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=10)
            await dist.barrier()
            await dist.destroy_process_group()

    await asyncio.gather(rank_fn(0), rank_fn(1))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_interval_and_the_wording_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_startup.INTERVAL_ENV, raising=False)
    assert _startup.warn_interval() == 10.0
    monkeypatch.setenv(_startup.INTERVAL_ENV, "0")
    assert _startup.warn_interval() == float("inf")  # 0 turns them off
    monkeypatch.setenv(_startup.INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match="AIODIST_INIT_WARN_INTERVAL='soon': expected a number of seconds >= 0"):
        _startup.warn_interval()
    assert _startup.waited(20.2, 1800) == "20 s of 1800 s"
    assert _startup.waited(0.31, 1.2) == "0.3 s of 1.2 s"
    assert _startup.waited(3, None) == "3.0 s so far"
    assert _startup.ranks(list(range(20)), limit=3) == "[0, 1, 2, ... (20 in all)]"
