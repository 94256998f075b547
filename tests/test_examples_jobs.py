"""The examples/ jobs as real multi-process runs under torchrun's environment (tests/helpers/env_job.py
starts the ranks itself, rank 0 hosting the store), with small sizes and hard timeouts; and the
training example through the launcher, ``python -m aiodist.run``, once it exists."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
from types import ModuleType

import numpy as np
import pytest
from helpers.env_job import ROOT, JobResult, run_env_job
from helpers.survive import check_survived

from aiodist.testing import run_world

pytestmark = pytest.mark.timeout(120)

TRAIN = "examples/train_data_parallel.py"
EPOCH = re.compile(r"^epoch +(\d+) +loss ([\d.]+) +acc ([\d.]+) +test loss ([\d.]+) +test acc ([\d.]+) +([\d.]+) steps/s$", re.M)


def ok(result: JobResult) -> JobResult:
    assert result.ok, result.report()
    assert result.out(0).rstrip().endswith("OK"), result.report()
    return result


def epochs(out: str) -> list[tuple[float, float, float]]:
    """(train loss, train accuracy, test accuracy) per epoch, from rank 0's output."""
    return [(float(m[2]), float(m[3]), float(m[5])) for m in EPOCH.finditer(out)]


# ---------------------------------------------------------------- training


@pytest.mark.subprocess
def test_train_data_parallel_4_ranks_learns_and_ends_identical() -> None:
    r = ok(run_env_job(TRAIN, 4, ["--epochs", "6", "--samples", "2400"], timeout=90))
    out = r.out(0)
    rows = epochs(out)
    assert len(rows) == 6, out
    losses = [loss for loss, _, _ in rows]
    assert losses[-1] < 0.5 * losses[0], out
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 4, out  # going down, nearly every epoch
    assert rows[-1][2] >= 0.9, out
    assert "4 ranks, 600 samples each (2400 in all)" in out
    assert "parameters identical on all 4 ranks (sha256 " in out
    assert re.search(r"\d+ steps in [\d.]+ s \([\d.]+ steps/s\)", out), out
    assert re.search(r"in 2 gradient buckets: b1\+W1 \(780 B\), b0\+W0 \(768 B\)", out), out
    assert all(o == "" for o in r.stdouts[1:]), "only rank 0 prints"


@pytest.mark.subprocess
def test_train_data_parallel_is_deterministic_with_a_seed() -> None:
    def run(seed: int) -> tuple[list[tuple[float, float, float]], str]:
        out = ok(run_env_job(TRAIN, 2, ["--epochs", "3", "--samples", "1200", "--seed", str(seed), "--min-accuracy", "0"], timeout=60)).out(
            0
        )
        sha = re.search(r"sha256 ([0-9a-f]{64})", out)
        assert sha, out
        return epochs(out), sha[1]

    a, b, c = run(3), run(3), run(4)
    assert a == b and len(a[0]) == 3
    assert c[1] != a[1]


@pytest.mark.subprocess
def test_train_data_parallel_below_the_accuracy_bar_fails_every_rank() -> None:
    r = run_env_job(TRAIN, 2, ["--epochs", "1", "--samples", "600", "--min-accuracy", "0.9999"], timeout=60)
    assert r.returncodes == [1, 1] and not r.timed_out, r.report()
    assert "FAILED: test accuracy" in r.out(0) and "OK" not in r.out(0).split()


@pytest.mark.subprocess
def test_train_data_parallel_more_buckets_and_layers() -> None:
    r = ok(
        run_env_job(
            TRAIN,
            3,
            ["--epochs", "4", "--samples", "1500", "--hidden", "32,32", "--bucket-bytes", "100", "--min-accuracy", "0.5"],
            timeout=60,
        )
    )
    assert "MLP 2-32-32-3" in r.out(0) and "in 5 gradient buckets: b2+W2 (396 B), b1 (128 B), W1 (4096 B), b0 (128 B), W0 (256 B)" in r.out(
        0
    ), r.out(0)


# ---------------------------------------------------------------- the short examples


@pytest.mark.subprocess
@pytest.mark.parametrize("n", [2, 4])
def test_p2p_ring(n: int) -> None:
    out = ok(run_env_job("examples/p2p_ring.py", n, ["--size", "999"], timeout=60)).out(0)
    assert f"ring all-reduce of 999 float64 over {n} ranks: matches" in out
    arrival = re.search(r"reports arrived from ranks \[([\d, ]*)\]", out)
    assert arrival and sorted(int(v) for v in arrival[1].split(",")) == list(range(1, n)), out
    assert f"rank 0: cells 0..3, ghosts {4 * n - 1} and 4" in out, out


@pytest.mark.subprocess
def test_object_collectives() -> None:
    out = ok(run_env_job("examples/object_collectives.py", 3, timeout=60)).out(0)
    for step in ("broadcast_object_list", "all_gather_object", "scatter_object_list", "recv_object_list (any source)", "gather_object"):
        assert step in out, out
    assert "(rank, total word length) = [(0, 4), (1, 11), (2, 24)]" in out


@pytest.mark.subprocess
def test_device_mesh_2x2() -> None:
    r = ok(run_env_job("examples/device_mesh_2x2.py", 4, timeout=60))
    assert "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))" in r.out(0)
    assert "rank 0: coordinate (dp=0, tp=0); tp group [0, 1] sums ranks to 1, dp group [0, 2] to 2" in r.out(0)
    assert "rank 3: coordinate (dp=1, tp=1); tp group [2, 3] sums ranks to 5, dp group [1, 3] to 4" in r.stdouts[3]


@pytest.mark.subprocess
def test_device_mesh_2x2_refuses_another_world_size() -> None:
    r = run_env_job("examples/device_mesh_2x2.py", 2, timeout=60)
    assert r.returncodes == [2, 2] and not r.timed_out, r.report()
    assert "needs 4 ranks (a 2x2 mesh), got 2" in r.stderrs[0]


@pytest.mark.subprocess
def test_rpc_service() -> None:
    """200 requests after the service idled for longer than its group's timeout (1.5 s against 1 s:
    the other ranks wait for rank 0's next request under idle_until_leader)."""
    args = ["--requests", "200", "--serve", "1.5", "--timeout", "1"]
    out = ok(run_env_job("examples/rpc_service.py", 4, args, timeout=60)).out(0)
    answers = re.findall(r"POST /sum_squares n=(\d+): (\d+) \(right;", out)
    assert len(answers) == 200, out
    assert all(int(s) == (int(n) - 1) * int(n) * (2 * int(n) - 1) // 6 for n, s in answers)
    assert "POST /sum_squares with a bad body: HTTP 400" in out
    assert len(re.findall(r"/stats: \{'rank': \d, 'served': 200\}", out)) == 4, out


# ---------------------------------------------------------------- the harness itself


@pytest.mark.subprocess
def test_harness_kills_the_rest_when_a_rank_fails(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "one_fails.py")
    with open(script, "w") as f:
        f.write("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(3)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    r = run_env_job(script, 2, timeout=30, grace=0.5)
    assert time.monotonic() - t0 < 10
    assert r.returncodes[0] == 3 and r.returncodes[1] == -9 and r.killed == [1] and not r.timed_out


@pytest.mark.subprocess
def test_train_survive_rank_loss_without_a_launcher() -> None:
    """examples/train_survive_rank_loss.py, 4 processes on env:// (rank 0 serves the store): rank 2
    SIGKILLs itself at step 15; the other three shrink the default group, rebuild DDP and end the
    40 steps with identical parameters, exit 0, within 10 s of the kill."""
    r = run_env_job("examples/train_survive_rank_loss.py", 4, ["--kill-rank", "2"], timeout=60, grace=30)
    assert r.returncodes == [0, 0, -9, 0], r.report()
    check_survived("".join(r.stdouts), victim=2, size=4)


# ---------------------------------------------------------------- through the launcher


@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("aiodist.run") is None, reason="the launcher (aiodist/run.py) is not there yet")
def test_train_data_parallel_under_the_launcher() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", "2", TRAIN, "--epochs", "4", "--samples", "1200"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"OK\s*$", r.stdout), r.stdout + r.stderr
    assert "parameters identical on all 2 ranks" in r.stdout
    assert "[rank0]: " in r.stdout and "[rank1]" not in r.stdout, r.stdout  # the launcher's line prefix; only rank 0 prints
    assert len(EPOCH.findall(re.sub(r"^\[rank\d+\]: ?", "", r.stdout, flags=re.M))) == 4, r.stdout


# ---------------------------------------------------------------- the torch DDP example

TORCH_DDP = "examples/train_torch_ddp.py"


def launch(script: str, nprocs: int, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m aiodist.run --standalone --nproc-per-node N script args``, as docs/examples.md
    starts it, bounded by ``timeout``; rank 0's lines with the launcher's prefix removed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run(
        [sys.executable, "-m", "aiodist.run", "--standalone", "--nproc-per-node", str(nprocs), script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank0]: " in r.stdout and "[rank1]" not in r.stdout, r.stdout  # only rank 0 prints
    r.stdout = re.sub(r"^\[rank\d+\]: ?", "", r.stdout, flags=re.M)
    assert r.stdout.rstrip().endswith("OK"), r.stdout + r.stderr
    return r


@pytest.mark.subprocess
@pytest.mark.torch
@pytest.mark.timeout(60)
def test_train_torch_ddp_2_ranks_under_the_launcher() -> None:
    pytest.importorskip("torch")
    out = launch(TORCH_DDP, 2, ["--epochs", "3"], timeout=45).stdout
    assert "2 ranks, 2048 samples each, batch 32 per rank (global 64), 64 steps/epoch; MLP 8-64-64-4, 4996 parameters" in out, out
    assert "in 1 gradient bucket (19984 B); comm hook none" in out, out  # torch's 1 MiB first bucket holds it all
    rows = epochs(out)
    assert len(rows) == 3 and rows[-1][0] < 0.5 * rows[0][0] and rows[-1][2] >= 0.9, out
    assert "parameters identical on all 2 ranks (sha256 " in out, out


@pytest.mark.subprocess
@pytest.mark.torch
@pytest.mark.timeout(60)
def test_train_torch_ddp_accumulating_under_no_sync_trains_like_the_whole_batch() -> None:
    """--accumulate 2: two micro-batches of 16, the first under no_sync(), make the same steps
    as batches of 32 (the same samples, in the same order), up to rounding."""
    pytest.importorskip("torch")
    args = ["--epochs", "2", "--min-accuracy", "0.5"]
    whole = ok(run_env_job(TORCH_DDP, 2, args, timeout=40)).out(0)
    split = ok(run_env_job(TORCH_DDP, 2, [*args, "--accumulate", "2"], timeout=40)).out(0)
    assert "batch 32 per rank (global 64) in 2 micro-batches of 16 (no_sync), 64 steps/epoch" in split, split
    a, b = epochs(whole), epochs(split)
    assert len(a) == len(b) == 2
    assert np.allclose(a, b, atol=2e-3), (a, b)
    assert "parameters identical on all 2 ranks" in split


@pytest.mark.subprocess
@pytest.mark.torch
@pytest.mark.timeout(60)
def test_train_torch_ddp_fp16_comm_hook_with_several_buckets() -> None:
    pytest.importorskip("torch")
    out = ok(run_env_job(TORCH_DDP, 2, ["--epochs", "2", "--hook", "fp16", "--bucket-cap-mb", "0.005"], timeout=40)).out(0)
    assert "in 2 gradient buckets (17680, 2304 B); comm hook fp16" in out, out
    assert "parameters identical on all 2 ranks" in out, out


@pytest.mark.subprocess
def test_train_torch_ddp_without_torch_exits_2_with_a_message() -> None:
    without_torch = ROOT / "tests" / "helpers" / "without_torch.py"  # SCRIPT [ARGS...]: runs SCRIPT with torch unimportable
    r = subprocess.run([sys.executable, str(without_torch), TORCH_DDP], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs torch" in r.stderr and "pip install torch" in r.stderr, r.stderr


# ---------------------------------------------------------------- the training example's parts, in process


def load_train_module() -> ModuleType:
    if "train_data_parallel" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_data_parallel", ROOT / TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["train_data_parallel"]


def test_mlp_backward_matches_finite_differences() -> None:
    t = load_train_module()
    rng = np.random.default_rng(0)
    model = t.MLP([2, 5, 4, 3], rng)
    model.params = [p.astype(np.float64) for p in model.params]
    x, y = rng.standard_normal((7, 2)), rng.integers(0, 3, 7)

    def mean_loss() -> float:
        return float(t.MLP.loss(model.forward(x)[0], y)[0] / len(y))

    logits, inputs = model.forward(x)
    grads = dict(model.backward(inputs, t.MLP.loss(logits, y)[2]))
    assert sorted(grads) == list(range(6))
    assert list(dict(model.backward(inputs, t.MLP.loss(logits, y)[2]))) == [5, 4, 3, 2, 1, 0]  # last layer first
    for i, p in enumerate(model.params):
        numeric = np.zeros_like(p)
        for j in np.ndindex(p.shape):
            old = p[j]
            p[j] = old + 1e-6
            up = mean_loss()
            p[j] = old - 1e-6
            down = mean_loss()
            p[j] = old
            numeric[j] = (up - down) / 2e-6
        np.testing.assert_allclose(grads[i], numeric, rtol=1e-4, atol=1e-7, err_msg=model.names[i])


async def test_async_loader_prefetches_shuffles_and_reports_a_failed_producer() -> None:
    t = load_train_module()
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20)
    loader = t.AsyncLoader(x, y, 6, seed=1, prefetch=2, jitter=0.0)
    assert len(loader) == 3
    epoch1 = [yb.tolist() async for _, yb in loader]
    epoch2 = [yb async for _, yb in loader]
    assert [len(b) for b in epoch1] == [6, 6, 6] and len(set(sum(epoch1, []))) == 18
    assert epoch1 != [b.tolist() for b in epoch2]  # reshuffled every epoch
    again = t.AsyncLoader(x, y, 6, seed=1, prefetch=2, jitter=0.0)
    assert [yb.tolist() async for _, yb in again] == epoch1  # seeded
    slow = t.AsyncLoader(x, y, 2, seed=1, prefetch=3)
    async for _ in slow:
        await asyncio.sleep(0.001)  # the producer runs ahead while the step awaits
    assert slow.asked == 10 and slow.ready >= 9

    class Broken(t.AsyncLoader):  # type: ignore[name-defined,misc]
        def __len__(self) -> int:
            raise ValueError("no length")

    with pytest.raises(RuntimeError, match="data loader failed") as info:
        async for _ in Broken(x, y, 2, seed=1):
            pass
    assert isinstance(info.value.__cause__, ValueError)


async def test_reducer_as_the_example_uses_it_buckets_in_backward_order_and_averages() -> None:
    """The example's gradients go through aiodist.nn.parallel.Reducer, its --bucket-bytes as
    bucket_cap_mb = bytes / 2**20: the buckets of the default MLP, last layer first, and the
    average of a step whose gradients arrive in backward order."""
    from aiodist.nn.parallel import Reducer

    params = [np.zeros((2, 64), np.float32), np.zeros(64, np.float32), np.zeros((64, 3), np.float32), np.zeros(3, np.float32)]

    async def rank(r: int) -> tuple[list[list[int]], list[np.ndarray]]:
        layouts = [[b.members for b in Reducer(params, bucket_cap_mb=cap / 2**20).buckets] for cap in (512, 1, 10**6)]
        reducer = Reducer(params, bucket_cap_mb=512 / 2**20)
        for i in (3, 2, 1, 0):
            reducer.ready(i, np.full(params[i].shape, float(r + i), np.float32))
        await reducer.finish()
        return layouts, [np.array(reducer.grad_view(i)) for i in range(len(params))]

    results = await run_world(2, rank)
    for layouts, grads in results:
        assert layouts == [[[3, 2], [1, 0]], [[3], [2], [1], [0]], [[3, 2, 1, 0]]]
        for i, g in enumerate(grads):
            assert g.shape == params[i].shape and np.all(g == i + 0.5)
