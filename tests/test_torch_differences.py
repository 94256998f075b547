"""The last places where torch's own tests (``distributed_test.py``) or a torch user's habits
told aiodist apart from torch, each checked here in torch's terms:

- a barrier's timeout says " timeout " as a word of its own (torch's tests match
  ``" (Timed out|closed|timeout) "``), after the culprit-first headline;
- every reduce op torch refuses on complex tensors (MAX, MIN, PRODUCT, BAND, BOR, BXOR) is a
  ``ValueError`` on the calling rank before anything is sent, in torch's words, for
  ``all_reduce_coalesced`` too (``all_reduce does not support ...``);
- the communicating calls pass for coroutine functions (``inspect.iscoroutinefunction`` on
  Python 3.12+, ``asyncio.iscoroutinefunction`` everywhere), ``init_process_group`` included;
- at debug level OFF, a desync names the other side's shape too where its message's size tells it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.rank_procs import run_ranks

import aiodist as dist
from aiodist import FileStore, HashStore, TCPStore
from aiodist._digest import op_digest, their_arguments
from aiodist.errors import DistTimeoutError
from aiodist.store import PrefixStore
from aiodist.testing import run_world
from aiodist.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

R = dist.ReduceOp
TORCH_TIMEOUT_WORDS = re.compile(" (Timed out|closed|timeout) ")  # torch's _test_barrier_timeout
COMPLEX_REFUSED = [R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR]  # torch's test_all_reduce_complex_unsupported_ops


# -- a barrier's timeout, in torch's words, culprits first ---------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.0 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("backend", ["gloo", "memory"])
@pytest.mark.parametrize("subgroup", [False, True], ids=["default_group", "full_subgroup"])
async def test_a_barrier_timeout_says_timeout_after_the_culprits(backend: str, subgroup: bool) -> None:
    """torch's test_barrier_timeout_group / _full_group: only group rank 0 calls barrier."""
    done = asyncio.Event()

    async def fn(rank: int) -> str | None:
        group = await dist.new_group([0, 1, 2], timeout=1) if subgroup else None
        if rank != 0:  # alive, never calls it, until rank 0 has its error
            await asyncio.wait_for(done.wait(), 15)
            return None
        try:
            start = time.monotonic()
            with pytest.raises(DistTimeoutError) as e:
                await dist.barrier(group)
            elapsed = time.monotonic() - start
            # torch checks the error is not raised early (delta 0.1 s at its 5 s); the grace in
            # which the store is asked ends before the timeout, and the error must still wait for it
            assert elapsed >= 0.99, f"raised {1 - elapsed:.3f} s before the 1 s timeout"
            return str(e.value)
        finally:
            done.set()

    msg = (await run_world(3, fn, backend=backend, timeout=20, pg_timeout=1))[0]
    assert msg is not None
    assert TORCH_TIMEOUT_WORDS.search(msg), msg
    # the headline stays first (whom rank 0 waits on first depends on the backend's barrier)
    assert re.match(r"(rank [12]|ranks \[1, 2\]) never issued barrier seq 0 of group", msg), msg
    assert "seq 0 timed out after 1 s on rank 0 (the timeout of the group)" in msg, msg


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.1 s a run); a second loop waits them out again for the same result")
async def test_a_timeout_of_the_calls_own_says_so() -> None:
    """monitored_barrier runs under its own timeout, not the group's: a rank whose group rank 0
    never comes fails at that deadline, naming rank 0 first."""
    done = asyncio.Event()

    async def fn(rank: int) -> str | None:
        if rank == 0:
            await asyncio.wait_for(done.wait(), 15)
            return None
        try:
            with pytest.raises(DistTimeoutError) as e:
                await dist.monitored_barrier(timeout=0.5)
            return str(e.value)
        finally:
            done.set()

    msg = (await run_world(2, fn, timeout=20, pg_timeout=5))[1]
    assert msg is not None and TORCH_TIMEOUT_WORDS.search(msg), msg
    assert msg.startswith("rank 0 never issued monitored_barrier seq 0"), msg
    assert "on rank 1 (the timeout of the call)" in msg, msg


# -- complex tensors: torch's refusals -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
async def test_every_op_torch_refuses_on_complex_is_a_value_error_before_anything_is_sent(dtype: str) -> None:
    async def fn(rank: int) -> None:
        pg = dist.group.WORLD
        assert pg is not None
        seq = pg.seq
        x = np.full(3, 1 + 2j, dtype)
        for op in COMPLEX_REFUSED:
            with pytest.raises(ValueError, match=f"^all_reduce does not support RedOpType.{op.name} on complex tensors"):
                await dist.all_reduce(x, op)
            with pytest.raises(ValueError, match=f"^all_reduce does not support RedOpType.{op.name} on complex tensors"):
                await dist.all_reduce_coalesced([x], op)
            with pytest.raises(ValueError, match=f"does not support RedOpType.{op.name} on complex tensors"):
                await dist.reduce(x, dst=0, op=op)
        assert pg.seq == seq, "a refused op took a sequence number"
        assert x.tolist() == [1 + 2j] * 3
        await dist.all_reduce(x)  # the group is still usable
        assert x.tolist() == [3 + 6j] * 3

    await run_world(3, fn, backend="gloo", timeout=20, pg_timeout=10)


async def test_torchs_complex_tests_as_torch_writes_them() -> None:
    """test_all_reduce_complex_unsupported_ops and test_all_reduce_coalesced_max_complex_unsupported."""
    torch = pytest.importorskip("torch")

    async def fn(rank: int) -> None:
        for op in COMPLEX_REFUSED:
            with pytest.raises(ValueError, match="all_reduce does not support"):
                await dist.all_reduce(torch.ones(1, dtype=torch.cfloat), op)
        with pytest.raises(ValueError, match="all_reduce does not support"):
            await dist.all_reduce_coalesced([torch.ones(1, dtype=torch.cfloat)], R.MAX)
        t = torch.full((2,), 1 + 1j, dtype=torch.cfloat)
        await dist.all_reduce_coalesced([t, torch.ones(2)], R.SUM)  # SUM on complex still works
        assert t.tolist() == [2 + 2j] * 2

    await run_world(2, fn, backend="gloo", timeout=20, pg_timeout=10)


# -- coroutine functions ------------------------------------------------------------------------------


def _asyncio_says_coroutine_function(fn: Any) -> bool:
    with warnings.catch_warnings():  # deprecated from Python 3.14
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(asyncio.iscoroutinefunction(fn))


def _communicating_calls() -> dict[str, Any]:
    calls = {name: getattr(dist, name) for name in dir(dist) if hasattr(getattr(dist, name), "__wrapped_coroutine__")}
    for cls in (TCPStore, HashStore, FileStore, PrefixStore):
        for name in ("get", "set", "add", "wait", "compare_set", "multi_get", "queue_pop", "barrier"):
            calls[f"{cls.__name__}.{name}"] = getattr(cls, name)
    return calls


def test_every_communicating_call_passes_for_a_coroutine_function() -> None:
    assert hasattr(dist.init_process_group, "__wrapped_coroutine__")
    calls = _communicating_calls()
    for name in ("all_reduce", "barrier", "broadcast", "init_process_group", "new_group", "destroy_process_group", "send", "recv"):
        assert name in calls, sorted(calls)
    assert len(calls) > 60, sorted(calls)
    for name, fn in calls.items():
        assert _asyncio_says_coroutine_function(fn), name
        if sys.version_info >= (3, 12):
            assert inspect.iscoroutinefunction(fn), name
    assert not _asyncio_says_coroutine_function(dist.get_rank)  # the queries stay plain


async def test_the_marked_calls_still_start_when_called_and_stores_keep_their_fast_path() -> None:
    async def fn(rank: int) -> None:
        handle = dist.all_reduce(np.ones(2))
        assert type(handle).__name__ == "Pending"  # still a started handle, not a coroutine
        await handle

    await run_world(2, fn, timeout=20)
    # TCPStore.get is a plain function with a hot path; the store's subclass hook does not wrap it
    assert TCPStore.get.__code__.co_name == "get" and not TCPStore.get.__code__.co_flags & inspect.CO_COROUTINE

    class Again(HashStore):  # a subclass that names an already-made call is not wrapped twice
        get = HashStore.get

    assert Again.get is HashStore.get
    async with TCPStore("127.0.0.1", 0, 1, True, timeout=5) as s:
        await s.set("k", "v")
        assert await s.get("k") == b"v"


# -- a desync at OFF names both sides' shapes -------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("warm", [False, True], ids=["first_op", "later_op"])
async def test_a_desync_names_the_other_sides_shape(n: int, warm: bool) -> None:
    async def fn(rank: int) -> str:
        if warm:
            await dist.all_reduce(np.ones(3))
        with pytest.raises(dist.DistError) as e:
            await dist.all_reduce(np.ones(5 if rank == 1 else 4, np.float32))
        return str(e.value)

    for msg in await run_world(n, fn, backend="gloo", timeout=20, pg_timeout=20):
        assert "both called all_reduce with different arguments" in msg, msg
        assert re.search(r"rank 1 has tensor float32\[5\]", msg) and re.search(r"rank \d has tensor float32\[4\]", msg), msg
        assert "'s differ" not in msg, msg


def test_their_arguments_reads_a_whole_message_a_part_of_one_and_another_dtype() -> None:
    mine = {"tensor": "float32[1000]", "op": "SUM"}
    peer = {"tensor": "float32[1001]", "op": "SUM"}
    d = op_digest("all_reduce", peer)
    assert their_arguments("all_reduce", mine, d, 4004, 2) == peer  # the whole tensor
    assert their_arguments("all_reduce", mine, d, 4 * 251, 4) == peer  # a quarter of it (251 of 1001)
    wide = {"tensor": "float64[1000]", "op": "SUM"}
    assert their_arguments("all_reduce", mine, op_digest("all_reduce", wide), 8000, 2) == wide
    grid = {"tensor": "float32[3, 5]", "op": "SUM"}
    assert their_arguments("all_reduce", {"tensor": "float32[3, 4]", "op": "SUM"}, op_digest("all_reduce", grid), 60, 2) == grid
    # a size that tells nothing (a control message), or another op: no guess is made
    assert their_arguments("all_reduce", mine, d, 2, 2) is None
    assert their_arguments("all_reduce", mine, op_digest("all_reduce", {"tensor": "float32[1000]", "op": "MAX"}), 4000, 2) is None


ROOT = Path(__file__).resolve().parents[1]
LANE_DESYNC = ROOT / "tests" / "helpers" / "shape_desync_rank.py"  # WHEN: all_reduce of float32[5] on rank 1, [4] elsewhere


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", [False, True], ids=["first_op", "later_op"])
def test_a_desync_between_processes_names_both_shapes(warm: bool) -> None:
    """Same-host processes: the group's first op agrees on shared memory (its vote tells no
    shape), then small all_reduces go through the latency lane, whose slot heads carry the size."""
    port = str(free_port())
    envs = [dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2") for r in range(2)]
    for out in run_ranks([[sys.executable, str(LANE_DESYNC), "later_op" if warm else "first_op"]] * 2, envs, 60.0):
        msg = out["msg"]
        assert "rank 1 has tensor float32[5]" in msg and "rank 0 has tensor float32[4]" in msg, json.dumps(out)
