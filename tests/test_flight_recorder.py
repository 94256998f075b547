"""The flight recorder: entries for collectives and p2p ops with their states, record_comm names
(also in tasks started inside the block), the ring buffer's size from AIODIST_FR_BUFFER_SIZE,
DETAIL's trimmed stacks, dump_flight_recorder's JSON, and the dump on timeout."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.debug import dump_flight_recorder, get_debug_level, record_comm, set_debug_level
from aiodist.debug.recorder import FORMAT_VERSION, FlightRecorder, buffer_size, current_comm_name
from aiodist.testing.world import run_world


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = get_debug_level()
    for var in ("AIODIST_FR_BUFFER_SIZE", "AIODIST_FR_DUMP_ON_TIMEOUT", "AIODIST_FR_DUMP_DIR"):
        monkeypatch.delenv(var, raising=False)
    set_debug_level("OFF")
    yield
    set_debug_level(before)


def _f32(n: int = 2) -> np.ndarray:
    return np.ones(n, np.float32)


def _entries(dump: dict[str, Any], group: int = 0) -> list[dict[str, Any]]:
    (g,) = [g for g in dump["groups"] if g["group_id"] == group]
    return list(g["entries"])


@pytest.mark.parametrize("backend", ["memory", "gloo"])
async def test_collectives_and_p2p_are_recorded(backend: str) -> None:
    async def fn(rank: int) -> dict[str, Any]:
        await dist.all_reduce(_f32(3))
        await dist.broadcast(_f32(4), 0)
        if rank == 0:
            await dist.send(_f32(5), 1, tag=7)
        else:
            await dist.recv(_f32(5), 0, tag=7)
        return dump_flight_recorder()

    dumps = await run_world(2, fn, backend=backend)
    for rank, d in enumerate(dumps):
        assert d["version"] == FORMAT_VERSION and d["rank"] == rank and d["world_size"] == 2
        es = _entries(d)
        assert [(e["op"], e["seq"], e["kind"], e["state"]) for e in es] == [
            ("all_reduce", 0, "collective", "completed"),
            ("broadcast", 1, "collective", "completed"),
            ("send" if rank == 0 else "recv", 0, "p2p", "completed"),
        ]
        assert es[0]["meta"]["same"] == {"tensor": "float32[3]", "op": "SUM"}
        assert es[1]["meta"]["same"] == {"tensor": "float32[4]", "root": 0}
        assert es[2]["meta"] == {"tag": 7, "peers": [1 - rank]}
        for e in es:
            assert e["time_issued"] <= e["time_started"] <= e["time_done"]
            assert e["duration_s"] >= 0 and e["error"] is None and e["stack"] is None  # stacks only at DETAIL
        json.dumps(d)  # JSON-able as is


async def test_states_issued_started_completed() -> None:
    async def fn(rank: int) -> list[str]:
        states = []
        if rank == 1:
            await asyncio.sleep(0.05)  # rank 0's op starts and waits for this one
        work = await dist.all_reduce(_f32(), async_op=True)
        states.append(_entries(dump_flight_recorder())[-1]["state"])  # issued: its task has not run yet
        if rank == 0:
            await asyncio.sleep(0.02)
            states.append(_entries(dump_flight_recorder())[-1]["state"])  # waiting on rank 1
        await work.wait()
        states.append(_entries(dump_flight_recorder())[-1]["state"])
        return states

    assert await run_world(2, fn) == [["issued", "started", "completed"], ["issued", "completed"]]


async def test_failed_state_and_error() -> None:
    set_debug_level("DETAIL")

    async def fn(rank: int) -> dict[str, Any]:
        with pytest.raises(dist.DistBackendError):
            await dist.all_reduce(_f32(2 + rank))
        return _entries(dump_flight_recorder())[-1]

    for e in await run_world(2, fn, pg_timeout=30):
        assert e["state"] == "failed"
        assert "rank 0 has tensor float32[2], rank 1 has tensor float32[3]" in e["error"]


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.6 s a run); a second loop waits them out again for the same result")
async def test_timed_out_and_dump_on_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_FR_DUMP_ON_TIMEOUT", "1")
    monkeypatch.setenv("AIODIST_FR_DUMP_DIR", str(tmp_path / "fr"))

    async def fn(rank: int) -> None:
        if rank == 1:  # rank 0 is never joined in its all_reduce: it times out and dumps
            with record_comm("step 3"):
                with pytest.raises(dist.DistTimeoutError):
                    await dist.all_reduce(_f32())
        else:
            await asyncio.sleep(0.6)

    await run_world(2, fn, pg_timeout=0.3)
    files = sorted(os.listdir(tmp_path / "fr"))
    assert files == ["aiodist_fr_rank1.json"]  # only the rank that timed out
    d = json.loads((tmp_path / "fr" / files[0]).read_text())
    assert d["rank"] == 1
    (e,) = _entries(d)
    assert (e["op"], e["record_comm"], e["state"]) == ("all_reduce", "step 3", "timed out")
    assert "timed out after 0.3 s" in e["error"]


async def test_no_dump_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    async def fn(rank: int) -> None:
        if rank == 1:
            with pytest.raises(dist.DistTimeoutError):
                await dist.all_reduce(_f32())
        else:
            await asyncio.sleep(0.4)

    await run_world(2, fn, pg_timeout=0.2)
    assert os.listdir(tmp_path) == []


async def test_record_comm_names_follow_tasks() -> None:
    async def fn(rank: int) -> list[tuple[str, str | None]]:
        with record_comm("forward"):
            assert current_comm_name() == "forward"
            await dist.all_reduce(_f32())
            # tasks started inside the block copy the context: their ops carry the name too
            await asyncio.gather(asyncio.create_task(dist.broadcast(_f32(), 0)))
            with record_comm("inner"):
                await dist.barrier()
            await dist.all_gather([_f32(), _f32()], _f32())
        assert current_comm_name() is None
        await dist.all_reduce(_f32())
        return [(e["op"], e["record_comm"]) for e in _entries(dump_flight_recorder())]

    for got in await run_world(2, fn):
        assert got == [
            ("all_reduce", "forward"),
            ("broadcast", "forward"),
            ("barrier", "inner"),
            ("all_gather", "forward"),
            ("all_reduce", None),
        ]


def test_record_comm_needs_a_name() -> None:
    for bad in ("", None, 3):
        with pytest.raises(ValueError), record_comm(bad):  # type: ignore[arg-type]
            pass


def test_buffer_size_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert buffer_size() == 2000
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "5")
    assert buffer_size() == 5 and FlightRecorder().size == 5
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "-3")
    assert buffer_size() == 0
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", "lots")
    with pytest.raises(ValueError, match="AIODIST_FR_BUFFER_SIZE"):
        buffer_size()


@pytest.mark.parametrize("size", [0, 3])
async def test_ring_buffer(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_FR_BUFFER_SIZE", str(size))

    async def fn(rank: int) -> list[tuple[int, int]]:
        for _ in range(7):
            await dist.all_reduce(_f32())
        return [(e["id"], e["seq"]) for e in _entries(dump_flight_recorder())]

    for got in await run_world(2, fn):
        assert got == ([] if size == 0 else [(4, 4), (5, 5), (6, 6)])


async def _user_helper() -> None:
    await dist.all_reduce(_f32())


async def test_detail_stacks_show_the_users_frames() -> None:
    set_debug_level("DETAIL")

    async def fn(rank: int) -> list[str]:
        await _user_helper()
        (e,) = _entries(dump_flight_recorder())
        return list(e["stack"])

    for stack in await run_world(2, fn, pg_timeout=30):
        assert stack[0].startswith("task 'run_world rank")
        assert " in fn: await _user_helper()" in stack[1]
        assert stack[2].endswith("in _user_helper: await dist.all_reduce(_f32())")
        assert len(stack) == 3  # nothing from asyncio or aiodist itself
        assert all(__file__ in s for s in stack[1:])


async def test_dump_to_file_and_directory(tmp_path: Path) -> None:
    async def fn(rank: int) -> None:
        sub = await dist.new_group([0, 1], group_desc="pair")
        await dist.all_reduce(_f32(), group=sub)
        dump_flight_recorder(tmp_path)  # a directory: one file per rank inside it
        if rank == 0:
            dump_flight_recorder(tmp_path / "one.json")

    await run_world(2, fn)
    assert sorted(os.listdir(tmp_path)) == ["aiodist_fr_rank0.json", "aiodist_fr_rank1.json", "one.json"]
    for name in ("aiodist_fr_rank1.json", "one.json"):
        d = json.loads((tmp_path / name).read_text())
        groups = {g["desc"]: g for g in d["groups"]}
        assert set(groups) == {"default_pg", "pair"}
        assert [e["op"] for e in groups["pair"]["entries"]] == ["all_reduce"]
        assert groups["pair"]["ranks"] == [0, 1] and groups["pair"]["seq"] == 1


async def test_a_reused_slot_is_left_to_its_new_op() -> None:
    """An op still running when the ring wraps past it does not touch the newer op's entry."""
    fr = FlightRecorder(1)
    old = fr.issued("all_reduce", 0, "collective", {"same": {"op": "SUM"}})
    new = fr.issued("broadcast", 1, "collective", {"same": {"root": 0}})
    assert old is not None and new is not None
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("boom"))
    fr.started(old)
    fr.timed_out(old, "late")
    fr.finished(old, failed)
    (e,) = fr.to_json()
    assert (e["id"], e["op"], e["state"], e["error"], e["meta"]) == (1, "broadcast", "issued", None, {"same": {"root": 0}})
    fr.started(new)
    fr.finished(new, failed)
    (e,) = fr.to_json()
    assert (e["state"], e["error"]) == ("failed", "boom")
