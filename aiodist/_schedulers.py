"""Where ``env://`` finds rank, world size, local rank and the master address when the job was
started by a scheduler instead of a torch-style launcher (see docs/schedulers.md).

``resolve_env(...)`` is what ``aiodist.rendezvous``'s ``env://`` handler calls. Precedence, per
value:

1. ``rank=`` / ``world_size=`` given to ``init_process_group`` / ``rendezvous`` (or in the URL);
2. the torchrun variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
3. the first scheduler, in this order, whose rank variable is set:

   - Open MPI (``mpirun``/``mpiexec``): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
     ``OMPI_COMM_WORLD_LOCAL_RANK``;
   - MVAPICH2: ``MV2_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_SIZE``, ``MV2_COMM_WORLD_LOCAL_RANK``;
   - PMI (MPICH / Intel MPI hydra, ``srun --mpi=pmi2``): ``PMI_RANK``, ``PMI_SIZE``,
     ``MPI_LOCALRANKID`` (else ``PMI_LOCAL_RANK``);
   - Slurm (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``.

   MPI comes before Slurm because ``mpirun`` inside an ``sbatch`` script inherits the batch
   step's ``SLURM_PROCID=0``, while the MPI variables are set per process.
4. Inside a Slurm job (whichever source gave the rank), an unset ``MASTER_ADDR`` is the first
   host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``), where
   ``srun`` places task 0; an unset ``MASTER_PORT`` is ``10000 + SLURM_JOB_ID % 20000`` (every
   task of a job derives the same port, and jobs sharing a node rarely collide). MPI launchers
   say nothing about where rank 0 runs: give ``MASTER_ADDR`` and ``MASTER_PORT``.

Host lists are expanded here (``node[01-03,07]``, ``r[1-2]-n[1-2]``), without ``scontrol``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Scheduler",
    "SCHEDULERS",
    "EnvResolution",
    "detect_scheduler",
    "expand_hostlist",
    "slurm_master_addr",
    "slurm_master_port",
    "node_local_rank",
    "resolve_env",
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
]

SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

_PREFIX = "Error initializing aiodist using env:// rendezvous: "


@dataclass(frozen=True)
class Scheduler:
    """One launcher's variables: ``rank_var`` set means the process was started by it."""

    name: str
    rank_var: str
    size_var: str
    local_rank_vars: tuple[str, ...]


SCHEDULERS: tuple[Scheduler, ...] = (
    Scheduler("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    Scheduler("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",)),
    Scheduler("MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    Scheduler("Slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)

_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    value = _get(env, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{_PREFIX}environment variable {name} must be an integer, got {value!r}") from None


def detect_scheduler(env: Mapping[str, str] | None = None) -> Scheduler | None:
    """The first scheduler of ``SCHEDULERS`` whose rank variable is set, or None."""
    env = os.environ if env is None else env
    for s in SCHEDULERS:
        if _get(env, s.rank_var) is not None:
            return s
    return None


# -- Slurm host lists --------------------------------------------------------------------------


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in Slurm host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm host list {text!r}")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_range(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"bad range {item!r} in Slurm host list {whole!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"range {item!r} runs backwards in Slurm host list {whole!r}")
        width = len(lo_s)  # Slurm pads to the width of the low bound: node[01-10]
        out.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return out


def _expand_host(expr: str, whole: str) -> list[str]:
    hosts = [""]
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", expr):
        literal = expr[pos : m.start()]
        choices = _expand_range(m.group(1), whole)
        hosts = [h + literal + c for h in hosts for c in choices]
        pos = m.end()
    tail = expr[pos:]
    return [h + tail for h in hosts]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``"node[01-03,07],gpu1"`` ->
    ``["node01", "node02", "node03", "node07", "gpu1"]``. Several brackets in one name expand
    as a product (``r[1-2]-n[1-2]`` -> r1-n1, r1-n2, r2-n1, r2-n2). ValueError when malformed."""
    if not isinstance(hostlist, str):
        raise TypeError(f"hostlist must be a str, got {type(hostlist).__name__}")
    text = hostlist.strip()
    if not text:
        return []
    hosts: list[str] = []
    for expr in _split_top_level(text):
        expr = expr.strip()
        if not expr:
            continue
        hosts.extend(_expand_host(expr, hostlist))
    return hosts


def slurm_master_addr(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(host, variable it came from)``: the first host of the step's (else the job's) node
    list, or None outside Slurm."""
    env = os.environ if env is None else env
    for name in _SLURM_NODELIST_VARS:
        value = _get(env, name)
        if value is not None:
            hosts = expand_hostlist(value)
            if hosts:
                return hosts[0], name
    return None


def slurm_master_port(env: Mapping[str, str] | None = None) -> int | None:
    """``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN`` (10000..29999), or None outside Slurm."""
    env = os.environ if env is None else env
    job_id = _int_var(env, "SLURM_JOB_ID")
    if job_id is None:
        job_id = _int_var(env, "SLURM_JOBID")
    if job_id is None:
        return None
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def node_local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its node: ``LOCAL_RANK``, else the detected scheduler's local
    rank variable, else None."""
    env = os.environ if env is None else env
    value = _int_var(env, "LOCAL_RANK")
    if value is not None:
        return value
    sched = detect_scheduler(env)
    if sched is None:
        return None
    for name in sched.local_rank_vars:
        value = _int_var(env, name)
        if value is not None:
            return value
    return None


# -- env:// resolution -------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvResolution:
    """What ``env://`` uses, and where each value came from (a variable name or ``"argument"``)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int | None
    scheduler: str | None
    sources: dict[str, str] = field(default_factory=dict)


def _no_scheduler() -> str:
    names = ", ".join(f"{s.rank_var} ({s.name})" for s in SCHEDULERS)
    return f"and no scheduler was detected either (none of {names} is set)"


def resolve_env(rank: int | None = None, world_size: int | None = None, env: Mapping[str, str] | None = None) -> EnvResolution:
    """Rank, world size, master address and port, local rank, in the order of the module doc.
    ``rank``/``world_size`` given (not None) win. A ValueError names the variables missing."""
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    sched = detect_scheduler(env)

    def pick(value: int | None, key: str, torch_var: str, sched_attr: str) -> int:
        if value is not None:
            sources[key] = "argument"
            return value
        got = _int_var(env, torch_var)
        if got is not None:
            sources[key] = torch_var
            return got
        if sched is None:
            raise ValueError(f"{_PREFIX}environment variable {torch_var} expected, but not set, {_no_scheduler()}")
        var = getattr(sched, sched_attr)
        got = _int_var(env, var)
        if got is None:
            raise ValueError(
                f"{_PREFIX}environment variable {torch_var} expected, but not set, and {sched.name} was detected "
                f"({sched.rank_var} is set) but its {var} is not set either"
            )
        sources[key] = var
        return got

    r = pick(rank, "rank", "RANK", "rank_var")
    n = pick(world_size, "world_size", "WORLD_SIZE", "size_var")
    used_sched = sched.name if sched is not None and any(s not in ("argument", "RANK", "WORLD_SIZE") for s in sources.values()) else None

    missing: list[str] = []
    addr = _get(env, "MASTER_ADDR")
    if addr is not None:
        sources["master_addr"] = "MASTER_ADDR"
    else:
        derived = slurm_master_addr(env)
        if derived is not None:
            addr, sources["master_addr"] = derived[0], f"first host of {derived[1]}"
        else:
            missing.append("MASTER_ADDR")
    port = _int_var(env, "MASTER_PORT")
    if port is not None:
        sources["master_port"] = "MASTER_PORT"
    else:
        port = slurm_master_port(env)
        if port is not None:
            sources["master_port"] = f"{SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}"
        else:
            missing.append("MASTER_PORT")
    if missing:
        first = missing[0]
        detail = ""
        if used_sched is not None and used_sched != "Slurm":
            detail = (
                f" (rank and world size came from {used_sched}, which does not say where rank 0 runs: export "
                f"{' and '.join(missing)} to every process, e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>)"
            )
        elif used_sched == "Slurm":
            derivable = {"MASTER_ADDR": "/".join(_SLURM_NODELIST_VARS), "MASTER_PORT": "SLURM_JOB_ID"}
            detail = f" (and {' nor '.join(derivable[m] for m in missing)} is not set to derive it from)"
        also = f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""
        raise ValueError(f"{_PREFIX}environment variable {first} expected, but not set{also}{detail}")
    assert addr is not None and port is not None
    return EnvResolution(r, n, addr, port, node_local_rank(env), used_sched, sources)
