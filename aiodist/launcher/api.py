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
from dataclasses import dataclass, field
from typing import Any

from aiodist.elastic.errors import ChildFailedError
from aiodist.elastic.utils import get_logger
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


@dataclass
class LaunchConfig:
    """torch's fields, plus what torchrun's flags carry that torch puts in ``logs_specs``.

    ``rdzv_endpoint`` is ``host:port`` of the rendezvous store; with the ``static`` backend
    ``rdzv_configs["rank"]`` is this node's rank (as torchrun sets it from ``--node-rank``).
    ``rdzv_configs`` also takes ``join_timeout`` (s, default 600), ``last_call_timeout`` (s,
    default 30: how long a ``c10d`` round waits for more nodes once MIN arrived),
    ``heartbeat_timeout`` (s, default 30: a node whose agent is silent that long fails the
    round). An empty
    ``rdzv_endpoint`` means ``127.0.0.1:0`` (this agent hosts it on a free port; one node only).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    # aiodist: what torch keeps in ``logs_specs`` (DefaultLogsSpecs) and the stop grace.
    log_dir: str | None = None
    redirects: int | str | dict[int, int] = 0
    tee: int | str | dict[int, int] = 0
    local_ranks_filter: set[int] | None = None
    stop_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.rdzv_timeout > 0:
            self.rdzv_configs["join_timeout"] = self.rdzv_timeout
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.logs_specs is not None:
            for name in ("log_dir", "redirects", "tee", "local_ranks_filter"):
                v = getattr(self.logs_specs, name, None) or getattr(self.logs_specs, f"_{name}", None)
                if v is not None and getattr(self, name) in (None, 0):
                    setattr(self, name, v)


def _entry_name(entrypoint: Callable[..., Any] | str, args: list[Any] | tuple[Any, ...]) -> str:
    """The name the failure report gives the job: for ``python [-u] [-m] script`` the script
    (as torch does), else the command or the callable's name."""
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), entrypoint)
        return entrypoint
    return getattr(entrypoint, "__qualname__", None) or getattr(entrypoint, "__name__", None) or repr(entrypoint)


def _worker_spec(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any] | tuple[Any, ...]) -> WorkerSpec:
    n = config.nproc_per_node
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
    return WorkerSpec(
        role=config.role,
        nproc=n,
        name=_entry_name(entrypoint, args),
        cmd=cmd,
        fn=fn,
        fn_args=tuple(args),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        stop_timeout=config.stop_timeout,
        log_dir=config.log_dir,
        redirects=Std.parse(config.redirects, n),
        tee=Std.parse(config.tee, n),
        local_ranks_filter=config.local_ranks_filter,
        log_line_prefix_template=config.log_line_prefix_template,
        run_id=config.run_id,
        extra_env=extra_env,
    )


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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
