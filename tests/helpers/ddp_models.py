"""Models, data and loops shared by the DDP tests: the same training run under torch's DDP
(gloo, real processes: ``python ddp_models.py RANK WORLD PORT_FILE OUT_DIR``) and under
aiodist's (``tests/test_ddp.py``), so that the parameters after it can be compared bit for bit.

Modes: plain, view (gradient_as_bucket_view), small_buckets, nosync (2 accumulated
micro-batches per step), hook (default allreduce_hook), fp16 (fp16_compress_hook), buffers
(BatchNorm, broadcast_buffers), unused (find_unused_parameters with a branch some steps skip).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("plain", "view", "small_buckets", "nosync", "hook", "fp16", "buffers", "unused")
STEPS = 4


class Branchy(torch.nn.Module):
    """Two layers and a side branch that only odd steps use (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.side = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_side:
            h = h + self.side(h)
        return self.b(h)


def build(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if mode == "unused":
        return Branchy()
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 32)]
    if mode == "buffers":
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)]
    return torch.nn.Sequential(*layers)


def ddp_kwargs(mode: str) -> dict[str, Any]:
    return {
        "view": {"gradient_as_bucket_view": True},
        "small_buckets": {"bucket_cap_mb": 0.002},
        "unused": {"find_unused_parameters": True},
    }.get(mode, {})


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)


def forward_kwargs(mode: str, step: int) -> dict[str, Any]:
    return {"use_side": step % 2 == 1} if mode == "unused" else {}


def checksum(model: torch.nn.Module) -> bytes:
    return b"".join(t.detach().contiguous().numpy().tobytes() for t in [*model.parameters(), *model.buffers()])


def torch_rank(rank: int, world: int, port_file: Path, out: Path) -> None:
    """Every mode's run under torch's DDP over gloo; ``out/MODE`` holds the state after it."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    if rank == 0:
        store = tdist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)  # atomic: rank 1 never reads a half-written port
    else:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise SystemExit("no port file")
            time.sleep(0.02)
        store = tdist.TCPStore("127.0.0.1", int(port_file.read_text()), world, False)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for mode in MODES:
        state = torch_run(rank, mode)
        if rank == 0:  # torch's rank 1 keeps its own last buffer update (it is broadcast at the next forward)
            (out / mode).write_bytes(state)
    # torch 2.13's teardown aborts now and then ("terminate called without an active exception",
    # rank 0, the store's host, while rank 1 is still leaving): leave in step, then without
    # running the destructors; every result is written by now
    tdist.barrier()
    tdist.destroy_process_group()
    if rank == 0:
        store.wait(["left"])
    else:
        store.set("left", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torch_run(rank: int, mode: str) -> bytes:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model = build(mode)
    ddp = DistributedDataParallel(model, **ddp_kwargs(mode))
    if mode == "hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        if mode == "nosync":
            with ddp.no_sync():
                x, y = batch(rank, step, 1)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x, **forward_kwargs(mode, step)), y)
        loss.backward()
        opt.step()
    return checksum(model)


if __name__ == "__main__":
    torch_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
