"""``LaunchConfig`` and ``launch_agent`` (torch.distributed.launcher.api), asyncio inside.

``launch_agent(config, entrypoint, args)`` runs this node's share of a job and returns
``{rank: return value}`` for the workers of this node (torch keys the dict by global rank; on
one node that is the local rank). ``entrypoint`` is a command (``str``: the program, with
``args`` as its arguments) or a picklable Python callable (run in fresh processes, an
``async def`` on a fresh event loop; its return values come back through the run directory).
``alaunch_agent`` is the same as a coroutine, for code already on a loop.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from aiodist.elastic.errors import ChildFailedError
from aiodist.elastic.utils import get_logger
from aiodist.launcher._config import LaunchConfig
from aiodist.launcher.agent import LocalAgent, SignalException, Std, WorkerSpec
from aiodist.launcher.rendezvous import AgentRendezvous, RendezvousError, RendezvousTimeoutError

__all__ = [
    "LaunchConfig",
    "launch_agent",
    "alaunch_agent",
    "elastic_launch",
    "ChildFailedError",
    "SignalException",
    "RendezvousError",
    "RendezvousTimeoutError",
    "Std",
]

DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_LAST_CALL_TIMEOUT_S = 30.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
ADVERTISE_ENV = "AIODIST_ADVERTISE_ADDR"  # the address a rank's transport advertises to its peers


def _entry_name(entrypoint: Callable[..., Any] | str, args: list[Any] | tuple[Any, ...]) -> str:
    """The name the failure report gives the job: for ``python [-u] [-m] script`` the script
    (as torch does), else the command or the callable's name."""
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), entrypoint)
        return entrypoint
    return getattr(entrypoint, "__qualname__", None) or getattr(entrypoint, "__name__", None) or repr(entrypoint)


def _worker_spec(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any] | tuple[Any, ...]) -> WorkerSpec:
    """The worker spec of ``config``: the config itself, and what ``entrypoint``/``args`` say."""
    cmd: list[str] | None = None
    fn: Callable[..., Any] | None = None
    if isinstance(entrypoint, str):
        cmd = [entrypoint, *(str(a) for a in args)]
    elif callable(entrypoint):
        fn = entrypoint
    else:
        raise TypeError(f"entrypoint must be a str (a command) or a callable, got {entrypoint!r}")
    extra_env: dict[str, str] = {}
    if config.local_addr and ADVERTISE_ENV not in os.environ:
        # --local-addr is where other nodes reach this one: the workers advertise it too (a
        # value the user set for the launcher is inherited as it is).
        extra_env[ADVERTISE_ENV] = config.local_addr
    return WorkerSpec(config, name=_entry_name(entrypoint, args), cmd=cmd, fn=fn, fn_args=tuple(args), extra_env=extra_env)


def _rendezvous(config: LaunchConfig) -> AgentRendezvous:
    conf = config.rdzv_configs
    node_rank = conf.get("rank")
    return AgentRendezvous(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint or "127.0.0.1:0",
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc=config.nproc_per_node,
        node_rank=int(node_rank) if node_rank is not None else (0 if config.rdzv_backend == "static" and config.max_nodes == 1 else None),
        join_timeout=float(conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S)),
        last_call_timeout=float(conf.get("last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT_S)),
        local_addr=config.local_addr,
        heartbeat_timeout=float(conf.get("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT_S)),
    )


async def alaunch_agent(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any] | tuple[Any, ...]
) -> dict[int, Any]:
    """``launch_agent`` as a coroutine (signal handlers go on the running loop when it runs in
    the main thread)."""
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    log = get_logger("aiodist.run")
    spec = _worker_spec(config, entrypoint, args)
    agent = LocalAgent(spec, _rendezvous(config), log)
    return await agent.run()


def launch_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any] | tuple[Any, ...]) -> dict[int, Any]:
    """Run this node's workers of the job to completion: ``{rank: return value}``; raises
    ``ChildFailedError`` when workers failed and no restarts remain, ``RendezvousError`` when
    the nodes could not meet, ``SignalException`` on SIGINT/SIGTERM (workers stopped)."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner:
        return runner.run(alaunch_agent(config, entrypoint, args))


class elastic_launch:  # noqa: N801 - torch's name
    """``elastic_launch(config, entrypoint)(*args)``: ``launch_agent`` as torch wraps it."""

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))
