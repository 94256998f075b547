"""aiodist.model_averaging: average_parameters, average_parameters_or_parameter_groups and
get_params_to_average over numpy arrays (world sizes 1-5, memory and socket backends) and torch
tensors (skipped without torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.c10d.objects import all_gather_object
from aiodist.model_averaging import average_parameters, average_parameters_or_parameter_groups, get_params_to_average
from aiodist.testing import run_world

SIZES = [1, 2, 3, 4, 5]
SHAPES = [(3, 4), (7,), (2, 1, 5), ()]


def params_of(rank: int, dtype: str = "float64") -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.integers(-64, 64, size=s).astype(dtype) for s in SHAPES]


def expected(n: int, dtype: str = "float64") -> list[np.ndarray]:
    per_rank = [params_of(r, dtype) for r in range(n)]
    return [np.stack([p[i] for p in per_rank]).astype(np.float64).sum(axis=0) / n for i in range(len(SHAPES))]


async def gathered(arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every rank's arrays, to check that every rank holds the same bits."""
    out: list[Any] = [None] * dist.get_world_size()
    await all_gather_object(out, arrays)
    return out


# -- numpy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
async def test_average_parameters_numpy(n: int) -> None:
    async def fn(rank: int) -> None:
        params = params_of(rank)
        views = [p.reshape(-1) for p in params]  # views share the storage and see the average
        ids = [id(p) for p in params]
        await average_parameters(iter(params), None)  # an iterator, as model.parameters() is
        assert [id(p) for p in params] == ids
        for p, v, e in zip(params, views, expected(n)):
            assert p.dtype == np.float64 and p.shape == e.shape
            np.testing.assert_allclose(p, e, rtol=1e-12)
            assert np.shares_memory(p, v)
        everyone = await gathered(params)
        for other in everyone:  # bitwise the same on every rank (one all_reduce)
            for a, b in zip(other, params):
                assert a.tobytes() == b.tobytes()

    await run_world(n, fn)


@pytest.mark.parametrize("n", [2, 3])
async def test_average_parameters_mixed_dtypes_cast_back(n: int) -> None:
    """Mixed dtypes are flattened in their common dtype (numpy's promotion, as torch.cat's) and
    written back in each parameter's own dtype."""

    async def fn(rank: int) -> None:
        a = np.full(4, rank + 1, dtype=np.float16)
        b = np.full((2, 2), 10.0 * rank, dtype=np.float32)
        c = np.full(3, 1j * rank, dtype=np.complex64)
        await average_parameters([a, b], dist.group.WORLD)
        assert a.dtype == np.float16 and b.dtype == np.float32
        np.testing.assert_allclose(a, (n + 1) / 2)
        np.testing.assert_allclose(b, 10.0 * (n - 1) / 2)
        d = np.ones(2, dtype=np.float32) * rank
        await average_parameters([d, c], None)  # complex and real: the real one stays real
        np.testing.assert_allclose(d, (n - 1) / 2)
        np.testing.assert_allclose(c, 1j * (n - 1) / 2)

    await run_world(n, fn)


async def test_average_parameters_non_contiguous_numpy() -> None:
    async def fn(rank: int) -> None:
        base = np.zeros((4, 6))
        p = base[:, ::2]  # a strided view: written back through the view
        p[...] = rank * 2.0
        await average_parameters([p], None)
        assert (base[:, ::2] == 1.0).all() and (base[:, 1::2] == 0).all()

    await run_world(2, fn)


@pytest.mark.parametrize("n", [2, 4])
async def test_parameter_groups_numpy(n: int) -> None:
    """Optimizer-style parameter groups (dicts with "params"); every numpy array counts."""

    async def fn(rank: int) -> None:
        params = params_of(rank, "float32")
        groups = [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}]
        assert [id(p) for p in get_params_to_average(groups)] == [id(p) for p in params]
        await average_parameters_or_parameter_groups(groups, None)
        for p, e in zip(params, expected(n, "float32")):
            np.testing.assert_allclose(p, e, rtol=1e-6)
        plain = params_of(rank, "float32")
        await average_parameters_or_parameter_groups(plain, None)  # model-style: a list of arrays
        for p, e in zip(plain, expected(n, "float32")):
            np.testing.assert_allclose(p, e, rtol=1e-6)

    await run_world(n, fn)


async def test_average_parameters_in_a_subgroup_and_non_members_do_nothing() -> None:
    async def fn(rank: int) -> None:
        g = await dist.new_group([0, 2, 3])
        p = np.full(5, float(rank))
        await average_parameters([p], g)
        await average_parameters_or_parameter_groups([{"params": [p]}], g)
        if isinstance(g, dist.ProcessGroup):
            np.testing.assert_allclose(p, (0 + 2 + 3) / 3)
        else:
            assert g == dist.GroupMember.NON_GROUP_MEMBER
            assert (p == rank).all()  # untouched, nothing sent
        await dist.barrier()

    await run_world(4, fn)


async def test_argument_errors_leave_the_group_usable() -> None:
    async def fn(rank: int) -> None:
        frozen = np.ones(3)
        frozen.flags.writeable = False
        with pytest.raises(TypeError, match="only floating and complex"):
            await average_parameters([np.ones(2), np.arange(3)], None)
        with pytest.raises(ValueError, match="read-only"):
            await average_parameters([frozen], None)
        with pytest.raises(ValueError, match="no parameters"):
            await average_parameters([], None)
        with pytest.raises(TypeError, match="iterable"):
            await average_parameters(3.0, None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="group must be"):
            await average_parameters([np.ones(2)], "world")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not supported"):
            get_params_to_average([np.ones(2), [1.0, 2.0]])
        with pytest.raises(TypeError, match="not supported"):
            await average_parameters_or_parameter_groups([{"params": [3.0]}], None)
        with pytest.raises(TypeError, match="'params' entry"):
            get_params_to_average([{"lr": 0.1}])
        p = np.full(2, float(rank))
        await average_parameters([p], None)  # the group took no sequence number above
        assert (p == 1.0).all()

    await run_world(3, fn)


@pytest.mark.parametrize("n", [2, 3])
async def test_average_parameters_over_gloo(n: int) -> None:
    async def fn(rank: int) -> None:
        params = params_of(rank, "float32") + [np.full(300_000, float(rank), dtype=np.float32)]
        await average_parameters(params, None)
        for p, e in zip(params, expected(n, "float32")):
            np.testing.assert_allclose(p, e, rtol=1e-6)
        assert (params[-1] == (n - 1) / 2).all()

    await run_world(n, fn, backend="gloo", timeout=20)


# -- torch -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_torch_model_parameters(n: int) -> None:
    torch = pytest.importorskip("torch")

    async def fn(rank: int) -> None:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        before = [p.detach().clone() for p in model.parameters()]
        storages = [p.data_ptr() for p in model.parameters()]
        # no gradients yet: nothing to average (torch fails on the empty list; so does aiodist)
        assert get_params_to_average(model.parameters()) == []
        model(torch.ones(1, 4)).sum().backward()
        model[1].bias.grad = None  # a parameter without a gradient is left out
        chosen = get_params_to_average(model.parameters())
        assert len(chosen) == 3 and all(p is not model[1].bias for p in chosen)
        await average_parameters_or_parameter_groups(model.parameters(), None)
        assert [p.data_ptr() for p in model.parameters()] == storages  # updated in place
        everyone = await gathered([p.detach().numpy().copy() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            if p is model[1].bias:
                assert torch.equal(p, before[i])
                continue
            mean = np.mean([everyone[r][i] for r in range(n)], axis=0)
            np.testing.assert_allclose(p.detach().numpy(), mean, rtol=1e-5, atol=1e-6)
            assert all(everyone[r][i].tobytes() == everyone[0][i].tobytes() for r in range(n))
        # autograd state is untouched
        assert all(p.requires_grad for p in model.parameters())
        assert model[0].weight.grad is not None and model[1].bias.grad is None

    await run_world(n, fn)


async def test_torch_optimizer_param_groups_and_dtypes() -> None:
    torch = pytest.importorskip("torch")

    async def fn(rank: int) -> None:
        w = torch.nn.Parameter(torch.full((3,), float(rank)))
        h = torch.nn.Parameter(torch.full((2,), float(rank), dtype=torch.bfloat16))
        frozen = torch.nn.Parameter(torch.full((2,), float(rank)))
        opt = torch.optim.SGD([{"params": [w, frozen]}, {"params": [h], "lr": 0.5}], lr=0.1)
        w.grad = torch.zeros_like(w)
        h.grad = torch.zeros_like(h)
        await average_parameters_or_parameter_groups(opt.param_groups, None)
        assert h.dtype == torch.bfloat16
        assert torch.equal(w.detach(), torch.full((3,), 1.0)) and torch.equal(h.detach().float(), torch.full((2,), 1.0))
        assert torch.equal(frozen.detach(), torch.full((2,), float(rank)))  # no grad: not averaged
        plain = torch.full((4,), 2.0 * rank)  # a plain tensor passed to average_parameters directly
        await average_parameters([plain], None)
        assert torch.equal(plain, torch.full((4,), 2.0))
        with pytest.raises(TypeError, match="only floating"):
            await average_parameters([torch.arange(3)], None)
        with pytest.raises(TypeError, match="all numpy arrays or all torch tensors"):
            await average_parameters([torch.ones(2), np.ones(2)], None)

    await run_world(3, fn)


async def test_no_grad_mode_does_not_leak_to_other_tasks() -> None:
    """The averaging awaits its all_reduce; other tasks running meanwhile keep grad mode on."""
    torch = pytest.importorskip("torch")
    import asyncio

    async def fn(rank: int) -> None:
        seen: list[bool] = []

        async def watcher() -> None:
            for _ in range(20):
                seen.append(torch.is_grad_enabled())
                await asyncio.sleep(0)

        task = asyncio.create_task(watcher())
        await average_parameters([torch.full((100_000,), float(rank))], None)
        await task
        assert all(seen)

    await run_world(2, fn)
