"""Debug levels (``AIODIST_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG``) and DETAIL's desync check:
shape, dtype, op, root and reduce-op mismatches fail every rank at once, long before the
group's timeout, with each side in the message (docs/debugging.md)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist._instrument import desync  # the module c10d calls (aiodist.debug.desync re-exports it)
from aiodist.debug import DebugLevel, get_debug_level, logs, set_debug_level, set_debug_level_from_env
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

    async def counting(p2p: Any, pg: Any, op: str, seq: int, meta: Any, exchange: Any) -> None:
        seen.append(op)
        await real(p2p, pg, op, seq, meta, exchange)

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


# -- logging: AIODIST_LOG_LEVEL / TORCH_CPP_LOG_LEVEL and torch's matrix --------------------------


@pytest.fixture
def aiodist_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    logger = logging.getLogger("aiodist")
    level, handlers = logger.level, list(logger.handlers)
    for var in logs.LOG_LEVEL_VARS:
        monkeypatch.delenv(var, raising=False)
    yield logger
    for var in logs.LOG_LEVEL_VARS:
        os.environ.pop(var, None)  # (monkeypatch restores them after this)
    logs.configure_logging(None)  # forget the applied level before the debug level is restored
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.mark.parametrize(
    ("log_level", "debug", "want"),
    [
        ("ERROR", "DETAIL", logging.ERROR),
        ("WARNING", "INFO", logging.WARNING),
        ("INFO", "OFF", logging.INFO),
        ("INFO", "INFO", logging.DEBUG),
        ("INFO", "DETAIL", logs.TRACE),
        ("FATAL", "OFF", logging.CRITICAL),
        ("debug", "OFF", logging.DEBUG),
    ],
)
def test_log_level_matrix(log_level: str, debug: str, want: int, aiodist_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    assert logs.effective_log_level(log_level, DebugLevel[debug]) == want
    set_debug_level(debug)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", log_level)  # torch's name is an alias
    assert logs.configure_logging() == want
    assert aiodist_logger.level == want
    assert logging.getLogger("aiodist.c10d").getEffectiveLevel() == want  # the whole tree


def test_log_level_env(aiodist_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    aiodist_logger.setLevel(logging.NOTSET)
    set_debug_level("OFF")
    assert logs.configure_logging() is None  # nothing set: left alone
    assert aiodist_logger.level == logging.NOTSET
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("AIODIST_LOG_LEVEL", "INFO")  # aiodist's own name wins
    assert logs.configure_logging() == logging.INFO
    set_debug_level("DETAIL")  # the matrix follows the debug level
    assert aiodist_logger.level == logs.TRACE
    set_debug_level("INFO")
    assert aiodist_logger.level == logging.DEBUG
    monkeypatch.setenv("AIODIST_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="AIODIST_LOG_LEVEL='chatty'"):
        logs.configure_logging()


def test_bad_log_level_at_import_warns(monkeypatch: pytest.MonkeyPatch, aiodist_logger: logging.Logger) -> None:
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "bogus")
    with pytest.warns(RuntimeWarning, match="TORCH_CPP_LOG_LEVEL='bogus'"):
        logs.configure_logging_at_import()


async def test_detail_and_info_trace_logs(caplog: pytest.LogCaptureFixture, aiodist_logger: logging.Logger) -> None:
    set_debug_level("DETAIL")
    logs.configure_logging("INFO")  # + DETAIL: trace
    assert aiodist_logger.level == logs.TRACE

    async def fn(rank: int) -> None:
        await dist.all_reduce(_f32(2))

    with caplog.at_level(logs.TRACE, logger="aiodist"):
        await run_world(2, fn, pg_timeout=PG_TIMEOUT)
    by_level = {(r.levelname, r.name) for r in caplog.records}
    assert ("TRACE", "aiodist.debug.desync") in by_level
    assert ("DEBUG", "aiodist.c10d") in by_level  # the per-op line of an INFO (or DETAIL) group
    assert ("INFO", "aiodist.c10d.init") in by_level
    assert all(r.name.startswith("aiodist.") for r in caplog.records if r.name.startswith("aiodist"))


@pytest.mark.parametrize("backend", ["memory", "gloo"])
async def test_detail_long_calls_agree_and_differences_past_the_shown_part_are_caught(backend: str) -> None:
    """A call whose description is longer than a fingerprint message (all_reduce_coalesced of 200
    tensors) is compared through its digest: equal calls pass, a difference in tensor 190 fails."""
    set_debug_level("DETAIL")
    try:

        async def fn(rank: int) -> str:
            same = [np.ones(4, np.float32) for _ in range(200)]
            await dist.all_reduce_coalesced(same)
            assert (same[0] == 2).all()
            other = [np.ones(4, np.float32) for _ in range(200)]
            if rank == 1:
                other[190] = np.ones(5, np.float32)
            with pytest.raises(dist.DistError) as ei:
                await dist.all_reduce_coalesced(other)
            return str(ei.value)

        msgs = await run_world(2, fn, backend=backend, timeout=20)
    finally:
        set_debug_level("OFF")
    for m in msgs:
        assert "desync detected" in m and "all_reduce_coalesced seq 1" in m and "rank 0 has" in m and "rank 1 has" in m
