"""The torch-like layer: World (a ContextVar), ProcessGroup, Work, init/groups, collectives, p2p.

Thin by design: argument checks, rank translation, sequence numbers, Work, timeouts; the
schedules live in ``aiodist.algorithms`` and the bytes move through a backend's channels
(``aiodist.backends``). Decisions are written down in docs/c10d.md.
"""

from aiodist.c10d.backend_registry import Backend, is_backend_available, is_nccl_available
from aiodist.c10d.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from aiodist.c10d.init import (
    destroy_process_group,
    get_backend,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    new_group,
)
from aiodist.c10d.point_to_point import irecv, isend, recv, send
from aiodist.c10d.process_group import ProcessGroup
from aiodist.c10d.work import Work
from aiodist.c10d.world import NON_GROUP_MEMBER, GroupMember, World, current_world, group, use_world

__all__ = [
    "Backend",
    "GroupMember",
    "NON_GROUP_MEMBER",
    "ProcessGroup",
    "Work",
    "World",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "current_world",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "use_world",
]
