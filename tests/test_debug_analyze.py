"""``aiodist.debug.analyze``: the first op where the ranks' flight recorders diverge, or which rank
is missing from which op; on dumps from real run_world jobs and on hand-made ones."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.debug.analyze import BadDumpError, analyze, format_report, load_dumps, main
from aiodist.debug.recorder import dump_flight_recorder
from aiodist.errors import DistError
from aiodist.testing import run_world

ROOT = Path(__file__).resolve().parent.parent


def entry(
    seq: int,
    op: str = "all_reduce",
    state: str = "completed",
    same: dict[str, Any] | None = None,
    kind: str = "collective",
    t: float = 100.0,
) -> dict[str, Any]:
    return {
        "id": seq,
        "op": op,
        "record_comm": None,
        "seq": seq,
        "kind": kind,
        "meta": {"same": same if same is not None else {"tensor": "float32[4]", "op": "SUM"}},
        "state": state,
        "time_issued": t + seq,
        "time_started": t + seq,
        "time_done": None if state in ("issued", "started") else t + seq + 0.001,
        "duration_s": None,
        "error": "boom" if state in ("failed", "timed out") else None,
        "stack": None,
    }


def dump(
    rank: int,
    entries: list[dict[str, Any]],
    world_size: int = 2,
    seq: int | None = None,
    *,
    gid: int = 0,
    desc: str = "default_pg",
    now: float = 120.0,
) -> dict[str, Any]:
    colls = [e for e in entries if e.get("kind", "collective") == "collective" and "seq" in e]
    return {
        "version": 1,
        "rank": rank,
        "world_size": world_size,
        "pid": 1000 + rank,
        "time": now,
        "groups": [
            {
                "group_id": gid,
                "desc": desc,
                "ranks": list(range(world_size)),
                "group_rank": rank,
                "seq": seq if seq is not None else (max(e["seq"] for e in colls) + 1 if colls else 0),
                "completed": sum(e["state"] == "completed" for e in colls),
                "broken": None,
                "timeout_s": 1800.0,
                "entries": entries,
            }
        ],
    }


# -- dumps from real jobs --------------------------------------------------------------------------


async def test_real_job_rank_never_issues_seq_7(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 ranks; ranks 0, 1, 3 are in all_reduce seq 7, rank 2 stopped after seq 6; every rank
    dumps its recorder (dump_flight_recorder(dir)) while they are stuck."""
    dumped, release = asyncio.Barrier(4), asyncio.Event()

    async def fn(rank: int) -> None:
        t = np.ones(4, dtype=np.float32)
        for _ in range(7):
            await dist.all_reduce(t)
        work = None
        if rank != 2:
            work = await dist.all_reduce(t, async_op=True)
        await asyncio.sleep(0.1)
        dump_flight_recorder(tmp_path)
        await asyncio.wait_for(dumped.wait(), 10)
        if rank == 2:
            await asyncio.wait_for(release.wait(), 10)
            await dist.all_reduce(t)
        else:
            release.set()
            assert work is not None
            await work.wait()

    await run_world(4, fn, backend="gloo", timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"aiodist_fr_rank{r}.json" for r in range(4)]
    result = analyze(load_dumps([str(tmp_path)]))
    assert not result["ok"] and result["missing_dumps"] == []
    (g,) = result["groups"]
    assert g["status"] == "missing" and g["issued"] == {"0": 8, "1": 8, "2": 7, "3": 8}
    p = g["problem"]
    assert (p["seq"], p["op"], p["missing_ranks"], p["waiting_ranks"]) == (7, "all_reduce", [2], [0, 1, 3])
    assert result["problems"][0].startswith(
        "rank 2 never issued seq 7 (all_reduce) of group 'default_pg'; ranks [0, 1, 3] are waiting in it (for up to "
    )
    assert result["problems"][0].endswith("rank 2's last op is seq 6 (all_reduce, completed)")
    pos = {p["rank"]: p for p in result["rank_positions"]}
    assert pos[2]["pending"] == [] and pos[2]["last_finished"]["seq"] == 6
    assert pos[0]["pending"][0]["seq"] == 7 and pos[0]["pending"][0]["state"] == "started"

    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("PROBLEM FOUND: 4/4 rank dumps, 1 group")
    assert "! rank 2 never issued seq 7 (all_reduce) of group 'default_pg'; ranks [0, 1, 3] are waiting in it" in out
    assert "rank 2: idle; last finished all_reduce seq 6 of group 'default_pg' (completed)" in out
    assert "rank 0: in all_reduce seq 7 of group 'default_pg' (started, for " in out


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_real_job_dumps_on_timeout_cross_group_deadlock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 waits in all_reduce on the default group, rank 1 in a barrier on another group:
    both time out and dump (AIODIST_FR_DUMP_ON_TIMEOUT=1); the analyzer names both sides."""
    monkeypatch.setenv("AIODIST_FR_DUMP_ON_TIMEOUT", "1")
    monkeypatch.setenv("AIODIST_FR_DUMP_DIR", str(tmp_path))

    async def fn(rank: int) -> None:
        t = np.ones(4, dtype=np.float32)
        await dist.all_reduce(t)
        side = await dist.new_group([0, 1], timeout=0.5, group_desc="side")
        if rank == 0:
            work = await dist.all_reduce(t, async_op=True)
        else:
            work = await dist.barrier(group=side, async_op=True)
        assert work is not None
        with pytest.raises(DistError, match="timed out"):
            await work.wait()

    await run_world(2, fn, backend="gloo", timeout=30, pg_timeout=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aiodist_fr_rank0.json", "aiodist_fr_rank1.json"]
    result = analyze(load_dumps([str(tmp_path)]))
    assert not result["ok"]
    by_desc = {g["desc"]: g for g in result["groups"]}
    d, s = by_desc["default_pg"]["problem"], by_desc["side"]["problem"]
    assert (d["kind"], d["seq"], d["op"], d["missing_ranks"], d["failed_ranks"]) == ("missing", 1, "all_reduce", [1], [0])
    assert (s["kind"], s["seq"], s["op"], s["missing_ranks"], s["failed_ranks"]) == ("missing", 0, "barrier", [0], [1])
    text = format_report(result)
    assert "rank 1 never issued seq 1 (all_reduce) of group 'default_pg'; it failed or timed out on rank 0" in text
    assert "rank 0 never issued seq 0 (barrier) of group 'side'; it failed or timed out on rank 1" in text


# -- hand-made dumps -------------------------------------------------------------------------------


def test_consistent_dumps_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in range(2):
        (tmp_path / f"aiodist_fr_rank{r}.json").write_text(json.dumps(dump(r, [entry(0), entry(1), entry(2, state="started")])))
    (tmp_path / "other.json").write_text("not a dump, not read")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CONSISTENT: 2/2 rank dumps, 1 group")
    assert "group 'default_pg': 2 ranks agree on seqs 0..2; seq 2 (all_reduce) is still running (rank 0: started, rank 1: started)" in out
    assert main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_different_ops_at_one_seq() -> None:
    a = dump(0, [entry(0), entry(1, "all_reduce", "started")])
    b = dump(1, [entry(0), entry(1, "broadcast", "started", same={"tensor": "float32[4]", "root": 0})])
    result = analyze([a, b])
    (g,) = result["groups"]
    assert g["status"] == "diverged" and g["problem"]["seq"] == 1
    assert result["problems"] == [
        "seq 1 of group 'default_pg': ranks called different ops: rank 0 called all_reduce(op=SUM, tensor=float32[4]); rank 1 called broadcast(root=0, tensor=float32[4])"
    ]


def test_same_op_different_shapes_first_divergence_only() -> None:
    shapes = ["float32[10]", "float32[20]", "float32[10]"]
    dumps = [dump(r, [entry(0), entry(1, same={"tensor": shapes[r], "op": "SUM"}), entry(2, "broadcast")], world_size=3) for r in range(3)]
    result = analyze(dumps)
    (g,) = result["groups"]
    assert g["problem"]["kind"] == "mismatch" and g["problem"]["seq"] == 1
    assert [s["ranks"] for s in g["problem"]["sides"]] == [[0, 2], [1]]
    assert (
        "ranks called all_reduce with different arguments: ranks [0, 2] called all_reduce(op=SUM, tensor=float32[10]); rank 1 called all_reduce(op=SUM, tensor=float32[20])"
        in g["message"]
    )


def test_ring_buffers_that_dropped_different_amounts() -> None:
    """Rank 0 kept seqs 5..9, rank 1 only 8..9: the comparison starts at 8."""
    a = dump(0, [entry(s) for s in range(5, 10)])
    b = dump(1, [entry(s, "broadcast" if s == 6 else "all_reduce") for s in range(8, 10)])
    result = analyze([a, b])
    assert result["ok"] and result["groups"][0]["message"].startswith("group 'default_pg': 2 ranks agree on seqs 8..9")


def test_missing_dump_and_p2p_ignored_and_failed_op() -> None:
    p2p = [entry(0, "send", kind="p2p"), entry(1, "send", "started", kind="p2p")]
    a = dump(0, [entry(0), entry(1, state="failed"), *p2p], world_size=3)
    b = dump(1, [entry(0), entry(1, state="completed"), entry(0, "recv", kind="p2p")], world_size=3)
    result = analyze([a, b])
    assert result["missing_dumps"] == [2]
    assert result["problems"] == [
        "seq 1 (all_reduce) of group 'default_pg' failed on rank 0: boom",
        "no dump from rank 2 of 3: what they were doing is unknown",
    ]
    assert "rank 2: no dump" in format_report(result)


def test_issued_but_not_yet_in_ring_buffer() -> None:
    """A group's seq counter says rank 1 issued seq 1 though its entry is gone (buffer size 0):
    nothing to compare, no false alarm."""
    a = dump(0, [entry(0), entry(1, state="started")])
    b = dump(1, [], seq=2)
    result = analyze([a, b])
    assert result["ok"], result["problems"]


def test_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no aiodist_fr_rank<N>.json dumps" in capsys.readouterr().err
    assert main([str(tmp_path / "nope")]) == 2
    (tmp_path / "aiodist_fr_rank0.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    assert "cannot read a JSON dump" in capsys.readouterr().err
    (tmp_path / "aiodist_fr_rank0.json").write_text(json.dumps({"rank": "zero"}))
    assert main([str(tmp_path)]) == 2
    assert "not a flight-recorder dump" in capsys.readouterr().err
    with pytest.raises(BadDumpError, match="two dumps for rank 0"):
        analyze([dump(0, []), dump(0, [])])
    with pytest.raises(BadDumpError, match="an entry needs an int 'seq'"):
        analyze([dump(0, [{"op": "x"}])])


def test_module_cli(tmp_path: Path) -> None:
    for r, n in ((0, 3), (1, 2)):
        (tmp_path / f"aiodist_fr_rank{r}.json").write_text(
            json.dumps(dump(r, [entry(s, state="started" if s == 2 else "completed") for s in range(n)]))
        )
    proc = subprocess.run(
        [sys.executable, "-m", "aiodist.debug.analyze", str(tmp_path)], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        "rank 1 never issued seq 2 (all_reduce) of group 'default_pg'; rank 0 is waiting in it (for up to 18.0 s); rank 1's last op is seq 1 (all_reduce, completed)"
        in proc.stdout
    )


def test_index_view_rows_from_hand_made_dumps() -> None:
    """The page's rows: an op older than STUCK_AFTER_S on every rank is WAITING on all (no one
    to blame); a rank that did not answer is NO ANSWER and counts as stuck."""
    from aiodist.debug.server import STUCK_AFTER_S, index_view

    now = 100.0 + 1 + STUCK_AFTER_S + 5  # seq 1 started at t=101
    dumps = {r: dump(r, [entry(0), entry(1, state="started")], world_size=3, now=now) for r in (0, 1)}
    view = index_view(dumps, {2: "no answer within 5 s"}, 3)
    assert [row["state"] for row in view["rows"]] == ["waiting", "waiting", "no answer"]
    assert view["stuck_ranks"] == [2]
    assert view["rows"][0]["age_s"] == pytest.approx(STUCK_AFTER_S + 5)
    assert view["rows"][2]["why"] == "no answer within 5 s"
    fresh = {r: dump(r, [entry(0), entry(1, state="started")], now=101.5) for r in (0, 1)}
    assert [row["state"] for row in index_view(fresh, {}, 2)["rows"]] == ["in op", "in op"]
