"""Every dotted name torch 2.13's torch.distributed reference documents has its aiodist
counterpart at the same path (``torch.distributed`` -> ``aiodist``), so a port that swaps the
prefix in its imports keeps them: ``from aiodist.algorithms.model_averaging.utils import
average_parameters``, ``from aiodist.elastic.utils.api import get_env_variable_or_raise``, ...
The names are the reference's section titles (torch's docs, "torch.distributed" page)."""

from __future__ import annotations

import importlib

import pytest

REFERENCE = [
    "torch.distributed.algorithms.model_averaging.utils.average_parameters",
    "torch.distributed.algorithms.model_averaging.utils.average_parameters_or_parameter_groups",
    "torch.distributed.algorithms.model_averaging.utils.get_params_to_average",
    "torch.distributed.all_gather",
    "torch.distributed.all_gather_coalesced",
    "torch.distributed.all_gather_object",
    "torch.distributed.all_gather_single",
    "torch.distributed.all_reduce",
    "torch.distributed.all_reduce_coalesced",
    "torch.distributed.all_to_all",
    "torch.distributed.all_to_all_single",
    "torch.distributed.barrier",
    "torch.distributed.batch_isend_irecv",
    "torch.distributed.breakpoint",
    "torch.distributed.broadcast",
    "torch.distributed.broadcast_object_list",
    "torch.distributed.collective_utils.all_gather_object_enforce_type",
    "torch.distributed.debug",
    "torch.distributed.debug.start_debug_server",
    "torch.distributed.debug.stop_debug_server",
    "torch.distributed.device_mesh.init_device_mesh",
    "torch.distributed.distributed_c10d.batch_isend_irecv",
    "torch.distributed.distributed_c10d.destroy_process_group",
    "torch.distributed.distributed_c10d.irecv",
    "torch.distributed.distributed_c10d.is_backend_available",
    "torch.distributed.distributed_c10d.is_gloo_available",
    "torch.distributed.distributed_c10d.is_initialized",
    "torch.distributed.distributed_c10d.is_mpi_available",
    "torch.distributed.distributed_c10d.is_nccl_available",
    "torch.distributed.distributed_c10d.is_torchelastic_launched",
    "torch.distributed.distributed_c10d.is_ucc_available",
    "torch.distributed.distributed_c10d.is_xccl_available",
    "torch.distributed.distributed_c10d.record_comm",
    "torch.distributed.distributed_c10d.shrink_group",
    "torch.distributed.elastic.utils.api.get_env_variable_or_raise",
    "torch.distributed.elastic.utils.distributed.get_free_port",
    "torch.distributed.elastic.utils.log_level.get_log_level",
    "torch.distributed.elastic.utils.logging.get_logger",
    "torch.distributed.gather",
    "torch.distributed.gather_object",
    "torch.distributed.get_backend",
    "torch.distributed.get_backend_config",
    "torch.distributed.get_debug_level",
    "torch.distributed.get_default_backend_for_device",
    "torch.distributed.get_global_rank",
    "torch.distributed.get_group_rank",
    "torch.distributed.get_node_local_rank",
    "torch.distributed.get_pg_count",
    "torch.distributed.get_process_group_ranks",
    "torch.distributed.get_rank",
    "torch.distributed.get_world_size",
    "torch.distributed.init_process_group",
    "torch.distributed.irecv",
    "torch.distributed.is_available",
    "torch.distributed.is_gloo_available",
    "torch.distributed.is_initialized",
    "torch.distributed.is_mpi_available",
    "torch.distributed.is_nccl_available",
    "torch.distributed.is_torchelastic_launched",
    "torch.distributed.isend",
    "torch.distributed.launch.launch",
    "torch.distributed.launch.main",
    "torch.distributed.launch.parse_args",
    "torch.distributed.launcher.api.launch_agent",
    "torch.distributed.monitored_barrier",
    "torch.distributed.new_group",
    "torch.distributed.recv",
    "torch.distributed.recv_object_list",
    "torch.distributed.reduce",
    "torch.distributed.reduce_scatter",
    "torch.distributed.reduce_scatter_single",
    "torch.distributed.rendezvous.register_rendezvous_handler",
    "torch.distributed.scatter",
    "torch.distributed.scatter_object_list",
    "torch.distributed.send",
    "torch.distributed.send_object_list",
    "torch.distributed.split_group",
]


@pytest.mark.parametrize("name", REFERENCE)
def test_the_documented_path_ports(name: str) -> None:
    path = "aiodist" + name[len("torch.distributed") :]
    module, _, attr = path.rpartition(".")
    mod = importlib.import_module(module)
    assert hasattr(mod, attr), f"{path}: {module} has no {attr}"


def test_the_paths_are_one_implementation() -> None:
    import aiodist
    from aiodist import distributed_c10d, elastic, model_averaging
    from aiodist.algorithms.model_averaging import utils as ma_utils
    from aiodist.elastic.utils import api, distributed, log_level, logging

    assert ma_utils.average_parameters is model_averaging.average_parameters
    assert api.get_env_variable_or_raise is elastic.utils.get_env_variable_or_raise
    assert distributed.get_free_port is elastic.utils.get_free_port
    assert log_level.get_log_level is elastic.utils.get_log_level
    assert logging.get_logger is elastic.utils.get_logger
    assert distributed_c10d.all_reduce is aiodist.all_reduce and distributed_c10d.shrink_group is aiodist.shrink_group
    assert elastic.utils.get_logger("aiodist.test").name == "aiodist.test"  # (the package's own `logging` is torch's path)


def test_the_license_the_package_declares_is_there() -> None:
    """pyproject says BSD-3-Clause: the LICENSE file says the same (setuptools puts it in the
    wheel's dist-info/licenses)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert 'license = { text = "BSD-3-Clause" }' in (root / "pyproject.toml").read_text()
    assert (root / "LICENSE").read_text().startswith("BSD 3-Clause License")
