"""aiodist.device_mesh: DeviceMesh and init_device_mesh over run_world (memory backend, and the
socket backend for a few): group layout per dimension, coordinates, local ranks, collectives on
every dimension's groups, slicing by names, from_group, errors, and the reference docs' examples
(on "cpu" instead of "cuda")."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.device_mesh import DeviceMesh, init_device_mesh
from aiodist.testing import run_world
from aiodist.testing.ports import free_port


def row_along(mesh: np.ndarray, coord: list[int], dim: int) -> list[int]:
    """The ranks that share every coordinate of ``coord`` except the one along ``dim``."""
    index: list[Any] = list(coord)
    index[dim] = slice(None)
    return [int(r) for r in mesh[tuple(index)]]


async def check_mesh(mesh: DeviceMesh, rank: int) -> None:
    """Every per-dimension property of ``mesh`` on ``rank``, plus an all_reduce over every
    dimension's group (each rank contributes 1 + its global rank)."""
    arr = mesh.mesh
    coord = mesh.get_coordinate()
    assert coord is not None
    assert int(arr[tuple(coord)]) == rank == mesh.get_rank()
    assert mesh.shape == arr.shape and mesh.ndim == arr.ndim and mesh.size() == arr.size
    groups = mesh.get_all_groups()
    assert len(groups) == mesh.ndim
    for dim in range(mesh.ndim):
        g = mesh.get_group(dim)
        assert g is groups[dim]
        row = row_along(arr, coord, dim)
        assert dist.get_process_group_ranks(g) == row  # in mesh order
        assert mesh.get_local_rank(dim) == coord[dim] == g.rank()
        assert mesh.size(dim) == len(row) == g.size()
        if mesh.mesh_dim_names:
            name = mesh.mesh_dim_names[dim]
            assert mesh.get_group(name) is g and mesh.get_local_rank(name) == coord[dim]
        x = np.full(3, rank + 1, dtype=np.int64)
        await dist.all_reduce(x, group=g)
        assert (x == sum(r + 1 for r in row)).all()


# -- init_device_mesh --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_1d_mesh_over_the_world_reuses_the_default_group(n: int) -> None:
    async def fn(rank: int) -> None:
        mesh = await init_device_mesh("cpu", (n,))
        assert mesh.get_group() is dist.group.WORLD
        assert dist.get_pg_count() == 1  # no new group
        assert mesh.mesh.tolist() == list(range(n)) and mesh.mesh_dim_names is None
        assert mesh.get_coordinate() == [rank] and mesh.get_local_rank() == rank
        assert mesh.device_type == "cpu"
        await check_mesh(mesh, rank)

    await run_world(n, fn, timeout=10)


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2), (1, 4), (4, 1)])
async def test_2d_mesh(shape: tuple[int, int]) -> None:
    n = shape[0] * shape[1]

    async def fn(rank: int) -> list[int]:
        mesh = await init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        assert mesh.mesh.tolist() == np.arange(n).reshape(shape).tolist()
        assert mesh.get_coordinate() == list(divmod(rank, shape[1]))
        assert dist.get_process_group_ranks(mesh.get_group("dp")) == [rank % shape[1] + shape[1] * i for i in range(shape[0])]
        assert dist.get_process_group_ranks(mesh.get_group("tp")) == [rank - rank % shape[1] + j for j in range(shape[1])]
        await check_mesh(mesh, rank)
        assert dist.get_pg_count() == 3  # the default group and one group per dimension
        return [mesh.get_group("dp").group_id, mesh.get_group("tp").group_id]

    ids = await run_world(n, fn, timeout=10)
    # every rank made every sub-group, in the same order: the ids agree and tell groups apart
    for a, b in itertools.combinations(range(n), 2):
        same_col, same_row = a % shape[1] == b % shape[1], a // shape[1] == b // shape[1]
        assert (ids[a][0] == ids[b][0]) == same_col
        assert (ids[a][1] == ids[b][1]) == same_row
    assert sorted({i for pair in ids for i in pair}) == list(range(1, shape[0] + shape[1] + 1))


async def test_3d_mesh_groups_and_slices() -> None:
    async def fn(rank: int) -> None:
        mesh = await init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "cp"))
        dp, pp, cp = rank // 4, rank // 2 % 2, rank % 2
        assert mesh.get_coordinate() == [dp, pp, cp]
        await check_mesh(mesh, rank)
        assert dist.get_pg_count() == 4
        # torch's __getitem__ docstring, second example
        dp_cp = mesh["dp", "cp"]
        assert dp_cp.mesh.tolist() == ([[0, 1], [4, 5]] if pp == 0 else [[2, 3], [6, 7]])
        cp_dp = mesh["cp", "dp"]
        assert cp_dp.mesh.tolist() == ([[0, 4], [1, 5]] if pp == 0 else [[2, 6], [3, 7]])
        assert cp_dp.mesh_dim_names == ("cp", "dp") and cp_dp.get_coordinate() == [cp, dp]
        assert cp_dp.get_group("dp") is mesh.get_group("dp") and cp_dp.get_group(0) is mesh.get_group("cp")
        await check_mesh(dp_cp, rank)
        await check_mesh(cp_dp, rank)
        pp_mesh = mesh["pp"]
        assert pp_mesh.mesh.tolist() == [4 * dp + cp, 4 * dp + 2 + cp] and pp_mesh.get_group() is mesh.get_group("pp")
        await check_mesh(pp_mesh, rank)
        # a submesh of a submesh
        assert cp_dp["dp"] == mesh["dp"] and cp_dp["dp"].get_group() is mesh.get_group("dp")
        assert mesh["dp", "pp", "cp"] is mesh
        assert dist.get_pg_count() == 4  # slicing made no group

    await run_world(8, fn, timeout=10)


async def test_init_device_mesh_argument_errors() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="world size is 4"):
            await init_device_mesh("cpu", (2, 3))
        with pytest.raises(ValueError, match="unique"):
            await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))
        with pytest.raises(ValueError, match="same length"):
            await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="index is not supported"):
            await init_device_mesh("cuda:0", (4,))
        with pytest.raises(ValueError, match="positive ints"):
            await init_device_mesh("cpu", (4, 0))
        with pytest.raises(TypeError, match="mesh_shape"):
            await init_device_mesh("cpu", 4)  # type: ignore[arg-type]
        with pytest.raises(dist.DistBackendError, match="does not serve device type 'cuda'"):
            await init_device_mesh("cuda", (4,))
        with pytest.raises(ValueError, match="redundant dim index 0"):
            await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={0: "memory", "dp": "memory"})
        with pytest.raises(ValueError, match="invalid keys"):
            await init_device_mesh("cpu", (2, 2), backend_override={5: "memory"})
        # another backend for one dimension is refused before any group is made
        before = dist.current_world().next_group_id
        with pytest.raises(dist.DistBackendError, match="one backend per World"):
            await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": "gloo"})
        assert dist.current_world().next_group_id == before and dist.get_pg_count() == 1
        # the World's own backend is accepted (by name, or with options); a 1-D mesh with an
        # override gets a new group, as in torch
        mesh = await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": ("memory", None), 0: "memory"})
        await check_mesh(mesh, rank)
        m1 = await init_device_mesh("cpu", (4,), backend_override={0: "memory"})
        assert m1.get_group() is not dist.group.WORLD
        await check_mesh(m1, rank)

    await run_world(4, fn, timeout=10)


async def test_cuda_without_nccl_is_refused_before_initialising() -> None:
    with dist.use_world(dist.World()):
        if dist.is_nccl_available():  # pragma: no cover - only where aiodist_cuda runs
            pytest.skip("nccl is available here")
        with pytest.raises(dist.DistBackendError, match="'nccl' is not available"):
            await init_device_mesh("cuda", (1,))
        assert not dist.is_initialized()


async def test_init_device_mesh_initialises_the_default_group_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    with dist.use_world(dist.World()):
        mesh = await init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        try:
            assert dist.is_initialized() and dist.get_backend() == "gloo"
            assert mesh.get_group("dp") is dist.group.WORLD and mesh.get_coordinate() == [0]
            x = np.ones(2)
            await dist.all_reduce(x, group=mesh.get_group())
            assert (x == 1).all()
        finally:
            await dist.destroy_process_group()


# -- DeviceMesh(...) ---------------------------------------------------------------------------


async def test_reference_example_mesh_2x4() -> None:
    """torch's DeviceMesh docs: 2 hosts with 4 devices each; a reduction over dim 0 reduces across
    columns (0, 4) .. (3, 7), one over dim 1 across rows (0, 1, 2, 3) and (4, 5, 6, 7); and the
    get_local_rank example."""

    async def fn(rank: int) -> None:
        mesh = await DeviceMesh(device_type="cpu", mesh=[[0, 1, 2, 3], [4, 5, 6, 7]])
        assert mesh.get_local_rank(mesh_dim=0) == (0 if rank in (0, 1, 2, 3) else 1)
        assert mesh.get_local_rank(mesh_dim=1) == rank % 4
        x = np.array([rank], dtype=np.int64)
        await dist.all_reduce(x, group=mesh.get_group(0))
        assert x[0] == (rank % 4) + (rank % 4 + 4)
        y = np.array([rank], dtype=np.int64)
        await dist.all_reduce(y, group=mesh.get_group(1))
        assert y[0] == (6 if rank < 4 else 22)
        await check_mesh(mesh, rank)

    await run_world(8, fn, timeout=10)


async def test_reference_example_init_device_mesh_and_slicing() -> None:
    """torch's init_device_mesh example ((8,) and (2, 8) named dp/tp, on 16 ranks here) and its
    __getitem__ docstring's first example ((2, 4) named dp/tp on 8 ranks)."""

    async def fn16(rank: int) -> None:
        mesh_1d = await init_device_mesh("cpu", mesh_shape=(16,))
        mesh_2d = await init_device_mesh("cpu", mesh_shape=(2, 8), mesh_dim_names=("dp", "tp"))
        assert mesh_1d.get_group() is dist.group.WORLD
        assert mesh_2d.get_coordinate() == [rank // 8, rank % 8]
        await check_mesh(mesh_2d, rank)

    await run_world(16, fn16, timeout=10)

    async def fn8(rank: int) -> None:
        mesh_2d = await init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh_2d["tp"], mesh_2d["dp"]
        assert tp_mesh.mesh.tolist() == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])
        assert dp_mesh.mesh.tolist() == [rank % 4, rank % 4 + 4]
        assert tp_mesh.mesh_dim_names == ("tp",) and tp_mesh.get_group() is mesh_2d.get_group("tp")
        assert dp_mesh.get_local_rank() == rank // 4 and tp_mesh.get_local_rank() == rank % 4
        await check_mesh(tp_mesh, rank)
        await check_mesh(dp_mesh, rank)

    await run_world(8, fn8, timeout=10)


async def test_mesh_inputs_and_order() -> None:
    """A permuted mesh: groups keep the mesh's order, so local rank == coordinate and an
    all_gather along a dimension comes back in mesh order; numpy, nested lists and torch
    tensors are accepted alike."""
    layout = [[3, 1], [0, 2]]

    async def fn(rank: int) -> None:
        mesh = await DeviceMesh("cpu", np.array(layout, dtype=np.int32), mesh_dim_names=("a", "b"))
        assert mesh.mesh.dtype == np.int64 and not mesh.mesh.flags.writeable
        await check_mesh(mesh, rank)
        coord = mesh.get_coordinate()
        assert coord is not None
        for dim in range(2):
            row = row_along(mesh.mesh, coord, dim)
            outs = [np.empty(1, dtype=np.int64) for _ in row]
            await dist.all_gather(outs, np.array([rank]), group=mesh.get_group(dim))
            assert [int(o[0]) for o in outs] == row
        same = await DeviceMesh("cpu", layout, mesh_dim_names=("a", "b"))
        assert same == mesh and hash(same) == hash(mesh)

    await run_world(4, fn, timeout=10)


async def test_torch_tensor_mesh() -> None:
    torch = pytest.importorskip("torch")

    async def fn(rank: int) -> None:
        mesh = await DeviceMesh("cpu", torch.arange(4, dtype=torch.int32).view(2, 2), mesh_dim_names=("dp", "tp"))
        assert mesh == await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        await check_mesh(mesh, rank)

    await run_world(4, fn, timeout=10)


async def test_mesh_smaller_than_the_world() -> None:
    """Ranks outside the mesh make every sub-group too (the counter stays in step) but hold
    none: no coordinate, get_group refuses."""

    async def fn(rank: int) -> None:
        mesh = await DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "y"))
        if rank == 4:
            assert mesh.get_coordinate() is None and mesh.get_rank() == 4
            with pytest.raises(ValueError, match="not in this mesh"):
                mesh.get_group("x")
            with pytest.raises(ValueError, match="not in this mesh"):
                mesh["x"]
            assert dist.get_pg_count() == 1
        else:
            await check_mesh(mesh, rank)
        # a later group over everyone still lines up
        g = await dist.new_group()
        assert isinstance(g, dist.ProcessGroup) and g.group_id == 5
        x = np.ones(1)
        await dist.all_reduce(x, group=g)
        assert x[0] == 5

    await run_world(5, fn, timeout=10)


async def test_device_mesh_errors() -> None:
    async def fn(rank: int) -> None:
        with pytest.raises(ValueError, match="at most once"):
            DeviceMesh("cpu", [[0, 1], [1, 2]])
        with pytest.raises(ValueError, match="rectangular"):
            DeviceMesh("cpu", [[0, 1], [2]])
        with pytest.raises(ValueError, match="integer"):
            DeviceMesh("cpu", [0.0, 1.0])
        with pytest.raises(ValueError, match="non-negative"):
            DeviceMesh("cpu", [-1, 0])
        with pytest.raises(ValueError, match="at least one dimension"):
            DeviceMesh("cpu", 3)
        with pytest.raises(ValueError, match="empty"):
            DeviceMesh("cpu", [])
        with pytest.raises(ValueError, match="same length"):
            DeviceMesh("cpu", [0, 1], mesh_dim_names=("a", "b"))
        with pytest.raises(TypeError, match="device_type"):
            DeviceMesh(0, [0, 1])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="backend_override has 1 entries"):
            DeviceMesh("cpu", [[0, 1], [2, 3]], backend_override=[(None, None)])
        with pytest.raises(TypeError, match="mesh_dim_names must be a tuple"):
            DeviceMesh("cpu", [0, 1], mesh_dim_names="dp")
        with pytest.raises(ValueError, match="bigger than default world size"):
            await DeviceMesh("cpu", list(range(5)))
        with pytest.raises(ValueError, match="out of range"):
            await DeviceMesh("cpu", [0, 7])
        pending = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        with pytest.raises(RuntimeError, match="await it first"):
            pending.get_group("dp")
        with pytest.raises(RuntimeError, match="await it first"):
            pending["dp"]
        assert pending.shape == (2, 2) and pending.size(1) == 2  # the layout needs no groups
        mesh = await pending
        assert await mesh is mesh  # awaiting again makes nothing new
        assert dist.get_pg_count() == 3
        with pytest.raises(RuntimeError, match="mesh_dim"):
            mesh.get_group()
        with pytest.raises(RuntimeError, match="mesh_dim"):
            mesh.get_local_rank()
        with pytest.raises(KeyError, match="does not exist"):
            mesh.get_group("pp")
        with pytest.raises(IndexError, match="out of range"):
            mesh.get_group(2)
        with pytest.raises(TypeError, match="mesh_dim"):
            mesh.get_group(1.0)  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="Invalid mesh_dim_names"):
            mesh["pp"]
        with pytest.raises(KeyError, match="named twice"):
            mesh["dp", "dp"]
        unnamed = await DeviceMesh("cpu", [[0, 1], [2, 3]])
        with pytest.raises(RuntimeError, match="without mesh_dim_names"):
            unnamed["dp"]
        with pytest.raises(KeyError, match="no `mesh_dim_names`"):
            unnamed.get_group("dp")
        assert unnamed.get_group(-1) is unnamed.get_group(1)

    await run_world(4, fn, timeout=10)


async def test_concurrent_awaits_create_the_groups_once() -> None:
    async def fn(rank: int) -> None:
        pending = DeviceMesh("cpu", [[0, 1], [2, 3]])
        a, b = await asyncio.gather(pending, pending)  # type: ignore[call-overload]
        assert a is b is pending and dist.get_pg_count() == 3
        await check_mesh(a, rank)

    await run_world(4, fn, timeout=10)


async def test_repr_eq_hash() -> None:
    async def fn(rank: int) -> None:
        m = await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert repr(m) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
        assert repr(m["tp"]) == f"DeviceMesh('cpu', {[0, 1] if rank < 2 else [2, 3]}, mesh_dim_names=('tp',))"
        # equality is by layout, device type and names, not by groups
        assert m == DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        assert m != DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
        assert m != DeviceMesh("cpu", [[0, 1], [2, 3]])
        assert m != DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("dp",))
        assert m != DeviceMesh("cuda", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        assert m != "mesh"
        assert len({m, DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")), m["dp"]}) == 2

    await run_world(4, fn, timeout=10)


# -- from_group --------------------------------------------------------------------------------


async def test_from_group() -> None:
    async def fn(rank: int) -> None:
        evens = await dist.new_group([0, 2])
        odds = await dist.new_group([1, 3])
        rows = [await dist.new_group([0, 1]), await dist.new_group([2, 3])]
        mine = evens if rank % 2 == 0 else odds
        assert isinstance(mine, dist.ProcessGroup)
        m1 = DeviceMesh.from_group(mine, "cpu", mesh_dim_names=("dp",))
        assert m1.mesh.tolist() == [rank % 2, rank % 2 + 2] and m1.get_group() is mine
        assert m1.get_local_rank("dp") == rank // 2
        await check_mesh(m1, rank)
        assert DeviceMesh.from_group(mine, "cpu", [rank % 2, rank % 2 + 2]) == DeviceMesh("cpu", [rank % 2, rank % 2 + 2])
        with pytest.raises(ValueError, match="Invalid mesh"):
            DeviceMesh.from_group(mine, "cpu", [0, 1])
        non_member = odds if rank % 2 == 0 else evens
        assert non_member == dist.NON_GROUP_MEMBER
        with pytest.raises(ValueError, match="not a member"):
            DeviceMesh.from_group(non_member, "cpu")  # type: ignore[arg-type]
        # 2-D: dimension 0 runs down the columns, dimension 1 along the rows
        row = rows[rank // 2]
        assert isinstance(row, dist.ProcessGroup)
        m2 = DeviceMesh.from_group([mine, row], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        assert m2.get_all_groups() == [mine, row] and m2.get_coordinate() == [rank // 2, rank % 2]
        await check_mesh(m2, rank)
        assert m2["tp"].get_group() is row
        with pytest.raises(ValueError, match="Must pass mesh "):
            DeviceMesh.from_group([mine, row], "cpu", mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="Must pass mesh_dim_names"):
            DeviceMesh.from_group([mine, row], "cpu", [[0, 1], [2, 3]])
        with pytest.raises(ValueError, match="ndim equal"):
            DeviceMesh.from_group([mine, row], "cpu", [0, 1, 2, 3], mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="does not hold this rank's row"):
            DeviceMesh.from_group([row, mine], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="at least one"):
            DeviceMesh.from_group([], "cpu")
        with pytest.raises(TypeError, match="ProcessGroup"):
            DeviceMesh.from_group("group", "cpu")  # type: ignore[arg-type]
        # the groups of an init_device_mesh mesh rebuild an equal mesh
        mesh = await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        again = DeviceMesh.from_group(mesh.get_all_groups(), "cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
        assert again == mesh and again.get_all_groups() == mesh.get_all_groups()

    await run_world(4, fn, timeout=10)


# -- over real sockets -------------------------------------------------------------------------


async def test_gloo_2x2_mesh() -> None:
    async def fn(rank: int) -> None:
        mesh = await init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert dist.get_backend(mesh.get_group("tp")) == "gloo"
        await check_mesh(mesh, rank)
        await check_mesh(mesh["tp"], rank)
        x = np.arange(1000, dtype=np.float32) * (rank + 1)
        await dist.all_reduce(x, group=mesh.get_group("dp"))
        np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32) * (rank % 2 + 1 + rank % 2 + 3))

    await run_world(4, fn, backend="gloo", timeout=10)


async def test_gloo_1d_mesh_and_from_group() -> None:
    async def fn(rank: int) -> None:
        mesh = await init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
        assert mesh.get_group("dp") is dist.group.WORLD
        await check_mesh(mesh, rank)
        pair = await dist.new_group([0, 2])
        if isinstance(pair, dist.ProcessGroup):
            await check_mesh(DeviceMesh.from_group(pair, "cpu"), rank)

    await run_world(3, fn, backend="gloo", timeout=10)
