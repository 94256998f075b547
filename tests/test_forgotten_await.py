"""A forgotten ``await`` never goes silent and never puts the ranks out of step, and torch's
non-blocking forms port by adding ``await`` to ``wait()`` alone (aiodist._pending).

Each test fails before: a communicating call was a bare coroutine, so ``dist.all_reduce(x)``
issued nothing (only Python's "never awaited" RuntimeWarning, at collection), and
``req = dist.isend(...); await req.wait()`` raised ``AttributeError: 'coroutine' object has no
attribute 'wait'``.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import aiodist as dist
from aiodist.testing import run_world

pytestmark = pytest.mark.timeout(30)


def _line_of(text: str) -> int:
    """The line number of ``text`` in this file (where a call is made)."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return i
    raise AssertionError(text)


async def test_a_forgotten_await_on_a_collective_is_an_error_naming_the_line_and_the_op_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fn(rank: int) -> float:
        x = np.full(2, float(rank + 1))
        if rank == 0:
            dist.all_reduce(x)  # forgotten await (only on rank 0): the op is issued anyway
        else:
            await dist.all_reduce(x)
        y = np.ones(1)
        await dist.all_reduce(y)  # the ranks are still in step: seq 1 on both
        assert y[0] == 2
        return float(x[0])

    with caplog.at_level(logging.ERROR, logger="aiodist.c10d"):
        out = await run_world(2, fn, timeout=20)
    assert out == [3.0, 3.0]  # rank 0's x was reduced too
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    line = _line_of("dist.all_reduce(x)  # forgotten await")
    assert any(f"all_reduce(...) called at {__file__}:{line} was never awaited" in m and "await dist.all_reduce" in m for m in errors), (
        errors
    )
    assert len(errors) == 1


async def test_torchs_non_blocking_forms_port_by_adding_await_to_wait() -> None:
    async def fn(rank: int) -> None:
        t = np.full(3, float(rank))
        if rank == 0:
            req = dist.isend(t, 1)  # torch: req = dist.isend(t, 1); req.wait()
            await req.wait()
            assert req.is_completed()
        else:
            req = dist.irecv(t, 0)
            await req.wait()
            assert req.source_rank() == 0 and (t == 0).all()
        x = np.ones(2)
        work = dist.all_reduce(x, async_op=True)  # torch: work = dist.all_reduce(x, async_op=True); work.wait()
        assert await work.wait() is True and work.is_completed() and work.is_success() and (x == 2).all()
        peer = 1 - rank
        a, b = np.full(2, float(rank)), np.zeros(2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)])
        for r in reqs:  # torch's loop over the returned list
            await r.wait()
        assert (b == peer).all() and len(reqs) == 2
        # every form documented before keeps working
        w = await dist.all_reduce(x, async_op=True)
        assert isinstance(w, dist.Work) and (await w)[0] is x
        if rank:
            assert await dist.recv(b, src=peer) == peer
        else:
            assert await dist.send(a, dst=peer) is None
        await asyncio.gather(dist.barrier(), asyncio.create_task(dist.all_reduce(np.ones(1))))

    await run_world(2, fn, timeout=20)


async def test_ops_issue_in_call_order_whoever_awaits_them() -> None:
    """torch's order: the order of the calls, not of the awaits."""

    async def fn(rank: int) -> list[float]:
        a, b = np.full(1, float(rank + 1)), np.full(1, 10.0 * (rank + 1))
        ha = dist.all_reduce(a)
        hb = dist.all_reduce(b)
        if rank == 0:
            await hb
            await ha
        else:
            await ha
            await hb
        return [float(a[0]), float(b[0])]

    assert await run_world(2, fn, timeout=20) == [[3.0, 30.0], [3.0, 30.0]]


@pytest.mark.one_loop(reason="mostly waits out its own deadlines (~0.6 s a run); a second loop waits them out again for the same result")
async def test_an_init_never_awaited_is_named_by_the_next_call(caplog: pytest.LogCaptureFixture) -> None:
    world = dist.World("unawaited")
    with dist.use_world(world):
        with caplog.at_level(logging.ERROR, logger="aiodist.c10d"):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=0.5)  # forgotten await
            with pytest.raises(ValueError) as e:
                await dist.all_reduce(np.ones(1))
        line = _line_of('dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=0.5)  # forgotten')
        assert str(e.value).startswith("Default process group has not been initialized")
        assert f"init_process_group was called at {__file__}:{line} but has not finished: was it awaited?" in str(e.value)
        assert any("init_process_group(...) called at" in r.getMessage() for r in caplog.records)
        for _ in range(50):  # the dropped init ran on in a task and failed at its timeout; let it end
            if world.init_site is None:
                break
            await asyncio.sleep(0.05)
        assert world.init_site is None and not dist.is_initialized()


async def test_two_concurrent_inits_refuse_the_second_and_leak_nothing() -> None:
    """Both used to pass the "already initialised" check (it is only true once one ends): the
    first backend leaked. Now the second is refused at once, naming where the first was called."""
    world = dist.World("twice")
    with dist.use_world(world):
        store = dist.HashStore()
        first = dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=5)
        with pytest.raises(ValueError, match=r"^trying to initialize the default process group twice! \(init_process_group called at "):
            await dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=5)
        await first
        assert dist.is_initialized() and dist.get_world_size() == 1
        await dist.destroy_process_group()


def test_a_tiny_group_timeout_still_gives_the_op_its_time() -> None:
    """A 50 ms timeout kept all 50 ms as the diagnosis grace: the op timed out at once."""
    from aiodist.c10d._diagnosis import grace_for

    # the op's own deadline is its time less the grace: 25 ms of 50 (it was 0); no op is run
    # here, since a real 25 ms deadline would make the test depend on the machine's load
    assert grace_for(0.05) == 0.025 and grace_for(1.0) == 0.1 and grace_for(100.0) == 5.0


async def test_a_forgotten_await_on_a_store_method_still_sends_it_and_says_where(caplog: pytest.LogCaptureFixture) -> None:
    async with dist.TCPStore("127.0.0.1", 0, 1, True, timeout=5) as store:
        with caplog.at_level(logging.ERROR, logger="aiodist.c10d"):
            store.set("k", "v")  # forgotten await: the request is sent anyway
            assert await store.get("k") == b"v"
        line = _line_of('store.set("k", "v")  # forgotten await')
        assert any(
            f"store.set(...) called at {__file__}:{line} was never awaited" in r.getMessage() and "await store.set" in r.getMessage()
            for r in caplog.records
        )


def test_a_call_made_outside_a_loop_starts_when_run() -> None:
    """``asyncio.run(store.get(k))``: the handle is made before the loop runs, so it starts then."""
    store = dist.HashStore(timeout=5)
    asyncio.run(store.set("k", "v"))
    assert asyncio.run(store.get("k")) == b"v"


async def test_a_group_that_was_not_awaited_is_named_with_its_line() -> None:
    """``g = dist.new_group([0, 1])`` without its await, then an op on it: the error names the
    call, its line and the fix (it said only "group must be a ProcessGroup or None, not Pending")."""
    from aiodist.testing import run_world

    async def fn(rank: int) -> str:
        g = dist.new_group([0, 1])  # forgotten await
        try:
            with pytest.raises(TypeError) as e:
                await dist.all_reduce(np.ones(2, np.float32), group=g)
            return str(e.value)
        finally:
            await g  # the group is made on every rank, so nothing is left running

    line = _line_of("g = dist.new_group([0, 1])  # forgotten await")
    for msg in await run_world(2, fn):
        assert msg.startswith(f"all_reduce: group is the result of new_group(...) called at {__file__}:{line}, which was not awaited"), msg
        assert "write `await dist.new_group(...)`" in msg


async def test_the_never_awaited_error_comes_before_the_error_it_causes(caplog: pytest.LogCaptureFixture) -> None:
    """The handle passed on as a group is still alive when the TypeError it causes propagates (it
    was only logged when freed, after the traceback): the ERROR is logged when it is refused."""

    async def fn(rank: int) -> list[str]:
        g = dist.new_group([0, 1])  # forgotten await, still referenced below
        with pytest.raises(TypeError):
            await dist.all_reduce(np.ones(2, np.float32), group=g)
        said = [r.getMessage() for r in caplog.records if "was never awaited" in r.getMessage()]
        await g
        return said

    with caplog.at_level(logging.ERROR, logger="aiodist.c10d"):
        results = await run_world(2, fn)
    line = _line_of("g = dist.new_group([0, 1])  # forgotten await, still referenced below")
    for said in results:
        assert any(m.startswith(f"new_group(...) called at {__file__}:{line} was never awaited") for m in said), said
    assert sum("was never awaited" in r.getMessage() for r in caplog.records) == 2  # once per rank, not again when freed


async def test_a_handle_used_as_a_number_names_the_call() -> None:
    async def fn(rank: int) -> str:
        h = dist.barrier()  # forgotten await
        try:
            with pytest.raises(TypeError) as e:
                range(h)  # type: ignore[call-overload]
            return str(e.value)
        finally:
            await h

    for msg in await run_world(2, fn):
        assert msg.startswith("a number is the result of barrier(...) called at") and "write `await dist.barrier(...)`" in msg, msg


def test_aiodists_errors_carry_level_and_logger_where_logging_is_not_configured() -> None:
    """Python's last-resort handler prints a bare message (it reads like a print): aiodist's
    fallback prints logging's default format instead, and stays silent once the application
    configures logging."""
    import subprocess
    import sys

    code = "import logging, aiodist; logging.getLogger('aiodist.c10d').error('boom %d', 1); logging.getLogger('aiodist.x').info('quiet')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "ERROR:aiodist.c10d:boom 1\n", r.stderr
    configured = "import logging; logging.basicConfig(format='app %(message)s'); " + code
    r = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "app boom 1\n", r.stderr


async def test_a_store_that_was_not_awaited_is_named_where_a_store_is_expected() -> None:
    store = dist.HashStore()
    handle = store.get("k")  # a Pending (never awaited: its wait is cancelled below)
    try:
        with pytest.raises(
            TypeError,
            match=r"PrefixStore: store is the result of store\.get\(\.\.\.\) called at .*test_forgotten_await\.py:\d+, which was not awaited",
        ):
            dist.PrefixStore("p", handle)  # type: ignore[arg-type]
    finally:
        handle.close()


async def test_a_handle_has_torchs_work_methods_and_forwards_nothing_else() -> None:
    """The handle's surface is explicit: torch's Work methods answer from the call's Work (or,
    for a call that returns no Work, from what it returned); anything else names the call."""

    async def fn(rank: int) -> None:
        x = np.ones(2)
        h = dist.all_reduce(x, async_op=True)
        await h.wait()
        assert h.is_success() and h.exception() is None and h.result()[0] is x
        assert h.get_future() is await h
        h.synchronize()
        h.block_current_stream()
        with pytest.raises(AttributeError, match=r"all_reduce\(\.\.\.\) returned a handle.*no 'seq'"):
            _ = h.seq
        peer = 1 - rank
        t = np.zeros(1)
        if rank:
            r = dist.recv(t, src=peer)
            await r
            assert r.source_rank() == peer and r.result() == peer and r.is_success()
        else:
            await dist.send(np.ones(1), dst=peer)
        p = dist.barrier()
        with pytest.raises(RuntimeError, match=r"barrier\(\.\.\.\)\.result\(\): the call has not produced its Work yet"):
            p.result()
        await p

    await run_world(2, fn, timeout=20)


async def test_a_task_made_from_a_handle_and_cancelled_before_it_ran_throws_into_the_call() -> None:
    """``create_task(handle)`` cancelled before its first step: the cancellation reaches the call
    where it waits (not the start of a fresh generator, which the call would never see)."""
    from aiodist._pending import communicating

    seen: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    @communicating
    async def call() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled in the call")
            raise

    task = asyncio.create_task(call())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled in the call"]


async def test_a_forgotten_await_on_a_call_done_in_its_first_step_is_named_too(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept small call whose peer already waits in shared memory is done in its first step
    (communicating's ``now``: a handle without a coroutine); dropped, it
    still logs the ERROR with its line, and the ranks stay in step."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> tuple[float, int]:
        x = np.ones(1, np.float32)
        for _ in range(3):  # the agreement, and the kept call
            await dist.all_reduce(x)
        pg = dist.group.WORLD
        if rank == 1:
            await asyncio.sleep(0.01)  # rank 0 waits in the lane: rank 1's call is done in its first step
            before = pg.stats()["eager"]
            x[0] = 2.0
            dist.all_reduce(x)  # forgotten await, done in the call
            done_in_call = pg.stats()["eager"] - before
        else:
            x[0] = 1.0
            await dist.all_reduce(x)
            done_in_call = 0
        y = np.ones(1, np.float32)
        await dist.all_reduce(y)  # still in step
        assert y[0] == 2.0
        return float(x[0]), done_in_call

    with caplog.at_level(logging.ERROR, logger="aiodist.c10d"):
        out = await run_world(2, fn, "gloo", timeout=20)
    assert out == [(3.0, 0), (3.0, 1)], out
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    line = _line_of("dist.all_reduce(x)  # forgotten await, done in the call")
    assert [m for m in errors if f"all_reduce(...) called at {__file__}:{line} was never awaited" in m], errors
    assert len(errors) == 1, errors


async def test_a_kept_call_with_a_wrong_argument_is_refused_as_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step takes the call's arguments: one it does not know is the call's TypeError
    (named ``all_reduce``), refused on the calling rank with nothing sent, the group usable."""
    monkeypatch.setenv("AIODIST_SHM_BYTES", "1M")

    async def fn(rank: int) -> float:
        x = np.ones(1, np.float32)
        for _ in range(3):
            await dist.all_reduce(x)
        with pytest.raises(TypeError, match=r"^all_reduce\(\) got an unexpected keyword argument 'groupp'"):
            dist.all_reduce(x, groupp=None)  # type: ignore[call-arg]
        x[0] = rank + 1.0
        await dist.all_reduce(x)
        return float(x[0])

    assert await run_world(2, fn, "gloo", timeout=20) == [3.0, 3.0]
