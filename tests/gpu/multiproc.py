"""Several ranks, one process each, sharing ONE GPU through NCCL (``NCCL_MULTI_RANK_GPU_ENABLE=1``,
NCCL >= 2.30, experimental; a small ``NCCL_MAX_CTAS`` so the ranks' kernels fit side by side).

    python tests/gpu/multiproc.py [--json PATH] [--seconds 60]      # the launcher
    python tests/gpu/multiproc.py --rank R    # one rank (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as the launcher sets)

The launcher runs 2 then 3 ranks, each team under a hard timeout (its processes are killed
after it), then 2 ranks *without* NCCL_MULTI_RANK_GPU_ENABLE, where aiodist_cuda must refuse
with its hint ("both use cuda:0"). A rank does all_reduce (SUM, AVG, PREMUL_SUM, 64 MiB),
broadcast from every root, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single and
a send/recv ring, checks each result and prints one JSON line. NCCL refusing or hanging is a
result: the summary records what each rank and NCCL (``NCCL_DEBUG=WARN`` on stderr) said.
Exit status: 0 when every team did what it should, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STEP_S = 20.0  # one step of a rank; the launcher's timeout is the backstop


# -- one rank ------------------------------------------------------------------------------------


async def rank_main(rank: int) -> dict[str, Any]:
    import numpy as np

    import aiodist as dist
    import aiodist_cuda

    out: dict[str, Any] = {"rank": rank, "ok": False, "steps": {}, "nccl_version": aiodist_cuda.nccl_version()}
    cp: Any
    if os.environ.get("AIODIST_MULTIPROC_DRY") == "1":  # the same checks on NumPy arrays over "gloo" (no GPU)
        cp, backend = np, "gloo"
    elif not aiodist_cuda.is_available():
        out["error"] = f"aiodist_cuda unavailable: {aiodist_cuda.unavailable_reason()}"
        return out
    else:
        import cupy

        cp, backend = cupy, "cpu:gloo,cuda:nccl"
        cp.cuda.Device(int(os.environ.get("AIODIST_GPU", "0"))).use()  # every rank on the same GPU
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(STEP_S * 2):
            await dist.init_process_group(backend, timeout=STEP_S)  # env://
    except BaseException as exc:
        out["error"] = f"init_process_group: {type(exc).__name__}: {exc}"
        return out
    n = dist.get_world_size()
    out["world_size"] = n
    R = dist.ReduceOp

    def expect(got: Any, want: Any, what: str) -> None:
        g = got.get() if hasattr(got, "get") else np.asarray(got)
        if not np.array_equal(g, np.asarray(want)):
            raise AssertionError(f"{what}: got {g.ravel()[:8].tolist()}, want {np.asarray(want).ravel()[:8].tolist()}")

    async def s_all_reduce() -> None:
        x = cp.full(1000, rank + 1, dtype=cp.float32)
        await dist.all_reduce(x)
        expect(x, np.full(1000, n * (n + 1) / 2, dtype=np.float32), "all_reduce SUM")
        y = cp.full(1001, 2.0 * rank, dtype=cp.float64)
        await dist.all_reduce(y, op=R.AVG)
        expect(y, np.full(1001, float(n - 1)), "all_reduce AVG")
        z = cp.full(7, rank + 1, dtype=cp.float32)
        await dist.all_reduce(z, op=R.PREMUL_SUM(2.0))
        expect(z, np.full(7, n * (n + 1), dtype=np.float32), "all_reduce PREMUL_SUM(2)")
        i = cp.full(5, rank, dtype=cp.int64)
        await dist.all_reduce(i, op=R.MAX)
        expect(i, np.full(5, n - 1), "all_reduce MAX int64")
        big = cp.full(1 << 24, 1.0, dtype=cp.float32)  # 64 MiB
        work = await dist.all_reduce(big, async_op=True)
        assert work is not None
        await work
        expect(big[:: 1 << 20], np.full(16, float(n), dtype=np.float32), "all_reduce 64 MiB")

    async def s_broadcast() -> None:
        for root in range(n):
            b = cp.full(333, 10 * rank + 1, dtype=cp.int32)
            await dist.broadcast(b, src=root)
            expect(b, np.full(333, 10 * root + 1, dtype=np.int32), f"broadcast from {root}")

    async def s_all_gather() -> None:
        out_t = cp.full((n, 100), -1, dtype=cp.float16)
        await dist.all_gather_into_tensor(out_t, cp.full(100, rank, dtype=cp.float16))
        expect(out_t, np.repeat(np.arange(n, dtype=np.float16)[:, None], 100, axis=1), "all_gather_into_tensor")
        lst = [cp.zeros(3 + j, dtype=cp.int32) for j in range(n)]  # uneven: grouped send/recv
        await dist.all_gather(lst, cp.full(3 + rank, rank, dtype=cp.int32))
        for j in range(n):
            expect(lst[j], np.full(3 + j, j, dtype=np.int32), f"all_gather (uneven) [{j}]")

    async def s_reduce_scatter() -> None:
        out_t = cp.zeros(64, dtype=cp.float32)
        inp = cp.concatenate([cp.full(64, float(rank * n + j), dtype=cp.float32) for j in range(n)])
        await dist.reduce_scatter_tensor(out_t, inp)
        expect(out_t, np.full(64, float(sum(r * n + rank for r in range(n))), dtype=np.float32), "reduce_scatter_tensor")

    async def s_all_to_all() -> None:
        sizes = [(rank + j) % 3 + 1 for j in range(n)]
        inp = cp.concatenate([cp.full((s, 2), 100 * rank + j, dtype=cp.int32) for j, s in enumerate(sizes)])
        got = [(i + rank) % 3 + 1 for i in range(n)]
        out_t = cp.full((sum(got), 2), -1, dtype=cp.int32)
        await dist.all_to_all_single(out_t, inp, got, sizes)
        want = np.concatenate([np.full((s, 2), 100 * i + rank, dtype=np.int32) for i, s in enumerate(got)])
        expect(out_t, want, "all_to_all_single (uneven)")

    async def s_ring() -> None:
        right, left = (rank + 1) % n, (rank - 1) % n
        send = cp.full(4096, rank, dtype=cp.float32)
        recv = cp.full(4096, -1, dtype=cp.float32)
        works = await dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)])
        for w in works:
            await w
        expect(recv, np.full(4096, left, dtype=np.float32), "ring batch_isend_irecv")
        # plain send/recv between rank 0 and rank 1
        t = cp.full(10, rank, dtype=cp.int64)
        if rank == 0:
            await dist.send(cp.full(10, 42, dtype=cp.int64), dst=1)
        elif rank == 1:
            await dist.recv(t, src=0)
            expect(t, np.full(10, 42), "send/recv 0 -> 1")

    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("all_reduce", s_all_reduce),
        ("broadcast", s_broadcast),
        ("all_gather", s_all_gather),
        ("reduce_scatter", s_reduce_scatter),
        ("all_to_all", s_all_to_all),
        ("send_recv_ring", s_ring),
    ]
    ok = True
    for name, step in steps:
        t = time.monotonic()
        try:
            async with asyncio.timeout(STEP_S):
                await step()
            out["steps"][name] = f"ok {time.monotonic() - t:.3f}s"
        except BaseException as exc:  # noqa: BLE001 - recorded; a later step would only hang
            why = str(exc) or (f"no answer within {STEP_S:g} s" if isinstance(exc, TimeoutError) else "")
            out["steps"][name] = f"{type(exc).__name__}: {why}"
            ok = False
            break
    out["ok"] = ok
    out["seconds"] = round(time.monotonic() - t0, 3)
    try:
        async with asyncio.timeout(STEP_S):
            await dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        out["destroy"] = f"{type(exc).__name__}: {exc}"
    return out


def run_rank(rank: int) -> int:
    try:
        result = asyncio.run(rank_main(rank))
    except BaseException as exc:  # noqa: BLE001 - one JSON line whatever happens
        result = {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


# -- the launcher --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def team(n: int, seconds: float, multi_rank: bool, max_ctas: int) -> dict[str, Any]:
    """Run ``n`` ranks on one GPU; what each said, and whether the team ran past ``seconds``."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    t0 = time.monotonic()
    for r in range(n):
        env = dict(os.environ)
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("NCCL_DEBUG", "WARN")
        env["NCCL_MAX_CTAS"] = str(max_ctas)
        if multi_rank:
            env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        else:
            env.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank", str(r)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs: list[tuple[int | None, str, str]] = []
    timed_out = False
    deadline = t0 + seconds
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:  # only our own children, by their pids
                if q.poll() is None:
                    q.kill()
            o, e = p.communicate(timeout=10)
        outs.append((p.returncode, o, e))
    ranks: list[dict[str, Any]] = []
    nccl_said: list[str] = []
    for r, (code, o, e) in enumerate(outs):
        lines = [ln for ln in o.strip().splitlines() if ln.startswith("{")]
        try:
            result = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            result = None
        said = [ln for ln in e.splitlines() if "NCCL" in ln and ("WARN" in ln or "error" in ln.lower())]
        nccl_said += [f"rank {r}: {ln}" for ln in said[:20]]
        ranks.append({"rank": r, "returncode": code, "result": result, "stderr_tail": e[-3000:]})
    ok = not timed_out and all(x["returncode"] == 0 and x["result"] and x["result"].get("ok") for x in ranks)
    return {
        "n": n,
        "multi_rank_gpu_enable": multi_rank,
        "nccl_max_ctas": max_ctas,
        "ok": ok,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 2),
        "nccl_said": nccl_said[:40],
        "ranks": ranks,
    }


def refusal_seen(t: dict[str, Any]) -> bool:
    """Without NCCL_MULTI_RANK_GPU_ENABLE, every rank must have been told "both use cuda:0"."""
    return not t["timed_out"] and all("both use cuda:" in json.dumps(x["result"]) for x in t["ranks"])


def launch(seconds: float, max_ctas: int, json_path: str | None) -> int:
    teams = []
    for n in (2, 3):
        t = team(n, seconds, True, max_ctas)
        teams.append(t)
        print(f"{n} ranks on one GPU: {'ok' if t['ok'] else 'FAILED'}{' (timed out)' if t['timed_out'] else ''} in {t['seconds']} s")
        for x in t["ranks"]:
            res = x["result"] or {}
            print(f"  rank {x['rank']}: rc={x['returncode']} {json.dumps(res.get('steps') or res.get('error') or 'no JSON line')}")
        for ln in t["nccl_said"][:10]:
            print(f"  {ln}")
    t = team(2, min(seconds, 30.0), False, max_ctas)
    t["ok"] = refusal_seen(t)
    teams.append(t)
    first = t["ranks"][0]["result"] or {}
    said = json.dumps(first.get("steps") or first.get("error") or "no JSON line")
    print(
        f"2 ranks on one GPU without NCCL_MULTI_RANK_GPU_ENABLE: {'refused with the hint' if t['ok'] else 'NOT refused as expected'}: {said[:400]}"
    )
    summary = {"ok": all(x["ok"] for x in teams), "teams": teams}
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=None, help="run one rank (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    ap.add_argument("--json", default=None, help="write the launcher's summary here")
    ap.add_argument("--seconds", type=float, default=60.0, help="hard timeout of each team")
    ap.add_argument("--max-ctas", type=int, default=2, help="NCCL_MAX_CTAS for every rank")
    args = ap.parse_args(argv)
    if args.rank is not None:
        sys.path.insert(0, str(REPO))
        return run_rank(args.rank)
    return launch(args.seconds, args.max_ctas, args.json)


if __name__ == "__main__":
    sys.exit(main())
