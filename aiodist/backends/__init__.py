"""Communication backends: the ``CommBackend`` interface (a per-op channel factory) and the
in-memory backend ("memory") for tests, and the CPU socket backend ("aio", alias "gloo") over
``aiodist.transport``."""

from aiodist.backends.aio import AioBackend, create_aio_backend
from aiodist.backends.base import BackendOptions, CommBackend
from aiodist.backends.memory import MemoryBackend, MemoryHub, create_memory_backend

__all__ = ["AioBackend", "create_aio_backend", "BackendOptions", "CommBackend", "MemoryBackend", "MemoryHub", "create_memory_backend"]
