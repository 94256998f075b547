"""A torch TCPStore client process for tests/test_torch_interop.py.

    python tests/helpers/torch_store_client.py PORT

torch's ``TCPStore.list_keys`` and ``queue_len`` keep the GIL while they wait for the server's
reply (torch 2.13), so a torch client calling them from a thread of a process whose server also
runs Python (aiodist's) deadlocks; hence a process of its own. Connects (no world size), sets
``from_torch``, pushes ``t`` onto queue ``tq``, then prints one JSON line:
``{"list_keys": [...], "num_keys": n, "queue_len": {"q": .., "tq": .., "none": ..}}``.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist


def main() -> None:
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=20))
    store.set("from_torch", "1")
    store.queue_push("tq", "t")
    queue_len = {q: store.queue_len(q) for q in ("q", "tq", "none")}
    print(json.dumps({"list_keys": sorted(store.list_keys()), "num_keys": store.num_keys(), "queue_len": queue_len}), flush=True)


if __name__ == "__main__":
    main()
