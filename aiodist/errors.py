"""The aiodist exception tree, mirroring torch.distributed's.

Every error aiodist raises on purpose is a ``DistError`` (a ``RuntimeError``, as in torch),
except argument errors, which are plain ``ValueError``/``TypeError`` raised before anything
is sent.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
    "DistTimeoutError",
    "StoreTimeoutError",
]


class DistError(RuntimeError):
    """Base of every distributed error aiodist raises."""


class DistBackendError(DistError):
    """A communication backend failed (an op could not complete, a peer broke the protocol)."""


class DistNetworkError(DistError):
    """A connection could not be made, or broke: names the peer (host:port) and what was being done."""


class DistStoreError(DistError):
    """A key-value store operation failed: a missing key after the timeout, a bad value, a lost server."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty."""


class DistTimeoutError(DistError, TimeoutError):
    """A deadline passed. Also a builtin ``TimeoutError``, so ``except TimeoutError`` catches it."""


class StoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store wait (get, wait, blocking queue_pop, barrier, worker join) ran past its timeout.

    Both a ``DistStoreError`` (what torch raises) and a ``TimeoutError``.
    """
