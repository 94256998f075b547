"""Checks of examples/train_survive_rank_loss.py's output, shared by the tests that run it."""

from __future__ import annotations

import re


def check_survived(out: str, *, victim: int, size: int) -> None:
    """The example's lines: the kill, each survivor's shrink (naming the victim) and its OK with
    the same parameters, the last within 10 s of the kill."""
    killed = re.search(rf"rank {victim}: SIGKILL at step 15 \(unix time ([\d.]+)\)", out)
    assert killed, out
    survivors = [q for q in range(size) if q != victim]
    for new, old in enumerate(survivors):
        assert f"rank {new} (launched as {old}): step 15: lost rank(s) [{victim}], now {size - 1} ranks" in out, out
    oks = re.findall(
        r"OK \(unix time ([\d.]+)\) rank (\d) \(launched as (\d)\) of (\d): 40 steps, .*parameters identical \(sha256 (\w+)\)", out
    )
    assert sorted((int(o[1]), int(o[2]), int(o[3])) for o in oks) == [(n, o, size - 1) for n, o in enumerate(survivors)], out
    assert len({o[4] for o in oks}) == 1, out
    assert max(float(o[0]) for o in oks) - float(killed[1]) < 10.0, out
