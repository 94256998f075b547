"""Chaos in the fault tier: a differential fuzz of collectives (tests/helpers/chaos_rank.py:
random ops, sizes, roots, groups, a third left in flight) on 4 ranks, one of which SIGKILLs or
SIGSTOPs itself at a random op. Every survivor raises a DistError within the group's timeout
whose ``culprits`` are exactly the victim; the survivors shrink the default group by them and
finish the fuzz on 3 ranks, with 0 wrong results over both phases. The store is served by this
test (as a launcher's agent serves it), so rank 0 may be the victim too."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from _procs import kill_all, read_lines_until, start_ranks  # this folder's helpers (pytest puts it on sys.path)

from aiodist.store.server import ServerThread, TCPStoreServer

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

N = 4
TIMEOUT_S = 4.0  # the group's timeout: a SIGSTOPped rank is found by it
START_S = 30.0
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "chaos_rank.py"
OPS_AFTER = 40

# (seed, how): the victim and the op it stops at are drawn from the seed
CASES = [(11, "kill"), (13, "stop")]


@pytest.mark.parametrize("seed,how", CASES, ids=[f"{h}-seed{s}" for s, h in CASES])
def test_a_rank_lost_mid_fuzz_is_named_and_the_survivors_finish_it(seed: int, how: str) -> None:
    _chaos(seed, how, N, {})


def test_a_pair_left_after_a_loss_runs_its_big_ops_exactly() -> None:
    """3 ranks, sizes up to 6 MB too: the survivors are a pair, whose all_reduce, broadcast,
    reduce_scatter and all_gather (up to 4 MiB of output: the 1.8 MB parts) go through its
    4 MiB lane (an all_reduce below 3 MiB in one lane op) and, past it, through the lane in
    pieces (turned on: off by default); 0 wrong."""
    _chaos(19, "kill", 3, {"CHAOS_MORE_SIZES": "450000,700000,1500001", "AIODIST_ALGO_PAIR_PIECES_MAX": "64M"})


def _chaos(seed: int, how: str, n: int, more: dict[str, str]) -> None:
    N = n
    rng = random.Random(seed)
    victim, at = rng.randrange(N), rng.randrange(5, 40)
    server = ServerThread(TCPStoreServer(host="127.0.0.1", port=0)).start()
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(server.server.port), **more}
    outs: dict[int, list[str]] = {r: [] for r in range(N)}
    procs = start_ranks(WORKER, N, env=lambda r: env, args=(seed, victim, how, at, TIMEOUT_S, OPS_AFTER))
    try:
        running = read_lines_until(procs, "running", time.monotonic() + START_S, outs)
        assert running == set(range(N)), outs
        assert read_lines_until({victim: procs[victim]}, "DYING", time.monotonic() + 30, outs) == {victim}, outs
        survivors = {r: p for r, p in procs.items() if r != victim}
        read_lines_until(survivors, "DONE", time.monotonic() + TIMEOUT_S + 30, outs)
        for r, p in survivors.items():
            assert p.wait(timeout=10) == 0, (r, outs[r])
    finally:
        kill_all(procs)
        server.stop()
    died = float(next(line for line in outs[victim] if line.startswith("DYING")).split()[1])
    for new, old in enumerate(r for r in range(N) if r != victim):
        err = next((line for line in outs[old] if line.startswith("ERROR ")), None)
        assert err is not None, (old, outs[old])
        _, t, rest = err.split(" ", 2)
        assert rest.startswith(f"[{victim}] "), f"rank {old} names {rest}, not [{victim}]"
        assert float(t) - died < TIMEOUT_S + 2.0, (old, err)
        assert not [line for line in outs[old] if line.startswith("WRONG")], outs[old]
        done = [line for line in outs[old] if line.startswith("DONE ")]
        assert done and done[0].startswith(f"DONE rank {new} of {N - 1} wrong 0 ops "), outs[old]
    print(f"victim {victim} ({how}) at op {at}: " + "; ".join(f"rank {r}: {outs[r][-1]}" for r in survivors))
