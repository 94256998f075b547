"""``python -m aiodist.run`` / ``aiodist-run``: torchrun for aiodist, an asyncio program.

    aiodist-run --standalone --nproc-per-node 4 train.py --epochs 3
    aiodist-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py   # node 0
    aiodist-run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py   # node 1
    aiodist-run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 train.py

Flags are torchrun's (dashes or underscores); every flag can also come from ``PET_<NAME>``
(``PET_NPROC_PER_NODE=4``). Workers get torchrun's environment and connect with
``init_process_group()`` (``env://``) to the store this agent hosts. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from argparse import REMAINDER, Action, ArgumentParser
from collections.abc import Callable, Sequence
from typing import Any

from aiodist.elastic.errors import ChildFailedError
from aiodist.elastic.utils import get_logger
from aiodist.errors import DistError
from aiodist.launcher.agent import SignalException
from aiodist.launcher.api import LaunchConfig, _cpu_count, launch_agent
from aiodist.launcher.rendezvous import RendezvousError, format_endpoint

__all__ = [
    "get_args_parser",
    "parse_args",
    "parse_min_max_nnodes",
    "determine_local_world_size",
    "config_from_args",
    "run",
    "main",
    "exit_code",
]

log = get_logger("aiodist.run")

_TRUE = ("1", "true", "yes", "on")


class _Env(Action):
    """A value flag whose default comes from ``PET_<DEST>`` when that is set."""

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kwargs: Any) -> None:
        env_name = f"PET_{dest.upper()}"
        default = os.environ.get(env_name, default)
        if default is not None:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser: ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(Action):
    """A switch whose default comes from ``PET_<DEST>`` (``1``/``true``/...)."""

    def __init__(self, dest: str, default: bool = False, **kwargs: Any) -> None:
        env_name = f"PET_{dest.upper()}"
        default = os.environ.get(env_name, str(int(default))).lower() in _TRUE
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser: ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)


def _flags(name: str, *short: str) -> list[str]:
    """``--nproc-per-node`` and ``--nproc_per_node`` (torchrun takes both)."""
    out = [*short, f"--{name}"]
    if "-" in name:
        out.append(f"--{name.replace('-', '_')}")
    return out


def get_args_parser(prog: str = "aiodist-run") -> ArgumentParser:
    p = ArgumentParser(
        prog=prog, description="aiodist's elastic launcher (torchrun's flags): starts and supervises the workers of one node"
    )

    def add(name: str, *short: str, **kw: Any) -> None:
        p.add_argument(*_flags(name, *short), action=_Env, **kw)

    def switch(name: str, *short: str, **kw: Any) -> None:
        p.add_argument(*_flags(name, *short), action=_CheckEnv, **kw)

    add("nnodes", type=str, default="1:1", help="number of nodes, or MIN:MAX (elastic, c10d backend)")
    add("nproc-per-node", type=str, default="1", help="workers per node: an int, 'cpu' or 'auto' (the CPUs this process may use)")
    add("rdzv-backend", type=str, default="static", help="rendezvous backend: static (default) or c10d")
    add("rdzv-endpoint", type=str, default="", help="rendezvous store host[:port] (c10d default port 29400)")
    add("rdzv-id", type=str, default="none", help="the job's id (all nodes give the same)")
    add("rdzv-conf", type=str, default="", help="key=value,... (join_timeout, last_call_timeout, heartbeat_timeout: seconds)")
    switch("standalone", help="single-node job: a local rendezvous on a free port, no other flags needed")
    add("max-restarts", type=int, default=0, help="restarts of the worker group before the job fails (default 0)")
    add("monitor-interval", type=float, default=0.1, help="seconds between checks of other nodes' state")
    add(
        "start-method",
        type=str,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted; workers are always fresh processes",
    )
    add("role", type=str, default="default", help="ROLE_NAME of the workers")
    switch("module", "-m", help="run the script as a python module (python -m)")
    switch("no-python", help="run the script directly, not through python")
    switch("run-path", help="run the script with runpy.run_path in the worker interpreter")
    add("log-dir", type=str, default=None, help="directory for the workers' log files (a fresh subdirectory per run)")
    add(
        "redirects",
        "-r",
        type=str,
        default="0",
        help="streams into log files only: 0 none, 1 stdout, 2 stderr, 3 both; or 0:1,1:2 per local rank",
    )
    add("tee", "-t", type=str, default="0", help="streams into log files and the console (same values as --redirects)")
    add("local-ranks-filter", type=str, default="", help="show only these local ranks' output on the console, e.g. 0,2")
    add("node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    add("master-addr", type=str, default="127.0.0.1", help="node 0's address (static rendezvous)")
    add("master-port", type=int, default=None, help="node 0's rendezvous port (multi-node default 29500; single node: a free port)")
    add(
        "local-addr",
        type=str,
        default=None,
        help="the address other nodes reach this one at; its workers advertise it too (AIODIST_ADVERTISE_ADDR, unless set)",
    )
    add("logs-specs", type=str, default=None, help="accepted for torchrun compatibility; ignored")
    p.add_argument("training_script", type=str, help="the program (a python script unless --no-python; a module with -m)")
    p.add_argument("training_script_args", nargs=REMAINDER)
    return p


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    return get_args_parser().parse_args(args)


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    parts = nnodes.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"nnodes={nnodes} is not in 'N' or 'MIN:MAX' form")


def determine_local_world_size(nproc_per_node: str) -> int:
    try:
        n = int(nproc_per_node)
    except ValueError:
        if nproc_per_node in ("cpu", "auto"):
            return _cpu_count()
        if nproc_per_node == "gpu":
            raise ValueError("--nproc-per-node gpu: aiodist's launcher does not count GPUs; give a number") from None
        raise ValueError(f"Unsupported nproc_per_node value: {nproc_per_node}") from None
    if n < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {n}")
    return n


def _parse_conf(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--rdzv-conf item {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def _ranks_filter(text: str) -> set[int] | None:
    text = text.strip()
    return {int(x) for x in text.split(",") if x.strip()} if text else None


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """(config, entrypoint, args) for ``launch_agent``, as torchrun derives them."""
    if args.module and args.no_python:
        raise ValueError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "127.0.0.1:0"
        args.rdzv_id = str(uuid.uuid4())
        args.nnodes = "1"
    min_nodes, max_nodes = parse_min_max_nnodes(str(args.nnodes))
    nproc = determine_local_world_size(str(args.nproc_per_node))
    conf = _parse_conf(args.rdzv_conf)
    if args.rdzv_backend == "static":
        conf["rank"] = int(args.node_rank)
        port = args.master_port if args.master_port is not None else (29500 if max_nodes > 1 else 0)
        endpoint = args.rdzv_endpoint or format_endpoint(args.master_addr, port)
    else:
        endpoint = args.rdzv_endpoint
        if not endpoint:
            if max_nodes > 1:
                raise ValueError("--rdzv-backend c10d with more than one node needs --rdzv-endpoint host:port")
            endpoint = "127.0.0.1:0"
    redirects: int | str = args.redirects
    tee: int | str = args.tee
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        log.warning(
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded"
        )
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=str(args.rdzv_id),
        role=args.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_configs=conf,
        max_restarts=int(args.max_restarts),
        monitor_interval=float(args.monitor_interval),
        start_method=args.start_method,
        local_addr=args.local_addr,
        log_dir=args.log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=_ranks_filter(args.local_ranks_filter),
    )
    script_args = list(args.training_script_args)
    if args.run_path:
        from aiodist.launcher._bootstrap import run_script_path

        return config, run_script_path, [args.training_script, *script_args]
    # The legacy launcher (aiodist.launch) passes --local-rank=N unless --use-env.
    local_rank_arg = [] if getattr(args, "use_env", True) else ["--local-rank=${local_rank}"]
    if args.no_python:
        return config, args.training_script, local_rank_arg + script_args
    cmd_args = ["-u"]
    if args.module:
        cmd_args.append("-m")
    cmd_args.append(args.training_script)
    return config, sys.executable, cmd_args + local_rank_arg + script_args


def run(args: argparse.Namespace) -> None:
    """Launch from parsed arguments; raises ``ChildFailedError`` (and the others of ``launch_agent``)."""
    config, entrypoint, cmd_args = config_from_args(args)
    launch_agent(config, entrypoint, cmd_args)


def main(args: Sequence[str] | None = None) -> int:
    """The command line: 0 on success, 1 when the workers failed (with the report on stderr),
    128+N when the launcher was stopped by signal N, 2 on bad arguments."""
    parsed = parse_args(args)
    return exit_code(lambda: run(parsed))


def exit_code(launch: Callable[[], None]) -> int:
    """Run ``launch`` and turn its outcome into the launcher's exit status (see ``main``)."""
    try:
        launch()
    except ChildFailedError as e:
        sys.stderr.write(e.format_msg() + "\n")
        sys.stderr.flush()
        return 1
    except SignalException as e:
        report = e.format_msg()
        if report:
            sys.stderr.write(report + "\n")
            sys.stderr.flush()
        log.warning("stopped by %s: workers were stopped", e.sigval.name)
        return 128 + int(e.sigval)
    except RendezvousError as e:
        sys.stderr.write(f"aiodist-run: rendezvous failed: {e}\n")
        return 1
    except DistError as e:  # the rendezvous store went away (its host died), or would not start
        sys.stderr.write(f"aiodist-run: {type(e).__name__}: {e}\n")
        return 1
    except ValueError as e:
        sys.stderr.write(f"aiodist-run: error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
