"""Where torch users rely on torch's exact behaviour: the same
exception types and words as torch, checked against torch 2.13 where torch is installed.

Each test fails before its fix: world_size=0 was taken as "not fixed"; the master's wait named
the time left (``after 1.99833 seconds``); the client pinged with a random nonce; PrefixStore
refused None with a TypeError; ``str(DebugLevel.DETAIL)`` was ``"2"``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from aiodist import DebugLevel, HashStore, TCPStore
from aiodist.errors import StoreTimeoutError
from aiodist.store import PrefixStore

pytestmark = pytest.mark.timeout(30)


def test_world_size_zero_is_refused_with_torchs_words() -> None:
    with pytest.raises(ValueError, match=r"^TCPStore world size cannot be 0$"):
        TCPStore("127.0.0.1", 0, 0, True)


async def test_a_negative_world_size_means_not_fixed_as_in_torch() -> None:
    async with TCPStore("127.0.0.1", 0, -1, True, timeout=5) as s:
        await s.set("k", "v")
        assert await s.get("k") == b"v"


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.5 s a run); a second loop waits them out again for the same result")
async def test_the_masters_wait_names_the_configured_timeout_in_seconds() -> None:
    with pytest.raises(StoreTimeoutError) as e:
        await TCPStore("127.0.0.1", 0, 2, True, timeout=0.5)
    assert str(e.value) == "Timed out after 1 seconds waiting for clients. 1/2 clients joined."


async def test_the_client_pings_with_its_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodist.store import _dial as tcp_mod  # (where a new connection's handshake is made)
    from aiodist.wire.store import Op

    pings: list[int] = []
    real = tcp_mod.encode

    def spy(op: Op, *args: object, **kw: object) -> bytes:
        if op == Op.PING:
            pings.append(int(kw["number"]))  # type: ignore[call-overload]
        return real(op, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(tcp_mod, "encode", spy)
    async with TCPStore("127.0.0.1", 0, 1, True, timeout=5) as s:
        await s.set("k", "v")
    # the connection's validation ping carries the pid (later pings only fence no-reply requests)
    assert pings and pings[0] == os.getpid() & 0xFFFFFFFF


def test_prefix_store_refuses_none_with_torchs_type_and_words() -> None:
    with pytest.raises(ValueError, match=r"^store argument cannot be None$"):
        PrefixStore("p", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PrefixStore("p", object())  # type: ignore[arg-type]
    PrefixStore("p", HashStore())


def test_debug_level_prints_as_torchs_enum() -> None:
    assert str(DebugLevel.DETAIL) == "DebugLevel.DETAIL" and f"{DebugLevel.OFF!s}" == "DebugLevel.OFF"
    assert DebugLevel.DETAIL == 2 and DebugLevel["INFO"] is DebugLevel.INFO and repr(DebugLevel.INFO) == "<DebugLevel.INFO: 1>"


# -- against torch 2.13, where it is installed ---------------------------------------------------


@pytest.fixture
def torch_dist():  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    return pytest.importorskip("torch.distributed")


def test_torch_says_the_same(torch_dist) -> None:  # type: ignore[no-untyped-def]
    import datetime

    with pytest.raises(ValueError, match=r"^TCPStore world size cannot be 0$"):
        torch_dist.TCPStore("127.0.0.1", 0, 0, True, timeout=datetime.timedelta(seconds=1))
    with pytest.raises(ValueError, match=r"^store argument cannot be None$"):
        torch_dist.PrefixStore("p", None)
    assert str(torch_dist.DebugLevel.DETAIL) == str(DebugLevel.DETAIL)
    with pytest.raises(RuntimeError) as e:  # torch's DistStoreError is a RuntimeError
        torch_dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=1))
    assert re.fullmatch(r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined\.", str(e.value))


async def test_an_unknown_rendezvous_scheme_is_a_runtime_error_as_in_torch() -> None:
    import aiodist

    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for foo://"):
        await aiodist.rendezvous("foo://x")
    with pytest.raises(ValueError):  # what aiodist raised before: still caught
        await aiodist.rendezvous("foo://x")


async def test_get_backend_of_a_group_this_rank_is_not_in() -> None:
    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        sub = await dist.new_group([0])
        if rank == 1:
            with pytest.raises(ValueError, match=r"^Invalid process group specified"):
                dist.get_backend(sub)
        else:
            assert dist.get_backend(sub) == "gloo"

    await run_world(2, fn, backend="gloo", timeout=20)


async def test_scatter_object_list_with_an_empty_output_list_uses_torchs_words() -> None:
    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match=r"Expected argument scatter_object_output_list to be a list of size at least 1\."):
            await dist.scatter_object_list([], [1, 2] if rank == 0 else None, src=0)

    await run_world(2, fn, backend="memory", timeout=20)


def test_torch_raises_the_same_types(torch_dist) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for foo://"):
        torch_dist.rendezvous("foo://x")


# -- a rank outside the group it passes: torch warns and returns ----------------------------------


async def test_a_rank_outside_the_group_warns_and_returns_without_communicating() -> None:
    """The tutorial "Writing Distributed Applications with PyTorch" with 4 processes: group
    [0, 1] all-reduces while ranks 2 and 3 make the same call with that group. torch warns on 2
    and 3 and returns; every op, p2p and object collective does the same (recv returns -1)."""
    import warnings

    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> dict[str, object]:
        g = await dist.new_group([0, 1])
        t = np.ones(1)
        await dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
        if rank >= 2:  # every call returns at once: the members below never take part
            one, out = np.ones(2), [np.zeros(2), np.zeros(2)]
            got: dict[str, object] = {
                "broadcast": await dist.broadcast(one, src=0, group=g),
                "reduce": await dist.reduce(one, dst=0, group=g, async_op=True),
                "all_gather": await dist.all_gather(out, one, group=g),
                "all_gather_into_tensor": await dist.all_gather_into_tensor(np.zeros(4), one, group=g),
                "gather": await dist.gather(one, group=g),
                "scatter": await dist.scatter(one, group=g),
                "reduce_scatter": await dist.reduce_scatter(one, out, group=g),
                "reduce_scatter_tensor": await dist.reduce_scatter_tensor(one, np.zeros(4), group=g),
                "all_to_all": await dist.all_to_all(out, out, group=g),
                "all_to_all_single": await dist.all_to_all_single(one, one, group=g),
                "barrier": await dist.barrier(group=g),
                "monitored_barrier": await dist.monitored_barrier(group=g),
                "all_reduce_coalesced": await dist.all_reduce_coalesced([one], group=g),
                "all_gather_coalesced": await dist.all_gather_coalesced([out], [one], group=g),
                "send": await dist.send(one, dst=0, group=g),
                "recv": await dist.recv(one, src=0, group=g),
                "isend": await dist.isend(one, dst=0, group=g),
                "irecv": await dist.irecv(one, src=0, group=g),
                "broadcast_object_list": await dist.broadcast_object_list([None], src=0, group=g),
                "all_gather_object": await dist.all_gather_object([None, None], 1, group=g),
                "gather_object": await dist.gather_object(1, None, group=g),
                "scatter_object_list": await dist.scatter_object_list([None], None, group=g),
                "send_object_list": await dist.send_object_list([1], dst=0, group=g),
                "recv_object_list": await dist.recv_object_list([None], src=0, group=g),
            }
            assert (one == 1).all() and all((o == 0).all() for o in out)
            await dist.destroy_process_group(g)  # torch: returns silently
            return {"value": float(t[0]), **got}
        return {"value": float(t[0])}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = await run_world(4, fn, timeout=20)
    assert [r["value"] for r in results] == [2.0, 2.0, 1.0, 1.0]
    for r in results[2:]:
        ops = [k for k in r if k != "value"]
        assert all(r[k] is None for k in ops if k not in ("recv", "recv_object_list"))
        assert r["recv"] == -1 and r["recv_object_list"] == -1
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    for rank in (2, 3):
        for op in ["all_reduce", *ops]:
            assert f"Running {op} on global rank {rank} which does not belong to the given group." in texts, (op, rank)
    assert not any("global rank 0" in x or "global rank 1" in x for x in texts)
    # the warning points at the caller's line (stacklevel), as torch's does
    assert {w.filename for w in caught if "does not belong" in str(w.message)} == {__file__}


# -- complex tensors and mixed-dtype coalesced ops --------------------------------------------------


@pytest.mark.parametrize("op", ["MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"])
async def test_an_op_complex_tensors_lack_is_torchs_value_error(op: str) -> None:
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        x = np.ones(3, np.complex64)
        for call in (  # torch's words name all_reduce for all_reduce_coalesced too
            lambda: dist.all_reduce(x, op=getattr(dist.ReduceOp, op)),
            lambda: dist.all_reduce_coalesced([np.ones(2), x], op=getattr(dist.ReduceOp, op)),
        ):
            with pytest.raises(ValueError, match=rf"^all_reduce does not support RedOpType\.{op} on complex tensors") as e:
                await call()  # the call itself raises: arguments are checked when it is made
            assert isinstance(e.value, TypeError)  # aiodist's type before: still caught
        assert (x == 1).all()
        await dist.barrier()  # nothing was sent: the group still works

    await run_world(2, fn, timeout=20)


async def test_all_reduce_coalesced_takes_mixed_dtypes() -> None:
    """torch reduces ``[float, float, cfloat]`` with SUM; aiodist any mix, one buffer per dtype,
    the same bits on every rank (a float64 and an int and a bfloat16-free mix here)."""
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    def inputs(rank: int) -> list[np.ndarray]:
        rng = np.random.default_rng(rank)
        return [
            rng.standard_normal(5).astype(np.float32),
            rng.standard_normal((2, 3)).astype(np.float32),
            (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
            rng.standard_normal(3),
            np.arange(4, dtype=np.int32) * (rank + 1),
        ]

    async def fn(rank: int) -> list[np.ndarray]:
        ts = inputs(rank)
        views = list(ts)
        await dist.all_reduce_coalesced(ts, op=dist.ReduceOp.SUM)
        assert all(a is b for a, b in zip(ts, views, strict=True))  # in place
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM(0.5)):  # (PRODUCT: refused on complex, as torch's)
            more = [np.full(2, 2.0 + rank, np.float32), np.full(2, 1 + 1j * rank, np.complex128)]
            await dist.all_reduce_coalesced(more, op=op)
            one = [np.full(2, 2.0 + rank, np.float32), np.full(2, 1 + 1j * rank, np.complex128)]
            for t in one:
                await dist.all_reduce(t, op=op)
            for a, b in zip(more, one, strict=True):
                np.testing.assert_array_equal(a, b)  # same bits as one all_reduce per tensor
        return ts

    n = 3
    results = await run_world(n, fn, timeout=20)
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()  # bitwise identical
    expected = [sum(inputs(r)[i].astype(np.complex128 if i == 2 else np.float64) for r in range(n)) for i in range(5)]
    for a, e in zip(results[0], expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5)


async def test_all_gather_coalesced_takes_mixed_dtypes() -> None:
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        ins = [np.full(2, rank, np.float32), np.full(3, 1j * rank, np.complex64), np.full(1, rank, np.int64)]
        outs = [[np.zeros_like(t) for t in ins] for _ in range(2)]
        await dist.all_gather_coalesced(outs, ins)
        for r in range(2):
            np.testing.assert_array_equal(outs[r][0], np.full(2, r, np.float32))
            np.testing.assert_array_equal(outs[r][1], np.full(3, 1j * r, np.complex64))
            np.testing.assert_array_equal(outs[r][2], np.full(1, r, np.int64))

    await run_world(2, fn, timeout=20)


def test_torch_refuses_max_on_complex_and_coalesces_mixed_dtypes(torch_dist, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch 2.13 itself, one gloo process: the same ValueError words, and a [float, float,
    cfloat] SUM through all_reduce_coalesced."""
    import torch

    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^all_reduce does not support RedOpType\.MAX on complex tensors$"):
            torch_dist.all_reduce(torch.ones(2, dtype=torch.cfloat), op=torch_dist.ReduceOp.MAX)
        ts = [torch.ones(2), torch.ones(3), torch.ones(2, dtype=torch.cfloat)]
        with pytest.warns(FutureWarning):
            torch_dist.all_reduce_coalesced(ts, op=torch_dist.ReduceOp.SUM)
        assert all((t == 1).all() for t in ts)
    finally:
        torch_dist.destroy_process_group()


# -- monitored_barrier: torch's words ---------------------------------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("wait_all", [False, True])
async def test_monitored_barrier_names_absent_ranks_in_torchs_words(wait_all: bool) -> None:
    """Ranks that never enter the barrier at all: rank 0 says torch's sentence (group ranks),
    with the global ranks where they differ and the word timeout."""
    import asyncio

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> str:
        sub = await dist.new_group([0, 2, 3, 4])  # group ranks 0..3 are global 0, 2, 3, 4
        if rank in (1, 3, 4):
            await asyncio.sleep(1.2)  # 3 and 4 never call it; 1 is not in the group
            return ""
        with pytest.raises(dist.DistError) as e:  # rank 0: DistTimeoutError; rank 2: its verdict
            await dist.monitored_barrier(sub, timeout=0.4, wait_all_ranks=wait_all)
        assert rank != 0 or isinstance(e.value, dist.DistTimeoutError)
        return str(e.value)

    out = await run_world(5, fn, timeout=20)
    if wait_all:
        assert "[Rank 0]: Ranks 2, 3 failed to pass monitoredBarrier in 400 ms (global ranks 3, 4)" in out[0]
    else:
        assert "[Rank 0]: Rank 2 failed to pass monitoredBarrier in 400 ms (global rank 3)" in out[0]
    assert re.search(r"[Tt]imeout", out[0]) and "seq 0" in out[0]
    assert "failed to pass monitoredBarrier" in out[2]  # rank 0's verdict reached global rank 2


# RANK PATH: torch gloo over a FileStore; rank 0 prints the first line of its monitored_barrier error
_TORCH_MONITORED = Path(__file__).resolve().parent / "helpers" / "torch_monitored_barrier.py"


def test_torch_says_the_same_monitored_barrier_words(torch_dist, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    path = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, str(_TORCH_MONITORED), str(r), path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert outs[0].strip() == "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 700 ms"


# -- new_subgroups / new_subgroups_by_enumeration -------------------------------------------------


async def test_new_subgroups_splits_the_world_as_torch() -> None:
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        mine, subs = await dist.new_subgroups(group_size=2)
        assert len(subs) == 2 and subs[rank // 2] is mine
        assert subs[1 - rank // 2] == dist.NON_GROUP_MEMBER
        assert isinstance(mine, dist.ProcessGroup) and dist.get_process_group_ranks(mine) == [rank // 2 * 2, rank // 2 * 2 + 1]
        x = np.array([float(rank)])
        await dist.all_reduce(x, group=mine)
        assert x[0] == (1.0 if rank < 2 else 5.0)
        # by enumeration: the odd and the even ranks; a rank in no list gets None
        mine2, subs2 = await dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        assert len(subs2) == 2 and mine2 is subs2[rank % 2] and dist.get_process_group_ranks(mine2) == [rank % 2, rank % 2 + 2]
        none, subs3 = await dist.new_subgroups_by_enumeration([[0, 1]])
        assert (none is None) == (rank >= 2) and len(subs3) == 1
        # of a group: its ranks, in consecutive pairs
        pairs_of_evens, _ = await dist.new_subgroups(group_size=1, group=mine2)
        assert dist.get_process_group_ranks(pairs_of_evens) == [rank]  # type: ignore[arg-type]
        # refusals, in torch's words, before any group is made (the counter stays in step)
        for kw, words in (
            ({"group_size": 0}, r"The arg 'group_size' \(0\) must be positive"),
            ({"group_size": 8}, r"The arg 'group_size' \(8\) must not exceed the world size \(4\)"),
            ({"group_size": 3}, r"The world size \(4\) must be divisible by 'group_size=3'"),
            ({}, r"Default group size only takes effect when CUDA is available"),
        ):
            with pytest.raises(ValueError, match=words):
                await dist.new_subgroups(**kw)
        with pytest.raises(ValueError, match=r"Rank 1 has appeared in both subgroup \[0, 1\] and \[1, 2\]"):
            await dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])
        with pytest.raises(ValueError, match=r"The arg 'ranks_per_subgroup_list' cannot be empty"):
            await dist.new_subgroups_by_enumeration([])
        after = await dist.new_group([0, 1, 2, 3])
        y = np.ones(1)
        await dist.all_reduce(y, group=after)
        assert y[0] == 4

    await run_world(4, fn, timeout=20)


def test_torch_new_subgroups_says_the_same(torch_dist, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^Default group size only takes effect when CUDA is available"):
            torch_dist.new_subgroups()
        with pytest.raises(ValueError, match=r"^The arg 'group_size' \(2\) must not exceed the world size \(1\)$"):
            torch_dist.new_subgroups(group_size=2)
        with pytest.raises(ValueError, match=r"^The arg 'ranks_per_subgroup_list' cannot be empty$"):
            torch_dist.new_subgroups_by_enumeration([])
        mine, subs = torch_dist.new_subgroups(group_size=1)
        assert len(subs) == 1 and subs[0] is mine
    finally:
        torch_dist.destroy_process_group()


# -- "timeout" in every timeout message --------------------------------------------------------------


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.8 s a run); a second loop waits them out again for the same result")
async def test_every_timeout_message_says_timeout() -> None:
    """torch users match ``[Tt]imeout``: a collective's, a barrier's, ``Work.wait``'s and init's
    timeouts all say it (aiodist's detail kept after it)."""
    import asyncio

    import numpy as np

    import aiodist as dist
    from aiodist.errors import DistTimeoutError
    from aiodist.testing import run_world

    async def fn(rank: int) -> list[str]:
        msgs = []
        if rank == 0:
            with pytest.raises(DistTimeoutError) as e:
                await dist.all_reduce(np.ones(2))
            msgs.append(str(e.value))
        else:
            await asyncio.sleep(0.8)
        return msgs

    out = await run_world(2, fn, timeout=20, pg_timeout=0.3)
    assert out[0] and all(re.search(r"[Tt]imeout", m) for m in out[0]), out[0]
    assert "all_reduce on default_pg" in out[0][0] and "timed out after" in out[0][0]  # the detail stays

    async def wait_fn(rank: int) -> str:
        if rank == 1:
            await asyncio.sleep(0.5)
            await dist.barrier()
            return ""
        w = await dist.barrier(async_op=True)
        with pytest.raises(DistTimeoutError) as e:
            await w.wait(timeout=0.1)
        await w
        return str(e.value)

    msg = (await run_world(2, wait_fn, timeout=20))[0]
    assert re.search(r"[Tt]imeout", msg) and "Work.wait: barrier" in msg

    with pytest.raises(DistTimeoutError) as e:  # init: the other rank never comes
        await dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=0.5)
    assert re.search(r"[Tt]imeout", str(e.value))
    assert not dist.is_initialized()


def test_a_timeout_error_without_the_word_gets_it() -> None:
    from aiodist.errors import DistTimeoutError, StoreTimeoutError

    assert str(DistTimeoutError("x timed out after 1 s")) == "Timeout: x timed out after 1 s"
    assert str(DistTimeoutError("wait timeout after 3 ms")) == "wait timeout after 3 ms"
    assert (
        str(StoreTimeoutError("Timed out after 2 seconds waiting for clients.")) == "Timed out after 2 seconds waiting for clients."
    )  # torch's own


# -- argument errors keep torch's words -------------------------------------------------------------


async def test_rank_argument_errors_say_torchs_words() -> None:
    import numpy as np

    import aiodist as dist
    from aiodist.testing import run_world

    async def fn(rank: int) -> None:
        x = np.ones(1)
        with pytest.raises(ValueError, match=r"^Can't specify both group_rank and global_rank"):
            await dist.broadcast(x, src=0, group_src=0)
        with pytest.raises(ValueError, match=r"^Must specify global_rank or group_rank"):
            await dist.broadcast(x)
        with pytest.raises(
            ValueError, match=r"^Invalid destination rank: destination rank should not be the same as the rank of the current process\."
        ):
            await dist.send(x, dst=rank)
        g = dist.group.WORLD
        for call in (lambda: dist.get_group_rank(g, 5), lambda: dist.get_global_rank(g, 5)):
            with pytest.raises(ValueError, match=r"rank 5 is not part of group") as e:  # torch 2.13's type
                call()
            assert isinstance(e.value, RuntimeError)  # aiodist's type before (and torch's docs')
        await dist.barrier()

    await run_world(2, fn, timeout=20)


def test_torch_rank_argument_words(torch_dist, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.ones(1)
        with pytest.raises(ValueError, match=r"^Can't specify both group_rank and global_rank$"):
            torch_dist.broadcast(x, src=0, group_src=0)
        with pytest.raises(ValueError, match=r"^Must specify global_rank or group_rank$"):
            torch_dist.broadcast(x)
        with pytest.raises(
            ValueError, match=r"^Invalid destination rank: destination rank should not be the same as the rank of the current process\.$"
        ):
            torch_dist.send(x, dst=0)
        sub = torch_dist.new_group([0])  # (torch answers for the WORLD group without checking)
        with pytest.raises(ValueError, match=r"^Global rank 5 is not part of group"):
            torch_dist.get_group_rank(sub, 5)
        with pytest.raises(ValueError, match=r"^Group rank 5 is not part of group"):
            torch_dist.get_global_rank(sub, 5)
    finally:
        torch_dist.destroy_process_group()
