"""Every ``AIODIST_*`` environment variable, declared once: its kind, default, what it does and
which module reads it. ``table()`` is the table that docs/environment.md holds (a test checks
that the page has this table, and that every ``"AIODIST_..."`` name in the source is declared
here); the debug page's ``/health`` shows the values each rank has set.

A knob is read with ``value(name)``: its default where the variable is unset or blank, else the
text parsed by its kind, or ``ValueError`` naming the variable and what it expects. The kinds
and their one parser each:

- ``bytes``: a byte count with an optional K/M/G suffix (``64M``, ``256KiB``; ``parse_size``);
- ``seconds`` and ``microseconds``: a number (a float);
- ``int``: an integer;
- ``choice``: one of ``choices``, case-insensitive (the value is given lower-case);
- ``text``: the text as it is (a path, an interface list, a flag a module reads its own way);
- ``family``: a prefix (``AIODIST_ALGO_``): one variable per field of a table, read by its module.

Where a module reads a variable its own way (a debug level with torch's alias, the path rules'
family, interface lists), the knob still declares it, with ``text``/``family`` and that module.
This module imports nothing of aiodist: every layer may read a knob.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Knob", "KNOBS", "knob", "value", "parse_size", "effective", "table"]

_SIZE = re.compile(r"\s*(-?\d+)\s*([kmg]?)(?:i?b)?\s*", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str, *, signed: bool = False) -> int:
    """``"64M"`` -> 67108864: a byte count with an optional K, M or G suffix (binary units;
    ``KB``/``KiB`` read the same); ``signed``: a minus sign too (the path rules' -1, "never").
    ValueError for anything else. aiodist's one size parser (knobs, path rules, benchmarks)."""
    m = _SIZE.fullmatch(text)
    if m is None or (not signed and m.group(1).startswith("-")):
        raise ValueError(f"expected a byte count such as 4, 64K or 16M, got {text!r}")
    return int(m.group(1)) * _UNIT[m.group(2).lower()]


@dataclass(frozen=True)
class Knob:
    """One ``AIODIST_*`` variable (the module docstring)."""

    name: str
    kind: str
    default: object
    doc: str
    read_by: str
    minimum: float | None = None  # the least value allowed (inclusive)
    positive: bool = False  # the value must be > 0
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> object:
        """The text ``raw`` (not blank) as this knob's value; ValueError naming the variable."""
        kind, text = self.kind, raw.strip()
        try:
            if kind == "bytes":
                v: object = parse_size(text)
            elif kind in ("seconds", "microseconds"):
                v = float(text)
                if v != v or v in (float("inf"), float("-inf")):
                    raise ValueError("not finite")
            elif kind == "int":
                v = int(text)
            elif kind == "choice":
                v = text.lower()
                if v not in self.choices:
                    raise ValueError(f"not one of {', '.join(self.choices)}")
            else:
                return raw
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected {self.expects()}") from None
        if (self.minimum is not None and v < self.minimum) or (self.positive and v <= 0):  # type: ignore[operator]
            raise ValueError(f"{self.name}={raw!r}: expected {self.expects()}")
        return v

    def expects(self) -> str:
        what = {
            "bytes": "a byte count such as 4096, 64K or 16M",
            "seconds": "a number of seconds",
            "microseconds": "a number of microseconds",
            "int": "an integer",
            "choice": "one of " + ", ".join(self.choices),
        }.get(self.kind, "text")
        if self.positive:
            what += " > 0"
        elif self.minimum is not None:
            what += f" >= {self.minimum:g}"
        return what

    def get(self, env: Mapping[str, str] | None = None) -> object:
        raw = (os.environ if env is None else env).get(self.name, "")
        return self.default if not raw.strip() else self.parse(raw)

    def number(self, env: Mapping[str, str] | None = None) -> float:
        """``get`` of a numeric knob (bytes, int, seconds, microseconds), as a float."""
        v = self.get(env)
        assert isinstance(v, (int, float)), f"{self.name} is not numeric"
        return float(v)

    def whole(self, env: Mapping[str, str] | None = None) -> int:
        """``get`` of a bytes or int knob."""
        v = self.get(env)
        assert isinstance(v, int), f"{self.name} is not a whole number"
        return v


_K = Knob
KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        # debugging and logging
        _K(
            "AIODIST_DEBUG",
            "choice",
            "off",
            "debug level (torch's TORCH_DISTRIBUTED_DEBUG, which it overrides): per-op checks and logs",
            "aiodist._instrument.levels",
            choices=("off", "info", "detail"),
        ),
        _K(
            "AIODIST_LOG_LEVEL",
            "text",
            "",
            "level of the aiodist loggers (ERROR, WARNING, INFO, DEBUG, TRACE; TORCH_CPP_LOG_LEVEL as an alias), combined with the debug level",
            "aiodist._instrument.logs",
        ),
        _K(
            "AIODIST_DESYNC_DIGESTS",
            "text",
            "1",
            "0 turns off the frame digests that find a desync at debug level OFF",
            "aiodist.c10d.process_group",
        ),
        _K("AIODIST_FR_BUFFER_SIZE", "int", 2000, "ops each group's flight recorder keeps (0: off)", "aiodist._instrument.recorder"),
        _K(
            "AIODIST_FR_DUMP_ON_TIMEOUT",
            "text",
            "",
            "1 (or true, yes): dump the flight recorder when an op times out",
            "aiodist._instrument.recorder",
        ),
        _K("AIODIST_FR_DUMP_DIR", "text", "", "where those dumps go (default: the working directory)", "aiodist._instrument.recorder"),
        _K(
            "AIODIST_LOOP_BLOCKED_WARN",
            "seconds",
            2.0,
            "warn when the event loop is blocked this long (0 or less: no watchdog)",
            "aiodist._instrument.loop_watchdog",
        ),
        _K(
            "AIODIST_INIT_WARN_INTERVAL",
            "seconds",
            10.0,
            "seconds between start-up progress warnings (0: none)",
            "aiodist._startup",
            minimum=0,
        ),
        _K(
            "AIODIST_BREAKPOINT_STDIN",
            "text",
            "",
            "the file aiodist.debug.breakpoint reads commands from (default: the terminal)",
            "aiodist.debug.breakpoint",
        ),
        # transport and shared memory
        _K(
            "AIODIST_SOCKET_IFNAME",
            "text",
            "",
            "network interfaces to use, comma-separated (as GLOO_SOCKET_IFNAME, which it overrides)",
            "aiodist.transport._ifaces",
        ),
        _K(
            "AIODIST_ADVERTISE_ADDR",
            "text",
            "",
            "the address a rank's transport advertises to its peers (set by the launcher)",
            "aiodist.transport._ifaces",
        ),
        _K(
            "AIODIST_HANDSHAKE_TIMEOUT",
            "seconds",
            10.0,
            "how long an accepted connection may take to say HELLO",
            "aiodist.transport._transport",
            positive=True,
        ),
        _K(
            "AIODIST_LINK_TIMEOUT_S",
            "seconds",
            10.0,
            "a connection whose peer's kernel acknowledges nothing for this long (keepalive probes while idle, TCP_USER_TIMEOUT while sending) is lost, naming the peer (0: the kernel's defaults, minutes)",
            "aiodist.transport._connection",
            minimum=0,
        ),
        _K(
            "AIODIST_STRIPE_MIN_BYTES",
            "bytes",
            256 << 10,
            "messages from this size are striped over a peer's lanes",
            "aiodist.transport._transport",
            minimum=1,
        ),
        _K(
            "AIODIST_SHM_BYTES",
            "bytes",
            32 << 20,
            "each rank's shared-memory segment (0: no shared memory; else at least 4096)",
            "aiodist.shm._manager",
            minimum=0,
        ),
        _K(
            "AIODIST_SHM_SPIN_US",
            "microseconds",
            500.0,
            "how long a shared-memory wait spins before it sleeps (0: never)",
            "aiodist.shm._manager",
            minimum=0,
        ),
        _K("AIODIST_SHM_CMA", "text", "", "0 turns off single-copy reads between processes (process_vm_readv)", "aiodist.shm._cma"),
        _K(
            "AIODIST_ALGO_",
            "family",
            "",
            "the path rules, one variable per field of aiodist.algorithms.Thresholds (AIODIST_ALGO_ALLREDUCE_CMA_MIN=4M, ...); AIODIST_ALGO_RULES names a rules file",
            "aiodist.algorithms.thresholds",
        ),
        # stores
        _K(
            "AIODIST_STORE_SPIN_US",
            "microseconds",
            100.0,
            "how long a TCPStore client spins for a reply before it sleeps (0: never); a bad value warns",
            "aiodist.store._connection",
            minimum=0,
        ),
        # training
        _K(
            "AIODIST_DDP_BACKWARD",
            "choice",
            "auto",
            "where DistributedDataParallel runs loss.backward(): auto, thread or loop",
            "aiodist.nn.parallel.distributed",
            choices=("auto", "thread", "loop"),
        ),
        # benchmarks
        _K("AIODIST_BENCH_MPI", "text", "", "benchmark internal: an MPI rank's settings", "aiodist.bench._mpi"),
        _K(
            "AIODIST_BENCH_MPICH",
            "text",
            "",
            "the venv holding MPICH and its mpi4py (default /opt/aiodist-mpi/mpich)",
            "aiodist.bench._mpi",
        ),
        _K(
            "AIODIST_BENCH_IMPI",
            "text",
            "",
            "the venv holding Intel MPI and its mpi4py (default /opt/aiodist-mpi/impi)",
            "aiodist.bench._mpi",
        ),
        _K(
            "AIODIST_BENCH_BEFORE",
            "text",
            "",
            "benchmark internal: the older checkout a before= side imports",
            "aiodist.bench._before_rank",
        ),
        _K("AIODIST_BENCH_FAIL_RANK", "text", "", "benchmark tests: the rank that fails on purpose", "aiodist.bench.collectives"),
        # aiodist_cuda (NCCL through CuPy: docs/cuda.md)
        _K(
            "AIODIST_CUDA_DISABLE",
            "text",
            "",
            "1: aiodist_cuda reports itself unavailable (is_nccl_available() is False)",
            "aiodist_cuda._cupy",
        ),
        _K(
            "AIODIST_CUDA_LAUNCH",
            "choice",
            "thread",
            "where NCCL calls are launched: on a launcher thread, or on the event loop",
            "aiodist_cuda.backend",
            choices=("thread", "loop"),
        ),
        _K(
            "AIODIST_CUDA_COMPLETION",
            "choice",
            "thread",
            "how the loop learns a GPU op ended: a completion thread, or a stream host function",
            "aiodist_cuda.backend",
            choices=("thread", "hostfunc"),
        ),
        _K("AIODIST_CUDA_SPIN", "text", "", "1: the completion thread spins (lowest latency, a core busy)", "aiodist_cuda.backend"),
        _K(
            "AIODIST_NCCL_SPLIT",
            "text",
            "1",
            "0: a sub-group gets a communicator of its own instead of ncclCommSplit of its parent's",
            "aiodist_cuda.backend",
        ),
    )
}


def knob(name: str) -> Knob:
    """The knob ``name`` (an ``AIODIST_ALGO_...`` field: the family's); KeyError naming it."""
    if name in KNOBS:
        return KNOBS[name]
    for k in KNOBS.values():
        if k.kind == "family" and name.startswith(k.name):
            return k
    raise KeyError(f"{name} is not an aiodist knob (aiodist.knobs.KNOBS)")


def value(name: str, env: Mapping[str, str] | None = None) -> object:
    """Knob ``name``'s effective value in ``env`` (default: this process's environment)."""
    return knob(name).get(env)


def effective(env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """Every knob with what this process has: ``name``, ``set`` (the variable's text, or None),
    ``value`` (parsed; a bad value: its error's text), ``default``; a family lists each
    variable set under its prefix."""
    env = os.environ if env is None else env
    out: list[dict[str, object]] = []
    for k in KNOBS.values():
        names = sorted(n for n in env if n.startswith(k.name)) if k.kind == "family" else [k.name]
        for name in names:
            raw = env.get(name)
            try:
                v: object = k.get({name: raw} if raw is not None else {}) if k.kind != "family" else raw
            except ValueError as exc:
                v = f"invalid: {exc}"
            out.append({"name": name, "set": raw, "value": v, "default": k.default})
    return out


def table() -> str:
    """The Markdown table of every knob (docs/environment.md is this)."""
    rows = ["| variable | kind | default | what it does | read by |", "|---|---|---|---|---|"]
    for k in KNOBS.values():
        name = f"`{k.name}*`" if k.kind == "family" else f"`{k.name}`"
        default = "" if k.default in ("", None) else f"`{k.default}`"
        kind = k.kind + (f" ({k.expects()})" if k.kind not in ("text", "family") else "")
        rows.append(f"| {name} | {kind} | {default} | {k.doc} | `{k.read_by}` |")
    return "\n".join(rows) + "\n"
