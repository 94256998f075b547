"""The aiodist exception tree, mirroring torch.distributed's.

Every error aiodist raises on purpose is a ``DistError`` (a ``RuntimeError``, as in torch),
except argument errors, which are plain ``ValueError``/``TypeError`` raised before anything
is sent.

An op's error carries its facts as fields too, so code (and tests) need not parse the message:
``op`` (``"all_reduce"``), ``group`` (the group's description, ``"default_pg"``), ``seq`` (the
op's sequence number in it), ``rank`` (the global rank that raised it) and ``culprits`` (global
rank -> what that rank did: ``"issued broadcast at seq 3"``, ``"never issued all_reduce seq 3"``,
``"closed the connection without GOODBYE"``; empty where nobody is known). A field nobody knew
is None (``culprits``: empty). They survive pickling (``BaseException`` keeps ``__dict__``).
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
    """Base of every distributed error aiodist raises (fields: the module docstring)."""

    op: str | None = None
    group: str | None = None
    seq: int | None = None
    rank: int | None = None

    def __init__(
        self,
        *args: object,
        op: str | None = None,
        group: str | None = None,
        seq: int | None = None,
        rank: int | None = None,
        culprits: dict[int, str] | None = None,
    ) -> None:
        super().__init__(*args)
        if op is not None:
            self.op = op
        if group is not None:
            self.group = group
        if seq is not None:
            self.seq = seq
        if rank is not None:
            self.rank = rank
        self.culprits: dict[int, str] = dict(culprits) if culprits else {}

    def with_facts(self, *, op: str, group: str, seq: int, rank: int, culprits: dict[int, str] | None = None) -> DistError:
        """Set the op's fields (``culprits`` only where given); returns the error."""
        self.op, self.group, self.seq, self.rank = op, group, seq, rank
        if culprits:
            self.culprits = dict(culprits)
        return self


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

    def __init__(self, *args: object, **facts: object) -> None:
        if args and isinstance(args[0], str) and not _TIMEOUT_WORD.search(args[0]):
            args = (f"Timeout: {args[0]}", *args[1:])
        super().__init__(*args, **facts)  # type: ignore[arg-type]


class StoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store wait (get, wait, blocking queue_pop, barrier, worker join) ran past its timeout.

    Both a ``DistStoreError`` (what torch raises) and a ``TimeoutError``.
    """
