"""aiodist.nn.parallel.DistributedDataParallel against torch's DDP, and its own rules.

- The same training run under torch's DDP (gloo, two real processes: tests/helpers/ddp_models.py)
  and under aiodist's (two ranks over real loopback sockets) leaves bit-identical parameters, for
  every mode: plain, gradient_as_bucket_view, small buckets, no_sync, the default comm hooks,
  BatchNorm buffers, find_unused_parameters.
- Model checks at construction, the unused-parameter error, the forgotten-await and direct
  ``loss.backward()`` errors, GPU-only arguments refused, comm hooks, and the debug logs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aiodist as dist  # noqa: E402
from aiodist.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from aiodist.nn.parallel import DDP, DistributedDataParallel, GradBucket  # noqa: E402
from aiodist.testing import run_world  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
import ddp_models  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HELPER = Path(__file__).resolve().parent / "helpers" / "ddp_models.py"


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, params=["thread", "loop"])
def backward_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with autograd on a worker thread and on the loop's thread (the
    construction reads AIODIST_DDP_BACKWARD)."""
    monkeypatch.setenv("AIODIST_DDP_BACKWARD", request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every mode's parameters after torch's DDP run (2 ranks, gloo; rank 0's)."""
    out = tmp_path_factory.mktemp("torch_ddp")
    port = out / "port"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(r), "2", str(port), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    return out


async def aiodist_run(rank: int, mode: str) -> bytes:
    model = ddp_models.build(mode)
    ddp = await DistributedDataParallel(model, **ddp_models.ddp_kwargs(mode))
    if mode == "hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(ddp_models.STEPS):
        opt.zero_grad()
        if mode == "nosync":
            with ddp.no_sync():
                x, y = ddp_models.batch(rank, step, 1)
                await ddp.backward(torch.nn.functional.mse_loss(ddp(x), y))
        x, y = ddp_models.batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x, **ddp_models.forward_kwargs(mode, step)), y)
        await ddp.backward(loss)
        opt.step()
    return ddp_models.checksum(model)


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ddp_models.MODES)
async def test_parameters_are_bit_identical_to_torch_ddp(mode: str, torch_reference: Path) -> None:
    got = await run_world(2, lambda rank: aiodist_run(rank, mode), backend="aio", timeout=60)
    assert got[0] == got[1], "the ranks' parameters differ"
    want = (torch_reference / mode).read_bytes()
    assert got[0] == want, f"{mode}: parameters after {ddp_models.STEPS} steps differ from torch DDP's"


def mlp() -> Any:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


async def test_construction_broadcasts_rank_0s_parameters_and_buffers() -> None:
    async def fn(rank: int) -> list[bytes]:
        torch.manual_seed(rank)  # every rank starts different
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model[1].running_mean.fill_(rank + 1.0)
        await DistributedDataParallel(model)
        return [t.detach().numpy().tobytes() for t in [*model.parameters(), *model.buffers()]]

    got = await run_world(3, fn)
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("world", [2, 3])
async def test_a_rank_with_another_model_fails_construction_on_every_rank(world: int) -> None:
    errors: list[str] = []

    async def fn(rank: int) -> None:
        width = 5 if rank == world - 1 else 4
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, width))
        try:
            await DistributedDataParallel(model)
        except RuntimeError as e:
            errors.append(str(e))
            return
        raise AssertionError("construction passed")

    await asyncio.wait_for(run_world(world, fn), 20)
    assert len(errors) == world
    for e in errors:
        assert "parameter 2 is 1.weight of shape [4, 8] (float32) on rank 0" in e
        assert f"1.weight of shape [5, 8] (float32) on rank {world - 1}" in e


async def test_a_rank_with_more_parameters_is_named() -> None:
    async def fn(rank: int) -> str:
        layers = [torch.nn.Linear(4, 4)] * (2 if rank else 1)
        try:
            await DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in layers]))
        except RuntimeError as e:
            return str(e)
        return ""

    got = await run_world(2, fn)
    assert all("rank 0 has 2 parameters requiring grad and rank 1 has 4" in g for g in got)
    assert all("parameter 2 is nothing on rank 0 and 1.weight of shape [4, 4]" in g for g in got)


async def test_gpu_only_arguments_are_refused() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
            DistributedDataParallel(mlp(), device_ids=[0])
        with pytest.raises(ValueError, match="output_device"):
            DistributedDataParallel(mlp(), output_device=0)
        with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
            DistributedDataParallel(torch.nn.Linear(2, 2).requires_grad_(False))
        with pytest.raises(TypeError, match="torch.nn.Module"):
            DistributedDataParallel([np.zeros(3)])  # type: ignore[arg-type]

    await run_world(1, fn)


async def test_the_alias_and_an_unawaited_construction() -> None:
    assert DDP is DistributedDataParallel

    async def fn(rank: int) -> None:
        ddp = DistributedDataParallel(mlp())
        with pytest.raises(RuntimeError, match=r"was not awaited: write `ddp = await DistributedDataParallel\(model\)`"):
            ddp(torch.randn(2, 8))
        assert await ddp is ddp
        ddp(torch.randn(2, 8))

    await run_world(1, fn)


async def test_unused_parameter_raises_torchs_error_at_the_next_step_naming_it() -> None:
    async def fn(rank: int) -> str:
        model = ddp_models.Branchy()
        ddp = await DistributedDataParallel(model)
        x, y = ddp_models.batch(rank, 0)
        loss = torch.nn.functional.mse_loss(ddp(x, use_side=False), y)
        await asyncio.wait_for(ddp.backward(loss), 10)  # the step itself ends: the peer is not left waiting
        with pytest.raises(RuntimeError) as e:
            ddp(x)
        # the error is raised once; the next step runs
        await ddp.backward(torch.nn.functional.mse_loss(ddp(x), y))
        return str(e.value)

    got = await run_world(2, fn)
    for rank, msg in enumerate(got):
        assert msg.startswith("Expected to have finished reduction in the prior iteration before starting a new one.")
        assert "find_unused_parameters=True" in msg
        assert f"Parameters which did not receive grad for rank {rank}: side.weight, side.bias" in msg
        assert f"Parameter indices which did not receive grad for rank {rank}: 2, 3" in msg


async def test_unused_on_one_rank_only_never_hangs_the_other() -> None:
    async def fn(rank: int) -> str:
        ddp = await DistributedDataParallel(ddp_models.Branchy())
        x, y = ddp_models.batch(rank, 0)
        await asyncio.wait_for(ddp.backward(torch.nn.functional.mse_loss(ddp(x, use_side=rank == 0), y)), 10)
        try:
            ddp(x)
        except RuntimeError as e:
            return str(e)
        return "no error"

    got = await run_world(2, fn)
    assert got[0] == "no error"
    assert "Parameters which did not receive grad for rank 1: side.weight, side.bias" in got[1]


async def test_find_unused_parameters_marks_them_ready_and_keeps_their_grad() -> None:
    async def fn(rank: int) -> tuple[bool, bool]:
        model = ddp_models.Branchy()
        ddp = await DistributedDataParallel(model, find_unused_parameters=True)
        x, y = ddp_models.batch(rank, 0)
        await asyncio.wait_for(ddp.backward(torch.nn.functional.mse_loss(ddp(x, use_side=False), y)), 10)
        unused_none = model.side.weight.grad is None  # used by no rank: left as it was
        model.zero_grad()
        # used on rank 0 only: rank 1 gets the average too
        await asyncio.wait_for(ddp.backward(torch.nn.functional.mse_loss(ddp(x, use_side=rank == 0), y)), 10)
        return unused_none, model.side.weight.grad is not None

    assert await run_world(2, fn) == [(True, True), (True, True)]


async def test_an_unawaited_backward_is_named_at_the_next_forward(caplog: pytest.LogCaptureFixture) -> None:
    async def fn(rank: int) -> str:
        ddp = await DistributedDataParallel(mlp())
        x = torch.randn(3, 8)
        coro = ddp.backward(ddp(x).sum())  # the await forgotten
        try:
            with pytest.raises(RuntimeError, match=r"ddp.backward\(loss\) was called but not awaited.*write `await ddp.backward\(loss\)`"):
                ddp(x)
        finally:
            coro.close()
        await ddp.backward(ddp(x).sum())  # then it works again
        return "ok"

    assert await run_world(2, fn) == ["ok", "ok"]


async def test_a_direct_loss_backward_is_named_at_the_next_forward() -> None:
    async def fn(rank: int) -> str:
        ddp = await DistributedDataParallel(mlp())
        x = torch.randn(3, 8)
        ddp(x).sum().backward()  # not through ddp.backward: the all-reduces start but nobody awaits them
        with pytest.raises(RuntimeError, match=r"loss.backward\(\) was called directly.*Write `await ddp.backward\(loss\)` instead"):
            ddp(x)
        await asyncio.sleep(0.2)  # the started all-reduces end in their group
        return "ok"

    assert await run_world(2, fn) == ["ok", "ok"]


async def test_no_sync_accumulates_and_the_next_synced_backward_reduces_the_sum() -> None:
    async def fn(rank: int) -> list[np.ndarray]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        ddp = await DistributedDataParallel(model)
        x = torch.full((1, 3), float(rank + 1))
        with ddp.no_sync():
            await ddp.backward(ddp(x).sum())
        local = model.weight.grad.clone()
        await ddp.backward(ddp(x).sum())
        return [local.numpy(), model.weight.grad.numpy().copy()]

    (l0, g0), (l1, g1) = await run_world(2, fn)
    np.testing.assert_array_equal(l0, [[1, 1, 1]])  # not reduced
    np.testing.assert_array_equal(l1, [[2, 2, 2]])
    np.testing.assert_array_equal(g0, g1)
    np.testing.assert_array_equal(g0, [[3, 3, 3]])  # (2*1 + 2*2) / 2


async def test_gradient_as_bucket_view_makes_grads_views_of_the_buckets() -> None:
    async def fn(rank: int) -> bool:
        model = mlp()
        ddp = await DistributedDataParallel(model, gradient_as_bucket_view=True)
        await ddp.backward(ddp(torch.randn(2, 8)).sum())
        flats = [b.flat for b in ddp.reducer.buckets]
        ptrs = {f.data_ptr(): f.numel() * f.element_size() for f in flats}
        return all(any(base <= p.grad.data_ptr() < base + size for base, size in ptrs.items()) for p in model.parameters())

    assert await run_world(2, fn) == [True, True]


async def test_buckets_are_reverse_order_with_a_small_first_bucket() -> None:
    async def fn(rank: int) -> list[list[int]]:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])  # 1 MiB each
        ddp = await DistributedDataParallel(model, bucket_cap_mb=25)
        return [b.members for b in ddp.reducer.buckets]

    got = await run_world(1, fn)
    assert got[0] == [[3], [2, 1, 0]]  # the first bucket closes at 1 MiB, as torch's


async def test_a_comm_hook_sees_torchs_bucket_api_and_can_be_a_plain_function() -> None:
    seen: list[tuple[int, int, bool, int]] = []

    def allreduce(process_group: Any, bucket: GradBucket) -> Any:  # the reference's example, as written for torch
        if dist.get_rank() == 0:
            seen.append((bucket.index(), len(bucket.parameters()), bucket.is_last(), len(bucket.gradients())))
        tensor = bucket.buffer().div_(dist.get_world_size(process_group))
        return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()

    async def fn(rank: int) -> bytes:
        torch.manual_seed(0)
        model = mlp()
        ddp = await DistributedDataParallel(model, bucket_cap_mb=0.0002)
        ddp.register_comm_hook(None, allreduce)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        await ddp.backward(ddp(x).sum())
        return b"".join(p.grad.numpy().tobytes() for p in model.parameters())

    got = await run_world(2, fn)
    assert got[0] == got[1]
    n = len(seen)
    assert n >= 2 and [s[0] for s in seen] == list(range(n)) and seen[n - 1][2] and not seen[0][2]


async def test_a_comm_hook_that_returns_no_awaitable_is_a_type_error() -> None:
    async def fn(rank: int) -> None:
        ddp = await DistributedDataParallel(mlp())
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        with pytest.raises(TypeError, match="must return an awaitable"):
            await ddp.backward(ddp(torch.randn(2, 8)).sum())
        with pytest.raises(RuntimeError, match="register_comm_hook"):
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    await run_world(1, fn)


async def test_bf16_hook_reduces_in_bfloat16() -> None:
    async def fn(rank: int) -> np.ndarray:
        model = torch.nn.Linear(4, 1, bias=False)
        ddp = await DistributedDataParallel(model)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        await ddp.backward(ddp(torch.full((1, 4), 1.0 + rank / 3)).sum())
        return model.weight.grad.numpy().copy()

    g0, g1 = await run_world(2, fn)
    np.testing.assert_array_equal(g0, g1)
    want = torch.tensor([(1.0 + 0 / 3), (1.0 + 1 / 3)]).to(torch.bfloat16).div(2).sum().to(torch.float32)
    assert float(g0[0, 0]) == pytest.approx(float(want), rel=1e-2)


async def test_buffers_follow_rank_0_after_each_step() -> None:
    async def fn(rank: int) -> bytes:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        ddp = await DistributedDataParallel(model)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
        await ddp.backward(ddp(x).sum())  # each rank's forward updated its running stats differently
        return model[1].running_mean.numpy().tobytes()

    got = await run_world(3, fn)
    assert got[0] == got[1] == got[2]


async def test_info_logs_the_init_line_and_detail_the_runtime_statistics(caplog: pytest.LogCaptureFixture) -> None:
    async def fn(rank: int) -> dict[str, Any]:
        ddp = await DistributedDataParallel(mlp())
        for _ in range(10):
            await ddp.backward(ddp(torch.randn(2, 8)).sum())
        return ddp._get_ddp_logging_data()

    old = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with caplog.at_level(logging.INFO, logger="aiodist.ddp"):
            data = await run_world(2, fn)
    finally:
        dist.set_debug_level(old)
    init = [r.getMessage() for r in caplog.records if "DDP Initialized with:" in r.getMessage()]
    assert len(init) == 2
    for field in (
        "bucket_cap_bytes: 26214400",
        "bucket_sizes: ",
        "world_size: 2",
        "backend_name: ",
        "module_name: Sequential",
        "num_parameter_tensors: 4",
        "total_parameter_size_bytes: 848",
        "find_unused_parameters: 0",
    ):
        assert field in init[0], field
    stats = [r.getMessage() for r in caplog.records if "Avg backward comm. time" in r.getMessage()]
    assert len(stats) == 2 and "[Rank 0 / 2] Training Sequential" in " ".join(stats)
    assert "Avg forward compute time" in stats[0] and "Avg backward comm/comp overlap time" in stats[0]
    assert data[0]["avg_backward_compute_time"] > 0 and data[0]["iteration"] == 10


async def test_off_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def fn(rank: int) -> None:
        ddp = await DistributedDataParallel(mlp())
        await ddp.backward(ddp(torch.randn(2, 8)).sum())

    with caplog.at_level(logging.INFO, logger="aiodist.ddp"):
        await run_world(2, fn)
    assert not [r for r in caplog.records if r.name == "aiodist.ddp"]


async def test_the_flight_recorder_names_the_buckets() -> None:
    async def fn(rank: int) -> list[str]:
        ddp = await DistributedDataParallel(mlp(), bucket_cap_mb=0.0002)
        await ddp.backward(ddp(torch.randn(2, 8)).sum())
        from aiodist.debug.recorder import dump_flight_recorder

        return [str(dump_flight_recorder())]

    got = await run_world(1, fn)
    assert "ddp bucket 0" in " ".join(got[0]) and "ddp bucket 1" in " ".join(got[0])


async def test_a_second_backward_in_one_step_is_refused() -> None:
    async def fn(rank: int) -> None:
        ddp = await DistributedDataParallel(mlp())
        out = ddp(torch.randn(2, 8)).sum()
        await ddp.backward(out, retain_graph=True)
        await ddp.backward(out)  # a new step: allowed (as torch's, gradients accumulate)

    await run_world(2, fn)


class TwoWays(torch.nn.Module):
    """Two square layers applied in an order that depends on the rank: the gradients arrive in
    opposite orders on the two ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = torch.nn.Linear(6, 6, bias=False)
        self.q = torch.nn.Linear(6, 6, bias=False)

    def forward(self, x: torch.Tensor, flip: bool) -> torch.Tensor:
        return self.p(self.q(x)) if flip else self.q(self.p(x))


async def test_buckets_issue_in_bucket_order_whatever_order_gradients_arrive_in() -> None:
    def local_grads(rank: int) -> list[torch.Tensor]:
        m = TwoWays()
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        m(x, flip=rank == 1).sum().backward()
        return [m.p.weight.grad, m.q.weight.grad]

    async def fn(rank: int) -> list[np.ndarray]:
        model = TwoWays()
        ddp = await DistributedDataParallel(model, bucket_cap_mb=0.0001)  # one bucket per layer
        assert len(ddp.reducer.buckets) == 2
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        await ddp.backward(ddp(x, flip=rank == 1).sum())
        return [model.p.weight.grad.numpy().copy(), model.q.weight.grad.numpy().copy()]

    got = await run_world(2, fn)
    want = [((a * 0.5) + (b * 0.5)).numpy() for a, b in zip(local_grads(0), local_grads(1))]
    for rank in range(2):
        np.testing.assert_array_equal(got[rank][0], want[0])
        np.testing.assert_array_equal(got[rank][1], want[1])


async def test_the_event_loop_runs_while_backward_computes(backward_mode: str) -> None:
    """On a worker thread the rank's other tasks (and the buckets' all-reduces) run during
    backward; on the loop's thread they wait for it (the ticks say which ran)."""

    async def fn(rank: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        ddp = await DistributedDataParallel(model, bucket_cap_mb=1)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        x = torch.randn(256, 512)
        loss = ddp(x).square().mean()
        at_last_grad: list[int] = []  # the first layer's weight gets its gradient last
        model[0].weight.register_hook(lambda g: at_last_grad.append(ticks) or g)
        task = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = ticks
        try:
            await ddp.backward(loss)
        finally:
            task.cancel()
        return at_last_grad[0] - before

    ticks = (await run_world(1, fn))[0]
    if backward_mode == "thread":
        assert ticks > 20, f"the loop ran {ticks} times during backward"
    else:
        # one turn: the step's task starts on the loop turn after the call; none during autograd
        assert ticks <= 1, f"the loop ran {ticks} times during a backward on its own thread"


@pytest.mark.parametrize(
    "choice, cores, local_ranks, thread",
    [
        ("thread", 1, 8, True),
        ("loop", 64, 2, False),
        ("", 16, 2, True),  # a core to spare: a thread
        ("auto", 16, 2, True),
        (" AUTO ", 2, 2, False),  # the ranks fill the cores: the loop
        ("auto", 2, 4, False),
        ("auto", 3, 2, True),
    ],
)
def test_where_backward_runs_is_one_rule(choice: str, cores: int, local_ranks: int, thread: bool) -> None:
    from aiodist.nn.parallel.distributed import backward_on_thread

    assert backward_on_thread(choice, cores, local_ranks) is thread


def test_a_bad_backward_choice_names_the_variable() -> None:
    from aiodist.nn.parallel.distributed import backward_on_thread

    with pytest.raises(ValueError, match="AIODIST_DDP_BACKWARD='threads': expected thread, loop or auto"):
        backward_on_thread("threads", 2, 2)


async def test_the_hooks_run_on_the_thread_the_choice_names(backward_mode: str) -> None:
    import threading

    async def fn(rank: int) -> tuple[bool, bool]:
        model = torch.nn.Linear(4, 4)
        seen: list[bool] = []
        model.weight.register_hook(lambda g: seen.append(threading.current_thread() is threading.main_thread()) or g)
        ddp = await DistributedDataParallel(model)
        await ddp.backward(ddp(torch.ones(2, 4)).sum())
        return seen[0], bool(ddp._get_ddp_logging_data()["backward_on_thread"])

    on_loop, on_thread = (await run_world(1, fn))[0]
    assert on_thread is (backward_mode == "thread")
    assert on_loop is (backward_mode == "loop")


async def test_cancelling_the_awaiting_task_does_not_cancel_the_step() -> None:
    async def fn(rank: int) -> tuple[str, bytes]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        ddp = await DistributedDataParallel(model, bucket_cap_mb=0.3)
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))
        task = asyncio.create_task(ddp.backward(ddp(x).square().sum()))
        await asyncio.sleep(0.002)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        try:
            ddp(x)
            early = "no error"
        except RuntimeError as e:
            early = str(e)
        assert ddp._step_task is not None
        await asyncio.wait([ddp._step_task], timeout=10)  # the step ends on its own
        grads = b"".join(p.grad.numpy().tobytes() for p in model.parameters())
        await ddp.backward(ddp(x).sum())  # the next step runs
        return early, grads

    (e0, g0), (e1, g1) = await run_world(2, fn)
    assert g0 == g1  # the cancelled step still averaged every gradient
    assert "the previous ddp.backward is still running" in e0 + e1


def local_average(make: Any, xs: list[Any]) -> list[Any]:
    grads = []
    for x in xs:
        m = make()
        m(x).square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    return [(a * 0.5) + (b * 0.5) for a, b in zip(*grads)]


def wide() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])


async def test_a_bucket_is_issued_only_once_it_is_filled() -> None:
    """Buckets of one big gradient each: the loop must not issue a bucket whose last gradient has
    arrived but is still being written (the backward thread fills it without the GIL)."""
    xs = [torch.randn(64, 1024, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    want = local_average(wide, xs)

    async def fn(rank: int) -> list[Any]:
        model = wide()
        ddp = await DistributedDataParallel(model, bucket_cap_mb=0.001)
        out = []
        for _ in range(4):
            model.zero_grad()
            await ddp.backward(ddp(xs[rank]).square().sum())
            out.append([p.grad.clone() for p in model.parameters()])
        return out

    for per_rank in await run_world(2, fn, backend="aio"):
        for grads in per_rank:
            for g, w in zip(grads, want):
                assert torch.equal(g, w)


async def test_a_no_grad_forward_before_backward_keeps_the_step_synced() -> None:
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def make() -> Any:
        torch.manual_seed(0)
        return mlp()

    want = local_average(make, xs)

    async def fn(rank: int) -> list[Any]:
        model = make()
        ddp = await DistributedDataParallel(model)
        loss = ddp(xs[rank]).square().sum()
        with torch.no_grad():
            ddp(xs[rank])  # an evaluation forward between forward and backward
        await ddp.backward(loss)
        return [p.grad for p in model.parameters()]

    for grads in await run_world(2, fn):
        for g, w in zip(grads, want):
            assert torch.equal(g, w)


async def test_a_local_backward_after_the_step_is_the_users_own() -> None:
    async def fn(rank: int) -> str:
        model = mlp()
        ddp = await DistributedDataParallel(model)
        for _ in range(2):
            x = torch.randn(2, 8)
            await ddp.backward(ddp(x).sum())
            if rank == 0:
                model(x).sum().backward()  # the bare module, after the step: no collective, no error
        return "ok"

    assert await asyncio.wait_for(run_world(2, fn), 20) == ["ok", "ok"]


async def test_a_step_that_fails_after_its_caller_was_cancelled_is_named_next() -> None:
    async def fn(rank: int) -> str:
        ddp = await DistributedDataParallel(mlp())

        async def broken(state: Any, bucket: GradBucket) -> Any:
            await asyncio.sleep(0.05)
            raise ValueError("hook broke")

        ddp.register_comm_hook(None, broken)
        x = torch.randn(2, 8)
        task = asyncio.create_task(ddp.backward(ddp(x).sum()))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait([task])
        assert ddp._step_task is not None
        await asyncio.wait([ddp._step_task], timeout=10)
        with pytest.raises(RuntimeError, match="the previous ddp.backward failed .* hook broke"):
            ddp(x)
        return "ok"

    assert await run_world(2, fn) == ["ok", "ok"]


async def test_the_unused_error_waits_for_a_forward_that_expects_a_backward() -> None:
    async def fn(rank: int) -> str:
        ddp = await DistributedDataParallel(ddp_models.Branchy())
        x, y = ddp_models.batch(rank, 0)
        await ddp.backward(torch.nn.functional.mse_loss(ddp(x, use_side=False), y))
        with torch.no_grad():
            ddp(x)  # evaluation: not the next training step
        with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
            ddp(x)
        return "ok"

    assert await run_world(2, fn) == ["ok", "ok"]


async def test_big_buckets_are_reduced_straight_into_the_gradients(backward_mode: str) -> None:
    """The default (gradient_as_bucket_view=False): a bucket of few big gradients is reduced
    straight into param.grad (aiodist.c10d.all_reduce_into), no copy back, and the gradients are
    the averages, bit for bit: (g0 / 2) + (g1 / 2). A comm hook keeps the copy back."""

    async def fn(rank: int) -> tuple[set[int], int, list[np.ndarray], list[np.ndarray]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1100, 1100), torch.nn.Linear(1100, 1100))  # two buckets of over 4 MiB
        ddp = await DistributedDataParallel(model)
        x = torch.randn(4, 1100, generator=torch.Generator().manual_seed(rank))
        loss = ddp(x).square().sum()
        params = list(model.parameters())
        grad = functools.partial(torch.autograd.grad, loss, params, retain_graph=True)
        # the reference on the thread DDP's backward runs on (a worker thread may round otherwise)
        local = [g.detach().clone() for g in (await asyncio.to_thread(grad) if backward_mode == "thread" else grad())]
        await ddp.backward(loss)
        halves = [(g * 0.5).numpy() for g in local]
        return ddp.reducer.written, len(list(model.parameters())), halves, [p.grad.numpy().copy() for p in model.parameters()]

    (w0, n, h0, g0), (w1, _, h1, g1) = await run_world(2, fn, backend="gloo", timeout=60)
    assert w0 == w1 == set(range(n))
    for a, b, x, y in zip(g0, g1, h0, h1, strict=True):
        np.testing.assert_array_equal(a, b)  # the same bits on every rank
        if backward_mode == "loop":  # the reference ran on the same thread as DDP's backward
            np.testing.assert_array_equal(a, x + y)
        else:  # autograd on another thread may round the local gradients otherwise (its kernels' state is per
            # thread, and a matmul's sum order with it): float32 rounding, on the scale of the whole array
            np.testing.assert_allclose(a, x + y, rtol=1e-5, atol=1e-5 * float(np.abs(x + y).max()))


async def test_after_the_default_group_shrinks_a_new_ddp_takes_the_module_over() -> None:
    """Rank 1 of 3 is gone: the survivors shrink the default group. The old DDP's next step fails
    naming the shrink (its group is gone); a new ``await DistributedDataParallel(model)`` takes
    the module over: the old one's hooks no longer fire, its use says why, and the new one
    averages over the 2 survivors from the new rank 0's parameters."""

    async def fn(rank: int) -> bytes:
        torch.manual_seed(rank)
        model = torch.nn.Linear(3, 1)
        old = await DistributedDataParallel(model)
        if rank == 1:
            return b""
        await dist.shrink_group([1], shrink_flags=dist.SHRINK_ABORT)
        x = torch.full((2, 3), float(rank + 1))
        with pytest.raises(dist.DistBackendError, match="destroyed by shrink_group of the default group"):
            await old.backward(old(x).sum())
        model.zero_grad()
        if rank == 2:
            with torch.no_grad():
                model.weight.add_(1.0)  # the new rank 0's parameters win
        new = await DistributedDataParallel(model)
        assert not old._hooks  # removed: they cannot fire into the old group
        with pytest.raises(RuntimeError, match="no longer serves its module.*destroyed by shrink_group"):
            old(x)
        with pytest.raises(RuntimeError, match="no longer serves its module"):
            await old.backward(x.sum())
        await new.backward(new(x).sum())
        # x is 1s on new rank 0, 3s on new rank 1: the mean of d(sum)/dW is 2 * (1 + 3) / 2 per element
        assert torch.equal(model.weight.grad, torch.full((1, 3), 4.0)), model.weight.grad
        assert new.process_group is dist.group.WORLD and dist.get_world_size() == 2
        return model.weight.detach().numpy().tobytes()

    got = await run_world(3, fn, timeout=30)
    assert got[0] == got[2]
