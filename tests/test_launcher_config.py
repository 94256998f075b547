"""The launcher's one configuration type: torchrun argv (and PET_* variables) -> LaunchConfig,
bad values refused naming the flag, every field reachable from the command line or API-only,
and the worker spec made from the config. Pure: no processes, no loop."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from aiodist.launch import parse_args as legacy_parse_args
from aiodist.launcher._bootstrap import run_script_path
from aiodist.launcher._config import LAUNCH_FLAGS, LaunchConfig, _cpu_count, cli_flags
from aiodist.launcher.api import _worker_spec
from aiodist.run import config_from_args, get_args_parser, main, parse_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["train.py", "--lr", "1"]


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # no warning from nproc > 1


def _config(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> LaunchConfig:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config, _, _ = config_from_args(parse_args([*argv, *SCRIPT]))
    return config


DEFAULTS = {
    "min_nodes": 1,
    "max_nodes": 1,
    "nproc_per_node": 1,
    "run_id": "none",
    "role": "default",
    "rdzv_backend": "static",
    "rdzv_endpoint": "127.0.0.1:0",
    "rdzv_configs": {"rank": 0},
    "max_restarts": 0,
    "monitor_interval": 0.1,
    "start_method": "spawn",
    "local_addr": None,
    "log_dir": None,
    "redirects": "0",
    "tee": "0",
    "local_ranks_filter": None,
    "stop_timeout": 5.0,
    "keep_survivors": False,
}

# (argv, environment, the fields that differ from DEFAULTS)
TABLE: list[tuple[list[str], dict[str, str], dict[str, Any]]] = [
    ([], {}, {}),
    (["--nproc-per-node", "4"], {}, {"nproc_per_node": 4}),
    (["--nproc_per_node", "3"], {}, {"nproc_per_node": 3}),
    (["--nproc-per-node", "auto"], {}, {"nproc_per_node": _cpu_count()}),
    (["--nproc-per-node=cpu"], {}, {"nproc_per_node": _cpu_count()}),
    ([], {"PET_NPROC_PER_NODE": "5"}, {"nproc_per_node": 5}),
    (["--nproc-per-node", "2"], {"PET_NPROC_PER_NODE": "5"}, {"nproc_per_node": 2}),  # the command line wins
    (
        ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "job7"],
        {},
        {"max_nodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": "h:29400", "run_id": "job7", "rdzv_configs": {}},
    ),
    (
        ["--nnodes", "3", "--node_rank", "2", "--master_addr", "h", "--master_port", "1234"],
        {},
        {"min_nodes": 3, "max_nodes": 3, "rdzv_endpoint": "h:1234", "rdzv_configs": {"rank": 2}},
    ),
    (["--nnodes", "2"], {}, {"min_nodes": 2, "max_nodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}),
    (["--master-addr", "fd00::1", "--master-port", "5"], {}, {"rdzv_endpoint": "[fd00::1]:5"}),
    (
        [],
        {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "h"},
        {"min_nodes": 2, "max_nodes": 2, "rdzv_endpoint": "h:29500", "rdzv_configs": {"rank": 1}},
    ),
    (["--rdzv_backend=c10d"], {}, {"rdzv_backend": "c10d", "rdzv_configs": {}}),
    (["--keep-survivors"], {}, {"keep_survivors": True}),
    ([], {"PET_KEEP_SURVIVORS": "1"}, {"keep_survivors": True}),
    (
        ["--rdzv-conf", "join_timeout=5, last_call_timeout=1", "--rdzv-endpoint", "h:7"],
        {},
        {"rdzv_configs": {"rank": 0, "join_timeout": "5", "last_call_timeout": "1"}, "rdzv_endpoint": "h:7"},
    ),
    (["-r", "3", "-t", "0:1,1:2", "--log_dir", "d"], {}, {"redirects": "3", "tee": "0:1,1:2", "log_dir": "d"}),
    (["--redirects=1", "--tee", "2"], {}, {"redirects": "1", "tee": "2"}),
    (["--local-ranks-filter", "0,2"], {}, {"local_ranks_filter": {0, 2}}),
    (
        ["--max_restarts", "2", "--monitor-interval", "0.5", "--role", "trainer", "--start_method", "fork", "--local-addr", "10.0.0.2"],
        {},
        {"max_restarts": 2, "monitor_interval": 0.5, "role": "trainer", "start_method": "fork", "local_addr": "10.0.0.2"},
    ),
    ([], {"PET_MAX_RESTARTS": "4", "PET_ROLE": "r"}, {"max_restarts": 4, "role": "r"}),
    (["--shutdown-timeout", "1.5"], {}, {"stop_timeout": 1.5}),
    (["--logs-specs", "x"], {}, {}),  # accepted, ignored
]

# --standalone: c10d on a free local port, one node, a fresh run id, whatever else was said.
STANDALONE = [
    (["--standalone"], {}),
    (["--standalone", "--nnodes", "4", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"], {}),
    ([], {"PET_STANDALONE": "1"}),
    ([], {"PET_STANDALONE": "true"}),
]


@pytest.mark.parametrize(("argv", "env", "changed"), TABLE, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_argv_to_config(argv: list[str], env: dict[str, str], changed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(argv, env, monkeypatch)
    got = {name: getattr(config, name) for name in DEFAULTS}
    assert got == {**DEFAULTS, **changed}


@pytest.mark.parametrize(("argv", "env"), STANDALONE)
def test_standalone(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(argv, env, monkeypatch)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.min_nodes, config.max_nodes) == ("c10d", "127.0.0.1:0", 1, 1)
    assert config.run_id not in ("none", "x") and len(config.run_id) == 36  # a fresh uuid
    assert config.rdzv_configs == {}


def test_standalone_switch_off_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config([], {"PET_STANDALONE": "0"}, monkeypatch).rdzv_backend == "static"


# (argv, environment, what the refusal must say: the flag's name and why)
BAD: list[tuple[list[str], dict[str, str], tuple[str, ...]]] = [
    (["--nproc-per-node", "0"], {}, ("--nproc-per-node", ">= 1")),
    (["--nproc-per-node", "gpu"], {}, ("--nproc-per-node", "count GPUs")),
    (["--nproc_per_node", "many"], {}, ("--nproc-per-node", "'many'")),
    ([], {"PET_NPROC_PER_NODE": "zero"}, ("--nproc-per-node", "PET_NPROC_PER_NODE")),
    (["--nnodes", "1:x"], {}, ("--nnodes", "MIN:MAX")),
    (["--nnodes", "2:1"], {}, ("--nnodes", "MIN <= MAX")),
    (["--nnodes", "0"], {}, ("--nnodes", "MIN:MAX")),
    (["--max-restarts", "-1"], {}, ("--max-restarts", ">= 0")),
    (["--max-restarts", "x"], {}, ("--max-restarts", "not an integer")),
    (["--monitor-interval", "fast"], {}, ("--monitor-interval", "seconds")),
    (["--shutdown-timeout", "-1"], {}, ("--shutdown-timeout", ">= 0")),
    (["--shutdown-timeout", "inf"], {}, ("--shutdown-timeout", "finite")),
    (["--shutdown-timeout", "nan"], {}, ("--shutdown-timeout", "finite")),
    (["--monitor-interval", "inf"], {}, ("--monitor-interval", "finite")),
    (["--rdzv-backend", "etcd"], {}, ("--rdzv-backend", "invalid choice", "c10d")),
    ([], {"PET_RDZV_BACKEND": "etcd"}, ("--rdzv-backend", "PET_RDZV_BACKEND")),
    (["--start-method", "thread"], {}, ("--start-method", "invalid choice")),
    (["--rdzv-conf", "join_timeout"], {}, ("--rdzv-conf", "key=value")),
    (["-r", "4"], {}, ("--redirects", "0 none")),
    (["--tee", "0:x"], {}, ("--tee", "per local rank")),
    (["--local-ranks-filter", "a"], {}, ("--local-ranks-filter", "local ranks")),
    (["--node-rank", "-1"], {}, ("--node-rank", ">= 0")),
    (["--master-port", "p"], {}, ("--master-port", "not an integer")),
]


@pytest.mark.parametrize(("argv", "env", "words"), BAD, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_value_refused_naming_the_flag(
    argv: list[str], env: dict[str, str], words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        main([*argv, *SCRIPT])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-m", "--no-python"], ("--no-python", "--module")),
        (["--nnodes", "2", "--rdzv-backend", "c10d"], ("--rdzv-endpoint",)),
    ],
)
def test_bad_combination_refused(argv: list[str], words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiodist-run: error:") and all(w in err for w in words), err


@pytest.mark.parametrize(
    ("argv", "entry", "args"),
    [
        ([], sys.executable, ["-u", *SCRIPT]),
        (["-m"], sys.executable, ["-u", "-m", *SCRIPT]),
        (["--module"], sys.executable, ["-u", "-m", *SCRIPT]),
        (["--no-python"], "train.py", SCRIPT[1:]),
        (["--no_python"], "train.py", SCRIPT[1:]),
        (["--run-path"], run_script_path, SCRIPT),
    ],
)
def test_program_flags(argv: list[str], entry: Any, args: list[str]) -> None:
    _, got_entry, got_args = config_from_args(parse_args([*argv, *SCRIPT]))
    assert (got_entry, got_args) == (entry, args)


def test_legacy_use_env(monkeypatch: pytest.MonkeyPatch) -> None:
    def cmd(*argv: str) -> list[str]:
        return config_from_args(legacy_parse_args([*argv, *SCRIPT]))[2]

    assert cmd() == ["-u", "train.py", "--local-rank=${local_rank}", "--lr", "1"]
    assert cmd("--use-env") == cmd("--use_env") == ["-u", *SCRIPT]
    monkeypatch.setenv("PET_USE_ENV", "1")
    assert cmd() == ["-u", *SCRIPT]


# ---------------------------------------------------------------- every field, one way or another


def test_every_field_is_reachable_from_the_cli_or_api_only() -> None:
    parser_options = {s for a in get_args_parser()._actions for s in a.option_strings}
    docs = (ROOT / "docs" / "launcher.md").read_text()
    for f in dataclasses.fields(LaunchConfig):
        has_cli, why = "cli" in f.metadata, f.metadata.get("api_only")
        assert has_cli != bool(why), f"{f.name}: give it a flag (cli) or say why it has none (api_only)"
        if has_cli:
            assert set(f.metadata["cli"].option_strings) <= parser_options, f.name
        else:
            assert f"`{f.name}`" in docs.split("API only")[1].split("\n\n")[0], f"{f.name} is not in docs/launcher.md's API-only list"
    # Each flag's field changes in some row of the table: the table covers every flag.
    covered = {name for _, _, changed in TABLE for name in changed}
    assert {name for name, _ in cli_flags()} <= covered


# torchrun's flags (torch 2.13, torch.distributed.run.get_args_parser), as option strings.
TORCHRUN_FLAGS = (
    "--nnodes --nproc-per-node --nproc_per_node --rdzv-backend --rdzv_backend --rdzv-endpoint --rdzv_endpoint "
    "--rdzv-id --rdzv_id --rdzv-conf --rdzv_conf --standalone --max-restarts --max_restarts --monitor-interval "
    "--monitor_interval --start-method --start_method --event-log-handler --event_log_handler --role -m --module "
    "--no-python --no_python --run-path --run_path --log-dir --log_dir -r --redirects -t --tee --local-ranks-filter "
    "--local_ranks_filter --duplicate-stdout-filters --duplicate_stdout_filters --duplicate-stderr-filters "
    "--duplicate_stderr_filters --node-rank --node_rank --master-addr --master_addr --master-port --master_port "
    "--local-addr --local_addr --logs-specs --logs_specs --numa-binding --numa_binding --signals-to-handle "
    "--signals_to_handle --shutdown-timeout --shutdown_timeout --virtual-local-rank --virtual_local_rank"
).split()
NOT_TAKEN = (
    "event-log-handler",
    "duplicate-stdout-filters",
    "duplicate-stderr-filters",
    "numa-binding",
    "signals-to-handle",
    "virtual-local-rank",
)


def test_torchrun_flags_are_taken_or_documented_as_not() -> None:
    ours = {s for a in get_args_parser()._actions for s in a.option_strings}
    missing = {s.lstrip("-").replace("_", "-") for s in TORCHRUN_FLAGS if s not in ours}
    assert missing == set(NOT_TAKEN)
    docs = (ROOT / "docs" / "launcher.md").read_text()
    assert all(f"`--{name}`" in docs for name in NOT_TAKEN)
    assert not ({f"--{f.name}" for f in LAUNCH_FLAGS} & {f"--{f.name}" for _, f in cli_flags()})


# ---------------------------------------------------------------- config -> worker spec


def test_worker_spec_holds_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_ADVERTISE_ADDR", raising=False)
    config = _config(["--nproc-per-node", "3", "-r", "0:1,2:3", "--tee", "2", "--local-addr", "10.0.0.2"], {}, monkeypatch)
    spec = _worker_spec(config, "prog", ["a", 1])
    assert spec.config is config  # nothing copied: the agent reads the config itself
    assert (spec.name, spec.cmd, spec.fn) == ("prog", ["prog", "a", "1"], None)
    assert spec.redirects == {0: 1, 1: 0, 2: 3} and spec.tee == {0: 2, 1: 2, 2: 2}
    assert spec.extra_env == {"AIODIST_ADVERTISE_ADDR": "10.0.0.2"}
    spec = _worker_spec(config, run_script_path, ["x.py"])
    assert (spec.fn, spec.fn_args, spec.cmd, spec.name) == (run_script_path, ("x.py",), None, "run_script_path")
    with pytest.raises(TypeError, match="entrypoint"):
        _worker_spec(config, None, [])
    with pytest.raises(ValueError):
        _worker_spec(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, redirects=7), "prog", [])


def test_api_defaults_are_torchs() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1)
    assert (config.max_restarts, config.role, config.run_id, config.monitor_interval, config.rdzv_timeout) == (
        3,
        "default_role",
        "",
        0.1,
        -1,
    )
