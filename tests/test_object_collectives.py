"""The object collectives (aiodist.c10d.objects) and collective_utils.all_gather_object_enforce_type:
world sizes 1-5 and every root over the memory backend, some over the socket backend ("gloo"),
torch's documented examples, uneven object sizes, argument errors that leave the group usable."""

from __future__ import annotations

import asyncio
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.c10d.objects import (
    PICKLE_PROTOCOL,
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from aiodist.collective_utils import all_gather_object_enforce_type
from aiodist.testing import run_world

SIZES = [1, 2, 3, 4, 5]
MB = 1 << 20


@dataclass
class Point:
    x: int
    y: list[int]


def obj_of(rank: int, salt: int = 0) -> Any:
    """A different, nested, picklable object per rank (sizes differ too)."""
    kinds: list[Any] = [
        f"rank {rank}/{salt}",
        {"rank": rank, "salt": salt, "list": list(range(rank))},
        Point(rank, [salt] * rank),
        np.arange(rank + salt, dtype=np.float32),
        (rank, None, b"\x00" * rank),
    ]
    return kinds[(rank + salt) % len(kinds)]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def same_list(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


async def still_usable(rank: int) -> None:
    """A collective after an argument error: the group took no sequence number and works."""
    out: list[Any] = [None] * dist.get_world_size()
    await all_gather_object(out, ("ok", rank))
    assert out == [("ok", r) for r in range(dist.get_world_size())]


# -- broadcast_object_list ---------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_object_list_every_root(n: int) -> None:
    async def fn(rank: int) -> None:
        for root in range(n):
            mine = [obj_of(root, k) for k in range(4)]
            objs = list(mine) if rank == root else [None] * 4
            await broadcast_object_list(objs, src=root)
            assert same_list(objs, mine)
            if rank == root:  # the source's list is left as it is: the same objects
                assert all(a is b for a, b in zip(objs, mine))
            # group_src names the same rank (the default group: group rank == global rank)
            objs2 = [obj_of(root, 9)] if rank == root else ["stale"]
            await broadcast_object_list(objs2, group_src=root)
            assert same_list(objs2, [obj_of(root, 9)])

    await run_world(n, fn)


async def test_broadcast_object_list_doc_example() -> None:
    """torch's docstring example (world size 3, device given, src=0)."""

    async def fn(rank: int) -> list[Any]:
        objects: list[Any] = ["foo", 12, {1: 2}] if rank == 0 else [None, None, None]
        await broadcast_object_list(objects, src=0, device="cpu")
        return objects

    assert await run_world(3, fn) == [["foo", 12, {1: 2}]] * 3


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_broadcast_object_list_defaults_to_rank_0_and_empty_lists(n: int) -> None:
    async def fn(rank: int) -> None:
        objs: list[Any] = ["zero", 0] if rank == 0 else [None, None]
        await broadcast_object_list(objs)
        assert objs == ["zero", 0]
        empty: list[Any] = []
        await broadcast_object_list(empty, src=n - 1)
        assert empty == []

    await run_world(n, fn)


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_broadcast_object_list_uneven_sizes(n: int) -> None:
    """One object of 1 MB next to tiny ones; the receivers allocate exactly the pickles' total."""
    big = np.random.default_rng(0).integers(0, 256, MB, dtype=np.uint8).tobytes()

    async def fn(rank: int) -> None:
        for root in range(n):
            objs: list[Any] = [1, big, "x", None] if rank == root else [None] * 4
            await broadcast_object_list(objs, src=root)
            assert objs[0] == 1 and objs[1] == big and objs[2] == "x" and objs[3] is None

    await run_world(n, fn)


async def test_broadcast_object_list_length_mismatch_across_ranks_fails_the_op() -> None:
    """Lengths that differ across ranks cannot be seen locally: the size message does not fit,
    the op fails on the rank that notices (and breaks the group), and no rank hangs."""

    async def fn(rank: int) -> str:
        objs: list[Any] = ["a", "b", "c"] if rank == 0 else [None, None]
        try:
            await broadcast_object_list(objs, src=0)
        except dist.DistError as exc:
            return f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
        return "ok"

    for backend in ("memory", "gloo"):
        results = await run_world(2, fn, backend=backend, pg_timeout=2, timeout=20)
        # the receiver's sizes buffer (2 int64) does not fit the 3 sizes sent; the source may finish
        assert results[1].startswith("DistBackendError"), results
        if backend == "gloo":  # the socket backend's frame digest catches it first, in the call's terms
            # whichever rank compares digests first names its own side; the other learns it by the abort
            assert "both called broadcast with different arguments" in results[1], results
            assert ("rank 1 has tensor int64[2]" in results[1]) or ("rank 0 has tensor int64[3]" in results[1]), results
        else:
            assert "24 bytes" in results[1], results
        assert "the sizes of 2 objects" in results[1] and "lengths differ across ranks" in results[1]


# -- all_gather_object ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
async def test_all_gather_object(n: int) -> None:
    async def fn(rank: int) -> None:
        for salt in range(3):
            out: list[Any] = [None] * n
            mine = obj_of(rank, salt)
            await all_gather_object(out, mine)
            assert same_list(out, [obj_of(r, salt) for r in range(n)])
            if not isinstance(mine, (str, tuple)):  # the own entry is an unpickled copy, as in torch
                assert out[rank] is not mine

    await run_world(n, fn)


async def test_all_gather_object_doc_example() -> None:
    gather_objects: list[Any] = ["foo", 12, {1: 2}]

    async def fn(rank: int) -> list[Any]:
        output: list[Any] = [None for _ in gather_objects]
        await all_gather_object(output, gather_objects[dist.get_rank()])
        return output

    assert await run_world(3, fn) == [["foo", 12, {1: 2}]] * 3


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_all_gather_object_uneven_sizes(n: int) -> None:
    """Rank 1's object is 1 MB, the others a few bytes: nothing is padded to the largest."""

    async def fn(rank: int) -> None:
        mine = bytes([rank]) * MB if rank == 1 else rank
        out: list[Any] = [None] * n
        await all_gather_object(out, mine)
        assert out == [bytes([1]) * MB if r == 1 else r for r in range(n)]

    await run_world(n, fn)


# -- gather_object -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
async def test_gather_object_every_dst(n: int) -> None:
    async def fn(rank: int) -> None:
        for dst in range(n):
            out: list[Any] | None = [None] * n if rank == dst else None
            await gather_object(obj_of(rank, dst), out, dst=dst)
            if rank == dst:
                assert out is not None and same_list(out, [obj_of(r, dst) for r in range(n)])
            out2: list[Any] | None = ["stale"] * n if rank == dst else None
            await gather_object((rank, "g"), out2, group_dst=dst)
            if rank == dst:
                assert out2 == [(r, "g") for r in range(n)]
        # dst defaults to global rank 0; non-destination ranks may pass an empty list
        out3: list[Any] | None = [None] * n if rank == 0 else []
        await gather_object(rank * 7, out3)
        if rank == 0:
            assert out3 == [r * 7 for r in range(n)]

    await run_world(n, fn)


async def test_gather_object_doc_example() -> None:
    gather_objects: list[Any] = ["foo", 12, {1: 2}]

    async def fn(rank: int) -> list[Any]:
        output: list[Any] = [None for _ in gather_objects]
        await gather_object(gather_objects[dist.get_rank()], output if dist.get_rank() == 0 else None, dst=0)
        return output

    results = await run_world(3, fn)
    assert results[0] == ["foo", 12, {1: 2}]
    assert results[1] == results[2] == [None, None, None]  # untouched on the other ranks


@pytest.mark.parametrize("n", [2, 4])
async def test_gather_object_uneven_sizes(n: int) -> None:
    async def fn(rank: int) -> None:
        for dst in range(n):
            mine = "y" * MB if rank == (dst + 1) % n else {"r": rank}
            out: list[Any] | None = [None] * n if rank == dst else None
            await gather_object(mine, out, dst=dst)
            if out is not None:
                assert out == ["y" * MB if r == (dst + 1) % n else {"r": r} for r in range(n)]

    await run_world(n, fn)


# -- scatter_object_list -------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
async def test_scatter_object_list_every_src(n: int) -> None:
    async def fn(rank: int) -> None:
        for src in range(n):
            ins = [obj_of(i, src) for i in range(n)] if rank == src else None
            out: list[Any] = [None, "kept"]
            await scatter_object_list(out, ins, src=src)
            assert same(out[0], obj_of(rank, src)) and out[1] == "kept"  # only the first entry is written
            out2: list[Any] = [None]
            await scatter_object_list(out2, [("s", i) for i in range(n)] if rank == src else None, group_src=src)
            assert out2 == [("s", rank)]
        out3: list[Any] = [None]
        await scatter_object_list(out3, [i * i for i in range(n)] if rank == 0 else None)  # src defaults to 0
        assert out3 == [rank * rank]

    await run_world(n, fn)


async def test_scatter_object_list_doc_example() -> None:
    """torch's example: non-source ranks pass a list too; its elements are not used."""

    async def fn(rank: int) -> list[Any]:
        objects: list[Any] = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None, None, None]
        output_list: list[Any] = [None]
        await scatter_object_list(output_list, objects, src=0)
        return output_list

    assert await run_world(3, fn) == [["foo"], [12], [{1: 2}]]


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_scatter_object_list_uneven_sizes(n: int) -> None:
    async def fn(rank: int) -> None:
        for src in range(n):
            ins = [b"z" * MB if i == n - 1 else i for i in range(n)] if rank == src else None
            out: list[Any] = [None]
            await scatter_object_list(out, ins, src=src)
            assert out[0] == (b"z" * MB if rank == n - 1 else rank)

    await run_world(n, fn)


# -- send_object_list / recv_object_list ---------------------------------------------------------


async def test_send_recv_object_list_doc_example() -> None:
    async def fn(rank: int) -> list[Any]:
        if dist.get_rank() == 0:
            objects: list[Any] = ["foo", 12, {1: 2}]
            await send_object_list(objects, dst=1, device="cpu")
        else:
            objects = [None, None, None]
            assert await recv_object_list(objects, src=0, device="cpu") == 0
        return objects

    assert await run_world(2, fn) == [["foo", 12, {1: 2}]] * 2


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_send_recv_object_list_every_pair(n: int) -> None:
    async def fn(rank: int) -> None:
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                objs = [obj_of(a, b), obj_of(b, a), "m" * (MB if (a + b) % 3 == 0 else 1)]
                if rank == a:
                    await send_object_list(objs, dst=b, use_batch=(a + b) % 2 == 0)
                    await send_object_list([], group_dst=b)  # an empty list: sizes only
                elif rank == b:
                    got: list[Any] = [None] * 3
                    assert await recv_object_list(got, src=a) == a
                    assert same_list(got, objs)
                    empty: list[Any] = []
                    assert await recv_object_list(empty, group_src=a) == a and empty == []

    await run_world(n, fn)


async def test_send_recv_object_list_in_a_subgroup() -> None:
    """dst/src are global ranks, group_dst/group_src group ranks; the sender's global rank is returned."""

    async def fn(rank: int) -> None:
        g = await dist.new_group([1, 3])
        if rank == 1:
            assert isinstance(g, dist.ProcessGroup)
            await send_object_list([{"from": 1}], dst=3, group=g)
            await send_object_list([{"again": 1}], group_dst=1, group=g)
            await send_object_list(["any", "x" * MB], dst=3, group=g)
        elif rank == 3:
            assert isinstance(g, dist.ProcessGroup)
            got: list[Any] = [None]
            assert await recv_object_list(got, src=1, group=g) == 1 and got == [{"from": 1}]
            assert await recv_object_list(got, group_src=0, group=g) == 1 and got == [{"again": 1}]
            two: list[Any] = [None, None]
            assert await recv_object_list(two, group=g) == 1 and two == ["any", "x" * MB]  # any source: a global rank
        else:
            assert g == dist.GroupMember.NON_GROUP_MEMBER
            with pytest.warns(UserWarning, match="which does not belong to the given group"):  # as torch
                assert await recv_object_list([None], src=1, group=g) == -1

    await run_world(4, fn)


@pytest.mark.parametrize("n", [2, 4])
async def test_recv_object_list_from_any_source(n: int) -> None:
    """src=None receives from whichever rank sends; the objects' bytes come from that same rank."""

    async def fn(rank: int) -> None:
        if rank == 0:
            senders = []
            for _ in range(n - 1):
                got: list[Any] = [None, None]
                sender = await recv_object_list(got)
                assert got == [sender, "x" * (MB if sender == 1 else sender)]
                senders.append(sender)
            assert sorted(senders) == list(range(1, n))
        else:
            await send_object_list([rank, "x" * (MB if rank == 1 else rank)], dst=0)

    await run_world(n, fn)


async def test_recv_object_list_length_mismatch_fails_the_receiver() -> None:
    async def fn(rank: int) -> str:
        try:
            if rank == 0:
                await send_object_list(["a", "b", "c"], dst=1)
            else:
                await recv_object_list([None, None], src=0)
        except dist.DistError as exc:
            return f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
        return "ok"

    results = await run_world(2, fn, pg_timeout=2, timeout=20)
    assert results[1].startswith("DistBackendError") and "24 bytes" in results[1], results
    assert "recv_object_list: this rank expected the sizes of 2 objects" in results[1]


# -- sub-groups ----------------------------------------------------------------------------------


async def test_object_collectives_in_a_subgroup() -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([1, 2, 4])
        if not isinstance(g, dist.ProcessGroup):
            for call in (
                lambda: broadcast_object_list([None], src=1, group=g),
                lambda: all_gather_object([None] * 3, rank, group=g),
                lambda: gather_object(rank, None, dst=1, group=g),
                lambda: scatter_object_list([None], None, src=1, group=g),
            ):
                with pytest.warns(UserWarning, match="which does not belong to the given group"):  # as torch
                    assert await call() is None
            return
        objs: list[Any] = ["from 4"] if rank == 4 else [None]
        await broadcast_object_list(objs, src=4, group=g)  # src: a global rank
        assert objs == ["from 4"]
        objs = ["from group rank 1"] if rank == 2 else [None]
        await broadcast_object_list(objs, group_src=1, group=g)
        assert objs == ["from group rank 1"]
        out: list[Any] = [None] * 3
        await all_gather_object(out, rank, group=g)
        assert out == [1, 2, 4]
        gl: list[Any] | None = [None] * 3 if rank == 2 else None
        await gather_object(-rank, gl, dst=2, group=g)
        if rank == 2:
            assert gl == [-1, -2, -4]
        so: list[Any] = [None]
        await scatter_object_list(so, ["a", "b", "c"] if rank == 4 else None, group_src=2, group=g)
        assert so == [["a", "b", "c"][g.rank()]]
        with pytest.raises(ValueError, match="not a rank of"):
            await broadcast_object_list([None], src=0, group=g)  # global rank 0 is not in g

    await run_world(5, fn)


# -- argument errors -----------------------------------------------------------------------------


async def test_argument_errors_leave_the_group_usable() -> None:
    async def fn(rank: int) -> None:
        n = dist.get_world_size()
        bad: list[tuple[type[Exception], str, Any]] = [
            (TypeError, "must be a list", lambda: broadcast_object_list(("a", "b"), src=0)),  # type: ignore[arg-type]
            (ValueError, "not both", lambda: broadcast_object_list([None], src=0, group_src=0)),
            (ValueError, "not a rank of", lambda: broadcast_object_list([None], src=n)),
            (TypeError, "must be an int", lambda: broadcast_object_list([None], src="0")),  # type: ignore[arg-type]
            (TypeError, "device", lambda: broadcast_object_list([None], src=0, device=3.5)),
            (ValueError, "has 2 entries, the group has 3", lambda: all_gather_object([None, None], rank)),
            (ValueError, "has 4 entries, the group has 3", lambda: all_gather_object([None] * 4, rank)),
            (TypeError, "must be a list", lambda: all_gather_object(None, rank)),  # type: ignore[arg-type]
            (ValueError, "not both", lambda: gather_object(rank, [None] * n, dst=0, group_dst=0)),
            (ValueError, "not both", lambda: scatter_object_list([None], None, src=0, group_src=0)),
            (ValueError, "to be a list of size at least 1", lambda: scatter_object_list([], [1, 2, 3], src=rank)),
            (TypeError, "must be a list", lambda: scatter_object_list(None, [1, 2, 3], src=rank)),  # type: ignore[arg-type]
            (ValueError, "must be specified on the source", lambda: scatter_object_list([None], None, src=rank)),
            (ValueError, "has 2 entries, the group has 3", lambda: scatter_object_list([None], [1, 2], src=rank)),
            (ValueError, "oneself", lambda: send_object_list([1], dst=rank)),
            (ValueError, "oneself", lambda: recv_object_list([None], src=rank)),
            (ValueError, "not both", lambda: send_object_list([1], dst=0, group_dst=0)),
            (ValueError, "not both", lambda: recv_object_list([None], src=0, group_src=0)),
            (ValueError, "must specify dst", lambda: send_object_list([1])),
            (TypeError, "use_batch", lambda: send_object_list([1], dst=(rank + 1) % n, use_batch=1)),  # type: ignore[arg-type]
            (TypeError, "use_batch", lambda: recv_object_list([None], src=(rank + 1) % n, use_batch="yes")),  # type: ignore[arg-type]
            (TypeError, "must be a list", lambda: recv_object_list("ab", src=(rank + 1) % n)),  # type: ignore[arg-type]
            (TypeError, "group must be", lambda: all_gather_object([None] * n, rank, group="world")),  # type: ignore[arg-type]
        ]
        # the gather list: required on the destination, refused elsewhere, sized as the group
        bad.append((ValueError, "must be specified on the destination", lambda: gather_object(rank, None, dst=rank)))
        bad.append((ValueError, "has 2 entries", lambda: gather_object(rank, [None, None], dst=rank)))
        bad.append((ValueError, "must NOT be specified", lambda: gather_object(rank, [None] * n, dst=(rank + 1) % n)))
        for exc, match, make in bad:
            with pytest.raises(exc, match=match):
                await make()
        await still_usable(rank)

    await run_world(3, fn)


async def test_unpicklable_objects_fail_before_anything_is_sent() -> None:
    """Pickling happens before the first op: a rank that cannot pickle raises at once and its
    group takes no sequence number (here every rank fails alike, so the group stays in step)."""

    async def fn(rank: int) -> None:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            await all_gather_object([None] * 2, lambda: rank)
        await still_usable(rank)

    await run_world(2, fn)

    async def alone(rank: int) -> None:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            await broadcast_object_list([1, lambda: 0], src=0)
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            await scatter_object_list([None], [lambda: 0], src=0)
        await still_usable(rank)

    await run_world(1, alone)


async def test_pickle_protocol_5() -> None:
    """Objects travel as protocol-5 pickles (out-of-band-capable types such as numpy arrays arrive intact)."""
    assert PICKLE_PROTOCOL == 5

    async def fn(rank: int) -> None:
        arr = np.arange(1000, dtype=np.float64).reshape(10, 100) * (rank + 1)
        out: list[Any] = [None, None]
        await all_gather_object(out, OrderedDict(a=arr, b=arr[:, ::2]))
        for r in range(2):
            np.testing.assert_array_equal(out[r]["a"], np.arange(1000, dtype=np.float64).reshape(10, 100) * (r + 1))
            np.testing.assert_array_equal(out[r]["b"], out[r]["a"][:, ::2])

    await run_world(2, fn)


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~1.2 s a run); a second loop waits them out again for the same result")
async def test_cancelled_between_ops_aborts_the_group_instead_of_desyncing() -> None:
    """A receiver cancelled while it waits for the sizes cannot issue the bytes op any more: its
    group is aborted (later ops refused, loudly) rather than left one op behind its peers, and the
    peers fail at their group timeout instead of matching the wrong ops."""

    async def fn(rank: int) -> str:
        objs: list[Any] = ["payload", 1] if rank == 0 else [None, None]
        if rank == 0:
            await asyncio.sleep(0.2)  # the source is late: rank 1 gives up first
            await broadcast_object_list(objs, src=0)
        elif rank == 1:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await broadcast_object_list(objs, src=0)
        else:
            await broadcast_object_list(objs, src=0)
            assert objs == ["payload", 1]
        try:
            await all_gather_object([None] * 3, rank)
        except dist.DistError as exc:
            return str(exc)
        return "ok"

    results = await run_world(3, fn, pg_timeout=1, timeout=20)
    assert "unusable" in results[1] and "cancelled on global rank 1 between its sizes op and its bytes op" in results[1]
    assert all(r != "ok" for r in results), results  # nobody pairs the wrong ops


async def test_sources_cancelled_after_issuing_keep_the_group_in_step() -> None:
    """A source (or a sender) issues both of its ops at once, so cancelling it afterwards leaves the
    ops running and the group in step: the next collective works on every rank."""

    async def fn(rank: int) -> None:
        objs: list[Any] = ["x" * MB] if rank == 0 else [None]
        if rank == 0:
            task = asyncio.create_task(broadcast_object_list(objs, src=0))
            await asyncio.sleep(0)  # issued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await asyncio.sleep(0.05)
            await broadcast_object_list(objs, src=0)
            assert objs == ["x" * MB]
        await still_usable(rank)

    await run_world(3, fn, pg_timeout=5, timeout=20)


# -- over the socket backend ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
async def test_object_collectives_over_gloo(n: int) -> None:
    async def fn(rank: int) -> None:
        for root in range(n):
            objs: list[Any] = [obj_of(root), b"q" * MB, {"k": root}] if rank == root else [None] * 3
            await broadcast_object_list(objs, src=root)
            assert same_list(objs, [obj_of(root), b"q" * MB, {"k": root}])
        out: list[Any] = [None] * n
        await all_gather_object(out, "w" * MB if rank == n - 1 else rank)
        assert out == ["w" * MB if r == n - 1 else r for r in range(n)]
        gl: list[Any] | None = [None] * n if rank == 1 else None
        await gather_object(obj_of(rank), gl, dst=1)
        if gl is not None:
            assert same_list(gl, [obj_of(r) for r in range(n)])
        so: list[Any] = [None]
        await scatter_object_list(so, [i if i else b"s" * MB for i in range(n)] if rank == n - 1 else None, src=n - 1)
        assert so[0] == (rank if rank else b"s" * MB)
        peer_to, peer_from = (rank + 1) % n, (rank - 1) % n
        got: list[Any] = [None, None]
        if rank % 2 == 0:
            await send_object_list([rank, "p" * MB], dst=peer_to)
            assert await recv_object_list(got, src=peer_from) == peer_from
        else:
            assert await recv_object_list(got, src=peer_from) == peer_from
            await send_object_list([rank, "p" * MB], dst=peer_to)
        assert got == [peer_from, "p" * MB]
        await dist.barrier()

    await run_world(n, fn, backend="gloo", timeout=20)


# -- all_gather_object_enforce_type --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_enforce_type_accepts_one_type(n: int) -> None:
    async def fn(rank: int) -> None:
        out: list[Any] = [None] * n
        await all_gather_object_enforce_type(None, out, {"rank": rank})
        assert out == [{"rank": r} for r in range(n)]
        await all_gather_object_enforce_type(dist.group.WORLD, out, rank)
        assert out == list(range(n))

    await run_world(n, fn)


class MyInt(int):
    pass


async def test_enforce_type_mismatch_fails_every_rank_alike() -> None:
    async def fn(rank: int) -> str:
        out: list[Any] = [None] * 3
        obj: Any = "two" if rank == 2 else rank
        with pytest.raises(
            TypeError, match=r"group rank 2 \(global rank 2\) is str, while group rank 0's \(global rank 0\) is int"
        ) as info:
            await all_gather_object_enforce_type(None, out, obj)
        assert out == [0, 1, "two"]  # gathered before the check
        # a subclass is a different type for the default check ...
        with pytest.raises(TypeError, match="group rank 1"):
            await all_gather_object_enforce_type(None, out, MyInt(rank) if rank == 1 else rank)
        # ... and a custom checker decides otherwise
        await all_gather_object_enforce_type(None, out, MyInt(rank) if rank == 1 else rank, type_checker=lambda x, y: isinstance(y, int))
        with pytest.raises(TypeError, match="type_checker must be callable"):
            await all_gather_object_enforce_type(None, out, rank, type_checker=None)  # type: ignore[arg-type]
        await still_usable(rank)  # the group is fine: the check runs after the op
        return str(info.value)

    messages = await run_world(3, fn)
    assert len(set(messages)) == 1


async def test_enforce_type_in_a_subgroup_names_global_ranks() -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([0, 2, 3])
        if not isinstance(g, dist.ProcessGroup):
            return
        out: list[Any] = [None] * 3
        with pytest.raises(TypeError, match=r"group rank 2 \(global rank 3\)"):
            await all_gather_object_enforce_type(g, out, 3.0 if rank == 3 else rank)

    await run_world(4, fn)


def test_the_lengths_hint_is_not_given_for_a_lost_peer() -> None:
    """A sizes op that failed because a peer is gone gets no "the lists' lengths differ" note
    (the hint misled: the cause was that rank 0 had exited)."""
    from aiodist.c10d.objects import _hint_lengths

    lost = dist.DistNetworkError("rank 0 closed the connection without GOODBYE (its process ended or crashed)")
    relayed = dist.DistBackendError("the failure started on rank 2: rank 0 closed the connection without GOODBYE")
    late = dist.DistTimeoutError("timed out")
    other = dist.DistBackendError("desync detected: rank 0 and rank 1 both called broadcast with different arguments")
    for e in (lost, relayed, late, other):
        _hint_lengths(e, "broadcast_object_list", 1)
    assert [getattr(e, "__notes__", []) for e in (lost, relayed, late)] == [[], [], []]
    assert "the lists' lengths differ across ranks" in other.__notes__[0]
