"""aiodist.multiprocessing.spawn / start_processes: async and plain functions in real child
processes doing an aiodist all_reduce (tcp:// and env://), a child that raises (the parent's
error names its rank and carries its traceback; the other child is stopped), ``join=False``
contexts, a child killed by a signal, a non-zero exit. Children started here are stopped by
their context (our own pids only); every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import aiodist as dist
from aiodist.multiprocessing import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)
from aiodist.testing.ports import free_port

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90)]

WORLD = 2


# -- what the children run (module level: the spawn start method pickles them by name) ---------


async def _all_reduce_job(rank: int, world: int, out_dir: str, how: str) -> None:
    await dist.init_process_group("gloo", init_method=None if how == "env" else how, rank=rank, world_size=world, timeout=30)
    try:
        x = np.arange(4, dtype=np.float64) * (rank + 1)
        await dist.all_reduce(x)
        await dist.barrier()
    finally:
        await dist.destroy_process_group()
    loop = type(asyncio.get_running_loop())
    record = {"rank": rank, "all_reduce": x.tolist(), "loop": f"{loop.__module__}.{loop.__qualname__}"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


async def async_all_reduce(rank: int, port: int, out_dir: str) -> None:
    await _all_reduce_job(rank, WORLD, out_dir, f"tcp://127.0.0.1:{port}")


def sync_all_reduce(rank: int, port: int, out_dir: str) -> None:
    # a plain function: it runs its own loop, over env:// as a torch user's worker would
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    asyncio.run(_all_reduce_job(rank, WORLD, out_dir, "env"))


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _wait_for(path: Path, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


async def fail_in_rank_1(rank: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    if rank == 1:
        _wait_for(Path(pid_dir, "0.pid"))  # rank 0 is running its function: it must be stopped
        raise ValueError("boom from rank 1")
    await asyncio.sleep(60)


def sync_fail_in_rank_1(rank: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    if rank == 1:
        _wait_for(Path(pid_dir, "0.pid"))
        raise KeyError("sync boom")
    time.sleep(60)


async def sleep_then_return(rank: int, pid_dir: str, seconds: float) -> None:
    _write_pid(pid_dir, rank)
    await asyncio.sleep(seconds)


def exit_with(rank: int, code: int) -> None:
    if rank == 1:
        sys.exit(code)


# -- helpers ------------------------------------------------------------------------------------


def _dead(pid: int) -> bool:
    """Gone, or a zombie (a child re-parented to an init that does not reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _read_results(out_dir: Path) -> list[dict[str, object]]:
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]


# -- tests --------------------------------------------------------------------------------------


def test_spawn_async_function_all_reduce_over_tcp(tmp_path: Path) -> None:
    assert spawn(async_all_reduce, args=(free_port(), str(tmp_path)), nprocs=WORLD) is None
    results = _read_results(tmp_path)
    want = (np.arange(4) * sum(r + 1 for r in range(WORLD))).tolist()
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["all_reduce"] == want
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert all(str(r["loop"]).startswith("asyncio.") for r in results)
    else:
        assert all(str(r["loop"]).startswith("uvloop") for r in results), results


def test_spawn_plain_function_all_reduce_over_env(tmp_path: Path) -> None:
    spawn(sync_all_reduce, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    want = (np.arange(4) * 3).tolist()
    assert [r["all_reduce"] for r in _read_results(tmp_path)] == [want, want]


def test_failure_in_rank_1_names_it_with_traceback_and_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException) as info:
        spawn(fail_in_rank_1, args=(str(tmp_path),), nprocs=WORLD)
    elapsed = time.monotonic() - start
    err = info.value
    assert isinstance(err, ProcessException)
    assert err.error_index == 1
    assert err.pid == int(Path(tmp_path, "1.pid").read_text())
    msg = str(err)
    assert "-- Process 1 terminated with the following error:" in msg
    assert "Traceback (most recent call last):" in msg
    assert "in fail_in_rank_1" in msg and "ValueError: boom from rank 1" in msg
    # rank 0 was sleeping 60 s: it was stopped, not waited for
    assert elapsed < 30, elapsed
    assert _dead(int(Path(tmp_path, "0.pid").read_text()))


def test_failure_of_a_plain_function_forked(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException) as info:
        start_processes(sync_fail_in_rank_1, args=(str(tmp_path),), nprocs=WORLD, start_method="fork")
    assert info.value.error_index == 1
    assert "KeyError: 'sync boom'" in str(info.value) and "in sync_fail_in_rank_1" in str(info.value)
    assert time.monotonic() - start < 30
    assert _dead(int(Path(tmp_path, "0.pid").read_text()))


def test_join_false_returns_a_context_that_joins_as_torchs(tmp_path: Path) -> None:
    ctx = spawn(sleep_then_return, args=(str(tmp_path), 1.0), nprocs=WORLD, join=False)
    assert isinstance(ctx, ProcessContext)
    try:
        assert len(ctx.pids()) == WORLD and all(p > 0 for p in ctx.pids())
        assert ctx.join(timeout=0.05) is False  # still starting / sleeping
        deadline = time.monotonic() + 30
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "children did not finish"
        assert ctx.join() is True  # joining a finished context again is fine
        assert [p.exitcode for p in ctx.processes] == [0] * WORLD
    finally:
        ctx.terminate(grace_period=5)


def test_child_killed_by_a_signal(tmp_path: Path) -> None:
    ctx = spawn(sleep_then_return, args=(str(tmp_path), 60.0), nprocs=WORLD, join=False)
    assert ctx is not None
    try:
        for r in range(WORLD):
            _wait_for(Path(tmp_path, f"{r}.pid"))
        victim = ctx.pids()[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ProcessExitedException) as info:
            deadline = time.monotonic() + 30
            while not ctx.join(timeout=1):
                assert time.monotonic() < deadline
        err = info.value
        assert err.error_index == 1 and err.pid == victim
        assert err.signal_name == "SIGKILL" and err.exit_code == -signal.SIGKILL
        assert "process 1 terminated with signal SIGKILL" in str(err)
        assert ctx.processes[0].exitcode == -signal.SIGTERM  # the other one was stopped
    finally:
        ctx.terminate(grace_period=5)


def test_non_zero_exit_code(tmp_path: Path) -> None:
    with pytest.raises(ProcessExitedException, match="process 1 terminated with exit code 3") as info:
        start_processes(exit_with, args=(3,), nprocs=WORLD, start_method="fork")
    assert info.value.exit_code == 3 and info.value.signal_name is None


def test_exceptions_pickle_and_arguments_are_checked() -> None:
    e = ProcessExitedException("process 2 terminated with signal SIGTERM", 2, 1234, -15, "SIGTERM")
    back = pickle.loads(pickle.dumps(e))
    assert (back.error_index, back.pid, back.exit_code, back.signal_name, str(back)) == (2, 1234, -15, "SIGTERM", str(e))
    r = pickle.loads(pickle.dumps(ProcessRaisedException("tb", 0, 7)))
    assert isinstance(r, ProcessException) and (r.error_index, r.pid, r.msg) == (0, 7, "tb")
    with pytest.raises(ValueError):
        spawn(exit_with, nprocs=0)
    with pytest.warns(FutureWarning, match="start_method=spawn"):
        spawn(exit_with, args=(0,), nprocs=1, start_method="fork")


# MODE PID_DIR: spawns two children of sleep_then_return, then kills or interrupts itself
PARENT = Path(__file__).resolve().parent / "helpers" / "spawn_parent.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("mode", ["orphan", "orphan-ignoring-sigint"], ids=["plain", "parent-ignores-sigint"])
def test_children_do_not_outlive_a_killed_parent(tmp_path: Path, mode: str) -> None:
    """A SIGKILLed parent's children die (PR_SET_PDEATHSIG). Also when the parent ignores SIGINT,
    as a job a shell started in the background does: the children must not inherit that, since
    SIGINT is their death signal (found: a test run started with `&`)."""
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as fo, err.open("w") as fe:  # files, not pipes: orphans holding a pipe would block the wait
        proc = subprocess.run([sys.executable, str(PARENT), mode, str(tmp_path)], stdout=fo, stderr=fe, timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.read_text()
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == WORLD
    deadline = time.monotonic() + 20
    try:
        while not all(_dead(p) for p in pids):
            assert time.monotonic() < deadline, f"children {pids} outlived their parent"
            time.sleep(0.05)
    finally:
        for p in pids:
            if not _dead(p) and int(Path(tmp_path, f"{pids.index(p)}.pid").read_text()) == p:
                os.kill(p, signal.SIGKILL)  # our own child, if the death signal failed


def test_interrupted_parent_stops_its_children_before_raising(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with out.open("w") as fo:
        proc = subprocess.Popen([sys.executable, str(PARENT), "interrupted", str(tmp_path)], stdout=fo, stderr=subprocess.PIPE, text=True)
        try:
            for r in range(WORLD):
                _wait_for(Path(tmp_path, f"{r}.pid"))
            os.kill(proc.pid, signal.SIGINT)  # the parent only, as a signal from its supervisor would be
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.read_text().split() == ["interrupted", "1", "1"]  # both children gone when spawn re-raised
