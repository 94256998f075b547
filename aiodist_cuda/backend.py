"""The "nccl" backend: whole collectives on CuPy arrays through ``cupy.cuda.nccl``.

Per group (``_Comm``):
- a communicator, made on first use (or at ``init_process_group(device_id=...)``): group rank 0
  makes NCCL's unique id and shares its 128 raw bytes through the group's store; every rank
  first publishes ``host:device`` there, so two ranks on one GPU get an actionable error instead
  of NCCL's. ``ncclCommInitRank`` blocks until every rank joins, so it runs on the group's
  launcher thread, never on the event loop.
- a dedicated non-blocking CUDA stream (high priority with ``NcclOptions(is_high_priority_stream=True)``).
- a *launcher thread* that makes the NCCL calls in issue order (NCCL needs every rank to enqueue
  a communicator's ops in one order; the first ops also connect peers, which blocks until they
  answer: off the loop). ``AIODIST_CUDA_LAUNCH=loop`` launches on the loop instead once the
  communicator exists and nothing is queued (lower latency, but a first-time peer connection
  then blocks the loop).
- completion: a *completion thread* waits on each op's event (``cudaEventSynchronize`` releases
  the GIL; a blocking-sync event, so the thread sleeps rather than spins) and tells the loop with
  ``call_soon_threadsafe``. ``AIODIST_CUDA_COMPLETION=hostfunc`` uses a stream host function
  instead (``cudaLaunchHostFunc``; the callback only calls ``call_soon_threadsafe``), and
  ``AIODIST_CUDA_SPIN=1`` makes the completion thread spin on the event (lowest latency, a core busy).

An op: at issue, on the loop, its arguments are checked (TypeError/ValueError, nothing enqueued),
an event is recorded on the caller's *current stream*, and the op is queued for the launcher;
the launcher makes the group's stream wait on that event, makes the NCCL calls, records a
completion event. The arrays stay referenced until the GPU is done (CuPy has no recordStream).

Failures: an NCCL error becomes ``DistBackendError`` with NCCL's message and a hint; any failure
or timeout of a group's op breaks the group (``ProcessGroup``), which calls ``abort_group``:
the communicator is aborted (``ncclCommAbort``, on its own thread), so no rank hangs in it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiodist.backends.base import BackendOptions, ProcessGroupLike
from aiodist.backends.device import DeviceBackend
from aiodist.errors import DistBackendError
from aiodist.knobs import value
from aiodist_cuda import _cupy
from aiodist_cuda._ops import BUILDERS, SUPPORTED_OPS, Checker, Plan
from aiodist_cuda._tables import nccl_error_name, nccl_hint
from aiodist_cuda.work import CudaWork, OpRecord

__all__ = ["NcclBackend", "NcclOptions", "create_nccl_backend", "nccl_error", "parse_device", "SUPPORTED_OPS"]

log = logging.getLogger("aiodist_cuda")


@dataclass
class NcclOptions:
    """``pg_options`` of the NCCL backend (torch's ``ProcessGroupNCCL.Options``, what applies)."""

    is_high_priority_stream: bool = False


def nccl_error(exc: BaseException, what: str) -> DistBackendError:
    """An NCCL (or CUDA) error as a DistBackendError: NCCL's words, then what to do."""
    status = getattr(exc, "status", None) if type(exc).__name__ == "NcclError" else None  # CUDA errors carry a status too
    if status is None and isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], int):
        status = exc.args[0]  # CuPy's NcclError knows results 0-5 only; naming 6+ fails with KeyError(status)
    if isinstance(status, int):
        hint = nccl_hint(status)
        msg = f"{what}: NCCL error {nccl_error_name(status)}: {exc}"
        if hint:
            msg += f"; hint: {hint}"
    else:
        msg = f"{what}: {type(exc).__name__}: {exc}"
    err = DistBackendError(msg)
    err.__cause__ = exc
    return err


# -- one group's communicator, stream and threads --------------------------------------------------


class _SplitJob:
    """An ``ncclCommSplit`` of a parent communicator, run on the parent's launcher thread in
    issue order; the child (None on ranks not in the new group) gets the new communicator."""

    def __init__(self, child: _Comm | None, color: int, key: int) -> None:
        self.child, self.color, self.key = child, color, key

    def run(self, parent: _Comm) -> None:
        try:
            if parent.aborted is not None:
                raise DistBackendError(f"cannot split {parent.desc}: its communicator was aborted ({parent.aborted})")
            with parent.cupy.cuda.Device(parent.device):
                parent.stream.synchronize()  # no parent op outstanding while it splits (NCCL's rule)
                new = parent.comm.commSplit(self.color, self.key)
        except BaseException as exc:
            self.fail(exc if isinstance(exc, DistBackendError) else nccl_error(exc, f"ncclCommSplit of {parent.desc}"))
            return
        if self.child is not None:
            self.child._uid.put(new)

    def fail(self, err: BaseException) -> None:
        if self.child is not None:
            self.child._uid.put(err)


class _Comm:
    """A group's NCCL communicator, stream, launcher thread and completion thread."""

    def __init__(self, backend: NcclBackend, pg: ProcessGroupLike, device: int, *, split: bool = False) -> None:
        self.backend = backend
        self.cupy, self.nccl = backend.cupy, backend.nccl
        self.group_id = pg.group_id
        self.desc = pg.describe()
        self.rank = pg.rank()
        self.size = pg.size()
        self.device = device
        self.timeout_s = pg.timeout_s
        self.loop = asyncio.get_running_loop()
        self.comm: Any = None
        self.made: asyncio.Future[None] = self.loop.create_future()  # the communicator exists (or failed)
        self.aborted: str | None = None
        self.lock = threading.Lock()  # held while launching (loop launches skip when it is busy)
        # ops handed to the launcher and ops it has launched: each written by one thread only
        self.submitted = 0
        self.launched = 0
        self.pending: set[OpRecord] = set()  # submitted, not yet ended on the GPU (read on the loop)
        with self.cupy.cuda.Device(device):
            priority = -100 if backend.high_priority else 0  # clamped by CUDA to the device's range
            self.stream = self.cupy.cuda.Stream(non_blocking=True, priority=priority)
        self._uid: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._launch_q: queue.SimpleQueue[OpRecord | _SplitJob | None] = queue.SimpleQueue()
        self._done_q: queue.SimpleQueue[OpRecord | None] = queue.SimpleQueue()
        self._launcher = threading.Thread(target=self._launcher_main, name=f"aiodist-nccl-launch-{self.group_id}", daemon=True)
        self._completer = threading.Thread(target=self._completer_main, name=f"aiodist-nccl-done-{self.group_id}", daemon=True)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watchdog_main, name=f"aiodist-nccl-watch-{self.group_id}", daemon=True)
        self._launcher.start()
        self._completer.start()
        self._watchdog.start()
        # a split child gets its communicator from the parent's launcher (ncclCommSplit), not an id
        self._exchange_task: asyncio.Task[None] | None = (
            None if split else self.loop.create_task(self._exchange(pg), name=f"aiodist nccl id {self.desc}")
        )
        self.made.add_done_callback(lambda f: f.exception())  # read here: failures also reach each op

    # -- making the communicator ------------------------------------------------------------------

    async def _exchange(self, pg: ProcessGroupLike) -> None:
        """Publish this rank's device, share the unique id (group rank 0 makes it), hand it to
        the launcher thread (which makes the communicator)."""
        store = pg.store
        key = f"aiodist_cuda/{self.group_id}/"
        try:
            if store is None:
                raise DistBackendError(f"{self.desc} has no store to share NCCL's unique id through")
            await store.set(f"{key}dev/{self.rank}", f"{socket.gethostname()}:{self.device}")
            if self.rank == 0:
                uid = await asyncio.to_thread(self.nccl.get_unique_id)  # bytes (CuPy 14), C chars before
                await store.set(f"{key}uid", uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid))
            keys = [f"{key}uid"] + [f"{key}dev/{r}" for r in range(self.size)]
            await store.wait(keys, self.timeout_s)
            got = await store.multi_get(keys)
            if await store.add(f"{key}read", 1) == self.size:  # the last reader clears the keys, so a
                for k in [*keys, f"{key}read"]:  # World made later on the same store starts afresh
                    await store.delete_key(k)
            self._check_devices([v.decode() for v in got[1:]], pg)
            raw = got[0]
            if len(raw) != 128:
                raise DistBackendError(f"{self.desc}: NCCL's unique id from the store has {len(raw)} bytes, not 128")
            self._uid.put(bytes(raw))
        except BaseException as exc:
            self._uid.put(exc)
            if not self.made.done():
                self.made.set_exception(exc if isinstance(exc, Exception) else DistBackendError(str(exc)))
            if not isinstance(exc, Exception):
                raise

    def _check_devices(self, places: list[str], pg: ProcessGroupLike) -> None:
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
            return  # NCCL >= 2.30 lets ranks share a GPU when asked to (experimental)
        seen: dict[str, int] = {}
        for r, place in enumerate(places):
            if place in seen:
                host, dev = place.rsplit(":", 1)
                a, b = pg.ranks[seen[place]], pg.ranks[r]
                raise DistBackendError(
                    f"{self.desc}: ranks {a} and {b} both use cuda:{dev} on {host}; "
                    "set the device from LOCAL_RANK (cupy.cuda.Device(int(os.environ['LOCAL_RANK'])).use() before the first op, "
                    "or init_process_group(device_id=...)); NCCL needs one GPU per rank"
                )
            seen[place] = r

    def _launcher_main(self) -> None:
        try:
            self.cupy.cuda.Device(self.device).use()  # the current device is per thread
            uid = self._uid.get()
            if isinstance(uid, BaseException):
                raise uid
            comm = uid if not isinstance(uid, bytes) else self._init_rank(uid)  # a split child: already made
        except BaseException as exc:
            err = exc if isinstance(exc, DistBackendError) else nccl_error(exc, f"making the NCCL communicator of {self.desc}")
            self._post(self._made_failed, err)
            self._drain_failed(err)
            return
        self.comm = comm
        self._post(self._made_ok)
        while True:
            rec = self._launch_q.get()
            if rec is None:
                return
            with self.lock:
                if isinstance(rec, _SplitJob):
                    rec.run(self)
                else:
                    self._launch(rec)
                self.launched += 1

    def _init_rank(self, uid: bytes) -> Any:
        """``ncclCommInitRank``: CuPy 14 takes the id as bytes, CuPy 13 as a tuple of C chars."""
        try:
            return self.nccl.NcclCommunicator(self.size, uid, self.rank)
        except TypeError:
            return self.nccl.NcclCommunicator(self.size, tuple(b - 256 if b > 127 else b for b in uid), self.rank)

    def _made_ok(self) -> None:
        if not self.made.done():
            self.made.set_result(None)

    def _made_failed(self, err: BaseException) -> None:
        if not self.made.done():
            self.made.set_exception(err)

    def _drain_failed(self, err: BaseException) -> None:
        while True:
            rec = self._launch_q.get()
            if rec is None:
                return
            if isinstance(rec, _SplitJob):
                rec.fail(err)
            else:
                self._post(rec.fail, err)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    # -- launching and completing -------------------------------------------------------------------

    def split(self, job: _SplitJob) -> None:
        """Queue an ``ncclCommSplit`` of this communicator behind the ops issued before it."""
        self.submitted += 1
        self._launch_q.put(job)

    def submit(self, rec: OpRecord) -> None:
        """Queue ``rec`` for the launcher, or launch it here (``AIODIST_CUDA_LAUNCH=loop``) when
        the communicator exists and nothing is queued before it."""
        self.pending.add(rec)
        rec.on_end = self.pending.discard
        if self.backend.launch_on_loop and self.comm is not None and self.launched == self.submitted and self.lock.acquire(blocking=False):
            try:  # nothing queued before it (checked again under the lock): launch it here, in order
                if self.launched == self.submitted:
                    self._launch(rec)
                    return
            finally:
                self.lock.release()
        self.submitted += 1
        self._launch_q.put(rec)

    def _launch(self, rec: OpRecord) -> None:
        if self.aborted is not None:
            self._post(rec.fail, DistBackendError(f"{rec.what}: the group's communicator was aborted ({self.aborted})"))
            return
        cupy = self.cupy
        try:
            with cupy.cuda.Device(self.device):
                stream = self.stream
                stream.wait_event(rec.ready)
                with stream:
                    rec.launch(self.comm, stream)
                ev = cupy.cuda.Event(block=not self.backend.spin, disable_timing=True)
                ev.record(stream)
        except BaseException as exc:
            self._post(rec.fail, exc if isinstance(exc, DistBackendError) else nccl_error(exc, rec.what))
            rec.enqueued.set()
            return
        rec.done_event = ev
        rec.enqueued.set()
        if self.backend.hostfunc:
            stream.launch_host_func(self._host_done, rec)
        else:
            self._done_q.put(rec)

    def _host_done(self, rec: OpRecord) -> None:
        """A CUDA host function: no CUDA calls allowed here; only hand the op to the loop."""
        self._post(self._resolve_checked, rec)

    def _resolve_checked(self, rec: OpRecord) -> None:
        """On the loop: the op's events fired; NCCL's asynchronous error, if any, fails it."""
        try:
            if self.comm is not None and self.aborted is None:
                self.comm.check_async_error()
        except BaseException as exc:
            rec.fail(nccl_error(exc, rec.what))
            return
        rec.resolve()

    def _completer_main(self) -> None:
        while True:
            rec = self._done_q.get()
            if rec is None:
                return
            try:
                rec.done_event.synchronize()  # releases the GIL while it waits
                if self.comm is not None and self.aborted is None:
                    self.comm.check_async_error()
            except BaseException as exc:
                self._post(rec.fail, nccl_error(exc, rec.what))
                continue
            self._post(rec.resolve)

    def _watchdog_main(self) -> None:
        """While ops are on the GPU, read NCCL's asynchronous error every 100 ms (torch's watchdog
        does the same): a kernel stuck on a failed peer never completes, so its error would
        otherwise surface only as the group's timeout."""
        while not self._stop.wait(0.1):
            comm = self.comm
            if comm is None or not self.pending or self.aborted is not None:
                continue
            try:
                comm.check_async_error()
            except BaseException as exc:
                self._post(self._async_failed, nccl_error(exc, f"NCCL communicator of {self.desc}"))
                return

    def _async_failed(self, err: DistBackendError) -> None:
        """On the loop: NCCL reported an asynchronous error: every op in flight fails with it
        (the group then breaks and aborts the communicator)."""
        for rec in list(self.pending):
            rec.fail(DistBackendError(f"{rec.what}: {err}"))

    # -- teardown -------------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Abort the communicator (on its own thread: ncclCommAbort may take a while) and stop
        the threads. Ops already queued fail; a communicator still being made cannot be aborted
        (NCCL's blocking init): its thread ends when the init does."""
        if self.aborted is not None:
            return
        self.aborted = reason
        comm = self.comm
        if comm is not None:
            threading.Thread(target=self._abort_comm, args=(comm,), name=f"aiodist-nccl-abort-{self.group_id}", daemon=True).start()
        self._launch_q.put(None)
        self._done_q.put(None)
        self._uid.put(DistBackendError(f"{self.desc} was aborted: {reason}"))
        if self._exchange_task is not None:
            self._exchange_task.cancel()
        self._stop.set()
        if not self.made.done():
            self.made.set_exception(DistBackendError(f"{self.desc} was aborted before its communicator was made: {reason}"))

    @staticmethod
    def _abort_comm(comm: Any) -> None:
        try:
            comm.abort()
        except Exception as exc:  # pragma: no cover - best effort on a broken communicator
            log.warning("ncclCommAbort: %s", exc)

    async def close(self) -> None:
        """Destroy the communicator (its ops have all ended), or abort it where an op is still in
        flight or the communicator was never made (ncclCommDestroy would wait for them)."""
        if self.aborted is None and (self.pending or self.comm is None):
            self.abort("the group was destroyed with ops in flight" if self.pending else "the group was destroyed")
        if self.aborted is None:
            self.aborted = "the group was destroyed"
            self._stop.set()
            self._launch_q.put(None)
            self._done_q.put(None)
            self._uid.put(DistBackendError(f"{self.desc} was destroyed"))
            comm = self.comm
            if comm is not None:
                await asyncio.to_thread(self._finish, comm)
        if self._exchange_task is not None:
            self._exchange_task.cancel()

    def _finish(self, comm: Any) -> None:
        self._launcher.join(5.0)  # nothing is in flight: it ends at once
        try:
            with self.cupy.cuda.Device(self.device):
                self.stream.synchronize()
            comm.destroy()
        except Exception as exc:  # pragma: no cover - best effort at teardown
            log.warning("destroying the NCCL communicator of %s: %s", self.desc, exc)


def parse_device(device: Any) -> int:
    """A CUDA device index from ``device_id``'s forms: an int, ``"cuda:1"``, ``"cuda"`` (the
    current device), a torch.device, a ``cupy.cuda.Device``."""
    if isinstance(device, bool):
        raise TypeError("device_id must be an int, 'cuda:N', a torch.device or a cupy.cuda.Device, not a bool")
    if isinstance(device, int):
        index: Any = device
    elif isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"device_id {device!r} is not a CUDA device")
        index = int(idx) if idx else None
    elif getattr(device, "type", None) is not None:  # torch.device
        if device.type != "cuda":
            raise ValueError(f"device_id {device} is not a CUDA device")
        index = device.index
    else:
        index = getattr(device, "id", None)  # cupy.cuda.Device
        if index is None:
            raise TypeError(f"device_id must be an int, 'cuda:N', a torch.device or a cupy.cuda.Device, not {type(device).__name__}")
    if index is None:
        cupy, _ = _cupy.load()
        return int(cupy.cuda.runtime.getDevice())
    if index < 0:
        raise ValueError(f"device_id {device!r}: a device index is >= 0")
    return int(index)


# -- the backend -------------------------------------------------------------------------------------


class NcclBackend(DeviceBackend):
    """One process's NCCL backend: a ``_Comm`` per group that used it."""

    name = "nccl"
    device_type = "cuda"

    def __init__(self, rank: int, world_size: int, options: NcclOptions | None = None, device_id: int | None = None) -> None:
        super().__init__(rank, world_size)
        self.cupy, self.nccl = _cupy.load()
        self.check = Checker(self.cupy)
        self.high_priority = bool(options and options.is_high_priority_stream)
        self.device_id = device_id
        self.launch_on_loop = value("AIODIST_CUDA_LAUNCH") == "loop"
        self.hostfunc = value("AIODIST_CUDA_COMPLETION") == "hostfunc"
        self.spin = value("AIODIST_CUDA_SPIN") == "1"
        self.comms: dict[int, _Comm] = {}
        self.ops = 0

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            groups=len(self.comms),
            ops=self.ops,
            launch="loop" if self.launch_on_loop else "thread",
            completion="hostfunc" if self.hostfunc else ("spin" if self.spin else "thread"),
            nccl_version=_cupy.nccl_version(),
        )
        return out

    # -- communicators ------------------------------------------------------------------------------

    def _comm(self, pg: ProcessGroupLike, device: int) -> _Comm:
        c = self.comms.get(pg.group_id)
        if c is None:
            c = self.comms[pg.group_id] = _Comm(self, pg, device)
        elif c.device != device:
            raise ValueError(
                f"{pg.describe()} runs on cuda:{c.device}; this op's arrays are on cuda:{device} (one device per rank and group)"
            )
        return c

    def _current_device(self) -> int:
        if self.device_id is not None:
            return self.device_id
        return int(self.cupy.cuda.runtime.getDevice())

    async def connect(self, pg: ProcessGroupLike, device_id: Any = None) -> None:
        if device_id is not None:
            self.device_id = parse_device(device_id)
        c = self._comm(pg, self._current_device())
        async with asyncio.timeout(pg.timeout_s):
            await asyncio.shield(c.made)

    def abort_group(self, group_id: int, reason: str) -> None:
        c = self.comms.pop(group_id, None)
        if c is not None:
            c.abort(reason)

    def _can_split(self) -> bool:
        """ncclCommSplit through CuPy: CuPy 14 wraps it; NCCL has it from 2.18.1."""
        if value("AIODIST_NCCL_SPLIT") == "0" or not hasattr(self.nccl.NcclCommunicator, "commSplit"):
            return False
        version = _cupy.nccl_version()
        return version is not None and version >= 21801

    async def new_group(self, parent: ProcessGroupLike, group: ProcessGroupLike | None, group_id: int, members: Sequence[int]) -> None:
        """Every rank of ``parent`` makes a sub-group, in the same order: where the parent has a
        communicator, the sub-group's is split from it (ncclCommSplit; ranks outside the new
        group take part with no color); else the sub-group makes its own on first use."""
        pc = self.comms.get(parent.group_id)
        if pc is None or pc.aborted is not None or not self._can_split():
            return
        child = None
        if group is not None:
            child = self.comms[group_id] = _Comm(self, group, pc.device, split=True)
        color = (group_id & 0x7FFFFFFF) if group is not None else -1  # -1: NCCL_SPLIT_NOCOLOR
        key = list(members).index(self.rank) if group is not None else 0
        pc.split(_SplitJob(child, color, key))

    async def release_group(self, group_id: int) -> None:
        c = self.comms.pop(group_id, None)
        if c is not None:
            await c.close()

    async def close(self) -> None:
        comms, self.comms = list(self.comms.values()), {}
        for c in comms:
            await c.close()

    # -- issuing ------------------------------------------------------------------------------------

    async def issue(self, pg: ProcessGroupLike, op: str, args: dict[str, Any]) -> Any:
        build = BUILDERS.get(op)
        if build is None:
            raise DistBackendError(f"{op} is not supported by the NCCL backend")
        pg.check_usable()
        plan = build(self, pg, args)  # checks everything; raises before anything is enqueued
        if op == "p2p":
            return self._issue_p2p(pg, plan)
        return self._issue(pg, op, plan)

    def _record(self, pg: ProcessGroupLike, what: str, plan: Plan) -> tuple[_Comm, OpRecord]:
        c = self._comm(pg, plan.device if plan.device is not None else self._current_device())
        cupy = self.cupy
        with cupy.cuda.Device(c.device):
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.get_current_stream())  # the op follows the caller's stream
        return c, OpRecord(plan.launch, ready, plan.keep, what, c.device, pg.timeout_s)

    def _issue(self, pg: ProcessGroupLike, op: str, plan: Plan) -> Any:
        c, rec = self._record(pg, f"{op} on {pg.describe()}", plan)
        cupy = self.cupy
        self.ops += 1

        def make_work(name: str, desc: str, seq: int) -> CudaWork:
            rec.what = f"{name} on {desc}, seq {seq}"
            return CudaWork(name, desc, seq, plan.outputs, rec, cupy)

        async def body() -> None:
            await self._run(c, rec)

        return pg.issue_device(op, body, make_work, meta=plan.meta, waiting=lambda: _waiting(c, rec))

    def _issue_p2p(self, pg: ProcessGroupLike, plan: Plan) -> list[Any]:
        """A batch of sends and receives: one grouped NCCL call; one Work per op of the batch,
        each resolved when the whole group call is done (NCCL completes them together)."""
        c, rec = self._record(pg, f"p2p on {pg.describe()}", plan)
        cupy = self.cupy
        self.ops += 1
        shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        works = []
        assert plan.p2p is not None
        for i, (name, tensor, peer) in enumerate(plan.p2p):
            first = i == 0

            def make_work(opname: str, desc: str, seq: int, tensor: Any = tensor, peer: int | None = peer, first: bool = first) -> CudaWork:
                w = CudaWork(opname, desc, seq, [tensor], rec, cupy)
                if opname in ("recv", "irecv") and peer is not None:
                    w._source_rank = pg.ranks[peer]
                if first:
                    rec.what = f"{opname} on {desc}, p2p seq {seq}"
                return w

            async def body(first: bool = first) -> None:
                if first:
                    try:
                        await self._run(c, rec)
                    except BaseException as exc:
                        if not shared.done():
                            shared.set_exception(exc)
                        raise
                    shared.set_result(None)
                else:
                    await asyncio.shield(shared)

            works.append(pg.issue_device(name, body, make_work, meta={"peer": peer}, waiting=lambda: _waiting(c, rec), p2p=True))
        shared.add_done_callback(lambda f: f.exception())
        return works

    @staticmethod
    async def _run(c: _Comm, rec: OpRecord) -> None:
        rec.future = c.loop.create_future()
        c.submit(rec)
        await rec.future


def _waiting(c: _Comm, rec: OpRecord) -> str:
    if c.comm is None:
        return "; the group's NCCL communicator was still being made (not every rank had joined)"
    if not rec.enqueued.is_set():
        return "; the op was still queued for launch behind earlier ops of the group"
    return "; the op was enqueued on the GPU and had not completed (a peer never joined it, or it is still running)"


def create_nccl_backend(opts: BackendOptions, pg_options: Any = None) -> NcclBackend:
    """The creator registered as backend "nccl" (``extended_api=True``)."""
    if pg_options is not None and not isinstance(pg_options, NcclOptions):
        raise TypeError(f"pg_options for the NCCL backend must be aiodist_cuda.NcclOptions, not {type(pg_options).__name__}")
    return NcclBackend(opts.group_rank, opts.group_size, pg_options)
