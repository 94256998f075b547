"""SIGSTOP of one of 4 ranks in the middle of an all_reduce loop: every other rank raises a
DistError within the group timeout (+ 1 s) of the stop, naming the frozen rank; after SIGCONT
every rank, the frozen one included, can ``await dist.destroy_process_group()`` and exit 0.
Victims 1 (a plain rank) and 0 (which hosts the env:// store, so the store is frozen too).

The other ranks print their error and destroy at once (as a script's ``except`` would), while
the victim is still stopped; the test continues the victim once they have all raised. Each rank
prints the wall-clock time of its error, which the test compares with the stop's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _procs import kill_all, read_lines_until, start_ranks  # this folder's helpers (pytest puts it on sys.path)

from aiodist.c10d._diagnosis import Findings, Note, Report, _chase, explain
from aiodist.store import HashStore

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]

N = 4
GROUP_TIMEOUT_S = 5.0  # its consult grace (10 %, 0.5 s) must outlast a loaded CI machine's store round trip: 0.3 s did not
DETECT_S = GROUP_TIMEOUT_S + 1.0  # the bound under test (the slack: the consult grace, logging, a loaded machine)
START_S = 30.0  # a bound on start-up (4 interpreters importing numpy on 2 cores)
EXIT_S = 15.0  # a rank's destroy and exit after its error (measured well under 1 s)
HELD_S = 1.6  # the victim stays stopped this long past the others' timeout: its timer fires >= 3x LATE_S late

ROOT = Path(__file__).resolve().parents[2]

WORKER = ROOT / "tests" / "helpers" / "loop_rank.py"  # all_reduce in a loop until the group breaks


@pytest.mark.parametrize("victim", [1, 0], ids=["victim1", "victim0-store-host"])
def test_sigstop_of_one_rank_fails_every_other_within_the_timeout_and_all_destroy_after_sigcont(victim: int) -> None:
    outs: dict[int, list[str]] = {r: [] for r in range(N)}
    codes: dict[int, int | None] = {}
    procs = start_ranks(WORKER, N, env=lambda r: {"AIODIST_DEBUG": None}, args=(GROUP_TIMEOUT_S, 4, "destroy"))
    try:
        running = read_lines_until(procs, "running", time.monotonic() + START_S, outs)
        assert running == set(range(N)) and all(o and o[-1] == "running" for o in outs.values()), outs
        time.sleep(0.2)  # let the loop run a few ops past the first
        stopped_at = time.time()
        os.kill(procs[victim].pid, signal.SIGSTOP)
        others = {r: p for r, p in procs.items() if r != victim}
        read_lines_until(others, "ERROR", time.monotonic() + DETECT_S + 10, outs)
        # the others destroy their group and exit while the victim is still stopped: a frozen peer
        # must not hold up a teardown
        for rank, p in others.items():
            try:
                p.wait(timeout=EXIT_S)
            except subprocess.TimeoutExpired:
                pass
            codes[rank] = p.poll()
        # the victim stays stopped past its own deadline by HELD_S at least, so its timer fires late
        time.sleep(max(0.0, stopped_at + GROUP_TIMEOUT_S + HELD_S - time.time()))
        os.kill(procs[victim].pid, signal.SIGCONT)
        continued_at = time.monotonic()
        for rank, p in {victim: procs[victim]}.items():
            try:
                p.wait(timeout=max(0.1, continued_at + EXIT_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            codes[rank] = p.poll()
        exited_s = time.monotonic() - continued_at
    finally:
        kill_all(procs, outs)  # and what is left of their output: the destroy lines, tracebacks
    took: dict[int, float] = {}
    for rank in others:
        errors = [line for line in outs[rank] if line.startswith("ERROR ")]
        assert errors, f"rank {rank} raised no DistError after rank {victim} was stopped: {outs[rank]}"
        _, t, msg = errors[0].split(" ", 2)
        took[rank] = float(t) - stopped_at
        assert re.search(rf"\brank {victim}\b", msg), f"rank {rank}'s error does not name rank {victim}: {msg}"
    # the victim's own error when it wakes: the peers' abort (naming it), or its own timeout,
    # which says that it is the one that did not run
    woke = [line for line in outs[victim] if line.startswith("ERROR ")]
    assert woke, f"rank {victim} raised no DistError after SIGCONT: {outs[victim]}"
    _, _, own = woke[0].split(" ", 2)
    if own.startswith("DistTimeoutError"):
        assert f"rank {victim} itself did not run for" in own, own
    else:
        assert re.search(rf"\brank {victim}\b", own), own
    print(f"\nvictim {victim}: time to error after SIGSTOP: " + ", ".join(f"rank {r} {s:.3f} s" for r, s in took.items()))
    for rank in range(N):
        print(f"  rank {rank}: " + " | ".join(line for line in outs[rank] if not line.startswith("running"))[:600])
    print(f"  the victim exited {exited_s:.2f} s after SIGCONT")
    assert all(s < DETECT_S for s in took.values()), took
    assert codes == dict.fromkeys(range(N), 0), (codes, outs)
    assert all(any(line.startswith("destroyed in") for line in outs[r]) for r in range(N)), outs


# -- the headline's pieces, as pure decisions (the subprocess case above cannot force each) -----


def test_a_rank_one_op_behind_is_followed_to_the_rank_it_waits_on() -> None:
    """A rank stopped mid-loop leaves its next peer one op behind: the rank waiting on that peer
    names whom the peer waits on there (it said only "it is in all_reduce seq 24")."""
    found = Findings({2: Report("all_reduce", (3,))}, notes={3: [Note(0, "seq 24", "all_reduce", 5.0, 24)]}, beyond={3: ([0], [1])})
    head, _, _ = explain(2, "all_reduce", 25, 0, found, since=1.0, now=9.0, grace=0.3)
    assert (
        head
        == "rank 3 never issued all_reduce seq 25 of group 0: it is in all_reduce seq 24 of group 0, waiting on rank 0 there (and through them on rank 1)"
    )


async def test_the_chase_at_another_seq_ends_at_the_rank_without_a_report() -> None:
    store = HashStore()
    await store.set("aiodist/hang/0/24/0", Report("all_reduce", (1,)).encode())  # rank 0 waits on 1; 1 wrote nothing
    assert await _chase(store, 0, 24, 3, Report("all_reduce", (0,))) == ([0], [1])


def test_a_store_that_does_not_answer_is_said_with_its_host() -> None:
    found = Findings({3: Report("all_reduce", (2,))}, answered=False, store_host="rank 0")
    head, _, _ = explain(3, "all_reduce", 7, 0, found, since=0.0, now=3.0, grace=0.3)
    assert head == "the store did not answer within 0.3 s, so no rank is named as the cause (is the store's host, rank 0, stopped?)"


def test_a_deadline_that_fired_late_says_this_rank_did_not_run_and_blames_no_silent_peer() -> None:
    found = Findings({1: Report("all_reduce", (0,))})
    head, tail, _ = explain(1, "all_reduce", 7, 0, found, since=0.0, now=5.0, grace=0.3, late=1.5)
    assert head.startswith("rank 1 itself did not run for 1.5 s past its deadline"), head
    assert "never issued" not in head and "stuck outside" not in tail, (head, tail)
    head, _, _ = explain(1, "all_reduce", 7, 0, found, since=0.0, now=5.0, grace=0.3, late=0.05)  # a timer's usual jitter
    assert head.startswith("rank 0 never issued"), head
