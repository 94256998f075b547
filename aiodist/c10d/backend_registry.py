"""``Backend``: torch's enum-like registry of backend names, and how a name becomes a
``CommBackend``.

- ``Backend("GLOO") == "gloo"``; ``Backend.GLOO``; ``Backend.register_backend(name, func,
  extended_api=False, devices=None)`` adds ``Backend.<NAME>``. An unknown name is a ValueError
  that lists the known ones and asks whether it was registered.
- Built in: "memory" (in-process, for tests); "aio" is the CPU socket backend and "gloo" an
  alias of it, over ``aiodist.transport`` (imported when first used; without it they refuse
  with a DistBackendError that says so);
  "nccl" is ``aiodist_cuda``'s to register; "mpi", "ucc", "xccl" are not available.
- A creator is called ``func(store, rank, world_size, timeout)`` (``extended_api=True``:
  ``func(BackendOptions, pg_options)``), may be async, and returns a ``CommBackend`` (a CPU
  backend) or a ``DeviceBackend`` (a device backend such as NCCL; ``aiodist.backends.device``).
- Per-device configs, torch's ``"cpu:gloo,cuda:nccl"``: ``parse_backend_config`` gives the
  device -> backend map; a single name serves the devices its capability lists.
- Plugins: a backend this process has not registered is looked up among the installed
  distributions' entry points, group ``aiodist.backends`` (name: the backend's name; value: a
  callable that registers it), e.g. ``nccl = "aiodist_cuda:register"``. ``aiodist.devices``
  does the same by device type (``cuda``), for staging a device's arrays through the host.
  This is the only way ``aiodist`` reaches ``aiodist_cuda``: it never imports it by name.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from aiodist.backends.aio import create_aio_backend, transport_available
from aiodist.backends.base import BackendOptions, CommBackend
from aiodist.backends.device import DeviceBackend
from aiodist.backends.memory import create_memory_backend
from aiodist.errors import DistBackendError
from aiodist.store.base import Store

__all__ = ["Backend", "create_backend", "is_backend_available", "is_nccl_available", "parse_backend_config", "load_plugin"]

log = logging.getLogger("aiodist.c10d")


@dataclass(frozen=True)
class _Plugin:
    func: Callable[..., Any]
    extended_api: bool
    devices: tuple[str, ...]


def _not_here(name: str, why: str) -> Callable[..., Any]:
    async def refuse(*args: Any, **kwargs: Any) -> CommBackend:
        raise DistBackendError(f"backend {name!r} is not available: {why}")

    return refuse


class Backend(str):
    """A backend name, lower-cased and checked: ``Backend("GLOO") == "gloo"``."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    FAKE = "fake"
    AIO = "aio"
    MEMORY = "memory"

    backend_list: ClassVar[list[str]] = [UNDEFINED, GLOO, NCCL, UCC, MPI, XCCL, AIO, MEMORY]
    default_device_backend_map: ClassVar[dict[str, str]] = {"cpu": GLOO, "cuda": NCCL}
    backend_capability: ClassVar[dict[str, list[str]]] = {
        GLOO: ["cpu"],
        AIO: ["cpu"],
        MEMORY: ["cpu"],
        NCCL: ["cuda"],
        UCC: ["cpu", "cuda"],
        MPI: ["cpu", "cuda"],
        XCCL: ["xpu"],
    }
    aliases: ClassVar[dict[str, str]] = {GLOO: AIO}
    _plugins: ClassVar[dict[str, _Plugin]] = {}

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ValueError(f"Backend constructor parameter must be string-ish, got {type(name).__name__}")
        if ":" in name:  # a per-device config: checked part by part, kept as written (lower-cased)
            parse_backend_config(name)
            return super().__new__(cls, name.lower().replace(" ", ""))
        value = getattr(Backend, name.upper(), Backend.UNDEFINED)
        if value == Backend.UNDEFINED:
            value = name.lower()
        if value not in Backend.backend_list or value == Backend.UNDEFINED:
            known = ", ".join(sorted(b for b in Backend.backend_list if b != Backend.UNDEFINED))
            raise ValueError(
                f"Invalid backend: {name!r}; known backends: {known}. Did you forget to register it with Backend.register_backend()?"
            )
        return super().__new__(cls, value)

    @classmethod
    def register_backend(
        cls, name: str, func: Callable[..., Any], extended_api: bool = False, devices: str | Sequence[str] | None = None
    ) -> None:
        """Register ``func`` as the creator of backend ``name`` (see the module docstring)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty str, got {name!r}")
        if not callable(func):
            raise TypeError(f"backend creator for {name!r} must be callable, got {type(func).__name__}")
        key = name.lower()
        if key in Backend._plugins or (hasattr(Backend, name.upper()) and key != Backend.NCCL):
            raise ValueError(f"{name.upper()} c10d backend already exist")
        devs = ("cpu", "cuda") if devices is None else ((devices,) if isinstance(devices, str) else tuple(devices))
        setattr(Backend, name.upper(), name.lower())
        if name.lower() not in Backend.backend_list:
            Backend.backend_list.append(name.lower())
        for d in devs:
            Backend.default_device_backend_map.setdefault(d, name.lower())
        Backend.backend_capability[name.lower()] = list(devs)
        Backend._plugins[name.lower()] = _Plugin(func, extended_api, devs)

    @classmethod
    def _creator(cls, name: str) -> _Plugin:
        b: str = Backend(name)
        b = Backend.aliases.get(b, b)
        plugin = cls._plugins.get(b)
        if plugin is None:
            raise DistBackendError(
                f"backend {b!r} has no creator in this process; did you forget to register it with Backend.register_backend()?"
            )
        return plugin


def _register_builtins() -> None:
    Backend._plugins.update(
        {
            Backend.MEMORY: _Plugin(create_memory_backend, False, ("cpu",)),
            Backend.AIO: _Plugin(create_aio_backend, False, ("cpu",)),
            Backend.MPI: _Plugin(_not_here("mpi", "aiodist has no MPI backend"), False, ("cpu",)),
            Backend.UCC: _Plugin(_not_here("ucc", "aiodist has no UCC backend"), False, ("cpu",)),
            Backend.XCCL: _Plugin(_not_here("xccl", "aiodist has no XCCL backend"), False, ("xpu",)),
        }
    )


_register_builtins()


def parse_backend_config(spec: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a single name -> the
    devices it serves (``"gloo"`` -> cpu, ``"nccl"`` -> cuda). ``"cuda:gloo"`` is torch's gloo
    taking CUDA tensors: the CPU backend, the arrays staged through host memory. ValueError on
    an unknown device or backend, a device named twice, or a backend that cannot serve it."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"backend must be a non-empty str, got {spec!r}")
    if ":" not in spec:
        b = Backend(spec)
        devices = Backend.backend_capability.get(Backend.aliases.get(b, b)) or Backend.backend_capability.get(b) or ["cpu"]
        return {d: str(b) for d in devices}
    out: dict[str, str] = {}
    for part in spec.replace(" ", "").lower().split(","):
        device, sep, name = part.partition(":")
        if not sep or not device or not name or ":" in name:
            raise ValueError(f"invalid backend config {spec!r}: each part must be 'device:backend', e.g. 'cpu:gloo,cuda:nccl'")
        if device in out:
            raise ValueError(f"invalid backend config {spec!r}: device {device!r} is named twice")
        known = {"cpu"} | set(Backend.default_device_backend_map) | {d for ds in Backend.backend_capability.values() for d in ds}
        if device not in known:
            raise ValueError(f"invalid backend config {spec!r}: unknown device type {device!r} (known: {sorted(known)})")
        b = Backend(name)
        serves = Backend.backend_capability.get(Backend.aliases.get(b, b), Backend.backend_capability.get(b, []))
        staged = device != "cpu" and "cpu" in serves  # a CPU backend takes device arrays through the host
        if device not in serves and not staged:
            raise ValueError(f"invalid backend config {spec!r}: backend {name!r} does not serve device {device!r} (it serves {serves})")
        out[device] = str(b)
    return out  # without "cpu" (e.g. "cuda:nccl"), CPU arrays are refused, as torch does


def load_plugin(group: str, name: str) -> bool:
    """Load the installed entry point ``name`` of ``group`` (``aiodist.backends`` /
    ``aiodist.devices``) and call it, so it registers itself. False when none is installed."""
    import importlib.metadata  # here, not at the top: it costs every process ~40 ms of import

    try:
        eps = importlib.metadata.entry_points(group=group, name=name)
    except Exception as exc:  # pragma: no cover - broken metadata: behave as not installed
        log.warning("could not read the entry points of %s: %s", group, exc)
        return False
    for ep in eps:
        register = ep.load()
        if callable(register):
            register()
        return True
    return False


def _nccl_module() -> Any:
    """aiodist_cuda when it is installed (loaded through its entry point), else None."""
    mod = sys.modules.get("aiodist_cuda")
    if mod is None and Backend.NCCL not in Backend._plugins:
        try:
            load_plugin("aiodist.backends", Backend.NCCL)
        except Exception as exc:  # a plugin that fails to import is "not available", with the reason logged
            log.warning("the nccl backend plugin failed to load: %s: %s", type(exc).__name__, exc)
        mod = sys.modules.get("aiodist_cuda")
    return mod


def is_nccl_available() -> bool:
    """Whether the NCCL backend (aiodist_cuda, found through its entry point) can run here: CuPy,
    its NCCL and a GPU present."""
    mod = _nccl_module()
    return bool(mod is not None and mod.is_available())


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` names a backend that can be created here."""
    try:
        b = Backend(backend)
    except ValueError:
        return False
    if b == Backend.NCCL:
        return is_nccl_available()
    if Backend.aliases.get(b, b) == Backend.AIO:
        return Backend._plugins[Backend.AIO].func is not create_aio_backend or transport_available()
    if b in (Backend.MPI, Backend.UCC, Backend.XCCL):
        return False
    return b in Backend._plugins


async def create_backend(
    name: str, store: Store, rank: int, world_size: int, timeout: timedelta, pg_options: Any = None
) -> CommBackend | DeviceBackend:
    """Make backend ``name`` for one World through its registered creator."""
    b = Backend(name)
    if b == Backend.NCCL:
        mod = _nccl_module()
        if Backend.NCCL not in Backend._plugins or (mod is not None and not mod.is_available()):
            why = mod.unavailable_reason() if mod is not None else "aiodist_cuda is not installed (pip install 'aiodist[cuda]')"
            raise DistBackendError(f"backend 'nccl' is not available: {why}")
    elif b not in Backend._plugins and Backend.aliases.get(b, b) not in Backend._plugins:
        load_plugin("aiodist.backends", str(b))
    plugin = Backend._creator(b)
    if plugin.extended_api:
        opts = BackendOptions(store, rank, world_size, timeout, "0", list(range(world_size)))
        result = plugin.func(opts, pg_options)
    else:
        result = plugin.func(store, rank, world_size, timeout)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, (CommBackend, DeviceBackend)):
        raise DistBackendError(
            f"the creator of backend {b!r} returned {type(result).__name__}, not an aiodist.backends.CommBackend or DeviceBackend"
        )
    if not result.name:
        result.name = str(b)
    return result
