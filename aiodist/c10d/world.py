"""``World``: everything a process knows about its distributed job (the default group, every
group, rank, world size, backend), reached through a ``ContextVar``.

The process has one World by default. ``use_world(world)`` (or running a task in a Context
where it is set) points a task, and the tasks it starts, at another World: that is how
``aiodist.testing.run_world`` runs N ranks as N tasks on one loop. There are no module-level
group tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec

from aiodist._pending import Pending, communicating
from aiodist._threads import LoopHome
from aiodist.store.base import Store

if TYPE_CHECKING:
    from aiodist.backends.base import CommBackend
    from aiodist.c10d.process_group import ProcessGroup

__all__ = ["World", "current_world", "world_of", "use_world", "GroupMember", "group", "NON_GROUP_MEMBER", "default_group", "on_world_loop"]

P = ParamSpec("P")


class World:
    """One rank's view of a job. Empty until ``init_process_group``."""

    def __init__(self, name: str = "world") -> None:
        self.name = name
        self.default_pg: ProcessGroup | None = None
        self.groups: dict[int, ProcessGroup] = {}
        self.rank = -1
        self.world_size = -1
        self.backend: CommBackend | None = None
        self.backend_name = ""
        # device type -> backend name, as init_process_group was asked ("cpu:gloo,cuda:nccl")
        self.backend_config: dict[str, str] = {}
        # device type -> DeviceBackend (aiodist.backends.device): "cuda" -> aiodist_cuda's NCCL
        self.devices: dict[str, Any] = {}
        # why CPU arrays are refused when the World has no CPU backend ("nccl" alone), else None
        self.host_refusal: str | None = None
        self.store: Store | None = None
        # the store rendezvous made for init_process_group (not a user's store=): closed on destroy
        self.owned_store: Store | None = None
        # new_group bookkeeping: how many groups of each member list this rank has made, so that
        # ids are agreed without talking (every member sees every creation of its own groups)
        self.created: dict[tuple[int, ...], int] = {}
        self.next_group_id = 1
        #: where an init_process_group still running was called (file, line): the next call
        #: that needs the default group names it (a forgotten ``await``)
        self.init_site: tuple[str, int] | None = None
        #: the event loop init_process_group ran on: every op of the World's groups runs there
        #: (a call from another thread is handed to it: aiodist._threads)
        self.loop: asyncio.AbstractEventLoop | None = None
        #: the rank whose process serves the job's store (env:// or tcp:// without a launcher:
        #: rank 0), or None where it is served elsewhere (a launcher's agent, a file, a user's store)
        self.store_host: int | None = None
        #: how many times the default group was shrunk (``shrink_group``): each shrink's survivors
        #: meet under their own store prefix
        self.shrinks = 0

    def __repr__(self) -> str:
        state = f"rank {self.rank}/{self.world_size}, backend {self.backend_name!r}" if self.default_pg else "not initialized"
        return f"<World {self.name}: {state}, {len(self.groups)} groups>"

    def reset(self) -> None:
        self.default_pg = None
        self.groups.clear()
        self.rank = self.world_size = -1
        self.backend = None
        self.backend_name = ""
        self.backend_config = {}
        self.devices = {}
        self.host_refusal = None
        self.store = None
        self.owned_store = None
        self.created.clear()
        self.next_group_id = 1
        self.loop = None
        self.store_host = None
        self.shrinks = 0

    def stats(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend_name,
            "address": None if self.backend is None else self.backend.address_info(),
            "groups": [g.stats() for g in self.groups.values()],
        }


_PROCESS_WORLD = World("process")
_CURRENT: contextvars.ContextVar[World] = contextvars.ContextVar("aiodist_world", default=_PROCESS_WORLD)


def current_world() -> World:
    """The World of the running task (the process's own unless ``use_world`` says otherwise)."""
    return _CURRENT.get()


def world_of(ctx: contextvars.Context) -> World:
    """The World ``ctx`` (a task's Context) points at, read without entering it: a Context
    another thread has entered, or the running task's, cannot be entered again
    (``Context.run`` raises RuntimeError)."""
    return ctx.get(_CURRENT, _PROCESS_WORLD)


class _WorldHome(LoopHome):
    """``communicating``'s ``home`` for c10d's calls: the current World's loop (a call from
    another thread: ``aiodist._threads``)."""

    __slots__ = ()

    def loop(self) -> asyncio.AbstractEventLoop | None:
        return _CURRENT.get().loop

    def start_timeout(self) -> float:
        pg = _CURRENT.get().default_pg
        return 1800.0 if pg is None else pg.timeout_s


_HOME = _WorldHome()


def on_world_loop(fn: Callable[P, Coroutine[Any, Any, Any]]) -> Callable[P, Pending]:
    """``communicating`` for a c10d call: its op runs on the World's loop, whichever thread
    calls it (``aiodist._threads``)."""
    return communicating(fn, home=_HOME)


def on_world_loop_now(now: Callable[..., Any]) -> Callable[[Callable[P, Coroutine[Any, Any, Any]]], Callable[P, Pending]]:
    """``on_world_loop`` for a call whose first step ``now`` may finish it without a coroutine
    (``communicating``'s ``now``): ``@on_world_loop_now(first_step)``."""

    def deco(fn: Callable[P, Coroutine[Any, Any, Any]]) -> Callable[P, Pending]:
        return communicating(fn, home=_HOME, now=now)

    return deco


@contextlib.contextmanager
def use_world(world: World) -> Iterator[World]:
    """Point this context (and tasks created inside it) at ``world`` for the ``with`` block."""
    token = _CURRENT.set(world)
    try:
        yield world
    finally:
        _CURRENT.reset(token)


def set_world(world: World) -> None:
    """Point this context at ``world`` for good (for a task's own Context)."""
    _CURRENT.set(world)


def default_group() -> ProcessGroup:
    world = current_world()
    pg = world.default_pg
    if pg is None:
        msg = "Default process group has not been initialized, please make sure to call init_process_group."
        if world.init_site is not None:
            file, line = world.init_site
            msg += (
                f" (init_process_group was called at {file}:{line} but has not finished: "
                "was it awaited? Write `await dist.init_process_group(...)`)"
            )
        raise ValueError(msg)
    return pg


#: what ``new_group`` returns on ranks that are not members (torch's value)
NON_GROUP_MEMBER = -100


class _WorldMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:  # noqa: N802 - torch's name
        """The current World's default group (None before ``init_process_group``)."""
        return current_world().default_pg


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` (the default group of the current World) and
    ``GroupMember.NON_GROUP_MEMBER``, as in torch."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD``: the default group of the current World."""
