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
from aiodist.store import HashStore, PrefixStore, Store

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
]
