"""A rank of a two-process torch.distributed job for tests/test_torch_parity.py: what torch's
``monitored_barrier`` says when a rank does not arrive in time (aiodist must say the same).

    python tests/helpers/torch_monitored_barrier.py RANK PATH

gloo over ``FileStore(PATH, 2)``. Rank 0 calls ``monitored_barrier`` with a 700 ms timeout and
prints the first line of the RuntimeError it raises; rank 1 sleeps 1.2 s and exits.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch.distributed as dist


def main(rank: int, path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    if rank == 0:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(milliseconds=700))
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    else:
        time.sleep(1.2)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
