"""A 2x2 DeviceMesh: 4 ranks as 2 data-parallel replicas of 2 tensor-parallel shards.

    aiodist-run --standalone --nproc-per-node 4 examples/device_mesh_2x2.py

``await aiodist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` lays the ranks
out row-major::

             tp=0  tp=1
    dp=0  [   0,    1  ]
    dp=1  [   2,    3  ]

and gives every rank one group per dimension: along "tp" the ranks of its row, along "dp" the
ranks of its column. The example runs the two collectives a 2-D parallel layer would:

- ``all_gather`` along "tp": the two shards of a row assemble the full weight row
  (tensor parallelism: each rank holds half the columns);
- ``all_reduce`` along "dp": replicas of the same shard average their gradients
  (data parallelism: the two rows saw different batches);
- and an ``all_reduce`` along each dimension of the rank numbers, whose sums are easy to check:
  along "tp" rank r gets the sum of its row, along "dp" the sum of its column.

Needs exactly 4 ranks. Rank 0 prints ``OK`` when every rank's results are right.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import aiodist as dist


async def run() -> int:
    await dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != 4:
            await dist.barrier()  # every rank is past init before rank 0's store goes away
            if rank == 0:
                print(f"this example needs 4 ranks (a 2x2 mesh), got {world}: use --nproc-per-node 4", file=sys.stderr)
            return 2
        mesh = await dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_coordinate() or [-1, -1]
        row = mesh.mesh[dp].tolist()
        col = mesh.mesh[:, tp].tolist()
        if rank == 0:
            print(f"mesh {mesh}", flush=True)
        ok = True

        # rank numbers along each dimension
        along_tp = np.array([rank], dtype=np.int64)
        await dist.all_reduce(along_tp, group=mesh.get_group("tp"))
        along_dp = np.array([rank], dtype=np.int64)
        await dist.all_reduce(along_dp, group=mesh.get_group("dp"))
        ok &= along_tp[0] == sum(row) and along_dp[0] == sum(col)

        # tensor parallel: each rank of a row holds half the columns of a 4x4 weight
        full = np.arange(16, dtype=np.float32).reshape(4, 4) + 100 * dp
        shard = np.ascontiguousarray(np.split(full, 2, axis=1)[tp])
        pieces = [np.empty_like(shard) for _ in range(mesh.size("tp"))]
        await dist.all_gather(pieces, shard, group=mesh.get_group("tp"))
        ok &= np.array_equal(np.concatenate(pieces, axis=1), full)

        # data parallel: the same shard's gradient, averaged over the replicas of a column
        grad = np.full(4, float(dp + 1), dtype=np.float32) * (tp + 1)
        await dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        ok &= np.allclose(grad, 1.5 * (tp + 1))

        print(
            f"rank {rank}: coordinate (dp={dp}, tp={tp}); tp group {row} sums ranks to {along_tp[0]}, "
            f"dp group {col} to {along_dp[0]}; tp all_gather rebuilt the {full.shape} weight; dp-averaged grad {grad[0]:g}",
            flush=True,
        )
        verdict = np.array([0 if ok else 1], dtype=np.int64)
        await dist.all_reduce(verdict)
        if rank == 0:
            print("OK" if verdict[0] == 0 else f"FAILED on {verdict[0]} rank(s)", flush=True)
        return 0 if verdict[0] == 0 else 1
    finally:
        await dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(asyncio.run(run()))
