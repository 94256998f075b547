"""The aiodist exception tree, mirroring torch.distributed's.

Every error aiodist raises on purpose is a ``DistError`` (a ``RuntimeError``, as in torch),
except argument errors, which are plain ``ValueError``/``TypeError`` raised before anything
is sent.
"""

from __future__ import annotations

import re

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


_TIMEOUT_WORD = re.compile(r"[Tt]imeout|^Timed out")


class DistTimeoutError(DistError, TimeoutError):
    """A deadline passed. Also a builtin ``TimeoutError``, so ``except TimeoutError`` catches it.

    Its message always has the word "timeout", which torch's have and user code matches
    (``[Tt]imeout``): a message without it is prefixed ``Timeout: ``. Sentences that copy torch's
    own ``Timed out ...`` words exactly are left as they are."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and not _TIMEOUT_WORD.search(args[0]):
            args = (f"Timeout: {args[0]}", *args[1:])
        super().__init__(*args)


class StoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store wait (get, wait, blocking queue_pop, barrier, worker join) ran past its timeout.

    Both a ``DistStoreError`` (what torch raises) and a ``TimeoutError``.
    """
