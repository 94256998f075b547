"""Key-value stores: the Store API and HashStore, PrefixStore, FileStore, TCPStore."""

from aiodist.store.base import Store
from aiodist.store.file import FileStore
from aiodist.store.hash import HashStore
from aiodist.store.prefix import PrefixStore
from aiodist.store.server import TCPStoreServer
from aiodist.store.tcp import TCPStore

__all__ = ["Store", "HashStore", "PrefixStore", "FileStore", "TCPStore", "TCPStoreServer"]
