"""``python -m aiodist_cuda.bench``: what awaiting an NCCL op through aiodist costs, on one GPU.

For every launch/completion mode (``AIODIST_CUDA_LAUNCH`` x ``AIODIST_CUDA_COMPLETION``, and
``AIODIST_CUDA_SPIN``), each in its own process under a hard timeout (``--mode-timeout``: a mode
that hangs is recorded and killed, and the others still run), in a 1-rank World ("cpu:gloo,cuda:nccl"):

- responsiveness: a ticker task sleeping 0.5 ms records the longest gap between its wake-ups
  while a 1 GiB float32 all_reduce is awaited (the first one, which also makes the
  communicator, and warm ones, each behind a 1 GiB kernel on the caller's stream); the same
  ticker on an idle loop is the baseline (asyncio's timers have 1 ms granularity);
- overhead: the median time per op of a raw CuPy NCCL call (``comm.allReduce`` on a stream, then
  ``stream.synchronize()``, on a 1-rank communicator made with ``cupy.cuda.nccl`` directly)
  against ``await dist.all_reduce(x)``, for 4 B and 256 MiB; the difference in µs and the
  bandwidth (bytes / time) of both.

At one rank NCCL's in-place all_reduce moves no data, so the 256 MiB "bandwidth" is bytes over
the time of a call that does next to nothing: it shows the per-op cost at that size, and the
raw and aiodist figures are comparable; link bandwidth needs two ranks (tests/gpu/multiproc.py).

A table on stdout; ``--json PATH`` gets the figures, rewritten after every mode. Exits 0 when
every mode ran, 1 when one failed, 2 (printing why) where NCCL cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiodist_cuda

__all__ = ["main"]

MODES: list[tuple[str, str, str]] = [
    ("thread", "thread", ""),
    ("loop", "thread", ""),
    ("thread", "hostfunc", ""),
    ("loop", "hostfunc", ""),
    ("thread", "thread", "1"),
    ("loop", "thread", "1"),
]
SIZES = [4, 256 << 20]  # bytes
TICK_S = 0.0005
GIB = 1 << 30
_BIG = [GIB]  # bytes of the array awaited while the ticker runs (--big)
_ENV = ("AIODIST_CUDA_LAUNCH", "AIODIST_CUDA_COMPLETION", "AIODIST_CUDA_SPIN")


def mode_name(launch: str, completion: str, spin: str) -> str:
    return f"launch={launch} completion={completion}{' spin' if spin else ''}"


@contextmanager
def mode_env(launch: str, completion: str, spin: str) -> Iterator[None]:
    """The backend reads these when a World makes it: set for one round, then put back."""
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ["AIODIST_CUDA_LAUNCH"] = launch
    os.environ["AIODIST_CUDA_COMPLETION"] = completion
    if spin:
        os.environ["AIODIST_CUDA_SPIN"] = spin
    else:
        os.environ.pop("AIODIST_CUDA_SPIN", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _iters(nbytes: int, quick: bool) -> tuple[int, int]:
    """(warm-up, timed) iterations for a message of ``nbytes``."""
    if nbytes <= 1 << 20:
        return (50, 300) if quick else (200, 2000)
    return (3, 10) if quick else (5, 40)


# -- the raw CuPy NCCL call ------------------------------------------------------------------------


class Raw:
    """A 1-rank communicator made with ``cupy.cuda.nccl`` directly, and its own stream."""

    def __init__(self, cp: Any, nccl: Any) -> None:
        self.cp, self.nccl = cp, nccl
        self.comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def per_op(self, x: Any, warm: int, timed: int) -> list[float]:
        """Seconds of each ``allReduce`` + ``stream.synchronize()`` on ``x`` (in place)."""
        comm, stream, ptr, count = self.comm, self.stream, x.data.ptr, x.size
        f32, op_sum, sptr = self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, stream.ptr
        self.cp.cuda.Device().synchronize()
        out = []
        for i in range(warm + timed):
            t = time.perf_counter()
            comm.allReduce(ptr, ptr, count, f32, op_sum, sptr)
            stream.synchronize()
            if i >= warm:
                out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.comm.destroy()


# -- aiodist --------------------------------------------------------------------------------------


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _with_ticker(coro_fn: Any) -> tuple[float, list[float]]:
    """Run ``await coro_fn()`` with the ticker alongside: (seconds it took, the ticker's gaps)."""
    gaps: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(_ticker(stop, gaps))
    await asyncio.sleep(0.002)  # the ticker is running before the op is issued
    t = time.perf_counter()
    try:
        await coro_fn()
    finally:
        took = time.perf_counter() - t
        stop.set()
        await tick
    return took, gaps


def _gap_stats(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"ticks": 0}
    return {
        "ticks": len(gaps),
        "max_gap_ms": round(max(gaps) * 1e3, 3),
        "p50_gap_ms": round(statistics.median(gaps) * 1e3, 3),
        "gaps_over_2ms": sum(g > 0.002 for g in gaps),
    }


async def _round(cp: Any, quick: bool) -> dict[str, Any]:
    """One mode's figures, inside a 1-rank World."""
    import aiodist as dist

    out: dict[str, Any] = {}
    # responsiveness: an idle baseline, the first 1 GiB op (makes the communicator), warm ones
    _, idle = await _with_ticker(lambda: asyncio.sleep(0.3))
    big = cp.ones(_BIG[0] // 4, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    first_s, first = await _with_ticker(lambda: dist.all_reduce(big))

    async def warm_ops() -> None:
        for _ in range(3 if quick else 10):
            cp.add(big, 0.0, out=big)  # a 1 GiB kernel queued on the caller's stream: the op waits for it
            await dist.all_reduce(big)

    warm_s, warm = await _with_ticker(warm_ops)
    out["responsiveness"] = {
        "bytes": _BIG[0],
        "idle": _gap_stats(idle),
        "first_op": {**_gap_stats(first), "op_ms": round(first_s * 1e3, 3)},
        "warm_ops": {**_gap_stats(warm), "ops": 3 if quick else 10, "total_ms": round(warm_s * 1e3, 3)},
    }
    # overhead: await dist.all_reduce(x), one at a time
    per: dict[str, Any] = {}
    for nbytes in SIZES:
        x = cp.ones(nbytes // 4, dtype=cp.float32)
        warmn, timed = _iters(nbytes, quick)
        cp.cuda.Device().synchronize()
        times = []
        for i in range(warmn + timed):
            t = time.perf_counter()
            await dist.all_reduce(x)
            if i >= warmn:
                times.append(time.perf_counter() - t)
        per[str(nbytes)] = times
        del x
    out["aiodist_times"] = per
    out["stats"] = dist.current_world().devices["cuda"].stats()
    return out


def run_mode(cp: Any, raw: Raw, launch: str, completion: str, spin: str, quick: bool, timeout_s: float = 60.0) -> dict[str, Any]:
    """One mode's figures (in this process): the raw call, then a 1-rank World in that mode."""
    from aiodist.testing import run_world

    result: dict[str, Any] = {"launch": launch, "completion": completion, "spin": bool(spin)}
    # the raw call, right before this mode's round (same GPU state)
    raw_times = {}
    for nbytes in SIZES:
        x = cp.ones(nbytes // 4, dtype=cp.float32)
        warm, timed = _iters(nbytes, quick)
        raw_times[str(nbytes)] = raw.per_op(x, warm, timed)
        del x

    async def rank_fn(rank: int) -> dict[str, Any]:
        return await _round(cp, quick)

    async def go() -> dict[str, Any]:
        return (await run_world(1, rank_fn, backend="cpu:gloo,cuda:nccl", timeout=timeout_s, pg_timeout=timeout_s))[0]

    try:
        with mode_env(launch, completion, spin):
            got = asyncio.run(go())
    except Exception as exc:  # the raw figures are still worth having
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["raw_us"] = {k: round(statistics.median(v) * 1e6, 2) for k, v in raw_times.items()}
        return result
    result["responsiveness"] = got["responsiveness"]
    result["backend_stats"] = got["stats"]
    sizes = {}
    for nbytes in SIZES:
        r = statistics.median(raw_times[str(nbytes)])
        a = statistics.median(got["aiodist_times"][str(nbytes)])
        sizes[str(nbytes)] = {
            "bytes": nbytes,
            "iters": len(raw_times[str(nbytes)]),
            "raw_us": round(r * 1e6, 2),
            "aiodist_us": round(a * 1e6, 2),
            "overhead_us": round((a - r) * 1e6, 2),
            "raw_GBps": _sig(nbytes / r / 1e9),
            "aiodist_GBps": _sig(nbytes / a / 1e9),
            "raw_p90_us": round(_pct(raw_times[str(nbytes)], 0.9) * 1e6, 2),
            "aiodist_p90_us": round(_pct(got["aiodist_times"][str(nbytes)], 0.9) * 1e6, 2),
        }
    result["sizes"] = sizes
    resp = result["responsiveness"]
    small, large = sizes[str(SIZES[0])], sizes[str(SIZES[-1])]
    result["goals"] = {  # the issue's: <= 10 µs per op over the raw call, the raw bandwidth, no loop stall over 1 ms
        "overhead_small_us": small["overhead_us"],
        "overhead_large_us": large["overhead_us"],
        "bandwidth_ratio_large": round(large["aiodist_GBps"] / large["raw_GBps"], 3) if large["raw_GBps"] else None,
        "max_gap_ms_awaiting": max(resp["first_op"].get("max_gap_ms", 0.0), resp["warm_ops"].get("max_gap_ms", 0.0)),
        "max_gap_ms_idle": resp["idle"].get("max_gap_ms"),
    }
    cp.get_default_memory_pool().free_all_blocks()
    return result


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- report ---------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    rows = [
        f"{'mode':<40} {'size':>9} {'raw µs':>10} {'aiodist µs':>11} {'+µs':>9} {'raw GB/s':>9} {'aio GB/s':>9}  loop max gap ms (idle / first / warm)"
    ]
    for m in report["modes"]:
        name = mode_name(m["launch"], m["completion"], "1" if m["spin"] else "")
        if "error" in m:
            raw = f" (raw µs: {m['raw_us']})" if "raw_us" in m else ""
            rows.append(f"{name:<40} error: {m['error'][:300]}{raw}")
            continue
        resp = m["responsiveness"]
        gaps = f"{resp['idle'].get('max_gap_ms')} / {resp['first_op'].get('max_gap_ms')} / {resp['warm_ops'].get('max_gap_ms')}"
        for i, s in enumerate(m["sizes"].values()):
            size = "4 B" if s["bytes"] < 1024 else f"{s['bytes'] >> 20} MiB"
            rows.append(
                f"{name if i == 0 else '':<40} {size:>9} {s['raw_us']:>10} {s['aiodist_us']:>11} {s['overhead_us']:>9} "
                f"{s['raw_GBps']:>9.4g} {s['aiodist_GBps']:>9.4g}  {gaps if i == 0 else ''}"
            )
    return "\n".join(rows)


def _child(mode: str, quick: bool, json_path: str, timeout_s: float) -> int:
    """One mode, in this (child) process: its figures as JSON at ``json_path``."""
    import cupy as cp
    from cupy.cuda import nccl

    launch, completion, spin = mode.split(",")
    raw = Raw(cp, nccl)
    try:
        result = run_mode(cp, raw, launch, completion, spin, quick, timeout_s)
    finally:
        raw.close()
    with open(json_path, "w") as f:
        json.dump(result, f)
    return 0


def _spawn(mode: tuple[str, str, str], quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run one mode in a child process under a hard timeout: a mode that hangs (or crashes the
    process) is recorded, and the others still run."""
    launch, completion, spin = mode
    failed: dict[str, Any] = {"launch": launch, "completion": completion, "spin": bool(spin)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mode.json")
        argv = [sys.executable, "-m", "aiodist_cuda.bench", "--child", ",".join(mode), "--json", path, "--mode-timeout", str(timeout_s)]
        argv += ["--sizes", ",".join(map(str, SIZES)), "--big", str(_BIG[0])]
        if quick:
            argv.append("--quick")
        env = dict(os.environ)
        env.update(AIODIST_CUDA_LAUNCH=launch, AIODIST_CUDA_COMPLETION=completion)
        if spin:
            env["AIODIST_CUDA_SPIN"] = spin
        else:
            env.pop("AIODIST_CUDA_SPIN", None)
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s + 15)
        except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            failed["error"] = f"timed out after {timeout_s + 15:g} s (killed); stderr: {err[-1500:]}"
            return failed
        if proc.returncode != 0 or not os.path.exists(path):
            failed["error"] = f"exit {proc.returncode}; stderr: {proc.stderr[-1500:]}"
            return failed
        with open(path) as f:
            got: dict[str, Any] = json.load(f)
        return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m aiodist_cuda.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--modes", default="all", help="'all' or 'default' (launch=thread completion=thread only)")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds; modes left when it is spent are skipped")
    ap.add_argument("--mode-timeout", type=float, default=25.0, help="seconds one mode may take (its process is killed after)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes (multiples of 4), comma-separated")
    ap.add_argument("--big", type=int, default=GIB, help="bytes of the array awaited while the ticker runs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "launch,completion,spin": one mode, here
    args = ap.parse_args(argv)
    SIZES[:] = [int(x) for x in args.sizes.split(",")]
    _BIG[0] = args.big
    if not aiodist_cuda.is_available():
        why = aiodist_cuda.unavailable_reason()
        print(f"aiodist_cuda.bench: NCCL cannot run here: {why}", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": why}, f)
        return 2
    if args.child is not None:
        return _child(args.child, args.quick, args.json, args.mode_timeout)
    import cupy as cp

    t0 = time.monotonic()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    report: dict[str, Any] = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "cupy": cp.__version__,
        "nccl_version": aiodist_cuda.nccl_version(),
        "python": sys.version.split()[0],
        "quick": args.quick,
        "modes": [],
    }
    modes = MODES if args.modes == "all" else MODES[:1]
    for mode in modes:
        launch, completion, spin = mode
        if time.monotonic() - t0 > args.budget:
            report["modes"].append({"launch": launch, "completion": completion, "spin": bool(spin), "error": "skipped: time budget spent"})
            continue
        print(f"-- {mode_name(*mode)}", file=sys.stderr, flush=True)
        report["modes"].append(_spawn(mode, args.quick, args.mode_timeout))
        print(table({"modes": report["modes"][-1:]}).split("\n", 1)[1], file=sys.stderr, flush=True)
        report["seconds"] = round(time.monotonic() - t0, 2)
        if args.json:  # after every mode: a run cut short still leaves the figures so far
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    print(table(report))
    return 0 if all("error" not in m for m in report["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
