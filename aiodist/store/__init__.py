"""Key-value stores: the Store API and HashStore, PrefixStore, FileStore, TCPStore."""

from aiodist.store.base import Store
from aiodist.store.hash import HashStore
from aiodist.store.prefix import PrefixStore

__all__ = ["Store", "HashStore", "PrefixStore"]
