"""Debug levels (``AIODIST_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG``) and DETAIL's desync check:
shape, dtype, op, root and reduce-op mismatches fail every rank at once, long before the
group's timeout, with each side in the message (docs/debugging.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.debug import DebugLevel, desync, get_debug_level, set_debug_level, set_debug_level_from_env
from aiodist.testing.world import run_world

PG_TIMEOUT = 30.0  # the group's timeout: a mismatch must be caught far sooner
CAUGHT_WITHIN = 2.0


@pytest.fixture(autouse=True)
def _restore_level() -> Iterator[None]:
    before = get_debug_level()
    yield
    set_debug_level(before)


# -- the level itself ---------------------------------------------------------------------------


def test_set_and_get() -> None:
    for value, want in [("DETAIL", DebugLevel.DETAIL), ("info", DebugLevel.INFO), (" Off ", DebugLevel.OFF), (2, DebugLevel.DETAIL)]:
        set_debug_level(value)
        assert get_debug_level() is want
    set_debug_level(DebugLevel.INFO)
    assert get_debug_level() == DebugLevel.INFO


@pytest.mark.parametrize("bad", ["verbose", "", "3", 7, -1])
def test_bad_values(bad: Any) -> None:
    set_debug_level("INFO")
    with pytest.raises(ValueError):
        set_debug_level(bad)
    assert get_debug_level() is DebugLevel.INFO  # unchanged


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    set_debug_level("DETAIL")
    set_debug_level_from_env()
    assert get_debug_level() is DebugLevel.OFF  # neither set: OFF
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")  # torch's name is an alias
    set_debug_level_from_env()
    assert get_debug_level() is DebugLevel.DETAIL
    monkeypatch.setenv("AIODIST_DEBUG", "INFO")  # aiodist's own name wins
    set_debug_level_from_env()
    assert get_debug_level() is DebugLevel.INFO
    monkeypatch.setenv("AIODIST_DEBUG", "loud")
    with pytest.raises(ValueError, match="AIODIST_DEBUG='loud'"):
        set_debug_level_from_env()
    monkeypatch.delenv("AIODIST_DEBUG")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "2")
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG"):
        set_debug_level_from_env()


# -- DETAIL's desync check ----------------------------------------------------------------------


def _f32(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


# case -> (what rank ``odd`` does differently, the text every rank's message must hold)
Call = Callable[[int, int], Awaitable[Any]]


async def _shape(rank: int, odd: int) -> Any:
    return await dist.all_reduce(_f32(20 if rank == odd else 10))


async def _dtype(rank: int, odd: int) -> Any:
    return await dist.all_reduce(np.ones(10, np.float64 if rank == odd else np.float32))


async def _op(rank: int, odd: int) -> Any:
    t = _f32(10)
    return await (dist.broadcast(t, 0) if rank == odd else dist.all_reduce(t))


async def _root(rank: int, odd: int) -> Any:
    return await dist.broadcast(_f32(4), 1 if rank == odd else 0)


async def _reduce_op(rank: int, odd: int) -> Any:
    return await dist.all_reduce(_f32(4), op=dist.ReduceOp.MAX if rank == odd else dist.ReduceOp.SUM)


CASES: dict[str, tuple[Call, Callable[[int, int], list[str]]]] = {
    "shape": (_shape, lambda n, odd: ["all_reduce seq 1", f"rank {odd} has tensor float32[20]", "float32[10]"]),
    "dtype": (_dtype, lambda n, odd: ["all_reduce seq 1", f"rank {odd} has tensor float64[10]", "float32[10]"]),
    "op": (_op, lambda n, odd: ["seq 1 on group 'default_pg'", f"rank {odd} called broadcast", "called all_reduce"]),
    "root": (_root, lambda n, odd: ["broadcast seq 1", f"rank {odd} has root 1", "root 0"]),
    "reduce_op": (_reduce_op, lambda n, odd: ["all_reduce seq 1", f"rank {odd} has op MAX", "op SUM"]),
}


@pytest.mark.parametrize("backend", ["memory", "gloo"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
async def test_detail_catches_mismatch(backend: str, n: int, case: str) -> None:
    set_debug_level("DETAIL")
    call, expected = CASES[case]
    odd = n - 1

    async def fn(rank: int) -> tuple[float, str]:
        await dist.barrier()  # connections made: time only the check
        t0 = time.monotonic()
        with pytest.raises(dist.DistBackendError) as info:
            await call(rank, odd)
        return time.monotonic() - t0, str(info.value)

    results = await run_world(n, fn, backend=backend, timeout=PG_TIMEOUT + 10, pg_timeout=PG_TIMEOUT)
    for rank, (took, msg) in enumerate(results):
        assert took < CAUGHT_WITHIN, (rank, took, msg)
        assert "desync detected (AIODIST_DEBUG=DETAIL)" in msg
        assert f"on rank {rank}" in msg
        for part in expected(n, odd):
            assert part in msg, (rank, part, msg)
    assert isinstance(results, list)


async def test_detail_message_names_every_side() -> None:
    """On 4 ranks with 3 different shapes, each side is in the message (agreeing ranks grouped)."""
    set_debug_level("DETAIL")

    async def fn(rank: int) -> str:
        with pytest.raises(desync.DesyncError) as info:
            await dist.all_reduce(_f32([10, 10, 20, 30][rank]))
        return str(info.value)

    for msg in await run_world(4, fn, pg_timeout=PG_TIMEOUT):
        assert "ranks [0, 1] have tensor float32[10], rank 2 has tensor float32[20], rank 3 has tensor float32[30]" in msg


async def test_detail_matching_calls_pass_and_group_stays_usable() -> None:
    set_debug_level("DETAIL")

    async def fn(rank: int) -> float:
        t = _f32(3) * (rank + 1)
        await dist.all_reduce(t)
        await dist.broadcast(t, 1)
        sub = await dist.new_group([0, 1])
        if rank < 2:
            await dist.all_reduce(t, group=sub)
        return float(t[0])

    assert await run_world(3, fn, backend="gloo", pg_timeout=PG_TIMEOUT) == [12.0, 12.0, 6.0]


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = desync.check_fingerprint

    async def counting(p2p: Any, pg: Any, op: str, seq: int, meta: Any) -> None:
        seen.append(op)
        await real(p2p, pg, op, seq, meta)

    monkeypatch.setattr(desync, "check_fingerprint", counting)
    return seen


@pytest.mark.parametrize("level", ["OFF", "INFO", "DETAIL"])
async def test_only_detail_exchanges_fingerprints(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_checks(monkeypatch)
    set_debug_level(level)

    async def fn(rank: int) -> None:
        for _ in range(3):
            await dist.all_reduce(_f32(2))

    await run_world(2, fn, pg_timeout=PG_TIMEOUT)
    assert len(seen) == (6 if level == "DETAIL" else 0)


async def test_group_keeps_the_level_it_was_made_at(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_checks(monkeypatch)
    set_debug_level("DETAIL")

    async def fn(rank: int) -> None:
        await dist.barrier()
        set_debug_level("OFF")  # the default group was made at DETAIL: it keeps checking
        late = await dist.new_group([0, 1])  # made at OFF: it never checks
        await dist.all_reduce(_f32(2))
        await dist.all_reduce(_f32(2), group=late)

    await run_world(2, fn, pg_timeout=PG_TIMEOUT)
    assert seen == ["barrier", "barrier", "all_reduce", "all_reduce"]


async def test_info_logs_group_life(caplog: pytest.LogCaptureFixture) -> None:
    set_debug_level("INFO")

    async def fn(rank: int) -> None:
        for _ in range(3):
            await dist.all_reduce(_f32(2))
        await dist.broadcast(_f32(2), 0)

    with caplog.at_level(logging.INFO, logger="aiodist"):
        await run_world(2, fn, pg_timeout=PG_TIMEOUT)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("aiodist"))
    assert "made default_pg" in text
    assert "all_reduce 3" in text and "broadcast 1" in text, text
