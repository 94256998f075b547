"""Rendezvous: from a URL to ``(store, rank, world_size)``.

Built-in schemes: ``env://`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun sets
them; else Slurm's or MPI's variables, see ``aiodist._schedulers``),
``tcp://host:port?rank=R&world_size=N`` and ``file:///path?rank=R&world_size=N``.
More schemes plug in with ``register_rendezvous_handler``. This module is the only place that
reads the environment for initialisation (but for ``TCPStore``, which, as torch's, reads
``TORCHELASTIC_USE_AGENT_STORE`` and ``MASTER_PORT`` when a master's port is taken).

A handler is called as ``handler(url, **kwargs)`` (``timeout`` among the kwargs) and may be an
async function returning the triple, or an async generator yielding it (torch's handlers are
generators; aiodist takes the first item).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from aiodist import _startup
from aiodist._schedulers import resolve_env
from aiodist._time import TimeoutLike, to_timedelta
from aiodist.constants import default_pg_timeout
from aiodist.store.base import Store
from aiodist.store.tcp import TCPStore

__all__ = [
    "rendezvous",
    "register_rendezvous_handler",
    "RendezvousRegistry",
    "UnknownSchemeError",
    "RendezvousArgumentError",
    "RendezvousTypeError",
    "create_c10d_store",
]

RendezvousResult = tuple[Store, int, int]
Handler = Callable[..., Any]

log = logging.getLogger("aiodist.rendezvous")


class UnknownSchemeError(ValueError, RuntimeError):
    """No handler for a rendezvous URL's scheme. torch raises RuntimeError here; aiodist raised
    ValueError before, so this is both: ``except RuntimeError`` (torch code) and ``except
    ValueError`` both catch it."""


class RendezvousArgumentError(ValueError, AssertionError):
    """A rendezvous URL that contradicts the arguments (``rank``/``world_size`` in both) or has
    no host. torch raises AssertionError here; aiodist raised ValueError (and a bare assert for
    the host) before, so this is both."""


class RendezvousTypeError(TypeError, RuntimeError):
    """A rendezvous argument of the wrong type (a url that is not a str, a rank that is not an
    int). torch raises RuntimeError; aiodist raised TypeError before, so this is both."""


class RendezvousRegistry:
    """Handlers by URL scheme."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def register(self, scheme: str, handler: Handler) -> None:
        if not isinstance(scheme, str) or not scheme:
            raise ValueError(f"scheme must be a non-empty str, got {scheme!r}")
        if not callable(handler):
            raise TypeError(f"rendezvous handler for {scheme}:// must be callable, got {type(handler).__name__}")
        if scheme in self._handlers:
            raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
        self._handlers[scheme] = handler

    def get(self, scheme: str) -> Handler:
        try:
            return self._handlers[scheme]
        except KeyError:
            known = ", ".join(f"{s}://" for s in sorted(self._handlers))
            raise UnknownSchemeError(
                f"No rendezvous handler for {scheme}://; known schemes: {known}. "
                f"Did you forget to register it with aiodist.register_rendezvous_handler()?"
            ) from None

    def schemes(self) -> list[str]:
        return sorted(self._handlers)


registry = RendezvousRegistry()


def register_rendezvous_handler(scheme: str, handler: Handler) -> None:
    """Register ``handler`` for URLs of ``scheme``; RuntimeError if the scheme is taken."""
    registry.register(scheme, handler)


async def rendezvous(
    url: str, rank: int = -1, world_size: int = -1, timeout: TimeoutLike = default_pg_timeout, **kwargs: Any
) -> RendezvousResult:
    """Run the handler for ``url``'s scheme and return ``(store, rank, world_size)``.

    ``rank``/``world_size`` given here are added to the URL's query; giving them both here and
    in the URL is a ``RendezvousArgumentError`` (a ValueError and, as torch raises, an AssertionError).
    """
    if not isinstance(url, str):
        raise RendezvousTypeError(f"`url` must be a string. rendezvous url must be a str, got {type(url).__name__}")
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise RendezvousTypeError(f"`{name}` must be an integer. {name} must be an int, got {v!r}")
    parsed = urlparse(url)
    if not parsed.scheme:
        raise ValueError(f"rendezvous url {url!r} has no scheme (expected e.g. env://, tcp://host:port, file:///path)")
    query = dict(parse_qsl(parsed.query))
    if rank != -1 or world_size != -1:
        if "rank" in query or "world_size" in query:
            raise RendezvousArgumentError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
        if rank != -1:
            query["rank"] = str(rank)
        if world_size != -1:
            query["world_size"] = str(world_size)
        url = urlunparse(parsed._replace(query=urlencode(query)))
    handler = registry.get(parsed.scheme)
    with _startup.phase(caller=None if _startup.current().caller else "rendezvous"):
        warn_if_launcher_disagrees(_maybe_int(query.get("rank")), _maybe_int(query.get("world_size")))
        result = handler(url, timeout=to_timedelta(timeout), **kwargs)
        if inspect.isasyncgen(result):
            triple = await anext(result)
        elif inspect.isawaitable(result):
            triple = await result
        elif inspect.isgenerator(result):
            triple = next(result)
        else:
            raise TypeError(f"rendezvous handler for {parsed.scheme}:// must be an async function or an async generator")
    return _check_result(parsed.scheme, triple)


def warn_if_launcher_disagrees(rank: int | None, world_size: int | None, caller: str | None = None) -> None:
    """Warn, at once, when ``rank``/``world_size`` given in code differ from the launcher's
    ``RANK``/``WORLD_SIZE`` (set by aiodist-run, torchrun): under a 2-process launcher,
    ``world_size=3`` waits the whole timeout for a rank that was never started. ``caller``
    names who was given them (default: the start-up phase's caller, else rendezvous)."""
    for name, value, var in (("world_size", world_size, "WORLD_SIZE"), ("rank", rank, "RANK")):
        raw = os.environ.get(var, "").strip()
        if value is None or value < 0 or not raw:
            continue
        try:
            launched = int(raw)
        except ValueError:
            continue  # env:// refuses it with its own error when it is used
        if launched != value:
            if name == "rank":
                then = "two processes may claim one rank while another rank is never filled"
            elif value > launched:
                then = f"the ranks will wait, until the timeout, for {value - launched} rank(s) the launcher never started"
            else:
                then = f"the launcher's ranks {value} to {launched - 1} do not fit in a world of {value}"
            log.warning(
                "%s: %s=%d was passed in code, but the launcher's %s is %d (in the environment): %s. "
                "Pass the launcher's value (env:// reads it itself when none is passed).",
                caller or _startup.current().caller or "rendezvous",
                name,
                value,
                var,
                launched,
                then,
            )


def _check_result(scheme: str, triple: Any) -> RendezvousResult:
    ok = isinstance(triple, tuple) and len(triple) == 3
    if ok:
        store, r, n = triple
        ok = isinstance(store, Store) and isinstance(r, int) and isinstance(n, int)
    if not ok:
        raise TypeError(f"rendezvous handler for {scheme}:// must produce (Store, rank: int, world_size: int), got {triple!r}")
    return triple


# ---------------------------------------------------------------- helpers


def _query_int(query: dict[str, str], name: str, url: str) -> int:
    if name not in query:
        raise ValueError(f"{name} parameter missing in rendezvous url {url!r}")
    try:
        return int(query[name])
    except ValueError:
        raise ValueError(f"{name} parameter in rendezvous url {url!r} is not an integer: {query[name]!r}") from None


def _maybe_int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # the handler refuses it in its own words


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None or value == "":
        raise ValueError(f"Error initializing aiodist using env:// rendezvous: environment variable {name} expected, but not set")
    return value


def _env_int(name: str) -> int:
    value = _env(name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Error initializing aiodist using env:// rendezvous: environment variable {name} must be an integer, got {value!r}"
        ) from None


def _use_libuv(query: dict[str, str]) -> bool:
    raw = query.get("use_libuv", os.environ.get("USE_LIBUV", "1"))
    return raw not in ("0", "false", "False")


async def create_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: TimeoutLike, use_libuv: bool = True) -> Store:
    """The job's TCPStore, as torch 2.13 makes it: rank 0 hosts it (shared by every store of
    this process on that port), the others connect. Under an agent that already hosts the store
    (``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun sets) every rank is a client; torch adds
    no per-attempt prefix (the agent makes a new store for every restart), nor does aiodist."""
    if not 0 <= port < 2**16:
        raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # the store's progress warnings name this rank and whose server it waits for
    with _startup.phase(rank=rank, world_size=world_size, server_of="the launcher agent" if agent else "rank 0"):
        if agent:
            return await TCPStore(hostname, port, world_size, False, timeout, use_libuv=use_libuv)
        return await TCPStore(hostname, port, world_size, rank == 0, timeout, multi_tenant=True, use_libuv=use_libuv)


# ---------------------------------------------------------------- built-in handlers


async def _tcp_handler(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> RendezvousResult:
    result = urlparse(url)
    if not result.port:
        raise ValueError(f"port number missing in rendezvous url {url!r}")
    query = dict(parse_qsl(result.query))
    rank = _query_int(query, "rank", url)
    world_size = _query_int(query, "world_size", url)
    if result.hostname is None:
        raise RendezvousArgumentError(f"hostname cannot be None: no host in rendezvous url {url!r}")  # torch: AssertionError
    with _startup.phase(addr_from="the init_method URL"):
        store = await create_c10d_store(result.hostname, result.port, rank, world_size, timeout, _use_libuv(query))
    return store, rank, world_size


async def _env_handler(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> RendezvousResult:
    query = dict(parse_qsl(urlparse(url).query))
    # torchrun's variables, else Slurm's / MPI's (aiodist/_schedulers.py, docs/schedulers.md)
    found = resolve_env(
        _query_int(query, "rank", url) if "rank" in query else None,
        _query_int(query, "world_size", url) if "world_size" in query else None,
    )
    if found.scheduler is not None and found.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(found.local_rank))  # for get_node_local_rank(), as torchrun sets it
    with _startup.phase(addr_from=found.sources.get("master_addr")):
        store = await create_c10d_store(found.master_addr, found.master_port, found.rank, found.world_size, timeout, _use_libuv(query))
    return store, found.rank, found.world_size


async def _file_handler(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> RendezvousResult:
    from aiodist.store.file import FileStore

    result = urlparse(url)
    path = result.path
    if result.netloc:  # file://relative/path: keep what the user wrote
        path = result.netloc + path
    if not path:
        raise ValueError(f"file path missing in rendezvous url {url!r}")
    query = dict(parse_qsl(result.query))
    rank = _query_int(query, "rank", url)
    world_size = _query_int(query, "world_size", url)
    store = FileStore(path, world_size, timeout=timeout)
    await store
    return store, rank, world_size


registry.register("tcp", _tcp_handler)
registry.register("env", _env_handler)
registry.register("file", _file_handler)
