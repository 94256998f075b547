"""Every code example of torch.distributed's reference sections "Point-to-point communication",
"Synchronous and asynchronous collective operations" and "Collective functions"
(the torch.distributed documentation of torch 2.13), reproduced with the documented inputs
and the documented outputs, on torch CPU tensors, over the memory backend and the socket
backend ("gloo").

The examples are torch's, made asyncio-native: every communicating call is awaited, and
``req.wait()`` is ``await req.wait()``. CUDA devices become CPU. Where the documentation has a
typo (the cfloat all_to_all examples allocate an int64 output), the output has the input's dtype.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

import aiodist as dist
from aiodist.testing import run_world

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parametrize("backend", ["memory", "gloo"])

ReduceOp = dist.ReduceOp


async def world(n: int, fn: Callable[[int], Awaitable[Any]], backend: str, timeout: float = 20) -> list[Any]:
    """run_world on ``backend``; ranks leave as soon as they are done."""
    return await run_world(n, fn, backend=backend, timeout=timeout)


# -- Point-to-point communication ----------------------------------------------------------------


async def test_send_recv_returns_the_sender_rank(backend: str) -> None:
    """recv: "Returns: Sender rank"; dst/src are global ranks, group_dst/group_src group ranks."""

    async def fn(rank: int) -> list[Any]:
        if rank == 0:
            await dist.send(torch.tensor([1, 2]), dst=1)
            await dist.send(torch.tensor([3, 4]), group_dst=1, tag=5)
            return []
        t, u = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        a = await dist.recv(t, src=0)
        b = await dist.recv(u, group_src=0, tag=5)
        return [a, b, t.tolist(), u.tolist()]

    assert (await world(2, fn, backend))[1] == [0, 0, [1, 2], [3, 4]]


async def test_recv_from_any_source(backend: str) -> None:
    """recv / irecv: "src ... Will receive from any process if unspecified"."""

    async def fn(rank: int) -> Any:
        if rank:
            await dist.send(torch.full((3,), float(rank)), dst=0)
            return None
        got = {}
        for _ in range(2):
            t = torch.zeros(3)
            sender = await dist.recv(t)
            got[sender] = t.tolist()
        return got

    assert (await world(3, fn, backend))[0] == {1: [1.0] * 3, 2: [2.0] * 3}


async def test_irecv_from_any_source_names_the_sender(backend: str) -> None:
    async def fn(rank: int) -> Any:
        if rank == 2:
            w = await dist.isend(torch.tensor([42]), dst=0, tag=3)
            await w.wait()
            return None
        if rank == 0:
            t = torch.zeros(1, dtype=torch.int64)
            w = await dist.irecv(t, tag=3)
            assert await w.wait() is True and w.is_completed()
            return w.source_rank(), t.item()
        return None

    assert (await world(3, fn, backend))[0] == (2, 42)


async def test_isend_irecv_to_oneself(backend: str) -> None:
    """isend: "Unlike send, which is blocking, isend allows src == dst rank, i.e. send to self";
    irecv the same. send: "Destination rank should not be the same as the rank of the current process"."""

    async def fn(rank: int) -> list[float]:
        out = torch.zeros(2)
        r = await dist.irecv(out, src=rank)
        s = await dist.isend(torch.tensor([rank, 0.5]), dst=rank)
        await s.wait()
        await r.wait()
        assert r.source_rank() == rank
        with pytest.raises((ValueError, RuntimeError)):
            await dist.send(torch.zeros(1), dst=rank)
        return [float(v) for v in out]

    assert await world(2, fn, backend) == [[0.0, 0.5], [1.0, 0.5]]


async def test_isend_irecv_requests_support_is_completed_and_wait(backend: str) -> None:
    """torch's docs: "they are guaranteed to support two methods: is_completed() ... wait() ... is_completed()
    is guaranteed to return True once it returns"."""

    async def fn(rank: int) -> list[int]:
        t = torch.tensor([rank, rank])
        req = await (dist.isend(t, dst=1) if rank == 0 else dist.irecv(t, src=0))
        await req.wait()
        assert req.is_completed()
        return t.tolist()

    assert await world(2, fn, backend) == [[0, 0], [0, 0]]


async def test_batch_isend_irecv_documented_example(backend: str) -> None:
    async def fn(rank: int) -> list[float]:
        world_size = dist.get_world_size()
        send_tensor = torch.arange(2, dtype=torch.float32) + 2 * rank
        recv_tensor = torch.randn(2, dtype=torch.float32)
        send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % world_size)
        recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + world_size) % world_size)
        reqs = await dist.batch_isend_irecv([send_op, recv_op])
        for req in reqs:
            await req.wait()
        return recv_tensor.tolist()

    assert await world(2, fn, backend) == [[2.0, 3.0], [0.0, 1.0]]
    # the same ring at 3 ranks
    assert await world(3, fn, backend) == [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]]


async def test_batch_isend_irecv_order_rules(backend: str) -> None:
    """torch's docs: "[recv_from_1, send_to_1] is equivalent to [send_to_1, recv_from_1]"; several ops between
    one pair in one direction match in list order."""

    async def fn(rank: int) -> list[list[int]]:
        peer = 1 - rank
        a, b = torch.tensor([10 * rank + 1]), torch.tensor([10 * rank + 2])
        ra, rb = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        sends = [dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.isend, b, peer)]
        recvs = [dist.P2POp(dist.irecv, ra, peer), dist.P2POp(dist.irecv, rb, peer)]
        ops = sends + recvs if rank == 0 else recvs + sends
        reqs = await dist.batch_isend_irecv(ops)
        assert len(reqs) == 4
        await asyncio.gather(*(r.wait() for r in reqs))
        return [ra.tolist(), rb.tolist()]

    assert await world(2, fn, backend) == [[[11], [12]], [[1], [2]]]


async def test_send_object_list_recv_object_list_example(backend: str) -> None:
    """recv_object_list "Returns: Sender rank"."""

    async def fn(rank: int) -> Any:
        device = torch.device("cpu")
        if dist.get_rank() == 0:
            objects: list[Any] = ["foo", 12, {1: 2}]
            await dist.send_object_list(objects, dst=1, device=device)
            return None
        objects = [None, None, None]
        sender = await dist.recv_object_list(objects, src=0, device=device)
        return sender, objects

    assert (await world(2, fn, backend))[1] == (0, ["foo", 12, {1: 2}])


# -- Synchronous and asynchronous collective operations -------------------------------------------


async def test_async_op_semantics_example_on_cpu(backend: str) -> None:
    """The section's example on CPU: once wait() returns, the output is final; adding 100 then
    gives 101 on rank 0 (never 1: the all_reduce cannot overwrite it afterwards)."""

    async def fn(rank: int) -> list[int]:
        output = torch.tensor([rank])
        handle = await dist.all_reduce(output, async_op=True)
        assert handle is not None
        assert await handle.wait() is True
        assert handle.is_completed()
        output.add_(100)
        fut = handle.get_future()
        assert (await fut)[0] is output
        # synchronous: when the function returns, the collective has been performed
        sync = torch.tensor([rank])
        assert await dist.all_reduce(sync) is None
        return [int(output.item()), int(sync.item())]

    assert await world(2, fn, backend) == [[101, 1], [101, 1]]


# -- Collective functions -------------------------------------------------------------------------


async def test_all_reduce_int64_example(backend: str) -> None:
    async def fn(rank: int) -> list[int]:
        tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
        assert tensor.tolist() == ([1, 2] if rank == 0 else [3, 4])
        await dist.all_reduce(tensor, op=ReduceOp.SUM)
        return tensor.tolist()

    assert await world(2, fn, backend) == [[4, 6], [4, 6]]


async def test_all_reduce_cfloat_example(backend: str) -> None:
    async def fn(rank: int) -> list[complex]:
        tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
        await dist.all_reduce(tensor, op=ReduceOp.SUM)
        assert tensor.dtype == torch.cfloat
        return tensor.tolist()

    assert await world(2, fn, backend) == [[4 + 4j, 6 + 6j]] * 2


async def test_all_reduce_coalesced(backend: str) -> None:
    """torch's docs: "Reduces each tensor in tensors ... After the call each tensor in tensors is going to
    bitwise identical in all processes"."""

    async def fn(rank: int) -> list[Any]:
        tensors = [torch.arange(4, dtype=torch.float32).reshape(2, 2) + rank, torch.full((3,), rank + 1, dtype=torch.float32)]
        await dist.all_reduce_coalesced(tensors, op=ReduceOp.SUM)
        maxed = [torch.tensor([rank, -rank], dtype=torch.float32)]
        work = await dist.all_reduce_coalesced(maxed, op=ReduceOp.MAX, async_op=True)
        assert work is not None
        await work.wait()
        return [tensors[0].tolist(), tensors[1].tolist(), maxed[0].tolist()]

    assert await world(3, fn, backend) == [[[[3.0, 6.0], [9.0, 12.0]], [6.0] * 3, [2.0, 0.0]]] * 3


async def test_all_reduce_coalesced_takes_a_single_tensor(backend: str) -> None:
    async def fn(rank: int) -> list[float]:
        single = torch.full((2,), float(rank))
        await dist.all_reduce_coalesced(single)
        return single.tolist()

    assert await world(2, fn, backend) == [[1.0, 1.0]] * 2


async def test_all_gather_int64_example(backend: str) -> None:
    async def fn(rank: int) -> list[list[int]]:
        tensor_list = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
        await dist.all_gather(tensor_list, tensor)
        return [t.tolist() for t in tensor_list]

    assert await world(2, fn, backend) == [[[1, 2], [3, 4]]] * 2


async def test_all_gather_cfloat_example(backend: str) -> None:
    async def fn(rank: int) -> list[list[complex]]:
        tensor_list = [torch.zeros(2, dtype=torch.cfloat) for _ in range(2)]
        tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
        await dist.all_gather(tensor_list, tensor)
        return [t.tolist() for t in tensor_list]

    assert await world(2, fn, backend) == [[[1 + 1j, 2 + 2j], [3 + 3j, 4 + 4j]]] * 2


async def test_all_gather_single_concatenation_and_stack_forms(backend: str) -> None:
    async def fn(rank: int) -> list[Any]:
        world_size = dist.get_world_size()
        tensor_in = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
        tensor_out = torch.zeros(world_size * 2, dtype=torch.int64)
        await dist.all_gather_single(tensor_out, tensor_in)
        tensor_out2 = torch.zeros(world_size, 2, dtype=torch.int64)
        await dist.all_gather_single(tensor_out2, tensor_in)
        legacy = torch.zeros(world_size, 2, dtype=torch.int64)
        await dist.all_gather_into_tensor(legacy, tensor_in)
        return [tensor_out.tolist(), tensor_out2.tolist(), legacy.tolist()]

    assert await world(2, fn, backend) == [[[1, 2, 3, 4], [[1, 2], [3, 4]], [[1, 2], [3, 4]]]] * 2


async def test_all_gather_coalesced_documented_example(backend: str) -> None:
    inputs = {0: [[[1, 1], [1, 1]], [2], [3, 3]], 1: [[[3, 3], [3, 3]], [5], [1, 1]]}

    async def fn(rank: int) -> list[list[Any]]:
        input_tensor_list = [torch.tensor(x) for x in inputs[rank]]
        output_tensor_lists = [[torch.full_like(t, -1) for t in input_tensor_list] for _ in range(2)]
        await dist.all_gather_coalesced(output_tensor_lists, input_tensor_list)
        return [[t.tolist() for t in lst] for lst in output_tensor_lists]

    want = [inputs[0], inputs[1]]
    assert await world(2, fn, backend) == [want, want]


async def test_gather_example(backend: str) -> None:
    async def fn(rank: int) -> Any:
        tensor_size = 2
        tensor = torch.ones(tensor_size) + rank
        gather_list = [torch.zeros_like(tensor) for i in range(2)] if dist.get_rank() == 0 else None
        await dist.gather(tensor, gather_list, dst=0)
        return None if gather_list is None else [t.tolist() for t in gather_list]

    assert await world(2, fn, backend) == [[[1.0, 1.0], [2.0, 2.0]], None]


async def test_scatter_example(backend: str) -> None:
    async def fn(rank: int) -> list[float]:
        tensor_size = 2
        output_tensor = torch.zeros(tensor_size)
        if dist.get_rank() == 0:
            t_ones = torch.ones(tensor_size)
            t_fives = torch.ones(tensor_size) * 5
            scatter_list = [t_ones, t_fives]
        else:
            scatter_list = None
        await dist.scatter(output_tensor, scatter_list, src=0)
        return output_tensor.tolist()

    assert await world(2, fn, backend) == [[1.0, 1.0], [5.0, 5.0]]


async def test_reduce_scatter_single_concatenation_and_stack_forms(backend: str) -> None:
    async def fn(rank: int) -> list[list[int]]:
        world_size = dist.get_world_size()
        tensor_out = torch.zeros(2, dtype=torch.int64)
        tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
        await dist.reduce_scatter_single(tensor_out, tensor_in)
        first = tensor_out.tolist()
        tensor_in = torch.reshape(tensor_in, (world_size, 2))
        await dist.reduce_scatter_single(tensor_out, tensor_in)
        legacy = torch.zeros(2, dtype=torch.int64)
        await dist.reduce_scatter_tensor(legacy, tensor_in)
        return [first, tensor_out.tolist(), legacy.tolist()]

    assert await world(2, fn, backend) == [[[0, 2]] * 3, [[4, 6]] * 3]


# all_to_all_single and all_to_all: the documented uneven example (4 ranks)
UNEVEN_INPUT = [list(range(0, 6)), list(range(10, 19)), list(range(20, 25)), list(range(30, 37))]
INPUT_SPLITS = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
OUTPUT_SPLITS = [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]]
UNEVEN_OUTPUT = [[0, 1, 10, 11, 12, 20, 21, 30, 31], [2, 3, 13, 14, 22, 32, 33], [4, 15, 16, 23, 34, 35], [5, 17, 18, 24, 36]]
CFLOAT_OUTPUT = [
    [1 + 1j, 5 + 5j, 9 + 9j, 13 + 13j],
    [2 + 2j, 6 + 6j, 10 + 10j, 14 + 14j],
    [3 + 3j, 7 + 7j, 11 + 11j, 15 + 15j],
    [4 + 4j, 8 + 8j, 12 + 12j, 16 + 16j],
]


async def test_all_to_all_single_even_example_and_its_scatter_equivalent(backend: str) -> None:
    async def fn(rank: int) -> list[list[int]]:
        world_size = dist.get_world_size()
        input = torch.arange(4) + rank * 4
        output = torch.empty([4], dtype=torch.int64)
        await dist.all_to_all_single(output, input)
        # "Essentially, it is similar to following operation"
        output2 = torch.empty([4], dtype=torch.int64)
        scatter_list = list(input.chunk(world_size))
        gather_list = list(output2.chunk(world_size))
        for i in range(world_size):
            await dist.scatter(gather_list[i], scatter_list if i == rank else [], src=i)
        return [output.tolist(), output2.tolist()]

    assert await world(4, fn, backend) == [[[r, r + 4, r + 8, r + 12]] * 2 for r in range(4)]


async def test_all_to_all_single_uneven_example(backend: str) -> None:
    async def fn(rank: int) -> list[int]:
        input = torch.tensor(UNEVEN_INPUT[rank])
        output = torch.empty(sum(OUTPUT_SPLITS[rank]), dtype=torch.int64)
        await dist.all_to_all_single(output, input, OUTPUT_SPLITS[rank], INPUT_SPLITS[rank])
        return output.tolist()

    assert await world(4, fn, backend) == UNEVEN_OUTPUT


async def test_all_to_all_single_cfloat_example(backend: str) -> None:
    async def fn(rank: int) -> list[complex]:
        input = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j, 4 + 4j], dtype=torch.cfloat) + 4 * rank * (1 + 1j)
        output = torch.empty([4], dtype=torch.cfloat)  # the documentation says int64: a typo
        await dist.all_to_all_single(output, input)
        return output.tolist()

    assert await world(4, fn, backend) == CFLOAT_OUTPUT


async def test_all_to_all_even_example_and_its_scatter_equivalent(backend: str) -> None:
    async def fn(rank: int) -> list[list[int]]:
        world_size = dist.get_world_size()
        input = list((torch.arange(4) + rank * 4).chunk(4))
        output = list(torch.empty([4], dtype=torch.int64).chunk(4))
        await dist.all_to_all(output, input)
        # "Essentially, it is similar to following operation"
        scatter_list = input
        gather_list = list(torch.empty([4], dtype=torch.int64).chunk(4))
        for i in range(world_size):
            await dist.scatter(gather_list[i], scatter_list if i == rank else [], src=i)
        return [torch.cat(output).tolist(), torch.cat(gather_list).tolist()]

    assert await world(4, fn, backend) == [[[r, r + 4, r + 8, r + 12]] * 2 for r in range(4)]


async def test_all_to_all_uneven_example(backend: str) -> None:
    async def fn(rank: int) -> list[list[int]]:
        input = list(torch.tensor(UNEVEN_INPUT[rank]).split(INPUT_SPLITS[rank]))
        output = [torch.empty(s, dtype=torch.int64) for s in OUTPUT_SPLITS[rank]]
        await dist.all_to_all(output, input)
        return [t.tolist() for t in output]

    want = [
        [[0, 1], [10, 11, 12], [20, 21], [30, 31]],
        [[2, 3], [13, 14], [22], [32, 33]],
        [[4], [15, 16], [23], [34, 35]],
        [[5], [17, 18], [24], [36]],
    ]
    assert await world(4, fn, backend) == want


async def test_all_to_all_cfloat_example(backend: str) -> None:
    async def fn(rank: int) -> list[complex]:
        input = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j, 4 + 4j], dtype=torch.cfloat) + 4 * rank * (1 + 1j)
        input = list(input.chunk(4))
        output = list(torch.empty([4], dtype=torch.cfloat).chunk(4))  # the documentation says int64: a typo
        await dist.all_to_all(output, input)
        return [t.item() for t in output]

    assert await world(4, fn, backend) == CFLOAT_OUTPUT


async def test_barrier_sync_and_async(backend: str) -> None:
    async def fn(rank: int) -> None:
        assert await dist.barrier() is None
        work = await dist.barrier(async_op=True)
        assert work is not None and await work.wait() is True

    await world(3, fn, backend)


async def test_monitored_barrier_all_ranks_join(backend: str) -> None:
    async def fn(rank: int) -> None:
        await dist.monitored_barrier(timeout=timedelta(seconds=10))  # returns None: nothing to check but that it returns
        await dist.monitored_barrier(wait_all_ranks=True)

    await world(3, fn, backend)


async def test_monitored_barrier_names_the_rank_that_did_not_join(backend: str) -> None:
    """torch's docs: "if dist.get_rank() != 1: dist.monitored_barrier()  # Raises exception indicating that
    rank 1 did not call into monitored_barrier"."""
    finished: list[int] = []
    everyone_failed = asyncio.Event()

    async def fn(rank: int) -> str | None:
        if dist.get_rank() == 1:
            await asyncio.wait_for(everyone_failed.wait(), 10)  # alive, never calls it
            return None
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            with pytest.raises(RuntimeError) as info:
                await dist.monitored_barrier(timeout=timedelta(seconds=0.3))
            assert loop.time() - start < 5
        finally:
            finished.append(rank)
            if len(finished) == 2:
                everyone_failed.set()
        return str(info.value)

    msgs = await world(3, fn, backend)
    assert msgs[0] is not None and re.search(r"\b1\b", msgs[0]), msgs[0]
    assert msgs[2] is not None


async def test_monitored_barrier_wait_all_ranks_names_every_missing_rank(backend: str) -> None:
    """torch's docs: "if dist.get_rank() == 0: dist.monitored_barrier(wait_all_ranks=True)  # Raises exception
    indicating that ranks 1, 2, ... world_size - 1 did not call into monitored_barrier"."""
    rank0_failed = asyncio.Event()

    async def fn(rank: int) -> str | None:
        if dist.get_rank() == 0:
            try:
                with pytest.raises(RuntimeError) as info:
                    await dist.monitored_barrier(timeout=timedelta(seconds=0.3), wait_all_ranks=True)
            finally:
                rank0_failed.set()
            return str(info.value)
        await asyncio.wait_for(rank0_failed.wait(), 10)
        return None

    msg = (await world(4, fn, backend))[0]
    assert msg is not None and all(re.search(rf"\b{r}\b", msg) for r in (1, 2, 3)), msg


async def test_reduce_op_premul_sum_float_or_single_element_tensor_and_avg(backend: str) -> None:
    """ReduceOp: "PREMUL_SUM multiplies inputs by a given scalar locally before reduction ... It can
    be used by calling ReduceOp.PREMUL_SUM(factor) where factor is a float or a single-element
    Tensor"; "AVG divides values by the world size"."""

    async def fn(rank: int) -> list[list[float]]:
        a = torch.tensor([1.0, 2.0]) * (rank + 1)
        await dist.all_reduce(a, op=ReduceOp.PREMUL_SUM(2.0))
        b = torch.tensor([1.0, 2.0]) * (rank + 1)
        await dist.all_reduce(b, op=ReduceOp.PREMUL_SUM(torch.tensor([0.5])))
        c = torch.tensor([1.0, 2.0]) * (rank + 1)
        await dist.all_reduce(c, op=ReduceOp.AVG)
        return [a.tolist(), b.tolist(), c.tolist()]

    assert await world(2, fn, backend) == [[[6.0, 12.0], [1.5, 3.0], [1.5, 3.0]]] * 2


# -- object collectives (in the "Collective functions" section) -----------------------------------


async def test_broadcast_object_list_example(backend: str) -> None:
    async def fn(rank: int) -> list[Any]:
        objects = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None, None, None]
        device = torch.device("cpu")
        await dist.broadcast_object_list(objects, src=0, device=device)
        return objects

    assert await world(3, fn, backend) == [["foo", 12, {1: 2}]] * 3


async def test_all_gather_object_example(backend: str) -> None:
    async def fn(rank: int) -> list[Any]:
        gather_objects = ["foo", 12, {1: 2}]
        output = [None for _ in gather_objects]
        await dist.all_gather_object(output, gather_objects[dist.get_rank()])
        return output

    assert await world(3, fn, backend) == [["foo", 12, {1: 2}]] * 3


async def test_gather_object_example(backend: str) -> None:
    async def fn(rank: int) -> Any:
        gather_objects = ["foo", 12, {1: 2}]
        output = [None for _ in gather_objects]
        await dist.gather_object(gather_objects[dist.get_rank()], output if dist.get_rank() == 0 else None, dst=0)
        return output

    assert (await world(3, fn, backend))[0] == ["foo", 12, {1: 2}]


async def test_scatter_object_list_example(backend: str) -> None:
    async def fn(rank: int) -> Any:
        objects = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None, None, None]
        output_list = [None]
        await dist.scatter_object_list(output_list, objects, src=0)
        return output_list

    assert await world(3, fn, backend) == [["foo"], [12], [{1: 2}]]
