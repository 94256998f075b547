"""aiodist: the torch.distributed communication API, asyncio-native. Re-exports only."""

from aiodist.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    QueueEmptyError,
    StoreTimeoutError,
)
from aiodist.rendezvous import register_rendezvous_handler, rendezvous
from aiodist.store import FileStore, HashStore, PrefixStore, Store, TCPStore, TCPStoreServer
from aiodist.types import ReduceOp, reduce_op

__version__ = "0.1.0"

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "QueueEmptyError",
    "StoreTimeoutError",
    "Store",
    "HashStore",
    "PrefixStore",
    "FileStore",
    "TCPStore",
    "TCPStoreServer",
    "rendezvous",
    "register_rendezvous_handler",
    "ReduceOp",
    "reduce_op",
]
