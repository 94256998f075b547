"""A TCPStore server in its own process (``python -m aiodist.store``), SIGKILLed or SIGSTOPped
under clients in this process: every client call fails within its own timeout (+ 0.5 s) with a
DistError whose message holds the server's address (``host:port``). Both the calls in flight at
the moment of the signal (a loop of each call kind, hammering the server; a ``get`` and a
``wait`` blocked on keys nobody sets) and the calls made after it are covered.

The store timeout is 2 s, a ``wait``'s explicit timeout 1 s: the bound each call is held to is
its own (``wait``'s 1 s, the others' 2 s)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from aiodist.errors import DistError
from aiodist.store.tcp import TCPStore

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]

HOST = "127.0.0.1"
STORE_S = 2.0  # the store's timeout: every call but wait's
WAIT_S = 1.0  # wait's explicit timeout
SLACK = 0.5  # what the issue allows past a call's own timeout
START_S = 20.0  # a bound on the server's start-up (an interpreter importing aiodist on 2 loaded cores)
ROOT = Path(__file__).resolve().parents[2]

Call = Callable[[TCPStore, int], Awaitable[object]]

# each call kind, with the timeout that bounds it; ``i`` keeps the hammer's keys apart
CALLS: dict[str, tuple[Call, float]] = {
    "set": (lambda s, i: s.set(f"k{i}", b"v"), STORE_S),
    "get": (lambda s, i: s.get("there"), STORE_S),
    "add": (lambda s, i: s.add("n", 1), STORE_S),
    "wait": (lambda s, i: s.wait(["there"], WAIT_S), WAIT_S),
    "check": (lambda s, i: s.check(["there"]), STORE_S),
    "compare_set": (lambda s, i: s.compare_set("c", b"", b"x"), STORE_S),
    "delete_key": (lambda s, i: s.delete_key(f"k{i}"), STORE_S),
    "num_keys": (lambda s, i: s.num_keys(), STORE_S),
}


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The server process and its port; stopped, continued and killed at the end whatever happened."""
    p = subprocess.Popen(
        [sys.executable, "-m", "aiodist.store", "--host", HOST, "--port", "0", "--log-level", "WARNING"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert p.stdout is not None
        line = _readline(p, START_S)
        m = re.search(r"listening on \S+:(\d+)", line)
        assert m, f"the store server printed {line!r} (exit code {p.poll()})"
        yield p, int(m.group(1))
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too, but let it run its last step
            p.kill()
        p.wait(timeout=10)
        if p.stdout is not None:
            p.stdout.close()


def _readline(p: subprocess.Popen[str], limit: float) -> str:
    """One line of ``p``'s stdout within ``limit`` seconds (a hung server fails the test, not the tier)."""
    import selectors

    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=limit):
            return ""
    return p.stdout.readline()


def _check_failure(name: str, took: float, bound: float, exc: BaseException | None, addr: str) -> None:
    assert exc is not None, f"{name} returned after the server's fault"
    assert isinstance(exc, DistError), f"{name} raised {type(exc).__name__}, not a DistError: {exc}"
    assert took < bound + SLACK, f"{name} took {took:.2f} s, over its own timeout {bound:g} s + {SLACK} s: {exc}"
    assert addr in str(exc), f"{name}'s error does not name the store's address {addr}: {exc}"


async def _timed(call: Awaitable[object]) -> tuple[float, BaseException | None]:
    t = time.monotonic()
    try:
        await call
    except Exception as exc:
        return time.monotonic() - t, exc
    return time.monotonic() - t, None


async def _hammer(store: TCPStore, name: str, stop: asyncio.Event) -> tuple[int, float, BaseException | None]:
    """Repeat one call kind until it fails (or ``stop`` is set before any fault): how many calls
    succeeded, and the failing call's time and error."""
    call, _ = CALLS[name]
    n = 0
    while not stop.is_set():
        took, exc = await _timed(call(store, n))
        if exc is not None:
            return n, took, exc
        n += 1
    return n, 0.0, None


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~2.8 s a run); a second loop waits them out again for the same result")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_every_client_call_fails_within_its_own_timeout_naming_the_store(
    server: tuple[subprocess.Popen[str], int], sig: signal.Signals
) -> None:
    proc, port = server
    addr = f"{HOST}:{port}"
    stores = [await TCPStore(HOST, port, timeout=STORE_S) for _ in CALLS]
    try:
        await stores[0].set("there", b"yes")
        # wait and get on keys that never come: blocked in the server at the signal. They are
        # called in this task and awaited in another (as gather or create_task do): the first
        # step of a store call runs in the caller's task, and wait's deadline used to cancel that
        # task (this test) instead of ending the wait
        blocked = {
            "get (blocked on a missing key)": (asyncio.ensure_future(_timed(stores[0].get("never"))), STORE_S),
            "wait (blocked on a missing key)": (asyncio.ensure_future(_timed(stores[0].wait(["never"], WAIT_S))), WAIT_S),
        }
        # one store object per call kind, so that each hammer's connection is its own
        never = asyncio.Event()
        hammers = {name: asyncio.ensure_future(_hammer(s, name, never)) for name, s in zip(CALLS, stores)}
        await asyncio.sleep(0.3)  # every hammer through some calls, the blocked ones sent
        assert not any(h.done() for h in hammers.values()), {n: h.result() for n, h in hammers.items() if h.done()}
        t_sig = time.monotonic()
        os.kill(proc.pid, sig)
        await asyncio.sleep(0.2)  # the signal has landed (a stopped or dead server answers nothing more)
        # the calls made after it (while those in flight still run), on a store in use and on a
        # fresh clone (which connects first)
        fresh = stores[0].clone()
        after = {
            f"{name} ({which})": (asyncio.ensure_future(_timed(call(s, 0))), bound)
            for which, s in (("after the fault", stores[1]), ("a clone made after the fault", fresh))
            for name, (call, bound) in CALLS.items()
        }
        # the calls in flight at the signal
        results = {name: await asyncio.wait_for(h, STORE_S + 5) for name, h in hammers.items()}
        for name, (n, took, exc) in results.items():
            assert n > 0, f"{name} never succeeded before the signal"
            _check_failure(f"{name} (in flight at {sig.name})", took, CALLS[name][1], exc, addr)
        for name, (fut, bound) in blocked.items():
            took, exc = await asyncio.wait_for(fut, STORE_S + 5)
            # they started 0.3 s before the signal: their own timeout bounds them from their start
            _check_failure(f"{name} at {sig.name}", took, bound, exc, addr)
        in_flight_s = time.monotonic() - t_sig
        took_after: dict[str, float] = {}
        for name, (fut, bound) in after.items():
            took, exc = await asyncio.wait_for(fut, STORE_S + 5)
            _check_failure(name, took, bound, exc, addr)
            took_after[name] = took
        print(f"\n{sig.name}: the calls in flight all failed by {in_flight_s:.2f} s after the signal, each within its own timeout")
        print("  calls after it: " + ", ".join(f"{n} {t:.2f} s" for n, t in took_after.items()))
        print(f"  e.g. {type(exc).__name__}: {exc}")
        await fresh.close()
    finally:
        for s in stores:
            await s.close()
