"""The isend flood of issue 14 (case 1), across two processes, on both loops: rank 0 isends
K x S bytes at once to rank 1, which posts no receive until HOLD_S seconds after the sender
has issued them all, then receives every message and checks every byte (message i holds
``arange + i * 2**32`` as uint64, so a message delivered twice, out of order or torn is
caught). The sender's peak RSS (VmHWM, its high-water mark reset through
``/proc/self/clear_refs`` just before it allocates the buffers) may grow by at most 1.3 x
the bytes in flight: the buffers themselves and little else. Before the fix (a send wrote to
a paused connection, and asyncio's selector transport copied every unsent remainder) the
asyncio run here peaked at +2.49x; uvloop stayed at 1.00x either way.

Scaled down: the issue's case is 32 x 64 MiB (2 GiB) held back 10 s. On a loaded 2-core
machine one such run took 15-35 s (first touches of fresh memory are slow there), so this is
32 x 16 MiB (512 MiB) held back 2 s, about 4-7 s a run. The bound is a ratio, and the
reverted fix breaks it at this size as at the issue's (2.49x; 2 GiB with the fix: asyncio
1.05x, uvloop 1.00x)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from _procs import kill_all, start_ranks  # this folder's helpers (pytest puts it on sys.path)

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

K = 32
SIZE = 16 << 20  # bytes per message
HOLD_S = 2.0  # rank 1 posts no receive for this long
BOUND = 1.3  # peak RSS growth / bytes in flight
RUN_S = 90.0  # a hard bound on one run (it takes 4-7 s)
MIB = 1 << 20

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import asyncio, json, os, sys, time
from datetime import timedelta
sys.path.insert(0, {root!r})
T_UP = time.monotonic()
import numpy as np
import aiodist as dist

K, SIZE, HOLD_S = {k}, {size}, {hold}
N = SIZE // 8

def status():
    out = {{}}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out

async def main():
    rank = int(os.environ["RANK"])
    store = await dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=60))
    await dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=60)
    base = np.arange(N, dtype=np.uint64)  # allocated before the baseline: not part of the flood
    await dist.barrier()
    if rank == 0:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS: the peak from here on is the flood's
        except OSError:
            pass  # then VmHWM may hold an older, higher peak: the bound is only stricter
        before = status()["VmRSS"]
        t_start = time.monotonic()
        bufs = []
        for i in range(K):
            b = np.empty(N, dtype=np.uint64)
            np.add(base, np.uint64(i << 32), out=b)
            bufs.append(b)
        works = [await dist.isend(b, dst=1) for b in bufs]
        issued = status()["VmRSS"]
        t0 = time.monotonic()
        issue_s = t0 - t_start
        await store.set("issued", "1")
        for w in works:
            await w.wait()
        sent_s = time.monotonic() - t0
        s = status()
        print("RESULT " + json.dumps(dict(before=before, issued=issued, peak=s["VmHWM"], after=s["VmRSS"], sent_s=sent_s, issue_s=issue_s, up_s=t_start - T_UP)), flush=True)
    else:
        await store.wait(["issued"])
        await asyncio.sleep(HOLD_S)  # nothing posted: the sender's isends wait
        buf = np.empty(N, dtype=np.uint64)
        bad = []
        for i in range(K):
            buf.fill(0)
            await dist.recv(buf, src=0)
            np.subtract(buf, np.uint64(i << 32), out=buf)
            if not np.array_equal(buf, base):
                bad.append(i)
        print("CHECKED " + json.dumps(bad), flush=True)
    await dist.destroy_process_group()

if {uvloop!r}:
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_isend_flood_to_a_late_receiver_keeps_sender_rss_within_1_3x_in_flight(tmp_path: Path, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    script = tmp_path / "rank.py"
    script.write_text(WORKER.format(root=str(ROOT), k=K, size=SIZE, hold=HOLD_S, uvloop=loop == "uvloop"))
    outs: list[str] = []
    procs = start_ranks(script, 2)
    try:
        deadline = time.monotonic() + RUN_S
        for p in procs.values():
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    finally:
        kill_all(procs)
    for rank, p in procs.items():
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{outs[rank]}"
    result = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    bad = json.loads(next(line for line in outs[1].splitlines() if line.startswith("CHECKED "))[8:])
    in_flight = K * SIZE
    growth = result["peak"] - result["before"]
    print(
        f"[{loop}] {K} x {SIZE // MIB} MiB in flight ({in_flight / MIB:.0f} MiB), receiver late {HOLD_S:g} s: sender RSS before "
        f"{result['before'] / MIB:.0f} MiB, issued +{(result['issued'] - result['before']) / MIB:.0f}, peak "
        f"+{growth / MIB:.0f} ({growth / in_flight:.2f}x), after +{(result['after'] - result['before']) / MIB:.0f}; "
        f"start-up {result['up_s']:.2f} s, allocate and issue {result['issue_s']:.2f} s, sends done {result['sent_s']:.2f} s after issue"
    )
    assert bad == [], f"messages with wrong bytes: {bad}"
    assert growth <= BOUND * in_flight, (
        f"[{loop}] sender RSS grew by {growth / MIB:.0f} MiB for {in_flight / MIB:.0f} MiB in flight ({growth / in_flight:.2f}x > {BOUND}x)"
    )
