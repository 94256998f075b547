"""Initialisation, groups and the pure queries: ``init_process_group``, ``destroy_process_group``,
``new_group``, ``get_rank`` and friends.

Decisions (see docs/c10d.md):
- Group ids are u32s every member agrees on without talking: the default group is 0; a
  ``new_group`` called by every rank (torch's rule) takes the World's next counter value
  (1, 2, ...); with ``use_local_synchronization=True`` only members call it, so its id is a
  hash of (member list, how many groups of that member list this rank made before), with bit 31
  set so it never meets a counter id.
- ``new_group`` does not communicate: the channel factory multiplexes by group id, so there is
  nothing to connect. Non-members get ``GroupMember.NON_GROUP_MEMBER``.
- A sub-group uses the default group's backend; asking for another backend is refused.
- Backends per device (torch's ``"cpu:gloo,cuda:nccl"``): the World has one CPU backend (the
  channel factory) and one ``DeviceBackend`` per device type; every op goes to the backend of
  the device its arrays live on (``aiodist.c10d._device``). ``backend=None`` is
  ``"cpu:gloo,cuda:nccl"`` where NCCL is available (or ``device_id`` is a CUDA device), else
  ``"gloo"``. A config without a CPU backend (``"nccl"``) refuses CPU arrays, as torch does.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiodist import _startup
from aiodist._instrument.levels import DebugLevel, get_debug_level
from aiodist._instrument.loop_watchdog import unwatch_loop, watch_loop  # the loop watchdog
from aiodist._pending import Pending, _site, mark_coroutine_function
from aiodist._threads import closed_loop_error
from aiodist._time import TimeoutLike, to_seconds, to_timedelta
from aiodist.algorithms.thresholds import rules_from
from aiodist.backends.base import CommBackend
from aiodist.backends.device import DeviceBackend
from aiodist.c10d._blocked import publisher
from aiodist.c10d.backend_registry import Backend, create_backend, is_backend_available, is_nccl_available, parse_backend_config
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.world import NON_GROUP_MEMBER, World, current_world, default_group, on_world_loop
from aiodist.constants import default_pg_timeout
from aiodist.errors import DistBackendError, DistTimeoutError
from aiodist.rendezvous import rendezvous, warn_if_launcher_disagrees
from aiodist.store.base import Store, present
from aiodist.store.prefix import PrefixStore

log = logging.getLogger("aiodist.c10d.init")

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "shrink_group",
    "SHRINK_DEFAULT",
    "SHRINK_ABORT",
    "get_backend_config",
    "get_node_local_rank",
    "is_initialized",
    "is_available",
    "is_gloo_available",
    "is_nccl_available",
    "is_mpi_available",
    "is_ucc_available",
    "is_xccl_available",
    "is_backend_available",
    "is_torchelastic_launched",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_pg_count",
    "get_process_group_ranks",
    "get_group_rank",
    "get_global_rank",
    "get_default_backend_for_device",
    "resolve_group",
    "not_member",
]

GroupArg = ProcessGroup | int | None
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return value


def resolve_group(group: GroupArg, *, what: str = "this op") -> ProcessGroup:
    """The group an API call works on: None is the default group; a non-member handle is refused."""
    if group is None:
        return default_group()
    world = current_world()
    if isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER:
        raise ValueError(f"{what}: this rank (global rank {world.rank}) is not a member of the group (new_group returned NON_GROUP_MEMBER)")
    if not isinstance(group, ProcessGroup):
        if isinstance(group, Pending):  # group = dist.new_group(...) without its await
            raise group.not_awaited(f"{what}: group")
        raise TypeError(f"group must be a ProcessGroup or None, not {type(group).__name__}")
    if world.groups.get(group.group_id) is not group:
        if group.broken is not None and "shrink_group" in group.broken:
            raise DistBackendError(f"{what}: {group.describe()} is unusable: {group.broken}")
        raise ValueError(f"{what}: {group.describe()} is not a live group of this World (destroyed, or made by another World)")
    return group


def not_member(group: object, op: str, *, stacklevel: int | None = None) -> bool:
    """True when ``group`` is ``NON_GROUP_MEMBER`` (new_group's answer on a rank outside the
    group), after warning as torch does: the caller then returns without communicating, as
    torch's ops do on such a rank."""
    if not (isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER):
        return False
    world = current_world()
    if stacklevel is None:  # the caller's line: the first frame outside aiodist
        stacklevel = 2
        f: Any = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
            stacklevel, f = stacklevel + 1, f.f_back
    warnings.warn(f"Running {op} on global rank {world.rank} which does not belong to the given group.", UserWarning, stacklevel=stacklevel)
    return True


# -- availability ------------------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_gloo_available() -> bool:
    """True: "gloo" is aiodist's CPU backend (an alias of "aio")."""
    return True


def is_mpi_available() -> bool:
    return False


def is_ucc_available() -> bool:
    return False


def is_xccl_available() -> bool:
    return False


def is_torchelastic_launched() -> bool:
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_default_backend_for_device(device: Any) -> str:
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    kind = kind.split(":")[0]
    try:
        return Backend.default_device_backend_map[kind]
    except KeyError:
        raise ValueError(f"Default backend not registered for device : {device}") from None


# -- init / destroy ----------------------------------------------------------------------------


def _tracked_init(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Pending]:
    """``communicating`` for init_process_group, which also records in the World where it was
    called until it ends, so that the next call of an init that was never awaited names it."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Pending:
        world = current_world()
        site = _site(2)

        async def run() -> None:
            if world.init_site is not None and world.default_pg is None:  # another init of this World is still running
                file, line = world.init_site
                raise ValueError(
                    "trying to initialize the default process group twice! "
                    f"(init_process_group called at {file}:{line} is still running; await it before calling it again)"
                )
            world.init_site = site
            try:
                await fn(*args, **kwargs)
            finally:
                world.init_site = None

        return Pending("init_process_group", run(), site, own_context=True)

    return mark_coroutine_function(call, fn)


@_tracked_init
async def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: TimeoutLike | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialise the default group of the current World (see torch's docs).

    ``store`` with ``rank`` and ``world_size``, or ``init_method`` (default ``env://``) through
    ``aiodist.rendezvous``. ``timeout`` (timedelta or seconds, default 30 min) bounds every op
    of the group. ``group_name`` (deprecated in torch) names the group; ``device_id`` and
    ``pg_options`` are passed to the backend's creator where it takes them; a
    ``aiodist.algorithms.Thresholds`` or a mapping of its field names to byte counts sets the
    group's path rules instead (``aiodist.algorithms.thresholds.rules_from``; the same on every rank).
    """
    world = current_world()
    if world.default_pg is not None:
        if world.loop is not None and world.loop.is_closed():
            raise closed_loop_error("init_process_group(...): the default group exists")
        raise ValueError("trying to initialize the default process group twice!")
    rules = rules_from(pg_options)  # a bad rule is refused before anything is made
    rank = _int(rank, "rank")
    world_size = _int(world_size, "world_size")
    if store is not None and init_method is not None:
        raise ValueError("Cannot specify both init_method and store.")
    if isinstance(store, Pending):  # store = dist.TCPStore(...).get(...)-style calls without their await
        raise store.not_awaited("init_process_group: store")
    td = default_pg_timeout if timeout is None else to_timedelta(timeout)
    name = Backend(backend if backend is not None else _default_backend(device_id))
    config = parse_backend_config(name)
    owned: Store | None = None
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be an aiodist Store, not {type(store).__name__}")
        if world_size <= 0:
            raise ValueError("world_size must be positive if using store")
        if rank < 0:
            raise ValueError("rank must be non-negative if using store")
        warn_if_launcher_disagrees(rank, world_size, "init_process_group")
    else:
        with _startup.phase(caller="init_process_group"):  # names the waits' progress warnings
            owned, rank, world_size = await rendezvous(init_method or "env://", rank, world_size, timeout=td)
        store = PrefixStore("default_pg", owned)
    if not 0 <= rank < world_size:
        if owned is not None:
            await owned.close()
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    made: list[CommBackend | DeviceBackend] = []
    try:
        with _startup.phase(caller="init_process_group", rank=rank):
            comm, devices = await _create_backends(config, store, rank, world_size, td, pg_options, made)
        if device_id is not None:  # torch's eager init: connect to every peer now, not on first use
            try:
                async with asyncio.timeout(td.total_seconds()):
                    await comm.connect()
            except TimeoutError as exc:
                if isinstance(exc, DistTimeoutError):
                    raise
                raise DistTimeoutError(
                    f"init_process_group: rank {rank} could not connect to every peer within {td.total_seconds():g} s (device_id given: eager connections)"
                ) from None
    except BaseException:
        for b in reversed(made):
            await b.close()
        if owned is not None:
            await owned.close()
        raise
    world.rank, world.world_size = rank, world_size
    world.backend, world.backend_name, world.store, world.owned_store = comm, str(name), store, owned
    world.backend_config = config
    world.devices = devices
    world.host_refusal = None if "cpu" in config or not isinstance(comm, _Hostless) else comm.refusal
    world.store_host = _store_host(owned)
    pg = _make_group(world, 0, range(world_size), td.total_seconds(), name=group_name or "0", desc="default_pg", pg_options=rules)
    world.groups[0] = pg
    world.default_pg = pg
    world.loop = asyncio.get_running_loop()  # every op of the World runs here (aiodist._threads)
    # the loop watchdog (docs/debugging.md), which also tells the peers through the
    # store when this rank's loop is blocked (aiodist.c10d._blocked); stopped in destroy
    watch_loop(world, pg.recorder, f"rank {rank}", publisher(world.store, rank))
    if device_id is not None:  # eager device communicators too (torch's device_id contract)
        try:
            async with asyncio.timeout(td.total_seconds()):
                for dev in dict.fromkeys(devices.values()):
                    await dev.connect(pg, device_id)
        except BaseException as exc:
            await destroy_process_group()
            if isinstance(exc, TimeoutError) and not isinstance(exc, DistTimeoutError):
                raise DistTimeoutError(
                    f"init_process_group: rank {rank}'s device communicators were not made within {td.total_seconds():g} s (device_id given: eager init)"
                ) from None
            raise
    if get_debug_level() >= DebugLevel.INFO:
        log.info(
            "rank %d: init_process_group: backend %s, world size %d, timeout %g s, %s, transport: %s",
            rank,
            name,
            world_size,
            td.total_seconds(),
            f"rendezvous {init_method or 'env://'}" if owned is not None else f"store {type(store).__name__}",
            _transport_desc(comm),
        )


def _store_host(owned: Store | None) -> int | None:
    """The rank whose process serves the store a rendezvous made: rank 0 for a TCPStore that is
    not the launcher agent's (``create_c10d_store``); None for any other store."""
    from aiodist.store.tcp import TCPStore

    if isinstance(owned, TCPStore) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 0
    return None


def _default_backend(device_id: Any) -> str:
    """torch's choice for ``backend=None``: CPU and CUDA where the device or NCCL says so."""
    if device_id is not None:
        kind = device_id if isinstance(device_id, str) else getattr(device_id, "type", None)
        if isinstance(device_id, int) and not isinstance(device_id, bool):
            kind = "cuda"
        if isinstance(kind, str) and kind.split(":")[0] == "cuda":
            return "cpu:gloo,cuda:nccl"
        return get_default_backend_for_device(device_id)
    return "cpu:gloo,cuda:nccl" if is_nccl_available() else "gloo"


class _Hostless(CommBackend):
    """The CPU side of a World without a CPU backend (``"nccl"`` alone): refuses CPU arrays."""

    name = "none"

    def __init__(self, rank: int, world_size: int, config: dict[str, str]) -> None:
        super().__init__(rank, world_size)
        spec = ",".join(f"{d}:{n}" for d, n in config.items())
        self.refusal = (
            f"No backend type associated with device type cpu (the group's backends: {spec}); "
            f"pass CPU and device backends, e.g. init_process_group('cpu:gloo,{spec}')"
        )

    def channel(self, group_id: int, seq: int, global_ranks: Sequence[int], digest: int = 0, call: Any = None) -> Any:
        raise DistBackendError(self.refusal)


async def _create_backends(
    config: dict[str, str], store: Store, rank: int, world_size: int, td: Any, pg_options: Any, made: list[Any]
) -> tuple[CommBackend, dict[str, Any]]:
    """The World's CPU backend and its device backends, one per distinct backend name."""
    by_name: dict[str, CommBackend | DeviceBackend] = {}
    comm: CommBackend | None = None
    devices: dict[str, Any] = {}
    host_names = [config["cpu"]] if "cpu" in config else []
    for device, bname in config.items():  # "cuda:gloo": the CPU backend takes them (staged)
        caps = Backend.backend_capability.get(_canonical(bname), Backend.backend_capability.get(bname, []))
        if device != "cpu" and device not in caps:
            host_names.append(bname)
    if len({_canonical(n) for n in host_names}) > 1:
        raise ValueError(f"backend config {config}: one CPU backend per World, got {sorted(set(host_names))}")
    for device, bname in config.items():
        if bname not in by_name:
            made_one = await create_backend(bname, store, rank, world_size, td, pg_options)
            made.append(made_one)
            by_name[bname] = made_one
        b = by_name[bname]
        if isinstance(b, DeviceBackend):
            if device == "cpu":
                raise ValueError(
                    f"backend {bname!r} is a device backend; it cannot serve CPU arrays (use e.g. 'cpu:gloo,{device}:{bname}')"
                )
            devices[device] = b
        elif comm is None or comm is b:
            comm = b
    if comm is None:
        comm = _Hostless(rank, world_size, config)
    return comm, devices


def _make_group(
    world: World, gid: int, members: Sequence[int], seconds: float, *, name: str, desc: str, pg_options: Any = None
) -> ProcessGroup:
    assert world.backend is not None
    pg = ProcessGroup(
        world.backend,
        world.backend_name,
        gid,
        members,
        seconds,
        name=name,
        desc=desc,
        store=world.store,
        devices=world.devices,
        host_refusal=world.host_refusal,
        thresholds=rules_from(pg_options),
    )
    pg.world_groups = functools.partial(_world_groups, world)
    return pg


def _world_groups(world: World) -> tuple[int, int, list[ProcessGroup]]:
    """The World's rank, size and groups (a group's timeout dumps every recorder)."""
    return world.rank, world.world_size, list(world.groups.values())


def _transport_desc(comm: Any) -> str:
    """What the backend listens on, for the INFO log: the socket transport's TCP address and
    whether it has an abstract Unix socket (peers on the same host use it), or the backend's kind."""
    address = getattr(getattr(comm, "transport", None), "address", None)
    if address is None:
        return f"in-process ({type(comm).__name__})"
    unix = "Unix socket for same-host peers, " if getattr(address, "unix", None) else ""
    return f"{unix}TCP {address.host}:{address.port} for the others"


def is_initialized() -> bool:
    """Whether the current World has a default group."""
    return current_world().default_pg is not None


@on_world_loop
async def destroy_process_group(group: GroupArg = None) -> None:
    """Destroy ``group`` (its pending ops fail, it refuses new ones); None or the default group
    destroys every group and deinitialises the World. ``NON_GROUP_MEMBER`` (new_group's answer on
    a rank outside the group) returns at once, as torch."""
    world = current_world()
    if isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER:
        return
    pg = resolve_group(group, what="destroy_process_group")
    if pg is world.default_pg:
        unwatch_loop(world)  # the loop watchdog stops with the World's default group
        for g in list(world.groups.values()):
            await g.shutdown("the group was destroyed")
        backend, owned, devices = world.backend, world.owned_store, list(dict.fromkeys(world.devices.values()))
        world.reset()
        for dev in devices:
            await dev.close()
        if backend is not None:
            await backend.close()
        if owned is not None:  # rank 0's server stops here, as torch's does when its store goes
            await owned.close()
        return
    del world.groups[pg.group_id]
    await pg.shutdown("the group was destroyed")


# -- new_group ---------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    b = Backend(name)
    if ":" in b:  # a per-device config: its parts, aliases resolved, in device order
        return ",".join(f"{d}:{_canonical(n)}" for d, n in sorted(parse_backend_config(b).items()))
    return Backend.aliases.get(b, b)


def _serves(asked: str, have: str) -> bool:
    """Whether the World's backends (``have``) are those ``asked`` names, device by device."""
    want = {d: _canonical(n) for d, n in parse_backend_config(Backend(asked)).items()}
    got = {d: _canonical(n) for d, n in parse_backend_config(Backend(have)).items()}
    return all(got.get(d) == n for d, n in want.items())


def _local_group_id(ranks: tuple[int, ...], occurrence: int) -> int:
    digest = hashlib.blake2b(f"{ranks}/{occurrence}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") | (1 << 31)


@on_world_loop
async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: TimeoutLike | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | int:
    """A group of ``ranks`` (global ranks; all if None). Every rank of the default group calls it,
    in the same order (with ``use_local_synchronization=True`` only the members). Returns the
    group, or ``GroupMember.NON_GROUP_MEMBER`` on ranks not in it."""
    world = current_world()
    parent = default_group()
    if ranks is None:
        members = list(range(world.world_size))
    else:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks must be a list of ints, not {type(ranks).__name__}")
        members = [_int(r, "every rank in ranks") for r in ranks]
    for r in members:
        if not 0 <= r < world.world_size:
            raise ValueError(f"new_group: rank {r} is out of range for world_size {world.world_size}")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks has duplicates: {members}")
    if not members:
        raise ValueError("new_group: ranks is empty")
    if sort_ranks:
        members.sort()
    if backend is not None and not _serves(backend, world.backend_name):
        raise DistBackendError(
            f"new_group: backend {backend!r} differs from the default group's {world.backend_name!r}; one backend per World is supported"
        )
    seconds = parent.timeout_s if timeout is None else to_seconds(timeout)
    key = tuple(members)
    if use_local_synchronization:
        if world.rank not in key:
            return NON_GROUP_MEMBER
        occurrence = world.created.get(key, 0)
        world.created[key] = occurrence + 1
        gid = _local_group_id(key, occurrence)
    else:
        gid = world.next_group_id
        world.next_group_id += 1
    if world.rank not in key:
        await _device_new_group(world, parent, None, gid, members)
        return NON_GROUP_MEMBER
    if gid in world.groups:
        raise DistBackendError(
            f"new_group: group id {gid} is already in use on this rank (a hash collision of use_local_synchronization ids)"
        )
    pg = _make_group(world, gid, members, seconds, name=str(gid), desc=group_desc or f"group {gid}", pg_options=pg_options)
    world.groups[gid] = pg
    if not use_local_synchronization:  # every rank of the parent is here: device backends may split
        await _device_new_group(world, parent, pg, gid, members)
    return pg


def _local_device_count() -> int:
    """How many GPUs this host shows, through aiodist_cuda (aiodist never imports CuPy itself);
    0 without it or without a GPU: torch's "CUDA is not available"."""
    from aiodist.c10d.backend_registry import _nccl_module

    mod = _nccl_module()
    count = getattr(mod, "device_count", None)
    return int(count()) if count is not None else 0


@on_world_loop
async def new_subgroups(
    group_size: int | None = None,
    group: GroupArg = None,
    timeout: TimeoutLike | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int | None, list[ProcessGroup | int]]:
    """Split ``group`` (default: the whole world) into consecutive subgroups of ``group_size``
    ranks each, as torch's: every rank calls it alike; returns ``(this rank's subgroup, every
    subgroup)``, the other subgroups being ``NON_GROUP_MEMBER`` here, as ``new_group`` returns.
    ``group_size=None`` is the number of GPUs on this host (torch's intra-node default), refused
    with torch's words where there are none."""
    if group_size is None:
        group_size = _local_device_count()
        if group_size == 0:
            raise ValueError(
                "Default group size only takes effect when CUDA is available.If your subgroup using a backend "
                "that does not depend on CUDA,please pass in 'group_size' correctly."
            )
    group_size = _int(group_size, "group_size")
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    world_size = get_world_size(group)
    if world_size < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({world_size})")
    if world_size % group_size != 0:
        raise ValueError(f"The world size ({world_size}) must be divisible by 'group_size={group_size}'")
    ranks = get_process_group_ranks(group)
    split = [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)]
    made: tuple[ProcessGroup | int | None, list[ProcessGroup | int]] = await new_subgroups_by_enumeration(
        split, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
    )
    return made


@on_world_loop
async def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: TimeoutLike | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | int | None, list[ProcessGroup | int]]:
    """One ``new_group`` per list of global ranks, in order, as torch's: every rank of the world
    calls it alike; returns ``(this rank's subgroup or None, every subgroup)``. The lists must
    not overlap; unlike torch, that (and every other argument error) is refused before any group
    is made, so a refusal leaves the group counter where it was on every rank."""
    if ranks_per_subgroup_list is None or isinstance(ranks_per_subgroup_list, (str, bytes)) or len(ranks_per_subgroup_list) == 0:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    lists = [_ranks_list(r, f"ranks_per_subgroup_list[{i}]") for i, r in enumerate(ranks_per_subgroup_list)]
    owner: dict[int, list[int]] = {}
    for ranks in lists:
        for r in ranks:
            if r in owner and owner[r] is not ranks:
                raise ValueError(f"Rank {r} has appeared in both subgroup {owner[r]} and {ranks}")
            owner[r] = ranks
    world = current_world()
    for ranks in lists:  # new_group's own checks, all before the first group is made
        if not ranks:
            raise ValueError("new_subgroups_by_enumeration: a subgroup's rank list is empty")
        for r in ranks:
            if not 0 <= r < world.world_size:
                raise ValueError(f"new_subgroups_by_enumeration: rank {r} is out of range for world_size {world.world_size}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_subgroups_by_enumeration: {ranks} has duplicates")
    subgroups: list[ProcessGroup | int] = []
    mine: ProcessGroup | int | None = None
    for ranks in lists:
        sub = await new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(sub)
        if world.rank in ranks:
            mine = sub
            log.info("Rank %s is assigned to subgroup %s", world.rank, ranks)
    return mine, subgroups


async def _device_new_group(world: Any, parent: ProcessGroup, pg: ProcessGroup | None, gid: int, members: Sequence[int]) -> None:
    """Tell the device backends about a sub-group every rank of ``parent`` made (same order on
    every rank), so NCCL can split the parent's communicator (DeviceBackend.new_group)."""
    for dev in dict.fromkeys(world.devices.values()):
        await dev.new_group(parent, pg, gid, members)


def _derived_id(world: Any, *parts: object) -> int:
    """A group id every member computes alike without talking (bit 31 set: never a counter id)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    gid = int.from_bytes(digest, "little") | (1 << 31)
    if gid in world.groups:
        raise DistBackendError(f"group id {gid} is already in use on this rank (a hash collision); create the group again")
    return gid


def _ranks_list(value: object, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{what} must be a list of ints, not {type(value).__name__}")
    return [_int(r, f"every rank in {what}") for r in value]


@on_world_loop
async def split_group(
    parent_pg: GroupArg = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: TimeoutLike | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups; ``split_ranks`` are lists of *group ranks of the
    parent*. Every member of the parent calls it with the same split, in the same order.
    Returns this rank's new group, or None when it is in none of the splits. Does not
    communicate (ids are derived from the parent's id, its split count and the members)."""
    world = current_world()
    parent = resolve_group(parent_pg, what="split_group")
    if split_ranks is None:
        raise ValueError("split_group: split_ranks is required (a list of lists of the parent's group ranks)")
    if isinstance(split_ranks, (str, bytes)) or not isinstance(split_ranks, Sequence) or not split_ranks:
        raise ValueError("split_group: split_ranks must be a non-empty list of lists of ranks")
    splits = [_ranks_list(s, f"split_ranks[{i}]") for i, s in enumerate(split_ranks)]
    seen: set[int] = set()
    for i, sp in enumerate(splits):
        if not sp:
            raise ValueError(f"split_group: split_ranks[{i}] is empty")
        for r in sp:
            if not 0 <= r < parent.size():
                raise ValueError(
                    f"split_group: rank {r} in split_ranks[{i}] is not a group rank of {parent.describe()} (size {parent.size()})"
                )
            if r in seen:
                raise ValueError(f"split_group: group rank {r} is in more than one split (or twice in one)")
            seen.add(r)
    if backend is not None and not _serves(backend, parent.backend_name):
        raise DistBackendError(f"split_group: backend {backend!r} is not the parent's {parent.backend_name!r}")
    count = parent.splits
    parent.splits += 1
    me = parent.rank()
    mine = next((sp for sp in splits if me in sp), None)
    if mine is None:
        await _device_new_group(world, parent, None, -1, [])
        return None
    members = [parent.ranks[r] for r in sorted(mine)]
    gid = _derived_id(world, "split", parent.group_id, count, tuple(members))
    seconds = parent.timeout_s if timeout is None else to_seconds(timeout)
    pg = _make_group(
        world, gid, members, seconds, name=str(gid), desc=group_desc or f"split {count} of {parent.group_desc}", pg_options=pg_options
    )
    world.groups[gid] = pg
    await _device_new_group(world, parent, pg, gid, members)
    return pg


SHRINK_DEFAULT = 0
SHRINK_ABORT = 1


@on_world_loop
async def shrink_group(
    ranks_to_exclude: Sequence[int], group: GroupArg = None, shrink_flags: int = SHRINK_DEFAULT, pg_options: Any = None
) -> ProcessGroup:
    """A new group of ``group``'s ranks minus ``ranks_to_exclude`` (group ranks of ``group``).
    Only the remaining ranks call it (the excluded ones may be dead), with the same list: they
    compare their lists through the store first, and a rank whose list differs fails on every
    rank that sees it (``DistBackendError`` naming each rank's list). ``SHRINK_ABORT`` first
    fails what is in flight on the old group on this rank; ``SHRINK_DEFAULT`` waits for it to end.

    Shrinking the default group (``group=None``) renumbers the survivors 0..n-1 in their old
    order and makes the result the new default group: the survivors meet again through the
    store (a fresh backend under their own prefix, ``_shrink_default``), and every other group
    is destroyed (using one names the shrink). Refused where the store's own server was in an
    excluded rank's process (env:// without a launcher: rank 0 hosts it)."""
    world = current_world()
    pg = resolve_group(group, what="shrink_group")
    excl = _ranks_list(ranks_to_exclude, "ranks_to_exclude")
    if not excl:
        raise ValueError("shrink_group: ranks_to_exclude is empty")
    if len(set(excl)) != len(excl):
        raise ValueError(f"shrink_group: ranks_to_exclude has duplicates: {excl}")
    for r in excl:
        if not 0 <= r < pg.size():
            raise ValueError(f"shrink_group: rank {r} is out of bounds for {pg.describe()} of size {pg.size()}")
    if len(excl) >= pg.size():
        raise ValueError("shrink_group: ranks_to_exclude excludes every rank of the group")
    if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"shrink_group: shrink_flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT (1), not {shrink_flags!r}")
    if pg.rank() in excl:
        raise RuntimeError(f"shrink_group: this rank (group rank {pg.rank()}) is excluded; excluded ranks must not call shrink_group")
    out = sorted(excl)
    default = pg is world.default_pg
    if default and world.store_host is not None and world.store_host in out:
        raise DistBackendError(
            f"shrink_group: cannot shrink the default group without rank {world.store_host}: its process served the job's "
            "store (env:// or tcp:// rendezvous without a launcher), so the survivors have no store to meet through; "
            "run the job under aiodist-run (its agent serves the store) or give init_process_group a store served elsewhere"
        )
    if shrink_flags == SHRINK_ABORT:
        for g in list(world.groups.values()) if default else [pg]:
            g.abort(f"shrink_group excluded group ranks {out} of {pg.describe()} (SHRINK_ABORT)")
    else:
        pending = list(pg.pending())
        if pending:
            await asyncio.wait(pending)
    count = world.shrinks if default else pg.shrinks
    members = [g for i, g in enumerate(pg.ranks) if i not in set(out)]
    await _agree_on_exclusion(world, pg, count, out, members)
    if default:
        world.shrinks += 1
        return await _shrink_default(world, pg, out, members, pg_options)
    pg.shrinks += 1
    gid = _derived_id(world, "shrink", pg.group_id, count, tuple(members))
    new = _make_group(
        world, gid, members, pg.timeout_s, name=str(gid), desc=f"{pg.group_desc} shrunk", pg_options=pg_options or pg.thresholds
    )
    world.groups[gid] = new
    return new


_AGREE_POLL_S = 0.02


async def _agree_on_exclusion(world: World, pg: ProcessGroup, count: int, out: list[int], members: list[int]) -> None:
    """Every survivor writes its exclusion list to the store and reads the others' (within the
    group's timeout): the same list everywhere, or a ``DistBackendError`` naming who said what
    on every survivor that sees the difference (each sees the lists of the ranks it keeps)."""
    store = world.store
    if store is None or len(members) == 1:
        return
    prefix = f"aiodist/shrink/{pg.group_id}/{count}/"
    me = pg.backend.rank
    mine = ",".join(map(str, out))
    await store.set(prefix + str(me), mine)
    others = [r for r in members if r != me]
    keys = [prefix + str(r) for r in others]
    loop = asyncio.get_running_loop()
    end = loop.time() + pg.timeout_s
    seen: dict[int, str] = {}  # rank -> its list, once read
    rank_of = dict(zip(keys, others))
    while True:
        fresh = await present(store, [k for r, k in zip(others, keys) if r not in seen])
        if fresh:
            values = await store.multi_get(fresh)
            seen.update((rank_of[k], v.decode()) for k, v in zip(fresh, values))
            differ = {r: v for r, v in seen.items() if v != mine}
            if differ:
                said = "; ".join(f"rank {r} excludes [{v}]" for r, v in sorted(differ.items()))
                raise DistBackendError(
                    f"shrink_group on {pg.describe()}: the survivors disagree on whom to exclude: this rank (rank {me}) "
                    f"excludes group ranks [{mine}]; {said}. Every survivor must pass the same ranks_to_exclude"
                )
        if len(seen) == len(others):
            return
        if loop.time() >= end:
            missing = sorted(set(others) - set(seen))
            raise DistTimeoutError(
                f"shrink_group on {pg.describe()}: ranks {missing} did not call shrink_group within {pg.timeout_s:g} s "
                f"(this rank, rank {me}, excludes group ranks [{mine}]); a rank that is gone must be in ranks_to_exclude"
            )
        await asyncio.sleep(_AGREE_POLL_S)


async def _shrink_default(world: World, old: ProcessGroup, out: list[int], members: list[int], pg_options: Any) -> ProcessGroup:
    """The survivors of the default group become a World of their own: ranks 0..n-1 in their
    old order, a fresh backend (the old one's connections and shared memory included its dead),
    rendezvoused through the same store under this shrink's prefix; then the old World's groups
    are torn down (their later use names the shrink) and the new default group takes over."""
    rank = members.index(old.backend.rank)
    size = len(members)
    assert world.store is not None
    store = PrefixStore(f"aiodist/shrunk{world.shrinks}", world.store)
    td = to_timedelta(old.timeout_s)
    made: list[CommBackend | DeviceBackend] = []
    try:
        comm, devices = await _create_backends(world.backend_config, store, rank, size, td, pg_options, made)
    except BaseException:
        for b in reversed(made):
            await b.close()
        raise
    reason = (
        f"it was destroyed by shrink_group of the default group, which excluded ranks {out} "
        f"(this rank, rank {old.backend.rank}, is now rank {rank} of {size}); use the group shrink_group returned "
        "(the new default group) or groups made from it"
    )
    unwatch_loop(world)
    for g in list(world.groups.values()):
        await g.shutdown(reason)
        g.broken = reason  # its later use says so (check_usable, resolve_group)
    backend, devs = world.backend, list(dict.fromkeys(world.devices.values()))
    for dev in devs:
        try:
            await dev.close()
        except Exception as exc:  # the old World's parts include the dead: best effort
            log.warning("rank %d: closing %s after shrink_group: %s", rank, getattr(dev, "name", dev), exc)
    if backend is not None:
        try:
            await backend.close()
        except Exception as exc:
            log.warning("rank %d: closing the old backend after shrink_group: %s", rank, exc)
    world.groups.clear()
    world.created.clear()
    world.next_group_id = 1
    world.rank, world.world_size = rank, size
    world.backend, world.store, world.devices = comm, store, devices
    if world.store_host is not None:
        world.store_host = members.index(world.store_host)
    pg = _make_group(world, 0, range(size), old.timeout_s, name=old.group_name, desc="default_pg", pg_options=pg_options or old.thresholds)
    world.groups[0] = pg
    world.default_pg = pg
    watch_loop(world, pg.recorder, f"rank {rank}", publisher(world.store, rank))
    if get_debug_level() >= DebugLevel.INFO:
        log.info("rank %d (was %d): shrink_group made the default group of %d ranks, without ranks %s", rank, members[rank], size, out)
    return pg


def idle_until_leader(leader: int = 0, group: GroupArg = None) -> None:
    """aiodist's own (torch has none): make ``group``'s collectives (default: the default group)
    wait without a deadline on every rank but ``leader`` (a global rank, as torch's ``src``) until
    the leader issues them; the group's timeout then starts. For a service whose ranks wait in
    a collective for the leader's next request: idle for as long as no request comes, while a
    leader that is gone (its connections: at once; a cut link: ``AIODIST_LINK_TIMEOUT_S``), a
    rank that calls another op (the desync check), and a rank that does not follow an op the
    leader issued (the timeout, from the leader's go) still fail as in any group. The leader's
    own ops keep their deadline from their issue. Call it on every rank of the group with the
    same leader, before the ops it should apply to (the leader sends each op's go, the others
    wait for it: ranks that disagree fail at the leader's timeout). Point-to-point ops and device
    (NCCL) ops are not affected. Plain function: it does not communicate."""
    pg = resolve_group(group, what="idle_until_leader")
    leader = _int(leader, "leader")
    if leader not in pg.ranks:
        raise ValueError(f"idle_until_leader: leader {leader} is not a rank of {pg.describe()}")
    pg.idle_until(pg.ranks.index(leader))


# -- queries -----------------------------------------------------------------------------------


def get_backend_config(group: GroupArg = None) -> str:
    """The group's backend per device, as torch writes it: ``"cpu:gloo"``."""
    pg = resolve_group(group, what="get_backend_config")
    return ",".join(f"{d}:{n}" for d, n in parse_backend_config(Backend(pg.backend_name)).items())


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``LOCAL_RANK`` from the environment (set by launchers), else a scheduler's local rank
    (``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ...), else ``fallback_rank``."""
    value = os.environ.get("LOCAL_RANK")
    if value is not None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"LOCAL_RANK must be an int, got {value!r}") from None
    from aiodist._schedulers import node_local_rank  # Slurm's / MPI's local rank variables

    detected = node_local_rank()
    if detected is not None:
        return detected
    if fallback_rank is not None:
        return _int(fallback_rank, "fallback_rank")
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow get_node_local_rank to work, assuming you are not running in a multi-device context and want the code to run locally instead."
    )


def get_rank(group: GroupArg = None) -> int:
    """This rank in ``group`` (default: the default group); -1 for a non-member handle."""
    if isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, what="get_rank").rank()


def get_world_size(group: GroupArg = None) -> int:
    """The size of ``group``; -1 for a non-member handle."""
    if isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, what="get_world_size").size()


def get_backend(group: GroupArg = None) -> Backend:
    if isinstance(group, int) and not isinstance(group, bool) and group == NON_GROUP_MEMBER:
        # torch's words, then aiodist's detail
        raise ValueError(f"Invalid process group specified: this rank (global rank {current_world().rank}) is not a member of the group")
    return Backend(resolve_group(group, what="get_backend").backend_name)


def get_pg_count() -> int:
    return len(current_world().groups)


def get_process_group_ranks(group: GroupArg) -> list[int]:
    return list(resolve_group(group, what="get_process_group_ranks").ranks)


class NotInGroupError(ValueError, RuntimeError):
    """``get_group_rank``/``get_global_rank`` of a rank outside the group: torch 2.13's code raises
    ValueError (its docs say RuntimeError, aiodist's type before), so this is both."""


def get_group_rank(group: GroupArg, global_rank: int) -> int:
    pg = resolve_group(group, what="get_group_rank")
    _int(global_rank, "global_rank")
    if global_rank not in pg.ranks:
        raise NotInGroupError(f"Global rank {global_rank} is not part of group {pg.describe()}")
    return pg.ranks.index(global_rank)


def get_global_rank(group: GroupArg, group_rank: int) -> int:
    pg = resolve_group(group, what="get_global_rank")
    _int(group_rank, "group_rank")
    if not 0 <= group_rank < pg.size():
        raise NotInGroupError(f"Group rank {group_rank} is not part of group {pg.describe()}")
    return pg.ranks[group_rank]
