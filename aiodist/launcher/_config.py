"""The launcher's one configuration type: ``LaunchConfig`` (torch's dataclass), whose fields
carry the torchrun flags that set them; the command-line parser is made from those fields, and
a parsed command line becomes a ``LaunchConfig`` by the same metadata.

Each field's metadata holds either ``cli`` (the ``Flag`` that reaches it, and ``pick``: how
the flag's parsed value gives the field's) or ``api_only`` (why no flag does). The flags that
set no single field (they decide the rendezvous endpoint and node rank, or the program to
run, or are accepted and ignored) are ``LAUNCH_FLAGS``; ``config_from_namespace`` applies
them. Bad values are refused while parsing, with the flag's name (and ``PET_<NAME>`` when
the value came from there).
"""

from __future__ import annotations

import argparse
import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from aiodist.launcher.rendezvous import format_endpoint

_N = TypeVar("_N", int, float)

__all__ = [
    "Flag",
    "LaunchConfig",
    "LAUNCH_FLAGS",
    "add_flags",
    "cli_flags",
    "config_from_namespace",
    "parse_min_max_nnodes",
    "determine_local_world_size",
]

_TRUE = ("1", "true", "yes", "on")
_PLAIN_TYPES: dict[Any, str] = {int: "an integer", float: "a number", str: "text"}


@dataclass(frozen=True)
class Flag:
    """One command-line flag. ``name`` is dashed (``nproc-per-node``); ``--nproc_per_node``
    is taken too, as torchrun does. ``default`` is torchrun's: text is parsed as if given on
    the command line, and ``PET_<NAME>`` replaces it when set. ``type`` turns the text into
    the value (a ``ValueError`` from it is the refusal's message)."""

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    short: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    switch: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_var(self) -> str:
        return f"PET_{self.dest.upper()}"

    @property
    def option_strings(self) -> list[str]:
        out = [*self.short, f"--{self.name}"]
        if "-" in self.name:
            out.append(f"--{self.dest}")
        return out

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.switch:
            parser.add_argument(*self.option_strings, dest=self.dest, action=_EnvSwitch, default=bool(self.default), help=self.help)
            return
        parser.add_argument(
            *self.option_strings,
            dest=self.dest,
            action=_EnvValue,
            default=self.default,
            type=_checked(self),
            choices=self.choices,
            help=self.help,
        )


class _EnvValue(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` when that is set."""

    def __init__(self, dest: str, default: Any = None, **kwargs: Any) -> None:
        super().__init__(dest=dest, default=os.environ.get(f"PET_{dest.upper()}", default), **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        setattr(namespace, self.dest, values)


class _EnvSwitch(argparse.Action):
    """A switch whose default comes from ``PET_<DEST>`` (``1``/``true``/``yes``/``on``)."""

    def __init__(self, dest: str, default: bool = False, **kwargs: Any) -> None:
        env = os.environ.get(f"PET_{dest.upper()}")
        on = env.strip().lower() in _TRUE if env is not None else default
        super().__init__(dest=dest, const=True, default=on, nargs=0, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        setattr(namespace, self.dest, self.const)


def _checked(flag: Flag) -> Callable[[str], Any]:
    """``flag.type`` with its refusal in words argparse prints after the flag's name."""

    def convert(text: str) -> Any:
        try:
            value = flag.type(text)
            if flag.choices is not None and value not in flag.choices:  # argparse skips defaults (PET_*)
                raise ValueError(f"invalid choice {text!r} (choose from {', '.join(flag.choices)})")
        except ValueError as e:
            what = _PLAIN_TYPES.get(flag.type) if flag.choices is None else None
            msg = f"{text!r} is not {what}" if what else str(e)
            if os.environ.get(flag.env_var) == text:
                msg += f" (from {flag.env_var})"
            raise argparse.ArgumentTypeError(msg) from None
        return value

    convert.__name__ = getattr(flag.type, "__name__", "value")
    return convert


# ---------------------------------------------------------------- what flags' text becomes


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX)."""
    parts = nnodes.split(":")
    try:
        if len(parts) in (1, 2):
            lo, hi = int(parts[0]), int(parts[-1])
            if 1 <= lo <= hi:
                return lo, hi
    except ValueError:
        pass
    raise ValueError(f"nnodes={nnodes} is not in 'N' or 'MIN:MAX' form (1 <= MIN <= MAX)")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def determine_local_world_size(nproc_per_node: str) -> int:
    """An int, or ``cpu``/``auto`` (the CPUs this process may use); ``gpu`` is refused."""
    try:
        n = int(nproc_per_node)
    except ValueError:
        if nproc_per_node in ("cpu", "auto"):
            return _cpu_count()
        if nproc_per_node == "gpu":
            raise ValueError("gpu: aiodist's launcher does not count GPUs; give a number") from None
        raise ValueError(f"unsupported value {nproc_per_node!r} (an int, 'cpu' or 'auto')") from None
    if n < 1:
        raise ValueError(f"must be >= 1, got {n}")
    return n


def _parse_conf(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"item {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def _ranks_filter(text: str) -> set[int] | None:
    try:
        ranks = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{text!r} is not a list of local ranks (0,2)") from None
    return ranks or None


def _std(text: str) -> str:
    """``0``-``3``, or per local rank ``0:1,1:3``: checked, kept as text (``Std.parse`` reads it)."""
    for part in text.split(","):
        rank, sep, mask = part.strip().rpartition(":")
        try:
            ok = 0 <= int(mask) <= 3 and (not sep or int(rank) >= 0)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{text!r}: streams are 0 none, 1 stdout, 2 stderr, 3 both; or per local rank 0:1,1:3")
    return text


def _number(parse: Callable[[str], _N], what: str, text: str) -> _N:
    """``parse(text)``, refused unless a finite number >= 0 (NaN and inf too: a bound of inf
    seconds is an unbounded wait)."""
    try:
        n = parse(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {what}") from None
    if not (n >= 0 and math.isfinite(n)):
        raise ValueError(f"must be a finite number >= 0, got {text}")
    return n


def _nonneg_int(text: str) -> int:
    return _number(int, "an integer", text)


def _seconds(text: str) -> float:
    return _number(float, "a number of seconds", text)


# ---------------------------------------------------------------- the config


def _cli(flag: Flag, pick: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    return {"cli": flag, "pick": pick}


def _api_only(why: str) -> dict[str, Any]:
    return {"api_only": why}


NNODES = Flag("nnodes", "number of nodes, or MIN:MAX (elastic, c10d backend)", default="1:1", type=parse_min_max_nnodes)
_ROLE_HELP = "ROLE_NAME of the workers"


@dataclass
class LaunchConfig:
    """torch's fields, plus what torchrun's flags carry that torch puts in ``logs_specs``.

    ``rdzv_endpoint`` is ``host:port`` of the rendezvous store; with the ``static`` backend
    ``rdzv_configs["rank"]`` is this node's rank (as torchrun sets it from ``--node-rank``).
    ``rdzv_configs`` also takes ``join_timeout`` (s, default 600), ``last_call_timeout`` (s,
    default 30: how long a ``c10d`` round waits for more nodes once MIN arrived),
    ``heartbeat_timeout`` (s, default 30: a node whose agent is silent that long fails the
    round). An empty ``rdzv_endpoint`` means ``127.0.0.1:0`` (this agent hosts it on a free
    port; one node only). Defaults are torch's API defaults; the command line's are
    torchrun's (``max_restarts`` 0, ``role`` ``default``, ``run_id`` ``none``).
    """

    min_nodes: int = field(metadata=_cli(NNODES, lambda v: v[0]))
    max_nodes: int = field(metadata=_cli(NNODES, lambda v: v[1]))
    nproc_per_node: int = field(
        metadata=_cli(
            Flag(
                "nproc-per-node",
                "workers per node: an int, 'cpu' or 'auto' (the CPUs this process may use)",
                default="1",
                type=determine_local_world_size,
            )
        )
    )
    logs_specs: Any = field(
        default=None, metadata=_api_only("torch's LogsSpecs object; --logs-specs (an entry-point name) is accepted and ignored")
    )
    run_id: str = field(default="", metadata=_cli(Flag("rdzv-id", "the job's id (all nodes give the same)", default="none")))
    role: str = field(default="default_role", metadata=_cli(Flag("role", _ROLE_HELP, default="default")))
    rdzv_endpoint: str = field(
        default="",
        metadata=_cli(
            Flag("rdzv-endpoint", "rendezvous store host[:port] (c10d default port 29400; static: --master-addr:--master-port)", default="")
        ),
    )
    rdzv_backend: str = field(
        default="static",
        metadata=_cli(Flag("rdzv-backend", "rendezvous backend: static (default) or c10d", default="static", choices=("static", "c10d"))),
    )
    rdzv_configs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_cli(
            Flag(
                "rdzv-conf",
                "key=value,... (join_timeout, last_call_timeout, heartbeat_timeout: seconds)",
                default="",
                type=_parse_conf,
            )
        ),
    )
    rdzv_timeout: int = field(
        default=-1, metadata=_api_only("torch's legacy join timeout; on the command line: --rdzv-conf join_timeout=S")
    )
    max_restarts: int = field(
        default=3,
        metadata=_cli(Flag("max-restarts", "restarts of the worker group before the job fails (default 0)", default=0, type=_nonneg_int)),
    )
    keep_survivors: bool = field(
        default=False,
        metadata=_cli(
            Flag(
                "keep-survivors",
                "aiodist's own: a worker's death stops no other worker; the job ends when every worker has ended "
                "(the survivors may shrink their groups and go on), and fails, naming the dead, if one failed",
                switch=True,
            )
        ),
    )
    monitor_interval: float = field(
        default=0.1,
        metadata=_cli(Flag("monitor-interval", "accepted; unused (agents wait on the store for news)", default=0.1, type=_seconds)),
    )
    start_method: str = field(
        default="spawn",
        metadata=_cli(
            Flag("start-method", "accepted; workers are always fresh processes", default="spawn", choices=("spawn", "fork", "forkserver"))
        ),
    )
    log_line_prefix_template: str | None = field(
        default=None, metadata=_api_only("the console prefix of worker output, ${rank} ${local_rank} ${role_name}")
    )
    metrics_cfg: dict[str, str] = field(default_factory=dict, metadata=_api_only("accepted; aiodist has no metrics"))
    local_addr: str | None = field(
        default=None,
        metadata=_cli(
            Flag(
                "local-addr",
                "the address other nodes reach this one at; its workers advertise it too (AIODIST_ADVERTISE_ADDR, unless set)",
            )
        ),
    )
    # aiodist: what torch keeps in ``logs_specs`` (DefaultLogsSpecs) and the stop grace.
    log_dir: str | None = field(
        default=None, metadata=_cli(Flag("log-dir", "directory for the workers' log files (a fresh subdirectory per run)"))
    )
    redirects: int | str | dict[int, int] = field(
        default=0,
        metadata=_cli(
            Flag(
                "redirects",
                "streams into log files only: 0 none, 1 stdout, 2 stderr, 3 both; or 0:1,1:2 per local rank",
                default="0",
                type=_std,
                short=("-r",),
            )
        ),
    )
    tee: int | str | dict[int, int] = field(
        default=0,
        metadata=_cli(
            Flag("tee", "streams into log files and the console (same values as --redirects)", default="0", type=_std, short=("-t",))
        ),
    )
    local_ranks_filter: set[int] | None = field(
        default=None,
        metadata=_cli(
            Flag("local-ranks-filter", "show only these local ranks' output on the console, e.g. 0,2", default="", type=_ranks_filter)
        ),
    )
    stop_timeout: float = field(
        default=5.0,
        metadata=_cli(
            Flag("shutdown-timeout", "seconds the workers have between SIGTERM and SIGKILL when stopped (default 5)", type=_seconds)
        ),
    )

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


# Flags that set no one field: config_from_namespace applies them (or the caller, for the program).
LAUNCH_FLAGS = (
    Flag(
        "standalone",
        "single-node job: a local c10d rendezvous on a free port and a fresh run id (--nnodes, --rdzv-* ignored)",
        switch=True,
    ),
    Flag("node-rank", "this node's rank (static rendezvous)", default=0, type=_nonneg_int),
    Flag("master-addr", "node 0's address (static rendezvous)", default="127.0.0.1"),
    Flag("master-port", "node 0's rendezvous port (multi-node default 29500; single node: a free port)", type=int),
    Flag("module", "run the script as a python module (python -m)", switch=True, short=("-m",)),
    Flag("no-python", "run the script directly, not through python", switch=True),
    Flag("run-path", "run the script with runpy.run_path in the worker interpreter", switch=True),
    Flag("logs-specs", "accepted for torchrun compatibility; ignored"),
)


def cli_flags() -> Iterator[tuple[str, Flag]]:
    """(field name, flag) for every field a flag reaches, in field order."""
    for f in fields(LaunchConfig):
        if "cli" in f.metadata:
            yield f.name, f.metadata["cli"]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the launcher: the fields' (once each: --nnodes gives two), then LAUNCH_FLAGS."""
    seen: set[str] = set()
    for _, flag in cli_flags():
        if flag.name not in seen:
            seen.add(flag.name)
            flag.add_to(parser)
    for flag in LAUNCH_FLAGS:
        flag.add_to(parser)


def config_from_namespace(args: argparse.Namespace) -> LaunchConfig:
    """The ``LaunchConfig`` a parsed command line says, as torchrun derives it: each field from
    its flag, then ``--standalone``, and for ``static`` the endpoint from ``--master-addr`` /
    ``--master-port`` and ``rdzv_configs["rank"]`` from ``--node-rank``."""
    values: dict[str, Any] = {}
    for f in fields(LaunchConfig):
        if "cli" in f.metadata:
            v = getattr(args, f.metadata["cli"].dest)
            if v is not None:  # a flag left unset leaves the field at its API default
                values[f.name] = f.metadata["pick"](v) if f.metadata["pick"] else v
    values["rdzv_configs"] = dict(values["rdzv_configs"])
    if args.standalone:
        values.update(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=str(uuid.uuid4()), min_nodes=1, max_nodes=1)
    if values["rdzv_backend"] == "static":
        values["rdzv_configs"]["rank"] = int(args.node_rank)
        port = args.master_port if args.master_port is not None else (29500 if values["max_nodes"] > 1 else 0)
        values["rdzv_endpoint"] = values["rdzv_endpoint"] or format_endpoint(args.master_addr, port)
    elif not values["rdzv_endpoint"]:
        if values["max_nodes"] > 1:
            raise ValueError("--rdzv-backend c10d with more than one node needs --rdzv-endpoint host:port")
        values["rdzv_endpoint"] = "127.0.0.1:0"
    return LaunchConfig(**values)
