"""The P2P conformance kit: checks every implementation of the two-method point-to-point
contract (``aiodist.algorithms.p2p``'s docstring) must pass, as ``store_kit`` does for stores.

``await check_p2p(make)`` runs each check of ``P2P_CHECKS`` on a fresh op made by ``make(n)``,
an async context manager giving ``Op``: ``n`` connected ends of one op (``ends[r]`` is rank
r's ``P2P``) and ``abort(err)``, which breaks the op on every rank the way the implementation
does (``None`` where it has no abort). It raises ``AssertionError`` naming every check that
failed. The checks: a message of each dtype arrives byte for byte, zero-length messages are
delivered, messages are matched by (peer, tag) whichever of send and receive comes first,
``send_nowait`` keeps its three answers (True: sent; a future: sent, await it before changing
the buffer; False: nothing sent), a size mismatch is a ``ValueError`` on the receiving rank,
a cancelled receive raises ``CancelledError`` and leaves the op's other messages alone, and an
abort fails a pending receive with an error.

Every wait is bounded (``timeout`` seconds). Usage, in an implementation's tests::

    async def test_conformance():
        await check_p2p(make_my_op, skip={"abort"})
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodist.algorithms.p2p import P2P

__all__ = ["Op", "P2P_CHECKS", "check_p2p"]


@dataclass
class Op:
    """One op's ends (``ends[r]``: rank r's P2P) and how to break it (None: the
    implementation has no abort)."""

    ends: list[P2P]
    abort: Callable[[BaseException], Any] | None = None


Make = Callable[[int], AbstractAsyncContextManager[Op]]
Check = Callable[[Op, float], Awaitable[None]]


async def _within(timeout: float, *aws: Awaitable[Any]) -> list[Any]:
    """Every one of ``aws`` together, within ``timeout``; on a failure the rest are cancelled
    and waited for (a check leaves nothing running behind it)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        async with asyncio.timeout(timeout):
            return list(await asyncio.gather(*tasks))
    finally:
        await _settle(tasks)


async def _settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for t in tasks:
        if not t.done():
            t.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: a failure is the check's, already raised


async def bytes_of_every_dtype(op: Op, timeout: float) -> None:
    a, b = op.ends[0], op.ends[1]
    for k, dtype in enumerate(("uint8", "int32", "float32", "float64", "complex64", "bool")):
        src = (np.arange(37 + k) % 2 == 0) if dtype == "bool" else (np.arange(37 + k) * 3 - 5).astype(dtype)
        dst = np.zeros_like(src)
        await _within(timeout, a.send(1, src, k), b.recv(0, dst, k))
        assert dst.tobytes() == src.tobytes(), f"{dtype}: the bytes changed on the way"


async def zero_length_messages(op: Op, timeout: float) -> None:
    a, b = op.ends[0], op.ends[1]
    empty = np.empty(0, np.float32)
    await _within(timeout, a.send(1, empty, 3), b.recv(0, np.empty(0, np.float32), 3))
    await _within(timeout, b.send(0, empty, 4), a.recv(1, np.empty(0, np.float32), 4))  # the other way


async def matched_by_peer_and_tag(op: Op, timeout: float) -> None:
    """Receives posted before their sends, sends before their receives, tags out of order."""
    a, b = op.ends[0], op.ends[1]
    outs = {t: np.zeros(4, np.int64) for t in (10, 11, 12, 13)}
    early = [asyncio.ensure_future(b.recv(0, outs[t], t)) for t in (12, 10)]  # posted first
    try:
        await asyncio.sleep(0)
        await _within(timeout, *(a.send(1, np.full(4, t, np.int64), t) for t in (10, 11, 12, 13)))
        await _within(timeout, *early, b.recv(0, outs[13], 13), b.recv(0, outs[11], 11))  # 11 and 13 arrived first
    finally:
        await _settle(early)
    for t, got in outs.items():
        assert (got == t).all(), f"tag {t} received {got.tolist()}"
    if len(op.ends) > 2:  # the same tag from two peers is two messages
        c = op.ends[2]
        x, y = np.zeros(2, np.int64), np.zeros(2, np.int64)
        await _within(
            timeout, a.send(2, np.full(2, 100, np.int64), 20), b.send(2, np.full(2, 200, np.int64), 20), c.recv(1, y, 20), c.recv(0, x, 20)
        )
        assert (x == 100).all() and (y == 200).all(), (x, y)


async def send_nowait_keeps_its_answers(op: Op, timeout: float) -> None:
    a, b = op.ends[0], op.ends[1]
    src = np.arange(64, dtype=np.float32)
    got = a.send_nowait(1, src, 30)
    if got is False:  # nothing was sent: send it properly
        await _within(timeout, a.send(1, src, 30))
    elif got is not True:
        assert isinstance(got, asyncio.Future), f"send_nowait returned {got!r}: True, False or a future"
        await _within(timeout, got)
    dst = np.zeros(64, np.float32)
    await _within(timeout, b.recv(0, dst, 30))
    assert (dst == src).all()


async def a_size_mismatch_is_a_value_error(op: Op, timeout: float) -> None:
    a, b = op.ends[0], op.ends[1]
    # sizes whose digits are not the tag's: the error must name both sizes, not merely the tag
    send = asyncio.ensure_future(a.send(1, np.zeros(24, np.uint8), 40))
    try:
        async with asyncio.timeout(timeout):
            try:
                await b.recv(0, np.zeros(16, np.uint8), 40)
            except ValueError as exc:
                assert "24" in str(exc) and "16" in str(exc), f"the error names both sizes: {exc}"
            else:
                raise AssertionError("a 16-byte receive of a 24-byte message succeeded")
    finally:
        if not send.done():
            send.cancel()
        await asyncio.wait([send], timeout=timeout)
        if send.done() and not send.cancelled():
            send.exception()  # the sender may fail too (the receive told it): either is allowed


async def a_cancelled_receive_leaves_the_rest(op: Op, timeout: float) -> None:
    a, b = op.ends[0], op.ends[1]
    waiting = asyncio.ensure_future(b.recv(0, np.zeros(2, np.int32), 50))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.wait([waiting], timeout=timeout)
    assert waiting.cancelled(), "a cancelled receive did not end cancelled"
    dst = np.zeros(2, np.int32)
    await _within(timeout, a.send(1, np.full(2, 7, np.int32), 51), b.recv(0, dst, 51))
    assert (dst == 7).all()
    # the cancelled receive's own tag: the next message on it goes to the next receive, not to
    # the cancelled one
    again = np.zeros(2, np.int32)
    await _within(timeout, a.send(1, np.full(2, 9, np.int32), 50), b.recv(0, again, 50))
    assert (again == 9).all(), "a cancelled receive took the next message of its tag"


async def abort_fails_a_pending_receive(op: Op, timeout: float) -> None:
    assert op.abort is not None
    b = op.ends[1]
    waiting = asyncio.ensure_future(b.recv(0, np.zeros(2, np.int32), 60))
    try:
        await asyncio.sleep(0.01)
        op.abort(RuntimeError("aborted by the kit"))
        try:
            await asyncio.wait_for(asyncio.shield(waiting), timeout)
        except TimeoutError:
            raise AssertionError("an abort left a receive waiting") from None
        except Exception:  # noqa: BLE001 - any error: the implementation's own kind
            return
        raise AssertionError("a receive returned after the op was aborted")
    finally:
        await _settle([waiting])


P2P_CHECKS: dict[str, Check] = {
    "bytes": bytes_of_every_dtype,
    "zero_length": zero_length_messages,
    "matching": matched_by_peer_and_tag,
    "send_nowait": send_nowait_keeps_its_answers,
    "size_mismatch": a_size_mismatch_is_a_value_error,
    "cancel": a_cancelled_receive_leaves_the_rest,
    "abort": abort_fails_a_pending_receive,
}


async def check_p2p(make: Make, *, n: int = 3, timeout: float = 5.0, skip: Container[str] = ()) -> None:
    """Run every check of ``P2P_CHECKS`` (but ``skip``) on a fresh op of ``n`` ranks from
    ``make``; AssertionError naming each check that failed and why."""
    failed: list[str] = []
    for name, check in P2P_CHECKS.items():
        if name in skip:
            continue
        try:
            async with make(n) as op:
                if name == "abort" and op.abort is None:
                    continue
                await check(op, timeout)
        except Exception as exc:  # noqa: BLE001 - collected and reported together
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failed, "P2P conformance failed:\n  " + "\n  ".join(failed)
