"""Shared memory between ranks on one host (aiodist.shm), in real processes (env://, one per rank).

Each world runs the same ops twice, on the default group (shared memory from 0 bytes) and on a
second group of the same ranks made with shared memory off (the socket path): results must be
the same bits on every rank, and exact sums/extrema (integers, integer-valued floats) must equal
the socket path's. Segments are 1 MiB (512 KiB rounds), so the big payloads go in many rounds;
sizes are odd, so slices and rounds are uneven. Plus: shared memory off on one rank sends the
whole group to the socket path and says so at INFO; no memfd stays mapped or open after
destroy_process_group (memfds have no name in /dev/shm: the process's maps and fds are where
a leak would show).

The rest runs in one process (``run_world`` over the socket backend: each rank has its own
SharedMemory, and the fds pass over the same abstract sockets): the ticket line with several
ops in flight, groups in opposite orders, an op that never runs, a destroyed group's segments,
and the agreement's fallbacks.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.memfds import memfds
from helpers.rank_procs import run_ranks

import aiodist as dist
from aiodist.c10d import process_group
from aiodist.errors import DistBackendError, DistStoreError
from aiodist.shm import SharedMemory, _cma
from aiodist.shm import _manager as shm_manager
from aiodist.shm._manager import _Turns
from aiodist.shm._segment import fetch
from aiodist.store import HashStore
from aiodist.testing import run_world
from aiodist.testing.ports import free_port

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
START_S = 60.0  # 4 interpreters importing numpy on a loaded 2-core machine, plus the ops

WORKER = ROOT / "tests" / "helpers" / "shm_compare_rank.py"  # RULES_JSON: every op on a shared-memory and a socket-only group


#: the default group's path rules in every rank (its init_process_group's pg_options): shared
#: memory from 0 bytes, single copy for reduce and scatter at every size, in groups of any size
#: (a pair's lane no further than a wider group's)
WORKER_RULES = {
    "allreduce_shm_min": 0,
    "allgather_shm_min": 0,
    "reduce_cma_min": 0,
    "cma_wide_min": 0,
    "scatter_cma_min": 0,
    "pair_lane_max": 0,
}


def _world(n: int, extra: dict[int, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    port = str(free_port())
    envs = []
    for r in range(n):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(n), AIODIST_SHM_BYTES="1M")
        env.update((extra or {}).get(r, {}))
        envs.append(env)
    return run_ranks([[sys.executable, str(WORKER), json.dumps(WORKER_RULES)]] * n, envs, START_S)


def _cma_between_processes() -> bool:
    """Whether this process can read a child's memory (what the ranks' agreement finds out)."""
    if _cma.record() is None:
        return False
    code = "import json, sys; from aiodist.shm import _cma; print(json.dumps(_cma.record()), flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout is not None
        rec = json.loads(child.stdout.readline())
        return rec is not None and _cma.readable(child.pid, rec)
    finally:
        child.communicate("", timeout=30)


@pytest.mark.subprocess
@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_path_matches_the_socket_path(n: int) -> None:
    res = _world(n)
    cma = _cma_between_processes()
    for r, out in enumerate(res):
        assert out["shm"]["groups"] == [0], f"rank {r}: the default group did not use shared memory: {out['shm']}"
        # the big broadcasts, reduces, the reduce_scatter, all_to_all and the two all_gathers
        # (cma_wide_min 0 here) took the single-copy path (process_vm_readv) where the kernel
        # lets one process read another here; the small gather and scatter, the lane
        if cma:
            assert out["shm"]["cma_groups"] == [0] and out["shm"]["cma_ops"] == 2 * n + 4, f"rank {r}: {out['shm']}"
        else:
            assert out["shm"]["cma_groups"] == [] and out["shm"]["cma_ops"] == 0, f"rank {r}: {out['shm']}"
        assert all(out["same"].values()), f"rank {r}: shared memory and socket results differ: {out['same']}"
        assert out["digests"] == res[0]["digests"], f"rank {r}'s results are not rank 0's bits"
        assert out["during"][0] >= n, f"rank {r}: expected {n} memfd mappings during the run, saw {out['during']}"
        assert out["after"] == [0, 0], f"rank {r}: memfd mappings/fds left after destroy_process_group: {out['after']}"


@pytest.mark.subprocess
def test_single_copy_off_on_one_rank_keeps_shared_memory_with_two_copies() -> None:
    """AIODIST_SHM_CMA=0 on one rank: the group votes single copy off, and its all_gathers go
    through the segments (two copies) with the same results."""
    res = _world(2, {1: {"AIODIST_SHM_CMA": "0"}})
    for out in res:
        assert out["shm"]["groups"] == [0] and out["shm"]["cma_groups"] == [] and out["shm"]["cma_ops"] == 0, out["shm"]
        assert all(out["same"].values()), out["same"]
        assert out["digests"] == res[0]["digests"]
    assert res[0]["shm"]["cma"] and not res[1]["shm"]["cma"]


@pytest.mark.subprocess
def test_shared_memory_off_on_one_rank_uses_the_socket_and_says_so() -> None:
    res = _world(2, {1: {"AIODIST_SHM_BYTES": "0"}})
    for r, out in enumerate(res):
        assert out["shm"]["groups"] == [], f"rank {r}: a group used shared memory with it off on rank 1: {out['shm']}"
        assert all(out["same"].values()), out["same"]
        assert out["digests"] == res[0]["digests"]
        assert out["during"] == [0, 0] and out["after"] == [0, 0], (out["during"], out["after"])
    assert any("shared memory off (AIODIST_SHM_BYTES=0)" in m for m in res[1]["logs"]), res[1]["logs"]
    assert any("group 0 does not use shared memory" in m for m in res[0]["logs"]), res[0]["logs"]


# -- in one process: run_world's ranks over the socket backend, each with its own SharedMemory ---

IN_PROCESS_ENV = {"AIODIST_SHM_BYTES": "1M"}
#: the path rules of every group the tests with ``shm_env`` make (run_world's and new_group's
#: pg_options): all_reduce and all_gather through shared memory from 0 bytes (a pair's lane no
#: further than a wider group's: the halves' rounds are what these ops in flight exercise)
RULES = {"allreduce_shm_min": 0, "allgather_shm_min": 0, "pair_lane_max": 0}
BIG = 300_007  # 1.2 MB of float32: three 512 KiB rounds, so ops in flight overlap round by round


@pytest.fixture
def shm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in IN_PROCESS_ENV.items():
        monkeypatch.setenv(k, v)
    # segments an earlier test's garbage still holds (a timed-out op's exception keeps its frames
    # in a cycle until the collector runs) go now: a test's own must go at destroy, with no collection
    gc.collect()


def _shm() -> SharedMemory:
    shm = getattr(getattr(dist.group.WORLD, "backend", None), "shm", None)
    assert isinstance(shm, SharedMemory)
    return shm


_memfds = memfds  # memfd mappings and fds of aiodist segments in this process (every rank's, here)


def _turns(group: Any) -> Any:
    return next(t for k, t in _shm()._turns.items() if k[0] == group.group_id)


async def test_ops_in_flight_take_their_turns_in_issue_order(shm_env: None) -> None:
    """Three async shared-memory all_reduces (each of several rounds) and a socket-path broadcast
    in flight at once, waited for in reverse: each gets its own sum."""

    async def fn(rank: int) -> list[np.ndarray]:
        xs = [np.full(BIG + i, rank + 1 + 10 * i, np.float32) for i in range(3)]
        # 40 KB: over the latency lane's 16 KiB and under broadcast_shm_min, so a socket-path
        # broadcast, which still takes its turn in line (it says which op it is in: a desync check)
        y = np.full(5000, rank + 7.0)
        works = [await dist.all_reduce(x, async_op=True) for x in xs[:2]]
        works.append(await dist.broadcast(y, src=1, async_op=True))
        works.append(await dist.all_reduce(xs[2], async_op=True))
        for w in reversed(works):
            assert await w.wait(timeout=20)
        t = _turns(dist.group.WORLD)
        assert (t.serving, t.issued, t.waiters) == (4, 4, {}), (t.serving, t.issued)
        return [*xs, y]

    for out in await run_world(2, fn, "gloo", timeout=30, pg_options=RULES):
        for i in range(3):
            assert np.array_equal(out[i], np.full(BIG + i, 3 + 20 * i, np.float32)), (i, out[i][:4])
        assert np.array_equal(out[3], np.full(5000, 8.0))
    assert _memfds() == (0, 0)


async def test_two_groups_of_the_same_ranks_issued_in_opposite_orders(shm_env: None) -> None:
    """Each group has its own segments and line, so rank 0 issuing each op of group 0 before
    the one of group 1 and rank 1 the other way round neither deadlocks nor mixes their data."""

    async def fn(rank: int) -> list[np.ndarray]:
        groups = [await dist.new_group([0, 1], pg_options=RULES), await dist.new_group([0, 1], pg_options=RULES)]
        xs = {(g, i): np.full(BIG, (rank + 1) * (1 + 2 * g + i), np.float32) for g in range(2) for i in range(2)}
        # the same order within a group (as torch requires), the opposite across the groups
        order = sorted(xs, key=lambda k: (k[1], k[0] if rank == 0 else -k[0]))
        works = [await dist.all_reduce(xs[k], group=groups[k[0]], async_op=True) for k in order]
        for w in works:
            assert await w.wait(timeout=20)
        assert sorted(_shm().stats()["groups"]) == sorted(g.group_id for g in groups)
        return [xs[k] for k in sorted(xs)]

    for out in await run_world(2, fn, "gloo", timeout=30, pg_options=RULES):
        for (g, i), x in zip(sorted((g, i) for g in range(2) for i in range(2)), out, strict=True):
            assert np.array_equal(x, np.full(BIG, 3 * (1 + 2 * g + i), np.float32)), (g, i, x[:4])


async def test_an_op_whose_body_never_runs_passes_its_turn_on(shm_env: None) -> None:
    """Rank 1 issues shared-memory ops on a group rank 0 never uses: the first waits in its
    agreement for rank 0; two more are issued and the group aborted in the same step, so their
    bodies never start; one more is refused at issue. All fail, and every ticket is passed on
    (the first by its body, the others by their Works), none left waiting."""

    async def fn(rank: int) -> tuple[int, int, int] | None:
        sub = await dist.new_group([0, 1], pg_options=RULES)
        if rank == 0:
            return None
        works = [await dist.all_reduce(np.ones(BIG, np.float32), group=sub, async_op=True)]
        await asyncio.sleep(0.05)
        works += [await dist.all_reduce(np.ones(BIG, np.float32), group=sub, async_op=True) for _ in range(2)]
        sub.abort("aborted by the test")
        with pytest.raises(dist.DistError):
            await dist.all_reduce(np.ones(BIG, np.float32), group=sub)
        for w in works:
            with pytest.raises(dist.DistError):
                await w.wait(timeout=10)
        t = _turns(sub)
        for _ in range(500):  # the cancelled first body unwinds over a few loop steps (5 s at most)
            if t.serving == t.issued:
                break
            await asyncio.sleep(0.01)
        return t.serving, t.issued, len(t.waiters)

    assert (await run_world(2, fn, "gloo", timeout=30, pg_options=RULES))[1] == (4, 4, 0)


def test_the_line_skips_tickets_passed_on_before_their_turn() -> None:
    """The pure line: ticket 1 passed on early (its op failed) is skipped once 0 passes it on."""
    t = _Turns()
    loop = asyncio.new_event_loop()
    try:
        t.waiters[2] = w = loop.create_future()
        t.issued = 3
        t.release(1)
        assert t.serving == 0 and not w.done()
        t.release(0)
        assert t.serving == 2 and w.done() and t.released == set()
    finally:
        loop.close()


async def test_a_destroyed_group_releases_its_segments(shm_env: None) -> None:
    """Groups made, used and destroyed in a loop leave no segment behind: only the default
    group's stay mapped (each rank's own and its peer's, both in this one process)."""

    async def fn(rank: int) -> list[tuple[int, int]]:
        x = np.ones(BIG, np.float32)
        await dist.all_reduce(x)
        seen = []
        for _ in range(4):
            sub = await dist.new_group([0, 1], pg_options=RULES)
            await dist.all_reduce(x, group=sub)
            await dist.destroy_process_group(sub)
            await dist.barrier()
            seen.append(_memfds())  # both ranks are between these barriers: neither changes a thing
            await dist.barrier()
        st = _shm().stats()
        assert (st["groups"], st["own_segments"], st["mapped_segments"]) == ([0], 1, 1), st
        return seen

    for seen in await run_world(2, fn, "gloo", timeout=30, pg_options=RULES):
        # 2 ranks x (own + the peer's) mapped; fds: each own one, and mmap's duplicate of each mapping's
        assert all(s == (4, 6) for s in seen), seen
    assert _memfds() == (0, 0)


async def test_a_peer_gets_no_segment_for_a_group_this_rank_never_reached_or_destroyed(
    shm_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fd server makes a segment only for a group this rank has an op of in line (a fetch
    for another waits for that, here 0.3 s, then is refused) and none for a destroyed group."""
    monkeypatch.setattr(shm_manager, "_SETUP_S", 0.3)

    async def fn(rank: int) -> dict[str, str] | None:
        sub = await dist.new_group([0, 1], pg_options=RULES)
        await dist.all_reduce(np.ones(4, np.float32), group=sub)
        await dist.destroy_process_group(sub)
        await dist.all_reduce(np.ones(4, np.float32))
        await dist.barrier()
        if rank == 1:
            await dist.barrier()
            return None
        name = bytes.fromhex((await _shm()._record(1))["name"]).decode()
        said = {}
        for what, group in (("never made", 12345), ("destroyed", sub.group_id), ("default", 0)):
            try:
                (await fetch(name, _shm().token, group)).close()
            except ValueError as exc:
                said[what] = str(exc)
            else:
                said[what] = "served"
        await dist.barrier()
        return said

    said = (await run_world(2, fn, "gloo", timeout=30, pg_options=RULES))[0]
    assert said == {
        "never made": "no shared memory for group 12345 on this rank",
        "destroyed": "no shared memory for group 1 on this rank",
        "default": "served",
    }, said


async def test_an_error_in_the_agreement_sends_the_group_to_the_socket_path(shm_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store error reading a peer's record on rank 0 (not an OSError) and a garbage record on
    rank 1 (a TypeError decoding it): each votes for the socket path, the ops still succeed,
    and the segments made meanwhile are closed at once."""
    real = SharedMemory._record

    async def record(self: SharedMemory, rank: int) -> dict[str, Any]:
        if self.rank == 0:
            raise DistStoreError("the store broke (test)")
        rec = await real(self, rank)
        return {**rec, "name": 12}  # not a hex string

    monkeypatch.setattr(SharedMemory, "_record", record)
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            logs.append(r.getMessage())

    handler = Keep()
    shm_log = logging.getLogger("aiodist.shm")
    shm_log.addHandler(handler)
    old_level = shm_log.level
    shm_log.setLevel(logging.INFO)  # (setLevel, not the attribute: it clears the loggers' cached levels)

    async def fn(rank: int) -> tuple[np.ndarray, dict[str, Any]]:
        x = np.full(BIG, rank + 1.0, np.float32)
        await dist.all_reduce(x)
        await dist.all_reduce(x)
        return x, _shm().stats()

    try:
        res = await run_world(2, fn, "gloo", timeout=30, pg_options=RULES)
    finally:
        shm_log.removeHandler(handler)
        shm_log.setLevel(old_level)
    for x, st in res:
        assert np.array_equal(x, np.full(BIG, 6.0, np.float32))
        assert (st["groups"], st["own_segments"], st["mapped_segments"]) == ([], 0, 0), st
    assert any("rank 0: group 0 does not use shared memory (DistStoreError: the store broke (test))" in m for m in logs), logs
    assert any(m.startswith("rank 1: group 0 does not use shared memory (TypeError") for m in logs), logs
    assert _memfds() == (0, 0)


async def test_start_closes_its_fd_server_when_publishing_its_record_fails() -> None:
    class Broken(HashStore):
        async def set(self, key: str, value: Any) -> None:
            raise DistStoreError("the store broke (test)")

    with pytest.raises(DistStoreError):
        await SharedMemory.start(Broken(), 0, b"token", "host")
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "aiodist shm fd server"]


# -- all_gather's own part: in place, the list form's own entry, an input overlapping the output --


async def test_all_gather_in_place_and_with_an_input_overlapping_the_output(shm_env: None) -> None:
    """Through shared memory, in rounds (int64 parts of BIG: five rounds): an in-place
    all_gather_into_tensor (the input is the output's own slice, which is then only copied into
    the segment), the list form with ``tensor_list[rank] is tensor``, and an input that straddles
    the output's slices (rank r's input starts half a part into slice r): that input is read
    from a copy, or a round's output would overwrite bytes it has yet to send."""
    n = BIG

    def part(rank: int, salt: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64) * 3 + 1_000_000 * rank + salt

    async def fn(rank: int) -> list[np.ndarray]:
        inplace = np.full(2 * n, -1, np.int64)
        inplace[rank * n : (rank + 1) * n] = part(rank, 1)
        await dist.all_gather_into_tensor(inplace, inplace[rank * n : (rank + 1) * n])
        mine = part(rank, 2)
        lst = [mine if q == rank else np.full(n, -1, np.int64) for q in range(2)]
        await dist.all_gather(lst, mine)
        straddle = np.arange(2 * n + n // 2, dtype=np.int64) * 7 + 100 * rank
        inp = straddle[rank * n + n // 2 : (rank + 1) * n + n // 2]
        sent = inp.copy()
        await dist.all_gather_into_tensor(straddle[: 2 * n], inp)
        assert _shm().stats()["groups"] == [0]
        return [inplace, *lst, straddle[: 2 * n], sent]

    res = await run_world(2, fn, "gloo", timeout=30, pg_options=RULES)
    sent = [out[-1] for out in res]
    for r, (inplace, l0, l1, straddle, _) in enumerate(res):
        assert np.array_equal(inplace, np.concatenate([part(0, 1), part(1, 1)])), f"rank {r}: in place"
        assert np.array_equal(l0, part(0, 2)) and np.array_equal(l1, part(1, 2)), f"rank {r}: the list form"
        assert np.array_equal(straddle, np.concatenate(sent)), f"rank {r}: an input straddling the output's slices"


@pytest.mark.parametrize("n", [1000, 2 * 1024 * 1024 // 8], ids=["small", "2 MiB parts (the pair's lane)"])
async def test_a_lane_all_gather_copies_its_own_part_in_place_from_the_input_or_from_its_slot(shm_env: None, n: int) -> None:
    """Through the latency lane (default rules: small parts, and a pair's 2 MiB parts in its
    4 MiB slots), three calls each, so that the kept calls run in the issuing call and the first
    on the task path: an in-place all_gather_into_tensor (its own part is left as it is), the list
    form with ``tensor_list[rank] is tensor``, an input that straddles the output's slices (the
    peers' parts are copied first and overwrite half of it: the own part then comes from the
    rank's slot), and a plain one (the own part from the input, after the peers')."""

    def part(rank: int, salt: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64) * 3 + 1_000_000 * rank + salt

    async def fn(rank: int) -> list[Any]:
        got: list[Any] = []
        lane0 = _shm().stats()["lane_ops"]
        for k in range(3):
            inplace = np.full(2 * n, -1, np.int64)
            inplace[rank * n : (rank + 1) * n] = part(rank, k)
            await dist.all_gather_into_tensor(inplace, inplace[rank * n : (rank + 1) * n])
            mine = part(rank, 10 + k)
            lst = [mine if q == rank else np.full(n, -1, np.int64) for q in range(2)]
            await dist.all_gather(lst, mine)
            straddle = np.arange(2 * n + n // 2, dtype=np.int64) * 7 + 100 * rank + k
            inp = straddle[rank * n + n // 2 : (rank + 1) * n + n // 2]
            sent = inp.copy()
            await dist.all_gather_into_tensor(straddle[: 2 * n], inp)
            plain = np.full(2 * n, -1, np.int64)
            await dist.all_gather_into_tensor(plain, part(rank, 20 + k))
            got.append((inplace, lst, straddle[: 2 * n].copy(), sent, plain))
        stats = _shm().stats()
        return [got, stats["lane_ops"] - lane0, stats["cma_ops"]]

    res = await run_world(2, fn, "gloo", timeout=30)
    for r, (got, lane_ops, cma_ops) in enumerate(res):
        assert lane_ops == 12 and cma_ops == 0, f"rank {r}: {lane_ops} lane ops, {cma_ops} single-copy ops"
        for k, (inplace, lst, straddle, _, plain) in enumerate(got):
            assert np.array_equal(inplace, np.concatenate([part(0, k), part(1, k)])), f"rank {r}, call {k}: in place"
            assert np.array_equal(lst[0], part(0, 10 + k)) and np.array_equal(lst[1], part(1, 10 + k)), f"rank {r}, call {k}: list"
            sent = np.concatenate([res[q][0][k][3] for q in range(2)])
            assert np.array_equal(straddle, sent), f"rank {r}, call {k}: an input straddling the output's slices"
            assert np.array_equal(plain, np.concatenate([part(0, 20 + k), part(1, 20 + k)])), f"rank {r}, call {k}: plain"


async def test_a_pairs_all_reduce_gives_both_ranks_the_same_bits_in_rank_order(shm_env: None) -> None:
    """A pair's all_reduce folds its own part from its input (one lane op below 3 MiB, slices
    above): both ranks must still fold in rank order, rank 0's part first, on the task path
    (every first call), in the call (the calls after) and with one rank in each (in one
    process, rank 0's first call parks and rank 1's is done in its call). The order shows in
    the MIN and MAX of +0 and -0 (checked against rank order) and in which NaN's payload a SUM
    keeps (checked equal on both ranks); float32, and bfloat16 through torch where it is
    installed. Sizes: one lane op, and slices."""
    try:
        import torch
    except ImportError:
        torch = None

    def want(op: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return {dist.ReduceOp.MIN: np.minimum, dist.ReduceOp.MAX: np.maximum}[op](a, b)

    async def fn(rank: int) -> list[tuple[str, bytes]]:
        got = []
        for n in (16, 100_000, 800_003):  # the lane (one lane op, below 3 MiB in a pair), slices
            for call in range(3):
                for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                    x = np.full(n, -0.0 if rank else 0.0, np.float32)
                    await dist.all_reduce(x, op=op)
                    got.append((f"f32 {op} {n} {call}", x.tobytes()))
                nan = np.full(n, 0x7FC00001 + rank, np.uint32).view(np.float32)
                await dist.all_reduce(nan)
                got.append((f"f32 nan {n} {call}", nan.tobytes()))
                if torch is not None:
                    t = torch.full((n,), -0.0 if rank else 0.0, dtype=torch.bfloat16)
                    await dist.all_reduce(t, op=dist.ReduceOp.MIN)
                    got.append((f"bf16 min {n} {call}", t.view(torch.int16).numpy().tobytes()))
                    b = torch.from_numpy(np.full(n, 0x7FC1 + rank, np.int16)).view(torch.bfloat16)
                    await dist.all_reduce(b)
                    got.append((f"bf16 nan {n} {call}", b.view(torch.int16).numpy().tobytes()))
        return got

    r0, r1 = await run_world(2, fn, "gloo", timeout=60)
    for (case, a), (_, b) in zip(r0, r1, strict=True):
        assert a == b, f"{case}: the two ranks' bits differ"
        if case.startswith("f32") and "nan" not in case:  # (which NaN's payload a SUM keeps is numpy's loop's choice)
            op = dist.ReduceOp.MIN if "MIN" in case.split()[1] else dist.ReduceOp.MAX
            n = len(a) // 4
            assert a == want(op, np.full(n, 0.0, np.float32), np.full(n, -0.0, np.float32)).tobytes(), f"{case}: not rank order's zero"


async def test_an_op_done_in_its_call_lets_the_loop_run_within_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane all_reduce whose peer already waits completes in its issuing call (post, collect:
    ProcessGroup.issue_now) whether or not the loop ran lately; where no op of the group let the
    loop run within EAGER_S, the call lets it run once before it returns (a callback scheduled
    before the call has run by then), and otherwise it never passes through the loop."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")  # (the default thresholds: 4 B goes through the lane)
    monkeypatch.setattr(process_group, "EAGER_S", 0.5)  # a pause of the test's own process is not a stale group

    async def fn(rank: int) -> list[tuple[int, bool]]:
        x = np.ones(1, np.float32)
        for _ in range(3):  # the agreement, and the lane in use
            await dist.all_reduce(x)
        pg = dist.group.WORLD
        loop = asyncio.get_running_loop()
        got = []
        for stale in (False, True, False, True):
            ran: list[int] = []
            if rank == 1:
                await asyncio.sleep(0.01)  # rank 0 is in the lane by now, waiting for rank 1
                pg.ran = time.perf_counter() - (1.0 if stale else 0.0)
                loop.call_soon(ran.append, 1)
            before = pg.stats()["eager"]
            await dist.all_reduce(x)
            got.append((pg.stats()["eager"] - before, bool(ran)))
        assert x[0] == 2.0**7
        return got

    res = await run_world(2, fn, "gloo", timeout=30)
    assert res[1] == [(1, False), (1, True), (1, False), (1, True)], res


async def test_a_small_reduce_whose_peer_waits_is_done_in_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept small reduce (the lane) whose peer already waits completes in its issuing call,
    with the right result."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    monkeypatch.setattr(process_group, "EAGER_S", 0.5)

    async def fn(rank: int) -> int:
        for _ in range(3):  # the agreement, shared memory in use, and the kept call
            await dist.reduce(np.ones(4, np.float32), dst=0)
        pg = dist.group.WORLD
        if rank == 1:
            await asyncio.sleep(0.01)  # rank 0 is in the op by now, waiting for rank 1
            pg.ran = time.perf_counter()
        before = pg.stats()["eager"]
        x = np.arange(4, dtype=np.float32) + 10 * rank
        await dist.reduce(x, dst=0)
        assert rank == 1 or np.array_equal(x, 2 * np.arange(4, dtype=np.float32) + 10)
        return int(pg.stats()["eager"] - before)

    res = await run_world(2, fn, "gloo", timeout=30)
    assert res[1] == 1, res


async def test_ops_done_in_their_calls_change_nothing_but_where_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-call path (post, collect, or park: ProcessGroup.issue_now) is c10d's fast path:
    the same program of small ops gives the same outputs, Work states and flight-recorder
    entries with it (EAGER_S 0.5 s) as without it (no in-call path, and a negative budget: every
    op starts in a task); the ``eager`` count (ops done in their call) differs, and only it."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> tuple[list[Any], list[Any], int]:
        pg = dist.group.WORLD
        if process_group.EAGER_S < 0:
            pg.quick = False
        outs: list[Any] = []
        for i in range(12):
            if rank == 1 and i % 3 == 0:
                await asyncio.sleep(0.005)  # the peer waits first: an op can complete in its call
                pg.ran = time.perf_counter()
            x = np.full(2, float(rank + i), np.float32)
            w = await dist.all_reduce(x, async_op=True)
            await w
            y = np.arange(2, dtype=np.float32) + rank
            await dist.reduce(y, dst=0)
            z = np.empty(1, np.float32)
            await dist.reduce_scatter_tensor(z, np.arange(2, dtype=np.float32) + 10 * rank + i)
            a = np.full(3, rank + i + 0.5, np.float32)
            await dist.all_reduce(a, op=dist.ReduceOp.AVG)
            v = np.full(3, 3.0 * rank + i, np.float32)
            await dist.reduce(v, dst=1, op=dist.ReduceOp.AVG)
            gl = [np.empty((2, 2), np.int32) for _ in range(2)] if rank == i % 2 else None
            await dist.gather(np.full((2, 2), rank * 10 + i, np.int32), gl, dst=i % 2)
            sc = np.empty(3, np.float64)
            await dist.scatter(sc, [np.full(3, q + i + 0.5) for q in range(2)] if rank == 1 - i % 2 else None, src=1 - i % 2)
            aa = np.empty(4, np.float32)
            await dist.all_to_all_single(aa, np.arange(4, dtype=np.float32) + 10 * rank + i)
            big = np.arange(131_072 + i, dtype=np.float32) * (rank + 1) + i  # 512 KB: folded by slices
            await dist.all_reduce(big)
            got = (x, y, z, a, v, sc, aa, big[[0, 65_536, -1]]) if gl is None else (x, y, z, a, v, sc, aa, big[[0, 65_536, -1]], *gl)
            outs.append((*(t.tolist() for t in got), w.is_completed(), w.is_success()))
        entries = [(e["op"], e["seq"], e["kind"], e["state"], e["error"]) for e in pg.recorder.to_json()]
        return outs, entries, int(pg.stats()["eager"])

    seen = {}
    for name, budget in (("eager", 0.5), ("never-eager", -1.0)):
        monkeypatch.setattr(process_group, "EAGER_S", budget)
        res = await run_world(2, fn, "gloo", timeout=30)
        seen[name] = [(outs, entries) for outs, entries, _ in res]
        eager_ops = [n for _, _, n in res]
        assert (sum(eager_ops) > 0) if name == "eager" else eager_ops == [0, 0], (name, eager_ops)
    assert seen["eager"] == seen["never-eager"]


def _count_in_call(pg: Any) -> list[int]:
    """Count the ops of ``pg`` that its calls issued by the in-call path (``issue_now`` took
    them: done in the call, or parked): the count is the returned list's one item."""
    taken = [0]
    issue_now = pg.issue_now

    def counting(*args: Any) -> Any:
        got = issue_now(*args)
        taken[0] += got is not process_group.NOT_NOW
        return got

    pg.issue_now = counting
    return taken


async def test_torch_cpu_tensors_take_the_in_call_path_as_numpy_arrays_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept call on torch CPU tensors (a tensor that requires grad included, as torch's c10d
    takes it) posts and collects in its call as a numpy array's does: the same results, done
    in the call (``issue_now`` took it); a bfloat16 tensor, whose numpy view is another dtype,
    takes its route, with the right result too, and a non-contiguous output is refused as before."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    monkeypatch.setattr(process_group, "EAGER_S", 0.5)

    async def fn(rank: int) -> tuple[list[Any], int]:
        taken = _count_in_call(dist.group.WORLD)
        outs: list[Any] = []
        for _ in range(4):
            x = torch.full((2,), rank + 1.0)
            await dist.all_reduce(x)
            p = torch.nn.Parameter(torch.full((3,), rank + 2.0))
            await dist.all_reduce(p)
            b = torch.full((2,), float(rank))
            await dist.broadcast(b, src=1)
            r = torch.full((2,), rank + 1.0)
            await dist.reduce(r, dst=0)
            g = torch.empty(4)
            await dist.all_gather_into_tensor(g, torch.full((2,), float(rank)))
            z = torch.empty(1)
            await dist.reduce_scatter_tensor(z, torch.arange(2.0) + rank)
            gl = [torch.empty(2) for _ in range(2)] if rank == 0 else None
            await dist.gather(torch.full((2,), rank + 5.0), gl, dst=0)
            sc = torch.empty(2)
            await dist.scatter(sc, [torch.full((2,), q + 7.0) for q in range(2)] if rank == 1 else None, src=1)
            assert sc.tolist() == [rank + 7.0] * 2 and (gl is None or [t.tolist() for t in gl] == [[5.0] * 2, [6.0] * 2])
            aa = torch.empty(4)
            await dist.all_to_all_single(aa, torch.arange(4.0) + 10 * rank)
            assert aa.tolist() == [2.0 * rank, 2.0 * rank + 1, 10 + 2.0 * rank, 11 + 2.0 * rank]
            h = torch.ones(2, dtype=torch.bfloat16)
            await dist.all_reduce(h)
            with pytest.raises(ValueError, match="not contiguous"):  # refused as before, nothing issued
                await dist.all_reduce(torch.ones(2, 2)[:, 0])
            outs.append([t.tolist() for t in (x, p.detach(), b, r, g, z, h.float())])
        return outs, taken[0]

    res = await run_world(2, fn, "gloo", timeout=30)
    for rank, (outs, done_in_call) in enumerate(res):
        for got in outs:
            assert got[0] == [3.0, 3.0] and got[1] == [5.0] * 3 and got[2] == [1.0, 1.0]
            assert got[3] == ([3.0, 3.0] if rank == 0 else [rank + 1.0] * 2)
            assert got[4] == [0.0, 0.0, 1.0, 1.0] and got[5] == [1.0 + 2 * rank]
            assert got[6] == [2.0, 2.0]
        assert done_in_call >= 3 * 9, (rank, done_in_call)  # every call of the nine kinds once kept (the first is checked)


async def test_small_gather_scatter_and_all_to_all_are_done_in_their_calls_and_object_payloads_of_any_size_still_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept gather or scatter of one size everywhere posts and collects in its call, from any
    root, in a group of 3 (not only 2), and so does an all_to_all_single of even splits; the object collectives, whose payloads differ in size
    per rank on purpose (here one of 10 bytes and one of 300 KB, either side of the lane's
    limit), take one path on every rank and pass."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    monkeypatch.setattr(process_group, "EAGER_S", 0.5)

    async def fn(rank: int) -> tuple[int, list[Any]]:
        taken = _count_in_call(dist.group.WORLD)
        seen: list[Any] = []
        for i in range(9):
            root = i % 3
            gl = [np.empty(5, np.int64) for _ in range(3)] if rank == root else None
            await dist.gather(np.arange(5) + 10 * rank + i, gl, dst=root)
            if gl is not None:
                assert all(np.array_equal(gl[q], np.arange(5) + 10 * q + i) for q in range(3))
            sc = np.empty(4, np.float32)
            await dist.scatter(sc, [np.full(4, q * 3.0 + i, np.float32) for q in range(3)] if rank == root else None, src=root)
            assert np.all(sc == rank * 3.0 + i)
            aa = np.empty(6, np.int16)
            await dist.all_to_all_single(aa, (np.arange(6) + 10 * rank + i).astype(np.int16))
            assert aa.tolist() == [10 * q + i + 2 * rank + k for q in range(3) for k in range(2)]
        big = {"rank": rank, "blob": b"x" * (300_000 if rank == 1 else 10)}
        got: list[Any] = [None] * 3 if rank == 0 else []
        await dist.gather_object(big, got if rank == 0 else None, dst=0)
        seen.append([g["rank"] for g in got] if rank == 0 else None)
        out: list[Any] = [None]
        await dist.scatter_object_list(out, [b"y" * (300_000 if q == 2 else 10) for q in range(3)] if rank == 0 else None, src=0)
        seen.append(len(out[0]))
        return taken[0], seen

    res = await run_world(3, fn, "gloo", timeout=30)
    for rank, (done_in_call, seen) in enumerate(res):
        assert done_in_call == 12 + 8, (rank, done_in_call)  # 27 calls; the first of each kind and root is checked
        assert seen == ([[0, 1, 2]] if rank == 0 else [None]) + [300_000 if rank == 2 else 10], (rank, seen)


async def test_an_async_op_call_gives_its_work_in_its_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's form, ``work = dist.all_reduce(x, async_op=True)`` without ``await``, then
    ``work.wait()``: the handle has its Work at once whichever path the op takes, the in-call one
    (a group whose loop ran lately) or its route (a stale group: the op starts in a task, and
    the loop runs)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    monkeypatch.setattr(process_group, "EAGER_S", 0.5)

    async def fn(rank: int) -> list[float]:
        x = np.ones(1, np.float32)
        for _ in range(3):  # the agreement, and the kept call
            await dist.all_reduce(x)
        pg = dist.group.WORLD
        got = []
        for stale in (False, True, False):
            if rank == 1:
                await asyncio.sleep(0.01)  # rank 0 waits in the lane
            pg.ran = time.perf_counter() - (1.0 if stale else 0.0)
            x[0] = rank + 1.0
            handle = dist.all_reduce(x, async_op=True)
            fut = handle.get_future()  # no await: the Work is there
            await handle.wait()
            assert fut.done()
            got.append(float(x[0]))
        return got

    res = await run_world(2, fn, "gloo", timeout=30)
    assert res == [[3.0] * 3] * 2, res


async def test_a_kept_broadcast_with_a_root_of_another_type_is_refused_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's key holds the root as given: a bool or float root (``src=True``,
    ``src=1.0``) does not pass for the kept ``src=1``; the call's own check refuses it on every
    rank, nothing sent, and the group stays usable."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> float:
        x = np.full(2, float(rank), np.float32)
        for _ in range(3):  # the agreement, and the kept call
            await dist.broadcast(x, src=1)
        for bad in (True, 1.0):
            with pytest.raises(TypeError):
                await dist.broadcast(x, src=bad)  # type: ignore[arg-type]
        x[:] = rank + 5.0
        await dist.broadcast(x, src=1)
        return float(x[0])

    assert await run_world(2, fn, "gloo", timeout=30) == [6.0, 6.0]


async def test_an_error_out_of_an_in_call_op_breaks_the_group_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception out of the in-call exchange (a KeyboardInterrupt in the spin, say) may leave
    the op posted and its peers' parts unread: the group is broken (the two slots' reuse rule no
    longer holds), the peers are told, and later ops on either rank fail naming it."""
    from aiodist.backends import routes

    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    real = routes.lane_now
    armed = [False]

    def interrupted(g: Any, *args: Any) -> int:
        if armed[0] and g.me == 0:
            raise RuntimeError("interrupted in the spin")
        return real(g, *args)

    async def fn(rank: int) -> str:
        x = np.ones(1, np.float32)
        for _ in range(3):
            await dist.all_reduce(x)
        armed[0] = True
        try:
            if rank == 0:
                with pytest.raises(RuntimeError, match="interrupted in the spin"):
                    await dist.all_reduce(x)
            else:
                await asyncio.sleep(0.05)
            with pytest.raises(DistBackendError) as err:
                await dist.all_reduce(x)
            return str(err.value)
        finally:
            armed[0] = False

    monkeypatch.setattr(routes, "lane_now", interrupted)
    out = await run_world(2, fn, "gloo", timeout=30)
    assert all("interrupted in its issuing call" in m for m in out), out


async def test_a_pair_takes_its_lane_up_to_4_mib(shm_env: None) -> None:
    """A group of 2 (the world, or a pair in a wider world) has lane slots of 4 MiB
    (``_manager.lane_max``): all_reduce, broadcast and reduce_scatter_tensor up to
    ``pair_lane_max`` go through it (lane ops counted, no single-copy op), in place and at odd
    lengths, with the exact sums; a wider group's slots stay 1 MiB."""

    def ints(count: int, salt: int) -> np.ndarray:
        return np.random.default_rng(salt).integers(-1000, 1000, count).astype(np.float32)

    async def fn(rank: int) -> tuple[bool, int, int, list[int]]:
        n = dist.get_world_size()
        pair = await dist.new_group([0, n - 1])
        ok = True
        if rank in (0, n - 1):
            me = 0 if rank == 0 else 1
            m = (4 << 20) // 4 - 5  # odd
            x = ints(m, me)
            await dist.all_reduce(x, group=pair)
            ok &= bool(np.array_equal(x, ints(m, 0) + ints(m, 1)))
            for root in (0, 1):
                b = ints(m, 9 + root) if me == root else np.zeros(m, np.float32)
                await dist.broadcast(b, group_src=root, group=pair)
                ok &= bool(np.array_equal(b, ints(m, 9 + root)))
            k = (4 << 20) // 8 - 1
            y = ints(2 * k, 20 + me)
            want = (ints(2 * k, 20) + ints(2 * k, 21))[me * k : (me + 1) * k]
            o = np.empty(k, np.float32)
            await dist.reduce_scatter_tensor(o, y, group=pair)
            await dist.reduce_scatter_tensor(y[me * k : (me + 1) * k], y, group=pair)  # in place
            ok &= bool(np.array_equal(o, want)) and bool(np.array_equal(y[me * k : (me + 1) * k], want))
        await dist.all_reduce(np.ones(4, np.float32))  # the world's lane
        world = next(t.state for key, t in _shm()._turns.items() if key[0] == dist.group.WORLD.group_id)
        g = next(t.state for key, t in _shm()._turns.items() if key[0] == pair.group_id) if rank in (0, n - 1) else None
        slots = [b[0].size for b in g.bodies] if g is not None else []
        ok &= all(b[0].size == (4 << 20 if n == 2 else 1 << 20) for b in world.bodies)
        lane_ops, cma_ops = (g.lane_ops, g.cma_ops) if g is not None else (0, 0)
        await dist.destroy_process_group()
        return ok, lane_ops, cma_ops, slots

    for out in await run_world(2, fn, "gloo", timeout=60):
        # all_reduce by slices (2 lane ops), 2 broadcasts, 2 reduce_scatters; no single copy
        assert out == (True, 6, 0, [4 << 20] * 2), out
    outs = await run_world(3, fn, "gloo", timeout=60)
    assert outs[0] == outs[2] == (True, 6, 0, [4 << 20] * 2) and outs[1] == (True, 0, 0, []), outs


async def test_a_pair_takes_its_lane_in_pieces_past_4_mib(shm_env: None) -> None:
    """Past ``pair_lane_max``, with ``pair_pieces_max`` set (0 by default), a pair's all_reduce,
    broadcast and reduce_scatter go through its lane in pieces (``_lane.*_pieces``: lane ops
    counted, no single-copy op): exact sums at odd
    lengths, the single-copy all_reduce's bits for random floats (each rank adds its own half
    first), MAX and AVG, a reduce_scatter in place and one whose output is the other rank's
    part, a broadcast from each rank."""
    m = 3_000_001  # 12 MB of float32: pieces of 1 MiB (the all_reduce's: of each half)
    pieces = {"pair_pieces_max": "64M"}  # (off by default)
    plain = {"pair_pieces_max": 0}  # the same ranks by single copy

    def ints(count: int, salt: int) -> np.ndarray:
        return np.random.default_rng(salt).integers(-1000, 1000, count).astype(np.float32)

    async def fn(rank: int) -> tuple[dict[str, bool], int, int, int]:
        other = await dist.new_group([0, 1], pg_options=plain)
        same: dict[str, bool] = {}
        x = ints(m, rank)
        await dist.all_reduce(x)
        same["sum"] = bool(np.array_equal(x, ints(m, 0) + ints(m, 1)))
        f = np.random.default_rng(5 + rank).standard_normal(m).astype(np.float32)
        a, b = f.copy(), f.copy()
        await dist.all_reduce(a)
        await dist.all_reduce(b, group=other)
        same["bits"] = bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
        i = (np.arange(m, dtype=np.int64) % 1000) * (rank + 1)
        await dist.all_reduce(i, op=dist.ReduceOp.MAX)
        same["max"] = bool(np.array_equal(i, (np.arange(m, dtype=np.int64) % 1000) * 2))
        v = np.full(m, float(rank + 1), np.float64)  # 24 MB
        await dist.all_reduce(v, op=dist.ReduceOp.AVG)
        same["avg"] = bool(np.all(v == 1.5))
        for root in (0, 1):
            c = ints(m, 9 + root) if rank == root else np.zeros(m, np.float32)
            await dist.broadcast(c, src=root)
            same[f"bcast_{root}"] = bool(np.array_equal(c, ints(m, 9 + root)))
        k = m // 2
        y = ints(2 * k, 20 + rank)
        want = (ints(2 * k, 20) + ints(2 * k, 21))[rank * k : (rank + 1) * k]
        o = np.empty(k, np.float32)
        await dist.reduce_scatter_tensor(o, y)
        same["rs"] = bool(np.array_equal(o, want))
        z = y.copy()
        await dist.reduce_scatter_tensor(z[rank * k : (rank + 1) * k], z)  # in place
        same["rs_in_place"] = bool(np.array_equal(z[rank * k : (rank + 1) * k], want))
        w = y.copy()
        nxt = 1 - rank
        await dist.reduce_scatter_tensor(w[nxt * k : (nxt + 1) * k], w)  # the output is the other rank's part
        same["rs_other_part"] = bool(np.array_equal(w[nxt * k : (nxt + 1) * k], want))
        g = next(t.state for key, t in _shm()._turns.items() if key[0] == dist.group.WORLD.group_id)
        lane_ops, cma_ops = g.lane_ops, g.cma_ops
        await dist.destroy_process_group()
        return same, lane_ops, cma_ops, m

    for same, lane_ops, cma_ops, _ in await run_world(2, fn, "gloo", timeout=120, pg_options=pieces):
        assert all(same.values()), same
        # pieces of 1 MiB (two lane ops each in an all_reduce, whose pieces hold 1 MiB a rank):
        # the two float32 all_reduces 6 each, the 24 MB MAX and AVG 12 each, the broadcasts 12
        # each, the reduce_scatters 6 each (each rank posts the other's part)
        assert (lane_ops, cma_ops) == (2 * (2 * 6 + 2 * 12) + 2 * 12 + 3 * 6, 0), (lane_ops, cma_ops)


@pytest.mark.parametrize(
    "n, itemsize, piece, slot, want",
    [
        (10, 1, 4, 16, [0, 4, 8, 10]),  # pieces of the piece's size, the last one short
        (8, 4, 16, 64, [0, 4, 8]),  # in items: 16 bytes are 4 float32
        (100, 1, 1, 16, [*range(0, 100, 4), 100]),  # more than 32 pieces: larger ones (4 items, 25 pieces)
        (3, 8, 1, 64, [0, 1, 2, 3]),  # a piece smaller than an item: one item
        (100, 1, 4, 3, None),  # a piece past the slot
        (0, 4, 16, 64, [0]),  # nothing: no piece
    ],
)
def test_piece_bounds(n: int, itemsize: int, piece: int, slot: int, want: list[int] | None) -> None:
    from aiodist.shm._lane import piece_bounds

    got = piece_bounds(n, itemsize, piece, slot)
    assert got == want
    if got is not None:
        assert len(got) - 1 <= 32  # LINE_STEP: every piece has a number of its own in the line


async def test_a_pairs_kept_calls_post_only_the_other_ranks_part(shm_env: None) -> None:
    """A pair's kept calls done in the call (the second call of a shape on): a sliced
    all_reduce and a reduce_scatter_tensor post only the other rank's slice or part and fold
    their own from the input, an all_reduce in one lane op folds its own part from the input;
    exact sums, call after call with new data, float bits equal to rank order (rank 0's
    element plus rank 1's, whichever rank folds it), and a reduce_scatter in place (the whole
    input posted) alike."""
    m = 300_003  # 1.2 MB: the lane, one lane op
    big = 800_003  # 3.2 MB: the lane, by slices (two lane ops)

    def ints(count: int, salt: int) -> np.ndarray:
        return np.random.default_rng(salt).integers(-1000, 1000, count).astype(np.float32)

    def floats(count: int, salt: int) -> np.ndarray:
        return np.random.default_rng(salt).standard_normal(count).astype(np.float32)

    async def fn(rank: int) -> tuple[list[bool], int]:
        ok = []
        before = None
        for call in range(4):
            x = ints(m, 10 * call + rank)
            await dist.all_reduce(x)
            ok.append(bool(np.array_equal(x, ints(m, 10 * call) + ints(m, 10 * call + 1))))
            f = floats(m, 100 + 10 * call + rank)
            await dist.all_reduce(f)
            ok.append(bool(np.array_equal(f, floats(m, 100 + 10 * call) + floats(m, 100 + 10 * call + 1))))
            x = ints(big, 300 + 10 * call + rank)
            await dist.all_reduce(x)
            ok.append(bool(np.array_equal(x, ints(big, 300 + 10 * call) + ints(big, 300 + 10 * call + 1))))
            f = floats(big, 400 + 10 * call + rank)
            await dist.all_reduce(f)
            ok.append(bool(np.array_equal(f, floats(big, 400 + 10 * call) + floats(big, 400 + 10 * call + 1))))
            y = floats(2 * m, 200 + 10 * call + rank)
            o = np.empty(m, np.float32)
            await dist.reduce_scatter_tensor(o, y)
            want = (floats(2 * m, 200 + 10 * call) + floats(2 * m, 201 + 10 * call))[rank * m : (rank + 1) * m]
            ok.append(bool(np.array_equal(o, want)))
            z = y.copy()
            await dist.reduce_scatter_tensor(z[rank * m : (rank + 1) * m], z)  # in place
            ok.append(bool(np.array_equal(z[rank * m : (rank + 1) * m], want)))
            if call == 0:
                before = dist.group.WORLD.backend.stats()["shm"]["lane_ops"]
        assert before is not None
        lane_ops = dist.group.WORLD.backend.stats()["shm"]["lane_ops"] - before
        await dist.destroy_process_group()
        return ok, lane_ops

    for ok, lane_ops in await run_world(2, fn, "gloo", timeout=60):
        assert all(ok), ok
        assert lane_ops == 3 * (1 + 1 + 2 + 2 + 1 + 1), lane_ops  # every call after the first through the lane
