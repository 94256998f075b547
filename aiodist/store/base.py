"""The ``Store`` base class: torch's key-value store API with every data method a coroutine.

Keys are ``str``; values go in as ``str`` or ``bytes`` and come back as ``bytes``. Argument
errors are raised at once (TypeError/ValueError) before anything is sent. Waits (``get``,
``wait``, ``multi_get``, blocking ``queue_pop``, ``barrier``) end by the store's timeout with a
``StoreTimeoutError`` (a ``DistStoreError`` and a ``TimeoutError``) naming the missing keys.

Cancellation: cancelling a task inside a store call stops that call's wait; nothing already
sent is undone (a ``set`` that reached the server stays set).
"""

from __future__ import annotations

import abc
import inspect
import operator
from collections.abc import Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from aiodist._pending import communicating
from aiodist._time import TimeoutLike, to_seconds
from aiodist.errors import StoreTimeoutError

__all__ = ["Store", "DEFAULT_STORE_TIMEOUT", "ValueLike", "present"]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)

ValueLike = str | bytes | bytearray | memoryview

# The one case a blocking queue_pop refuses at once: waits see a key that holds a value as
# present, so the pop could never wait for the queue to fill.
VALUE_NOT_QUEUE = (
    "{store}: queue_pop({key!r}): the queue is empty and the key holds a value, so a blocking pop "
    "could never wait for it; use different keys for values and queues"
)


def check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, not {type(key).__name__}")
    return key


def check_keys(keys: object) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a list of str, not {type(keys).__name__}")
    return [check_key(k) for k in keys]


def to_value(value: object, what: str = "value") -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def to_amount(amount: object) -> int:
    if isinstance(amount, bool):
        raise TypeError("add() amount must be an int, not bool")
    try:
        n = operator.index(amount)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"add() amount must be an int, not {type(amount).__name__}") from None
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"add() amount {n} does not fit in a signed 64-bit integer")
    return n


def pair_up(keys: Sequence[str], values: Sequence[ValueLike]) -> tuple[list[str], list[bytes]]:
    ks = check_keys(keys)
    if isinstance(values, (str, bytes)):
        raise TypeError("values must be a list of str or bytes")
    vs = [to_value(v) for v in values]
    if len(ks) != len(vs):
        raise ValueError(f"multi_set needs as many values as keys: {len(ks)} keys, {len(vs)} values")
    return ks, vs


def first_few(items: Sequence[str], sep: str = ", ") -> str:
    return sep.join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")


def ms(seconds: float) -> int:
    """A timeout as torch's messages give it: whole milliseconds."""
    return round(seconds * 1000)


def store_timeout(store: str, op: str, missing: Sequence[str], waited: float, torch_words: str) -> StoreTimeoutError:
    """A wait's timeout error: aiodist's detail (the call, the keys still missing, how long it
    waited), then, in brackets, what torch's store of that kind says (``wait timeout after
    300ms, keys: /k``, ``Wait timeout``), so code that matches torch's text matches ours."""
    shown = first_few([repr(k) for k in missing])
    return StoreTimeoutError(f"{store}: {op} timed out after {waited:g} s; key(s) not set: {shown} ({torch_words})")


#: the data methods whose calls start when made and return a handle (aiodist._pending): a
#: forgotten ``await`` still sends the request and logs an ERROR naming the call's line
_COMMUNICATING = frozenset(
    {
        "set_timeout", "set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "list_keys",
        "append", "multi_get", "multi_set", "queue_push", "queue_pop", "queue_len", "barrier",
    }
)  # fmt: skip


class Store(abc.ABC):
    """Base of every key-value store. Subclasses implement the abstract coroutines; each data
    method a subclass defines is wrapped (``__init_subclass__``) so that calling it starts it
    and returns an awaitable handle, as the c10d calls do (docs/c10d.md, "Sequence numbers and
    issue order")."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _COMMUNICATING:
            fn = cls.__dict__.get(name)
            # (a method already made a handle-returning call is marked as a coroutine function too)
            if fn is not None and inspect.iscoroutinefunction(fn) and not hasattr(fn, "__wrapped_coroutine__"):
                setattr(cls, name, communicating(fn, f"store.{name}"))

    def __init__(self, timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout_s = to_seconds(timeout)

    # -- timeout ------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """The default timeout of waits (``get``, ``wait``, ``barrier``, ...)."""
        return timedelta(seconds=self._timeout_s)

    async def set_timeout(self, timeout: TimeoutLike) -> None:
        """Set the default timeout (a timedelta or seconds)."""
        self._timeout_s = to_seconds(timeout)

    def _wait_seconds(self, timeout: TimeoutLike | None) -> float:
        return self._timeout_s if timeout is None else to_seconds(timeout)

    # -- the API ------------------------------------------------------------------------

    @abc.abstractmethod
    async def set(self, key: str, value: ValueLike) -> None:
        """Store ``value`` at ``key``, replacing any old value, and wake waiters on it."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The value at ``key``; waits up to the store timeout for it to be set."""

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (created at ``amount``); return the new value.
        Raises ``DistStoreError`` if the key holds a non-integer."""

    @abc.abstractmethod
    async def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        """Set ``desired_value`` if the key holds ``expected_value`` (or is missing and
        ``expected_value`` is empty); return the value the key then holds (``expected_value``
        when the key is missing and ``expected_value`` is not empty)."""

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout: TimeoutLike | None = None) -> None:
        """Wait until every key in ``keys`` exists (``timeout`` defaults to the store's)."""

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists now (a non-empty queue counts)."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """How many keys the store holds (queues not counted)."""

    @abc.abstractmethod
    async def list_keys(self) -> list[str]:
        """Every key the store holds (queues not listed)."""

    @abc.abstractmethod
    async def append(self, key: str, value: ValueLike) -> None:
        """Append ``value`` to the value at ``key`` (created if missing)."""

    @abc.abstractmethod
    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the timeout for all to exist."""

    @abc.abstractmethod
    async def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        """Set every ``keys[i]`` to ``values[i]``."""

    @abc.abstractmethod
    async def queue_push(self, key: str, value: ValueLike) -> None:
        """Push ``value`` onto the queue ``key``; wakes one waiter."""

    @abc.abstractmethod
    async def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the oldest value of queue ``key``. Blocking waits up to the timeout; with
        ``block=False`` an empty queue raises ``QueueEmptyError``."""

    @abc.abstractmethod
    async def queue_len(self, key: str) -> int:
        """The queue's length (0 if it does not exist)."""

    @abc.abstractmethod
    def clone(self) -> Store:
        """A new store object on the same underlying store, usable concurrently."""

    async def barrier(self, key: str, world_size: int, timeout: TimeoutLike | None = None) -> None:
        """Return once ``world_size`` callers have entered the barrier named ``key``.

        Built from ``add`` and ``wait``: the last arrival sets ``<key>/done``, everyone waits on
        it. A key is good for one barrier; use a fresh key for the next one.
        """
        check_key(key)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"barrier world_size must be an int >= 1, got {world_size!r}")
        seconds = self._wait_seconds(timeout)
        arrived = await self.add(f"{key}/num_members", 1)
        if arrived >= world_size:
            await self.set(f"{key}/done", b"1")
        try:
            await self.wait([f"{key}/done"], seconds)
        except StoreTimeoutError:
            raise StoreTimeoutError(
                f"{self._describe()}: barrier {key!r} timed out after {seconds:g} s (barrier timeout) with "
                f"{arrived}/{world_size} arrived when this rank entered"
            ) from None

    def has_extended_api(self) -> bool:
        """Whether the store supports the extended operations (append, multi_get/set, queues)."""
        return True

    async def close(self) -> None:  # noqa: B027 - a no-op default, not abstract
        """Release what the store holds (connections, servers). Idempotent."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        """A small statistics record, for the debug server."""
        return {"type": type(self).__name__, "timeout_s": self._timeout_s}

    def _describe(self) -> str:
        return type(self).__name__


async def present(store: Store, keys: Sequence[str]) -> list[str]:
    """The keys of ``keys`` that ``store`` holds now, in order: one round trip where all are
    there (the common case of a poll that is about to end), else one ``check`` a key."""
    if not keys or await store.check(keys):
        return list(keys)
    return [k for k in keys if await store.check([k])]
