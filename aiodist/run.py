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
from argparse import REMAINDER, ArgumentParser
from collections.abc import Callable, Sequence
from typing import Any

from aiodist.elastic.errors import ChildFailedError
from aiodist.elastic.utils import get_logger
from aiodist.errors import DistError
from aiodist.launcher._config import add_flags, config_from_namespace, determine_local_world_size, parse_min_max_nnodes
from aiodist.launcher.agent import SignalException
from aiodist.launcher.api import LaunchConfig, launch_agent
from aiodist.launcher.rendezvous import RendezvousError

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


def get_args_parser(prog: str = "aiodist-run") -> ArgumentParser:
    """torchrun's flags, made from ``LaunchConfig``'s fields (aiodist/launcher/_config.py)."""
    p = ArgumentParser(
        prog=prog, description="aiodist's elastic launcher (torchrun's flags): starts and supervises the workers of one node"
    )
    add_flags(p)
    p.add_argument("training_script", type=str, help="the program (a python script unless --no-python; a module with -m)")
    p.add_argument("training_script_args", nargs=REMAINDER)
    return p


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    return get_args_parser().parse_args(args)


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """(config, entrypoint, args) for ``launch_agent``, as torchrun derives them."""
    if args.module and args.no_python:
        raise ValueError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
    config = config_from_namespace(args)
    if args.standalone and args.master_port is not None:  # torchrun ignores it without a word; aiodist says so
        log.warning(
            "--standalone ignores --master-port %d: the rendezvous store takes a free port of its own "
            "(use --rdzv-backend static --master-port %d for that port)",
            args.master_port,
            args.master_port,
        )
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        log.warning(
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded"
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
