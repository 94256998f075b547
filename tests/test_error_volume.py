"""How much a failure prints, measured in real jobs under the launcher (tests/helpers/failing_job.py):
a 2-rank and an 8-rank desync, a dead rank, a timeout. Each failing rank says its headline once, in
the user's terms: its traceback is the user's own lines (no frame inside aiodist), the sentence
names the op, group and sequence number and no message tag, a peer reads where the failure
started, and the launcher's root cause is one line. The bounds are on lines printed."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120)]
launched = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "helpers" / "failing_job.py")
LINE = re.compile(r"^\[rank(\d+)\]: (.*)$")
HEADLINE = re.compile(r"^aiodist\.errors\.(Dist\w+): (.*)$")


def run(how: str, n: int) -> tuple[str, dict[int, list[str]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "AIODIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"))}
    p = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", str(n), JOB, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode == 1, p.stderr
    ranks: dict[int, list[str]] = {}
    for line in p.stderr.splitlines():
        m = LINE.match(line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return p.stderr, ranks


def headlines(lines: list[str]) -> list[str]:
    return [m.group(2) for line in lines if (m := HEADLINE.match(line))]


def check_common(err: str, ranks: dict[int, list[str]], failing: list[int], per_rank: int) -> None:
    assert "aiodist/" not in "".join(line for line in err.splitlines() if line.lstrip().startswith("File ")), err
    assert "The above exception was the direct cause" not in err and "Exception Group" not in err, err
    for r in failing:
        lines = ranks[r]
        assert len(lines) <= per_rank, (r, lines)
        heads = headlines(lines)
        assert len(heads) == 1, (r, lines)  # one error, said once
        assert not re.search(r"\btag \d", heads[0]), heads[0]
        assert sum(heads[0][:60] in line for line in lines) == 1, lines  # no log line repeats it
    root = err[err.index("Root Cause") :].splitlines()
    i = next(k for k, line in enumerate(root) if line.strip() == "traceback :")
    assert root[i + 2].startswith("====="), root  # one line under it


@launched
@pytest.mark.parametrize("n", [2, 8])
def test_a_desync_is_one_sentence_per_rank(n: int) -> None:
    err, ranks = run("desync", n)
    check_common(err, ranks, sorted(ranks), per_rank=20)
    for r, lines in ranks.items():
        head = headlines(lines)[0]
        assert "seq 0" in head and "default_pg" in head, head
        if n == 2:  # found at once, from the ops' digests: both calls named
            assert "desync detected" in head and "called broadcast" in head and "called all_reduce" in head, head
        elif r == n - 1:  # the timeout's explanation names a rank at the other op ("... issued all_reduce",
            # or "rank 6 never issued broadcast seq 0 ...: it is in all_reduce seq 0", as the store's reports came)
            assert "all_reduce" in head and re.search(rf"\brank [0-{n - 2}]\b", head), head
        else:
            assert f"rank {n - 1}" in head and "broadcast" in head, head
    assert len(err.splitlines()) <= 24 * n + 10  # the traceback (about 13 lines) and the launcher's entry (8) per rank


@launched
def test_a_dead_rank_is_one_sentence_on_each_peer() -> None:
    err, ranks = run("dead", 2)
    check_common(err, ranks, [0], per_rank=20)
    head = headlines(ranks[0])[0]
    # a peer that exits reads as a close without GOODBYE, or as a reset where it had unread bytes
    assert head.startswith("all_reduce on default_pg") and "seq 1" in head, head
    assert "rank 1 closed the connection" in head or "connection with rank 1 lost" in head, head
    assert sum("rank 1 closed the connection" in line for line in ranks[0]) <= 2  # the warning (once) and the error
    assert len(err.splitlines()) <= 45


@launched
def test_a_timeout_is_one_sentence() -> None:
    err, ranks = run("timeout", 2)
    check_common(err, ranks, [0], per_rank=20)
    head = headlines(ranks[0])[0]
    assert "rank 1 never issued all_reduce seq 1" in head and "timed out after 2 s" in head, head
    assert len(err.splitlines()) <= 45


async def test_an_ops_error_reaches_the_user_without_aiodists_frames() -> None:
    """In one process (every Python's version tier): a desync's error, as the awaiting line
    gets it, formats to the user's frames and one sentence: no frame inside aiodist, no chained
    internal error; a peer's names the rank where the failure started."""
    import traceback

    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> str:
        x = np.ones(4, np.float32)
        try:
            if rank == 0:
                await dist.all_reduce(x)
            else:
                await dist.broadcast(x, src=0)
        except dist.DistError as exc:
            return "".join(traceback.format_exception(exc))
        return "no error"

    for text in await run_world(2, fn, backend="gloo", pg_timeout=10, timeout=60):
        frames = [line for line in text.splitlines() if line.lstrip().startswith("File ")]
        assert frames and not any("/aiodist/" in f for f in frames), text
        assert "The above exception" not in text and "During handling" not in text, text
        assert text.count("desync detected") == 1 and "seq 0" in text and "tag " not in text, text


async def test_argument_errors_are_one_sentence() -> None:
    """A refused call (a list for an array, a non-contiguous output, a call before init, a bad
    rank) reaches the user as their own line and one sentence: no frame inside aiodist."""
    import traceback

    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    def shown(exc: BaseException) -> str:
        return "".join(traceback.format_exception(exc))

    texts = []
    try:
        await dist.all_reduce(np.ones(2))
    except ValueError as exc:
        texts.append(shown(exc))

    async def fn(rank: int) -> list[str]:
        out = []
        for call in (
            lambda: dist.all_reduce([1.0, 2.0]),  # type: ignore[arg-type]
            lambda: dist.all_reduce(np.ones((4, 4), np.float32)[:, 1]),
            lambda: dist.broadcast(np.ones(2), src=7),
        ):
            try:
                await call()
            except (TypeError, ValueError) as exc:
                out.append(shown(exc))
        return out

    texts += (await run_world(2, fn))[0]
    assert len(texts) == 4
    for text in texts:
        assert "/aiodist/" not in text and len(text.splitlines()) <= 8, text  # (the lambda is a frame of its own)


async def test_ddp_errors_are_one_sentence() -> None:
    """DDP's mistakes named at the next forward, and a backward that fails, reach the user without
    aiodist's frames (torch's own module-call frames may remain)."""
    import traceback

    torch = pytest.importorskip("torch")
    import aiodist as dist
    from aiodist.nn.parallel import DistributedDataParallel
    from aiodist.testing import run_world

    async def fn(rank: int) -> list[str]:
        model = torch.nn.Linear(2, 1)
        ddp = await DistributedDataParallel(model)
        out = []
        ddp.backward(ddp(torch.ones(1, 2)).sum()).close()  # never awaited: the next forward says so
        try:
            ddp(torch.ones(1, 2))
        except RuntimeError as exc:
            out.append("".join(traceback.format_exception(exc)))
        if rank == 0:
            await dist.destroy_process_group()  # rank 0 leaves: rank 1's backward fails
            return out
        await asyncio.sleep(0.2)
        try:
            await ddp.backward(ddp(torch.ones(1, 2)).sum())
        except dist.DistError as exc:
            out.append("".join(traceback.format_exception(exc)))
        return out

    got = await run_world(2, fn, backend="gloo", pg_timeout=5, timeout=30)
    for text in got[0] + got[1]:
        assert "/aiodist/" not in text, text
    assert len(got[1]) == 2 and "not awaited" in got[1][0], got
