"""Run a script as an N-process job under torchrun's environment, without a launcher.

    result = run_env_job("examples/p2p_ring.py", nprocs=4, args=["--rounds", "2"], timeout=60)
    assert result.ok, result.report()
    result.out(0)  # rank 0's stdout

Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0,
MASTER_ADDR=127.0.0.1 and MASTER_PORT (``aiodist.testing.ports.free_port()``),
OMP_NUM_THREADS=1, and PYTHONPATH pointing at the checkout; no TORCHELASTIC_USE_AGENT_STORE, so under env:// rank 0 hosts the job's store
(aiodist.rendezvous.create_c10d_store). Output goes to files (no pipe can fill up and block a
rank). The job is bounded: past ``timeout`` seconds, or ``grace`` seconds after the first rank
failed, the processes still running are killed (by their own pid, each in its own session, with
their children) and marked ``timed_out``/``killed``. Only the processes started here are touched.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aiodist.testing.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass
class JobResult:
    cmd: list[str]
    returncodes: list[int | None]
    stdouts: list[str]
    stderrs: list[str]
    elapsed: float
    timed_out: bool = False
    killed: list[int] = field(default_factory=list)  # ranks killed by the harness

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def out(self, rank: int = 0) -> str:
        return self.stdouts[rank]

    def report(self) -> str:
        lines = [
            f"job {' '.join(self.cmd)}: {self.elapsed:.1f} s, exit codes {self.returncodes}" + (" (timed out)" if self.timed_out else "")
        ]
        if self.killed:
            lines.append(f"killed by the harness: ranks {self.killed}")
        for r, (o, e) in enumerate(zip(self.stdouts, self.stderrs)):
            lines.append(f"--- rank {r} stdout ---\n{o.rstrip()}\n--- rank {r} stderr ---\n{e.rstrip()}")
        return "\n".join(lines)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process's own session (it was started with start_new_session=True, so its
    process group id is its pid): the rank and anything it started, nothing else."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_env_job(
    script: str | os.PathLike[str],
    nprocs: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 60.0,
    grace: float = 10.0,
    env: Mapping[str, str] | None = None,
    python_args: Sequence[str] = (),
) -> JobResult:
    """Start ``nprocs`` copies of ``python [python_args] script args`` as ranks 0..nprocs-1 and
    wait for all of them (see the module docstring)."""
    script = str(pathlib.Path(script) if pathlib.Path(script).is_absolute() else ROOT / script)
    cmd = [sys.executable, *python_args, script, *args]
    port = free_port()
    base = dict(os.environ)
    for k in [k for k in base if k.startswith(("TORCHELASTIC_", "PET_", "SLURM_", "OMPI_", "PMI_"))]:
        del base[k]  # this job's environment is the one set here, whatever the test runner inherited
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])]),
    )
    base.update(env or {})
    with tempfile.TemporaryDirectory(prefix="env_job_") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        files = []
        t0 = time.monotonic()
        try:
            for rank in range(nprocs):
                out = open(pathlib.Path(tmp, f"{rank}.out"), "wb")  # closed in the finally below
                err = open(pathlib.Path(tmp, f"{rank}.err"), "wb")
                files += [out, err]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
            deadline = t0 + timeout
            timed_out = False
            killed: list[int] = []
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if any(p.returncode not in (None, 0) for p in procs):
                    deadline = min(deadline, now + grace)  # a rank failed: the others get `grace` to notice
                if now >= deadline:
                    timed_out = not any(p.returncode not in (None, 0) for p in procs)
                    for rank, p in enumerate(procs):
                        if p.poll() is None:
                            killed.append(rank)
                            _kill(p)
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                _kill(p)
            for f in files:
                f.close()
        elapsed = time.monotonic() - t0

        def read(rank: int, ext: str) -> str:
            return pathlib.Path(tmp, f"{rank}.{ext}").read_text(errors="replace")

        return JobResult(
            cmd=cmd,
            returncodes=[p.returncode for p in procs],
            stdouts=[read(r, "out") for r in range(nprocs)],
            stderrs=[read(r, "err") for r in range(nprocs)],
            elapsed=elapsed,
            timed_out=timed_out,
            killed=killed,
        )
