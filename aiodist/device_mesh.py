"""``DeviceMesh`` and ``init_device_mesh``: torch.distributed.device_mesh over aiodist's groups.

A mesh is an n-d numpy array of global ranks; for every mesh dimension each rank holds the
group of the ranks that share all its other coordinates. Creating those groups is ``new_group``,
a coroutine, so a mesh is made with ``mesh = await DeviceMesh("cpu", [[0, 1], [2, 3]])`` or
``mesh = await init_device_mesh("cpu", (2, 2))``; everything else is synchronous.

Decisions (see docs/device_mesh.md):
- Every rank calls ``new_group`` for every sub-group of every dimension, in torch's order
  (dimension by dimension; within a dimension, the rows of ``swapaxes(mesh, -1, dim)``), so the
  World's group counter stays in step on all ranks. A rank keeps the one group it belongs to.
- Sub-groups keep the mesh's order (``sort_ranks=False``): a rank's local rank along a
  dimension is always its coordinate there. A 1-D mesh equal to ``range(world_size)`` reuses
  the default group, as torch does.
- Slicing (``mesh["dp"]``, ``mesh["dp", "tp"]``) reuses the parent's groups: no new group, no
  communication.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from aiodist.c10d.backend_registry import Backend, is_backend_available, parse_backend_config
from aiodist.c10d.init import (
    _serves,
    destroy_process_group,
    init_process_group,
    is_initialized,
    new_group,
    resolve_group,
)
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.world import NON_GROUP_MEMBER, current_world
from aiodist.errors import DistBackendError

__all__ = ["DeviceMesh", "init_device_mesh"]

#: (backend name or None, backend options or None) for one mesh dimension, as torch's BackendConfig
BackendConfig = tuple[str | None, Any]
_NO_OVERRIDE: BackendConfig = (None, None)


def _check_device_type(device_type: object) -> str:
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str, not {type(device_type).__name__}")
    if not device_type or not device_type.isalpha():
        raise ValueError(
            f"Device type with index is not supported but got {device_type!r}; pass the device type only (e.g. 'cuda', not 'cuda:0')"
            if device_type
            else "device_type must be a non-empty str such as 'cpu' or 'cuda'"
        )
    return device_type


def _to_array(mesh: object) -> np.ndarray:
    """The mesh as a fresh, read-only int64 array (from an array, a torch tensor or nested lists)."""
    device = getattr(mesh, "device", None)
    if device is not None and hasattr(mesh, "detach"):  # a torch tensor
        if getattr(device, "type", "cpu") != "cpu":
            raise ValueError(f"mesh must be a CPU tensor, got one on {device}")
        mesh = mesh.detach().cpu().numpy()
    try:
        arr = np.array(mesh)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"mesh must be a rectangular n-d array of ranks: {e}") from None
    if arr.ndim == 0:
        raise ValueError(f"mesh must have at least one dimension, got the scalar {mesh!r}")
    if arr.size == 0:
        raise ValueError(f"mesh must not be empty, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"mesh must hold integer ranks, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    flat = arr.reshape(-1)
    if (flat < 0).any():
        raise ValueError(f"mesh ranks must be non-negative, got {arr.tolist()}")
    if len(np.unique(flat)) != flat.size:
        values, counts = np.unique(flat, return_counts=True)
        raise ValueError(f"mesh must contain each rank at most once; repeated: {values[counts > 1].tolist()}")
    arr.flags.writeable = False
    return arr


def _check_dim_names(names: Iterable[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"mesh_dim_names must be a tuple of str, not the str {names!r}")
    result = tuple(names)
    for n in result:
        if not isinstance(n, str):
            raise TypeError(f"every mesh_dim_name must be a str, got {n!r}")
    if len(set(result)) != len(result):
        raise ValueError(f"Each mesh_dim_name must be unique; found a repeated name in mesh_dim_names {result}")
    if len(result) != ndim:
        raise ValueError(
            f"mesh_dim_names {result} has {len(result)} names for a mesh of {ndim} dimensions; they should have the same length"
        )
    return result


def _normalize_backend_override(
    backend_override: Mapping[int | str, Any], ndim: int, mesh_dim_names: tuple[str, ...] | None
) -> tuple[BackendConfig, ...]:
    """torch's rule: keys are dimension indices or names (not both for one dimension); a value is
    a backend name, options, or a (name, options) pair."""
    left = dict(backend_override)
    out: list[BackendConfig] = []
    names: tuple[str | None, ...] = mesh_dim_names or (None,) * ndim
    for dim, name in zip(range(ndim), names):
        if name is not None and name in left:
            if dim in left:
                raise ValueError(f"Found redundant dim index {dim} and name {name!r} in backend_override")
            val = left.pop(name)
        elif dim in left:
            val = left.pop(dim)
        else:
            out.append(_NO_OVERRIDE)
            continue
        if isinstance(val, str):
            out.append((val, None))
        elif isinstance(val, tuple) and len(val) == 2 and (val[0] is None or isinstance(val[0], str)):
            out.append((val[0], val[1]))
        else:
            out.append((None, val))
    if left:
        raise ValueError(
            f"Found invalid keys in backend_override: got {list(left)}, expected integers in range [0, {ndim}) or one of {mesh_dim_names}"
        )
    return tuple(out)


def _world_backend_for(device_type: str) -> str | None:
    """The backend to initialise the default group with for ``device_type`` (None: aiodist's default)."""
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if not is_backend_available(Backend.NCCL):
            raise DistBackendError(
                "init_device_mesh('cuda', ...): backend 'nccl' is not available (import aiodist_cuda, which registers it, "
                "on a machine with a GPU); use device_type='cpu' for the CPU backends"
            )
        return "cpu:gloo,cuda:nccl"
    try:
        return Backend.default_device_backend_map[device_type]
    except KeyError:
        raise ValueError(f"no backend is registered for device type {device_type!r}") from None


def _check_backend_serves(backend_name: str, device_type: str) -> None:
    devices = list(parse_backend_config(Backend(backend_name)))
    if device_type not in devices:
        raise DistBackendError(
            f"the default group's backend {backend_name!r} does not serve device type {device_type!r} (it serves {devices}); "
            "aiodist runs one backend per World, so make the mesh with a device type that backend serves"
        )


class DeviceMesh:
    """An n-d layout of global ranks with one process group per mesh dimension (torch's
    ``DeviceMesh``). ``mesh = await DeviceMesh(device_type, mesh, mesh_dim_names=...)`` creates
    the groups (every rank of the World must do it, with the same mesh, in the same order
    relative to its other ``new_group`` calls); ``init_device_mesh`` is the usual way in.

    ``mesh`` is a numpy array, a CPU torch tensor or nested lists of distinct global ranks; it
    may be smaller than the World (ranks outside it have no coordinate and no groups).
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Iterable[str] | None = None,
        backend_override: Sequence[BackendConfig] | None = None,
    ) -> None:
        self._device_type = _check_device_type(device_type)
        self._mesh = _to_array(mesh)
        self._mesh_dim_names = _check_dim_names(mesh_dim_names, self._mesh.ndim)
        if backend_override is None:
            self._backend_override: tuple[BackendConfig, ...] = (_NO_OVERRIDE,) * self._mesh.ndim
        else:
            self._backend_override = tuple((b, o) for b, o in backend_override)
            if len(self._backend_override) != self._mesh.ndim:
                raise ValueError(f"backend_override has {len(self._backend_override)} entries for a mesh of {self._mesh.ndim} dimensions")
        self._flat = tuple(int(r) for r in self._mesh.reshape(-1))
        self._rank = -1
        self._coordinate: list[int] | None = None
        # this rank's group along each dimension; None until the mesh is awaited (or a
        # non-member's, which stays empty once ready)
        self._groups: list[ProcessGroup] | None = None
        self._creating: asyncio.Future[None] | None = None

    # -- creation --------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, DeviceMesh]:
        return self._create().__await__()

    async def _create(self) -> DeviceMesh:
        if self._groups is not None:
            return self
        if self._creating is not None:  # another task of this rank is creating the groups
            await asyncio.shield(self._creating)
            return self
        self._creating = asyncio.get_running_loop().create_future()
        try:
            await self._create_groups()
        except BaseException as e:
            if isinstance(e, Exception):
                self._creating.set_exception(e)
                self._creating.exception()  # retrieved here: the awaiting task raises it itself
            else:
                self._creating.cancel()
            self._creating = None
            raise
        self._creating.set_result(None)
        return self

    async def _create_groups(self) -> None:
        if not is_initialized():
            # torch: "If no process group is found, init_device_mesh will initialize distributed
            # process group/groups required for distributed communications behind the scene."
            await init_process_group(backend=_world_backend_for(self._device_type))
        world = current_world()
        _check_backend_serves(world.backend_name, self._device_type)
        if self._mesh.size > world.world_size:
            raise ValueError(f"Mesh should not be bigger than default world size {world.world_size}, but found {self._mesh.size} ranks")
        if max(self._flat) >= world.world_size:
            raise ValueError(f"mesh rank {max(self._flat)} is out of range for world size {world.world_size}")
        for dim, (backend, _options) in enumerate(self._backend_override):
            # new_group would refuse it too, but only after the earlier dimensions' groups were made
            if backend is not None and not _serves(backend, world.backend_name):
                raise DistBackendError(
                    f"backend_override for mesh dimension {dim}: backend {backend!r} differs from the default group's "
                    f"{world.backend_name!r}; one backend per World is supported"
                )
        rank = world.rank
        groups: list[ProcessGroup] = []
        made: list[ProcessGroup] = []
        if self._mesh.ndim == 1 and self._flat == tuple(range(world.world_size)) and self._backend_override[0] == _NO_OVERRIDE:
            assert world.default_pg is not None
            groups.append(world.default_pg)
        else:
            try:
                for dim in range(self._mesh.ndim):
                    backend, options = self._backend_override[dim]
                    desc = f"mesh_{self._mesh_dim_names[dim]}" if self._mesh_dim_names else f"mesh_dim_{dim}"
                    for row in np.swapaxes(self._mesh, -1, dim).reshape(-1, self._mesh.shape[dim]):
                        ranks = [int(r) for r in row]
                        g = await new_group(ranks=ranks, backend=backend, pg_options=options, group_desc=desc, sort_ranks=False)
                        if isinstance(g, ProcessGroup):
                            made.append(g)
                            groups.append(g)
                        elif rank in ranks:  # pragma: no cover - new_group returns a group to its members
                            raise AssertionError(f"new_group({ranks}) returned {g!r} on member rank {rank}")
            except BaseException:
                for g in made:
                    await destroy_process_group(g)
                raise
        self._set_rank(rank)
        self._groups = groups if self._coordinate is not None else []

    def _set_rank(self, rank: int) -> None:
        self._rank = rank
        where = np.argwhere(self._mesh == rank)
        self._coordinate = [int(i) for i in where[0]] if len(where) else None

    @staticmethod
    def from_group(
        group: ProcessGroup | Sequence[ProcessGroup],
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: Iterable[str] | None = None,
    ) -> DeviceMesh:
        """A mesh over existing groups, without creating any (torch's ``DeviceMesh.from_group``).

        One group: a 1-D mesh of its ranks (``mesh``, if given, must list them in group order).
        A list of groups: ``mesh`` and ``mesh_dim_names`` are required, the mesh has one
        dimension per group, and group i must hold the ranks of this rank's row along
        dimension i.
        """
        world = current_world()
        if isinstance(group, ProcessGroup) or group == NON_GROUP_MEMBER:
            pg = resolve_group(group, what="DeviceMesh.from_group")  # type: ignore[arg-type]
            ranks = list(pg.ranks)
            if mesh is not None and _to_array(mesh).tolist() != ranks:
                raise ValueError(f"Invalid mesh {_to_array(mesh).tolist()} for ProcessGroup with ranks {ranks}")
            dm = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names)
            dm._set_rank(world.rank)
            dm._groups = [pg]
            return dm
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise TypeError(f"group must be a ProcessGroup or a list of ProcessGroups, not {type(group).__name__}")
        pgs = [resolve_group(g, what="DeviceMesh.from_group") for g in group]
        if not pgs:
            raise ValueError("Expects at least one ProcessGroup to be passed")
        if mesh is None:
            raise ValueError("Must pass mesh if passing multiple ProcessGroups")
        if mesh_dim_names is None:
            raise ValueError("Must pass mesh_dim_names if passing multiple ProcessGroups")
        dm = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)
        if dm.ndim != len(pgs):
            raise ValueError(
                f"Expects mesh with ndim equal to number of ProcessGroups but got mesh {dm._mesh.tolist()} and {len(pgs)} ProcessGroups"
            )
        dm._set_rank(world.rank)
        coord = dm._coordinate
        if coord is None:
            raise ValueError(f"this rank (global rank {world.rank}) holds the groups but is not in the mesh {dm._mesh.tolist()}")
        for dim, pg in enumerate(pgs):
            index: list[Any] = list(coord)
            index[dim] = slice(None)
            row = sorted(int(r) for r in dm._mesh[tuple(index)])
            if sorted(pg.ranks) != row:
                raise ValueError(
                    f"group {dim} ({pg.describe()}) does not hold this rank's row of mesh dimension {dim}: expected ranks {row}"
                )
        dm._groups = pgs
        return dm

    # -- queries ---------------------------------------------------------------------------

    def _ready(self, what: str) -> list[ProcessGroup]:
        if self._groups is None:
            raise RuntimeError(
                f"DeviceMesh.{what}: the mesh's process groups are not created yet; await it first (mesh = await DeviceMesh(...))"
            )
        return self._groups

    def _dim(self, mesh_dim: int | str | None, what: str) -> int:
        if mesh_dim is None:
            if self.ndim > 1:
                raise RuntimeError(
                    f"Found the DeviceMesh have {self.ndim} dimensions; optional kwarg `mesh_dim` needs to be specified when "
                    "device_mesh.ndim > 1 (use get_all_groups() for the groups of every dimension)"
                )
            return 0
        if isinstance(mesh_dim, str):
            if not self._mesh_dim_names:
                raise KeyError(f"{what}: no `mesh_dim_names` found, so mesh dimension {mesh_dim!r} cannot be looked up by name")
            if mesh_dim not in self._mesh_dim_names:
                raise KeyError(
                    f"Mesh dimension {mesh_dim!r} does not exist. Available mesh dimensions are: mesh_dim_names={self._mesh_dim_names}"
                )
            return self._mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise TypeError(f"mesh_dim must be an int, a str or None, not {type(mesh_dim).__name__}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"{what}: mesh_dim {mesh_dim} is out of range for a mesh of {self.ndim} dimensions")
        return mesh_dim % self.ndim

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """This rank's group along ``mesh_dim`` (an index or a name; None only for a 1-D mesh)."""
        groups = self._ready("get_group")
        dim = self._dim(mesh_dim, "get_group")
        if not groups:
            raise ValueError(f"global rank {self._rank} is not in this mesh ({self!r}), so it holds none of its groups")
        return groups[dim]

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group along every mesh dimension, in dimension order."""
        return [self.get_group(d) for d in range(self.ndim)]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in its group along ``mesh_dim`` (= its coordinate there)."""
        return self.get_group(self._dim(mesh_dim, "get_local_rank")).rank()

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every dimension of the mesh; None if it is not in the mesh."""
        self._ready("get_coordinate")
        return None if self._coordinate is None else list(self._coordinate)

    def get_rank(self) -> int:
        """This process's global rank."""
        self._ready("get_rank")
        return self._rank

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along ``mesh_dim``."""
        return int(self._mesh.size) if mesh_dim is None else int(self._mesh.shape[self._dim(mesh_dim, "size")])

    @property
    def mesh(self) -> np.ndarray:
        """The global ranks, as a read-only int64 array of the mesh's shape."""
        return self._mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_dim_names

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def ndim(self) -> int:
        return int(self._mesh.ndim)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._mesh.shape)

    # -- slicing ---------------------------------------------------------------------------

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """The submesh of the named dimensions that holds this rank, in the order named, with
        the parent's groups (nothing is created, nothing is sent).

        On a (dp=2, tp=4) mesh over ranks 0..7, ``mesh["tp"]`` is ``[0, 1, 2, 3]`` on ranks
        0-3 and ``[4, 5, 6, 7]`` on ranks 4-7; ``mesh["dp"]`` is ``[r % 4, r % 4 + 4]``.
        """
        if not self._mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names!")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if not names:
            raise KeyError("slicing a DeviceMesh needs at least one mesh_dim_name")
        for n in names:
            if not isinstance(n, str) or n not in self._mesh_dim_names:
                raise KeyError(f"Invalid mesh_dim_names {names} specified. Valid mesh_dim_names are {self._mesh_dim_names}.")
        if len(set(names)) != len(names):
            raise KeyError(f"Invalid mesh_dim_names {names} specified: a dimension is named twice")
        if names == self._mesh_dim_names:
            return self
        groups = self._ready("__getitem__")
        if self._coordinate is None:
            raise ValueError(f"global rank {self._rank} is not in this mesh ({self!r}), so it has no submesh")
        dims = [self._mesh_dim_names.index(n) for n in names]
        index: list[Any] = [slice(None) if d in dims else c for d, c in enumerate(self._coordinate)]
        # the kept dimensions, in the order they were named
        sub = np.transpose(self._mesh[tuple(index)], np.argsort(np.argsort(dims)))
        child = DeviceMesh(self._device_type, sub, mesh_dim_names=names)
        child._set_rank(self._rank)
        child._groups = [groups[d] for d in dims]
        return child

    # -- identity --------------------------------------------------------------------------

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._mesh_dim_names}" if self._mesh_dim_names else ""
        return f"DeviceMesh({self._device_type!r}, {self._mesh.tolist()}{names})"

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return False
        return (
            self._flat == other._flat
            and self._mesh.shape == other._mesh.shape
            and self._device_type == other._device_type
            and self._mesh_dim_names == other._mesh_dim_names
        )

    def __hash__(self) -> int:
        return hash((self._flat, self._mesh.shape, self._device_type, self._mesh_dim_names))


async def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Iterable[str] | None = None,
    backend_override: Mapping[int | str, Any] | None = None,
) -> DeviceMesh:
    """A mesh of ``mesh_shape`` over ranks 0..world_size-1 in row-major order, with its groups
    (torch's ``init_device_mesh``). Every rank calls it with the same arguments. The product of
    ``mesh_shape`` must be the world size. If the default group is not initialised,
    ``init_process_group()`` is called first (from the environment, ``env://``), as torch does:
    with aiodist's default CPU backend for "cpu", with "nccl" for "cuda" (only if registered).

    ``backend_override`` maps dimension indices or names to a backend name, options, or a
    (name, options) pair; aiodist runs one backend per World, so a name other than the World's
    is refused.
    """
    _check_device_type(device_type)
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
        raise TypeError(f"mesh_shape must be a tuple of ints, not {type(mesh_shape).__name__}")
    shape = tuple(mesh_shape)
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"mesh_shape must be a tuple of positive ints, got {shape}")
    if not shape:
        raise ValueError("mesh_shape must have at least one dimension")
    names = _check_dim_names(mesh_dim_names, len(shape))
    override = None if backend_override is None else _normalize_backend_override(backend_override, len(shape), names)
    if not is_initialized():
        await init_process_group(backend=_world_backend_for(device_type))
    world_size = current_world().world_size
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh_shape {shape} has {math.prod(shape)} ranks but the world size is {world_size}; they must be equal")
    mesh = np.arange(world_size, dtype=np.int64).reshape(shape)
    return await DeviceMesh(device_type, mesh, mesh_dim_names=names, backend_override=override)
