"""The seam between shared memory and the transport (aiodist.shm._link.OpLink).

Three things: the shm modules reach the transport and the op's tracker only through the
contract (a check over their syntax, itself tested on the reach-arounds it must catch and the
code it must let through); every implementation keeps it (the transport's ``Channel``, the
runner's ``TrackedP2P`` and a hierarchical op's ``HostLink``: every member there, with the
Protocol's parameters, and doing what it says, on a real transport or mapped onto the op's
link); and a lane wait is counted by the op's tracker through it (the timeout names the peer).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist._digest import op_digest
from aiodist._message import LINE_STEP
from aiodist.algorithms.p2p import TAG_LIMIT, local_world
from aiodist.c10d._runner import TrackedP2P
from aiodist.errors import DistBackendError, DistTimeoutError
from aiodist.shm import OpLink
from aiodist.shm._link import HostLink, op_link
from aiodist.testing import run_world
from aiodist.transport._channel import Channel

pytestmark = [pytest.mark.timeout(60)]

SHM = Path(__file__).resolve().parents[1] / "aiodist" / "shm"
_DYNAMIC = {"getattr", "hasattr", "setattr", "delattr"}
_LINK_NAMES = {"p2p", "link", "ch"}  # what a parameter holding the op's P2P or link is called
_LINK_TYPES = {"OpLink", "P2P"}
_FORBIDDEN = ("aiodist.transport", "aiodist.c10d")  # reached only through the OpLink


def _imported_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> full module name, for every name the source binds to a module by import."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parent = importlib.import_module(node.module)
            for a in node.names:
                if isinstance(getattr(parent, a.name, None), types.ModuleType):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def reach_arounds(source: str, name: str = "<shm>") -> list[str]:
    """Where ``source`` (a module of aiodist/shm) reaches around the OpLink contract:
    - ``getattr``/``hasattr``/``setattr``/``delattr`` on anything but an imported module that
      is not another aiodist package's (``hasattr(os, "eventfd")`` is a feature check);
    - a private attribute (``x._name``, not a dunder) of anything but ``self``/``cls`` or a
      module of aiodist.shm;
    - a parameter called ``p2p``, ``link`` or ``ch`` not typed ``OpLink`` or ``P2P``;
    - an import from the transport or c10d."""
    tree = ast.parse(source)
    modules = _imported_modules(tree)
    own = {local for local, full in modules.items() if full == "aiodist.shm" or full.startswith("aiodist.shm.")}
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC:
            recv = node.args[0] if node.args else None
            local = recv.id if isinstance(recv, ast.Name) else ""
            module = modules.get(local, "")
            if not module or (module.startswith("aiodist") and local not in own):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            recv = node.value
            if not (isinstance(recv, ast.Name) and (recv.id in ("self", "cls") or recv.id in own)):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # (a lambda's are typed by its Callable)
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else "no annotation"
                if arg.arg in _LINK_NAMES and ann not in _LINK_TYPES:
                    found.append(f"{where}: parameter {arg.arg}: {ann}")
        elif isinstance(node, ast.ImportFrom | ast.Import):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{where}: imports {m}" for m in mods if m.startswith(_FORBIDDEN)]
    return found


def test_shared_memory_reaches_the_transport_only_through_its_oplink() -> None:
    files = sorted(SHM.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "_lane.py", "_manager.py", "_algorithms.py", "_link.py"}
    found = [hit for f in files for hit in reach_arounds(f.read_text(), f"aiodist/shm/{f.name}")]
    assert not found, "shared memory reaches around aiodist.shm._link.OpLink:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [
        "def f(ch: OpLink):\n    return ch.transport._digests.get((1, 2))",
        "def f(t):\n    t._abort_now(1, 'why')\n    raise t._abort_error((1, 2, 0))",
        "def f(ch: OpLink):\n    ch.transport._check_usable((1, 2, 0), 1)",
        "def f(p2p: OpLink):\n    return getattr(p2p, 'waiting_recv', None)",
        "def f(p2p: OpLink):\n    return getattr(p2p, 'inner', None) or getattr(p2p, '_p2p', None)",
        "def f(p2p: OpLink):\n    return hasattr(p2p, 'transport')",
        "def f(p2p: OpLink):\n    return p2p._heard",
        "def f(p2p: Any):\n    return p2p.rank",
        "def f(ch):\n    return ch.seq",
        "async def f(*, link: Any = None):\n    return link.seq",
        "from aiodist.algorithms import collectives as alg\nx = alg._borrowed",
        "from aiodist.algorithms import collectives as alg\nx = getattr(alg, '_borrowed')",
        "from aiodist.transport._channel import Channel",
        "import aiodist.c10d._runner",
    ],
)
def test_the_check_catches_a_reach_around(code: str) -> None:
    assert reach_arounds(code), code


@pytest.mark.parametrize(
    "code",
    [
        "import os\nok = hasattr(os, 'eventfd') and getattr(os, 'memfd_create', None)",
        "class A:\n    def f(self):\n        return self._turns.serving",
        "class A:\n    @classmethod\n    def f(cls):\n        return cls._cache",
        "def f(a):\n    return a.__array_interface__['data'][0]",
        "from aiodist.shm import _cma\nx = _cma._readv",
        "def f(p2p: OpLink, link: OpLink, ch: P2P):\n    return p2p.check_peer(1), link.seq, ch.rank",
        "run: Callable[[OpLink, GroupShm], Awaitable[None]] = lambda link, g: link.check_peer(g)",
    ],
)
def test_the_check_lets_the_contract_through(code: str) -> None:
    assert not reach_arounds(code), reach_arounds(code)


@pytest.mark.parametrize("impl", [Channel, TrackedP2P, HostLink])
def test_every_member_is_there_with_the_protocols_parameters(impl: type) -> None:
    for name in sorted({n for n in dir(OpLink) if not n.startswith("_")}):
        want = getattr(OpLink, name)
        assert hasattr(impl, name) or name in getattr(impl, "__slots__", ()), f"{impl.__name__} has no {name}"
        if inspect.isfunction(want):
            have = getattr(impl, name)
            assert list(inspect.signature(have).parameters) == list(inspect.signature(want).parameters), (impl.__name__, name)
        elif isinstance(want, property):
            have = inspect.getattr_static(impl, name)
            assert isinstance(have, property | types.MemberDescriptorType), (impl.__name__, name, have)
    assert "digest" in OpLink.__annotations__
    assert hasattr(Channel, "digest") and isinstance(inspect.getattr_static(TrackedP2P, "digest"), property)
    assert inspect.getattr_static(TrackedP2P, "digest").fset is not None  # the agreement clears it for its vote


async def test_the_channel_and_the_tracker_keep_the_contract_on_a_real_transport() -> None:
    """On rank 0 of a socket world, groups no process group uses (their aborts reach rank 1's
    transport, and touch nothing else): identity and digest, the counts, a desync without and
    with a digest, an abort."""
    done = asyncio.Event()

    async def fn(rank: int) -> None:
        if rank == 1:
            await done.wait()
            return
        try:
            t = dist.group.WORLD.backend.transport  # type: ignore[union-attr]
            same = {"dtype": "float32", "shape": [4]}
            digest = op_digest("all_reduce", same)
            ch = t.channel(901, 5, [0, 1], digest, ("all_reduce", same, None))
            assert isinstance(ch, OpLink) and op_link(ch) is ch
            tracked = TrackedP2P(ch, [0, 1], 0)
            assert isinstance(tracked, OpLink) and op_link(tracked) is tracked
            assert (tracked.group_id, tracked.seq, tracked.digest, tracked.op_name, list(tracked.ranks)) == (
                901,
                5,
                digest,
                "all_reduce",
                [0, 1],
            )
            tracked.digest = 0  # what the agreement does for its vote: the channel sends no digest
            assert ch.digest == 0
            tracked.digest = digest
            assert ch.digest == digest

            # the waits: counted in the tracker as its receives', read by the timeout message
            tracked.wait_on([1])
            assert tracked.silent() == [1] and "ranks not heard from: [1]" in tracked.describe_waiting()
            tracked.waited_on([1], heard=False)
            assert tracked.silent() == [] and tracked.heard() == {}
            tracked.wait_on([1])
            tracked.waited_on([1], heard=True)
            assert tracked.silent() == [] and set(tracked.heard()) == {1}
            ch.wait_on([1])  # a bare channel counts nothing
            ch.waited_on([1], heard=True)

            tracked.check_peer(1)  # alive, group not aborted: nothing to raise

            # a desync where this rank kept no digest: None, and nothing is aborted
            bare = t.channel(902, 1, [0, 1])
            assert bare.op_name is None and bare.desync(1, digest) is None
            bare.check_peer(1)

            # with a digest: the group breaks, with the transport's sentence, and stays broken
            err = tracked.desync(1, op_digest("all_reduce", {"dtype": "float32", "shape": [8]}), 32)
            assert isinstance(err, DistBackendError) and "desync detected: seq 5 on group 901" in str(err), err
            with pytest.raises(DistBackendError, match="desync detected"):
                ch.check_peer(1)

            # an abort: the error the op raises, and the first reason stays the group's
            other = TrackedP2P(t.channel(903, 2, [0, 1]), [0, 1], 0)
            err = other.abort_group("a reason of the test's")
            assert isinstance(err, DistBackendError) and "a reason of the test's" in str(err), err
            with pytest.raises(DistBackendError, match="a reason of the test's"):
                other.check_peer(1)
            assert "a reason of the test's" in str(other.abort_group("another reason"))
        finally:
            done.set()

    await run_world(2, fn, "gloo", timeout=30)


class _Recorder:
    """An OpLink of 4 ranks (global ranks 10-13) that records what reaches it."""

    def __init__(self) -> None:
        self.rank, self.size, self.ranks = 2, 4, (10, 11, 12, 13)
        self.digest, self.group_id, self.seq, self.line_seq, self.op_name = 7, 3, 5, 5, "all_reduce"
        self.calls: list[tuple[Any, ...]] = []

    async def send(self, peer: int, buf: np.ndarray, tag: int) -> None:
        self.calls.append(("send", peer, tag))

    async def recv(self, peer: int, buf: np.ndarray, tag: int) -> None:
        self.calls.append(("recv", peer, tag))

    def send_nowait(self, peer: int, buf: np.ndarray, tag: int) -> bool:
        self.calls.append(("send_nowait", peer, tag))
        return True

    def check_peer(self, peer: int) -> None:
        self.calls.append(("check_peer", peer))

    def abort_group(self, reason: str) -> DistBackendError:
        self.calls.append(("abort_group", reason))
        return DistBackendError(reason)

    def desync(self, peer: int, theirs: int, nbytes: int = -1) -> DistBackendError | None:
        self.calls.append(("desync", peer, theirs, nbytes))
        return None

    def wait_on(self, peers: Any) -> None:
        self.calls.append(("wait_on", list(peers)))

    def waited_on(self, peers: Any, heard: bool) -> None:
        self.calls.append(("waited_on", list(peers), heard))


async def test_a_host_link_maps_peers_and_tags_onto_the_ops_link() -> None:
    """``HostLink``: a host's ranks 0 and 2 of the op (here rank 2 is its rank 1), the op's identity
    its own (but its number in the host's line: one per phase, growing), peers mapped to the op's group ranks, algorithm tags moved to the phase's block and
    a sub-op's (the agreement's) left as they are."""
    op = _Recorder()
    assert isinstance(op, OpLink)
    link = HostLink(op, (0, 2), 4)
    assert isinstance(link, OpLink) and op_link(link) is link
    assert (link.rank, link.size, link.ranks) == (1, 2, (10, 12))
    assert (link.group_id, link.seq, link.op_name, link.digest) == (3, 5, "all_reduce", 7)
    # each in-host phase of the op has lane flags of its own (and room for its own pieces)
    assert link.line_seq == (5 * 32 + 4) * LINE_STEP
    assert HostLink(op, (0, 2), 5).line_seq >= link.line_seq + LINE_STEP and HostLink(op, (0, 2), 29).line_seq < 6 * 32 * LINE_STEP
    link.digest = 0  # the agreement clears the op's digest for its vote
    assert op.digest == 0
    buf = np.zeros(1, np.uint8)
    await link.send(0, buf, 3)
    await link.recv(0, buf, 3)
    assert link.send_nowait(0, buf, 30 * TAG_LIMIT + 1) is True
    link.check_peer(0)
    link.desync(0, 99, 4)
    link.wait_on([0])
    link.waited_on([0], heard=True)
    assert isinstance(link.abort_group("why"), DistBackendError)
    assert op.calls == [
        ("send", 0, 5 * TAG_LIMIT + 3),
        ("recv", 0, 5 * TAG_LIMIT + 3),
        ("send_nowait", 0, 30 * TAG_LIMIT + 1),
        ("check_peer", 0),
        ("desync", 0, 99, 4),
        ("wait_on", [0]),
        ("waited_on", [0], True),
        ("abort_group", "why"),
    ]


def test_a_p2p_without_a_link_is_refused() -> None:
    with pytest.raises(TypeError, match="not one"):
        op_link(local_world(2)[0])


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~3.0 s a run); a second loop waits them out again for the same result")
async def test_a_lane_wait_is_counted_by_the_ops_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's small all_reduce waits in the latency lane for rank 1, which never calls it: the
    timeout message names rank 1 among the ranks not heard from (``OpLink.wait_on``)."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")
    released = asyncio.Event()

    async def fn(rank: int) -> str:
        x = np.ones(4, np.float32)
        await dist.all_reduce(x)  # the group agrees on shared memory, with its lane
        lane_ops = dist.group.WORLD.backend.stats()["shm"]["lane_ops"]  # type: ignore[union-attr]
        assert lane_ops >= 1, dist.group.WORLD.backend.stats()["shm"]  # type: ignore[union-attr]
        if rank == 1:
            await released.wait()  # alive, so the wait ends by the timeout, not by a dead peer
            return ""
        try:
            await dist.all_reduce(x)
            return "no error"
        except DistTimeoutError as exc:
            return str(exc)
        finally:
            released.set()

    msg = (await run_world(2, fn, "gloo", timeout=30, pg_timeout=3))[0]
    assert "ranks not heard from: [1]" in msg, msg
