"""``python -m aiodist.launch``: the legacy launcher (torch.distributed.launch), deprecated.

The same launcher as ``aiodist-run`` (``python -m aiodist.run``) with one difference: each
worker gets ``--local-rank=N`` on its command line (before the script's own arguments) unless
``--use-env`` is given, in which case only the ``LOCAL_RANK`` environment variable says it (as
it always does with ``aiodist-run``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from aiodist.launcher._config import Flag
from aiodist.run import exit_code, get_args_parser, run

__all__ = ["parse_args", "launch", "main"]

DEPRECATION = (
    "The module aiodist.launch is deprecated\n"
    "and will be removed in future. Use aiodist-run (python -m aiodist.run).\n"
    "Note that --use-env is set by default in aiodist-run.\n"
    "If your script expects `--local-rank` argument to be set, please\n"
    "change it to read from `os.environ['LOCAL_RANK']` instead. See \n"
    "docs/launcher.md for further instructions\n"
)


_USE_ENV = Flag(
    "use-env",
    "Use environment variable to pass 'local rank'. If set, the launcher will not pass --local-rank as argument.",
    switch=True,
)


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    parser = get_args_parser(prog="python -m aiodist.launch")
    _USE_ENV.add_to(parser)
    return parser.parse_args(args)


def launch(args: argparse.Namespace) -> None:
    if args.no_python and not args.use_env:
        raise ValueError("When using the '--no-python' flag, you must also set the '--use-env' flag.")
    run(args)


def main(args: Sequence[str] | None = None) -> int:
    warnings.warn(DEPRECATION, FutureWarning, stacklevel=2)
    return exit_code(lambda: launch(parse_args(args)))


if __name__ == "__main__":
    sys.exit(main())
