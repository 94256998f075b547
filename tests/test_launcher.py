"""The launcher (python -m aiodist.run), launch_agent and the legacy aiodist.launch, with real
processes. Every launcher runs under a deadline; one that overstays gets SIGTERM (it stops its
workers), then SIGKILL. Only processes these tests start are ever signalled."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiodist.elastic.errors import ChildFailedError, ProcessFailure, read_error_file, record
from aiodist.launcher.agent import Std
from aiodist.run import config_from_args, parse_args, parse_min_max_nnodes
from aiodist.testing.ports import free_port

pytestmark = [pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "helpers" / "launched_worker.py")
AGENT_JOB = ROOT / "tests" / "helpers" / "launch_agent_job.py"  # launch_agent with launched_worker's callables
LINE = re.compile(r"^\[rank(\d+)\]: (.*)$")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _start(args: list[str], env: dict[str, str] | None = None, module: str = "aiodist.run") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(p: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the launcher stops its workers
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"launcher overstayed {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return p.returncode, out, err


def launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 30, module: str = "aiodist.run") -> tuple[int, str, str]:
    return _finish(_start(args, env, module), timeout)


def rank_lines(text: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def json_by_rank(text: str) -> dict[int, dict[str, Any]]:
    out = {}
    for r, lines in rank_lines(text).items():
        for line in lines:
            if line.startswith("{"):
                out[r] = json.loads(line)
    return out


def _reap(p: subprocess.Popen[Any], pids: list[int]) -> None:
    """Kill our launcher ``p`` if it still runs, and any of our workers ``pids`` still alive."""
    if p.poll() is None:
        p.kill()
        p.wait(5)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- single node


def test_three_workers_prefixed_output_and_env() -> None:
    rc, out, err = launch(["--standalone", "--nproc-per-node", "3", WORKER, "ok"])
    assert rc == 0, err
    res = json_by_rank(out)
    assert sorted(res) == [0, 1, 2]
    ports = set()
    for r, d in res.items():
        e = d["env"]
        assert d["sum"] == 6.0
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(r)
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("3", "3", "3")
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == ("0", "1", "default")
        assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and e["TORCHELASTIC_RUN_ID"]
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{r}/error.json")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["OMP_NUM_THREADS"] == "1"
        ports.add(e["MASTER_PORT"])
    assert len(ports) == 1 and int(ports.pop()) > 0


def test_rank1_raises_fails_fast_with_root_cause() -> None:
    start = time.monotonic()
    rc, out, err = launch(["--standalone", "--nproc-per-node", "3", WORKER, "raise1"])
    assert rc == 1
    assert time.monotonic() - start < 15
    report = err[err.index("Root Cause") :]
    assert "launched_worker.py FAILED" in err
    assert "rank      : 1 (local_rank: 1)" in report
    assert "exitcode  : 1" in report
    assert 'raise ValueError("rank one exploded")' in report and "ValueError: rank one exploded" in report
    m = re.search(r"error_file: (\S+)", report)
    assert m and read_error_file(m.group(1)) is not None


def test_no_error_file_reports_stderr_tail_and_exit_code() -> None:
    rc, out, err = launch(["--nproc-per-node", "2", WORKER, "flaky"])
    assert rc == 1
    report = err[err.index("Root Cause") :]
    assert "exitcode  : 3" in report
    assert "error_file: <N/A>" in report
    assert "(no error file; last lines of stderr)" in report and "failing the first attempt" in report


def test_max_restarts_recovers_from_a_first_attempt_failure() -> None:
    rc, out, err = launch(["--nproc_per_node", "2", "--max_restarts", "2", WORKER, "flaky"])
    assert rc == 0, err
    res = json_by_rank(out)
    assert sorted(res) == [0, 1]
    assert {d["env"]["TORCHELASTIC_RESTART_COUNT"] for d in res.values()} == {"1"}
    assert {d["env"]["TORCHELASTIC_MAX_RESTARTS"] for d in res.values()} == {"2"}
    assert all(d["sum"] == 3.0 for d in res.values())
    assert "restarting (1/2)" in err
    # the restart line names the first failure and its exit (both ranks exit 3: one of them)
    assert re.search(r"worker group failed \(round 0\): rank [01] exited with 3 \(pid: \d+\) \(1 more failed\); restarting \(1/2\)", err), (
        err
    )


def test_sigterm_to_launcher_stops_workers_no_orphans() -> None:
    p = _start(["--nproc-per-node", "2", WORKER, "sleep"])
    pids: list[int] = []
    try:
        pids = _worker_pids(p, 2)
        assert len(pids) == 2, "workers did not start"
        assert all(_alive(pid) for pid in pids)
        p.send_signal(signal.SIGTERM)
        rc, _, err = _finish(p, 15)
    finally:
        _reap(p, pids)  # never leave our own launcher or workers behind, even when the test fails
    assert rc == 128 + signal.SIGTERM
    assert "received SIGTERM" in err
    assert not [pid for pid in pids if _alive(pid)]


def test_log_dir_redirects_and_tee(tmp_path: Path) -> None:
    rc, out, err = launch(["--nproc-per-node", "2", "--log-dir", str(tmp_path), "-r", "1", "-t", "0:2", WORKER, "plain"])
    assert rc == 0, err
    assert not json_by_rank(out)  # stdout went to files only
    assert "[rank0]: err from 0" in err and "[rank1]: err from 1" in err  # rank 0 teed, rank 1 untouched
    (run_dir,) = tmp_path.iterdir()
    for r in (0, 1):
        stdout_log = run_dir / "attempt_0" / str(r) / "stdout.log"
        assert json.loads(stdout_log.read_text())["env"]["RANK"] == str(r)  # unprefixed in the file
    assert (run_dir / "attempt_0" / "0" / "stderr.log").read_text() == "err from 0\n"
    assert not (run_dir / "attempt_0" / "1" / "stderr.log").exists()


def test_local_ranks_filter_and_pet_env() -> None:
    rc, out, err = launch([WORKER, "plain"], env={"PET_NPROC_PER_NODE": "3", "PET_STANDALONE": "1", "PET_LOCAL_RANKS_FILTER": "1,2"})
    assert rc == 0, err
    res = json_by_rank(out)
    assert sorted(res) == [1, 2]
    assert res[1]["env"]["WORLD_SIZE"] == "3"


def test_module_and_no_python(tmp_path: Path) -> None:
    rc, out, err = launch(["--nproc-per-node", "1", "-m", "json.tool", "--help"])
    assert rc == 0, err
    assert any("usage" in line for line in rank_lines(out)[0])
    rc, out, err = launch(["--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "r=$RANK n=$WORLD_SIZE"'])
    assert rc == 0, err
    assert rank_lines(out) == {0: ["r=0 n=2"], 1: ["r=1 n=2"]}
    rc, out, err = launch(["--nproc-per-node", "2", "--run-path", WORKER, "legacy"])
    assert rc == 0, err
    assert sorted(json_by_rank(out)) == [0, 1]


# ---------------------------------------------------------------- several nodes


def test_two_nodes_on_localhost() -> None:
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    p1 = _start([*common, "--node-rank", "1", WORKER, "ok"])
    p0 = _start([*common, "--node-rank", "0", WORKER, "ok"])
    rc0, out0, err0 = _finish(p0, 30)
    rc1, out1, err1 = _finish(p1, 30)
    assert (rc0, rc1) == (0, 0), err0 + err1
    res0, res1 = json_by_rank(out0), json_by_rank(out1)
    assert sorted(res0) == [0, 1] and sorted(res1) == [2, 3]
    for r, d in {**res0, **res1}.items():
        e = d["env"]
        assert d["sum"] == 10.0
        assert e["WORLD_SIZE"] == "4" and e["GROUP_WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == str(r // 2) and e["LOCAL_RANK"] == str(r % 2)
    assert len({d["env"]["MASTER_PORT"] for d in [*res0.values(), *res1.values()]}) == 1


def test_missing_node_fails_rendezvous_naming_arrivals() -> None:
    port = free_port()
    start = time.monotonic()
    rc, out, err = launch(
        ["--nnodes", "2", "--node-rank", "0", "--master-port", str(port), "--rdzv-conf", "join_timeout=1", WORKER, "ok"], timeout=20
    )
    assert rc == 1
    assert time.monotonic() - start < 10
    assert "1 of 2 nodes arrived" in err and "missing node ranks: [1]" in err
    assert not rank_lines(out)


def test_c10d_min_max_proceeds_with_min_nodes() -> None:
    port = free_port()
    args = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "j1"]
    rc, out, err = launch([*args, "--rdzv-conf", "last_call_timeout=0.3", "--nproc-per-node", "2", WORKER, "ok"])
    assert rc == 0, err
    res = json_by_rank(out)
    assert sorted(res) == [0, 1] and res[0]["env"]["GROUP_WORLD_SIZE"] == "1"


# ---------------------------------------------------------------- launch_agent and legacy launch


def test_launch_agent_with_python_callables() -> None:
    p = subprocess.Popen([sys.executable, str(AGENT_JOB)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, err = _finish(p, 40)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["sync"] == {"0": 0, "1": 10, "2": 20}
    assert res["async"] == {"0": 3.0, "1": 3.0, "2": 3.0}
    assert res["failed"] == [1, "RuntimeError: callable failed on rank 1"]


@pytest.mark.parametrize("use_env", [False, True])
def test_legacy_launch(use_env: bool) -> None:
    args = ["--nproc-per-node", "2", *(["--use-env"] if use_env else []), WORKER, "legacy", "extra"]
    rc, out, err = launch(args, module="aiodist.launch")
    assert rc == 0, err
    assert "aiodist.launch is deprecated" in err and "aiodist-run" in err
    res = json_by_rank(out)
    for r in (0, 1):
        assert res[r]["LOCAL_RANK"] == str(r)
        assert res[r]["arg"] == (None if use_env else r)
        assert res[r]["rest"] == ["extra"]


# ---------------------------------------------------------------- pieces, in process


def test_flag_parsing() -> None:
    assert parse_min_max_nnodes("3") == (3, 3) and parse_min_max_nnodes("1:4") == (1, 4)
    with pytest.raises(ValueError):
        parse_min_max_nnodes("a:b")
    assert Std.parse("3", 2) == {0: 3, 1: 3}
    assert Std.parse("0:1,2:3", 3) == {0: 1, 1: 0, 2: 3}
    with pytest.raises(ValueError):
        Std.parse("4", 1)
    with pytest.raises(ValueError, match="--no-python"):
        config_from_args(parse_args(["-m", "--no-python", "x"]))
    config, entry, args = config_from_args(parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "train.py", "--lr", "1"]))
    assert (config.rdzv_endpoint, config.rdzv_configs["rank"], entry) == ("h:29500", 1, sys.executable)
    assert args == ["-u", "train.py", "--lr", "1"]


def test_record_writes_error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def boom() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        boom()
    data = read_error_file(str(path))
    assert data is not None and data["message"]["message"] == "KeyError: 'k'"
    f = ProcessFailure(local_rank=0, rank=0, pid=1, exitcode=1, error_file=str(path))
    assert "raise KeyError" in f.traceback
    err = ChildFailedError("job", {0: f})
    assert "Root Cause" in str(err) and "KeyError" in str(err)


async def test_record_async(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    async def boom() -> int:
        raise ValueError("async boom")

    with pytest.raises(ValueError):
        await boom()
    data = read_error_file(str(path))
    assert data is not None and "async boom" in data["message"]["extraInfo"]["py_callstack"]


def test_sigkilled_launcher_leaves_no_workers() -> None:
    p = _start(["--nproc-per-node", "2", WORKER, "sleep"])
    pids: list[int] = []
    try:
        pids = _worker_pids(p, 2)
        assert len(pids) == 2, "workers did not start"
        p.kill()
        p.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        _reap(p, pids)


def test_failure_on_one_node_stops_both() -> None:
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port)]
    p1 = _start([*common, "--node-rank", "1", WORKER, "raise1"])
    p0 = _start([*common, "--node-rank", "0", WORKER, "raise1"])
    rc0, out0, err0 = _finish(p0, 30)
    rc1, out1, err1 = _finish(p1, 30)
    assert (rc0, rc1) == (1, 1), err0 + err1
    for err in (err0, err1):  # both nodes name the job's first failure: rank 1, on node 1
        report = err[err.index("Root Cause") :]
        assert "rank      : 1 (local_rank: 0)" in report and "ValueError: rank one exploded" in report


def test_c10d_two_agents_and_a_restart_across_nodes() -> None:
    """Two agents on one host meet through c10d (the first to bind the endpoint hosts it);
    the first attempt fails on both nodes and both restart into round 1 together."""
    port = free_port()
    args = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "j2", "--max-restarts", "1"]
    pa = _start([*args, "--nproc-per-node", "1", WORKER, "flaky"])
    pb = _start([*args, "--nproc-per-node", "2", WORKER, "flaky"])
    rca, outa, erra = _finish(pa, 40)
    rcb, outb, errb = _finish(pb, 40)
    assert (rca, rcb) == (0, 0), erra + errb
    res = {**json_by_rank(outa), **json_by_rank(outb)}
    assert sorted(res) == [0, 1, 2]
    assert {d["env"]["TORCHELASTIC_RESTART_COUNT"] for d in res.values()} == {"1"}
    assert {d["env"]["WORLD_SIZE"] for d in res.values()} == {"3"} and all(d["sum"] == 6.0 for d in res.values())
    local_sizes = sorted(len(json_by_rank(o)) for o in (outa, outb))
    assert local_sizes == [1, 2]


def _worker_pids(p: subprocess.Popen[str], n: int) -> list[int]:
    assert p.stdout is not None
    pids: list[int] = []
    deadline = time.monotonic() + 20
    while len(pids) < n and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        m = LINE.match(line.rstrip("\n"))
        if m:
            pids.append(json.loads(m.group(2))["pid"])
    return pids


def test_sigint_is_forwarded_and_exit_status_is_130() -> None:
    p = _start(["--nproc-per-node", "2", WORKER, "sleep"])
    pids = _worker_pids(p, 2)
    try:
        assert len(pids) == 2
        p.send_signal(signal.SIGINT)
        rc, _, err = _finish(p, 15)
        assert rc == 130
        assert "KeyboardInterrupt" in err  # the workers got SIGINT, not only SIGKILL
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        _reap(p, pids)


def test_dead_rendezvous_host_ends_the_other_node() -> None:
    port = free_port()
    common = ["--nnodes", "2", "--master-port", str(port), "--rdzv-conf", "heartbeat_timeout=1.5"]
    p1 = _start([*common, "--node-rank", "1", WORKER, "sleep"])
    p0 = _start([*common, "--node-rank", "0", WORKER, "sleep"])
    pids: list[int] = []
    try:
        pids = _worker_pids(p0, 1) + _worker_pids(p1, 1)
        assert len(pids) == 2
        p0.kill()  # the host of the rendezvous store dies without a word
        p0.communicate(timeout=10)
        start = time.monotonic()
        rc, _, err = _finish(p1, 20)
        assert rc == 1 and time.monotonic() - start < 10
        assert "TCPStore" in err or "rendezvous" in err
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        for q in (p0, p1):
            if q.poll() is None:
                q.kill()
                q.wait(5)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_long_lines_reach_a_slow_console_whole() -> None:
    """A console that reads slowly (a pipe to a busy reader) loses nothing: Python's buffered
    writer once dropped whole 64 KiB pieces here (the launcher now loops on os.write)."""
    code = 'print("x" * 200000); print("end")'
    p = subprocess.Popen(
        [sys.executable, "-m", "aiodist.run", "--nproc-per-node", "2", "--no-python", sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    data = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            chunk = p.stdout.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            data += chunk
            time.sleep(0.001)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    by_rank = rank_lines(data.decode())
    assert sorted(by_rank) == [0, 1]
    for lines in by_rank.values():
        assert lines[-1] == "end"
        assert sum(len(line) for line in lines[:-1]) == 200000


def test_long_lines_pass_whole_and_in_pieces() -> None:
    code = 'print("x" * 200000); print("end")'
    rc, out, err = launch(["--nproc-per-node", "2", "--no-python", sys.executable, "-c", code])
    assert rc == 0, err
    for lines in rank_lines(out).values():
        assert lines[-1] == "end" and "" not in lines
        assert sum(len(line) for line in lines[:-1]) == 200000


def test_standalone_says_it_ignores_master_port() -> None:
    rc, out, err = launch(["--standalone", "--master-port", "29999", "--nproc-per-node", "1", WORKER, "plain"])
    assert rc == 0, err
    assert "--standalone ignores --master-port 29999: the rendezvous store takes a free port of its own" in err, err
