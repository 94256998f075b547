"""The MPI libraries ``python -m aiodist.bench collectives --compare mpi`` measures: how each is
found, how its ``mpirun`` is called, and the best-MPI figure of a row.

Three libraries, each its own side of the run (named as in ``--compare``):

- ``openmpi``: Open MPI's ``mpirun`` on PATH (Debian: ``apt-get install openmpi-bin
  libopenmpi-dev``) and mpi4py built against it in THIS Python (``pip install mpi4py``).
- ``mpich``: a venv of its own with ``pip install mpich mpi4py numpy``: its ``bin/mpirun``
  and ``bin/python``. The venv is ``$AIODIST_BENCH_MPICH``, or ``/opt/aiodist-mpi/mpich``
  when that is unset.
- ``impi``: likewise for Intel MPI (``pip install impi-rt mpi4py numpy``): ``$AIODIST_BENCH_IMPI``,
  or ``/opt/aiodist-mpi/impi``.

MPICH and Intel MPI live in venvs of their own because each ships its own ``libmpi.so.12``
(same soname, same ABI family) and mpi4py picks one per interpreter: one venv cannot hold both,
nor Open MPI's. Their rank processes run that venv's Python on ``_mpi_rank.py``, which needs
only numpy and mpi4py.

Finding a library runs its Python once (``probe``: mpi4py imported without MPI_Init, asked for
MPI_Get_library_version), so a venv whose mpi4py loads another library is refused before the
run instead of measuring the wrong one. What cannot run gives one line saying why and how to
install it (``find`` returns that line instead of a ``MpiLib``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LIBS = ("openmpi", "mpich", "impi")
TITLE = {"openmpi": "Open MPI", "mpich": "MPICH", "impi": "Intel MPI"}
#: how the library mpi4py loaded names itself (the first line of MPI_Get_library_version)
MARKER = {"openmpi": "Open MPI", "mpich": "MPICH", "impi": "Intel(R) MPI"}
#: where the MPICH and Intel MPI venvs are: the variable, else the default
VENV_VAR = {"mpich": "AIODIST_BENCH_MPICH", "impi": "AIODIST_BENCH_IMPI"}
DEFAULT_VENV = {"mpich": "/opt/aiodist-mpi/mpich", "impi": "/opt/aiodist-mpi/impi"}
PIP = {"mpich": "mpich mpi4py numpy", "impi": "impi-rt mpi4py numpy"}
OPENMPI_INSTALL = "apt-get install openmpi-bin libopenmpi-dev, then pip install mpi4py"

#: Open MPI: shared memory between the ranks (vader: Open MPI 4's single-copy shared-memory
#: transport), no binding (aiodist's and torch's ranks are not bound either; Open MPI binds
#: each rank to a core by default). ``--oversubscribe`` is added only for more ranks than cores,
#: where Open MPI refuses to start without it (it also makes Open MPI yield the core while it
#: waits: 4 B all_reduce went from 1.5 us to 2.8 ms here).
OPENMPI_FLAGS = ("--mca", "btl", "self,vader", "--bind-to", "none")
#: MPICH's hydra: no binding (hydra's default too; said, not assumed). Its ch4 device takes
#: shared memory between ranks of one host by itself, and hydra starts more ranks than cores
#: without a flag.
MPICH_FLAGS = ("-bind-to", "none")
#: Intel MPI pins each rank to a core by default: I_MPI_PIN=0 turns that off (its mpirun has no
#: flag for it); I_MPI_FABRICS=shm keeps it on shared memory (one host) without probing
#: libfabric's network providers. It too starts more ranks than cores without a flag.
IMPI_ENV = {"I_MPI_FABRICS": "shm", "I_MPI_PIN": "0"}

#: what ``probe`` runs in a library's Python: mpi4py without MPI_Init (no launcher needed)
PROBE = (
    "import numpy, mpi4py\n"
    "mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "print(mpi4py.__version__)\n"
    "print((MPI.Get_library_version().strip().splitlines() or ['unknown'])[0].strip())\n"
)
PROBE_TIMEOUT = 60.0


@dataclass(frozen=True)
class MpiLib:
    """One MPI library found, ready to start ranks with."""

    name: str  # "openmpi" | "mpich" | "impi"
    mpirun: str  # its launcher (absolute path)
    python: str  # the interpreter its ranks run (mpi4py + numpy built for it)
    venv: str | None  # its venv (MPICH, Intel MPI), None for Open MPI (this Python)
    library: str  # what mpi4py loads, as MPI_Get_library_version names it (``short_library``)
    mpi4py: str  # mpi4py's version in that interpreter

    @property
    def title(self) -> str:
        return TITLE[self.name]

    def flags(self, nproc: int) -> tuple[str, ...]:
        """The launcher's flags (before ``-np``) for ``nproc`` ranks."""
        if self.name == "openmpi":
            root = ("--allow-run-as-root",) if os.geteuid() == 0 else ()  # Open MPI refuses root without it
            return root + OPENMPI_FLAGS + (("--oversubscribe",) if nproc > (os.cpu_count() or 1) else ())
        if self.name == "mpich":
            return MPICH_FLAGS
        return ()

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The launcher's environment: ``base`` plus what this library needs."""
        return launch_env(self.name, self.venv, base)

    def command(self, nproc: int, script: str, pass_on: Sequence[str] = ()) -> list[str]:
        """``mpirun`` starting ``nproc`` ranks of ``python -I script``. ``pass_on``: variables
        the ranks must see (hydra passes the whole environment on; Open MPI's mpirun is told)."""
        cmd = [self.mpirun, *self.flags(nproc), "-np", str(nproc)]
        if self.name == "openmpi":
            for name in pass_on:
                cmd += ["-x", name]
        return [*cmd, self.python, "-I", script]

    def describe(self, nproc: int) -> str:
        """One line for the run's notes: the library, the launcher and how it was called."""
        words = [f"{k}={v}" for k, v in IMPI_ENV.items()] if self.name == "impi" else []
        words += [self.mpirun, *self.flags(nproc)]
        return f"{self.name}: mpi4py {self.mpi4py} over {self.library} ({' '.join(words)}; ranks run {self.python} -I)"


def launch_env(name: str, venv: str | None, base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    if venv is not None:  # that venv's bin first: its mpirun finds its own hydra proxies there
        bin_dir = os.path.join(venv, "bin")
        env["PATH"] = bin_dir + (os.pathsep + env["PATH"] if env.get("PATH") else "")
    if name == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if name == "impi":
        env.update(IMPI_ENV)
    return env


def short_library(line: str) -> str:
    """MPI_Get_library_version's first line without its noise: ``Open MPI v4.1.4``, ``MPICH
    5.0.2``, ``Intel(R) MPI Library 2021.18.1``."""
    text = line.split(",")[0].replace(" for Linux* OS", "")
    text = re.sub(r"\s*Version:\s*", " ", text)
    return " ".join(text.split()) or "unknown"


def install_hint(name: str, venv: str | None = None) -> str:
    if name == "openmpi":
        return OPENMPI_INSTALL
    v = venv or DEFAULT_VENV[name]
    return f"python3 -m venv {v} && {v}/bin/pip install {PIP[name]}"


def probe(python: str, env: Mapping[str, str]) -> tuple[str, str] | str:
    """(mpi4py's version, the library it loads) in ``python``; or why it could not say."""
    try:
        r = subprocess.run([python, "-I", "-c", PROBE], env=dict(env), capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"did not answer within {PROBE_TIMEOUT:g} s"
    except OSError as exc:
        return str(exc)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or len(lines) < 2:
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return last.strip()
    return lines[-2].strip(), short_library(lines[-1])


def find(name: str, environ: Mapping[str, str] | None = None, python: str | None = None) -> MpiLib | str:
    """The library ``name`` of ``LIBS``, or the one line saying why it cannot run and how to
    install it. ``environ`` (default os.environ) is where PATH and the venv variables are read;
    ``python`` (default this one) is Open MPI's interpreter."""
    environ = os.environ if environ is None else environ
    if name == "openmpi":
        return _find_openmpi(environ, python or sys.executable)
    return _find_venv(name, environ)


def _find_openmpi(environ: Mapping[str, str], python: str) -> MpiLib | str:
    mpirun = shutil.which("mpirun", path=environ.get("PATH", ""))
    if mpirun is None:
        return f"mpirun is not on PATH (install Open MPI: {OPENMPI_INSTALL})"
    try:
        out = subprocess.run([mpirun, "--version"], env=dict(environ), capture_output=True, text=True, timeout=PROBE_TIMEOUT)
        version = (out.stdout.strip().splitlines() or [""])[0].strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{mpirun} --version failed ({exc})"
    if "Open MPI" not in version and "OpenRTE" not in version:
        return (
            f"the mpirun on PATH ({mpirun}: {version or 'no version'}) is not Open MPI's; put Open MPI's first on PATH ({OPENMPI_INSTALL})"
        )
    got = probe(python, launch_env("openmpi", None, environ))
    if isinstance(got, str):
        if "mpi4py" in got and "No module" in got:
            return f"mpi4py is not installed in {python} (pip install mpi4py; it builds against the Open MPI that mpicc names)"
        return f"{python} cannot load mpi4py and numpy ({got}); pip install mpi4py numpy"
    mpi4py_version, library = got
    if MARKER["openmpi"] not in library:
        return (
            f"the mpi4py in {python} loads {library!r}, not Open MPI "
            "(rebuild it against Open MPI: pip install --force-reinstall --no-binary=mpi4py mpi4py)"
        )
    return MpiLib("openmpi", mpirun, python, None, library, mpi4py_version)


def _find_venv(name: str, environ: Mapping[str, str]) -> MpiLib | str:
    var = VENV_VAR[name]
    given = environ.get(var, "")
    venv = os.path.abspath(os.path.expanduser(given)) if given else DEFAULT_VENV[name]
    where = f"{var}={given}" if given else f"{venv} ({var} is unset; that is the default)"
    title = TITLE[name]
    if not os.path.isdir(venv):
        if given:
            return f"{var}={given}: no such folder (make the {title} venv there: {install_hint(name, venv)})"
        return f"no {title} venv at {venv} ({var} is unset; make one: {install_hint(name, venv)}; or set {var}=/path/to/venv)"
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return f"{where}: {python} is missing (not a venv; make one: {install_hint(name, venv)})"
    mpirun = os.path.join(venv, "bin", "mpirun")
    if not os.access(mpirun, os.X_OK):
        return f"{where}: no mpirun in {venv}/bin ({venv}/bin/pip install {PIP[name]})"
    got = probe(python, launch_env(name, venv, environ))
    if isinstance(got, str):
        return f"{where}: {python} cannot load mpi4py and numpy ({got}); {venv}/bin/pip install {PIP[name]}"
    mpi4py_version, library = got
    if MARKER[name] not in library:
        return f"{where}: its mpi4py loads {library!r}, not {title} ({venv}/bin/pip install {PIP[name]})"
    return MpiLib(name, mpirun, python, venv, library, mpi4py_version)


def best(times: Mapping[str, float | None]) -> tuple[str, float] | None:
    """The fastest library of a row and its time: the least of ``times`` (library -> time; None
    for one with no figure for the row); a tie goes to the first. None where none has one."""
    found = [(t, i, name) for i, (name, t) in enumerate(times.items()) if t is not None]
    if not found:
        return None
    t, _, name = min(found)
    return name, t
