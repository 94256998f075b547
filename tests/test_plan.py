"""aiodist.algorithms.plan: the one decision of a collective's path, as a table (rules in the
module docstring, in order), and the rule that c10d makes no path decision of its own."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import NamedTuple

import pytest

from aiodist.algorithms.plan import OPS, Plan, plan
from aiodist.algorithms.thresholds import Thresholds

K, M = 1 << 10, 1 << 20
D = Thresholds()
NO_LANE = Thresholds(lane_max=0)
NO_PAIR = Thresholds(pair_lane_max=0)  # a pair's lane as a wider group's (1 MiB)
NO_CMA = Thresholds(
    broadcast_shm_min=-1, reduce_cma_min=-1, reduce_scatter_cma_min=-1, alltoall_cma=-1, gather_cma_min=-1, scatter_cma_min=-1
)
NO_CMA_PAIR = dataclasses.replace(NO_CMA, pair_lane_max=0)
PIECES = Thresholds(pair_pieces_max=64 * M)  # a pair's lane in pieces past 4 MiB (off by default)


class Row(NamedTuple):
    why: str
    op: str
    nbytes: int
    ranks: int
    want: Plan
    th: Thresholds = D
    part: int = 0
    spread: bool = False  # the group is on several hosts, more than one rank on some


ROWS = [
    # broadcast
    Row("small, 2 ranks: the lane", "broadcast", 4, 2, Plan("lane", True)),
    Row("16 KiB, 2 ranks: still the lane", "broadcast", 16 * K, 2, Plan("lane", True)),
    Row("small, 4 ranks: the lane too", "broadcast", 4, 4, Plan("lane", True)),
    Row("empty: the socket", "broadcast", 0, 2, Plan("socket", False)),
    Row("256 KiB, 2 ranks: still the lane", "broadcast", 256 * K, 2, Plan("lane", True)),
    Row("1 MiB, 4 ranks: still the lane", "broadcast", M, 4, Plan("lane", True)),
    Row("past the lane, under single copy, 4 ranks: socket, in line", "broadcast", M + 4, 4, Plan("socket", True)),
    Row("past the lane, 2 ranks: single copy", "broadcast", M + 4, 2, Plan("single_copy", True), NO_PAIR),
    Row("a pair, 4 MiB: the lane (its slots hold 4 MiB)", "broadcast", 4 * M, 2, Plan("lane", True)),
    Row("a pair, past 4 MiB: single copy (pieces off by default)", "broadcast", 4 * M + 4, 2, Plan("single_copy", True)),
    Row("a pair, past 4 MiB, pieces on: its lane in pieces", "broadcast", 4 * M + 4, 2, Plan("pieces", True), PIECES),
    Row("a pair, 64 MiB: still pieces", "broadcast", 64 * M, 2, Plan("pieces", True), PIECES),
    Row("a pair, past 64 MiB: single copy", "broadcast", 64 * M + 4, 2, Plan("single_copy", True), PIECES),
    Row("a pair, lane off: no pieces", "broadcast", 8 * M, 2, Plan("single_copy", True), dataclasses.replace(PIECES, lane_max=0)),
    Row("3 ranks, 8 MiB: no pieces", "broadcast", 8 * M, 3, Plan("single_copy", True), PIECES),
    Row("a pair, lane off: single copy", "broadcast", 2 * M, 2, Plan("single_copy", True), NO_LANE),
    Row("3 ranks, 2 MiB: not the pair's lane", "broadcast", 2 * M, 3, Plan("single_copy", True)),
    Row("256 KiB, 4 ranks: still the lane", "broadcast", 256 * K, 4, Plan("lane", True)),
    Row("2 MiB, 4 ranks: single copy", "broadcast", 2 * M, 4, Plan("single_copy", True)),
    Row("single copy off: the socket, out of line", "broadcast", 4 * M, 2, Plan("socket", False), NO_CMA_PAIR),
    Row("single copy off, a pair, 4 MiB: the lane", "broadcast", 4 * M, 2, Plan("lane", True), NO_CMA),
    Row("no lane, single copy on: single copy", "broadcast", 4 * M, 2, Plan("single_copy", True), NO_LANE),
    Row("no lane, under single copy: socket, out of line", "broadcast", 64 * K, 2, Plan("socket", False), NO_LANE),
    Row(
        "lane before single copy where both would apply",
        "broadcast",
        8 * K,
        2,
        Plan("lane", True),
        Thresholds(broadcast_shm_min=0),
    ),
    Row(
        "single copy allowed but within the lane's sizes, 4 ranks: the lane",
        "broadcast",
        8,
        4,
        Plan("lane", True),
        Thresholds(broadcast_shm_min=0, cma_wide_min=0),
    ),
    # all_reduce
    Row("small: the lane", "all_reduce", 4, 2, Plan("lane", True)),
    Row("small, 4 ranks: the lane too (where the group has one)", "all_reduce", 4, 4, Plan("lane", True)),
    Row("empty: the socket", "all_reduce", 0, 2, Plan("socket", False)),
    Row("256 KiB: still the lane", "all_reduce", 256 * K, 2, Plan("lane", True)),
    Row("1 MiB, the lane's slot: still the lane", "all_reduce", M, 2, Plan("lane", True)),
    Row("past the lane's slot: the halves", "all_reduce", M + 4, 2, Plan("halves", True), NO_PAIR),
    Row("4 MiB: single copy", "all_reduce", 4 * M, 2, Plan("single_copy", True), NO_PAIR),
    Row("a pair, 4 MiB: the lane (its slots hold 4 MiB)", "all_reduce", 4 * M, 2, Plan("lane", True)),
    Row("a pair, past 4 MiB: single copy (pieces off by default)", "all_reduce", 4 * M + 4, 2, Plan("single_copy", True)),
    Row("a pair, past 4 MiB, pieces on: its lane in pieces", "all_reduce", 4 * M + 4, 2, Plan("pieces", True), PIECES),
    Row("a pair, past 64 MiB: single copy", "all_reduce", 64 * M + 4, 2, Plan("single_copy", True), PIECES),
    Row("a pair, piece 0: single copy", "all_reduce", 8 * M, 2, Plan("single_copy", True), dataclasses.replace(PIECES, pair_piece=0)),
    Row("4 ranks, 8 MiB: single copy", "all_reduce", 8 * M, 4, Plan("single_copy", True), PIECES),
    Row("4 ranks, 2 MiB: the halves", "all_reduce", 2 * M, 4, Plan("halves", True)),
    Row("a pair, lane off: the halves", "all_reduce", 2 * M, 2, Plan("halves", True), NO_LANE),
    Row("spread over hosts, 64 KiB: the hierarchy, out of line", "all_reduce", 64 * K, 4, Plan("hier", False), spread=True),
    Row("spread over hosts, 16 MiB: the hierarchy", "all_reduce", 16 * M, 4, Plan("hier", False), spread=True),
    Row("spread, under the hierarchy's size: as on one host", "all_reduce", 4 * K, 4, Plan("lane", True), spread=True),
    Row("spread, hierarchy at every size", "all_reduce", 4, 4, Plan("hier", False), Thresholds(hier_min=0), spread=True),
    Row("spread, hierarchy off", "all_reduce", 16 * M, 4, Plan("single_copy", True), Thresholds(hier_min=-1), spread=True),
    Row("spread, small broadcast: its own rules", "broadcast", 4, 4, Plan("lane", True), spread=True),
    Row("spread, barrier: the hierarchy", "barrier", 0, 4, Plan("hier", False), spread=True),
    Row("spread, barrier, hierarchy off: the lane", "barrier", 0, 4, Plan("lane", True), Thresholds(hier_min=-1), spread=True),
    Row("spread, broadcast of 1 MiB: the hierarchy", "broadcast", M, 4, Plan("hier", False), spread=True),
    Row("spread, reduce of 1 MiB: the hierarchy", "reduce", M, 4, Plan("hier", False), spread=True),
    Row("spread, reduce, hierarchy off: its own rules", "reduce", M, 4, Plan("lane", True), Thresholds(hier_min=-1), spread=True),
    Row("spread, all_gather of 1 MiB: the hierarchy", "all_gather", M, 4, Plan("hier", False), spread=True, part=256 * K),
    Row("spread, reduce_scatter of 1 MiB: the hierarchy", "reduce_scatter", M, 4, Plan("hier", False), spread=True),
    Row("spread, small reduce_scatter: its lane", "reduce_scatter", 4 * K, 4, Plan("lane", True), spread=True),
    Row(
        "shared memory off, lane off: the socket",
        "all_reduce",
        4 * M,
        2,
        Plan("socket", False),
        Thresholds(allreduce_shm_min=-1, lane_max=0),
    ),
    # reduce
    Row("small, 2 ranks: the lane", "reduce", 64, 2, Plan("lane", True)),
    Row("small, 4 ranks: the lane too", "reduce", 64, 4, Plan("lane", True)),
    Row("256 KiB, 2 ranks: still the lane (it comes first)", "reduce", 256 * K, 2, Plan("lane", True)),
    Row("1 MiB, 4 ranks: still the lane", "reduce", M, 4, Plan("lane", True)),
    Row("past the lane, 2 ranks: single copy", "reduce", M + 4, 2, Plan("single_copy", True)),
    Row("past the lane, 4 ranks: socket, in line", "reduce", M + 4, 4, Plan("socket", True)),
    Row("2 MiB, 4 ranks: single copy", "reduce", 2 * M, 4, Plan("single_copy", True)),
    Row("single copy off: socket, out of line", "reduce", M + 4, 2, Plan("socket", False), NO_CMA),
    # all_gather (nbytes: the total; part: the largest part)
    Row("small parts: the lane", "all_gather", 8, 2, Plan("lane", True), part=4),
    Row("256 KiB in all, 4 ranks: the lane", "all_gather", 256 * K, 4, Plan("lane", True), part=64 * K),
    Row("2 MiB in all, 2 ranks: the lane", "all_gather", 2 * M, 2, Plan("lane", True), part=M),
    Row("3 MiB in all, 3 ranks: the lane", "all_gather", 3 * M, 3, Plan("lane", True), part=M),
    Row("4 MiB in all, 2 ranks: the pair's lane (2 MiB parts)", "all_gather", 4 * M, 2, Plan("lane", True), part=2 * M),
    Row("past 4 MiB in all, 2 ranks: single copy", "all_gather", 4 * M + 8, 2, Plan("single_copy", True), part=2 * M + 4),
    Row("4 MiB in all, 2 ranks, the pair's lane off: single copy", "all_gather", 4 * M, 2, Plan("single_copy", True), NO_PAIR, part=2 * M),
    Row("4 MiB in all, 3 ranks: not the pair's lane", "all_gather", 4 * M, 3, Plan("single_copy", True), part=2 * M),
    Row("a pair, 16 MiB in all: single copy (no pieces: measured slower)", "all_gather", 16 * M, 2, Plan("single_copy", True), part=8 * M),
    Row("a part past the lane, 2 ranks: single copy", "all_gather", 3 * M, 2, Plan("single_copy", True), NO_PAIR, part=2 * M),
    Row("a part past the lane, 3 ranks (past cma_wide_min): single copy", "all_gather", 3 * M, 3, Plan("single_copy", True), part=2 * M),
    Row(
        "a part past a smaller lane, 4 ranks: the halves",
        "all_gather",
        M,
        4,
        Plan("halves", True),
        Thresholds(lane_max=128 * K),
        part=256 * K,
    ),
    Row(
        "a part past the lane, shared memory off: the socket",
        "all_gather",
        3 * M,
        2,
        Plan("socket", False),
        Thresholds(allgather_shm_min=-1, pair_lane_max=0),
        part=2 * M,
    ),
    Row(
        "halves from 256 KiB, 4 ranks: the halves",
        "all_gather",
        256 * K,
        4,
        Plan("halves", True),
        Thresholds(allgather_shm_min=256 * K),
        part=64 * K,
    ),
    Row("4 MiB in all, 4 ranks (from cma_wide_min): single copy", "all_gather", 4 * M, 4, Plan("single_copy", True), part=M),
    Row("lane off, small: the socket", "all_gather", 8, 2, Plan("socket", False), NO_LANE, part=4),
    # gather / scatter
    Row("gather, small, 2 ranks: the lane", "gather", 64, 2, Plan("lane", True)),
    Row("gather, small, 4 ranks: the lane", "gather", 64, 4, Plan("lane", True)),
    Row("gather, at its lane's limit: the lane", "gather", 64 * K, 2, Plan("lane", True)),
    Row("gather, sizes that differ on purpose (part 1): never the lane", "gather", 64, 2, Plan("single_copy", True), part=1),
    Row("gather, lane off for gather: single copy", "gather", 64, 2, Plan("single_copy", True), Thresholds(gather_lane_max=0)),
    Row("gather, past its lane, 2 ranks: single copy", "gather", 64 * K + 1, 2, Plan("single_copy", True)),
    Row("gather, 2 ranks, far past its lane: single copy", "gather", M, 2, Plan("single_copy", True)),
    Row("gather, past its lane, 4 ranks: the socket", "gather", 128 * K, 4, Plan("socket", False)),
    Row(
        "gather, past its lane, under its threshold: socket, in line",
        "gather",
        128 * K,
        2,
        Plan("socket", True),
        Thresholds(gather_cma_min=M),
    ),
    Row("gather, lane and single copy off: the socket", "gather", 64, 2, Plan("socket", False), Thresholds(lane_max=0, gather_cma_min=-1)),
    Row("scatter, small: the lane", "scatter", 64, 4, Plan("lane", True)),
    Row("scatter, 4 ranks of 64 KiB: the table and parts fit the lane", "scatter", 64 * K, 4, Plan("lane", True)),
    Row("scatter, 16 ranks of 64 KiB: the table and parts do not fit the lane, the socket", "scatter", 64 * K, 16, Plan("socket", False)),
    Row("scatter, 2 ranks of 64 KiB: the lane", "scatter", 64 * K, 2, Plan("lane", True)),
    Row("scatter, part 1: single copy", "scatter", 64, 2, Plan("single_copy", True), part=1),
    # reduce_scatter
    Row("reduce_scatter, small: the lane", "reduce_scatter", 64, 2, Plan("lane", True)),
    Row("reduce_scatter, 1 MiB: still the lane", "reduce_scatter", M, 2, Plan("lane", True)),
    Row("reduce_scatter, past the lane: single copy", "reduce_scatter", M + 8, 2, Plan("single_copy", True), NO_PAIR),
    Row("reduce_scatter, a pair, 4 MiB: the lane", "reduce_scatter", 4 * M, 2, Plan("lane", True)),
    Row("reduce_scatter, a pair, past 4 MiB: single copy", "reduce_scatter", 4 * M + 8, 2, Plan("single_copy", True)),
    Row("reduce_scatter, a pair, past 4 MiB, pieces on: its lane in pieces", "reduce_scatter", 4 * M + 8, 2, Plan("pieces", True), PIECES),
    Row("reduce_scatter, a pair, past 64 MiB: single copy", "reduce_scatter", 64 * M + 8, 2, Plan("single_copy", True), PIECES),
    Row("reduce_scatter, 4 ranks, 2 MiB: single copy", "reduce_scatter", 2 * M, 4, Plan("single_copy", True)),
    Row("reduce_scatter, lane off: single copy", "reduce_scatter", 64, 2, Plan("single_copy", True), NO_LANE),
    Row("reduce_scatter, big: single copy", "reduce_scatter", 4 * M, 4, Plan("single_copy", True)),
    Row("reduce_scatter, empty: the socket", "reduce_scatter", 0, 2, Plan("socket", False)),
    Row(
        "reduce_scatter, single copy from 2 MiB, 1.5 MiB: socket, in line",
        "reduce_scatter",
        M + 512 * K,
        2,
        Plan("socket", True),
        Thresholds(reduce_scatter_cma_min=2 * M, pair_lane_max=0),
    ),
    Row(
        "reduce_scatter, single copy from 1 MiB, 128 KiB (past its lane, within the others'): socket, in line",
        "reduce_scatter",
        128 * K,
        2,
        Plan("socket", True),
        Thresholds(reduce_scatter_cma_min=M, reduce_scatter_lane_max=64 * K, pair_lane_max=0),
    ),
    Row("reduce_scatter, single copy off: the socket", "reduce_scatter", 2 * M, 2, Plan("socket", False), NO_CMA_PAIR),
    # all_to_all (nbytes: this rank's own; part: the number of parts)
    Row("all_to_all: single copy (inline where the parts fit the lane)", "all_to_all", 64, 4, Plan("single_copy", True), part=4),
    Row("all_to_all, big: single copy", "all_to_all", M, 4, Plan("single_copy", True), part=4),
    Row("all_to_all, single copy off: the socket", "all_to_all", 64, 4, Plan("socket", False), NO_CMA, part=4),
    # barrier
    Row("barrier: the lane", "barrier", 0, 4, Plan("lane", True)),
    Row("barrier, lane off: the socket", "barrier", 0, 4, Plan("socket", False), NO_LANE),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.why for r in ROWS])
def test_plan(row: Row) -> None:
    assert plan(row.op, row.nbytes, row.ranks, row.th, part=row.part, spread=row.spread) == row.want


def test_every_op_has_a_row() -> None:
    assert {r.op for r in ROWS} == set(OPS)


def test_an_unknown_op_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown op 'allreduce'"):
        plan("allreduce", 4, 2, D)


def test_latency_bound_never_takes_shared_memory() -> None:
    th = Thresholds.latency_bound()
    for op in OPS:
        for n in (0, 4, 64 * K, 4 * M, 64 * M):
            for ranks in (2, 4):
                assert plan(op, n, ranks, th, part=n or 1) == Plan("socket", False), (op, n, ranks)


def test_c10d_makes_no_path_decision() -> None:
    """c10d/collectives.py asks the plan; it reads no threshold itself (it only hands the table to
    the socket's algorithms as ``thresholds=``)."""
    src = Path(__file__).resolve().parent.parent / "aiodist" / "c10d" / "collectives.py"
    tree = ast.parse(src.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "th") or (isinstance(v, ast.Attribute) and v.attr == "thresholds"):
                bad.append(f"line {node.lineno}: .{node.attr}")
    assert not bad, "c10d reads thresholds itself (a path decision belongs in aiodist.algorithms.plan): " + ", ".join(bad)


# -- where the rules come from: the defaults, a rules file, the variables, a group's pg_options --


def test_a_rules_file_then_the_variables(tmp_path: Path) -> None:
    import json

    from aiodist.algorithms.thresholds import from_env

    f = tmp_path / "rules.json"
    rules = {"lane_max": "64K", "allreduce_shm_min": 1048576, "broadcast_lane_max": "4K", "pair_lane_max": "8M"}
    f.write_text(json.dumps(rules))
    th = from_env({"AIODIST_ALGO_RULES": str(f), "AIODIST_ALGO_LANE_MAX": "32K", "AIODIST_ALGO_PAIR_LANE_MAX": "0"})
    assert (th.lane_max, th.allreduce_shm_min, th.broadcast_lane_max, th.pair_lane_max) == (32 * K, M, 4 * K, 0)  # the variables win
    assert plan("all_reduce", 128 * K, 2, th) == Plan("socket", False)  # past the lane, under the halves


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"lane_mx": 0}', "unknown threshold 'lane_mx'"),
        ('{"lane_max": true}', "lane_max=True: expected a byte count"),
        ('{"lane_max": "lots"}', "expected a byte count such as 65536"),
        ("[1, 2]", "expected an object of threshold names"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_rules_file_names_itself(tmp_path: Path, text: str, match: str) -> None:
    from aiodist.algorithms.thresholds import from_env

    f = tmp_path / "rules.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        from_env({"AIODIST_ALGO_RULES": str(f)})
    assert "AIODIST_ALGO_RULES=" in str(e.value)


def test_a_missing_rules_file_is_named(tmp_path: Path) -> None:
    from aiodist.algorithms.thresholds import from_env

    with pytest.raises(ValueError, match=r"AIODIST_ALGO_RULES=.*nope\.json: cannot read it"):
        from_env({"AIODIST_ALGO_RULES": str(tmp_path / "nope.json")})


async def test_a_group_takes_its_rules_from_pg_options() -> None:
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> tuple[int, int, int, float]:
        by_map = await dist.new_group([0, 1], pg_options={"lane_max": 0, "allreduce_shm_min": "1K"})
        by_table = await dist.new_group([0, 1], pg_options=Thresholds.latency_bound())
        plain = await dist.new_group([0, 1])
        x = np.full(1024, rank + 1.0, np.float32)
        await dist.all_reduce(x, group=by_map)  # 4 KiB: the halves under this group's rules
        await dist.all_reduce(x, group=by_table)
        return by_map.thresholds.lane_max, by_map.thresholds.allreduce_shm_min, plain.thresholds.lane_max, float(x[0])

    for lane_max, shm_min, plain_lane, value in await run_world(2, fn):
        assert (lane_max, shm_min, plain_lane) == (0, 1024, M)
        assert value == 6.0  # (1 + 2), then (3 + 3)


async def test_bad_pg_options_rules_are_refused_at_the_group() -> None:
    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> str:
        with pytest.raises(ValueError) as e:
            await dist.new_group([0, 1], pg_options={"lane": 0})
        return str(e.value)

    for msg in await run_world(2, fn):
        assert "pg_options: unknown threshold 'lane'" in msg


async def test_bad_rules_at_init_are_refused_before_a_backend_is_made() -> None:
    import aiodist as dist
    from aiodist.c10d.world import World, use_world

    with use_world(World("bad rules")) as w:
        with pytest.raises(ValueError, match="pg_options: unknown threshold 'nope'"):
            await dist.init_process_group("gloo", store=dist.HashStore(timeout=5), rank=0, world_size=1, pg_options={"nope": 1})
        assert w.backend is None and w.default_pg is None
